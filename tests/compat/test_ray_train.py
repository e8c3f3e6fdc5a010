"""aloader.from_ray against a local Ray (``ray.init(num_cpus=2)``): a Dataset, the parts of a
``streaming_split``, and Ray Train's TorchTrainer on 2 CPU workers running
examples/ray_train.py, whose workers load their shard through aloader.

Skipped where Ray is not installed (``pip install "aloader[ray]"``); one Ray instance serves
the module (starting it costs seconds). Ray's processes stay on this machine.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

import aloader  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# A hang guard (seconds), never a timing assertion: Ray Train alone takes tens of seconds on
# two busy cores.
GUARD = 280


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # Ray's workers import the example and aloader from the paths the driver has.
    saved = os.environ.get("PYTHONPATH")
    paths = [str(EXAMPLES), str(EXAMPLES.parent), *([saved] if saved else [])]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def ids(batches: list[Any]) -> list[int]:
    return [int(i) for batch in batches for i in batch["id"]]


@pytest.mark.timeout(GUARD)
def test_a_dataset_every_row_once_and_resume_by_counting(local_ray: None) -> None:
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # Ray's order repeats: counting is exact
    try:
        dataset = ray.data.range(300, override_num_blocks=6).map(
            lambda row: {"id": row["id"], "square": row["id"] ** 2})
        loader = aloader.DataLoader(aloader.from_ray(dataset), batch_size=32)
        full = list(loader)
        assert ids(full) == list(range(300))
        assert full[1]["square"].tolist() == [i * i for i in range(32, 64)]
        iterator = iter(loader)
        for _ in range(3):
            next(iterator)
        state = json.loads(json.dumps(loader.state_dict()))
        iterator.close()
        resumed = aloader.DataLoader(aloader.from_ray(dataset), batch_size=32)
        resumed.load_state_dict(state)
        assert ids(list(resumed)) == ids(full[3:])
    finally:
        context.execution_options.preserve_order = False


@pytest.mark.timeout(GUARD)
def test_the_parts_of_a_streaming_split(local_ray: None) -> None:
    parts = ray.data.range(400, override_num_blocks=8).streaming_split(2, equal=True)
    seen: list[list[int]] = [[], []]
    errors: list[BaseException] = []

    def consume(k: int) -> None:  # Ray needs every part consumed at once
        try:
            for batch in aloader.DataLoader(aloader.from_ray(parts[k]), batch_size=25):
                seen[k].extend(int(i) for i in batch["id"])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GUARD - 30)
    assert not errors, errors
    assert sorted(seen[0] + seen[1]) == list(range(400))
    assert len(seen[0]) == len(seen[1]) == 200  # equal=True


@pytest.mark.timeout(GUARD)
def test_ray_train_torch_trainer_example(local_ray: None, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("ray.train")
    import sys

    sys.path.insert(0, str(EXAMPLES))
    try:
        import ray_train  # examples/ray_train.py
    finally:
        sys.path.remove(str(EXAMPLES))

    record = tmp_path / "record"
    record.mkdir()
    result = ray_train.main(rows=256, epochs=2, workers=2, storage=str(tmp_path / "runs"),
                            record=str(record))
    assert result.error is None
    assert result.metrics["epoch"] == 1
    assert result.metrics["loss"] < 1.0
    for epoch in range(2):
        parts = [json.loads((record / f"{epoch}-{rank}.json").read_text()) for rank in (0, 1)]
        assert len(parts[0]) == len(parts[1]) == 128  # Ray Train's equal split
        assert sorted(parts[0] + parts[1]) == list(range(256))
    checkpoint = Path(result.checkpoint.path)
    for rank in (0, 1):  # each worker's loader state, between epochs: it resumes anywhere
        state = json.loads((checkpoint / f"loader-{rank}.json").read_text())
        assert state["iterable"]["mode"] == "between"
        assert state["epoch"] == 2
