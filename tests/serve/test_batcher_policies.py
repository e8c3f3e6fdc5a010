"""The batcher's policies, each on asyncio and trio, with exact assertions.

Cost budgets (``max_batch_cost`` with ``cost``: no batch above the budget, a batch closes
before the item that would exceed it), priorities (order of service) and their bounded wait
(``promote_after``: no starvation), preferred batch sizes, queue deadlines (``queue_timeout``:
dropped before the batch runs), adaptive wait (while every slot is busy the next batch keeps
filling), an ``async with`` body's exception leaving as itself, and the metrics' resolution
under uvloop.

The batch function is held at a gate while requests queue, so which requests make which batch
is decided by the policy alone, never by timing; time-dependent cases (promotion, deadlines)
run on trio's ``MockClock`` too, where each instant is exact.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import anyio
import pytest
import trio
import trio.testing
from test_batcher import Recorder, on_mock_clock, start

from aloader import BatchCostError, Batcher, BatcherTimeoutError

pytestmark = pytest.mark.anyio


async def queue_behind_a_held_batch(
    tg: anyio.abc.TaskGroup, b: Batcher[Any, Any], recorder: Recorder, first: Any,
    requests: list[tuple[Any, dict[str, Any]]],
) -> list[Any]:
    """Run ``first`` alone and hold it; queue ``requests`` (item, call options) in order
    behind it; return their callers (release with ``recorder.release()``)."""
    recorder.hold()
    await start(tg, b, first)
    await recorder.wait_running(1)
    return [await start(tg, b, item, **options) for item, options in requests]


# -- cost budgets -------------------------------------------------------------------------------


async def test_no_batch_costs_more_than_the_budget(anyio_backend: Any) -> None:
    recorder = Recorder(lambda x: x.upper())
    costs = {"x": 1, "aaaa": 4, "bbbb": 4, "cccc": 4, "ddd": 3, "eee": 3, "fffffffff": 9,
             "g": 1, "hhhhhhhhhh": 10}  # fmt: skip
    async with (
        Batcher(recorder, max_batch_size=100, cost=len, max_batch_cost=10) as b,
        anyio.create_task_group() as tg,
    ):
        callers = await queue_behind_a_held_batch(
            tg, b, recorder, "x", [(item, {}) for item in costs if item != "x"]
        )
        recorder.release()
    assert recorder.batches == [
        ["x"], ["aaaa", "bbbb"], ["cccc", "ddd", "eee"], ["fffffffff", "g"], ["hhhhhhhhhh"],
    ]  # fmt: skip
    assert all(sum(map(len, batch)) <= 10 for batch in recorder.batches)
    assert [c.result for c in callers] == [item.upper() for item in costs if item != "x"]


async def test_an_item_costing_more_than_a_batch_is_refused_unless_allowed(
    anyio_backend: Any,
) -> None:
    recorder = Recorder()
    async with Batcher(recorder, cost=abs, max_batch_cost=5) as b:
        with pytest.raises(BatchCostError, match="alone exceeds max_batch_cost=5") as info:
            await b(6)
        assert isinstance(info.value, RuntimeError)
        assert b.metrics()["submitted"] == 0
        assert await b(5) == 50
    allowed = Recorder()
    async with (
        Batcher(allowed, cost=abs, max_batch_cost=5, allow_oversized=True) as b,
        anyio.create_task_group() as tg,
    ):
        await queue_behind_a_held_batch(tg, b, allowed, 1, [(2, {}), (9, {}), (3, {})])
        allowed.release()
    assert allowed.batches == [[1], [2], [9], [3]]  # the oversized one alone, in its place


@pytest.mark.parametrize(
    ("cost", "error", "message"),
    [
        (lambda x: 1 / 0, ZeroDivisionError, "division"),
        (lambda x: -1, ValueError, "cost must return a finite number >= 0"),
        (lambda x: float("nan"), ValueError, "finite number"),
        (lambda x: "3", TypeError, "cost must return a number"),
        (lambda x: True, TypeError, "cost must return a number"),
    ],
)
async def test_a_bad_cost_fails_its_caller_alone(
    anyio_backend: Any, cost: Any, error: type[Exception], message: str
) -> None:
    recorder = Recorder()

    def costs(x: int) -> Any:
        return cost(x) if x == 13 else 1

    async with Batcher(recorder, cost=costs, max_batch_cost=4) as b:
        with pytest.raises(error, match=message):
            await b(13)
        assert await b(2) == 20
    assert recorder.batches == [[2]]


# -- priorities ---------------------------------------------------------------------------------


async def test_higher_priorities_are_served_first_oldest_first(anyio_backend: Any) -> None:
    recorder = Recorder()
    async with (
        Batcher(recorder, max_batch_size=2, promote_after=None) as b,
        anyio.create_task_group() as tg,
    ):
        order = [("a", 0), ("b", 1), ("c", 2), ("d", 0), ("e", 2), ("f", 1), ("g", -5)]
        await queue_behind_a_held_batch(
            tg, b, recorder, "first", [(item, {"priority": p}) for item, p in order]
        )
        recorder.release()
    assert recorder.batches == [["first"], ["c", "e"], ["b", "f"], ["a", "d"], ["g"]]


async def test_priorities_and_costs_together(anyio_backend: Any) -> None:
    recorder = Recorder()
    async with (
        Batcher(recorder, cost=lambda x: x, max_batch_cost=6, promote_after=None) as b,
        anyio.create_task_group() as tg,
    ):
        order = [(4, 0), (3, 1), (3, 1), (1, 0), (5, 2)]
        await queue_behind_a_held_batch(
            tg, b, recorder, 0, [(item, {"priority": p}) for item, p in order]
        )
        recorder.release()
    # 5 (p2) then 3 would exceed 6: closes; 3 3 (p1); 4 1 (p0).
    assert recorder.batches == [[0], [5], [3, 3], [4, 1]]


async def test_a_bad_priority_is_refused(anyio_backend: Any) -> None:
    async with Batcher(Recorder()) as b:
        for bad in (None, "1", 1.5, True):
            with pytest.raises(TypeError, match="priority must be an integer"):
                await b(1, priority=bad)  # type: ignore[arg-type]
        assert b.metrics()["submitted"] == 0


async def test_a_long_wait_promotes_a_low_priority(anyio_backend: Any) -> None:
    """On real clocks: the low-priority request waited longer than promote_after when the
    batch formed, so it goes before the newer high-priority ones."""
    recorder = Recorder()
    async with (
        Batcher(recorder, max_batch_size=1, promote_after=0.01) as b,
        anyio.create_task_group() as tg,
    ):
        recorder.hold()
        await start(tg, b, "first")
        await recorder.wait_running(1)
        await start(tg, b, "low", priority=0)
        await anyio.sleep(0.02)  # older than promote_after, whatever the clock's grain
        for item in ("high1", "high2"):
            await start(tg, b, item, priority=5)
        recorder.release()
    assert recorder.batches == [["first"], ["low"], ["high1"], ["high2"]]


async def high_priority_stream(promote_after: float | None) -> Recorder:
    """Batches of one take 1 s; a low-priority request queues at t=0 behind "h0", and a
    high-priority one arrives every 0.5 s, more than the model serves (on a MockClock)."""
    recorder = Recorder(duration=1.0)
    async with (
        Batcher(recorder, max_batch_size=1, promote_after=promote_after, max_queue=100) as b,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(functools.partial(b, "h0", priority=5))
        await trio.testing.wait_all_tasks_blocked()
        tg.start_soon(functools.partial(b, "low", priority=0))
        for i in range(1, 12):
            await trio.sleep(0.5)
            tg.start_soon(functools.partial(b, f"h{i}", priority=5))
    assert b.metrics()["completed"] == 13  # every request is served in the end
    return recorder


@on_mock_clock()
async def test_no_priority_starves_under_a_stream_of_higher_ones(anyio_backend: Any) -> None:
    """The low one is served by the first batch formed after it has waited promote_after=2.5
    s: at t=3, after h0, h1 and h2. With strict priorities it is served last."""
    t0 = trio.current_time()
    recorder = await high_priority_stream(promote_after=2.5)
    starts = {batch[0]: t - t0 for batch, t in zip(recorder.batches, recorder.times, strict=True)}
    assert starts["low"] == 3.0
    assert [batch[0] for batch in recorder.batches[:4]] == ["h0", "h1", "h2", "low"]
    strict = await high_priority_stream(promote_after=None)
    assert strict.batches[-1] == ["low"]


# -- preferred batch sizes ----------------------------------------------------------------------


@on_mock_clock()
async def test_a_preferred_size_goes_out_without_waiting(anyio_backend: Any) -> None:
    recorder = Recorder()
    t0 = trio.current_time()
    async with (
        Batcher(recorder, max_batch_size=8, max_wait=10.0, preferred_batch_sizes=[2, 4]) as b,
        anyio.create_task_group() as tg,
    ):
        for i in range(5):
            await start(tg, b, i)
    assert recorder.batches == [[0, 1], [2, 3], [4]]
    assert [t - t0 for t in recorder.times] == [0.0, 0.0, 10.0]  # the last one waited max_wait


# -- queue deadlines ----------------------------------------------------------------------------


async def test_a_request_whose_deadline_passed_in_the_queue_is_dropped(
    anyio_backend: Any,
) -> None:
    recorder = Recorder()
    async with Batcher(recorder, max_batch_size=4) as b, anyio.create_task_group() as tg:
        recorder.hold()
        await start(tg, b, "running", queue_timeout=0.001)  # started at once: never dropped
        await recorder.wait_running(1)
        late = await start(tg, b, "late", queue_timeout=0.001)
        kept = await start(tg, b, "kept")
        await late.done.wait()  # dropped while the model is busy
        recorder.release()
    assert isinstance(late.error, BatcherTimeoutError)
    assert "dropped" in str(late.error) and "queue_timeout" in str(late.error)
    assert kept.result == "keptkeptkeptkeptkeptkeptkeptkeptkeptkept"
    assert recorder.batches == [["running"], ["kept"]]
    metrics = b.metrics()
    assert (metrics["dropped"], metrics["timed_out"], metrics["completed"]) == (1, 0, 2)


@on_mock_clock()
async def test_queue_deadlines_to_the_instant(anyio_backend: Any) -> None:
    """Batches take 2 s. A request queued at t=0 with queue_timeout=1 is dropped at t=1; one
    with 3 s starts at t=2 (in time) and is served although its batch ends after t=3; a
    batcher default applies unless a call overrides it."""
    recorder = Recorder(duration=2.0)
    outcome: dict[str, tuple[str, float]] = {}

    async def call(b: Batcher[str, str], item: str, **options: Any) -> None:
        try:
            await b(item, **options)
            outcome[item] = ("served", trio.current_time() - t0)
        except BatcherTimeoutError:
            outcome[item] = ("dropped", trio.current_time() - t0)

    t0 = trio.current_time()
    async with (
        Batcher(recorder, max_batch_size=1, queue_timeout=1.0) as b,
        anyio.create_task_group() as tg,
    ):
        for item, options in [("busy", {}), ("short", {}), ("long", {"queue_timeout": 3.0}),
                              ("none", {"queue_timeout": None})]:  # fmt: skip
            tg.start_soon(functools.partial(call, b, item, **options))
            await trio.testing.wait_all_tasks_blocked()
    assert outcome == {
        "busy": ("served", 2.0),
        "short": ("dropped", 1.0),
        "long": ("served", 4.0),
        "none": ("served", 6.0),
    }
    assert recorder.batches == [["busy"], ["long"], ["none"]]


# -- adaptive wait ------------------------------------------------------------------------------


async def test_while_every_slot_is_busy_the_next_batch_keeps_filling(
    anyio_backend: Any,
) -> None:
    recorder = Recorder()
    async with (
        Batcher(recorder, max_batch_size=8, max_concurrent_batches=2) as b,
        anyio.create_task_group() as tg,
    ):
        recorder.hold()
        await start(tg, b, 1)
        await recorder.wait_running(1)
        await start(tg, b, 2)
        await recorder.wait_running(2)  # both slots busy
        for item in range(3, 8):
            await start(tg, b, item)
        assert b.metrics()["queued"] == 5 and len(recorder.batches) == 2
        recorder.release()
    assert recorder.batches == [[1], [2], [3, 4, 5, 6, 7]]


@on_mock_clock()
async def test_max_wait_passed_while_slots_are_busy_forms_one_batch(anyio_backend: Any) -> None:
    """The oldest request's max_wait passes while the model is busy: nothing is dispatched
    (no slot), the queue keeps filling, and the moment the slot frees everything queued goes
    out in one batch."""
    recorder = Recorder(duration=5.0)
    t0 = trio.current_time()
    async with (
        Batcher(recorder, max_batch_size=8, max_wait=1.0) as b,
        anyio.create_task_group() as tg,
    ):
        await start(tg, b, 0)
        await trio.sleep(1.0)  # batch [0] runs from t=1 to t=6
        for item in range(1, 5):
            await start(tg, b, item)
            await trio.sleep(1.0)
    assert recorder.batches == [[0], [1, 2, 3, 4]]
    assert [t - t0 for t in recorder.times] == [1.0, 6.0]


# -- the async with block -----------------------------------------------------------------------


class Boom(Exception):
    pass


async def test_an_exception_in_the_body_leaves_as_itself(anyio_backend: Any) -> None:
    recorder = Recorder()
    with pytest.raises(Boom) as info:
        async with Batcher(recorder) as b:
            assert await b(1) == 10
            raise Boom("from the body")
    assert type(info.value) is Boom and str(info.value) == "from the body"
    # With a request in flight: the exit drains it (answered), then the KeyError leaves.
    async with anyio.create_task_group() as tg:
        with pytest.raises(KeyError):
            async with Batcher(recorder) as b:
                recorder.hold()
                caller = await start(tg, b, 2)
                await recorder.wait_running(1)
                tg.start_soon(release_after_a_step, recorder)
                raise KeyError("k")
    assert caller.result == 20 and b.closed


async def release_after_a_step(recorder: Recorder) -> None:
    await anyio.sleep(0)
    recorder.release()


async def test_a_cancelled_body_is_cancelled_cleanly(anyio_backend: Any) -> None:
    recorder = Recorder()
    with anyio.CancelScope() as scope:
        async with Batcher(recorder) as b:
            assert await b(1) == 10
            scope.cancel()
            await anyio.sleep(1)
    assert scope.cancelled_caught and b.closed


# -- metrics under uvloop -----------------------------------------------------------------------


def test_metrics_keep_microseconds_under_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def instant(items: list[int]) -> list[int]:
        return items

    async def main() -> Batcher[int, int]:
        async with Batcher(instant) as b:
            for i in range(20):
                assert await b(i) == i
            # uvloop's loop.time() counts whole milliseconds; the batcher reads finer.
            assert b._binding.now is time.monotonic
        return b

    b = uvloop.run(main())
    metrics = b.metrics()
    assert metrics["execution"]["count"] == 20
    # An instant batch measured on a millisecond clock reads 0.0 nearly always.
    assert metrics["execution"]["max"] is not None and 0 < metrics["execution"]["max"] < 0.5
