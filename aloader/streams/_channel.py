"""A bounded FIFO between two tasks of one event loop (:class:`_Channel`): what the epoch's
background task hands the consumer through, and what concurrent stages (shard read-ahead)
talk to it by.

Invariant: at most ``capacity`` items are queued, and a waiting end never misses a change
(see :class:`_Channel`).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from .._util import Signal

T = TypeVar("T")


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
