"""The batcher on trio: requests wait on trio's low-level park and reschedule, and time out
by one alarm task per batcher rather than a cancel scope each.

Counts, not times, for the cost (no ``trio.Event``, no ``trio.CancelScope`` per request, two
scheduler steps per lone request); the timeouts' contract on ``MockClock(autojump_threshold=0)``,
where the clock jumps to the next deadline once every task is blocked, so each caller's
deadline is checked to the instant: later requests with shorter timeouts, deadlines that the
alarm had already passed by when it was armed, answered requests that must not time out later,
and a deadline heap that stays bounded by the waiting requests and keeps no answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import math
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio
import trio.testing

from aloader import Batcher, BatcherTimeoutError
from aloader.serve import _batcher
from aloader.serve._request import _Request


def run_mock(fn: Callable[[], Any]) -> Any:
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


async def instant(items: list[int]) -> list[int]:
    return [x * 10 for x in items]


class Gate:
    """A batch function that records each batch and waits until ``open``."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.opened = trio.Event()

    def open(self) -> None:
        self.opened.set()

    async def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        await self.opened.wait()
        return [x * 10 for x in items]


async def outcome(b: Batcher[int, int], item: int, timeout: float | None,
                  into: dict[int, tuple[str, float]]) -> None:
    """Call ``b`` and record (result or "timeout", the clock when the answer came)."""
    try:
        result: Any = await b(item, timeout=timeout)
    except BatcherTimeoutError:
        result = "timeout"
    into[item] = (result, trio.current_time())


