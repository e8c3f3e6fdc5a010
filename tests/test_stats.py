"""DataLoader.stats(): counts equal to the work done, JSON-able snapshots, and each bottleneck
verdict on a workload built to have that bottleneck (magnitudes with wide margins: a loaded
2-core machine must not change the verdict)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import test_failures

import aloader
from aloader import DataLoader, LoaderStats
from aloader._stats import Collector, Occupancy, Stage


class Fast:
    _inline_fetch = True

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class Sleepy:
    """An async dataset whose fetches wait ``delay`` seconds (latency, no CPU)."""

    def __init__(self, n: int = 40, delay: float = 0.02) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> int:
        await anyio.sleep(self.delay)
        return i


def spin_cpu(seconds: float) -> None:
    """Use ``seconds`` of this thread's CPU (however loaded the machine is)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def spin_wall(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Burning(Fast):
    """A synchronous dataset whose fetches use the CPU (and so hold the GIL)."""

    _inline_fetch = False

    def __getitem__(self, i: int) -> int:
        spin_cpu(0.002)
        return i


class Blocking(Fast):
    """A synchronous dataset whose fetches block without using the CPU."""

    _inline_fetch = False

    def __getitem__(self, i: int) -> int:
        time.sleep(0.005)
        return i


# --- counts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, {"max_concurrency": 3}], ids=["batch", "items"])
@pytest.mark.parametrize("cls", [Fast, Sleepy, Blocking])
def test_counts_equal_the_work_done(cls: Any, kwargs: dict[str, Any]) -> None:
    dl = DataLoader(cls(23), batch_size=5, collate_fn=list, **kwargs)
    delivered = list(dl)
    stats = dl.stats()
    assert stats.batches == len(delivered) == 5
    assert stats.items == sum(map(len, delivered)) == 23
    assert stats.failures == 0
    assert stats.stages["collate"].count == 5
    assert stats.stages["sampling"].count == 5
    assert stats.stages["wait"].count == 5
    assert stats.stages["consumer"].count == 5  # after each batch, until the next ask
    # In-memory datasets fetch a batch per call whatever max_concurrency says.
    item_level = cls is Sleepy or (cls is Blocking and "max_concurrency" in kwargs)
    assert stats.stages["fetch"].count == (23 if item_level else 5)
    assert not stats.running
    assert stats.items_per_second > 0
    assert stats.stages["fetch"].p50 <= stats.stages["fetch"].p90 <= stats.stages["fetch"].p99


def test_counts_with_failures() -> None:
    class Bad(Fast):
        def __getitem__(self, i: int) -> int:
            if i < 5 or i == 7:
                raise ValueError(i)
            return i

    dl = DataLoader(Bad(23), batch_size=5, collate_fn=list, max_failures=6)
    delivered = list(dl)
    stats = dl.stats()
    assert stats.failures == 6
    assert stats.batches == len(delivered) == 4  # batch 0 lost every sample
    assert stats.items == sum(map(len, delivered)) == 17


def test_counts_with_workers() -> None:
    dl = DataLoader(Fast(23), batch_size=5, collate_fn=list, num_workers=2)
    delivered = list(dl)
    stats = dl.stats()
    assert stats.mode == "process"
    assert stats.batches == 5 and stats.items == 23 == sum(map(len, delivered))
    assert stats.stages["fetch"].count == 5  # reported by the workers
    assert stats.stages["collate"].count == 5
    assert stats.stages["transfer"].count == 5
    assert [w["batches"] for w in stats.workers] == [3, 2]


def test_iterable_counts() -> None:
    dl = DataLoader(aloader.as_stream(range(23)), batch_size=5, collate_fn=list)
    assert sum(map(len, dl)) == 23
    stats = dl.stats()
    assert stats.batches == 5 and stats.items == 23


def test_sources_report_their_counters(tmp_path: Path) -> None:
    shard = tmp_path / "a.jsonl"
    shard.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(10)))
    dl = DataLoader(aloader.JsonLines(shard), batch_size=4, collate_fn=list)
    list(dl)
    sources = dl.stats().sources
    assert sources == [{"shards": 1, "records": 10, "bytes": shard.stat().st_size,
                        "skipped": 0, "retries": 0}]


