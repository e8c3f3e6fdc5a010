"""Tests of the inference micro-batcher (aloader.serve._batcher).

Tests that depend on time run on trio with ``MockClock(autojump_threshold=0)``: the clock jumps
to the next deadline as soon as every task is blocked, so batch formation by time, timeouts and
latency metrics are checked exactly and without sleeping. The other tests run on asyncio and
trio and synchronise on events, never on elapsed time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aloader
from aloader import (
    AloaderError,
    Batcher,
    BatcherClosedError,
    BatcherTimeoutError,
    BatchMethod,
    BatchResultError,
    QueueFullError,
    batch,
    default_collate,
)

# -- helpers -----------------------------------------------------------------------------------


class Recorder:
    """An async batch function that records its batches and can be held at a gate."""

    def __init__(
        self,
        fn: Callable[[Any], Any] = lambda x: x * 10,
        *,
        duration: float = 0.0,
    ) -> None:
        self.fn = fn
        self.duration = duration
        self.batches: list[list[Any]] = []
        self.times: list[float] = []
        self.gate: anyio.Event | None = None
        self.running = 0
        self.peak_running = 0
        self._changed = anyio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_running(self, n: int) -> None:
        """Block (letting a mock clock jump) until ``n`` batches are running."""
        while self.running != n:
            await self._changed.wait()

    async def wait_batches(self, n: int) -> None:
        """Block until ``n`` batches have started."""
        while len(self.batches) < n:
            await self._changed.wait()

    def hold(self) -> None:
        self.gate = anyio.Event()

    def release(self) -> None:
        assert self.gate is not None
        self.gate.set()
        self.gate = None

    async def __call__(self, items: list[Any]) -> list[Any]:
        self.batches.append(list(items))
        self.times.append(anyio.current_time())
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        self._notify()
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.duration:
                await anyio.sleep(self.duration)
        finally:
            self.running -= 1
            self._notify()
        return [self.fn(x) for x in items]


class Caller:
    """One caller of a batcher, in its own cancel scope; the outcome is recorded."""

    def __init__(self, batcher: Batcher[Any, Any], item: Any, **kwargs: Any) -> None:
        self.batcher = batcher
        self.item = item
        self.kwargs = kwargs
        self.scope = anyio.CancelScope()
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = anyio.Event()
        self.cancelled = False

    async def run(self) -> None:
        with self.scope:
            try:
                self.result = await self.batcher(self.item, **self.kwargs)
            except Exception as exc:
                self.error = exc
        self.cancelled = self.scope.cancelled_caught
        self.done.set()


async def start(
    task_group: anyio.abc.TaskGroup, batcher: Batcher[Any, Any], item: Any, **kwargs: Any
) -> Caller:
    """Start a caller and return once its request is queued (or refused)."""
    caller = Caller(batcher, item, **kwargs)
    before = batcher.metrics()
    task_group.start_soon(caller.run)
    while True:
        now = batcher.metrics()
        if now["submitted"] > before["submitted"] or caller.done.is_set():
            return caller
        await anyio.sleep(0)


async def call_many(batcher: Batcher[Any, Any], items: list[Any]) -> list[Any]:
    """Call the batcher with every item concurrently; return the results in order."""
    results: list[Any] = [None] * len(items)

    async def one(i: int) -> None:
        results[i] = await batcher(items[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(items)):
            tg.start_soon(one, i)
    return results


async def until(predicate: Callable[[], bool]) -> None:
    """Let other tasks run until ``predicate()`` holds."""
    for _ in range(10_000):
        if predicate():
            return
        await anyio.sleep(0)
    raise AssertionError("condition never became true")


def on_mock_clock() -> pytest.MarkDecorator:
    """Run an anyio test on trio with a fresh ``MockClock(autojump_threshold=0)``."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    return pytest.mark.parametrize(
        "anyio_backend", [pytest.param(("trio", {"clock": clock}), id="trio-mockclock")]
    )


# -- basics ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_each_caller_gets_its_own_result(anyio_backend: str) -> None:
    recorder = Recorder()
    results: dict[int, Any] = {}

    async def one(b: Batcher[int, int], i: int) -> None:
        results[i] = await b(i)

    async with Batcher(recorder, max_batch_size=8) as b, anyio.create_task_group() as tg:
        for i in range(50):
            tg.start_soon(one, b, i)
    assert results == {i: i * 10 for i in range(50)}
    assert all(1 <= len(batch) <= 8 for batch in recorder.batches)
    assert sorted(x for batch in recorder.batches for x in batch) == list(range(50))
    metrics = b.metrics()
    assert metrics["completed"] == 50
    assert sum(size * n for size, n in metrics["batch_size_histogram"].items()) == 50
    assert metrics["batches"] == len(recorder.batches)


