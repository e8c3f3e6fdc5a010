"""A batcher's requests and the queue they wait in: priority levels, promotion, costs.

:class:`_Request` is one caller's item and answer; :class:`_RequestQueue` holds the requests
that wait for a batch and says in which order they are served. Batch formation (which of them
make the next batch) is the batcher's policy and lives with it; this module only keeps the
order and the running totals that formation and the dispatcher's wake-ups read.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Iterator
from operator import neg
from types import TracebackType
from typing import Any

from .._backend import Waiter

__all__ = (
    "_ABANDONED",
    "_DONE",
    "_DROPPED",
    "_QUEUED",
    "_RUNNING",
    "_TIMED_OUT",
    "_Request",
    "_RequestQueue",
    "_StreamBatch",
)

# Request states: a caller still waiting is _QUEUED or _RUNNING (below _DONE); the others
# say how it was answered (or that its caller left).
_QUEUED = 0
_RUNNING = 1
_DONE = 2
_ABANDONED = 3
_TIMED_OUT = 4
_DROPPED = 5  # its queue_timeout passed before its batch started


class _StreamBatch:
    """What the callers of one streaming batch share: how many of them still read it, and the
    cancel scope of the batch function's iteration, cancelled once none is left."""

    __slots__ = ("live", "scope")

    def __init__(self, live: int) -> None:
        self.live: int = live
        self.scope: Any = None  # the anyio.CancelScope of the batch's iteration


class _Request:
    """One caller's item and answer. The caller waits on ``waiter`` (one :class:`Waiter` of
    the bound loop, woken once; a stream re-arms it for each wait); whoever moves ``state``
    from ``_QUEUED``/``_RUNNING`` to another state answers it, and only then sets the waiter
    (unless the waiter is done: a cancelled caller's future on asyncio).

    ``priority`` and ``cost`` order and weigh it in the queue; ``drop_at`` is the loop time
    its batch must have started by (``inf``: none), ``drop_timer`` the asyncio timer that
    drops it then; ``timer`` is the asyncio timer of its caller's timeout, ``timeout`` that
    timeout (for the message). A streamed request collects its results in ``chunks`` and
    shares a :class:`_StreamBatch` with the other callers of its batch (``batch``).

    Cost: the fields every request sets are slots; the others are class-level defaults that
    a request overrides in its own ``__dict__`` only when it uses them (a lone request with
    no option stores seven fields, not fifteen).
    """

    __slots__ = ("__dict__", "enqueued", "error", "item", "result", "state", "tb", "waiter")

    # Defaults of the fields most requests never set (see Cost).
    priority: int = 0
    cost: float = 0
    drop_at: float = math.inf
    drop_timer: Any = None  # asyncio.TimerHandle
    timer: Any = None  # asyncio.TimerHandle
    timeout: float | None = None
    chunks: deque[Any] | None = None
    batch: _StreamBatch | None = None

    def __init__(self, item: Any, enqueued: float, waiter: Waiter) -> None:
        self.item: Any = item
        self.enqueued: float = enqueued
        self.state: int = _QUEUED
        self.result: Any = None
        self.error: BaseException | None = None
        self.tb: TracebackType | None = None
        self.waiter: Waiter = waiter

    def wake(self) -> None:
        waiter = self.waiter
        if not waiter.done():
            waiter.set_result(None)


