"""A torch training loop that checkpoints its model, optimizer and data loader, and resumes.

The loader's ``state_dict()`` is saved beside the model's every ``--save-every`` steps; a run
started again with the same ``--checkpoint`` resumes where the checkpoint was taken: the rest
of the interrupted epoch, then the later epochs, with exactly the batches (and augmentations)
the uninterrupted run would have had, whatever ``--num-workers`` each run uses. Try it::

    python examples/train_checkpoint.py --checkpoint /tmp/ckpt.pt --kill-at-step 25
    python examples/train_checkpoint.py --checkpoint /tmp/ckpt.pt     # resumes at step 20

``--kill-at-step N`` kills the process with SIGKILL after step ``N`` (no cleanup, as a
preempted machine); ``--record FILE`` writes one JSON line per step with the sample indices of
its batch, to compare runs. Needs torch (``pip install "aloader[torch]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

import aloader

FEATURES = 8


class Regression(aloader.Dataset[tuple[npt.NDArray[np.float32], np.float32, int]]):
    """``n`` noisy samples of a linear function; each sample jittered by its own random
    stream (``aloader.sample_rng``), so the augmentation survives a resume unchanged."""

    def __init__(self, n: int = 512, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        true_weights = rng.normal(size=FEATURES).astype(np.float32)
        self.y = (self.x @ true_weights + 0.1 * rng.normal(size=n)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[npt.NDArray[np.float32], np.float32, int]:
        jitter = aloader.sample_rng().normal(scale=0.01, size=FEATURES).astype(np.float32)
        return self.x[index] + jitter, self.y[index], index


def save(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` atomically: a kill during the write leaves the previous checkpoint."""
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="the checkpoint file: resumed from when it exists")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--kill-at-step", type=int, default=None,
                        help="SIGKILL this process after that step (to try resuming)")
    parser.add_argument("--record", type=Path, default=None,
                        help="append each step's sample indices to this file (JSON lines)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = aloader.DataLoader(Regression(), batch_size=args.batch_size, shuffle=True,
                                generator=0, num_workers=args.num_workers)
    step = 0
    if args.checkpoint.exists():
        checkpoint = torch.load(args.checkpoint)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loader.load_state_dict(checkpoint["loader"])
        step = checkpoint["step"]
    epoch = loader.state_dict()["epoch"]  # the epoch the loader yields next
    if step:
        print(f"resumed at step {step}, in epoch {epoch}")
    record = args.record.open("a") if args.record is not None else None

    while epoch < args.epochs:
        for x, y, indices in loader:
            loss = torch.nn.functional.mse_loss(model(torch.from_numpy(x)).squeeze(1),
                                                torch.from_numpy(y))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if record is not None:
                record.write(json.dumps({"step": step, "indices": indices.tolist()}) + "\n")
                record.flush()
            if step % args.save_every == 0:
                save(args.checkpoint, {"model": model.state_dict(),
                                       "optimizer": optimizer.state_dict(),
                                       "loader": loader.state_dict(),
                                       "step": step})
            if step == args.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
        epoch += 1
        print(f"epoch {epoch}: step {step}, loss {loss.item():.4f}")
    weights = model.weight.detach().numpy().ravel()
    print("final weights", " ".join(f"{w:.6f}" for w in weights))
    loader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