@pytest.mark.anyio
async def test_plain_function_runs_in_a_worker_thread(anyio_backend: str) -> None:
    main_thread = threading.get_ident()
    threads: list[int] = []

    def double(items: list[int]) -> list[int]:
        threads.append(threading.get_ident())
        return [2 * x for x in items]

    async with Batcher(double, max_batch_size=4) as b:
        assert await b(21) == 42
    assert threads and all(t != main_thread for t in threads)


@pytest.mark.anyio
async def test_plain_function_on_the_loop_with_to_thread_false(anyio_backend: str) -> None:
    main_thread = threading.get_ident()
    threads: list[int] = []

    def double(items: list[int]) -> tuple[int, ...]:
        threads.append(threading.get_ident())
        return tuple(2 * x for x in items)

    async with Batcher(double, to_thread=False) as b:
        assert await b(5) == 10
    assert threads == [main_thread]


@pytest.mark.anyio
async def test_async_callable_object_and_partial_are_awaited(anyio_backend: str) -> None:
    import functools

    async def scaled(factor: int, items: list[int]) -> list[int]:
        return [factor * x for x in items]

    async with Batcher(functools.partial(scaled, 3)) as b:
        assert await b(2) == 6


@pytest.mark.anyio
async def test_plain_function_returning_an_awaitable_is_awaited(anyio_backend: str) -> None:
    async def triple(items: list[int]) -> list[int]:
        return [3 * x for x in items]

    async with Batcher(lambda items: triple(items), to_thread=False) as b:
        assert await b(2) == 6


@pytest.mark.anyio
async def test_default_collate_stacks_arrays_and_ndarray_results_are_split(
    anyio_backend: str,
) -> None:
    seen: list[Any] = []

    async def model(x: np.ndarray) -> np.ndarray:
        seen.append(x)
        return x.sum(axis=1)

    async with Batcher(model, collate_fn=default_collate, max_batch_size=4) as b:

        async def one(i: int, out: dict[int, Any]) -> None:
            out[i] = await b(np.full(3, i, dtype=np.float32))

        out: dict[int, Any] = {}
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i, out)
    assert out == {i: 3.0 * i for i in range(4)}
    assert all(isinstance(x, np.ndarray) and x.ndim == 2 and x.shape[1] == 3 for x in seen)


@pytest.mark.anyio
async def test_collate_fn_can_pad(anyio_backend: str) -> None:
    recorder = Recorder(lambda row: row)

    def pad(items: list[list[int]]) -> list[list[int]]:
        width = max(len(item) for item in items)
        return [item + [0] * (width - len(item)) for item in items]

    b = Batcher(recorder, collate_fn=pad, max_batch_size=8)
    recorder.hold()
    async with anyio.create_task_group() as tg:
        first = await start(tg, b, [9])
        await recorder.wait_running(1)
        second = await start(tg, b, [1, 2, 3])
        third = await start(tg, b, [4])
        recorder.release()
    await b.aclose()
    assert first.result == [9]
    assert second.result == [1, 2, 3]
    assert third.result == [4, 0, 0]


# -- batch formation -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_max_wait_zero_takes_whatever_is_queued_when_a_slot_frees(
    anyio_backend: str,
) -> None:
    recorder = Recorder()
    async with Batcher(recorder, max_batch_size=3, max_wait=0) as b:
        recorder.hold()
        async with anyio.create_task_group() as tg:
            await start(tg, b, 0)
            await recorder.wait_running(1)
            # While the model is busy the queue builds up; nothing is frozen into tiny batches.
            for i in range(1, 6):
                await start(tg, b, i)
            assert b.metrics()["queued"] == 5
            recorder.release()
    assert recorder.batches == [[0], [1, 2, 3], [4, 5]]


