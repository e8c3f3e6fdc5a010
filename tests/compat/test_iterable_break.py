"""Persistent workers over an ``IterableDataset``, epochs left with a ``break``: torch's
workers have drawn exactly the batches torch had asked of them (``prefetch_factor`` per
worker, plus one per batch taken), then start a new iterator; what a worker's global RNGs
(``random``, numpy's, torch's) give in the next epoch follows from that, so aloader's must
give the same (README: after a ``break``, persistent workers' generators are where torch's
would be), run after run, however far ahead its workers ran or however little.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest

import aloader

torch = pytest.importorskip("torch")
tud = torch.utils.data


class Draws(tud.IterableDataset):  # type: ignore[misc]
    """Each sample: its number, and a draw from each global RNG of the worker."""

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        for i in range(info.id, 60, info.num_workers):
            yield i, random.getrandbits(30), int(np.random.randint(2**30)), int(
                torch.randint(2**30, ()))


# A consumer that pauses after each batch lets aloader's workers run ahead of torch's window
# (their draws must be put back); one that breaks at once may leave requests torch had sent
# unsent (they must still run). Each epoch breaks at another step, the last runs to the end.
@pytest.mark.parametrize(("pause", "stops", "batch_size", "prefetch"), [
    (0.0, (0, 3, None), 3, 2),
    (0.02, (4, 1, None), None, 1),
])
def test_persistent_iterable_workers_after_a_break_draw_what_torchs_draw(
        pause: float, stops: tuple[int | None, ...], batch_size: int | None,
        prefetch: int) -> None:
    def run(module: Any) -> list[Any]:
        loader = module.DataLoader(Draws(), batch_size=batch_size, num_workers=2,
                                   prefetch_factor=prefetch,
                                   generator=torch.Generator().manual_seed(3),
                                   persistent_workers=True)
        out = []
        for stop in stops:
            for step, batch in enumerate(loader):
                out.append([int(field) for field in batch] if batch_size is None
                           else [field.tolist() for field in batch])
                if step == stop:
                    break
                if stop is not None:  # lets the workers run ahead; asserts nothing on timing
                    time.sleep(pause)
        return out

    assert run(aloader) == run(tud)
