"""``for batch in loader``: the async pipeline driven from plain synchronous code.

The epoch runs on a private asyncio event loop in a background thread (an anyio blocking
portal). A pump task there moves batches into a thread-safe queue one step ahead of the
consumer, so a ``next()`` that finds its batch ready costs one queue read rather than a round
trip through the loop. The loop is shut down when the epoch ends, and when the iterator is
closed, garbage-collected or still open at interpreter exit.
"""

from __future__ import annotations

import queue
import weakref
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from ._backend import threadsafe_caller

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ._loader import DataLoader, _AsyncLoaderIter

__all__ = ("SyncLoaderIter",)

_END = object()


class _Pump:
    """Runs on the private loop: fetches ahead while the consumer works on its batch.

    At most ``AHEAD`` batches wait in the hand-off queue. The consumer's thread counts what it
    takes with a plain integer and wakes the loop only when the pump is actually waiting, so a
    batch costs no cross-thread call while the pump keeps ahead.
    """

    AHEAD = 2

    def __init__(self, iterator: _AsyncLoaderIter) -> None:
        self.iterator = iterator
        self.out: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()
        self.produced = 0
        self.consumed = 0  # written by the consumer's thread only
        self.waiting: anyio.Event | None = None
        self.call_soon = threadsafe_caller()

    async def run(self) -> None:
        while True:
            while self.produced - self.consumed >= self.AHEAD:
                waiting = self.waiting = anyio.Event()
                # Checked again after publishing the event: the consumer may have taken a batch
                # in between, and then it saw no event to set.
                if self.produced - self.consumed < self.AHEAD:
                    break
                await waiting.wait()
            self.waiting = None
            self.produced += 1
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

    def taken(self) -> None:
        """The consumer took a batch (called from the consumer's thread)."""
        self.consumed += 1
        waiting = self.waiting
        if waiting is not None:
            self.call_soon(waiting.set)


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
        self._pump.taken()
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