class _RequestQueue:
    """The requests waiting for a batch, in the order they are served.

    Order of service: a request that has waited ``promote_after`` seconds or more is promoted
    and goes before every request that has not (promoted ones oldest first: a bounded wait, so
    no priority starves); the others go highest ``priority`` first, oldest first within a
    priority.

    Invariant: ``fifo`` holds every queued request (state ``_QUEUED``), oldest first (so the
    promoted ones are a prefix of it). While only priority 0 has been seen, ``levels`` is
    None and ``fifo`` is the order of service (the common case costs one dict). From the first
    other priority on, ``levels[p]`` holds the queued requests of priority ``p`` oldest first
    and ``order`` lists the priorities of the non-empty levels, highest first. ``cost`` is
    the sum of the queued requests' costs (exactly 0 when the queue is empty, so float
    rounding never accumulates), ``deadlines`` how many of them have a ``drop_at``.

    Cost: O(1) to add and to remove a request (O(log levels) compares when a level appears
    or empties, and a move of the list's pointers: priorities used as deadlines make every
    request a level); :meth:`ordered` yields each request once, O(1) each, plus O(promoted)
    for skipping the promoted ones in their levels.
    """

    __slots__ = ("cost", "deadlines", "fifo", "levels", "order")

    def __init__(self) -> None:
        self.fifo: OrderedDict[_Request, None] = OrderedDict()
        self.levels: dict[int, OrderedDict[_Request, None]] | None = None
        self.order: list[int] = []
        self.cost: float = 0
        self.deadlines = 0

    def __len__(self) -> int:
        return len(self.fifo)

    def __bool__(self) -> bool:
        return bool(self.fifo)

    def oldest(self) -> _Request:
        """The request that has waited longest (the queue is not empty)."""
        return next(iter(self.fifo))

    def push(self, request: _Request) -> None:
        self.fifo[request] = None
        if request.cost:
            self.cost += request.cost
        if request.drop_at != math.inf:
            self.deadlines += 1
        if self.levels is not None or request.priority:
            self._push_level(request)

    def _push_level(self, request: _Request) -> None:
        levels = self.levels
        if levels is None:
            # The first request of another priority: the ones queued so far are priority 0.
            others = OrderedDict((queued, None) for queued in self.fifo if queued is not request)
            levels = self.levels = {0: others} if others else {}
            self.order = [0] if others else []
        level = levels.get(request.priority)
        if level is None:
            level = levels[request.priority] = OrderedDict()
            insort(self.order, request.priority, key=neg)  # O(log levels) compares
        level[request] = None

    def _leave_level(self, request: _Request) -> None:
        """Take ``request`` out of its level (the levels exist), and the level once empty."""
        levels = self.levels
        assert levels is not None
        priority = request.priority
        level = levels[priority]
        del level[request]
        if not level:
            del levels[priority]
            order = self.order
            del order[bisect_left(order, -priority, key=neg)]

    def remove(self, request: _Request) -> None:
        """Take ``request`` (queued) out of the queue."""
        del self.fifo[request]
        if self.fifo:
            self.cost -= request.cost
        else:
            self.cost = 0
        if request.drop_at != math.inf:
            self.deadlines -= 1
        if self.levels is not None:
            self._leave_level(request)

    def pop_oldest(self) -> _Request:
        """Take the oldest request out (the order of service while there is one level)."""
        request = self.fifo.popitem(last=False)[0]
        if not self.fifo:
            self.cost = 0
        elif request.cost:
            self.cost -= request.cost
        if request.drop_at != math.inf:
            self.deadlines -= 1
        if self.levels is not None:
            self._leave_level(request)
        return request

    def single_level(self) -> bool:
        """Whether the order of service is the order of arrival (one priority queued)."""
        return self.levels is None or len(self.order) <= 1

    def ordered(self, promoted_before: float) -> Iterator[_Request]:
        """The queued requests in order of service; those enqueued at or before
        ``promoted_before`` (a loop time) are promoted. Do not change the queue meanwhile."""
        fifo = self.fifo
        if self.single_level():
            yield from fifo
            return
        for request in fifo:
            if request.enqueued > promoted_before:
                break
            yield request
        levels = self.levels
        assert levels is not None
        for priority in self.order:
            for request in levels[priority]:
                if request.enqueued > promoted_before:
                    yield request

    def clear(self) -> None:
        self.fifo.clear()
        self.levels = None
        self.order = []
        self.cost = 0
        self.deadlines = 0
