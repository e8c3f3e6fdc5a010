"""DataLoader.stats(): counts equal to the work done, JSON-able snapshots, and each bottleneck
verdict on a workload built to have that bottleneck (magnitudes with wide margins: a loaded
2-core machine must not change the verdict)."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import test_failures

import aloader
from aloader import DataLoader, LoaderStats
from aloader._stats import Collector, Occupancy, Stage, StageStats


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
    stats = dl.stats()
    assert stats.bottleneck.startswith("collate: ") and stats.bottleneck.endswith(
        f"of one core, {_workers_advice(stats.cores, 'pass')} or a cheaper collate_fn"), \
        stats.bottleneck


def test_verdict_gil_bound_sync_dataset() -> None:
    dl = DataLoader(Burning(80), batch_size=4, collate_fn=list)
    list(dl)
    stats = dl.stats()
    assert stats.bottleneck.startswith("GIL-bound sync dataset: ") and \
        stats.bottleneck.endswith(_workers_advice(stats.cores)), stats.bottleneck


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
    # (at least 0.75 of the limit in flight: a loaded machine's epoch may show 3 of 4)
    assert re.match(rf"the workers: \d+ of {stats.in_flight_limit} batches in flight on 2 "
                    "workers; ", stats.bottleneck), stats.bottleneck
    if stats.cores > 2:
        assert f"raise num_workers (up to {stats.cores}, the cores here)" in stats.bottleneck
    else:  # this machine: 2 workers use its cores already
        assert "raise num_workers" not in stats.bottleneck
        assert stats.bottleneck.endswith(f"the CPU is the limit: 2 processes on {stats.cores} "
                                         "cores; make each sample cheaper to load, or use a "
                                         "machine with more cores"), stats.bottleneck


def _workers_advice(cores: int, verb: str = "use") -> str:
    """What the verdict advises about num_workers (none beyond ``cores``) with no workers."""
    if cores <= 1:
        return ("the CPU is the limit: 1 process on 1 core; make each sample cheaper to load, "
                "or use a machine with more cores")
    return f"{verb} num_workers (up to {cores}, the cores here)"


def _stats(**changes: Any) -> LoaderStats:
    """A snapshot as measured (seconds), with ``changes``."""
    stages = {name: StageStats(name, 0, 0.0, 0.0, 0.0, 0.0)
              for name in ("sampling", "fetch", "collate", "transfer", "wait", "consumer")}
    base: dict[str, Any] = dict(
        epoch=0, running=False, elapsed=10.0, items=1000, batches=100, failures=0,
        items_per_second=100.0, mode="process", kind="map", stages=stages, in_flight=8.0,
        in_flight_limit=8, ready=0.0, ready_limit=2, fetch_cpu=0.0, cores=4,
        workers=[{"batches": 25, "busy": 9.0}] * 4)
    stages["wait"] = StageStats("wait", 100, 8.0, 0.08, 0.1, 0.2)
    stages["fetch"] = StageStats("fetch", 100, 36.0, 0.3, 0.4, 0.5)
    return LoaderStats(**(base | changes))


@pytest.mark.parametrize(("workers", "cores", "advice"), [
    (2, 8, "raise num_workers (up to 8, the cores here) (or max_concurrency for an async "
           "dataset)"),
    (4, 4, "the CPU is the limit: 4 processes on 4 cores; make each sample cheaper to load, "
           "or use a machine with more cores"),
    (8, 4, "the CPU is the limit: 8 processes on 4 cores"),
    (4, 0, "raise num_workers (or max_concurrency for an async dataset)"),
])
def test_the_verdict_never_advises_more_workers_than_cores(workers: int, cores: int,
                                                           advice: str) -> None:
    stats = _stats(workers=[{"batches": 25, "busy": 9.0}] * workers, cores=cores,
                   in_flight_limit=2 * workers, in_flight=2.0 * workers)
    said = aloader._stats.verdict(stats)
    assert said.startswith(f"the workers: {2 * workers} of {2 * workers} batches in flight on "
                           f"{workers} workers; {advice}"), said


def test_the_verdict_names_in_order_false_for_stragglers() -> None:
    """A long tail of fetch latencies (p99 100x p50), the window far from full and the
    consumer waiting: the slow fetches hold back the batches behind them."""
    stages = {name: StageStats(name, 0, 0.0, 0.0, 0.0, 0.0)
              for name in ("sampling", "fetch", "collate", "transfer", "wait", "consumer")}
    stages["fetch"] = StageStats("fetch", 2000, 8.0, 0.002, 0.004, 0.2)
    stages["wait"] = StageStats("wait", 125, 3.9, 0.01, 0.2, 0.2)
    stats = _stats(mode="async", workers=[], stages=stages, elapsed=4.0, in_flight=3.1,
                   in_flight_limit=16)
    said = aloader._stats.verdict(stats)
    assert said.startswith("stragglers: a few slow fetches (p99 200 ms, p50 2.0 ms) hold back "
                           "the batches behind them (3.1 of 16 fetches in flight); pass "
                           "in_order=False"), said
    # Delivered as they come already, or without a tail, or a full window: not stragglers.
    for changes in ({"in_order": False},
                    {"stages": stages | {"fetch": StageStats("fetch", 2000, 8.0, 0.002,
                                                             0.004, 0.005)}},
                    {"in_flight": 15.0}):
        other = dataclasses.replace(stats, **changes)
        assert "in_order=False" not in aloader._stats.verdict(other), changes


def test_a_real_straggler_epoch_is_called_so() -> None:
    """2% of fetches take 100 ms, the others 1 ms: in order, the verdict says stragglers;
    with in_order=False it does not (the window keeps moving)."""
    class Tail:
        def __len__(self) -> int:
            return 1000

        async def __getitem__(self, i: int) -> int:
            await anyio.sleep(0.1 if i % 50 == 7 else 0.001)
            return i

    verdicts = {}
    for in_order in (True, False):
        dl = DataLoader(Tail(), batch_size=16, max_concurrency=16, in_order=in_order)
        assert sum(len(batch) for batch in dl) == 1000
        verdicts[in_order] = dl.stats().bottleneck
    assert verdicts[True].startswith("stragglers: "), verdicts
    assert "in_order=False" not in verdicts[False], verdicts


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


def test_skipped_errors_is_a_bounded_sliceable_list(tmp_path: Path) -> None:
    import pickle

    from aloader import JsonLines, RecordError, SourceStats

    stats = SourceStats()
    errors = [RecordError(f"bad {i}") for i in range(150)]
    for error in errors[:120]:
        stats.skipped_errors.append(error)
    stats.skipped_errors.extend(errors[120:])
    assert len(stats.skipped_errors) == 100  # the oldest dropped
    assert stats.skipped_errors[-5:] == errors[-5:] and stats.skipped_errors[0] is errors[50]
    assert isinstance(stats.skipped_errors, list)
    again = pickle.loads(pickle.dumps(stats))
    assert [str(e) for e in again.skipped_errors] == [str(e) for e in errors[50:]]
    again.skipped_errors.append(RecordError("one more"))
    assert len(again.skipped_errors) == 100
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(f'{{"i": {i}}}\n' if i % 4 else "not json\n" for i in range(40)))
    source = JsonLines(str(path), skip_errors=True)
    assert len(list(source)) == 30
    assert [error.line for error in source.stats.skipped_errors[-2:]] == [33, 37]
