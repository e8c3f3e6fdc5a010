"""Attacks on the batcher's waiters, timers and states: many concurrent callers with random
timeouts and cancellations against a batch function that raises, returns the wrong length,
returns per-item errors or sleeps; a timeout at the instant of the flush; a caller cancelled
while its batch runs; a hanging batch function; closing with requests waiting. Every caller
gets exactly its own result or a clear error, nothing hangs (``anyio.fail_after``), the
metrics add up, and no request (waiter) or timer outlives its call.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import math
import random
import threading
from typing import Any

import anyio
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aloader import (
    BatchCostError,
    Batcher,
    BatcherClosedError,
    BatcherTimeoutError,
    BatchResultError,
)
from aloader.serve._request import _Request

pytestmark = pytest.mark.hostile


class Boom(Exception):
    pass


def live_requests() -> int:
    gc.collect()
    return sum(type(obj) is _Request for obj in gc.get_objects())


def pending_timers() -> int:
    """asyncio timers of the running loop not cancelled yet (0 on trio)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return 0
    return sum(not handle.cancelled() for handle in loop._scheduled)  # type: ignore[attr-defined]


def accounted(metrics: dict[str, Any]) -> int:
    return (metrics["completed"] + metrics["failed"] + metrics["timed_out"]
            + metrics["cancelled"])


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [0])
async def test_many_callers_each_get_their_own_answer(seed: int, anyio_backend: str) -> None:
    rng = random.Random(seed)
    before = live_requests()

    async def fn(items: list[int]) -> Any:
        roll = rng.random()
        await anyio.sleep(rng.choice([0, 0, 0.001]))
        if roll < 0.1:
            raise Boom(list(items))
        if roll < 0.15:
            return [("r", x) for x in items][1:]  # one result short
        if roll < 0.25:
            return [Boom(x) if x % 3 == 0 else ("r", x) for x in items]
        return [("r", x) for x in items]

    batcher = Batcher(fn, max_batch_size=rng.choice([1, 4, 16]),
                      max_wait=rng.choice([0, 0.001]),
                      max_concurrent_batches=rng.choice([1, 3]), max_queue=10_000)
    outcomes: dict[int, str] = {}

    async def caller(i: int, group: Any) -> None:
        await anyio.sleep(rng.random() * 0.005)
        timeout = rng.choice([None, None, 0.001, 0.003, 0.05])
        with anyio.CancelScope() as scope:
            if rng.random() < 0.1:
                async def cancel_soon() -> None:
                    await anyio.sleep(rng.random() * 0.003)
                    scope.cancel()
                group.start_soon(cancel_soon)
            try:
                assert await batcher(i, timeout=timeout) == ("r", i)
                outcomes[i] = "ok"
            except BatcherTimeoutError:
                outcomes[i] = "timeout"
            except BatchResultError as exc:
                assert "returned" in str(exc)
                outcomes[i] = "bad length"
            except Boom as exc:
                # Its own item's error, or its batch's (which holds its item).
                assert exc.args[0] == i or i in exc.args[0]
                outcomes[i] = "error"
        if scope.cancelled_caught:
            outcomes[i] = "cancelled"

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            for i in range(150):
                group.start_soon(caller, i, group)
        await batcher.aclose()
    assert len(outcomes) == 150
    metrics = batcher.metrics()
    assert metrics["submitted"] == 150 == accounted(dict(metrics))
    assert metrics["queued"] == metrics["running_batches"] == 0
    # A caller cancelled after its answer came, before it resumed, counts as completed.
    assert metrics["completed"] >= sum(v == "ok" for v in outcomes.values())
    assert pending_timers() == 0
    assert live_requests() == before