@pytest.mark.anyio
async def test_max_concurrent_batches_run_at_once(anyio_backend: str) -> None:
    recorder = Recorder()
    async with Batcher(recorder, max_batch_size=2, max_concurrent_batches=2) as b:
        recorder.hold()
        async with anyio.create_task_group() as tg:
            for i in range(6):
                await start(tg, b, i)
            await recorder.wait_running(2)
            assert b.metrics()["running_batches"] == 2
            # The third batch waits for a slot: its requests are still queued.
            assert b.metrics()["queued"] >= 1
            recorder.release()
    assert recorder.peak_running == 2
    assert sorted(x for batch in recorder.batches for x in batch) == list(range(6))
    assert all(len(batch) <= 2 for batch in recorder.batches)


@pytest.mark.anyio
@on_mock_clock()
async def test_batch_goes_out_when_full(anyio_backend: object) -> None:
    recorder = Recorder()
    results: dict[int, Any] = {}

    async def one(b: Batcher[int, int], i: int) -> None:
        results[i] = await b(i)

    async with Batcher(recorder, max_batch_size=4, max_wait=100.0) as b:
        t0 = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(one, b, i)
    assert [len(batch) for batch in recorder.batches] == [4, 4, 2]
    # Two full batches at once; the remainder waits max_wait for company, then goes anyway.
    assert [t - t0 for t in recorder.times] == [0.0, 0.0, pytest.approx(100.0)]
    assert results == {i: 10 * i for i in range(10)}


@pytest.mark.anyio
@on_mock_clock()
async def test_batch_goes_out_when_max_wait_passed_since_first_item(
    anyio_backend: object,
) -> None:
    recorder = Recorder()
    async with Batcher(recorder, max_batch_size=8, max_wait=1.0) as b:
        t0 = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(b, "a")
            await anyio.sleep(0.3)
            tg.start_soon(b, "b")
            await anyio.sleep(2.2)  # t = 2.5
            tg.start_soon(b, "c")
    assert recorder.batches == [["a", "b"], ["c"]]
    assert [t - t0 for t in recorder.times] == [pytest.approx(1.0), pytest.approx(3.5)]


@pytest.mark.anyio
@on_mock_clock()
async def test_wait_restarts_from_the_next_oldest_when_the_oldest_leaves(
    anyio_backend: object,
) -> None:
    recorder = Recorder()
    async with Batcher(recorder, max_batch_size=8, max_wait=1.0) as b:
        t0 = anyio.current_time()
        async with anyio.create_task_group() as tg:
            first = await start(tg, b, "a")
            await anyio.sleep(0.5)
            await start(tg, b, "b")
            await anyio.sleep(0.2)
            first.scope.cancel()
    assert recorder.batches == [["b"]]
    assert recorder.times[0] - t0 == pytest.approx(1.5)
    assert first.cancelled


@pytest.mark.anyio
@on_mock_clock()
async def test_preferred_batch_sizes(anyio_backend: object) -> None:
    recorder = Recorder()
    async with Batcher(
        recorder, max_batch_size=8, max_wait=10.0, preferred_batch_sizes=[4, 2]
    ) as b:
        t0 = anyio.current_time()
        async with anyio.create_task_group() as tg:
            await start(tg, b, 0)
            await anyio.sleep(1.0)
            # The smallest preferred size is reached: no waiting for max_wait.
            await start(tg, b, 1)
            await recorder.wait_batches(1)
            recorder.hold()
            await start(tg, b, 2)
            await recorder.wait_running(1)
            for i in range(3, 10):
                await start(tg, b, i)
            recorder.release()
    sizes = [len(batch) for batch in recorder.batches]
    # [0, 1] at t=1; [2] alone after max_wait; then 7 queued -> 4 (largest preferred <= 7),
    # 3 left -> 2, and the last one waits max_wait.
    assert sizes == [2, 1, 4, 2, 1]
    assert recorder.times[0] - t0 == pytest.approx(1.0)
    assert recorder.batches[2:] == [[3, 4, 5, 6], [7, 8], [9]]


# -- overload ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_full_queue_rejects_at_once(anyio_backend: str) -> None:
    recorder = Recorder()
    async with Batcher(recorder, max_batch_size=2, max_queue=3) as b:
        recorder.hold()
        async with anyio.create_task_group() as tg:
            callers = [await start(tg, b, 0)]
            await recorder.wait_running(1)
            callers += [await start(tg, b, i) for i in range(1, 4)]
            assert b.metrics()["queued"] == 3
            with pytest.raises(QueueFullError, match="queue is full"):
                await b(99)
            with pytest.raises(QueueFullError):
                await b(100, timeout=5)
            assert b.metrics()["rejected"] == 2
            recorder.release()
        # Once the queue drains, requests are admitted again.
        assert await b(7) == 70
    assert [c.result for c in callers] == [0, 10, 20, 30]
    assert isinstance(QueueFullError("x"), AloaderError)