@pytest.fixture
def trio_objects(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """How many trio Events and CancelScopes are made (patched before any batcher starts)."""
    made = {"Event": 0, "CancelScope": 0}
    for name in made:
        cls = getattr(trio, name)

        def counting(*args: Any, _cls: Any = cls, _name: str = name, **kwargs: Any) -> Any:
            made[_name] += 1
            return _cls(*args, **kwargs)

        monkeypatch.setattr(trio, name, counting)
    yield made


# -- cost ----------------------------------------------------------------------------------


def test_trio_requests_make_no_event_or_cancel_scope(trio_objects: dict[str, int]) -> None:
    async def main() -> None:
        async with Batcher(instant) as b:
            await b(0, timeout=10.0)
            await trio.testing.wait_all_tasks_blocked()  # the alarm task has started
            before = dict(trio_objects)
            for i in range(50):
                assert await b(i) == i * 10
                assert await b(i, timeout=10.0) == i * 10
            made = {k: trio_objects[k] - before[k] for k in trio_objects}
        assert made == {"Event": 0, "CancelScope": 0}
        assert b.metrics()["completed"] == 101

    trio.run(main)


def test_a_lone_trio_request_costs_two_scheduler_steps() -> None:
    """The caller wakes the dispatcher, which answers it; with a timeout too (the alarm task
    sleeps through it)."""

    class Steps(trio.abc.Instrument):
        steps = 0

        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            self.steps += 1

    async def main() -> None:
        async with Batcher(instant) as b:
            assert await b(0, timeout=10.0) == 0
            await trio.testing.wait_all_tasks_blocked()  # the alarm task has started
            for timeout in (None, 10.0):
                steps = Steps()
                trio.lowlevel.add_instrument(steps)
                for i in range(100):
                    assert await b(i, timeout=timeout) == i * 10
                trio.lowlevel.remove_instrument(steps)
                assert steps.steps == 200

    trio.run(main)


def test_a_trio_request_reads_the_runs_clock_directly() -> None:
    """The batcher reads the run's own clock (its MockClock here) three times a request,
    without trio.current_time()'s two frames around it each time."""
    clock = trio.testing.MockClock()

    async def main() -> None:
        async with Batcher(instant) as b:
            assert await b(0) == 0
            reads: list[str] = []

            def profile(frame: Any, event: str, arg: Any) -> None:
                # The batcher's reads of a clock: the functions it calls named current_time.
                if (
                    event == "call"
                    and frame.f_code.co_name == "current_time"
                    and frame.f_back.f_code.co_filename == _batcher.__file__
                ):
                    reads.append(frame.f_code.co_qualname)

            sys.setprofile(profile)
            try:
                for i in range(10):
                    assert await b(i) == i * 10
            finally:
                sys.setprofile(None)
        assert reads == ["MockClock.current_time"] * 30
        assert b.metrics()["queue_wait"]["max"] == 0.0  # the MockClock stood still

    trio.run(main, clock=clock)


# -- the alarm's contract (MockClock) --------------------------------------------------------


def test_a_later_request_with_a_shorter_timeout_times_out_first() -> None:
    """The alarm, set for the first deadline, is moved earlier by a later, shorter one."""

    async def main() -> tuple[dict[int, tuple[str, float]], list[list[int]]]:
        gate = Gate()
        got: dict[int, tuple[str, float]] = {}
        async with Batcher(gate, max_batch_size=1) as b, trio.open_nursery() as nursery:
            nursery.start_soon(outcome, b, 0, None, got)  # holds the model
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(outcome, b, 1, 10.0, got)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(outcome, b, 2, 1.0, got)
            await trio.sleep(20)
            gate.open()
        return got, gate.batches

    got, batches = run_mock(main)
    assert got == {0: (0, 20.0), 1: ("timeout", 10.0), 2: ("timeout", 1.0)}
    assert batches == [[0]]


def test_each_queued_request_times_out_at_its_own_deadline() -> None:
    async def main() -> dict[int, tuple[str, float]]:
        gate = Gate()
        got: dict[int, tuple[str, float]] = {}
        async with Batcher(gate, max_batch_size=1) as b, trio.open_nursery() as nursery:
            nursery.start_soon(outcome, b, 0, None, got)
            await trio.testing.wait_all_tasks_blocked()
            for i, timeout in enumerate((3.0, 1.0, 2.0, 1.0, 5.0), start=1):
                nursery.start_soon(outcome, b, i, timeout, got)
                await trio.sleep(0.25)  # submitted at 0.25 * (i - 1)
            await trio.sleep(10)
            gate.open()
        return got

    got = run_mock(main)
    assert got[0] == (0, 11.25)
    assert {i: got[i] for i in range(1, 6)} == {
        1: ("timeout", 3.0), 2: ("timeout", 1.25), 3: ("timeout", 2.5),
        4: ("timeout", 1.75), 5: ("timeout", 6.0),
    }  # fmt: skip


def test_answered_or_cancelled_requests_never_time_out_later() -> None:
    """Their entries stay in the heap until their deadline: the alarm then skips them."""

    async def main() -> tuple[dict[str, Any], list[list[int]]]:
        gate = Gate()
        async with Batcher(gate, max_batch_size=4) as b:
            gate.open()
            assert [await b(i, timeout=1.0) for i in range(3)] == [0, 10, 20]
            gate.opened = trio.Event()
            with trio.move_on_after(0.5):
                await b(3, timeout=1.0)  # cancelled while its batch runs
            await trio.sleep(5)  # every deadline has passed
            gate.open()
            assert await b(4, timeout=1.0) == 40
        return dict(b.metrics()), gate.batches

    metrics, batches = run_mock(main)
    assert batches == [[0], [1], [2], [3], [4]]
    assert metrics["timed_out"] == 0
    assert metrics["cancelled"] == 1
    assert metrics["completed"] == 4


def test_a_request_after_an_answered_one_times_out_at_its_own_deadline() -> None:
    """The alarm is still set for the answered request's deadline when the next one comes:
    it wakes then, finds nothing due, and sleeps on until the next deadline."""

    async def main() -> dict[int, tuple[str, float]]:
        gate = Gate()
        got: dict[int, tuple[str, float]] = {}
        async with Batcher(gate, max_batch_size=1) as b:
            gate.open()
            assert await b(0, timeout=1.0) == 0
            await trio.sleep(0.5)
            gate.opened = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(outcome, b, 1, 1.0, got)  # its batch runs, blocked
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(outcome, b, 2, 2.0, got)  # queued behind it
            gate.open()
        return got

    assert run_mock(main) == {1: ("timeout", 1.5), 2: ("timeout", 2.5)}


def test_the_deadline_heap_stays_bounded_and_keeps_its_deadlines() -> None:
    """Many answered requests (dropped lazily) and then waiting ones: the heap is compacted
    as it grows, never beyond twice the waiting requests (plus a constant), and every waiting
    request still times out at its deadline, in order."""

    async def main() -> tuple[dict[int, tuple[str, float]], list[int]]:
        gate = Gate()
        got: dict[int, tuple[str, float]] = {}
        sizes: list[int] = []
        heap = None
        async with Batcher(gate, max_batch_size=1, max_queue=10_000) as b:
            heap = b._trio_timeouts.heap
            gate.open()
            for i in range(1_000):
                assert await b(i, timeout=100.0) == i * 10
                sizes.append(len(heap))
            gate.opened = trio.Event()
            async with trio.open_nursery() as nursery:
                for i in range(1_000, 1_300):
                    nursery.start_soon(outcome, b, i, 1.0 + (i % 7), got)
                    await trio.sleep(0)
                    sizes.append(len(heap))
                await trio.sleep(0.5)
                assert sum(r.state < 2 for _, _, r, _ in heap) == 300  # all waiting, all there
            gate.open()
        assert not heap  # the dispatcher's end clears it
        return got, sizes

    got, sizes = run_mock(main)
    assert max(sizes[:1_000]) == 1  # one request in flight at a time: answered ones leave at once
    assert max(sizes) <= 2 * 300 + 64
    assert sorted(got) == list(range(1_000, 1_300))
    for i in range(1_000, 1_300):
        result, when = got[i]
        assert result == "timeout"
        assert when == pytest.approx(1.0 + (i % 7))


def test_the_heap_keeps_no_answer() -> None:
    """A caller takes its result (or error) out of its request: the request may wait in the
    deadline heap until its deadline (here behind a waiting one with an earlier deadline), its
    result must not."""

    class Payload:
        pass

    refs: list[weakref.ref[Payload]] = []
    gate = trio.Event()

    async def model(items: list[int]) -> list[Any]:
        if items == [-1]:
            await gate.wait()
            return items
        out: list[Any] = []
        for x in items:
            if x % 2:
                out.append(ValueError(x))
            else:
                payload = Payload()
                refs.append(weakref.ref(payload))
                out.append(payload)
        return out

    async def main() -> None:
        async with Batcher(model, max_batch_size=1, max_concurrent_batches=2) as b, \
                trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(b, -1, timeout=30.0))
            await trio.testing.wait_all_tasks_blocked()
            for i in range(10):
                with contextlib.suppress(ValueError):
                    await b(i, timeout=60.0)
            heap = b._trio_timeouts.heap
            assert len(heap) == 11
            gc.collect()
            assert [ref() for ref in refs] == [None] * 5
            held = [r for _, _, r, _ in heap]
            assert all(type(r) is _Request for r in held)
            assert all(r.result is None and r.error is None and r.tb is None for r in held)
            gate.set()

    trio.run(main)


@pytest.mark.anyio
async def test_an_infinite_timeout_waits_without_a_timer(anyio_backend: str) -> None:
    async with Batcher(instant, timeout=math.inf) as b:
        assert await b(1) == 10
        assert await b(2, timeout=math.inf) == 20
        assert not b._trio_timeouts.heap
        assert pending_timers() == 0
    assert b.metrics()["completed"] == 2


def pending_timers() -> int:
    """asyncio timers of the running loop not cancelled yet (0 on trio)."""
    try:
        loop: Any = asyncio.get_running_loop()
    except RuntimeError:
        return 0
    return sum(not handle.cancelled() for handle in loop._scheduled)