def test_a_timeout_at_the_instant_of_the_flush() -> None:
    # max_wait == timeout on trio's MockClock: the batch goes out at the instant the callers
    # time out. Either way each caller gets its own result or a timeout, and nothing hangs.
    async def main(delay: float) -> tuple[dict[int, Any], list[list[int]], Any]:
        seen: list[list[int]] = []

        async def fn(items: list[int]) -> list[int]:
            seen.append(list(items))
            await anyio.sleep(delay)
            return [x * 10 for x in items]

        batcher = Batcher(fn, max_batch_size=8, max_wait=1.0)
        got: dict[int, Any] = {}

        async def call(i: int) -> None:
            try:
                got[i] = await batcher(i, timeout=1.0)
            except BatcherTimeoutError:
                got[i] = "timeout"

        with anyio.fail_after(100):
            async with anyio.create_task_group() as group:
                for i in range(3):
                    group.start_soon(call, i)
            await batcher.aclose()
        return got, seen, batcher.metrics()

    for delay in (0, 0.5):
        got, seen, metrics = trio.run(main, delay,
                                      clock=trio.testing.MockClock(autojump_threshold=0))
        assert sorted(got) == [0, 1, 2]
        for i, answer in got.items():
            assert answer in (i * 10, "timeout")
        assert metrics["timed_out"] == sum(a == "timeout" for a in got.values())
        assert metrics["completed"] == 3 - metrics["timed_out"]
        batched = [x for batch in seen for x in batch]
        assert len(batched) == len(set(batched)) and set(batched) <= {0, 1, 2}
        # An answer came from a batch; a caller timed out before the flush left no item.
        assert {i for i, a in got.items() if a != "timeout"} <= set(batched)


@pytest.mark.anyio
async def test_a_caller_cancelled_while_its_batch_runs(anyio_backend: str) -> None:
    started, release = anyio.Event(), anyio.Event()
    calls: list[list[int]] = []

    async def fn(items: list[int]) -> list[int]:
        calls.append(list(items))
        started.set()
        await release.wait()
        return [x + 100 for x in items]

    got: dict[int, Any] = {}
    with anyio.fail_after(10):
        # A batch of exactly the two (trio may start either caller first: a batch the
        # first fills alone would not hold the other).
        async with Batcher(fn, max_batch_size=2, max_wait=10) as batcher, \
                anyio.create_task_group() as group:
            async def call(i: int, scope: anyio.CancelScope | None = None) -> None:
                if scope is None:
                    got[i] = await batcher(i)
                    return
                with scope:
                    got[i] = await batcher(i)

            victim = anyio.CancelScope()
            group.start_soon(call, 1, victim)
            group.start_soon(call, 2)
            await started.wait()
            victim.cancel()
            await anyio.sleep(0.01)
            release.set()
        metrics = batcher.metrics()
    assert calls == [[1, 2]] or calls == [[2, 1]]
    assert got == {2: 102}
    assert metrics["cancelled"] == 1 and metrics["completed"] == 1


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["async", "thread"])
async def test_closing_with_requests_waiting_on_a_hanging_batch(kind: str,
                                                                anyio_backend: str) -> None:
    gate = threading.Event()

    def hang_in_thread(items: list[int]) -> list[int]:
        gate.wait(10)
        return items

    async def hang(items: list[int]) -> list[int]:
        await anyio.sleep_forever()
        raise AssertionError

    batcher = Batcher(hang if kind == "async" else hang_in_thread, max_batch_size=2,
                      max_wait=0.001, close_timeout=0.05)
    got: dict[int, str] = {}

    async def call(i: int, timeout: float | None = None) -> None:
        try:
            await batcher(i, timeout=timeout)
            got[i] = "result"
        except Exception as exc:
            got[i] = type(exc).__name__

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                for i in range(5):
                    group.start_soon(call, i)
                group.start_soon(call, 99, 0.01)
                while 99 not in got:  # queued behind the hanging batch until its timeout
                    await anyio.sleep(0.005)
                await batcher.aclose()
    finally:
        gate.set()
    assert got == {99: "BatcherTimeoutError", **{i: "BatcherClosedError" for i in range(5)}}
    metrics = batcher.metrics()
    assert metrics["submitted"] == 6 == accounted(dict(metrics))
    assert metrics["queued"] == metrics["running_batches"] == 0
    with pytest.raises(BatcherClosedError):
        await batcher(7)


