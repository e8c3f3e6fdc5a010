"""Objects that are their own iterator (``__iter__`` resets the position and returns ``self``,
or ``__aiter__`` does): every loop over one takes its iterator once per epoch, so it is never
started over in the middle of an epoch and its ``__iter__`` / ``__aiter__`` runs once."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from aloader import BatchSampler, ChainDataset, IterableDataset, Sampler


class Counting(IterableDataset[int]):
    """Yields ``0..n-1``; ``__iter__`` resets, counts its calls and returns ``self``."""

    def __init__(self, n: int) -> None:
        self.n, self.i, self.calls = n, 0, 0

    def __iter__(self) -> Any:
        self.calls += 1
        self.i = 0
        return self

    def __next__(self) -> int:
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self.i - 1


class ACounting(IterableDataset[int]):
    """:class:`Counting` with ``__aiter__`` / ``__anext__``."""

    def __init__(self, n: int) -> None:
        self.n, self.i, self.calls = n, 0, 0

    def __aiter__(self) -> Any:
        self.calls += 1
        self.i = 0
        return self

    async def __anext__(self) -> int:
        if self.i >= self.n:
            raise StopAsyncIteration
        self.i += 1
        return self.i - 1


class CountingSampler(Counting, Sampler[int]):
    def __len__(self) -> int:
        return self.n


class ACountingSampler(ACounting):  # (Sampler's __iter__ would raise NotImplementedError)
    def __len__(self) -> int:
        return self.n


def test_batch_sampler_over_a_self_returning_sampler_ends() -> None:
    sampler = CountingSampler(7)
    batches = list(itertools.islice(BatchSampler(sampler, 3, False), 20))
    assert batches == [[0, 1, 2], [3, 4, 5], [6]]
    assert sampler.calls == 1


def test_batch_sampler_with_drop_last_asks_as_torchs_zip_does() -> None:
    # torch's drop_last loop zips batch_size references to the sampler's iterator: zip takes
    # iter() of each once, before the first index (a self-returning sampler: 1 + batch_size).
    sampler = CountingSampler(7)
    assert list(BatchSampler(sampler, 3, True)) == [[0, 1, 2], [3, 4, 5]]
    assert sampler.calls == 4


def test_batch_sampler_resumed_over_a_self_returning_sampler() -> None:
    sampler = CountingSampler(7)
    assert list(itertools.islice(BatchSampler(sampler, 2, False)._generic_batches(3), 20)) == [
        [3, 4], [5, 6]]
    assert sampler.calls == 1


def test_async_batch_sampler_takes_its_samplers_iterator_once() -> None:
    sampler = ACountingSampler(5)

    async def run() -> list[list[int]]:
        return [batch async for batch in BatchSampler(sampler, 2, False)]

    assert asyncio.run(run()) == [[0, 1], [2, 3], [4]]
    assert sampler.calls == 1


@pytest.mark.parametrize("use_async", [False, True])
def test_chain_takes_each_childs_iterator_once(use_async: bool) -> None:
    children = [Counting(3), Counting(2)]
    chain = ChainDataset(children)
    if use_async:
        async def run() -> list[int]:
            return [item async for item in chain]

        items = asyncio.run(run())
    else:
        items = list(chain)
    assert items == [0, 1, 2, 0, 1]
    assert [child.calls for child in children] == [1, 1]
