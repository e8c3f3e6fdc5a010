"""The batcher's hot path: what each request and each batch costs, counted, and the contracts
of the plain-future waits and loop-timer timeouts behind it.

Counts, not times: loop steps per request, anyio objects made per request, the loop step a
batch starts in. The timeouts on asyncio are loop timers (no cancel scope), so they are
checked here on asyncio with real (short) deadlines against gated batch functions: whatever
the clock does, the gate holds the batch until the deadline has passed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aloader
from aloader import Batcher, BatcherClosedError, BatcherTimeoutError


class StepCounter:
    """Counts the running asyncio loop's steps (iterations of ``_run_once``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.steps = 0
        self._loop: Any = loop
        self._run_once = loop._run_once  # type: ignore[attr-defined]

    def __enter__(self) -> StepCounter:
        def run_once() -> None:
            self.steps += 1
            self._run_once()

        self._loop._run_once = run_once
        return self

    def __exit__(self, *exc: object) -> None:
        del self._loop._run_once


async def instant(items: list[Any]) -> list[Any]:
    return [x * 10 for x in items]


@pytest.fixture
def anyio_objects(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """How many anyio Events and CancelScopes the code under test creates."""
    made = {"Event": 0, "CancelScope": 0}
    for name in made:
        cls = getattr(anyio, name)

        def counting(*args: Any, _cls: Any = cls, _name: str = name, **kwargs: Any) -> Any:
            made[_name] += 1
            return _cls(*args, **kwargs)

        monkeypatch.setattr(f"aloader.serve._batcher.anyio.{name}", counting)
    yield made


# -- counts --------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_lone_request_costs_two_loop_steps() -> None:
    """The caller wakes the dispatcher, which answers it: no step more (asyncio)."""
    async with Batcher(instant) as b:
        assert await b(0) == 0
        for timeout in (None, 10.0):
            with StepCounter(asyncio.get_running_loop()) as counter:
                for i in range(100):
                    assert await b(i, timeout=timeout) == i * 10
            assert counter.steps == 200


@pytest.mark.anyio
async def test_requests_make_no_anyio_event_or_cancel_scope(
    anyio_backend: str, anyio_objects: dict[str, int]
) -> None:
    """Requests wait on the loop's plain waiters, not on anyio Events (each of which looks up
    the running library); on asyncio a timeout is a loop timer, not a cancel scope."""
    async with Batcher(instant) as b:
        await b(0)
        before = dict(anyio_objects)
        for i in range(50):
            assert await b(i) == i * 10
            assert await b(i, timeout=10.0) == i * 10
        made = {k: anyio_objects[k] - before[k] for k in anyio_objects}
    assert made["Event"] == 0
    if anyio_backend == "asyncio":
        assert made["CancelScope"] == 0


@pytest.mark.asyncio
async def test_the_next_batch_starts_in_the_step_the_previous_one_ended() -> None:
    """Under load the dispatcher takes the next batch at once, in the same loop step."""
    loop = asyncio.get_running_loop()
    marks: list[tuple[str, int]] = []
    counter = StepCounter(loop)

    async def model(items: list[int]) -> list[int]:
        marks.append(("start", counter.steps))
        await asyncio.sleep(0)
        marks.append(("end", counter.steps))
        return items

    with counter:
        async with Batcher(model, max_batch_size=4) as b:
            results = await asyncio.gather(*(b(i) for i in range(16)))
    assert results == list(range(16))
    assert len(marks) >= 8
    ends = [step for kind, step in marks if kind == "end"]
    starts = [step for kind, step in marks if kind == "start"]
    assert starts[1:] == ends[:-1]


# -- plain-future waits ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_caller_cancelled_as_its_batch_ends_leaves_the_others_served() -> None:
    """asyncio: a cancelled caller's future is cancelled at once, before its task runs again,
    so the batch may end with that future already done: it is skipped, never set twice (an
    InvalidStateError would kill the dispatcher), and the others get their results."""
    gate = asyncio.Event()

    async def model(items: list[int]) -> list[int]:
        await gate.wait()
        return [x * 10 for x in items]

    async with Batcher(model, max_batch_size=4) as b:
        tasks = [asyncio.ensure_future(b(i)) for i in range(4)]  # queued in one step: one batch
        while b.metrics()["running_batches"] == 0:
            await asyncio.sleep(0)
        gate.set()  # the batch ends in the next step ...
        tasks[1].cancel()  # ... after this caller's future was cancelled, its task not yet run
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert await b(7) == 70  # the dispatcher lives on
    assert results[0] == 0 and results[2] == 20 and results[3] == 30
    assert isinstance(results[1], asyncio.CancelledError)
    metrics = b.metrics()
    assert metrics["batch_size_histogram"] == {1: 1, 4: 1}
    assert metrics["completed"] + metrics["cancelled"] == 5


@pytest.mark.asyncio
async def test_closing_with_a_batch_running_fails_its_callers() -> None:
    gate = asyncio.Event()

    async def model(items: list[int]) -> list[int]:
        await gate.wait()
        return items

    b = Batcher(model, max_batch_size=2)
    first = asyncio.ensure_future(b(1))
    while b.metrics()["running_batches"] == 0:
        await asyncio.sleep(0)
    queued = asyncio.ensure_future(b(2))
    await asyncio.sleep(0)
    await b.aclose(timeout=0)
    for task in (first, queued):
        with pytest.raises(BatcherClosedError):
            await task


# -- loop-timer timeouts (asyncio) ----------------------------------------------------------


@pytest.mark.asyncio
async def test_timeout_while_queued_leaves_the_queue_at_the_deadline() -> None:
    gate = asyncio.Event()
    batches: list[list[int]] = []

    async def model(items: list[int]) -> list[int]:
        batches.append(list(items))
        await gate.wait()
        return [x * 10 for x in items]

    async with Batcher(model, max_batch_size=4) as b:
        first = asyncio.ensure_future(b(0))
        while not batches:
            await asyncio.sleep(0)
        late = asyncio.ensure_future(b(1, timeout=0.01))
        patient = asyncio.ensure_future(b(2))
        with pytest.raises(BatcherTimeoutError, match="within 0.01 s") as info:
            await late
        assert info.value.__suppress_context__
        assert b.metrics()["queued"] == 1  # gone from the queue at once
        assert not late.cancelled()
        gate.set()
        assert await first == 0
        assert await patient == 20
    assert batches == [[0], [2]]  # the late item never reached the batch function
    metrics = b.metrics()
    assert metrics["timed_out"] == 1 and metrics["completed"] == 2 and metrics["cancelled"] == 0


@pytest.mark.asyncio
async def test_timeout_while_running_lets_the_batch_go_on() -> None:
    gate = asyncio.Event()
    finished: list[list[int]] = []

    async def model(items: list[int]) -> list[int]:
        await gate.wait()
        finished.append(items)
        return [x * 10 for x in items]

    async with Batcher(model, max_batch_size=2, max_wait=60.0) as b:
        late = asyncio.ensure_future(b(1, timeout=0.01))
        other = asyncio.ensure_future(b(2))
        with pytest.raises(BatcherTimeoutError):
            await late
        assert b.metrics()["running_batches"] == 1  # the batch goes on for the other caller
        gate.set()
        assert await other == 20
    assert finished == [[1, 2]]
    metrics = b.metrics()
    assert metrics["timed_out"] == 1 and metrics["completed"] == 1


@pytest.mark.asyncio
async def test_a_served_request_is_never_timed_out_later() -> None:
    """The timer of a request answered in time is cancelled: nothing fires afterwards."""
    loop = asyncio.get_running_loop()
    async with Batcher(instant) as b:
        before = sum(1 for h in loop._scheduled if not h.cancelled())  # type: ignore[attr-defined]
        assert [await b(i, timeout=0.02) for i in range(20)] == [i * 10 for i in range(20)]
        live = sum(1 for h in loop._scheduled if not h.cancelled())  # type: ignore[attr-defined]
        assert live == before
        await asyncio.sleep(0.05)
        assert await b(3) == 30
    metrics = b.metrics()
    assert metrics["timed_out"] == 0 and metrics["completed"] == 21


@pytest.mark.asyncio
async def test_a_cancelled_caller_with_a_timeout_counts_as_cancelled() -> None:
    gate = asyncio.Event()

    async def model(items: list[int]) -> list[int]:
        await gate.wait()
        return items

    async with Batcher(model) as b:
        task = asyncio.ensure_future(b(1, timeout=30.0))
        while b.metrics()["running_batches"] == 0:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        assert await b(2) == 2
    metrics = b.metrics()
    assert metrics["cancelled"] == 1 and metrics["timed_out"] == 0


@pytest.mark.anyio
async def test_timeouts_on_both_backends(anyio_backend: str) -> None:
    gate = anyio.Event()

    async def model(items: list[int]) -> list[int]:
        await gate.wait()
        return items

    async with Batcher(model, max_batch_size=1) as b, anyio.create_task_group() as tg:
        tg.start_soon(b, 0)
        while b.metrics()["running_batches"] == 0:
            await anyio.sleep(0)
        with pytest.raises(aloader.BatcherTimeoutError):
            await b(1, timeout=0.01)
        gate.set()
        assert await b(2, timeout=30.0) == 2
    assert b.metrics()["timed_out"] == 1
