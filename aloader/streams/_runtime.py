"""The runtime of one epoch: the iterator the consumer holds (:class:`_StreamIterator`) and
the background task that runs the chain of stages a few blocks ahead of it (:class:`_Driver`).

Each ``async for`` over a stream (one epoch) runs the whole chain of stages in one background
task that reads at most a few blocks ahead of the consumer, then waits: a slow consumer stops
the sources. A chain that needs no task (:meth:`Stream._loopless`: sources over local files)
is pulled in the consumer's task instead, and its sync ``for`` on the consumer's thread with
no event loop (:class:`aloader.streams._syncfor._LocalPairs`): the same stages, tokens and
resume on every path. Stages that need concurrency (``map(..., concurrency=n)``, shard
read-ahead) run helper tasks in that background task's task group and talk to it through
bounded channels (:mod:`aloader.streams._channel`). No stage holds a cancel scope or a task
group across a ``yield``, so the chain can be closed from any task, and closing the iterator
(``aclose()``, garbage collection, cancelling the loader) cancels the background task, which
closes every file and connection the stages opened.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
import anyio.abc

from .._backend import Detached
from .._util import Closing, close_iterator, single_error
from .._workerinfo import worker_slot
from ._channel import _Abandoned, _Channel
from ._context import _Context
from ._positions import _START, _state_of

if TYPE_CHECKING:
    from ._stream import Stream

T = TypeVar("T")


class _Driver:
    """The background task of one epoch: pulls the chain's blocks into a bounded channel.

    Holds no reference to the iterator, so dropping the iterator lets ``__del__`` stop it.
    ``error`` is what ended the chain (the channel's reader gets this very object, and drops
    it here once it has it), ``last``
    the size and token of the last block the channel took: after an interrupt of the chain,
    the epoch goes on from its end (:meth:`after`).
    """

    def __init__(self, stream: Stream[Any], epoch: int, capacity: int, at: Any,
                 slot: tuple[int, int], reading: dict[Any, Any]) -> None:
        self.stream = stream
        self.epoch = epoch
        self.at = at
        self.reading = reading
        # The iterator's worker slot, read where it was made: a background task may not see
        # the context of a virtual replica (see aloader._workerinfo).
        self.slot = slot
        self.channel: _Channel[tuple[list[Any], Any]] = _Channel(capacity)
        self.done = anyio.Event()
        self.error: BaseException | None = None
        self.last: tuple[int, Any] | None = None
        self._task = Detached()

    def start(self) -> None:
        self._task.spawn(self._main)

    def stop(self) -> None:
        """Cancel the background task; safe from ``__del__`` and from other threads."""
        self._task.cancel()

    async def _main(self) -> None:
        error: BaseException | None = None
        try:
            with self._task.scope() as scope:
                worker_id, num_workers = self.slot
                async with anyio.create_task_group() as group:
                    ctx = _Context(self.epoch, worker_id, num_workers, group, self.reading)
                    error = await self._pump(ctx)
                    # Helper tasks end with their stages; cancel any that linger.
                    group.cancel_scope.cancel()
            if scope.cancelled_caught and error is None:
                error = RuntimeError("the stream was closed")
        except BaseException as exc:  # reported to the consumer, never lost in the background
            # The chain's own error comes first; a helper failing while it winds down after it
            # would only hide it.
            if error is None:
                error = single_error(exc) or exc
        finally:
            self.error = error
            self.channel.end(error)
            self.done.set()

    def after(self) -> Any:
        """The position after the last block the channel took (``at`` before any)."""
        last = self.last
        return self.at if last is None else _state_of(self.stream, last[1], last[0])

    async def _pump(self, ctx: _Context) -> BaseException | None:
        channel = self.channel
        try:
            async with Closing(self.stream._blocks_at(ctx, self.at)) as blocks:
                async for pair in blocks:
                    if pair[0]:
                        await channel.put(pair)
                        self.last = len(pair[0]), pair[1]
                    del pair  # not kept while the next is made (see aloader.streams._positions)
        except _Abandoned:
            return None
        except Exception as exc:
            return exc
        return None


class _StreamIterator(AsyncIterator[T]):
    """One epoch of a stream: the consumer's position, and the blocks the driver prefetches.

    Invariant: the consumer is at item ``_size - _cursor.__length_hint__()`` of the block
    whose token is ``_token`` (before the first block, at ``_at``), a block of ``_size``
    items. ``_cursor`` is the list iterator over it that every way of consuming takes its
    items from (the iterator lets go of the block once spent, and nothing else here holds it:
    see :mod:`aloader.streams._positions`), so no
    path counts items one by one: :meth:`__anext__` and :meth:`_take` (the loader's, which
    slices whole batches off it), :meth:`items` (the async generator ``async for`` gets,
    whose items cost no Python frame each), and :class:`_SyncItems` (a plain ``for``, fed
    whole blocks from another thread by :class:`_Pairs`). The consumer takes a block
    (:meth:`_enter`) only when it starts on it, so a block read ahead is never counted as
    delivered.
    """

    __slots__ = ("__weakref__", "_at", "_capacity", "_cursor", "_driver", "_epoch",
                 "_finished", "_inline", "_reading", "_restart", "_size", "_slot", "_stream",
                 "_token")

    def __init__(self, stream: Stream[T], epoch: int, capacity: int, at: Any = None,
                 reading: dict[Any, Any] | None = None) -> None:
        self._stream = stream
        self._epoch = epoch
        self._capacity = capacity
        # What this epoch's chains have counted (_Context.reading), whichever opens them.
        self._reading: dict[Any, Any] = {} if reading is None else reading
        self._driver: _Driver | None = None
        self._inline: AsyncGenerator[tuple[list[T], Any], None] | None = None
        self._size = 0
        self._cursor: Iterator[T] = iter([])
        self._finished = False
        self._at = at
        # Where the chain opens next (``_at`` until an interrupt of the chain, see _receive).
        self._restart = at
        self._token: Any = _START
        self._slot = worker_slot()

    def _snapshot(self) -> tuple[Any, ...]:
        """The consumer's position now, cheaply (encoded only when a state is asked for)."""
        # A list iterator's length hint is the number of items it has left (0 once spent).
        pos = self._size - self._cursor.__length_hint__()  # type: ignore[attr-defined]
        return (self._epoch, self._token, pos, self._finished, self._at, self._slot)

    def __aiter__(self) -> _StreamIterator[T]:
        return self

    async def __anext__(self) -> T:
        for item in self._cursor:
            return item
        return next(await self._next_block())

    def _context(self, group: anyio.abc.TaskGroup | None = None, blocking: bool = False
                 ) -> _Context:
        """The context of a chain of this epoch (its reading's counts go on in each)."""
        worker_id, num_workers = self._slot
        return _Context(self._epoch, worker_id, num_workers, group, self._reading, blocking)

    def _drained(self) -> None:
        """The chain reached the epoch's end: its reading is complete, so a state saved
        during it and loaded now starts a new reading (it counts what it reads again)."""
        self._stream._reading_done(self._slot, self._reading)

    def _enter(self, block: list[T], token: Any) -> Iterator[T]:
        """Start the consumer on ``block`` (the channel hands on no empty block)."""
        self._size = len(block)
        self._token = token
        cursor = self._cursor = iter(block)
        return cursor

    def _end(self) -> None:
        """The consumer has nothing more: the epoch ended, failed or was closed."""
        self._finished = True
        # Spent, the cursor gives nothing more to a consumer still holding it (the chain of
        # a sync for that was closed).
        cast(Any, self._cursor).__setstate__(self._size)
        self._size = 0
        self._cursor = iter([])

    async def _receive(self) -> tuple[list[T], Any]:
        """The next (block, token) of the epoch; StopAsyncIteration at the end, or the
        chain's error.

        A loopless stream's chain (:meth:`Stream._loopless`) is pulled here, in the
        consumer's task: a block is read and decoded when the consumer asks for it, with no
        background task, no channel and no task switch (which cost more per block than the
        read and the split together). Its reads still never make the loop wait on a disk
        (:func:`aloader.io._files.file_chunks`: a read the page cache cannot serve goes to a
        thread), but such a read is not overlapped with the consumer's work, and its shards
        are read one after another. Any other stream's chain runs in the driver, started by
        the first call, a few blocks ahead of the consumer.
        """
        if self._finished:
            raise StopAsyncIteration
        inline = self._inline
        if inline is None and self._driver is None and self._stream._loopless():
            inline = self._inline = self._stream._blocks_at(self._context(), self._restart)
        if inline is not None:
            try:
                while True:
                    pair = await inline.__anext__()
                    if pair[0]:
                        return pair
            except StopAsyncIteration:
                self._drained()
                raise
        driver = self._driver
        if driver is None:
            driver = self._driver = _Driver(self._stream, self._epoch, self._capacity,
                                            self._restart, self._slot, self._reading)
            driver.start()
        try:
            return await driver.channel.get()
        except StopAsyncIteration:
            self._drained()
            raise
        except anyio.get_cancelled_exc_class():
            # The consumer is gone (as the DataLoader treats it): stop reading for it now,
            # rather than when this iterator is garbage-collected.
            driver.stop()
            raise
        except BaseException as exc:
            # Not kept past here: raised, its traceback holds the consumer's frames (a sync
            # for's iterator, which would then never be collected).
            chain, driver.error = exc is driver.error, None
            if not chain:  # an interrupt of this wait, not the chain's end
                driver.stop()
            with anyio.CancelScope(shield=True):
                await driver.done.wait()
            if chain and not isinstance(exc, Exception):
                # An interrupt in the chain (a KeyboardInterrupt raised by a transform) ends
                # that chain, not the epoch: the next call opens it again after the blocks
                # handed out (the resume path, exact), as a loopless chain does.
                self._driver = None
                self._restart = driver.after()
            raise

    def _pull_here(self) -> None:
        """Pull this loopless epoch's chain with no event loop from now on (a loader's epoch
        on the consumer's thread, driven by :func:`~aloader._facade.run_here`): its reads
        block, as a plain ``for``'s (:class:`_LocalPairs`'s context)."""
        if self._inline is None and self._driver is None:
            self._inline = self._stream._blocks_at(self._context(blocking=True),
                                                   self._restart)

    async def _next_block(self) -> Iterator[T]:
        """The cursor of the next block, entered; StopAsyncIteration at the end."""
        try:
            block, token = await self._receive()
        except BaseException:
            self._end()
            raise
        return self._enter(block, token)

    async def _take(self, n: int) -> list[T]:
        """Up to ``n`` items (fewer only at the end), sliced from the prefetched blocks.

        The DataLoader cuts batches with this rather than ``n`` calls of ``__anext__``: a
        slice of the block the cursor is over (its list and position read off the cursor's
        pickle form, so nothing else holds the block), the cursor moved past it. A slice
        copies the items' pointers at once, where ``islice`` stepped the cursor item by item
        (~80 instructions a row, counted on ``DataLoader(ParquetRows)``).
        """
        out: list[T] = []
        cursor: Any = self._cursor
        while True:
            if cursor.__length_hint__():  # a list iterator not spent: (iter, (list,), index)
                _, (block,), pos = cursor.__reduce__()
                got = block[pos : pos + n - len(out)]
                del block  # not kept while the next is made (see aloader.streams._positions)
                cursor.__setstate__(pos + len(got))
                if out:
                    out.extend(got)
                else:
                    out = got
            if len(out) >= n:
                return out
            # The cursor is at its block's end: a step past it lets go of the block (a list
            # iterator holds its list until then), so it is freed before the next is made.
            next(cursor, None)
            try:
                cursor = await self._next_block()
            except StopAsyncIteration:
                return out

    async def items(self) -> AsyncGenerator[T, None]:
        """The epoch's items, for ``async for``: a plain ``for`` over each block's cursor, so
        that an item costs the async generator's step and nothing more."""
        try:
            while True:
                try:
                    cursor = await self._next_block()
                except StopAsyncIteration:
                    return
                for item in cursor:
                    yield item
        finally:
            if not self._finished:  # closed early (aclose, garbage collection)
                await self.aclose()

    async def aclose(self) -> None:
        """Stop reading and wait until every file and connection of this epoch is closed."""
        self._end()
        await self._stop()

    async def _stop(self) -> None:
        inline, self._inline = self._inline, None
        if inline is not None:
            await close_iterator(inline)
        driver = self._driver
        if driver is not None and not driver.done.is_set():
            driver.stop()
            with anyio.CancelScope(shield=True):
                await driver.done.wait()

    def __del__(self) -> None:
        driver = self._driver
        if driver is not None and not driver.done.is_set():
            driver.stop()
