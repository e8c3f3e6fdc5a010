"""A plain ``for`` over one epoch of a stream (what ``Stream.__iter__`` returns): its blocks
come whole, from a private event loop in another thread (:class:`_Pairs`) or, for a loopless
stream, made on the consumer's own thread with no loop (:class:`_LocalPairs`), and each is
entered only when the consumer starts on it, so ``state_dict`` says what this thread received.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, TypeVar

from .._facade import SyncIterator, run_here
from ._positions import _START, _state_of
from ._runtime import _StreamIterator

T = TypeVar("T")


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
