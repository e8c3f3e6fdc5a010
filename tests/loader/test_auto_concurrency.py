"""``max_concurrency="auto"``: the DataLoader's fetches in flight follow the controller of
aloader._tuning, bounded by ``max_concurrency_limit``; the controller's value and history are
in ``stats()``, its state in ``state_dict()``; bad values are refused naming the argument.

The controller's own decisions are tested on a fake clock (tests/test_tuning.py); here a
scripted controller (its limit a function of the completions) checks that the pipeline obeys
whatever it decides, and a real one runs against a local HTTP server. No test asserts a
duration.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import numpy as np
import pytest

import aloader
from aloader import DataLoader
from aloader._tuning import Controller

pytestmark = pytest.mark.anyio


class Scripted(Controller):
    """A controller whose limit is ``script(completions)``: decisions known in advance."""

    def __init__(self, script: Callable[[int], int]) -> None:
        super().__init__(1024, initial=script(0))
        self.script = script
        self.completions = 0
        self.record = self.completed  # what the fetch workers call per item

    def completed(self, latency: int) -> None:
        self.completions += 1
        limit = self.script(self.completions)
        if limit != self.limit:
            self.limit = limit
            if self.on_change is not None:
                self.on_change(limit)

    def done(self, latency: int, now: int) -> None:
        self.completed(latency)

    def tick(self, now: int) -> None:
        pass


class Watched:
    """An async dataset whose fetches record how many were in flight when each started, and
    how many had completed then."""

    def __init__(self, n: int, tuner: Scripted | None = None, delay: float = 0.001) -> None:
        self.n = n
        self.tuner = tuner
        self.delay = delay
        self.in_flight = 0
        self.starts: list[tuple[int, int]] = []  # (completions so far, in flight)

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        self.in_flight += 1
        done = self.tuner.completions if self.tuner is not None else 0
        self.starts.append((done, self.in_flight))
        try:
            await anyio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        return index


class SyncWatched(Watched):
    """The same as a blocking synchronous dataset (fetched in threads)."""

    def __init__(self, n: int, tuner: Scripted | None = None) -> None:
        super().__init__(n, tuner)
        self.lock = threading.Lock()

    def __getitem__(self, index: int) -> int:  # type: ignore[override]
        with self.lock:
            self.in_flight += 1
            done = self.tuner.completions if self.tuner is not None else 0
            self.starts.append((done, self.in_flight))
        time.sleep(0.001)
        with self.lock:
            self.in_flight -= 1
        return index


def _script(completions: int) -> int:
    """40 in flight, then 3 from the 200th completion, then 40 again from the 500th."""
    return 3 if 200 <= completions < 500 else 40


def _check_followed(starts: list[tuple[int, int]]) -> None:
    # Once the fetches started under 40 have come back, no more than 3 run at once.
    low = [flight for done, flight in starts if 200 + 40 <= done < 500]
    assert low and max(low) <= 3
    high = [flight for done, flight in starts if done >= 500 + 40]
    assert max(high) > 3  # and the workers came back when the limit rose
    assert max(flight for _, flight in starts) <= 40


async def test_the_fetches_in_flight_follow_the_controller() -> None:
    tuner = Scripted(_script)
    dataset = Watched(2000, tuner)
    loader = DataLoader(dataset, batch_size=8, max_concurrency="auto")
    loader._tuner = tuner
    got = [int(x) for batch in [b async for b in loader] for x in batch]
    assert got == list(range(2000))  # in order, each once
    _check_followed(dataset.starts)
    stats = loader.stats()
    assert stats.concurrency is not None and stats.in_flight_limit == 40


async def test_blocking_fetches_in_threads_follow_the_controller() -> None:
    tuner = Scripted(_script)
    dataset = SyncWatched(1200, tuner)
    loader = DataLoader(dataset, batch_size=8, max_concurrency="auto")
    loader._tuner = tuner
    got = [int(x) for batch in [b async for b in loader] for x in batch]
    assert got == list(range(1200))
    low = [flight for done, flight in dataset.starts if 200 + 40 <= done < 500]
    assert low and max(low) <= 3
    assert max(flight for _, flight in dataset.starts) <= 40
    assert loader.stats().mode == "thread"


async def test_a_batch_dataset_tunes_its_batch_calls() -> None:
    class Batches:
        def __init__(self) -> None:
            self.in_flight = self.peak = 0

        def __len__(self) -> int:
            return 640

        async def __getitem__(self, index: int) -> int:
            return index

        async def __getitems__(self, indices: list[int]) -> list[int]:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            await anyio.sleep(0.001)
            self.in_flight -= 1
            return indices

    dataset = Batches()
    loader = DataLoader(dataset, batch_size=32, max_concurrency="auto",
                        max_concurrency_limit=64)
    got = [int(x) for batch in [b async for b in loader] for x in batch]
    assert got == list(range(640))
    # The controller counts batch calls: 64 items are 3 calls of 32 (a window).
    concurrency = loader.stats().concurrency
    assert concurrency is not None and concurrency["maximum"] == 3
    assert dataset.peak <= 3


async def test_auto_against_a_local_store(serve: Any) -> None:
    files = {str(i): f"item {i}".encode() for i in range(50)}
    server = serve(files, latency=0.002)

    class Remote:
        client: httpx.AsyncClient | None = None

        def __len__(self) -> int:
            return 600

        async def __getitem__(self, index: int) -> bytes:
            if self.client is None:
                self.client = httpx.AsyncClient()
            response = await self.client.get(server.url(str(index % 50)))
            return response.content

    dataset = Remote()
    loader = DataLoader(dataset, batch_size=10, max_concurrency="auto",
                        max_concurrency_limit=48, collate_fn=list)
    try:
        got = [item async for batch in loader for item in batch]
    finally:
        if dataset.client is not None:
            await dataset.client.aclose()
    assert got == [f"item {i % 50}".encode() for i in range(600)]
    stats = loader.stats()
    concurrency = stats.concurrency
    assert concurrency is not None
    assert 1 <= concurrency["limit"] <= 48 and concurrency["maximum"] == 48
    assert all(why in ("startup", "knee", "steady") for _, _, why in concurrency["history"])
    assert concurrency["rate"] > 0 and concurrency["latency"] > 0
    assert stats.in_flight_limit == concurrency["limit"]
    assert "(auto)" in stats.table()
    json.dumps(stats.as_dict())


async def test_the_state_resumes_at_the_limit_it_had() -> None:
    loader = DataLoader(Watched(300), batch_size=10, max_concurrency="auto")
    iterator = loader.__aiter__()
    for _ in range(5):
        await iterator.__anext__()
    state = json.loads(json.dumps(loader.state_dict()))
    await iterator.aclose()
    assert state["concurrency"]["limit"] == loader._tuner.limit  # type: ignore[union-attr]
    saved = dict(state["concurrency"], limit=7, phase="steady")
    state["concurrency"] = saved
    dataset = Watched(300)
    resumed = DataLoader(dataset, batch_size=10, max_concurrency="auto")
    resumed.load_state_dict(state)
    assert resumed.state_dict()["concurrency"]["limit"] == 7
    got = [int(x) for batch in [b async for b in resumed] for x in batch]
    assert got == list(range(50, 300))
    # It started at 7 in flight, in its steady phase (no startup from 16).
    assert max(flight for _, flight in dataset.starts[:12]) <= 7
    concurrency = resumed.stats().concurrency
    assert concurrency is not None and concurrency["phase"] == "steady"


async def test_the_controller_goes_on_from_epoch_to_epoch() -> None:
    loader = DataLoader(Watched(400), batch_size=8, max_concurrency="auto")
    async for _ in loader:
        pass
    tuner = loader._tuner
    assert tuner is not None
    history = len(tuner.history)
    async for _ in loader:
        pass
    assert loader._tuner is tuner and len(tuner.history) >= history


def test_a_bad_concurrency_state_is_refused_naming_the_field() -> None:
    loader = DataLoader(Watched(10), max_concurrency="auto")
    state = loader.state_dict()
    state["concurrency"] = {"limit": -1, "phase": "steady"}
    with pytest.raises(ValueError, match="'concurrency'.*'limit'"):
        loader.load_state_dict(state)
    state["concurrency"] = None  # a state from a fixed max_concurrency, or an older one
    loader.load_state_dict(state)


def test_fixed_concurrency_has_no_controller() -> None:
    loader = DataLoader(Watched(20), batch_size=4, max_concurrency=8)
    assert [len(batch) for batch in loader] == [4] * 5
    assert loader.stats().concurrency is None
    assert loader.state_dict()["concurrency"] is None


def test_auto_in_a_sync_for() -> None:
    loader = DataLoader(SyncWatched(200), batch_size=10, max_concurrency="auto")
    got = [int(x) for batch in loader for x in batch]
    assert got == list(range(200))
    assert loader.stats().concurrency is not None


def test_auto_with_worker_processes_reports_each_workers_controller() -> None:
    loader = DataLoader(Watched(400), batch_size=10, max_concurrency="auto", num_workers=2)
    try:
        got = sorted(int(x) for batch in loader for x in batch)
        assert got == list(range(400))
        concurrency = loader.stats().concurrency
        assert concurrency is not None and len(concurrency["workers"]) == 2
        assert concurrency["limit"] == sum(w["limit"] for w in concurrency["workers"])
        assert loader.state_dict()["concurrency"] is not None
    finally:
        loader.close()


def test_inline_and_iterable_datasets_have_nothing_to_tune() -> None:
    loader = DataLoader(np.arange(10), batch_size=5, max_concurrency="auto")
    assert [batch.tolist() for batch in loader] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert loader.stats().concurrency is None


@pytest.mark.parametrize("value", ["fast", 0, -4, 1.5, True, "Auto"])
def test_a_bad_max_concurrency_is_a_value_error_naming_it(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^max_concurrency should be a positive integer or "
                                         r"'auto', None, but got max_concurrency="):
        DataLoader(Watched(4), max_concurrency=value)


@pytest.mark.parametrize("value", ["fast", 0, -4, 1.5, True, "auto"])
def test_a_bad_max_concurrency_limit_is_a_value_error_naming_it(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^max_concurrency_limit should be"):
        DataLoader(Watched(4), max_concurrency="auto", max_concurrency_limit=value)


def test_max_concurrency_limit_needs_auto() -> None:
    with pytest.raises(ValueError, match=r"max_concurrency_limit bounds max_concurrency='auto'"):
        DataLoader(Watched(4), max_concurrency=8, max_concurrency_limit=64)


def test_the_verdict_speaks_of_auto() -> None:
    from dataclasses import replace

    from aloader._stats import StageStats, verdict

    stages = {name: StageStats(name, 10, 0.0, 0, 0, 0) for name in
              ("sampling", "fetch", "collate", "transfer", "wait", "consumer")}
    stages["fetch"] = StageStats("fetch", 10, 50.0, 0, 0, 0)
    stages["wait"] = StageStats("wait", 10, 9.0, 0, 0, 0)
    base = aloader.LoaderStats(epoch=0, running=False, elapsed=10.0, items=100, batches=10,
                               failures=0, items_per_second=10.0, mode="async", kind="map",
                               stages=stages, in_flight=200.0, in_flight_limit=210,
                               ready=0.0, ready_limit=2, fetch_cpu=0.0,
                               concurrency={"limit": 210, "maximum": 1024, "ceiling": None})
    assert verdict(base).startswith("the store: max_concurrency='auto' keeps 210 fetches")
    at_max = replace(base, in_flight_limit=1024,
                     concurrency={"limit": 1024, "maximum": 1024, "ceiling": None},
                     in_flight=1000.0)
    assert "raise max_concurrency_limit" in verdict(at_max)
    throttled = replace(base, throttled=57, concurrency={"limit": 90, "maximum": 1024,
                                                         "ceiling": 950.0})
    assert verdict(throttled).startswith("the store's rate limit: 57 fetches were throttled")


async def test_no_fetch_thread_starts_once_the_threads_close() -> None:
    """A controller's last change may reach the fetch threads after the epoch began to close
    them: no thread may start then (it would wait for work for ever)."""
    from aloader.pipeline._plan import FetchPlan
    from aloader.pipeline._schedule import _Job
    from aloader.pipeline._threads import _FetchThreads

    plan = FetchPlan.for_dataset(SyncWatched(8), iterable=False, auto_batch=True,
                                 collate_fn=list, batch_size=4, max_concurrency="auto")
    threads = _FetchThreads(plan, 1)
    job = _Job(0, [0, 1, 2, 3])
    job.samples, job.remaining = [None] * 4, 4
    threads.submit(job, [0, 1, 2, 3])
    assert job.fetched is not None
    await job.fetched.wait()
    await threads.close()
    threads._unfinished = 4  # as if work were still queued
    threads.resize(8)
    assert not any(t.is_alive() for t in threads._threads)
    assert job.samples == [0, 1, 2, 3]
