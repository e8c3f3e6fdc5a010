"""The two epoch kinds (aloader.loader._epochs) and the one place that plans fetches
(FetchPlan.for_dataset in aloader.pipeline._plan)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aloader
from aloader.loader._epochs import IterableEpochs, MapEpochs
from aloader.pipeline._epoch import IterableEpoch, MapEpoch
from aloader.pipeline._plan import DEFAULT_MAX_CONCURRENCY, FetchPlan
from aloader.pipeline._results import Results
from aloader.workers._pool_epoch import MapPoolEpoch, ReplicaPoolEpoch
from aloader.workers._worker import ServeReplica, ServeTasks


class Plain(aloader.Dataset[int]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> int:
        return index


class Batched(Plain):
    def __getitems__(self, indices: list[int]) -> list[int]:
        return list(indices)


class Async(Plain):
    async def __getitem__(self, index: int) -> int:  # type: ignore[override]
        return index


class Stream(aloader.IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(7))

    def __len__(self) -> int:
        return 7


class AsyncStream(aloader.IterableDataset[int]):
    async def __aiter__(self) -> Any:
        yield 1


def test_the_loader_picks_its_epoch_kind_once() -> None:
    loader = aloader.DataLoader(Plain(), batch_size=4)
    assert isinstance(loader._kind, MapEpochs)
    assert loader._kind.index_sampler is loader.batch_sampler is loader._index_sampler
    assert loader._kind.serve == ServeTasks()
    assert loader._kind.pool_epoch is MapPoolEpoch
    unbatched = aloader.DataLoader(Plain(), batch_size=None)
    assert isinstance(unbatched._kind, MapEpochs)
    assert unbatched._kind.index_sampler is unbatched.sampler
    assert not unbatched._auto_collation
    stream = aloader.DataLoader(Stream(), batch_size=3, drop_last=True)
    assert isinstance(stream._kind, IterableEpochs)
    assert stream._kind.serve == ServeReplica(3, True)
    assert stream._kind.pool_epoch is ReplicaPoolEpoch
    assert stream.sampler is None and stream.batch_sampler is None


def test_iterable_kind_remembers_the_length_it_reported() -> None:
    kind = IterableEpochs(Stream(), 3, drop_last=False)
    assert kind.reported_length() is None
    assert kind.length() == 3
    assert kind.reported_length() == 7
    assert MapEpochs(range(5), None).reported_length() is None
    assert MapEpochs(range(5), None).length() == 5


def test_each_kind_builds_its_own_epoch() -> None:
    results = Results(2, True)
    map_plan = FetchPlan.for_dataset([1, 2, 3], iterable=False, auto_batch=False,
                                     collate_fn=lambda x: x, batch_size=None,
                                     max_concurrency=None)
    assert isinstance(MapEpochs(range(3), None).local(map_plan, results, iter(range(3))),
                      MapEpoch)
    iter_plan = FetchPlan.for_dataset(Stream(), iterable=True, auto_batch=True,
                                      collate_fn=list, batch_size=2, max_concurrency=None)
    assert isinstance(IterableEpochs(Stream(), 2, False).local(iter_plan, results),
                      IterableEpoch)


def _plan(dataset: Any, *, iterable: bool = False, batch_size: int | None = 4,
          max_concurrency: int | None = None) -> tuple[str, str, int, int]:
    plan = FetchPlan.for_dataset(dataset, iterable=iterable, auto_batch=batch_size is not None,
                                 collate_fn=list, batch_size=batch_size,
                                 max_concurrency=max_concurrency)
    return plan.mode, plan.granularity, plan.concurrency, plan.window


@pytest.mark.parametrize(
    ("dataset", "kwargs", "expected"),
    [
        # in memory: inline, one job at a time
        ([1, 2, 3], {}, ("inline", "job", 1, 1)),
        (np.arange(10), {"max_concurrency": 8}, ("inline", "job", 3, 3)),
        # synchronous: a batch per thread call, or items in threads with max_concurrency
        (Plain(), {}, ("thread", "job", 1, 1)),
        (Plain(), {"max_concurrency": 8}, ("thread", "item", 8, 3)),
        (Batched(), {"max_concurrency": 8}, ("thread", "job", 3, 3)),
        # async: items on the loop, whole batches through an async-free __getitems__ window
        (Async(), {}, ("async", "item", DEFAULT_MAX_CONCURRENCY, 17)),
        (Async(), {"max_concurrency": 8, "batch_size": None}, ("async", "item", 8, 9)),
        # iterable: one batch at a time
        (Stream(), {"iterable": True}, ("thread", "job", 1, 1)),
        (AsyncStream(), {"iterable": True}, ("async", "job", DEFAULT_MAX_CONCURRENCY, 1)),
    ],
)
def test_for_dataset_decides_mode_granularity_concurrency_and_window(
    dataset: Any, kwargs: dict[str, Any], expected: tuple[str, str, int, int]
) -> None:
    assert _plan(dataset, **kwargs) == expected


def test_a_process_plan_sends_whole_jobs_prefetch_factor_per_worker() -> None:
    remote: Any = object()
    plan = FetchPlan.for_dataset(Plain(), iterable=False, auto_batch=True, collate_fn=list,
                                 batch_size=4, max_concurrency=None, remote=remote,
                                 num_workers=3, prefetch_factor=2)
    assert (plan.mode, plan.granularity, plan.concurrency, plan.window) == ("process", "job", 6, 6)
    assert plan.remote is remote


def test_the_worker_asks_the_plan_whether_it_needs_an_event_loop() -> None:
    def plan(dataset: Any, collate: Any = list, **kwargs: Any) -> FetchPlan:
        return FetchPlan.for_dataset(dataset, iterable=False, auto_batch=True,
                                     collate_fn=collate, batch_size=4, **kwargs)

    async def async_collate(samples: Any) -> Any:
        return samples

    assert not plan(Plain(), max_concurrency=None).needs_event_loop
    assert not plan([1, 2], max_concurrency=None).needs_event_loop
    assert plan(Plain(), max_concurrency=4).needs_event_loop  # item fetches overlap
    assert plan(Async(), max_concurrency=None).needs_event_loop
    assert plan(Plain(), async_collate, max_concurrency=None).needs_event_loop