def test_snapshot_is_json_and_of_the_current_epoch() -> None:
    dl = DataLoader(Fast(40), batch_size=4, collate_fn=list)
    assert dl.stats().batches == 0  # before any epoch
    assert dl.stats().bottleneck == "no batch delivered yet"
    it = iter(dl)
    next(it)
    next(it)
    running = dl.stats()
    # Delivered to the for facade, which may be a batch or two ahead of this code.
    assert running.running and 2 <= running.batches <= 4
    list(it)
    done = dl.stats()
    assert not done.running and done.batches == 10 and done.epoch == 0
    data = done.as_dict()
    assert json.loads(json.dumps(data)) == data
    assert set(data["stages"]) == {"sampling", "fetch", "collate", "transfer", "wait",
                                   "consumer"}
    assert isinstance(done, LoaderStats)
    list(dl)
    assert dl.stats().epoch == 1
    assert "bottleneck:" in done.table()


@pytest.mark.anyio
async def test_async_for(anyio_backend: str) -> None:
    dl = DataLoader(Sleepy(12, 0.001), batch_size=4, collate_fn=list)
    assert [b async for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert dl.stats().items == 12


# --- the parts --------------------------------------------------------------------------------
def test_stage_ring_is_bounded() -> None:
    stage = Stage()
    for ns in range(5000):
        stage.add(ns)
        if ns % 100 == 0:
            stage.flush()
    snap = stage.snapshot("fetch")
    assert stage.count == 5000 and stage.busy == sum(range(5000))
    assert len(stage.ring) <= 2048 and not stage.pending
    assert stage.ring[-1] == 4999
    assert snap.p50 == (5000 - 512) / 1e9  # of the last 1024
    assert snap.p50 <= snap.p90 <= snap.p99 <= 5000 / 1e9


def test_occupancy_is_time_weighted() -> None:
    level = Occupancy()
    start = level.start
    level.change(2, start)  # 2 for 10 ns, then 0 for 10 ns
    level.change(-2, start + 10)
    assert level.mean(start + 20) == 1.0
    assert level.peak == 2


def test_worker_report_merges() -> None:
    worker, loader = Collector(), Collector(num_workers=2)
    for ns in (10, 20, 30):
        worker.fetch.add(ns)
    worker.collated([1, 2], 5)
    loader.merge(1, worker.report())
    assert (loader.fetch.count, loader.fetch.busy, loader.items) == (3, 60, 2)
    assert loader.workers[1] == [1, 65]
    loader.merge(1, worker.report())  # nothing new
    assert (loader.fetch.count, loader.fetch.busy, loader.items) == (3, 60, 2)


# --- verdicts ------------------------------------------------------------------------------------
def test_verdict_consumer() -> None:
    dl = DataLoader(Fast(80), batch_size=4, collate_fn=list)
    for _ in dl:
        time.sleep(0.02)  # the consumer's work: far slower than loading
    assert dl.stats().bottleneck.startswith("the consumer: batches are ready before you ask")


@pytest.mark.anyio
async def test_ready_batches_against_prefetch_factor(anyio_backend: str) -> None:
    # `async for` (the for facade reads ahead): 1 ms fetches, 20 ms of consumer's work.
    dl = DataLoader(Sleepy(80, 0.001), batch_size=4, collate_fn=list)
    async for _ in dl:
        await anyio.sleep(0.02)
    stats = dl.stats()
    # The others ready once the consumer took its batch: prefetch_factor - 1 at most.
    assert 0.5 < stats.ready <= stats.ready_limit - 1 == 1
    assert stats.bottleneck.startswith("the consumer: batches are ready before you ask")


def test_verdict_fetch_latency() -> None:
    dl = DataLoader(Sleepy(40, 0.02), batch_size=4, collate_fn=list, max_concurrency=2)
    list(dl)
    stats = dl.stats()
    assert stats.bottleneck == "fetch latency: 2 of 2 fetches in flight, raise max_concurrency"


def test_verdict_collate() -> None:
    def slow_collate(samples: list[int]) -> list[int]:
        spin_wall(0.01)
        return samples

    dl = DataLoader(Fast(80), batch_size=4, collate_fn=slow_collate)
    list(dl)
    verdict = dl.stats().bottleneck
    assert verdict.startswith("collate: ") and verdict.endswith(
        "of one core, pass num_workers or a cheaper collate_fn"), verdict


def test_verdict_gil_bound_sync_dataset() -> None:
    dl = DataLoader(Burning(80), batch_size=4, collate_fn=list)
    list(dl)
    verdict = dl.stats().bottleneck
    assert verdict.startswith("GIL-bound sync dataset: ") and verdict.endswith(
        "use num_workers"), verdict


def test_verdict_blocking_sync_dataset() -> None:
    dl = DataLoader(Blocking(80), batch_size=4, collate_fn=list)
    list(dl)
    verdict = dl.stats().bottleneck
    assert verdict.startswith("blocking sync fetches, one batch call at a time: pass "
                              "max_concurrency"), verdict


class OneSlowWorker(Fast):
    _inline_fetch = False

    def __getitem__(self, i: int) -> int:
        info = aloader.get_worker_info()
        if info is not None and info.id == 1:
            time.sleep(0.01)
        return i


def test_verdict_one_slow_worker() -> None:
    dl = DataLoader(OneSlowWorker(64), batch_size=4, collate_fn=list, num_workers=2)
    list(dl)
    verdict = dl.stats().bottleneck
    assert verdict.startswith("one slow worker: worker 1 takes"), verdict


@pytest.mark.anyio
async def test_an_epoch_left_early_ends_its_statistics(anyio_backend: str) -> None:
    dl = DataLoader(Fast(40), batch_size=4, collate_fn=list)
    count = 0
    async for _ in dl:
        count += 1
        if count == 3:
            break
    first = dl.stats()
    await anyio.sleep(0.05)
    second = dl.stats()
    assert not first.running and first.batches == 3
    assert second.elapsed == first.elapsed  # ended at the last batch, not still counting


class BigObjects(Fast):
    """Each sample a large list of Python ints: nothing to fetch, much to pickle across."""

    _inline_fetch = False

    def __init__(self, n: int = 32) -> None:
        super().__init__(n)
        self.big = list(range(200_000))

    def __getitem__(self, i: int) -> Any:
        return self.big


def test_verdict_transfer_from_workers() -> None:
    dl = DataLoader(BigObjects(32), batch_size=4, collate_fn=list, num_workers=2)
    assert sum(1 for _ in dl) == 8
    verdict = dl.stats().bottleneck
    assert verdict.startswith("transfer from workers: batches take long to come back"), verdict


class CpuBound(Fast):
    _inline_fetch = False

    def __getitem__(self, i: int) -> int:
        spin_cpu(0.02)
        return i


def test_verdict_the_workers_raise_num_workers() -> None:
    dl = DataLoader(CpuBound(64), batch_size=4, collate_fn=list, num_workers=2)
    list(dl)
    stats = dl.stats()
    assert stats.bottleneck.startswith(f"the workers: {stats.in_flight_limit} of "
                                       f"{stats.in_flight_limit} batches in flight on 2 "
                                       "workers; raise num_workers"), stats.bottleneck


class SlowIterable:
    """An iterable dataset whose iterator waits 20 ms per sample (sync or async)."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __iter__(self) -> Any:
        for i in range(self.n):
            time.sleep(0.02)
            yield i


class SlowAsyncIterable(SlowIterable):
    async def __aiter__(self) -> Any:
        for i in range(self.n):
            await anyio.sleep(0.02)
            yield i


@pytest.mark.parametrize("make", [SlowIterable, SlowAsyncIterable,
                                  lambda: aloader.as_stream(SlowIterable())],
                         ids=["sync", "async", "stream"])
def test_verdict_the_datasets_iterator(make: Any) -> None:
    # One pull at a time whatever max_concurrency says: the verdict must not ask to raise it.
    dl = DataLoader(make(), batch_size=4, collate_fn=list)
    assert sum(map(len, dl)) == 40
    verdict = dl.stats().bottleneck
    assert verdict.startswith("the dataset's iterator: pulling its samples took"), verdict


class TupleItems(Fast):
    """``__getitems__`` returning a tuple (any sequence will do, as for torch)."""

    def __getitems__(self, indices: list[int]) -> tuple[int, ...]:
        return tuple(indices)


class ListSamples(Fast):
    def __getitem__(self, i: int) -> list[int]:
        return [i, i, i]  # one sample that is a list: still one item


@pytest.mark.parametrize("workers", [0, 2], ids=["local", "workers"])
def test_items_are_samples_whatever_the_batch_type(workers: int) -> None:
    arrays = aloader.ArrayDataset(np.zeros((23, 3), dtype=np.float32))
    cases = [(arrays, 5, None, 23, 5), (TupleItems(23), 5, list, 23, 5),
             (ListSamples(7), None, None, 7, 7)]
    for dataset, batch_size, collate, items, batches in cases:
        kwargs: dict[str, Any] = {} if collate is None else {"collate_fn": collate}
        dl = DataLoader(dataset, batch_size=batch_size, num_workers=workers, **kwargs)
        assert sum(1 for _ in dl) == batches
        stats = dl.stats()
        assert (stats.items, stats.batches) == (items, batches), type(dataset).__name__


# --- failures and sources in the counts -----------------------------------------------------
FAILURE_KINDS = [*test_failures.KINDS,
                 *(pytest.param(cls, {"num_workers": 2}, id=f"workers-{cls.__name__}")
                   for cls in (test_failures.Sync, test_failures.Async, test_failures.GetItems)),
                 pytest.param(test_failures.Iterating, {}, id="iterable")]


@pytest.mark.parametrize(("cls", "kwargs"), FAILURE_KINDS)
def test_counts_with_failures_in_every_mode(cls: Any, kwargs: dict[str, Any]) -> None:
    dl = DataLoader(cls(), batch_size=4, collate_fn=list, max_failures=6, **kwargs)
    delivered = list(dl)
    stats = dl.stats()
    assert stats.failures == 6  # of the 20 samples, 6 fail
    assert stats.batches == len(delivered)
    assert stats.items == sum(map(len, delivered)) == 14
    data = stats.as_dict()
    assert json.loads(json.dumps(data)) == data


def test_stream_counters_skipped_and_retries(tmp_path: Path) -> None:
    from faulty_server import FaultyServer

    good = "".join(json.dumps({"i": i}) + "\n" for i in range(6))
    files = {"a.jsonl": (good + "{not json\n" + good).encode()}
    server = FaultyServer(files).start()
    try:
        server.fail("a.jsonl", 503, times=2)
        source = aloader.JsonLines(server.urls, skip_errors=True, retries=3, backoff=0.01,
                                   max_backoff=0.05)
        dl = DataLoader(source, batch_size=4, collate_fn=list, max_failures=1)
        assert sum(map(len, dl)) == 12
    finally:
        server.close()
    stats = dl.stats()
    assert stats.sources == [{"shards": 1, "records": 12, "bytes": len(files["a.jsonl"]),
                              "skipped": 1, "retries": 2}]
    assert stats.failures == 1  # the skipped record, within the budget


def test_stream_counters_from_workers(tmp_path: Path) -> None:
    shards = []
    for k in range(4):
        shard = tmp_path / f"{k}.jsonl"
        shard.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(10)))
        shards.append(shard)
    dl = DataLoader(aloader.JsonLines(shards), batch_size=4, collate_fn=list, num_workers=2)
    assert sum(map(len, dl)) == 40
    stats = dl.stats()
    assert stats.sources == [{"shards": 4, "records": 40,
                              "bytes": sum(s.stat().st_size for s in shards),
                              "skipped": 0, "retries": 0}]
    assert stats.items == 40 and sum(w["batches"] for w in stats.workers) == stats.batches
    assert stats.stages["transfer"].count == stats.batches  # not the replicas' ends
    data = stats.as_dict()
    assert json.loads(json.dumps(data)) == data and len(data["workers"]) == 2


def test_items_so_far_counts_what_is_not_folded_yet() -> None:
    stats = Collector()
    for _ in range(3):
        stats.collated([1, 2, 3], 10)
    assert stats.items_so_far() == 9  # before any fold (a live progress line reads this)
    stats.flush()
    assert (stats.items, stats.items_so_far()) == (9, 9)