# -- timeouts and cancellation -------------------------------------------------------------------


@pytest.mark.anyio
@on_mock_clock()
async def test_timeout_while_queued_removes_the_request(
    anyio_backend: object,
) -> None:
    recorder = Recorder()
    async with Batcher(recorder, max_batch_size=4) as b:
        recorder.hold()
        async with anyio.create_task_group() as tg:
            await start(tg, b, 0)
            await recorder.wait_running(1)
            late = await start(tg, b, 1, timeout=1.0)
            patient = await start(tg, b, 2)
            t0 = anyio.current_time()
            await late.done.wait()
            assert anyio.current_time() - t0 == pytest.approx(1.0)
            assert b.metrics()["queued"] == 1
            recorder.release()
    assert isinstance(late.error, BatcherTimeoutError)
    assert isinstance(late.error, TimeoutError)
    assert patient.result == 20
    assert recorder.batches == [[0], [2]]  # the late item never reached the batch function
    metrics = b.metrics()
    assert metrics["timed_out"] == 1
    assert metrics["completed"] == 2


@pytest.mark.anyio
@on_mock_clock()
async def test_timeout_while_running_does_not_abort_the_batch(
    anyio_backend: object,
) -> None:
    recorder = Recorder(duration=5.0)
    async with (
        Batcher(recorder, max_batch_size=4, max_wait=0.5) as b,
        anyio.create_task_group() as tg,
    ):
        late = await start(tg, b, 1, timeout=1.0)
        other = await start(tg, b, 2)
    assert recorder.batches == [[1, 2]]
    assert isinstance(late.error, BatcherTimeoutError)
    assert other.result == 20
    assert b.metrics()["timed_out"] == 1
    assert b.metrics()["completed"] == 1


@pytest.mark.anyio
@on_mock_clock()
async def test_batcher_default_timeout_and_per_call_override(
    anyio_backend: object,
) -> None:
    recorder = Recorder(duration=2.0)
    async with Batcher(recorder, timeout=1.0) as b:
        with pytest.raises(TimeoutError):
            await b(1)
        assert await b(2, timeout=None) == 20
        assert await b(3, timeout=3.0) == 30
        with pytest.raises(ValueError, match="timeout"):
            await b(4, timeout=-1)


@pytest.mark.anyio
async def test_cancelled_while_queued_never_reaches_the_batch(anyio_backend: str) -> None:
    recorder = Recorder()
    async with Batcher(recorder, max_batch_size=4) as b:
        recorder.hold()
        async with anyio.create_task_group() as tg:
            await start(tg, b, 0)
            await recorder.wait_running(1)
            gone = await start(tg, b, 1)
            kept = await start(tg, b, 2)
            gone.scope.cancel()
            await gone.done.wait()
            assert b.metrics()["queued"] == 1  # removed at once, not at batch time
            recorder.release()
    assert gone.cancelled and gone.error is None
    assert kept.result == 20
    assert recorder.batches == [[0], [2]]
    assert b.metrics()["cancelled"] == 1


