"""The loader over datasets and samplers that are their own iterator (``__iter__`` or
``__aiter__`` resets the position and returns ``self``): each epoch takes the iterator once
(per replica), a resumed epoch too, so no epoch starts over in its middle. torch's contract,
checked batch for batch against torch, is in tests/compat/test_iterator_shapes.py."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from test_self_iterating import ACounting, ACountingSampler, Counting

import aloader

pytestmark = pytest.mark.anyio


def _lists(batches: Any) -> list[Any]:
    return [batch.tolist() for batch in itertools.islice(batches, 50)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumed_epoch_of_a_self_returning_dataset_goes_on(num_workers: int) -> None:
    loader = aloader.DataLoader(Counting(10), batch_size=3, num_workers=num_workers)
    epoch = iter(loader)
    first = next(epoch).tolist()
    state = loader.state_dict()
    rest = _lists(epoch)
    resumed = aloader.DataLoader(Counting(10), batch_size=3, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert _lists(resumed) == rest
    if num_workers == 0:
        assert [first, *rest] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


async def test_async_self_returning_dataset(anyio_backend: str) -> None:
    data = ACounting(10)
    loader = aloader.DataLoader(data, batch_size=3)
    for _ in range(2):
        assert [batch.tolist() async for batch in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8],
                                                               [9]]
    assert data.calls == 2


async def test_async_self_returning_sampler_resumed(anyio_backend: str) -> None:
    data = list(range(0, 100, 10))
    loader = aloader.DataLoader(data, sampler=ACountingSampler(10), batch_size=3)
    epoch = loader.__aiter__()
    assert (await epoch.__anext__()).tolist() == [0, 10, 20]
    state = loader.state_dict()
    await epoch.aclose()
    sampler = ACountingSampler(10)
    resumed = aloader.DataLoader(data, sampler=sampler, batch_size=3)
    resumed.load_state_dict(state)
    assert [batch.tolist() async for batch in resumed] == [[30, 40, 50], [60, 70, 80], [90]]
    assert sampler.calls == 1


def test_failure_budget_over_a_self_returning_sampler() -> None:
    class Data(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: int) -> int:
            if index == 4:
                raise ValueError("bad sample")
            return index

    from test_self_iterating import CountingSampler
    loader = aloader.DataLoader(Data(), sampler=CountingSampler(10), batch_size=3,
                                max_failures=1)
    assert _lists(loader) == [[0, 1, 2], [3, 5], [6, 7, 8], [9]]
