"""Composable async streams: the base of aloader's sources and the transforms between them.

It owns :class:`Stream` (epochs, ``set_epoch``), the transforms ``shuffle``, ``map`` (whose
concurrent results are ordered by :class:`aloader.pipeline._pipeline.Results`, the loader's own
buffer), ``filter`` and :func:`interleave`, the adapter :func:`as_stream`, and the plumbing
of one epoch: the background task that runs the chain (``_Driver``) and the bounded channels
between tasks (``_Channel``).

A :class:`Stream` is an :class:`~aloader.IterableDataset` with ``async def __aiter__``, so
``DataLoader(stream, batch_size=...)`` batches it. Internally every stage passes *blocks* (lists
of items) to the next one, so per-item costs stay small; the consumer still receives one item at
a time.

Each ``async for`` over a stream (one epoch) runs the whole chain of stages in one background
task that reads at most a few blocks ahead of the consumer, then waits: a slow consumer stops
the sources. A chain that needs no task (:meth:`Stream._loopless`: sources over local files)
is pulled in the consumer's task instead, and its sync ``for`` on the consumer's thread with
no event loop (:class:`_LocalPairs`): the same stages, tokens and resume on every path.
Stages that need concurrency (``map(..., concurrency=n)``, shard read-ahead) run
helper tasks in that background task's task group and talk to it through bounded channels. No
stage holds a cancel scope or a task group across a ``yield``, so the chain can be closed from
any task, and closing the iterator (``aclose()``, garbage collection, cancelling the loader)
cancels the background task, which closes every file and connection the stages opened.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast, overload

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from .._backend import Detached
from .._exceptions import FetchError, RecordError, SourceError
from .._facade import PrivateLoop, SyncIterator, forbid_running_loop, run_here
from .._util import (
    Closing,
    Signal,
    ataken,
    check_int,
    close_iterator,
    is_async_callable,
    single_error,
    taken,
)
from .._workerinfo import get_worker_info, served_epoch, worker_slot
from ..data._dataset import IterableDataset
from ..data._random import GeneratorLike, as_generator, draw_seed, permutation
from ..pipeline._pipeline import Results

__all__ = (
    "FetchError",
    "RecordError",
    "SourceError",
    "Stream",
    "as_stream",
)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
U = TypeVar("U")

_UINT64 = 1 << 64
# Items per block when a stage builds blocks itself (sync iterables, interleave).
_BLOCK = 256


# --------------------------------------------------------------------------- resume
#
# Every stage hands on (block, token) pairs (:meth:`Stream._blocks_at`). A token is small,
# immutable data (no items) that, with a count ``skip``, names a position in the stage's
# output: "resume at the start of this token's block, then discard ``skip`` items".
# :meth:`Stream._state` turns (token, skip) into a JSON-able dict; ``_blocks_at(ctx, state)``
# resumes there. Encoding happens only when a state is asked for, so following the consumer
# costs a reference and a counter per batch. The invariant each stage keeps: resuming its
# output from ``_state(token, skip)`` yields exactly what the uninterrupted epoch yields after
# that position (the epoch, worker and seeds being the same).
#
# No stage (nor the consumer) keeps a block it handed on once it asks for the next: a stage
# that forwards blocks drops its reference after the yield (``del block``), and the consumer
# keeps the block's length, not the block. So a consumed block is freed before the next one
# is made, into the memory it held, still in the CPU's caches: kept, each block of Parquet
# rows (~2 MB of dicts) was made while the last one was alive (see ParquetRows._items).

STATE_FORMAT = "aloader.Stream"
STATE_VERSION = 1

_START: Any = None  # the token of an iterator that has received no block yet
_END: dict[str, Any] = {"stage": "end", "skip": 0}  # an epoch's position after its last item
_UNORDERED: Any = "unordered"  # the token of map(ordered=False)'s blocks: no position


class _Skip:
    """The token of a block whose first ``skip`` items were discarded (on resume)."""

    __slots__ = ("skip", "token")

    def __init__(self, token: Any, skip: int) -> None:
        self.token = token
        self.skip = skip

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Skip, (self.token, self.skip))


class _Encoded:
    """A token that is already a state (where a resumed stage started; None: its start)."""

    __slots__ = ("state",)

    def __init__(self, state: dict[str, Any] | None) -> None:
        self.state = state

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Encoded, (self.state,))


def _state_of(stage: Stream[Any], token: Any, skip: int) -> dict[str, Any] | None:
    """The state of ``stage`` at item ``skip`` of the block ``token`` names."""
    while type(token) is _Skip:
        token, skip = token.token, token.skip + skip
    if type(token) is _Encoded:
        state = token.state
        if state is None:
            if skip:
                raise AssertionError("a stage's start has no items before its first block")
            return None
        return {**state, "skip": state["skip"] + skip} if skip else state
    return stage._state(token, skip)


def _discard(
    pairs: AsyncGenerator[tuple[list[T], Any], None], count: int
) -> AsyncGenerator[tuple[list[T], Any], None]:
    """``pairs`` without their first ``count`` items (what the resumed consumer had); ``pairs``
    itself when there are none (one generator less for every block to pass through)."""
    return _discarding(pairs, count) if count else pairs


async def _discarding(
    pairs: AsyncGenerator[tuple[list[T], Any], None], count: int
) -> AsyncGenerator[tuple[list[T], Any], None]:
    async with Closing(pairs) as blocks:
        async for block, token in blocks:
            if count:
                if len(block) <= count:
                    count -= len(block)
                    continue
                block, token = block[count:], _Skip(token, count)
                count = 0
            yield block, token
            del block  # not kept while the next is made (see the resume notes above)


def _check_upstream(upstream: Stream[Any], at: dict[str, Any], slot: tuple[int, int, int],
                    field: str = "upstream") -> None:
    inner = check_field(at, field, (dict, type(None)), at.get("stage", "?"))
    if inner is not None:
        upstream._check(inner, slot)


def _bad_state(where: str, field: str, message: str) -> ValueError:
    return ValueError(f"cannot load this stream state: {where}: field {field!r} {message}")


def check_field(state: Any, field: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``state[field]``, checked to be of ``kind`` (an int is never a bool, nor negative)."""
    if not isinstance(state, dict):
        raise _bad_state(where, field, f"is missing: the state is not a dict but {state!r}")
    if field not in state:
        raise _bad_state(where, field, "is missing")
    value = state[field]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _bad_state(where, field, f"should be {_kind_name(kind)}, but is {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise _bad_state(where, field, f"should be non-negative, but is {value!r}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def check_stage(state: Any, stage: str, where: str) -> None:
    """``state`` is a position of a stage of kind ``stage`` (with its ``skip``)."""
    found = check_field(state, "stage", str, where)
    if found != stage:
        raise _bad_state(where, "stage", f"is {found!r}, but this stage is {stage!r}: the "
                                         "state comes from another stream")
    check_field(state, "skip", int, where)


def check_same(state: dict[str, Any], field: str, expected: Any, where: str) -> None:
    """``state[field] == expected``, else a ValueError naming the field and both values."""
    found = state.get(field)
    if found != expected:
        raise _bad_state(where, field, f"is {found!r}, but this stream has {expected!r}")


# --------------------------------------------------------------------------- plumbing


class _Abandoned(Exception):
    """The reading side of a channel is gone: the writer should stop."""


class _Channel(Generic[T]):
    """A bounded FIFO between two tasks of one event loop: a deque and one
    :class:`~aloader._util.Signal` that both ends wait on.

    Invariant: at most ``capacity`` items are queued; a task waits only when it cannot go on
    (a writer on a full channel, a reader on an empty one), and every change (an item in or
    out, the end, the reader leaving) notifies the signal, so a waiting end re-checks and
    never misses one. So an item costs no turn of the loop, and a wait is one real wait (a
    memory object stream took a checkpoint first, a turn of the loop more per wait).

    The writer's :meth:`end` may carry an error, which the reader gets after the queued items
    (``end`` is synchronous: writers call it from ``finally`` blocks, cancelled or not). The
    reader's :meth:`abandon` drops what is queued and makes the writer's next :meth:`put`
    raise :class:`_Abandoned`.
    """

    __slots__ = ("_capacity", "_changed", "_ended", "_error", "_gone", "_items")

    def __init__(self, capacity: int) -> None:
        self._items: deque[T] = deque()
        self._capacity = max(1, capacity)
        self._changed = Signal()
        self._ended = False
        self._gone = False  # the reader abandoned the channel
        self._error: BaseException | None = None

    async def put(self, item: T) -> None:
        """Append ``item``, waiting while the channel is full; _Abandoned once the reader left.

        An item that fits goes in without a turn of the loop (the writers' own reads give
        the loop its turns): the reader then finds it without one either.
        """
        while True:
            if self._gone:
                raise _Abandoned
            if len(self._items) < self._capacity:
                self._items.append(item)
                self._changed.notify()
                return
            await self._changed.wait()

    def end(self, error: BaseException | None = None) -> None:
        """No more items; the reader gets ``error`` (or the end) after the queued ones."""
        if not self._ended:
            self._ended = True
            self._error = error
            self._changed.notify()

    def abandon(self) -> None:
        """The reader is gone: drop what is queued and release a waiting writer."""
        self._gone = True
        self._items.clear()
        self._changed.notify()

    async def get(self) -> T:
        """The next item; StopAsyncIteration at the end, or the writer's error (once).

        A queued item is taken without a turn of the loop: a reader always waits once the
        queue is empty, and the writer cannot refill it meanwhile, so it still waits (and
        can be cancelled) at least once per ``capacity`` items.
        """
        items = self._items
        while not items:
            if self._ended or self._gone:
                error, self._error = self._error, None
                if error is not None:
                    raise error
                raise StopAsyncIteration
            await self._changed.wait()
        item = items.popleft()
        self._changed.notify()
        return item


@dataclass(frozen=True, eq=False)
class _Context:
    """What every stage of one epoch's chain shares.

    Attributes:
        epoch: the epoch (seeds shard orders and shuffles).
        worker_id: this loader worker's id (0 without workers).
        num_workers: loader workers per rank (1 without workers).
        group: the background task's task group, for stages that run helper tasks; None
            for an inline epoch (:meth:`Stream._loopless`), which no task may be started in:
            its chain runs in the consumer's own task, or with no event loop at all.
        reading: what the epoch's reading has counted so far, for the stages that count
            (the sources' stats, see :class:`aloader.sources._sources.ShardedSource`), each under a
            key of its own. One dict per reading of an epoch (:meth:`Stream._reading_of`),
            kept by every chain that reading opens: one reopened after an interrupt, a
            shuffle or mix replaying its input, the stream resumed from a state it saved
            itself. So what is read again is never counted again.
        blocking: the chain runs with no event loop (a sync ``for``, :class:`_LocalPairs`):
            its stages must never await a real event (a local file is read on this thread).
    """

    epoch: int
    worker_id: int
    num_workers: int
    group: anyio.abc.TaskGroup | None
    reading: dict[Any, Any]
    blocking: bool = False

    @property
    def inline(self) -> bool:
        """Whether the chain runs with no task group (in the consumer's task, or with no
        event loop when ``blocking``): one stage step at a time, no helper task."""
        return self.group is None

    def spawn(self, fn: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Start ``fn`` as a helper task of the epoch (never in an inline one)."""
        if self.group is None:
            raise AssertionError("an inline epoch cannot start a task")
        self.group.start_soon(fn)

    def rng(self, base_seed: int) -> np.random.Generator:
        """A generator for one stage in this epoch and worker, reproducible from its seed."""
        return np.random.default_rng(
            [base_seed, self.epoch % _UINT64, self.worker_id, self.num_workers]
        )


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
                    del pair  # not kept while the next is made (see the resume notes)
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
    see the resume notes at the top of the module), so no
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
                del block  # not kept while the next is made (see the resume notes)
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


class _Pairs(AsyncIterator[tuple[list[T], Any]]):
    """An epoch's (block, token) pairs as they come, none entered: for a consumer on another
    thread (:class:`_SyncItems`), which enters each block when it starts on it. ``aclose``
    may come while a ``__anext__`` waits (from the thread that closes the loop)."""

    __slots__ = ("_iterator",)

    def __init__(self, iterator: _StreamIterator[T]) -> None:
        self._iterator = iterator

    async def __anext__(self) -> tuple[list[T], Any]:
        return await self._iterator._receive()

    async def aclose(self) -> None:
        await self._iterator._stop()


class _LocalPairs(Iterator[tuple[list[T], Any]]):
    """An epoch's (block, token) pairs made on the consumer's thread, with no event loop and
    no thread (a loopless stream's sync ``for``, see :meth:`Stream._loopless`): the chain of
    stages is the one the driver runs (``_blocks_at``, the same decoding, tokens and resume),
    each of its steps driven to its end by :func:`~aloader._facade.run_here`.

    An error of the chain ends it (the caller ends the epoch). A KeyboardInterrupt (any
    BaseException) that lands in a step unwinds the chain, closing its files, as it would
    any generator; the next call opens the chain again from the position after the block
    the consumer last entered (the resume path, exact), so the epoch goes on where it was, as
    after an interrupt in the threaded path's wait. Closed (or dropped), it closes the chain.
    """

    __slots__ = ("_blocks", "_iterator")

    def __init__(self, iterator: _StreamIterator[T]) -> None:
        self._iterator = iterator
        self._blocks: AsyncGenerator[tuple[list[T], Any], None] | None = None

    def __iter__(self) -> _LocalPairs[T]:
        return self

    def _reopen(self) -> AsyncGenerator[tuple[list[T], Any], None]:
        iterator = self._iterator
        if iterator._token is _START:
            at = iterator._at
        else:  # after an interrupt: from the end of the block the consumer is on
            at = _state_of(iterator._stream, iterator._token, iterator._size)
        blocks = self._blocks = iterator._stream._blocks_at(
            iterator._context(blocking=True), at)
        return blocks

    def __next__(self) -> tuple[list[T], Any]:
        if self._iterator._finished:
            raise StopIteration
        blocks = self._blocks
        if blocks is None:
            blocks = self._reopen()
        try:
            while True:
                pair = run_here(blocks.__anext__())
                if pair[0]:  # the driver hands on no empty block either
                    return pair
        except StopAsyncIteration:
            self._blocks = None
            self._iterator._drained()
            raise StopIteration from None
        except BaseException:
            self._blocks = None  # unwound by the error: spent
            raise

    def close(self) -> None:
        blocks, self._blocks = self._blocks, None
        if blocks is not None:
            run_here(blocks.aclose())

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class _EnteredBlocks(Iterator[Iterator[T]]):
    """The cursor of each block of a sync ``for``'s epoch, entered when the consumer starts
    on it (:class:`_SyncItems` asks for the next one only once the last is spent).

    It never raises but at its end: an error of the epoch comes back as a cursor that raises
    it (:func:`_raising`), so the chain over it is not closed by it. An error of the stream ends
    the epoch (as ``async for`` ends), while a KeyboardInterrupt (any BaseException) that
    lands in the wait for a block leaves the epoch going on, as :class:`SyncIterator` does.
    """

    __slots__ = ("_iterator", "_pairs")

    def __init__(self, iterator: _StreamIterator[T],
                 pairs: SyncIterator[tuple[list[T], Any]] | _LocalPairs[T]) -> None:
        self._iterator = iterator
        self._pairs = pairs

    def __iter__(self) -> _EnteredBlocks[T]:
        return self

    def __next__(self) -> Iterator[T]:
        try:
            block, token = next(self._pairs)
        except StopIteration:
            self._iterator._end()
            raise
        except Exception as exc:
            self._iterator._end()
            return _raising(exc)
        except BaseException as exc:
            return _raising(exc)
        return self._iterator._enter(block, token)

    def close(self) -> None:
        self._iterator._end()
        self._pairs.close()


def _raising(error: BaseException) -> Iterator[Any]:
    """A cursor that raises ``error`` at its first step, then is spent."""
    yield from ()
    raise error


class _SyncItems(itertools.chain[T]):
    """A plain ``for`` over one epoch of a stream (what ``Stream.__iter__`` returns).

    Its blocks run on a private loop in another thread (:class:`_Pairs`, through a
    :class:`SyncIterator`): whole blocks cross the threads, and an item costs a step of
    ``itertools.chain`` over the block's cursor, no Python frame. :meth:`close` closes the
    epoch (its files and connections) and the loop; so does dropping the iterator.
    """

    _blocks: _EnteredBlocks[T]

    def close(self) -> None:
        """Close the epoch's iterator and wait until it is closed, then its loop."""
        self._blocks.close()


def _sync_items(iterator: _StreamIterator[T],
                pairs: SyncIterator[tuple[list[T], Any]] | _LocalPairs[T]) -> _SyncItems[T]:
    """The plain ``for`` over ``iterator``'s epoch, whose blocks ``pairs`` brings."""
    blocks = _EnteredBlocks(iterator, pairs)
    items: _SyncItems[T] = _SyncItems.from_iterable(blocks)  # type: ignore[assignment]
    items._blocks = blocks
    return items


# --------------------------------------------------------------------------- the base class


class Stream(IterableDataset[T_co]):
    """A composable async stream of items: an iterable dataset with ``async def __aiter__``.

    Every ``async for`` over a stream is one epoch. Without :meth:`set_epoch`, each new
    iteration advances the epoch counter (0, 1, 2, ...), which seeds shard orders and shuffles
    together with their seeds, like ``DistributedSampler``'s ``seed + epoch``. After
    ``set_epoch(e)`` every iteration uses epoch ``e`` until the next call.

    With loader worker processes, the loader's copy of the stream claims each epoch's number
    as an iteration would (``set_epoch``'s value, else its counter, which advances), and the
    workers' copies iterate that epoch, persistent or not. So every epoch has a new order, the
    same sequence of orders per seed: with one worker exactly that of ``num_workers=0``; with
    more, each epoch's shard order is that of ``num_workers=0``, split across the workers, and
    each worker's shuffles are seeded by (seed, epoch, worker). Another stream iterated
    inside a worker (held by a dataset of your own) uses its own ``set_epoch`` value if it has
    one, else the loader's epoch (:attr:`aloader.WorkerInfo.epoch`).

    Streams compose: ``source.shuffle(1000, seed=0).map(parse, concurrency=16).filter(ok)``,
    and :func:`interleave` mixes several. Memory stays bounded: an epoch reads at most a couple
    of blocks ahead of its consumer, and every stage documents what it holds.

    Streams resume (torchdata's protocol): :meth:`state_dict` says where the consumer of the
    current epoch is, and :meth:`load_state_dict` on an equal stream makes its next iteration
    yield exactly the rest of that epoch, then the same later epochs. Sources resume inside a
    shard at the record (a seek, a ``Range`` request), ``shuffle`` by replaying its input from
    a checkpoint, ``map`` and ``filter`` through their input, ``interleave`` from each input's
    position; a stage of your own that only defines ``_blocks`` is replayed from its start
    and the items the consumer had discarded. ``map(..., ordered=False)`` has no position to
    save (:meth:`state_dict` raises ValueError). A state belongs to one loader worker slot
    (``worker`` in it: [id, num_workers]) and, during an epoch, to one rank of one world size
    of its sharded sources (``world``): ``load_state_dict`` resumes it in the same slot and
    on the same rank; a :class:`~aloader.DataLoader`'s own state resumes with any
    ``num_workers`` (it runs the saved slots as virtual replicas), and on any world size
    between epochs, never inside one (each rank's shards would change).
    """

    # Class-level defaults keep subclasses free of any required __init__ call.
    _fixed_epoch: int | None = None
    _next_epoch: int = 0
    #: Blocks the background task may read ahead of the consumer.
    _prefetch_blocks: int = 2
    # The latest iterator (for state_dict), and what load_state_dict left for the next one.
    _live: weakref.ref[Any] | None = None
    _resume_epoch: int | None = None
    _resume_at: dict[str, Any] | None = None
    # Per worker slot: (epoch, reading) of the latest iterator, until it read to the end.
    _readings: dict[tuple[int, int], tuple[int, dict[Any, Any]]] | None = None

    def _blocks(self, ctx: _Context) -> AsyncGenerator[list[T_co], None]:
        """This epoch's items, in blocks (lists); subclasses implement it."""
        raise NotImplementedError

    def _upstreams(self) -> Sequence[Stream[Any]]:
        return ()

    def _loopless(self) -> bool:
        """Whether this stage's epoch can run inline: given a :class:`_Context` with no task
        group, its ``_blocks_at`` starts no task, and with ``blocking`` it awaits no real
        event (no thread, no sleep). Then a sync ``for`` drives the chain on the consumer's
        thread with no loop (:class:`_LocalPairs`), and an ``async for`` (or the loader's
        ``_take``) pulls it in the consumer's own task, with no background task and no
        channel between them (:meth:`_StreamIterator._receive`). False unless a stage says
        so."""
        return False

    @property
    def epoch(self) -> int:
        """The epoch the next iteration will use."""
        return self._fixed_epoch if self._fixed_epoch is not None else self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for every following iteration (of this stream and its inputs).

        Args:
            epoch: epoch number; with the seeds, it decides shard orders and shuffles.
        """
        self._fixed_epoch = int(epoch)
        for upstream in self._upstreams():
            upstream.set_epoch(epoch)

    def __aiter__(self) -> AsyncIterator[T_co]:
        """Start one epoch: items one by one, read in the background at most a few blocks
        ahead of the consumer (a loopless stream's, such as ``TextLines`` over local files:
        in the consumer's task as it reaches them);
        after :meth:`load_state_dict`, the rest of the epoch it saved.

        The iterator is an async generator (``aclose()`` closes it; leaving an ``async for``
        early leaves it to be closed when it is garbage-collected, as any async generator).
        """
        return self._open().items()

    def _open(self) -> _StreamIterator[T_co]:
        """Start one epoch: its iterator, with the position :meth:`state_dict` reads (the
        loader's way in: it cuts batches with ``_take``)."""
        at = self._resume_at
        epoch = self._claim_epoch()
        iterator = _StreamIterator(self, epoch, self._prefetch_blocks, at,
                                   self._reading_of(epoch, at))
        if at == _END:
            iterator._finished = True
        self._live = weakref.ref(iterator)
        return iterator

    def _reading_of(self, epoch: int, at: dict[str, Any] | None) -> dict[Any, Any]:
        """The reading an iteration of ``epoch`` opened now from ``at`` counts into
        (:attr:`_Context.reading`): from a position inside the epoch, the reading of this
        stream's latest iterator of it in this worker slot if that one did not read to the
        end (a state this stream saved, resumed: its counts go on, what the old iterator read
        ahead is not counted again); else a new one (an epoch from its start, or a state
        saved by another stream, which counts from its position)."""
        slot = worker_slot()
        readings = self._readings
        if readings is None:
            readings = self._readings = {}
        kept = readings.get(slot)
        if at is not None and kept is not None and kept[0] == epoch:
            return kept[1]
        reading: dict[Any, Any] = {}
        readings[slot] = (epoch, reading)
        return reading

    def _reading_done(self, slot: tuple[int, int], reading: dict[Any, Any]) -> None:
        """``reading`` (of worker ``slot``) read its epoch to the end (see _reading_of)."""
        readings = self._readings
        if readings is not None:
            kept = readings.get(slot)
            if kept is not None and kept[1] is reading:
                del readings[slot]

    # Resume (torchdata's protocol) -------------------------------------------------------
    def _blocks_at(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        """This epoch's (block, token) pairs from position ``at`` (None: the start); see
        ``_state``. A stage that only defines ``_blocks`` is resumed by counting: its epoch
        is replayed from the start and the items the consumer had are discarded."""
        if at is not None:
            check_stage(at, "count", type(self).__name__)
        return _discard(self._counted(ctx), 0 if at is None else at["skip"])

    async def _counted(self, ctx: _Context) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        count = 0
        async with Closing(self._blocks(ctx)) as blocks:
            async for block in blocks:
                size = len(block)
                yield block, count
                del block  # not kept while the next is made (see the resume notes above)
                count += size

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        """The position at item ``skip`` of the block ``token`` names, as JSON builtins."""
        return {"stage": "count", "skip": int(token) + skip}

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        """Validate a position of this stage (and its inputs) before anything is applied, for
        ``slot``: (epoch, worker id, num_workers)."""
        check_stage(at, "count", type(self).__name__)

    def state_dict(self) -> dict[str, Any]:
        """Where this stream is: the epoch counter and, during an epoch, the position of the
        consumer of its latest iterator (what it received, not what was read ahead).

        The state is small, JSON builtins only (no items): shard, byte offset and record
        numbers of the sources, the shuffle buffer's random state and where its input must
        be replayed from, ... :meth:`load_state_dict` on an equal stream (same arguments,
        same shards) resumes it exactly. A :class:`~aloader.DataLoader` records the position
        of each batch it cuts, so its own ``state_dict`` reflects the batches delivered.
        """
        live = self._live() if self._live is not None else None
        snapshot = live._snapshot() if isinstance(live, _StreamIterator) else None
        return self._state_from(snapshot)

    def _state_from(self, snapshot: tuple[Any, ...] | None, *,
                    counters: Stream[Any] | None = None, at_end: bool = False
                    ) -> dict[str, Any]:
        """The state for an iterator's ``_snapshot()`` (None: no epoch under way); the epoch
        counters are those of ``counters`` (by default this stream). A finished iterator
        means no epoch under way, or with ``at_end`` (a loader's epoch that has not ended
        yet) its epoch at its end, which resumes with nothing left."""
        owner = self if counters is None else counters
        state: dict[str, Any] = {
            "format": STATE_FORMAT, "version": STATE_VERSION, "stream": type(self).__name__,
            "next_epoch": owner._next_epoch, "fixed_epoch": owner._fixed_epoch,
            "epoch": None, "position": None, "worker": [0, 1], "world": self._worlds(),
        }
        if snapshot is not None:
            epoch, token, pos, finished, at, slot = snapshot
            state["worker"] = [slot[0], slot[1]]
            if finished and at_end:
                state["epoch"], state["position"] = epoch, _END
            elif not finished:
                state["epoch"] = epoch
                state["position"] = at if token is _START else _state_of(self, token, pos)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration continues the saved epoch
        where its consumer was (or starts the next one, if none was under way).

        Raises:
            ValueError: a state of another format or version, of another kind of stream,
                stage or shard list, taken by another loader worker, or taken during an epoch
                on another rank or world size; it names the field. Nothing is applied then.
            TypeError: ``state`` is not a dict.
        """
        self._apply_state(self._parse_state(state, worker_slot()))

    def _parse_state(self, state: Any, slot: tuple[int, int]) -> tuple[Any, ...]:
        """The validated parts of a state meant for worker ``slot`` (id, num_workers)."""
        where = type(self).__name__
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict needs a dict, but got {type(state).__name__}")
        check_same(state, "format", STATE_FORMAT, where)
        check_same(state, "version", STATE_VERSION, where)
        check_same(state, "stream", type(self).__name__, where)
        next_epoch = check_field(state, "next_epoch", int, where)
        fixed = check_field(state, "fixed_epoch", (int, type(None)), where)
        epoch = check_field(state, "epoch", (int, type(None)), where)
        position = check_field(state, "position", (dict, type(None)), where)
        worker = check_field(state, "worker", list, where)
        if worker != list(slot):
            # A loader resumes another num_workers' replicas as virtual ones, each in its
            # saved slot (aloader.loader._epochs): a mismatch is a state given to the wrong replica.
            raise _bad_state(where, "worker", f"is {worker!r} ([worker id, num_workers]), but "
                             f"this is worker {list(slot)}: a stream's state resumes in the "
                             "worker slot it was saved in (a DataLoader resumes it with any "
                             "num_workers)")
        world = check_field(state, "world", list, where)
        if position is not None and world != self._worlds():
            raise _bad_state(where, "world", f"is {world!r} ([rank, world_size] of each "
                             f"sharded source), but this stream's is {self._worlds()!r}: a "
                             "state taken during an epoch resumes only on the same rank of "
                             "the same world size (one taken between epochs, on any)")
        if position is not None:
            if epoch is None:
                raise _bad_state(where, "epoch", "is None, but a position is given")
            if position != _END:
                self._check(position, (epoch, slot[0], slot[1]))
        return next_epoch, fixed, epoch, position

    def __getstate__(self) -> dict[str, Any]:
        # The latest iterator is this process's (and a weak reference does not pickle).
        state = self.__dict__.copy()
        state.pop("_live", None)
        state.pop("_readings", None)  # what this process counted
        return state

    def _worlds(self) -> list[list[int]]:
        """``[rank, world_size]`` of every sharded source of this stream, inputs first to
        last: a position inside an epoch belongs to that split of the shards."""
        worlds = []
        rank, size = getattr(self, "rank", None), getattr(self, "world_size", None)
        if type(rank) is int and type(size) is int:
            worlds.append([rank, size])
        for upstream in self._upstreams():
            worlds.extend(upstream._worlds())
        return worlds

    def _apply_state(self, parsed: tuple[Any, ...]) -> None:
        self._next_epoch, self._fixed_epoch, self._resume_epoch, self._resume_at = parsed

    def __iter__(self) -> Iterator[T_co]:
        """One epoch for synchronous code: what ``async for`` over the stream yields.

        A loopless stream (:meth:`_loopless`: a sharded source whose shards are all local
        files, such as ``TextLines(dir)`` or ``JsonLines(dir)``, with any compression,
        sharding, ``records_per_rank`` or ``skip_errors``) runs its epoch on this thread with
        no event loop and no thread: each block is read (one shard after another, a blocking
        read as a plain ``open(f)`` loop's), decoded and handed on when the consumer reaches
        it. Any other stream (remote shards, transforms, streams of
        your own) runs on an event loop of its own in a background thread (see
        :mod:`aloader._facade`), closed with the iterator, and its items cross to this thread
        in whole blocks. Both run the same chain of stages, so they give the same items,
        stats and states. Leaving the ``for`` early (``break``, an exception) closes the
        stream's iterator and so its files and connections, as leaving an ``async for`` does,
        and so does the iterator's ``close()``. :meth:`state_dict` says what this thread
        received, not what was read ahead.

        Raises:
            RuntimeError: a ``for`` inside a running event loop, which it would block.
        """
        forbid_running_loop("Stream", "item in stream")
        if self._loopless():
            iterator = self._open()
            return _sync_items(iterator, _LocalPairs(iterator))
        opened: list[_StreamIterator[T_co]] = []

        def open_() -> AsyncIterator[tuple[list[T_co], Any]]:
            # On the loop, as an async for would open it there.
            opened.append(self._open())
            return _Pairs(opened[0])

        pairs = SyncIterator(open_, PrivateLoop(), owns_loop=True)
        return _sync_items(opened[0], pairs)

    def _claim_epoch(self) -> int:
        """The epoch of an iteration starting now; advances the counter as iterating does.

        The loader calls it on its copy when its workers iterate the stream instead.
        """
        resumed, self._resume_epoch, self._resume_at = self._resume_epoch, None, None
        served = served_epoch()
        if served is not None:  # in a loader worker
            info = get_worker_info()
            if info is not None and info.dataset is self:
                return served  # what the loader's copy claimed, set_epoch included
            if self._fixed_epoch is None:
                self._next_epoch = served + 1
                return served
        if resumed is not None:  # the epoch a state was saved in (already counted)
            return resumed
        if self._fixed_epoch is not None:
            return self._fixed_epoch
        epoch = self._next_epoch
        self._next_epoch = epoch + 1
        return epoch

    # Transforms --------------------------------------------------------------------------
    def shuffle(self, buffer_size: int, seed: GeneratorLike = None) -> Stream[T_co]:
        """Shuffle the stream through a buffer of ``buffer_size`` items (webdataset's
        ``shuffle(n)``, tf.data's ``shuffle``).

        The buffer fills with the first ``buffer_size`` items; then each new item takes the
        place of a uniformly chosen buffered one, which is emitted; at the end the rest is
        emitted in random order. The stage never holds more than ``buffer_size`` items. The
        order depends only on the input order, the seed, the epoch and the worker, so it is
        reproducible.

        Its saved state holds no item: a checkpoint (the input's position, the random state
        and how full the buffer was, taken every ``max(256, buffer_size)`` input items)
        older than every buffered item, and the outputs to discard. Resuming replays the input
        from there, about ``buffer_size * (ln(buffer_size) + 1)`` items (measured: 940 for
        100, 9 900 for 1 000, 100 000 for 10 000), and continues exactly.

        Args:
            buffer_size: items held at most (1 keeps the order).
            seed: None (fresh entropy), an int or a numpy Generator; one base seed is drawn
                from it at construction and each epoch's shuffle is seeded by
                ``(base seed, epoch, worker)``.

        Raises:
            ValueError: ``buffer_size`` is not a positive integer.
        """
        return _Shuffled(self, buffer_size, seed)

    @overload
    def map(
        self, fn: Callable[[T_co], Awaitable[U]], *, concurrency: int = 1, ordered: bool = True
    ) -> Stream[U]: ...

    @overload
    def map(
        self, fn: Callable[[T_co], U], *, concurrency: int = 1, ordered: bool = True
    ) -> Stream[U]: ...

    def map(
        self,
        fn: Callable[[T_co], Any],
        *,
        concurrency: int = 1,
        ordered: bool = True,
    ) -> Stream[Any]:
        """Apply ``fn`` to every item.

        ``fn`` may be a plain function or an ``async def``. With ``concurrency=1`` calls run
        one at a time on the event loop (a plain function should be quick). With
        ``concurrency=n > 1``, up to ``n`` calls run at once: async functions on the event
        loop, plain functions in worker threads (for blocking I/O or code that releases the
        GIL). The stage then holds at most ``2 * n`` items (running or finished and waiting),
        and starts its helper tasks as items arrive, so a huge ``n`` costs nothing more than
        the calls actually in flight. A failing call raises its error once the results before
        it are delivered, whatever the concurrency.

        Args:
            fn: the function.
            concurrency: calls in flight at most.
            ordered: keep the input order (True), or emit results as they finish (False: not
                reproducible, but one slow item does not hold back the others).

        Raises:
            ValueError: ``concurrency`` is not a positive integer.
        """
        return _Mapped[Any](self, fn, concurrency, ordered)

    def filter(self, predicate: Callable[[T_co], bool | Awaitable[bool]]) -> Stream[T_co]:
        """Keep the items for which ``predicate`` (plain or ``async def``) is true.

        Args:
            predicate: called once per item, in order.
        """
        return _Filtered(self, predicate)


# --------------------------------------------------------------------------- shuffle


class _Shuffled(Stream[T_co]):
    def __init__(self, upstream: Stream[T_co], buffer_size: int, seed: GeneratorLike) -> None:
        self.upstream = upstream
        self.buffer_size = check_int("buffer_size", buffer_size)
        self.seed = draw_seed(as_generator(seed))
        #: The most items the buffer has held (a bound the tests check).
        self.max_buffered = 0

    def _upstreams(self) -> Sequence[Stream[Any]]:
        return (self.upstream,)

    # Resume. The buffer's items are not recorded: its output from any point is a function
    # of the input from some earlier point (a checkpoint: the input's position, the random
    # state, how full the buffer was) as long as every item buffered at that checkpoint has
    # been emitted since. So a state names the latest such checkpoint and how many outputs
    # to discard; resuming replays the input from there, buffered items standing in as
    # placeholders, all of them emitted among the discarded outputs. ``ids`` holds a lower
    # bound of the input number of each buffered item (exact but for slots picked twice in a
    # block), so its minimum bounds the oldest item still buffered: checkpoints older than
    # that are dropped. The replay reads back about ``buffer_size * ln(buffer_size)`` items,
    # what it takes for the buffer to turn over.

    def _blocks_at(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        return self._shuffled(ctx, at)

    async def _shuffled(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        rng = ctx.rng(self.seed)
        size = self.buffer_size
        buffer: list[Any] = []
        ingested = 0  # input items taken so far (numbered from the epoch's start)
        emitted = 0  # output items so far, in this run
        discard = 0  # outputs the resumed consumer already had
        dummies = 0  # placeholders still in the buffer
        checkpoints: deque[tuple[int, tuple[Any, ...]]] = deque()
        if at is not None:
            rng.bit_generator.state = at["rng"]
            dummies = at["fill"]
            buffer = [_PLACEHOLDER] * dummies
            ingested = at["ingested"]
            discard = at["skip"]
            checkpoints.append((ingested, (_Encoded(at["upstream"]), at["rng"], dummies, 0,
                                           ingested)))
        # Grown with the buffer (up to ``size``), never allocated for the size it may reach:
        # ``shuffle(10**12)`` over a short stream holds only what the stream holds.
        ids = np.full(max(len(buffer), min(size, _BLOCK)), ingested, dtype=np.int64)
        every = max(_BLOCK, size)  # input items between checkpoints
        oldest = ingested  # a lower bound of the oldest buffered item's number
        upstream = self.upstream._blocks_at(ctx, None if at is None else at["upstream"])

        def cut(out: list[Any]) -> tuple[list[Any], Any] | None:
            nonlocal emitted, discard, dummies
            token: Any = (checkpoints[0][1], emitted)
            emitted += len(out)
            if discard:
                if len(out) <= discard:
                    discard -= len(out)
                    dummies -= _count_placeholders(out) if dummies else 0
                    return None
                dropped, out = out[:discard], out[discard:]
                if dummies:
                    dummies -= _count_placeholders(dropped)
                token, discard = _Skip(token, discard), 0
            if dummies and _count_placeholders(out):
                raise ValueError("cannot resume this shuffle: its state does not fit its input "
                                 "(a buffered item would be emitted twice)")
            return out, token

        async with Closing(upstream) as blocks:
            async for block, up_token in blocks:
                if not checkpoints or ingested - checkpoints[-1][0] >= every:
                    if buffer:
                        oldest = max(oldest, int(ids[: len(buffer)].min()))
                    while len(checkpoints) > 1 and checkpoints[1][0] <= oldest:
                        checkpoints.popleft()
                    checkpoints.append((ingested, (up_token, rng.bit_generator.state,
                                                   len(buffer), emitted, ingested)))
                room = size - len(buffer)
                if room > 0:
                    taken = block[:room]
                    if len(buffer) + len(taken) > len(ids):
                        ids = _grown(ids, len(buffer) + len(taken), size)
                    ids[len(buffer) : len(buffer) + len(taken)] = np.arange(
                        ingested, ingested + len(taken))
                    buffer.extend(taken)
                    ingested += len(taken)
                    self.max_buffered = max(self.max_buffered, len(buffer))
                    if len(block) <= room:
                        continue
                    block = block[room:]
                drawn = rng.integers(0, size, size=len(block))
                ids[drawn] = np.arange(ingested, ingested + len(block))
                ingested += len(block)
                out: list[T_co] = []
                append = out.append
                for slot, item in zip(drawn.tolist(), block, strict=True):
                    append(buffer[slot])
                    buffer[slot] = item
                pair = cut(out)
                if pair is not None:
                    yield pair
        if buffer:
            order = permutation(rng, len(buffer)).tolist()
            pair = cut([buffer[i] for i in order])
            if pair is not None:
                yield pair

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        (up_token, rng_state, fill, cp_emitted, cp_ingested), emitted = token
        return {
            "stage": "shuffle", "buffer_size": self.buffer_size, "seed": self.seed,
            "upstream": _state_of(self.upstream, up_token, 0), "rng": rng_state,
            "fill": fill, "ingested": cp_ingested, "skip": emitted - cp_emitted + skip,
        }

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        check_stage(at, "shuffle", "shuffle")
        check_same(at, "buffer_size", self.buffer_size, "shuffle")
        check_same(at, "seed", self.seed, "shuffle")
        fill = check_field(at, "fill", int, "shuffle")
        if fill > self.buffer_size:
            raise _bad_state("shuffle", "fill", f"is {fill}, more than the buffer_size")
        check_field(at, "ingested", int, "shuffle")
        rng_state = check_field(at, "rng", dict, "shuffle")
        try:
            np.random.default_rng().bit_generator.state = rng_state
        except (TypeError, ValueError, KeyError) as exc:
            raise _bad_state("shuffle", "rng", f"is not a PCG64 state: {exc}") from None
        _check_upstream(self.upstream, at, slot)


def _grown(ids: npt.NDArray[np.int64], need: int, size: int) -> npt.NDArray[np.int64]:
    """``ids`` with room for at least ``need`` (doubling, at most ``size``)."""
    grown = np.empty(min(size, max(need, 2 * len(ids))), dtype=np.int64)
    grown[: len(ids)] = ids
    return grown


_PLACEHOLDER: Any = object()  # a buffered item of a resumed shuffle, emitted before the resume


def _count_placeholders(items: list[Any]) -> int:
    return sum(1 for item in items if item is _PLACEHOLDER)


# --------------------------------------------------------------------------- map


class _ConcurrentMap(Generic[T, U]):
    """``map`` with concurrency: workers pull items, results go back in order (or not).

    Item ``k`` (numbered in input order) is a job of a :class:`~aloader.pipeline._pipeline.Results`
    of capacity ``2 * concurrency``: a worker reserves its output slot before it pulls the
    item, so at most ``2 * concurrency`` items are held between their pull and their hand-over
    to the consumer, and in order the head of the line can always be handed over.

    Workers start as work arrives, not all at once: one runs from the start, and a worker
    that has pulled an item starts another when no worker is left free to pull the next, so
    at most ``min(concurrency, calls in flight + 1)`` exist whatever ``concurrency`` says.
    """

    def __init__(
        self,
        upstream: AsyncGenerator[tuple[list[T], Any], None],
        call: Callable[[T], Awaitable[U]],
        concurrency: int,
        ordered: bool,
    ) -> None:
        self.upstream = upstream
        self.call = call
        self.concurrency = concurrency
        self.results = Results(2 * concurrency, ordered)
        self.lock = anyio.Lock()  # one worker at a time reserves, numbers and pulls an item
        self.block: list[T] = []
        self.pos = 0
        self.exhausted = False
        self.next_seq = 0
        # (number of the first item, token) of each input block not yet all handed on.
        self.spans: deque[tuple[int, Any]] = deque()
        self.scope = anyio.CancelScope()
        self.group: anyio.abc.TaskGroup | None = None
        self.workers = 0  # started and not returned
        self.running = 0  # of them, inside a call
        self.max_running = 0
        self.max_workers = 0

    async def pull(self) -> tuple[int, T] | None:
        async with self.lock:
            if self.exhausted:
                return None
            seq = self.next_seq
            await self.results.reserve(seq)
            while self.pos >= len(self.block):
                try:
                    self.block, token = await self.upstream.__anext__()
                except StopAsyncIteration:
                    self.exhausted = True
                    self.results.finish(seq)
                    return None
                except Exception as exc:
                    # The upstream's error takes its place in the order.
                    self.exhausted = True
                    self.results.publish(seq, None, exc)
                    self.results.finish(seq + 1)
                    return None
                self.pos = 0
                if self.block:
                    self.spans.append((seq, token))
            item = self.block[self.pos]
            self.pos += 1
            self.next_seq = seq + 1
            if self.pos == len(self.block):
                self.block = []
            return seq, item

    async def worker(self) -> None:
        while (got := await self.pull()) is not None:
            seq, item = got
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            if self.running == self.workers and self.workers < self.concurrency:
                self.spawn()  # nobody is left to pull the next item
            try:
                value = await self.call(item)
            except Exception as exc:
                self.results.publish(seq, None, exc)
            else:
                self.results.publish(seq, value)
            finally:
                self.running -= 1

    def spawn(self) -> None:
        assert self.group is not None
        self.workers += 1
        self.max_workers = max(self.max_workers, self.workers)
        self.group.start_soon(self._worker_task)

    async def _worker_task(self) -> None:
        try:
            await self.worker()
        finally:
            self.workers -= 1

    async def run(self) -> None:
        try:
            with self.scope:
                async with anyio.create_task_group() as group:
                    self.group = group
                    self.spawn()
        finally:
            await close_iterator(self.upstream)


class _Mapped(Stream[U]):
    def __init__(
        self,
        upstream: Stream[Any],
        fn: Callable[[Any], Any],
        concurrency: int,
        ordered: bool,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"map needs a callable, but got {fn!r}")
        self.upstream = upstream
        self.fn = fn
        self.concurrency = check_int("concurrency", concurrency)
        self.ordered = bool(ordered)
        self.is_async = is_async_callable(fn)
        #: The most calls that ran at once, and the most items the stage held.
        self.max_running = 0

    def _upstreams(self) -> Sequence[Stream[Any]]:
        return (self.upstream,)

    def _blocks_at(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[U], Any], None]:
        # Item k out is item k in: the upstream resumes where the consumer was, and items the
        # consumer had are never mapped again.
        upstream = self.upstream._blocks_at(ctx, None if at is None else at["upstream"])
        return _discard(self._mapped(ctx, upstream), 0 if at is None else at["skip"])

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        if token is _UNORDERED:
            raise ValueError(
                "map(..., ordered=False) hands on results as they finish, in no reproducible "
                "order: a stream with such a stage cannot save its position (use ordered=True)"
            )
        return {"stage": "map", "upstream": _state_of(self.upstream, token, skip), "skip": 0}

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        check_stage(at, "map", "map")
        if not self.ordered:
            raise _bad_state("map", "stage", "names a map stage, but this one has "
                                             "ordered=False, which cannot resume")
        _check_upstream(self.upstream, at, slot)

    async def _mapped(
        self, ctx: _Context, upstream: AsyncGenerator[tuple[list[Any], Any], None]
    ) -> AsyncGenerator[tuple[list[U], Any], None]:
        fn = self.fn
        if self.concurrency == 1:
            async with Closing(upstream) as blocks:
                async for block, token in blocks:
                    # The results before a failing item are delivered before its error, as
                    # with concurrency: a block is not all or nothing.
                    done: list[U] = []
                    append = done.append
                    error: Exception | None = None
                    try:
                        if self.is_async:
                            self.max_running = 1
                            for item in block:
                                append(await fn(item))
                        else:
                            for item in block:
                                append(fn(item))
                    except Exception as exc:
                        error = exc
                    if done:
                        yield done, token
                    if error is not None:
                        raise error
            return

        call: Callable[[Any], Awaitable[U]]
        if self.is_async:
            call = fn
        else:
            limiter = anyio.CapacityLimiter(self.concurrency)

            async def call(item: Any) -> U:
                return cast(U, await anyio.to_thread.run_sync(fn, item, limiter=limiter))

        mapping: _ConcurrentMap[Any, U] = _ConcurrentMap(upstream, call, self.concurrency,
                                                         self.ordered)
        ctx.spawn(mapping.run)
        results = mapping.results
        spans = mapping.spans
        emitted = 0  # results handed on: the input number of the next one, in order
        try:
            while True:
                # A block of every result ready now: the first one waited for, then the rest.
                try:
                    ready: tuple[Any, BaseException | None] | None = await results.take()
                except StopAsyncIteration:
                    return
                if self.ordered:
                    while len(spans) > 1 and spans[1][0] <= emitted:
                        spans.popleft()
                    first, token = spans[0]
                    token = _Skip(token, emitted - first) if emitted > first else token
                else:
                    token = _UNORDERED
                out: list[U] = []
                while ready is not None:
                    value, failure = ready
                    if failure is not None:
                        if out:
                            yield out, token
                        raise failure
                    out.append(value)
                    ready = results.poll()
                emitted += len(out)
                self.max_running = max(self.max_running, mapping.max_running)
                yield out, token
        finally:
            self.max_running = max(self.max_running, mapping.max_running)
            mapping.scope.cancel()


# --------------------------------------------------------------------------- filter


class _Filtered(Stream[T_co]):
    def __init__(self, upstream: Stream[T_co], predicate: Callable[[Any], Any]) -> None:
        if not callable(predicate):
            raise TypeError(f"filter needs a callable, but got {predicate!r}")
        self.upstream = upstream
        self.predicate = predicate
        self.is_async = is_async_callable(predicate)

    def _upstreams(self) -> Sequence[Stream[Any]]:
        return (self.upstream,)

    def _blocks_at(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        upstream = self.upstream._blocks_at(ctx, None if at is None else at["upstream"])
        return _discard(self._kept(upstream), 0 if at is None else at["skip"])

    async def _kept(
        self, upstream: AsyncGenerator[tuple[list[T_co], Any], None]
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        predicate = self.predicate
        async with Closing(upstream) as blocks:
            async for block, token in blocks:
                if self.is_async:
                    kept = [item for item in block if await predicate(item)]
                else:
                    kept = [item for item in block if predicate(item)]
                if kept:
                    yield kept, token

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        # The upstream at the start of the input block, and the kept items to discard.
        return {"stage": "filter", "upstream": _state_of(self.upstream, token, 0), "skip": skip}

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        check_stage(at, "filter", "filter")
        _check_upstream(self.upstream, at, slot)


# --------------------------------------------------------------------------- interleave


class _Cursor(Generic[T]):
    """One input of an interleave: its blocks, the position in the current one, and that
    block's token (where the input is, for a state)."""

    __slots__ = ("block", "blocks", "pos", "token")

    def __init__(self, blocks: AsyncGenerator[tuple[list[T], Any], None], token: Any) -> None:
        self.blocks = blocks
        self.block: list[T] = []
        self.pos = 0
        self.token = token

    async def refill(self) -> bool:
        """Load the next non-empty block; False at the end of the input."""
        while True:
            try:
                self.block, self.token = await self.blocks.__anext__()
            except StopAsyncIteration:
                self.block = []
                return False
            self.pos = 0
            if self.block:
                return True


async def _no_blocks() -> AsyncGenerator[tuple[list[Any], Any], None]:
    """The blocks of an input that had ended when a state was saved."""
    none: tuple[tuple[list[Any], Any], ...] = ()
    for pair in none:
        yield pair


class _Interleaved(Stream[Any]):
    """Round-robin interleave (weighted interleave is :func:`aloader.mix`'s job)."""

    def __init__(self, streams: Sequence[Stream[Any]], stop_on_first: bool) -> None:
        if not streams:
            raise ValueError("interleave needs at least one stream")
        self.streams = list(streams)
        self.stop_on_first = bool(stop_on_first)

    def _upstreams(self) -> Sequence[Stream[Any]]:
        return self.streams

    # A block is cut after a whole round: its token is where each input then was and which
    # inputs were still running.

    def _blocks_at(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[Any], Any], None]:
        return _discard(self._mixed(ctx, at), 0 if at is None else at["skip"])

    async def _mixed(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[Any], Any], None]:
        count = len(self.streams)
        starts: list[dict[str, Any] | None] = [None] * count if at is None else at["inputs"]
        running = [True] * count if at is None else list(at["running"])
        # One cursor per input; those that had ended when the state was saved stay closed.
        cursors = [
            _Cursor(stream._blocks_at(ctx, start) if live else _no_blocks(), _Encoded(start))
            for stream, start, live in zip(self.streams, starts, running, strict=True)
        ]
        try:
            async with Closing(self._round_robin(cursors, running)) as blocks:
                async for block in blocks:
                    yield block
        finally:
            with anyio.CancelScope(shield=True):
                for cursor in cursors:
                    await cursor.blocks.aclose()

    @staticmethod
    def _mark(cursors: list[_Cursor[Any]], running: list[bool]) -> tuple[Any, ...]:
        """Where every input is now (the token of the next block cut)."""
        marks = tuple((c.token, c.pos) if live else None
                      for c, live in zip(cursors, running, strict=True))
        return (marks, tuple(running))

    async def _round_robin(
        self, cursors: list[_Cursor[Any]], running: list[bool]
    ) -> AsyncGenerator[tuple[list[Any], Any], None]:
        active = [i for i, live in enumerate(running) if live]
        token = self._mark(cursors, running)
        out: list[Any] = []
        while active:
            still: list[int] = []
            for i in active:
                cursor = cursors[i]
                if cursor.pos >= len(cursor.block) and not await cursor.refill():
                    if self.stop_on_first:
                        if out:
                            yield out, token
                        return
                    running[i] = False
                    continue
                out.append(cursor.block[cursor.pos])
                cursor.pos += 1
                still.append(i)
            active = still
            if len(out) >= _BLOCK:
                yield out, token
                out = []
                token = self._mark(cursors, running)
        if out:
            yield out, token

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        marks, running = token
        inputs = [
            None if mark is None else _state_of(stream, mark[0], mark[1])
            for stream, mark in zip(self.streams, marks, strict=True)
        ]
        return {"stage": "interleave", "inputs": inputs, "running": list(running), "skip": skip}

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        check_stage(at, "interleave", "interleave")
        inputs = check_field(at, "inputs", list, "interleave")
        running = check_field(at, "running", list, "interleave")
        if len(inputs) != len(self.streams) or len(running) != len(self.streams):
            raise _bad_state("interleave", "inputs", f"has {len(inputs)} inputs, but this "
                             f"interleave has {len(self.streams)}")
        if not all(isinstance(flag, bool) for flag in running):
            raise _bad_state("interleave", "running", f"should be booleans, not {running!r}")
        for stream, start in zip(self.streams, inputs, strict=True):
            if start is not None:
                if not isinstance(start, dict):
                    raise _bad_state("interleave", "inputs", f"holds {start!r}, not a state")
                stream._check(start, slot)


# --------------------------------------------------------------------------- adapters


class _Iterated(Stream[Any]):
    """Any iterable or async iterable, as a stream (iterated anew at every epoch)."""

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        set_epoch = getattr(self.iterable, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    async def _blocks(self, ctx: _Context) -> AsyncGenerator[list[Any], None]:
        source = self.iterable
        aiter_ = getattr(type(source), "__aiter__", None)
        if aiter_ is not None:
            iterator = source.__aiter__()
            try:
                async for item in ataken(iterator):
                    yield [item]
            finally:
                await close_iterator(iterator)
            return
        sync_iterator = iter(source)
        items = taken(sync_iterator)  # a `for` per block: never the source's __iter__ again
        try:
            while True:
                block = []
                for item in items:
                    block.append(item)
                    if len(block) == _BLOCK:
                        break
                if not block:
                    return
                yield block
                await anyio.lowlevel.checkpoint()
        finally:
            await close_iterator(sync_iterator, blocking=False)


def as_stream(iterable: Any) -> Stream[Any]:
    """Wrap an iterable (a list, a generator function's iterable, an ``IterableDataset``) or
    an async iterable as a :class:`Stream`, to ``shuffle``, ``map`` or ``interleave`` it.

    Plain iterators are pulled on the event loop, so they should not block. The wrapped
    object is iterated anew at every epoch (a one-shot iterator yields its items once).

    Args:
        iterable: the object; a :class:`Stream` is returned unchanged.

    Raises:
        TypeError: ``iterable`` is neither iterable nor async iterable.
    """
    if isinstance(iterable, Stream):
        return iterable
    if not (hasattr(iterable, "__iter__") or hasattr(iterable, "__aiter__")):
        raise TypeError(f"as_stream needs an iterable or async iterable, but got {iterable!r}")
    return _Iterated(iterable)