@pytest.mark.anyio
async def test_queued_requests_drain_at_once_when_closed(anyio_backend: str) -> None:
    # A long max_wait does not hold a closing batcher: what is queued goes out at once.
    batches: list[list[int]] = []

    async def fn(items: list[int]) -> list[int]:
        batches.append(list(items))
        return items

    got: list[int] = []
    with anyio.fail_after(10):
        async with Batcher(fn, max_batch_size=64, max_wait=3600) as batcher, \
                anyio.create_task_group() as group:
            async def call(i: int) -> None:
                got.append(await batcher(i))

            for i in range(10):
                group.start_soon(call, i)
            await anyio.sleep(0.01)
            group.start_soon(batcher.aclose)
    assert sorted(got) == list(range(10))
    assert sorted(x for batch in batches for x in batch) == list(range(10))


# -- budgets, priorities, deadlines and streams under attack -------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.0, 0.3, 1.0]),  # gap before the call
            st.integers(0, 12),  # cost (12 > the budget: refused unless allowed)
            st.integers(-2, 2),  # priority
            st.sampled_from([None, None, 0.5, 3.0]),  # queue_timeout
        ),
        min_size=1,
        max_size=30,
    ),
    budget=st.sampled_from([5, 10]),
    max_batch_size=st.integers(1, 6),
    max_wait=st.sampled_from([0.0, 0.5]),
    promote_after=st.sampled_from([None, 0.0, 1.0]),
    allow_oversized=st.booleans(),
    duration=st.sampled_from([0.0, 0.4, 1.5]),
)
def test_every_request_is_answered_once_and_no_batch_exceeds_a_budget(
    calls: list[tuple[float, int, int, float | None]],
    budget: int,
    max_batch_size: int,
    max_wait: float,
    promote_after: float | None,
    allow_oversized: bool,
    duration: float,
) -> None:
    """Random arrivals, costs, priorities and queue deadlines on a MockClock: every call ends
    once (served with its own result, refused for its cost, or dropped by its deadline), no
    batch holds more than max_batch_size items or costs more than the budget (an oversized
    item, where allowed, alone), and requests of one priority that are served are served in
    the order they came."""
    costs = {i: cost for i, (_, cost, _, _) in enumerate(calls)}
    batches: list[list[int]] = []
    outcome: dict[int, str] = {}

    async def model(items: list[int]) -> list[int]:
        batches.append(list(items))
        await trio.sleep(duration)
        return [-i for i in items]

    async def call(
        b: Batcher[int, int], i: int, priority: int, queue_timeout: float | None
    ) -> None:
        try:
            result = await b(i, priority=priority, queue_timeout=queue_timeout)
            outcome[i] = "served" if result == -i else f"wrong {result}"
        except BatchCostError:
            outcome[i] = "refused"
        except BatcherTimeoutError:
            outcome[i] = "dropped"

    async def main() -> None:
        async with (
            Batcher(
                model, max_batch_size=max_batch_size, max_wait=max_wait, cost=costs.__getitem__,
                max_batch_cost=budget, allow_oversized=allow_oversized,
                promote_after=promote_after, max_queue=len(calls),
            ) as b,
            trio.open_nursery() as nursery,
        ):
            for i, (gap, _, priority, queue_timeout) in enumerate(calls):
                await trio.sleep(gap)
                nursery.start_soon(call, b, i, priority, queue_timeout)
                await trio.testing.wait_all_tasks_blocked()
        metrics = b.metrics()
        assert metrics["dropped"] == sum(v == "dropped" for v in outcome.values())
        assert metrics["queued"] == 0 and not b._queue.fifo and not b._queue.levels

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert set(outcome) == set(range(len(calls)))
    assert not [v for v in outcome.values() if v.startswith("wrong")]
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == sorted(i for i, v in outcome.items() if v == "served")
    for batch in batches:
        assert 1 <= len(batch) <= max_batch_size
        total = sum(costs[i] for i in batch)
        assert total <= budget or (allow_oversized and len(batch) == 1)
    for i, v in outcome.items():
        assert (v == "refused") == (costs[i] > budget and not allow_oversized)
    for priority in range(-2, 3):  # promotion goes by age: it keeps this order too
        same = [i for i in flat if calls[i][2] == priority]
        assert same == sorted(same)


