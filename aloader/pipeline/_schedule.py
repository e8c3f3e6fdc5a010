"""Scheduling a map epoch's jobs: the window that admits them, and the queue the fetch workers
take their work from.

A job (:class:`_Job`) is one batch (or one index without auto-batching) from admission to
publication. :class:`_Admission` admits jobs in sampler order; :class:`_WorkQueue` hands out
their pieces of work (a whole job, or one item) in queue order, waking one idle fetch worker
per piece, or starting one where none is idle.

Invariant: at most ``window`` jobs are admitted and not yet collated (a job holds its slot
from admission until its batch is collated); at most ``room`` jobs are started and not yet
taken by the consumer; workers never outnumber the work the window let in.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from .._backend import Waiter
from ._errors import _note

if TYPE_CHECKING:
    from ._epoch import MapEpoch
    from ._threads import _FetchThreads

__all__ = ()

# The kinds of a job's work (``_Job.kind``): items fetched one by one on the loop, a job
# fetched in one call, a job whose items fetch threads are filling, a job with no item to
# fetch (collated at once), and items of a job that failed. The first and the last are a
# piece per item; all but the first are negative.
_ITEMS = 0
_WHOLE_JOB = -1
_AWAIT_THREADS = -2
_NO_ITEMS = -3
_FAILED_ITEMS = -4  # items of a job whose error is known: passed over, not fetched


_now = time.perf_counter_ns

_ENDED: Any = object()  # a sampler with no more keys



class _WorkQueue:
    """Work for the fetch workers: a deque of jobs, and the idle workers parked in arrival
    order.

    A job is ``count`` pieces of work, handed out in order from the queue's head job: its
    cursor ``next`` is the position the next taker gets, and the job leaves the queue with its
    last piece. So an item costs no object of its own in the queue (a tuple per item, and the
    zip that made them, cost ~1% of an io epoch's instructions).

    Lighter than a memory object stream (the producer never waits on it: the window bounds
    what it holds), and it wakes one idle worker per piece of work that may start rather than
    all of them, which matters with hundreds of workers at tens of thousands of items per
    second. A worker takes work without awaiting anything while there is some (:meth:`take`),
    and parks on a :class:`~aloader._backend.Waiter` of the epoch's loop (``new_waiter``) when
    there is none. Pieces start in queue order (a woken worker takes the queue's head).

    ``room`` bounds the jobs started and not yet taken by the consumer (what holds fetched
    data): a job's first piece (position 0, or a whole-job piece) takes one, and :meth:`free`
    (the results' ``on_take``) gives it back. The window may admit jobs ahead of that (indices
    only), so that a worker finishing a fetch finds its next one waiting, even in a turn of
    the loop where hundreds finish at once.

    Workers start on demand: work that no idle worker is woken for starts a new one, up to
    ``limit``, so workers never outnumber the work the window let in.
    """

    __slots__ = ("_closed", "_idle", "_limit", "_new_waiter", "_spawned", "items", "room",
                 "spawn")

    def __init__(self, limit: int, new_waiter: Callable[[], Waiter], room: int,
                 spawn: Callable[[], None] = lambda: None) -> None:
        self.items: deque[_Job] = deque()  # jobs with pieces left, taken in order
        self.room = room
        self._idle: deque[Waiter] = deque()
        self._closed = False
        self._limit = limit
        self._spawned = 0
        self._new_waiter = new_waiter
        self.spawn = spawn  # starts one more worker

    def take(self) -> _Job | None:
        """The job of the next piece of work if it may start now, else None (never waits).

        The piece is the job's position ``next - 1``: read it before the next await.
        """
        items = self.items
        if items:
            job = items[0]
            position = job.next
            if position == 0:  # a job's first piece starts it
                if self.room <= 0:
                    return None
                self.room -= 1
            job.next = position = position + 1
            if position == job.count:
                items.popleft()
            return job
        return None

    def put(self, job: _Job) -> None:
        """Add a job's pieces, waking an idle worker (or starting one) for each."""
        self.items.append(job)
        new = job.count
        more = min(new - self._wake(new), self._limit - self._spawned)
        if more > 0:
            self._spawned += more
            for _ in range(more):
                self.spawn()

    def free(self) -> None:
        """A started job is taken by the consumer: the next job may start."""
        self.room += 1
        if not self._idle:
            return
        # Wake a worker for each piece at the head that may start now.
        startable, room, idle = 0, self.room, len(self._idle)
        for job in self.items:
            if job.next == 0:
                if room <= 0:
                    break
                room -= 1
            startable += job.count - job.next
            if startable >= idle:
                break
        self._wake(min(startable, idle))
        if self._closed and not self.items:
            self._wake(len(self._idle))  # nothing left: the idle workers leave

    def _wake(self, count: int) -> int:
        """Wake up to ``count`` idle workers; returns how many."""
        idle = self._idle
        woken = 0
        while woken < count and idle:
            waiter = idle.popleft()
            if not waiter.done():  # not a worker cancelled while it waited
                waiter.set_result(None)
                woken += 1
        return woken

    def close(self) -> None:
        """No more work will come: idle workers leave once the queue is empty (every piece
        taken leads to a :meth:`free`, which checks)."""
        self._closed = True
        if not self.items:
            self._wake(len(self._idle))

    async def get(self) -> _Job | None:
        """The job of the next piece of work (as :meth:`take`), or None once the queue is
        closed and drained."""
        while True:
            job = self.take()
            if job is not None:
                return job
            if self._closed and not self.items:
                return None
            wakeup = self._new_waiter()
            self._idle.append(wakeup)
            await wakeup


class _Job:
    """One batch (or one index without auto-batching) of a map epoch, from admission to its
    publication: its samples as they are fetched, and its pieces of work in the queue."""

    __slots__ = ("count", "epoch", "error", "fetched", "indices", "key", "kind", "next",
                 "remaining", "samples", "seq")

    def __init__(self, seq: int, key: Any, epoch: int = 0) -> None:
        self.seq = seq
        self.key = key
        self.epoch = epoch  # the plan's epoch at admission: sample_rng's, for its items
        self.samples: list[Any] = []
        self.remaining = 0  # samples not yet fetched
        self.error: BaseException | None = None
        self.fetched: anyio.Event | None = None  # set when fetch threads filled every sample
        self.kind = _ITEMS
        self.indices: list[Any] = []  # the items' indices (kind _ITEMS)
        self.count = 1  # pieces of work: an item each (kind _ITEMS), else one
        self.next = 0  # the position of the piece the queue hands out next



class _Admission:
    """The window of a :class:`MapEpoch`: jobs enter it here, at most ``window`` at once
    (``plan.window``, or more where items are fetched on the loop: see :meth:`MapEpoch._run`).

    A job holds a window slot from admission until its batch is collated (:meth:`release`).
    :meth:`produce`, the epoch's producer task, admits jobs in sampler order, numbered from 0,
    one per turn of the loop (as fetches start, the first may already stop the epoch before
    the rest begin; with a window ahead, after the first job it fills in one turn), and parks
    on a plain :class:`~aloader._backend.Waiter` while the window is full: lighter than a
    semaphore, whose every acquire looks up the running library.
    While it is parked on a full window, a slot freed by :meth:`release` is refilled there and
    then from a plain (sync) sampler: the next job's items are in the queue before the fetch
    workers finishing in the same turn of the loop look for work, and no task wakes per job.
    The sampler's end or error (``_end``) wakes the producer, which reports it.
    """

    __slots__ = ("_ahead", "_end", "_epoch", "_free", "_keys", "_new_waiter", "_queue",
                 "_sampling", "_threads", "_waiting", "seq")

    def __init__(self, epoch: MapEpoch, queue: _WorkQueue, threads: _FetchThreads | None,
                 new_waiter: Callable[[], Waiter], window: int) -> None:
        self._epoch = epoch
        self._queue = queue
        self._threads = threads
        self._new_waiter = new_waiter
        plan = epoch.plan
        # Jobs admitted ahead of those the queue's room lets start wait there as indices.
        self._ahead = window > plan.window
        self._free = window
        self._waiting: Waiter | None = None  # the producer, parked
        keys = epoch._keys
        self._keys: Iterator[Any] | None = None if isinstance(keys, AsyncIterator) else keys
        self._sampling = epoch.plan.stats.sampling
        self._end: object = None  # _ENDED, or the sampler's error, once it has no more keys
        self.seq = 0  # the next job's number

    def release(self) -> None:
        """A job left the window (its batch is collated, or its error published)."""
        self._free += 1
        waiting = self._waiting
        if waiting is None:
            return
        if self._keys is not None and self._end is None:
            self._admit_next()
            if self._end is None:
                return
        self._waiting = None
        if not waiting.done():
            waiting.set_result(None)

    def _ended(self) -> bool:
        return self._end is not None

    def _admit_next(self) -> None:
        """Admit the plain sampler's next key, or record its end (``_end``)."""
        started = _now()
        try:
            key = next(self._keys)  # type: ignore[arg-type]
        except Exception as exc:  # StopIteration included
            self._stop(exc)
        else:
            self._enter(key, started)

    def _stop(self, error: Exception) -> None:
        """The sampler raised ``error``: its end, or an error to report."""
        self._end = _ENDED if isinstance(error, (StopIteration, StopAsyncIteration)) else error

    def _enter(self, key: Any, started: int) -> None:
        """Admit ``key``, which the sampler took from ``started`` to now to give."""
        self._sampling.add(_now() - started)
        self._free -= 1
        plan = self._epoch.plan
        job = _Job(self.seq, key, plan.epoch)
        self.seq += 1
        if plan.granularity == "job":
            job.kind = _WHOLE_JOB
        else:
            items = plan.items_of(key)
            job.samples = [None] * len(items)
            job.remaining = len(items)
            if not items:
                job.kind = _NO_ITEMS
            elif self._threads is not None:
                self._threads.submit(job, items)
                job.kind = _AWAIT_THREADS
            else:
                job.indices = items
                job.count = len(items)
        self._queue.put(job)

    async def produce(self) -> None:
        """Admit jobs until the sampler ends or fails, then tell the results how many."""
        epoch = self._epoch
        keys = epoch._keys
        while self._end is None:
            if self._free > 0:
                await anyio.lowlevel.checkpoint()
            while self._free <= 0 and self._end is None:
                waiting = self._waiting = self._new_waiter()
                await waiting
            if self._ended():  # while it waited (mypy keeps `_end is None` across the awaits)
                break
            if self._keys is not None:
                self._admit_next()
                # Items on the loop, after the first job: fill the window in one turn (the
                # queue's room decides what starts), as one job per turn would let a loop busy
                # with hundreds of fetches admit far fewer jobs than it finishes.
                while self._ahead and self.seq > 1 and self._free > 0 and self._end is None:
                    self._admit_next()
                continue
            started = _now()
            try:
                key = await keys.__anext__()  # type: ignore[union-attr]
            except Exception as exc:  # StopAsyncIteration included
                self._stop(exc)
            else:
                self._enter(key, started)
        if isinstance(self._end, Exception):
            results = epoch.results
            await results.reserve(self.seq)
            results.publish(self.seq, None, _note(self._end, "raised by the sampler"))
            self.seq += 1
        epoch.results.finish(self.seq)
