"""Ray Train with aloader: a TorchTrainer whose workers load their Ray Data shard with aloader.

Ray Data prepares the rows (here a small synthetic regression set, mapped by a Ray task); Ray
Train starts the workers and their process group; in each worker, ``aloader.from_ray`` turns
the worker's shard into a stream, and an ``aloader.DataLoader`` batches it, as it would batch
files. The loader's state goes into each epoch's Ray checkpoint beside the model's, so a
restarted run resumes the loader where it was.

Run it (``pip install "aloader[ray,torch]"``)::

    python examples/ray_train.py            # 2 CPU workers, on a local Ray instance

The test suite runs :func:`main` on small data (``tests/compat/test_ray_train.py``).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def make_dataset(rows: int) -> Any:
    """``y = 3x + 1`` with ``x`` in [0, 1), prepared by Ray Data (a map on Ray's workers)."""
    import ray.data

    return ray.data.range(rows).map(
        lambda row: {"id": row["id"], "x": row["id"] / rows, "y": 3.0 * row["id"] / rows + 1.0})


def train_loop(config: dict[str, Any]) -> None:
    """What each Ray Train worker runs: its shard through aloader, into a DDP model."""
    import ray.train
    import torch
    from ray.train.torch import prepare_model

    import aloader

    shard = ray.train.get_dataset_shard("train")
    loader = aloader.DataLoader(aloader.from_ray(shard), batch_size=config["batch_size"])
    model = prepare_model(torch.nn.Linear(1, 1))  # DDP over the workers' gloo group
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # a restarted run: the model, and the loader where it was
        with checkpoint.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "model.pt"))
            model.load_state_dict(saved["model"])
            start = saved["epoch"] + 1
            rank = ray.train.get_context().get_world_rank()
            with open(os.path.join(folder, f"loader-{rank}.json")) as file:
                loader.load_state_dict(json.load(file))
    for epoch in range(start, config["epochs"]):
        ids: list[int] = []
        total = 0.0
        for batch in loader:
            x = torch.as_tensor(batch["x"], dtype=torch.float32).reshape(-1, 1)
            y = torch.as_tensor(batch["y"], dtype=torch.float32).reshape(-1, 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(x)
            ids.extend(int(i) for i in batch["id"])
        context = ray.train.get_context()
        with tempfile.TemporaryDirectory() as folder:
            # Every worker writes its loader's state; rank 0 the model too.
            rank = context.get_world_rank()
            with open(os.path.join(folder, f"loader-{rank}.json"), "w") as file:
                json.dump(loader.state_dict(), file)
            if rank == 0:
                torch.save({"model": model.state_dict(), "epoch": epoch},
                           os.path.join(folder, "model.pt"))
            ray.train.report({"epoch": epoch, "loss": total / max(1, len(ids))},
                             checkpoint=ray.train.Checkpoint.from_directory(folder))
        if config.get("record"):  # the rows each worker saw, for the test suite's checks
            with open(os.path.join(config["record"], f"{epoch}-{rank}.json"), "w") as file:
                json.dump(ids, file)


def main(rows: int = 512, epochs: int = 2, workers: int = 2, storage: str | None = None,
         record: str | None = None) -> Any:
    """Train on ``rows`` rows for ``epochs`` epochs on ``workers`` CPU workers; the result.

    Ray must be initialized (``ray.init``) or is started locally by Ray Train. ``record``: a
    folder where each worker writes the row ids it saw in each epoch (``{epoch}-{rank}.json``).
    """
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"batch_size": 32, "lr": 0.5, "epochs": epochs, "record": record},
        # Half a CPU each leaves room for Ray Data's own tasks on a small machine.
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False,
                                     resources_per_worker={"CPU": 0.5}),
        datasets={"train": make_dataset(rows)},
        run_config=RunConfig(storage_path=storage or tempfile.mkdtemp(prefix="ray-train-")),
    )
    return trainer.fit()


if __name__ == "__main__":
    result = main()
    print("final metrics:", result.metrics)
