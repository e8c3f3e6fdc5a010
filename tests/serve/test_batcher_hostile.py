"""Attacks on the batcher's waiters, timers and states: many concurrent callers with random
timeouts and cancellations against a batch function that raises, returns the wrong length,
returns per-item errors or sleeps; a timeout at the instant of the flush; a caller cancelled
while its batch runs; a hanging batch function; closing with requests waiting. Every caller
gets exactly its own result or a clear error, nothing hangs (``anyio.fail_after``), the
metrics add up, and no request (waiter) or timer outlives its call.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
from typing import Any

import anyio
import pytest
import trio
import trio.testing

from aloader import Batcher, BatcherClosedError, BatcherTimeoutError, BatchResultError
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
