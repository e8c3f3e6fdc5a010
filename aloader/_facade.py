"""``for batch in loader``: the async pipeline driven from plain synchronous code.

The epoch runs on a private asyncio event loop in a background thread (an anyio blocking
portal). A pump task there moves batches into a thread-safe queue one step ahead of the
consumer, so a ``next()`` that finds its batch ready costs one queue read rather than a round
trip through the loop. The loop is shut down when the epoch ends, and when the iterator is
closed, garbage-collected or still open at interpreter exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import weakref
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ._loader import DataLoader, _AsyncLoaderIter

__all__ = ("SyncLoaderIter",)

_END = object()


class _Pump:
    """Runs on the private loop: fetches batch k+1 while the consumer works on batch k."""

    def __init__(self, iterator: _AsyncLoaderIter) -> None:
        self.iterator = iterator
        self.out: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()
        self.credits = anyio.Semaphore(1)
        self.loop = asyncio.get_running_loop()

    async def run(self) -> None:
        while True:
            await self.credits.acquire()
            try:
                value = await self.iterator.__anext__()
            except StopAsyncIteration:
                self.out.put((_END, None))
                return
            except Exception as exc:
                self.out.put((None, exc))
            except BaseException as exc:  # cancelled: the consumer is closing this epoch
                self.out.put((None, exc))
                raise
            else:
                self.out.put((value, None))

    def request(self) -> None:
        """Let the pump fetch one more batch (from the consumer's thread)."""
        with contextlib.suppress(RuntimeError):  # the loop has closed
            self.loop.call_soon_threadsafe(self.credits.release)


async def _open(loader: DataLoader[Any]) -> _Pump:
    return _Pump(loader.__aiter__())


def _shutdown(
    manager: AbstractContextManager[BlockingPortal],
    portal: BlockingPortal,
    pump: _Pump,
    task: Future[None],
) -> None:
    try:
        task.cancel()
        portal.call(pump.iterator.aclose)
    finally:
        manager.__exit__(None, None, None)


class SyncLoaderIter:
    """One epoch for synchronous code; see :meth:`aloader.DataLoader.__iter__`."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        manager = start_blocking_portal("asyncio", name="aloader-loop")
        portal = manager.__enter__()
        try:
            pump = portal.call(_open, loader)
            task = portal.start_task_soon(pump.run)
        except BaseException:
            manager.__exit__(None, None, None)
            raise
        self._pump = pump
        self._close = weakref.finalize(self, _shutdown, manager, portal, pump, task)

    def __iter__(self) -> SyncLoaderIter:
        return self

    def __next__(self) -> Any:
        if not self._close.alive:
            raise StopIteration
        value, error = self._pump.out.get()
        if value is _END:
            self.close()
            raise StopIteration
        self._pump.request()
        if error is not None:
            raise error
        return value

    def close(self) -> None:
        """Stop the epoch and its event loop; waits until every fetch has ended."""
        self._close()

    @property
    def num_yielded(self) -> int:
        """Batches delivered so far in this epoch."""
        return int(self._pump.iterator.num_yielded)