@pytest.mark.anyio
async def test_cancelled_while_running_does_not_abort_the_batch(anyio_backend: str) -> None:
    recorder = Recorder()
    finished = []

    async def model(items: list[int]) -> list[int]:
        out = await recorder(items)
        finished.append(items)
        return out

    async with Batcher(model, max_batch_size=2, max_wait=60.0) as b:
        recorder.hold()
        async with anyio.create_task_group() as tg:
            gone = await start(tg, b, 1)
            kept = await start(tg, b, 2)
            await recorder.wait_running(1)
            gone.scope.cancel()
            await gone.done.wait()
            assert recorder.running == 1  # the batch goes on
            recorder.release()
    assert gone.cancelled and gone.result is None and gone.error is None
    assert kept.result == 20
    assert finished == [[1, 2]]
    metrics = b.metrics()
    assert metrics["cancelled"] == 1
    assert metrics["completed"] == 1  # the cancelled caller was never resolved


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_batch_exception_reaches_every_caller_and_dispatcher_survives(
    anyio_backend: str,
) -> None:
    calls = 0

    async def flaky(items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ValueError(f"bad batch {items}")
        return [x + 1 for x in items]

    # max_wait is never reached: the batch goes out when its third item arrives.
    async with Batcher(flaky, max_batch_size=3, max_wait=60.0) as b:
        async with anyio.create_task_group() as tg:
            callers = [await start(tg, b, i) for i in range(3)]
        assert all(isinstance(c.error, ValueError) for c in callers)
        assert all("bad batch" in str(c.error) for c in callers)
        assert await call_many(b, [10, 20, 30]) == [11, 21, 31]  # later requests are served
    assert b.metrics()["failed"] == 3


@pytest.mark.anyio
async def test_exception_in_a_result_slot_is_raised_for_that_caller_alone(
    anyio_backend: str,
) -> None:
    def model(items: list[int]) -> list[object]:
        return [KeyError(x) if x == 1 else x * 2 for x in items]

    async with (
        Batcher(model, max_batch_size=3, max_wait=60.0) as b,
        anyio.create_task_group() as tg,
    ):
        callers = [await start(tg, b, i) for i in range(3)]
    assert isinstance(callers[1].error, KeyError)
    assert callers[0].result == 0 and callers[2].result == 4
    assert b.metrics()["failed"] == 1
    assert b.metrics()["completed"] == 2


@pytest.mark.anyio
async def test_wrong_result_length_is_a_batch_error(anyio_backend: str) -> None:
    calls = 0

    async def short(items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        return items[:-1] if calls == 1 else items

    async with Batcher(short, max_batch_size=3, max_wait=60.0) as b:
        async with anyio.create_task_group() as tg:
            callers = [await start(tg, b, i) for i in range(3)]
        for c in callers:
            assert isinstance(c.error, BatchResultError)
            assert isinstance(c.error, ValueError)
            assert "returned 2 results for a batch of 3 items" in str(c.error)
        assert await call_many(b, [5, 6, 7]) == [5, 6, 7]  # the dispatcher survived


@pytest.mark.anyio
async def test_unsized_result_is_a_batch_error(anyio_backend: str) -> None:
    async def gen(items: list[int]) -> Any:
        return (x for x in items)

    async with Batcher(gen) as b:
        with pytest.raises(BatchResultError, match="no len"):
            await b(1)


@pytest.mark.anyio
async def test_collate_and_thread_errors_reach_the_callers(anyio_backend: str) -> None:
    def bad_collate(items: list[int]) -> list[int]:
        raise TypeError("cannot collate")

    def explode(items: list[int]) -> list[int]:
        raise ZeroDivisionError("boom")

    async with Batcher(lambda items: items, collate_fn=bad_collate) as b:
        with pytest.raises(TypeError, match="cannot collate"):
            await b(1)
    async with Batcher(explode) as b2:
        with pytest.raises(ZeroDivisionError, match="boom"):
            await b2(1)
        with pytest.raises(ZeroDivisionError):
            await b2(2)


@pytest.mark.asyncio
async def test_spontaneous_cancelled_error_does_not_kill_the_dispatcher() -> None:
    calls = 0

    async def weird(items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise asyncio.CancelledError()
        return items

    async with Batcher(weird) as b:
        with pytest.raises(RuntimeError, match="CancelledError"):
            await b(1)
        assert await b(2) == 2


@pytest.mark.anyio
async def test_tracebacks_do_not_grow_across_callers(anyio_backend: str) -> None:
    async def fail(items: list[int]) -> list[int]:
        raise RuntimeError("model down")

    async with (
        Batcher(fail, max_batch_size=10, max_wait=60.0) as b,
        anyio.create_task_group() as tg,
    ):
        callers = [await start(tg, b, i) for i in range(10)]
    depths = []
    for c in callers:
        assert c.error is not None
        tb, depth = c.error.__traceback__, 0
        while tb is not None:
            depth, tb = depth + 1, tb.tb_next
        depths.append(depth)
    assert max(depths) < 10


# -- shutdown ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_aclose_drains_queued_work_and_refuses_new_requests(anyio_backend: str) -> None:
    recorder = Recorder()
    b = Batcher(recorder, max_batch_size=2, max_wait=60.0)
    recorder.hold()
    async with anyio.create_task_group() as tg:
        callers = [await start(tg, b, i) for i in range(5)]
        await recorder.wait_running(1)
        tg.start_soon(b.aclose)
        await until(lambda: b.closed)
        with pytest.raises(BatcherClosedError, match="closed"):
            await b(99)
        recorder.release()
    # The last request did not wait max_wait: closing dispatches at once.
    assert [c.result for c in callers] == [0, 10, 20, 30, 40]
    assert not b._binding.alive
    with pytest.raises(BatcherClosedError):
        await b(1)


@pytest.mark.anyio
async def test_aclose_fails_what_remains_after_the_drain_timeout(anyio_backend: str) -> None:
    recorder = Recorder()
    b = Batcher(recorder, max_batch_size=2)
    recorder.hold()
    async with anyio.create_task_group() as tg:
        callers = [await start(tg, b, i) for i in range(5)]
        await recorder.wait_running(1)
        await b.aclose(timeout=0)
    for c in callers:
        assert isinstance(c.error, BatcherClosedError)
    assert "running" in str(callers[0].error)
    assert "before serving" in str(callers[-1].error)
    assert not b._binding.alive
    assert b.metrics()["failed"] == 5


@pytest.mark.anyio
@on_mock_clock()
async def test_aclose_timeout_with_mock_clock(anyio_backend: object) -> None:
    recorder = Recorder(duration=100.0)
    async with anyio.create_task_group() as tg:
        async with Batcher(recorder, max_batch_size=1, close_timeout=5.0) as b:
            callers = [await start(tg, b, i) for i in range(3)]
            t0 = anyio.current_time()
        assert anyio.current_time() - t0 == pytest.approx(5.0)
    assert all(isinstance(c.error, BatcherClosedError) for c in callers)


@pytest.mark.anyio
async def test_sync_batch_abandoned_in_thread_at_forced_close(anyio_backend: str) -> None:
    release = threading.Event()
    started = threading.Event()

    def slow(items: list[int]) -> list[int]:
        started.set()
        release.wait(timeout=10)
        return items

    b = Batcher(slow)
    async with anyio.create_task_group() as tg:
        caller = await start(tg, b, 1)
        await anyio.to_thread.run_sync(started.wait, 10)
        await b.aclose(timeout=0)
    release.set()
    assert isinstance(caller.error, BatcherClosedError)


@pytest.mark.anyio
async def test_async_with_leaves_no_task_behind(anyio_backend: str) -> None:
    before = _task_count(anyio_backend)
    async with Batcher(Recorder(), max_concurrent_batches=3) as b:
        assert await b(1) == 10
    assert not b._binding.alive
    assert _task_count(anyio_backend) == before
    with pytest.raises(BatcherClosedError):
        async with b:
            pass


@pytest.mark.anyio
async def test_lazy_start_and_aclose_leave_no_task_behind(anyio_backend: str) -> None:
    before = _task_count(anyio_backend)
    b = Batcher(Recorder())
    assert "idle" in repr(b)
    assert await b(1) == 10
    assert b._binding.alive and "running" in repr(b)
    await b.aclose()
    for _ in range(5):
        await anyio.sleep(0)  # let the finished dispatcher task be reaped
    assert not b._binding.alive and "closed" in repr(b)
    assert _task_count(anyio_backend) == before
    with pytest.raises(BatcherClosedError):
        async with b:
            pass


@pytest.mark.anyio
async def test_aclose_before_any_call_and_twice(anyio_backend: str) -> None:
    b = Batcher(Recorder())
    await b.aclose()
    await b.aclose()
    with pytest.raises(BatcherClosedError):
        await b(1)


@pytest.mark.anyio
async def test_entering_a_running_batcher_is_an_error(anyio_backend: str) -> None:
    b = Batcher(Recorder())
    await b(1)
    with pytest.raises(RuntimeError, match="already running"):
        async with b:
            pass
    await b.aclose()


def test_lazy_batcher_moves_to_a_new_event_loop_when_the_old_one_ended() -> None:
    b = Batcher(Recorder())

    async def use() -> Any:
        return await b(4)

    assert asyncio.run(use()) == 40
    assert asyncio.run(use()) == 40  # the first loop is gone: the dispatcher restarts here
    assert trio.run(use) == 40

    async def close() -> None:
        await b.aclose()

    trio.run(close)


def test_a_batcher_serves_one_running_event_loop_at_a_time() -> None:
    b = Batcher(Recorder())
    started, release = threading.Event(), threading.Event()

    async def hold_loop_a() -> None:
        await b(1)
        started.set()
        await asyncio.to_thread(release.wait, 10)
        await b.aclose()

    thread = threading.Thread(target=asyncio.run, args=(hold_loop_a(),))
    thread.start()
    try:
        assert started.wait(10)

        async def use_from_loop_b() -> Any:
            return await b(2)

        with pytest.raises(RuntimeError, match="another event loop"):
            asyncio.run(use_from_loop_b())
    finally:
        release.set()
        thread.join(10)
    assert b.closed


def _task_count(backend: str) -> int:
    if backend == "asyncio":
        return len(asyncio.all_tasks())
    root = trio.lowlevel.current_root_task()
    assert root is not None

    def count(task: trio.lowlevel.Task) -> int:
        return 1 + sum(count(t) for n in task.child_nurseries for t in n.child_tasks)

    return count(root)


# -- decorator -----------------------------------------------------------------------------------


class Model:
    def __init__(self, scale: int) -> None:
        self.scale = scale
        self.batches: list[list[int]] = []

    @batch(max_batch_size=4)
    async def predict(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        return [self.scale * x for x in items]

    @batch(to_thread=True)
    def predict_sync(self, items: list[int]) -> list[int]:
        return [self.scale + x for x in items]


@pytest.mark.anyio
async def test_batch_decorator_gives_each_instance_its_own_batcher(anyio_backend: str) -> None:
    a, b = Model(2), Model(3)
    assert isinstance(Model.predict, BatchMethod)
    assert a.predict is a.predict and a.predict is not b.predict
    assert isinstance(a.predict, Batcher)
    out: dict[tuple[str, int], int] = {}

    async def one(name: str, model: Model, i: int) -> None:
        out[name, i] = await model.predict(i)

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(one, "a", a, i)
            tg.start_soon(one, "b", b, i)
    assert out == {**{("a", i): 2 * i for i in range(6)}, **{("b", i): 3 * i for i in range(6)}}
    assert all(len(batch) <= 4 for batch in a.batches + b.batches)
    assert await a.predict_sync(1) == 3
    assert a.predict.metrics()["completed"] == 6
    for model in (a, b):
        await model.predict.aclose()
        await model.predict_sync.aclose()


def test_batch_decorator_errors() -> None:
    with pytest.raises(TypeError, match="call it on an instance"):
        Model.predict(1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        batch(max_batch_sise=3)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="max_batch_size"):
        batch(max_batch_size=0)

    class Slotted:
        __slots__ = ()

        @batch
        async def f(self, items: list[int]) -> list[int]:
            return items

    with pytest.raises(TypeError, match="__slots__"):
        Slotted().f  # noqa: B018


# -- arguments and metrics -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_batch_size": 0}, ValueError, "max_batch_size must be an integer >= 1"),
        ({"max_batch_size": 2.5}, TypeError, "max_batch_size must be an integer >= 1, got 2.5"),
        ({"max_batch_size": True}, TypeError, "max_batch_size"),
        ({"max_wait": -1}, ValueError, "max_wait must be a float >= 0"),
        ({"max_wait": float("nan")}, ValueError, "max_wait"),
        ({"max_wait": None}, TypeError, "max_wait"),
        ({"max_concurrent_batches": 0}, ValueError, "max_concurrent_batches"),
        ({"max_queue": 0}, ValueError, "max_queue"),
        ({"timeout": 0}, ValueError, "timeout should be positive"),
        ({"queue_timeout": 0}, ValueError, "queue_timeout should be positive"),
        ({"close_timeout": -1}, ValueError, "close_timeout"),
        ({"metrics_window": 0}, ValueError, "metrics_window"),
        ({"preferred_batch_sizes": [0]}, ValueError, "preferred_batch_sizes"),
        ({"preferred_batch_sizes": [64]}, ValueError, "larger than max_batch_size"),
        ({"preferred_batch_sizes": []}, ValueError, "should not be empty"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Batcher(lambda items: items, **kwargs)


def test_an_integral_float_is_a_batch_size_as_in_ray() -> None:
    assert Batcher(lambda items: items, max_batch_size=4.0).max_batch_size == 4


def test_non_callables_are_refused() -> None:
    with pytest.raises(TypeError, match="callable batch function"):
        Batcher(42)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="collate_fn"):
        Batcher(lambda items: items, collate_fn=3)  # type: ignore[call-overload]


def test_exception_tree() -> None:
    assert issubclass(BatcherTimeoutError, TimeoutError)
    assert issubclass(BatcherTimeoutError, AloaderError)
    assert issubclass(BatchResultError, ValueError)
    for cls in (QueueFullError, BatcherClosedError, BatchResultError):
        assert issubclass(cls, AloaderError)
    assert aloader.Batcher is Batcher and aloader.batch is batch


@pytest.mark.anyio
@on_mock_clock()
async def test_metrics_are_a_plain_dict_with_exact_latencies(
    anyio_backend: object,
) -> None:
    recorder = Recorder(duration=3.0)
    async with (
        Batcher(recorder, max_batch_size=8, max_wait=2.0, max_queue=2) as b,
        anyio.create_task_group() as tg,
    ):
        await start(tg, b, 1)
        await start(tg, b, 2)
        with pytest.raises(QueueFullError):
            await b(3)
    metrics = b.metrics()
    assert type(metrics) is dict
    assert metrics["batch_size_histogram"] == {2: 1}
    assert metrics["queue_wait"]["count"] == 2
    assert metrics["queue_wait"]["p50"] == pytest.approx(2.0)
    assert metrics["queue_wait"]["p99"] == pytest.approx(2.0)
    assert metrics["execution"]["p50"] == pytest.approx(3.0)
    assert metrics["execution"]["max"] == pytest.approx(3.0)
    assert (metrics["submitted"], metrics["completed"], metrics["rejected"]) == (2, 2, 1)
    assert metrics["queued"] == 0 and metrics["running_batches"] == 0
    empty = Batcher(recorder).metrics()
    assert empty["queue_wait"] == {"count": 0, "p50": None, "p99": None, "max": None}


def test_metrics_window_bounds_the_samples() -> None:
    b = Batcher(Recorder(), metrics_window=3, max_batch_size=1)

    async def run() -> None:
        for i in range(10):
            await b(i)
        await b.aclose()

    asyncio.run(run())
    assert b.metrics()["queue_wait"]["count"] == 3
    assert b.metrics()["execution"]["count"] == 3
    assert b.metrics()["batches"] == 10


# -- a property test on a mock clock -------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gaps=st.lists(st.sampled_from([0.0, 0.0, 0.1, 0.5, 2.0]), min_size=1, max_size=30),
    max_batch_size=st.integers(1, 6),
    max_wait=st.sampled_from([0.0, 0.3, 1.0]),
    max_concurrent=st.integers(1, 3),
    duration=st.sampled_from([0.0, 0.2, 1.5]),
)
def test_every_item_is_answered_once_in_bounded_fifo_batches(
    gaps: list[float], max_batch_size: int, max_wait: float, max_concurrent: int, duration: float
) -> None:
    recorder = Recorder(lambda x: -x, duration=duration)
    results: dict[int, int] = {}
    arrival: dict[int, float] = {}

    async def one(b: Batcher[int, int], i: int) -> None:
        results[i] = await b(i)

    async def main() -> None:
        async with (
            Batcher(
                recorder,
                max_batch_size=max_batch_size,
                max_wait=max_wait,
                max_concurrent_batches=max_concurrent,
                max_queue=len(gaps),
            ) as b,
            trio.open_nursery() as nursery,
        ):
            for i, gap in enumerate(gaps):
                await trio.sleep(gap)
                arrival[i] = trio.current_time()
                nursery.start_soon(one, b, i)
                await trio.testing.wait_all_tasks_blocked()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert results == {i: -i for i in range(len(gaps))}
    assert all(1 <= len(batch) <= max_batch_size for batch in recorder.batches)
    assert sorted(x for batch in recorder.batches for x in batch) == list(range(len(gaps)))
    for batch_items, t in zip(recorder.batches, recorder.times, strict=True):
        # FIFO inside a batch, and nobody waits past max_wait while a slot is free.
        assert batch_items == sorted(batch_items)
        if max_concurrent == 1 and duration == 0:
            assert t - arrival[batch_items[0]] <= max_wait + 1e-9
    if max_concurrent == 1:
        flat = [x for batch in recorder.batches for x in batch]
        assert flat == sorted(flat)
