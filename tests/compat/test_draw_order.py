"""A sync ``for`` without workers draws and fetches where torch's loader does, run after run.

torch's loader without workers fetches each batch inside ``next()``, on the consumer's thread,
and draws its sampler's epoch at the first ``next()``. A training script relies on that: what
its dataset draws from the global ``random`` (or numpy's, torch's) generator interleaves with
what the training step draws (dropout) in one fixed order, and two loaders sharing one
generator draw from it in the consumer's order. Fetched ahead in a thread, or drawn on a
background loop, both orders became a race: other augmentations, other batches, per run.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import aloader
from aloader.loader._start import epoch_seed


class Augmented:
    """A map-style dataset whose samples draw from the global ``random``, as torch's do."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> float:
        return index + random.random()


class AugmentedStream(aloader.IterableDataset[float]):
    def __iter__(self) -> Iterator[float]:
        for index in range(40):
            yield index + random.random()


def _training(loader: Any) -> list[float]:
    random.seed(7)
    out = []
    for _ in range(2):
        for batch in loader:
            out += [round(float(x), 9) for x in batch]
            out.append(random.random())  # the training step's own draw (dropout, say)
    return out


def _sequential() -> list[float]:
    """What torch's loader gives: each batch fetched in its next(), then the step's draw."""
    random.seed(7)
    out = []
    for _ in range(2):
        for start in range(0, 40, 8):
            out += [round(i + random.random(), 9) for i in range(start, start + 8)]
            out.append(random.random())
    return out


@pytest.mark.parametrize("dataset", [Augmented, AugmentedStream])
def test_global_draws_of_a_dataset_interleave_with_the_consumers_in_torchs_order(
        dataset: Any) -> None:
    expected = _sequential()
    for _ in range(3):
        assert _training(aloader.DataLoader(dataset(), batch_size=8)) == expected


def test_max_concurrency_still_fetches_ahead_in_threads() -> None:
    # Asked for concurrent fetches, the user gets them (and the draws' order is theirs).
    loader = aloader.DataLoader(Augmented(), batch_size=8, max_concurrency=4)
    iterator = iter(loader)
    next(iterator)
    assert not isinstance(iterator._open(), aloader._facade.LocalIterator)
    iterator.close()


class AsyncRange:
    def __len__(self) -> int:
        return 30

    async def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize("make", [lambda: list(range(30)), AsyncRange],
                         ids=["in memory", "async (a background loop)"])
def test_two_loaders_sharing_a_generator_side_by_side(make: Any) -> None:
    def run() -> list[Any]:
        generator = np.random.default_rng(3)
        a = aloader.DataLoader(make(), batch_size=4, shuffle=True, generator=generator)
        b = aloader.DataLoader(make(), batch_size=4, shuffle=True, generator=generator)
        return [(x.tolist(), y.tolist()) for _ in range(3) for x, y in zip(a, b, strict=True)]

    # The draws in the consumer's order: iter(a) and iter(b) draw their base seeds, the first
    # next() of each its permutation, as torch's loaders without workers do.
    def expected() -> list[Any]:
        generator = np.random.default_rng(3)
        out = []
        for _ in range(3):
            seeds = [epoch_seed(aloader.DataLoader([0], generator=generator)) for _ in "ab"]
            assert all(drawn for _, drawn in seeds)
            orders = [aloader.RandomSampler(range(30), generator=generator) for _ in "ab"]
            a, b = (list(iter(o)) for o in orders)
            out += [(a[k:k + 4], b[k:k + 4]) for k in range(0, 30, 4)]
        return out

    first = run()
    assert first == run() == run()
    assert first == expected()
