"""``_facade.parked``: the private loops held between two callbacks for a fork of the process.

A held loop runs nothing until the block ends; a loop busy in a long step is not waited for
(None: the caller does not fork); a loop closed while held is let go. Hang guards only.
"""

from __future__ import annotations

import asyncio
import threading
import time

import anyio.to_thread

from aloader._facade import PrivateLoop, parked


def test_held_loops_run_nothing_until_the_block_ends() -> None:
    loop = PrivateLoop()
    try:
        ran: list[int] = []

        async def mark() -> None:
            ran.append(1)

        with parked() as quiet:
            assert quiet is not None and loop._thread in quiet
            future = loop.submit(mark)
            time.sleep(0.05)
            assert ran == [] and not future.done()
        future.result(timeout=30)
        assert ran == [1]
    finally:
        loop.close()


def test_idle_worker_threads_of_a_held_loop_are_quiet_and_busy_ones_are_not() -> None:
    loop = PrivateLoop()
    release = threading.Event()
    try:
        both = threading.Barrier(2, timeout=30)

        async def two() -> None:  # two worker threads at once, idle when they return
            async with anyio.create_task_group() as tg:
                for _ in range(2):
                    tg.start_soon(anyio.to_thread.run_sync, both.wait)

        loop.call(two)
        started = threading.Event()

        def hold() -> None:
            started.set()
            release.wait(30)

        busy = loop.submit(lambda: anyio.to_thread.run_sync(hold))  # one of them busy again
        assert started.wait(30)
        with parked() as quiet:
            assert quiet is not None
            workers = [t for t in threading.enumerate() if t.name == "AnyIO worker thread"]
            assert len([t for t in workers if t in quiet]) == 1
        release.set()
        busy.result(timeout=30)
    finally:
        release.set()
        loop.close()


def test_a_loop_busy_in_a_long_step_is_not_waited_for() -> None:
    loop = PrivateLoop()
    try:
        started = threading.Event()

        async def block() -> None:
            started.set()
            time.sleep(0.3)  # a step that does not return to the loop

        future = loop.submit(block)
        assert started.wait(30)
        with parked(timeout=0.01) as quiet:
            assert quiet is None
        future.result(timeout=30)
        # The hold that came too late lets the loop go on at once.
        assert loop.call(lambda: asyncio.sleep(0, "after")) == "after"
    finally:
        loop.close()


def test_a_loop_closed_while_held_is_let_go() -> None:
    loop = PrivateLoop()
    with parked() as quiet:
        assert quiet is not None
        loop.close()  # would wait for the held thread forever
        assert not loop._thread.is_alive()
