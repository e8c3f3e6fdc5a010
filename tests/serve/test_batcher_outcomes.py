"""Every caller gets exactly one outcome, whatever happens around it.

Hundreds of callers arrive at random on trio's MockClock (deterministic: hypothesis replays a
failure exactly), with random priorities, costs, timeouts, queue deadlines and cancellations;
streams are read partly, closed early or cancelled between two results. The batch function
fails, returns the wrong number of results or something that is not a sequence, puts
exceptions in some slots, yields unequal steps, runs long or hangs; the settings change while
batches form and run; the batcher closes while callers wait. Each caller must end once with
its own result (or its own prefix of its stream), its own error, a clear batcher error, or the
cancellation it was given; no batch may exceed a budget in force; nothing may be left behind
(queued requests, deadlines, tasks). The last test storms asyncio the same way, on real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import random
from collections.abc import AsyncIterator
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
    QueueFullError,
)
from aloader.serve._request import _Request

pytestmark = pytest.mark.hostile


class Boom(Exception):
    """What the batch function raises (args[0]: the batch's items) or puts in a slot (the
    item)."""


def live_requests() -> int:
    gc.collect()
    return sum(type(obj) is _Request for obj in gc.get_objects())


def live_trio_tasks() -> int:
    def count(task: Any) -> int:
        return 1 + sum(count(child) for nursery in task.child_nurseries
                       for child in nursery.child_tasks)

    return count(trio.lowlevel.current_root_task())


class Storm:
    """One random run: the batch function's behaviour, the callers' plans, and what each got."""

    def __init__(self, seed: int, streaming: bool, budget: str) -> None:
        self.rng = random.Random(seed)
        self.streaming = streaming
        self.budget = budget
        self.batches: list[tuple[list[int], int]] = []  # items, max_batch_size ever in force
        self.sizes_set = 0
        self.outcomes: dict[int, str] = {}
        self.costs: dict[int, int] = {}
        self.cancelled_on_purpose: set[int] = set()
        self.arrivals: list[int] = []  # in the order the batcher admitted them
        self.priorities: dict[int, int] = {}

    # -- the batch functions ---------------------------------------------------------------------

    def _pause(self) -> float:
        return self.rng.choice([0] * 8 + [0.01, 0.3, 2.0, 1000.0])  # 1000 s: a hang

    def _record(self, items: list[int]) -> None:
        self.batches.append((list(items), self.sizes_set))
        assert len(set(items)) == len(items)

    async def unary(self, items: list[int]) -> Any:
        self._record(items)
        roll = self.rng.random()
        await trio.sleep(self._pause())
        if roll < 0.05:
            raise Boom(list(items))
        if roll < 0.08:
            return [("r", x) for x in items][1:] + ([] if len(items) > 1 else [None, None])
        if roll < 0.10:
            return self.rng.choice([None, "abc", {"not": "a list"}, (x for x in items)])
        if roll < 0.20:
            return [Boom(x) if x % 3 == 0 else ("r", x) for x in items]
        return [("r", x) for x in items]

    async def steps(self, items: list[int]) -> AsyncIterator[list[Any]]:
        self._record(items)
        lengths = {x: self.rng.randint(0, 4) for x in items}
        roll = self.rng.random()
        for step in range(max(lengths.values(), default=0) + 1):
            await trio.sleep(self._pause())
            if roll < 0.05 and step == 1:
                raise Boom(list(items))
            if roll < 0.08 and step == 1:
                yield [("r", x, step) for x in items][1:] or [1, 2]  # unequal
                continue
            row: list[Any] = []
            for x in items:
                if step < lengths[x]:
                    row.append(("r", x, step))
                elif roll < 0.2 and x % 3 == 0:
                    row.append(Boom(x))
                else:
                    row.append(StopAsyncIteration)
            yield row

    # -- the callers -----------------------------------------------------------------------------

    async def call(self, b: Batcher[Any, Any], i: int) -> None:
        rng = self.rng
        await trio.sleep(rng.choice([0, 0, 0.01, 0.2, 1.0, 3.0]))
        options: dict[str, Any] = {
            "priority": rng.choice([0, 0, 1, -1, 10**30, -(10**30)]),
            "timeout": rng.choice([None, None, None, 0.5, 5.0, 1e-9]),
            "queue_timeout": rng.choice([None, None, None, 0.3, 5.0, 5e-324]),
        }
        self.priorities[i] = options["priority"]
        self.arrivals.append(i)  # the call below admits it before its first checkpoint
        cancel_after = rng.choice([None, None, None, 0, 0.005, 0.4, 3.0])
        plan = rng.choice(["all", "all", "first", "aclose-early", "slow", "drop"])
        outcome = "unfinished"
        with trio.CancelScope() as scope:
            if cancel_after is not None:
                scope.deadline = trio.current_time() + cancel_after
                self.cancelled_on_purpose.add(i)
            try:
                if self.streaming:
                    outcome = await self._read(b, i, options, plan)
                else:
                    result = await b(i, **options)
                    assert result == ("r", i), f"caller {i} got {result!r}"
                    outcome = "ok"
            except BatchCostError:
                assert self.costs[i] > 10, f"caller {i} refused at cost {self.costs[i]}"
                outcome = "refused"
            except BatcherTimeoutError:
                outcome = "timeout"
            except BatchResultError:
                outcome = "bad result"
            except Boom as exc:
                assert exc.args[0] == i or i in exc.args[0], f"caller {i} got {exc!r}"
                outcome = "error"
            except BatcherClosedError:
                outcome = "closed"
            except QueueFullError:
                outcome = "full"
        if scope.cancelled_caught:
            assert i in self.cancelled_on_purpose
            outcome = "cancelled"
        assert i not in self.outcomes, f"caller {i} ended twice"
        self.outcomes[i] = outcome

    async def _read(self, b: Batcher[Any, Any], i: int, options: dict[str, Any],
                    plan: str) -> str:
        stream = b.stream(i, **options)
        got = 0
        # "drop": a break without closing, the stream left to the collector (as "slow" leaves
        # it when cancelled between two results).
        closing: Any = contextlib.nullcontext() if plan == "drop" else contextlib.aclosing(stream)
        async with closing:
            async for result in stream:
                assert result == ("r", i, got), f"caller {i} read {result!r} at {got}"
                got += 1
                if plan in ("first", "drop") or (plan == "aclose-early" and got == 2):
                    return f"left after {got}"
                if plan == "slow":
                    await trio.sleep(self.rng.choice([0, 0.05, 1.0]))  # cancelled in between
        return f"read {got}"

    async def tweak(self, b: Batcher[Any, Any], until: float) -> None:
        """Change the settings at random while batches form and run."""
        rng = self.rng
        while trio.current_time() < until:
            await trio.sleep(rng.choice([0.01, 0.1, 0.5]))
            if rng.random() < 0.5:
                size = rng.randint(1, 8)
                try:
                    b.set_max_batch_size(size)
                except ValueError:  # below a preferred batch size: refused, nothing changed
                    continue
                self.sizes_set = max(self.sizes_set, size)
            else:
                b.set_max_wait(rng.choice([0, 0.05, 0.5]))


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    seed=st.integers(0, 2**32 - 1),
    callers=st.integers(1, 250),
    streaming=st.booleans(),
    budget=st.sampled_from(["count", "cost", "batch_size_fn"]),
    max_batch_size=st.integers(1, 8),
    max_wait=st.sampled_from([0.0, 0.05, 0.5]),
    max_concurrent=st.integers(1, 3),
    promote_after=st.sampled_from([None, 0.0, 1.0]),
    allow_oversized=st.booleans(),
    max_queue=st.sampled_from([4, 64, 10_000, 10_000]),
    close_at=st.sampled_from([None, 0.5, 4.0]),
    preferred=st.sampled_from([None, (2,), (2, 4)]),
)
def test_every_caller_gets_exactly_one_outcome(
    seed: int, callers: int, streaming: bool, budget: str, max_batch_size: int,
    max_wait: float, max_concurrent: int, promote_after: float | None,
    allow_oversized: bool, max_queue: int, close_at: float | None,
    preferred: tuple[int, ...] | None,
) -> None:
    storm = Storm(seed, streaming, budget)
    storm.sizes_set = max_batch_size
    storm.costs = {i: storm.rng.choice([0, 1, 2, 5, 11]) for i in range(callers)}
    options: dict[str, Any] = {}
    if budget == "cost":
        options = {"cost": storm.costs.__getitem__, "max_batch_cost": 10}
    elif budget == "batch_size_fn":
        options = {"batch_size_fn": lambda xs: sum(storm.costs[x] for x in xs)}
        max_batch_size = storm.sizes_set = 10
    if budget != "batch_size_fn" and preferred and max(preferred) <= max_batch_size:
        options["preferred_batch_sizes"] = preferred
    before = live_requests()

    async def main() -> None:
        tasks_before = live_trio_tasks()
        b: Batcher[Any, Any] = Batcher(
            storm.steps if streaming else storm.unary, max_batch_size=max_batch_size,
            max_wait=max_wait, max_concurrent_batches=max_concurrent,
            promote_after=promote_after, allow_oversized=allow_oversized,
            max_queue=max_queue, close_timeout=2.0, **options,
        )
        with trio.fail_after(100_000):  # virtual seconds: a hang, not a slow test
            async with b, trio.open_nursery() as nursery:
                for i in range(callers):
                    nursery.start_soon(storm.call, b, i)
                if budget != "batch_size_fn":
                    nursery.start_soon(storm.tweak, b, 5.0)
                if close_at is not None:
                    await trio.sleep(close_at)
                    await b.aclose()
        metrics = b.metrics()
        assert metrics["queued"] == 0 and metrics["running_batches"] == 0
        assert not b._queue.fifo and not b._queue.levels and b._queue.cost == 0
        assert not [e for e in b._trio_timeouts.heap if e[2].state < 2]
        ended = (metrics["completed"] + metrics["failed"] + metrics["timed_out"]
                 + metrics["cancelled"] + metrics["dropped"])
        assert metrics["submitted"] == ended, metrics
        del b
        gc.collect()
        await trio.testing.wait_all_tasks_blocked()
        assert live_trio_tasks() == tasks_before

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(storm.outcomes) == list(range(callers))
    assert "unfinished" not in storm.outcomes.values()
    seen = [x for items, _ in storm.batches for x in items]
    assert len(seen) == len(set(seen)), "an item reached the batch function twice"
    for items, size in storm.batches:
        assert items
        if budget != "batch_size_fn":  # which measures by cost, not by count
            assert len(items) <= max(size, max_batch_size)
        total = sum(storm.costs[x] for x in items)
        if budget in ("cost", "batch_size_fn"):
            assert total <= 10 or (allow_oversized and len(items) == 1), (items, total)
    for i, outcome in storm.outcomes.items():
        if outcome == "ok" or outcome.startswith(("read", "left")):
            assert i in seen
    # Within a priority, requests reach the batch function in the order they came (a
    # promotion goes by age, a budget closes a batch rather than letting a later item by).
    # Batches in concurrent slots start in any order: the order holds for one slot.
    for priority in set(storm.priorities.values()) if max_concurrent == 1 else ():
        served = [x for x in seen if storm.priorities[x] == priority]
        came = [x for x in storm.arrivals if x in set(served)]
        assert served == came, f"priority {priority} served out of order"
    assert live_requests() == before


def test_thousands_of_asyncio_callers_with_random_cancellations() -> None:
    """The same invariants on asyncio's real clock: 3,000 callers, a tenth cancelled at random
    times, a model that sometimes fails, hangs or answers wrongly."""
    rng = random.Random(7)
    outcomes: dict[int, str] = {}
    batches: list[list[int]] = []

    async def model(items: list[int]) -> Any:
        batches.append(list(items))
        roll = rng.random()
        await asyncio.sleep(rng.choice([0, 0, 0.001, 0.01]))
        if roll < 0.03:
            await asyncio.sleep(3600)  # hangs: its callers time out or are closed
        if roll < 0.08:
            raise Boom(list(items))
        if roll < 0.10:
            return items[:-1]
        return [("r", x) for x in items]

    async def call(b: Batcher[int, Any], i: int) -> None:
        await asyncio.sleep(rng.random() * 0.2)
        try:
            async with asyncio.timeout(rng.choice([None] * 9 + [rng.random() * 0.05])):
                result = await b(i, timeout=1.0, priority=rng.randint(-3, 3))
            assert result == ("r", i)
            outcomes[i] = "ok"
        except TimeoutError as exc:
            outcomes[i] = "timeout" if isinstance(exc, BatcherTimeoutError) else "cancelled"
        except (BatchResultError, BatcherClosedError, QueueFullError) as exc:
            outcomes[i] = type(exc).__name__
        except Boom as exc:
            assert i in exc.args[0]
            outcomes[i] = "error"

    async def main() -> dict[str, Any]:
        before = len(asyncio.all_tasks())
        async with (
            Batcher(model, max_batch_size=16, max_wait=0.002, max_concurrent_batches=3,
                    max_queue=2_000, close_timeout=0.5) as b,
            asyncio.TaskGroup() as group,
        ):
            for i in range(3_000):
                group.create_task(call(b, i))
        metrics = dict(b.metrics())
        del b
        gc.collect()
        await asyncio.sleep(0)
        assert len(asyncio.all_tasks()) == before
        return metrics

    requests_before = live_requests()
    metrics = asyncio.run(asyncio.wait_for(main(), 120))
    assert sorted(outcomes) == list(range(3_000))
    seen = [x for batch in batches for x in batch]
    assert len(seen) == len(set(seen))
    assert all(1 <= len(batch) <= 16 for batch in batches)
    assert {i for i, o in outcomes.items() if o == "ok"} <= set(seen)
    ended = (metrics["completed"] + metrics["failed"] + metrics["timed_out"]
             + metrics["cancelled"] + metrics["dropped"])
    assert metrics["submitted"] == ended
    assert metrics["submitted"] + metrics["rejected"] == 3_000
    assert live_requests() == requests_before
    assert not math.isnan(metrics["queue_wait"]["max"] or 0.0)


@pytest.mark.anyio
async def test_a_stream_closed_early_is_accounted_for(anyio_backend: str) -> None:
    """Its caller left: it counts as ``cancelled``, so that the counts of what became of the
    requests add up to ``submitted`` (a dashboard's in-flight count returns to 0)."""
    gate = anyio.Event()

    async def steps(items: list[int]) -> Any:
        for step in range(3):
            yield [(x, step) for x in items]
            if items == [1]:
                await gate.wait()

    async with Batcher(steps) as b:
        stream = b.stream(1)
        assert await stream.__anext__() == (1, 0)
        queued = b.stream(2)
        await queued.aclose()  # queued behind the first
        await stream.aclose()  # while its batch runs
        gate.set()
        assert [x async for x in b.stream(3)] == [(3, 0), (3, 1), (3, 2)]
    metrics = b.metrics()
    assert metrics["submitted"] == 3
    assert (metrics["completed"], metrics["cancelled"]) == (1, 2)