@pytest.mark.anyio
async def test_a_flood_of_distinct_priorities_is_served_highest_first(anyio_backend: str) -> None:
    served: list[int] = []
    gate = anyio.Event()

    async def model(items: list[int]) -> list[int]:
        await gate.wait()
        served.extend(items)
        return items

    priorities = list(range(500))
    random.Random(1).shuffle(priorities)
    async with (
        Batcher(model, max_batch_size=7, max_queue=1000, promote_after=None) as b,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(b, -1)
        await anyio.wait_all_tasks_blocked()
        for p in priorities:
            tg.start_soon(functools.partial(b, p, priority=p))
        await anyio.wait_all_tasks_blocked()
        assert len(b._queue.order) == 500
        gate.set()
    assert served == [-1, *range(499, -1, -1)]
    assert not b._queue.order and not b._queue.levels


class Counted(int):
    """A priority that counts what the queue does with it (comparisons, negations)."""

    ops = 0

    def _count(self) -> None:
        Counted.ops += 1

    def __lt__(self, other: object) -> bool:
        self._count()
        return int(self) < other  # type: ignore[operator]

    def __gt__(self, other: object) -> bool:
        self._count()
        return int(self) > other  # type: ignore[operator]

    def __le__(self, other: object) -> bool:
        self._count()
        return int(self) <= other  # type: ignore[operator]

    def __ge__(self, other: object) -> bool:
        self._count()
        return int(self) >= other  # type: ignore[operator]

    def __eq__(self, other: object) -> bool:
        self._count()
        return int(self) == other

    __hash__ = int.__hash__

    def __neg__(self) -> int:
        self._count()
        return -int(self)


def test_distinct_priorities_cost_the_queue_log_time_each() -> None:
    """Priorities as deadlines (every request a level of its own, as an earliest-deadline-
    first server makes them): adding and emptying a level costs O(log levels) work on the
    priorities, not O(levels), so a full queue of 5,000 stays cheap (it was quadratic: 30,000
    such requests took seconds of event loop)."""
    from aloader.serve._request import _RequestQueue

    queue = _RequestQueue()
    n = 5_000
    priorities = list(range(n))
    random.Random(0).shuffle(priorities)
    requests = []
    Counted.ops = 0
    for i, p in enumerate(priorities):
        request = _Request(i, float(i), None)  # type: ignore[arg-type]
        request.priority = Counted(p)
        queue.push(request)
        requests.append(request)
    served = [r.priority for r in queue.ordered(-math.inf)]
    assert served == sorted(priorities, reverse=True)
    random.Random(1).shuffle(requests)
    for request in requests:
        queue.remove(request)
    assert not queue.order and not queue.levels
    assert Counted.ops < 60 * n, f"{Counted.ops} operations for {n} levels"


@pytest.mark.anyio
async def test_a_batch_size_fn_that_fails_on_some_mixes_fails_the_item_that_mixed(
    anyio_backend: str,
) -> None:
    """The sizes raise only when "x" and "y" share a batch, and do not grow monotonically:
    the item whose addition raised fails alone, and no batch ever measures over the limit."""
    batches: list[list[str]] = []
    gate = anyio.Event()

    def size(items: list[str]) -> int:
        if "x" in items and "y" in items:
            raise RuntimeError("x and y do not mix")
        return 7 if len(items) == 3 else len(items) * 2  # non-monotone at 3

    async def model(items: list[str]) -> list[str]:
        await gate.wait()
        batches.append(list(items))
        return items

    outcomes: dict[str, Any] = {}

    async def call(b: Batcher[str, str], item: str) -> None:
        try:
            outcomes[item] = await b(item)
        except RuntimeError as exc:
            outcomes[item] = str(exc)

    async with (
        Batcher(model, max_batch_size=8, batch_size_fn=size, max_wait=0.0) as b,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(call, b, "held")
        await anyio.wait_all_tasks_blocked()
        for item in ("x", "a", "y", "b", "c"):
            tg.start_soon(call, b, item)
            await anyio.wait_all_tasks_blocked()
        gate.set()
    assert outcomes["y"] == "x and y do not mix"
    served = {k: v for k, v in outcomes.items() if k != "y"}
    assert served == {k: k for k in ("held", "x", "a", "b", "c")}
    assert all(size(batch) <= 8 for batch in batches)
    assert sorted(i for batch in batches for i in batch) == sorted(["held", "x", "a", "b", "c"])


@pytest.mark.anyio
async def test_a_base_exception_in_a_streaming_batch_reaches_its_readers(
    anyio_backend: str,
) -> None:
    async def steps(items: list[int]) -> Any:
        yield items
        if 1 in items:
            raise KeyboardInterrupt

    async with Batcher(steps, max_batch_size=2) as b:
        first, second = b.stream(1), b.stream(2)
        assert await first.__anext__() == 1
        with pytest.raises(KeyboardInterrupt):
            await first.__anext__()
        assert await second.__anext__() == 2
        with pytest.raises(KeyboardInterrupt):
            await second.__anext__()
        assert [x async for x in b.stream(3)] == [3]  # the dispatcher goes on


@pytest.mark.anyio
async def test_streams_that_time_out_or_are_dropped_end_with_a_timeout(anyio_backend: str) -> None:
    release = anyio.Event()

    async def steps(items: list[int]) -> Any:
        yield items
        await release.wait()
        yield items

    async with Batcher(steps, max_batch_size=1) as b:
        slow = b.stream(1, timeout=0.01)
        queued = b.stream(2, queue_timeout=0.01)  # behind the held batch
        assert await slow.__anext__() == 1
        with pytest.raises(BatcherTimeoutError, match="not served within"):
            await slow.__anext__()
        with pytest.raises(BatcherTimeoutError, match="dropped"):
            await queued.__anext__()
        with pytest.raises(StopAsyncIteration):
            await queued.__anext__()
        release.set()
        assert [x async for x in b.stream(3)] == [3, 3]
    assert b.metrics()["dropped"] == 1 and b.metrics()["timed_out"] == 1


# -- callers that leave in the step between a batch's forming and its start ----------------------


@pytest.mark.anyio
@pytest.mark.parametrize("streaming", [False, True])
async def test_a_caller_that_leaves_before_its_batch_starts_is_not_run(
    anyio_backend: str, streaming: bool
) -> None:
    """With several execution slots a batch starts in a task of its own, one scheduler step
    after it was formed. A caller that leaves in that step never reaches the batch function
    (as in Ray, which drops cancelled requests before it calls the function), and a
    streaming batch that no caller reads any more never holds its slot."""
    seen: list[list[int]] = []
    closed: list[list[int]] = []

    async def unary(items: list[int]) -> list[int]:
        seen.append(list(items))
        return items

    async def steps(items: list[int]) -> Any:
        seen.append(list(items))
        try:
            if items != [0]:
                await anyio.sleep_forever()  # a model that decodes until it is stopped
            yield items
        finally:
            closed.append(list(items))

    fn: Any = steps if streaming else unary
    with anyio.fail_after(10):
        async with Batcher(fn, max_concurrent_batches=2, close_timeout=1) as b:
            assert [x async for x in b.stream(0)] == [0]  # the dispatcher is up
            # asyncio orders the steps (the dispatcher forms the batch, then this task
            # leaves, then the batch's task starts); trio shuffles them: a few rounds hit it.
            for i in range(1, 21):
                stream = b.stream(i)
                await anyio.lowlevel.checkpoint()
                await stream.aclose()
                await anyio.wait_all_tasks_blocked()
                assert b.metrics()["running_batches"] == 0, f"round {i}: a batch nobody reads"
    assert seen == [[0]]  # nobody else was run
    if streaming:
        assert closed == [[0]]


# -- numbers out of a float's range --------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["cost", "batch_size_fn"])
async def test_a_cost_too_large_for_a_float_is_a_clear_error(
    anyio_backend: str, where: str
) -> None:
    options: dict[str, Any] = (
        {"cost": lambda x: x, "max_batch_cost": 10} if where == "cost"
        else {"batch_size_fn": sum, "max_batch_size": 10}
    )  # fmt: skip
    async with Batcher(lambda xs: xs, **options) as b:
        with pytest.raises(ValueError, match=f"{where} must return a finite number"):
            await b(10**400)
        assert await b(3) == 3  # the batcher goes on
    with pytest.raises(ValueError, match="max_batch_cost"):
        Batcher(lambda xs: xs, cost=len, max_batch_cost=10**400)


# -- a budget lowered while items wait ---------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("allow_oversized", [False, True])
async def test_a_lowered_max_batch_size_holds_for_items_queued_before(
    anyio_backend: str, allow_oversized: bool
) -> None:
    """An item that fit ``max_batch_size`` (by ``batch_size_fn``) when it was submitted, but
    alone exceeds the size set since: refused when its batch forms (as Ray refuses it there),
    or, with ``allow_oversized``, run alone. No batch measures over the size in force."""
    gate = anyio.Event()
    batches: list[list[int]] = []

    async def model(items: list[int]) -> list[int]:
        await gate.wait()
        batches.append(list(items))
        return items

    got: dict[int, Any] = {}

    async def call(b: Batcher[int, int], x: int) -> None:
        try:
            got[x] = await b(x)
        except BatchCostError as exc:
            got[x] = exc

    with anyio.fail_after(10):
        async with Batcher(model, max_batch_size=10, batch_size_fn=sum,
                           allow_oversized=allow_oversized) as b, \
                anyio.create_task_group() as tg:
            tg.start_soon(call, b, 1)  # runs, holding the slot
            await anyio.wait_all_tasks_blocked()
            for x in (8, 2, 3):
                tg.start_soon(call, b, x)
                await anyio.wait_all_tasks_blocked()
            b.set_max_batch_size(5)
            gate.set()
    if allow_oversized:
        assert got == {1: 1, 8: 8, 2: 2, 3: 3}
        assert batches == [[1], [8], [2, 3]]
    else:
        assert isinstance(got.pop(8), BatchCostError)
        assert got == {1: 1, 2: 2, 3: 3}
        assert batches == [[1], [2, 3]]


# -- a BaseException that no caller is left to receive, from a lazily started dispatcher ---------


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_a_base_exception_nobody_receives_stops_asyncio_run(exc_type: type[BaseException]) -> None:
    """As Ray's batch task does: the lazily started dispatcher lets it out of the event loop
    as itself (asyncio stops there for KeyboardInterrupt and SystemExit), rather than ending
    in an exception group that asyncio only logs when the task is collected."""
    async def main() -> None:
        started, gate = asyncio.Event(), asyncio.Event()

        async def model(items: list[int]) -> list[int]:
            started.set()
            await gate.wait()
            raise exc_type("nobody waits for this batch")

        b = Batcher(model)
        caller = asyncio.ensure_future(b(1))
        await started.wait()
        caller.cancel()
        gate.set()
        await asyncio.sleep(5)  # the dispatcher's exception ends the loop before this

    with pytest.raises(exc_type, match="nobody waits"):
        asyncio.run(main())


# -- closing from inside a batch -----------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("streaming", [False, True])
async def test_a_batch_function_may_close_its_own_batcher(
    anyio_backend: str, slots: int, streaming: bool
) -> None:
    """A model that gives up (a fatal device error) closes its batcher from inside its batch:
    the close cannot wait for the batch it is called from, so it starts the shutdown and
    returns; the batch and the requests queued before it are still answered, later ones are
    refused."""
    gate = anyio.Event()
    holder: list[Batcher[int, int]] = []

    async def unary(items: list[int]) -> list[int]:
        await gate.wait()
        if 0 in items:
            await holder[0].aclose()
        return [x + 100 for x in items]

    async def steps(items: list[int]) -> Any:
        yield await unary(items)

    b = Batcher(steps if streaming else unary, max_batch_size=1,
                max_concurrent_batches=slots, close_timeout=60)
    holder.append(b)
    got: dict[int, Any] = {}

    async def call(i: int) -> None:
        if streaming:
            got[i] = [x async for x in b.stream(i)]
        else:
            got[i] = await b(i)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(call, i)
                await anyio.wait_all_tasks_blocked()
            gate.set()
        with pytest.raises(BatcherClosedError):
            b.stream(5) if streaming else await b(5)
        await b.aclose()
    expected: dict[int, Any] = {i: i + 100 for i in range(3)}
    assert got == ({i: [v] for i, v in expected.items()} if streaming else expected)
