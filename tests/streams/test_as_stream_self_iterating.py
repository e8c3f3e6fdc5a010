"""``as_stream``, ``mix`` and ``interleave`` over objects that are their own iterator
(``__iter__`` / ``__aiter__`` resets and returns ``self``): each epoch takes the iterator once,
so an epoch longer than one read-ahead block ends after its items, and the next starts over."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from test_self_iterating import ACounting, Counting

import aloader

pytestmark = pytest.mark.anyio

# More items than one read-ahead block of a wrapped iterable (a `for` per block).
N = 600


def test_as_stream_of_a_self_returning_iterable_ends() -> None:
    data = Counting(N)
    stream = aloader.as_stream(data)
    for _ in range(2):
        assert list(itertools.islice(stream, 3 * N)) == list(range(N))
    assert data.calls == 2


async def test_as_stream_of_a_self_returning_async_iterable(anyio_backend: str) -> None:
    data = ACounting(5)
    stream = aloader.as_stream(data)
    assert [item async for item in stream] == list(range(5))
    assert data.calls == 1


def test_mix_and_interleave_of_self_returning_iterables_end() -> None:
    mixed = aloader.mix([Counting(N), Counting(N)], [1.0, 1.0], seed=0, stop="all_exhausted")
    assert sorted(itertools.islice(mixed, 5 * N)) == sorted(list(range(N)) * 2)
    woven = aloader.interleave(Counting(N), Counting(3))
    assert sorted(itertools.islice(woven, 5 * N)) == sorted([*range(N), *range(3)])


def test_interleave_refuses_a_list_of_iterable_datasets_as_one_input() -> None:
    with pytest.raises(TypeError, match="separate arguments"):
        aloader.interleave([Counting(3), Counting(2)])


def test_loader_over_as_stream_of_a_self_returning_iterable() -> None:
    loader = aloader.DataLoader(aloader.as_stream(Counting(N)), batch_size=256)
    sizes: list[Any] = [len(batch) for batch in itertools.islice(loader, 20)]
    assert sizes == [256, 256, N - 512]
