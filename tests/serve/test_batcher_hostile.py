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
