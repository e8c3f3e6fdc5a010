"""aloader._backend: which event loop runs, callbacks onto it from any thread, detached tasks.

``Detached``'s contract: ``cancel()`` works from any thread and at any time, even before the
task has started (its ``scope()`` then comes already cancelled).
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

import anyio
import pytest

from aloader._backend import (
    Detached,
    current_backend,
    spawn_background,
    task_group,
    threadsafe_caller,
    waiters,
)

pytestmark = pytest.mark.anyio


def test_no_backend_outside_an_event_loop() -> None:
    assert current_backend() is None
    with pytest.raises(RuntimeError, match="needs a running asyncio or trio event loop"):
        threadsafe_caller()


async def test_current_backend_names_the_running_loop(anyio_backend: str) -> None:
    assert current_backend() == anyio_backend
    # A worker thread runs no loop of its own.
    assert await anyio.to_thread.run_sync(current_backend) is None


async def test_threadsafe_caller_runs_the_callback_on_the_loop_thread(anyio_backend: str) -> None:
    call_soon = threadsafe_caller()
    loop_thread = threading.get_ident()
    ran_on: list[int] = []
    done = anyio.Event()

    def callback() -> None:
        ran_on.append(threading.get_ident())
        done.set()  # only safe because it runs on the loop

    thread = threading.Thread(target=call_soon, args=(callback,))
    thread.start()
    thread.join()
    with anyio.fail_after(10):
        await done.wait()
    assert ran_on == [loop_thread]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_threadsafe_caller_does_nothing_once_the_loop_closed(backend: str) -> None:
    async def main() -> Callable[[Callable[[], None]], None]:
        return threadsafe_caller()

    call_soon = anyio.run(main, backend=backend)
    ran: list[bool] = []
    call_soon(lambda: ran.append(True))  # no error: there is nothing left to notify
    assert ran == []


async def test_spawn_background_outlives_the_task_that_started_it(anyio_backend: str) -> None:
    release, finished = anyio.Event(), anyio.Event()

    async def work() -> None:
        await release.wait()
        finished.set()

    # The spawning task ends at once; its task group does not wait for the work.
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(_spawn, work)
    assert not finished.is_set()
    release.set()
    with anyio.fail_after(10):
        await finished.wait()


async def _spawn(work: Callable[[], Awaitable[None]]) -> None:
    call_soon = spawn_background(work)
    assert callable(call_soon)


async def test_detached_cancel_before_start_cancels_the_work(anyio_backend: str) -> None:
    detached = Detached()
    detached.cancel()  # before spawn: remembered
    outcome: list[str] = []
    done = anyio.Event()

    async def work() -> None:
        with detached.scope() as scope:
            assert scope.cancel_called
            await anyio.sleep_forever()
        outcome.append("cancelled")
        done.set()

    detached.spawn(work)
    with anyio.fail_after(10):
        await done.wait()
    assert outcome == ["cancelled"]


async def test_detached_cancel_from_another_thread(anyio_backend: str) -> None:
    detached = Detached()
    started, done = anyio.Event(), anyio.Event()

    async def work() -> None:
        with detached.scope():
            started.set()
            await anyio.sleep_forever()
        done.set()

    detached.spawn(work)
    with anyio.fail_after(10):
        await started.wait()
        thread = threading.Thread(target=detached.cancel)
        thread.start()
        thread.join()
        await done.wait()


async def test_detached_cancel_after_the_work_ended_is_harmless(anyio_backend: str) -> None:
    detached = Detached()
    done = anyio.Event()

    async def work() -> None:
        with detached.scope():
            pass
        done.set()

    detached.spawn(work)
    with anyio.fail_after(10):
        await done.wait()
    detached.cancel()
    detached.cancel()
    await anyio.sleep(0)


# task_group: anyio's task-group contract, on asyncio with plain tasks ---------------------------
async def test_task_group_waits_for_every_child(anyio_backend: str) -> None:
    done: list[int] = []

    async def child(i: int) -> None:
        await anyio.sleep(0.001 * (i % 3))
        done.append(i)

    async with task_group() as tg:
        for i in range(50):
            tg.start_soon(child, i)
    assert sorted(done) == list(range(50))


async def test_task_group_child_error_cancels_the_rest_and_is_raised(anyio_backend: str) -> None:
    cancelled: list[int] = []

    async def sleeper(i: int) -> None:
        try:
            await anyio.sleep(60)
        except anyio.get_cancelled_exc_class():
            cancelled.append(i)
            raise

    async def failing() -> None:
        await anyio.sleep(0.01)
        raise ValueError("child failed")

    with pytest.raises(ExceptionGroup) as info:
        async with task_group() as tg:
            for i in range(5):
                tg.start_soon(sleeper, i)
            tg.start_soon(failing)
            await anyio.sleep(60)  # the block itself is cancelled too
    assert [type(e) for e in info.value.exceptions] == [ValueError]
    assert sorted(cancelled) == list(range(5))


async def test_task_group_cancelled_from_outside_cancels_children(anyio_backend: str) -> None:
    cancelled: list[int] = []
    started = anyio.Event()

    async def sleeper(i: int) -> None:
        try:
            started.set()
            await anyio.sleep(60)
        except anyio.get_cancelled_exc_class():
            cancelled.append(i)
            raise

    with anyio.CancelScope() as scope:
        async with task_group() as tg:
            for i in range(5):
                tg.start_soon(sleeper, i)
            await started.wait()
            scope.cancel()
            await anyio.sleep(60)
    assert scope.cancelled_caught
    assert sorted(cancelled) == list(range(5))


# waiters: one-shot wake-ups shaped like asyncio's plain future, on both backends --------------
async def test_waiter_wakes_the_task_that_awaits_it(anyio_backend: str) -> None:
    new = waiters()
    waiter = new()
    woken: list[str] = []

    async def wait() -> None:
        await waiter
        woken.append("woken")

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.sleep(0.01)
        assert not waiter.done() and woken == []
        waiter.set_result(None)
        assert waiter.done()
    assert woken == ["woken"]


async def test_a_done_waiter_returns_at_once_without_a_checkpoint(anyio_backend: str) -> None:
    # As an asyncio future does: awaiting one that is done neither yields nor takes a pending
    # cancellation (trio.Event.wait checkpoints there, and raised Cancelled).
    waiter = waiters()()
    waiter.set_result(None)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await waiter
        await waiter
        reached = True
    assert reached and not scope.cancelled_caught


async def test_a_cancelled_wait_leaves_the_waiter_waking_nobody(anyio_backend: str) -> None:
    waiter = waiters()()
    with anyio.move_on_after(0.01) as scope:
        await waiter
    assert scope.cancelled_caught
    if not waiter.done():  # asyncio: the cancelled future is done; trio: nobody to wake
        waiter.set_result(None)
    await anyio.sleep(0)  # a stray reschedule of this task would break trio's run here


def test_a_trio_waiter_refuses_a_second_task() -> None:
    # A second task would take the first one's wake-up and leave it parked forever: an error.
    trio = pytest.importorskip("trio")

    async def main() -> None:
        waiter = waiters()()

        async def first() -> None:
            await waiter

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await trio.sleep(0.01)
            with pytest.raises(RuntimeError, match="one task at a time"):
                await waiter
            waiter.set_result(None)  # the first task wakes, and the nursery ends

    trio.run(main)
