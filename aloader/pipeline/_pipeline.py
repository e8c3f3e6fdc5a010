"""One epoch of a DataLoader: the place that schedules fetches, orders results and collates.

An epoch is a stream of *jobs*. A job is one batch (an index batch from the batch sampler, or
one index when auto-batching is off, or up to ``batch_size`` items of an iterable dataset). The
pipeline runs in a background task (see :mod:`aloader._backend`) and has three parts:

* a producer that walks the sampler and admits jobs, at most ``window`` at a time;
* fetch workers that pull work (whole jobs, or single items of jobs when item fetches
  overlap) and collate a job once its last item is in; a worker starts only when work arrives
  that no idle worker can take, so there are never more workers than the work in the window,
  whatever the concurrency allowed;
* :class:`Results`, which hands finished batches to the consumer in sampler order (or in
  completion order) and lets at most ``capacity`` collated batches wait for it.

Two kinds of epoch share it: :class:`MapEpoch` walks a sampler's keys (index batches or
indices), :class:`IterableEpoch` cuts an iterable dataset's samples into batches. How a job
turns into a batch is the epoch's :class:`FetchPlan`, decided in one place
(:meth:`FetchPlan.for_dataset`) for the loader and its worker processes alike; the fetch calls
themselves are :mod:`aloader.data._fetch`'s, shared with the wrapper datasets.

With worker processes (``mode="process"``) the same pipeline runs; a job's fetch sends its key
to a worker and awaits the batch the worker collated (see :mod:`aloader.workers._pool`), and the
plan's
``remote`` runs a service task beside the fetch workers for as long as the epoch lasts.

The hot path, hundreds of single-item fetches in flight, costs little beyond the fetches' own
awaits: a worker takes work without awaiting while there is some, parks on a waiter of the
running loop (:func:`aloader._backend.waiters`: a plain future on asyncio, looked up once per
epoch) only when there is none, awaits the dataset's own awaitable with no coroutine of ours
around it, and a plain ``collate_fn`` runs without an await.

Memory is bounded whatever the consumer does: a job holds a window slot from admission until its
batch is collated, and a batch is collated only once it has an output slot.

With a failure budget (the plan's ``failures``, see :mod:`aloader.pipeline._failures`), a sample
whose
fetch raises is left out of its batch instead (marked ``_FAILED`` until the job collates; a
job left with no sample publishes :data:`SKIP`), until the budget is exceeded. A resumed
epoch's job whose samples all failed before the checkpoint has the key ``KNOWN_FAILED`` and
publishes :data:`SKIP` unfetched. Every epoch
records its statistics into the plan's ``stats`` (see :mod:`aloader._stats`): a timestamp
pair per job, or per item where items are fetched one by one.

An ``Exception`` from the dataset, the sampler or ``collate_fn`` is that batch's error; any
other ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``...) ends the epoch and reaches
the consumer as itself (see :meth:`Epoch._guard`), never the event loop. Stopping an epoch
waits for the fetches in threads to return, unless the epoch has abandoned its threads (after a
``timeout`` fired): a thread stuck in the dataset is then left running, its result discarded.
"""

from __future__ import annotations

import functools
import inspect
import math
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from types import SimpleNamespace
from typing import Any, Literal, Protocol

import anyio
import anyio.lowlevel
import numpy as np

from .._backend import Detached, Waiter, current_backend, task_group, threadsafe_caller, waiters
from .._exceptions import FailureBudgetExceeded, LoaderClosedError
from .._stats import Collector
from .._util import Signal, close_iterator, is_async_callable, is_awaitable, resolve
from ..data._collate import ColumnBatch, default_collate
from ..data._dataset import aiter_of, fetch_mode
from ._failures import KNOWN_FAILED, Failures, resumable
from ._sample_rng import BATCH, IDLE, FrameScope, Scope, fetch_var, scope_var

__all__ = (
    "DEFAULT_MAX_CONCURRENCY",
    "SKIP",
    "Epoch",
    "FetchPlan",
    "IterableEpoch",
    "MapEpoch",
    "PacedKeys",
    "Remote",
    "Results",
)

# The kinds of a job's work (``_Job.kind``): items fetched one by one on the loop, a job
# fetched in one call, a job whose items fetch threads are filling, a job with no item to
# fetch (collated at once), and items of a job that failed. The first and the last are a
# piece per item; all but the first are negative.
_ITEMS = 0
_WHOLE_JOB = -1
_AWAIT_THREADS = -2
_NO_ITEMS = -3
_FAILED_ITEMS = -4  # items of a job whose error is known: passed over, not fetched

# A fetch worker's stand-in for a FrameScope where sample_rng has none (fetches in threads):
# never asked, so its fetches are never numbered.
_NO_SCOPE = SimpleNamespace(asked=False)

# Inline epochs give other tasks a turn at least this often (ns).
_YIELD_EVERY_NS = 1_000_000

# Fetches in flight for async datasets when max_concurrency is not given.
DEFAULT_MAX_CONCURRENCY = 64

FetchMode = Literal["async", "inline", "thread", "process"]
# How a job's data is fetched: one call per job, or one call per item with items overlapping.
Granularity = Literal["job", "item"]

# Published by a job that turned out to have no batch (a worker's exhausted iterable replica):
# it keeps its place in the order and is passed over by the consumer.
SKIP: Any = object()

# A sample whose fetch failed within the failure budget (see aloader.pipeline._failures): left out.
_FAILED: Any = object()


_now = time.perf_counter_ns
_cpu = time.thread_time_ns

_CLOSED = LoaderClosedError()  # never raised itself: a fresh one is, without a traceback
_ENDED: Any = object()  # a sampler with no more keys


class Results:
    """Finished batches waiting for the consumer, in sampler order or in completion order.

    A job must :meth:`reserve` an output slot before it collates and :meth:`publish` es. In
    order, job ``k`` may publish only while ``k < taken + capacity``, so the head of the line
    can always publish and no slot is ever held by a batch the consumer cannot take yet.

    The same buffer orders the results of ``Stream.map`` with concurrency (see
    :mod:`aloader.streams._streams`), where a job is one item and a batch is its mapped value.

    Batches of an iterable dataset come with metadata (where the dataset was once the batch's
    samples were drawn, for a resume): when ``metas`` is set (a mapping from job number to
    metadata, with ``pop``), taking job ``k`` pops its entry into :attr:`meta`. Without it
    (map-style epochs) nothing of this runs.

    A job that may not publish yet and can finish without an await (a plain collate on the
    loop) need not wait for its slot either: :meth:`defer` keeps the job's ``finish`` and runs
    it when the slot frees, from the :meth:`poll` that freed it (the consumer's), so no task
    waits, and no task wakes, per batch. In order, the slot freed by taking job ``t`` belongs
    to exactly one job, ``t + capacity``; out of order to the job deferred first.
    """

    #: The metadata of the batch taken last (None without ``metas``).
    meta: Any = None
    #: Job number -> metadata of the jobs published, popped as they are taken (or None).
    metas: Any = None
    #: Called as each job publishes (or None): its result is the job's metadata (a map-style
    #: dataset's own state once the batch is loaded, see aloader.loader._datasetstate).
    snapshot: Callable[[], Any] | None = None
    #: Called each time a job is taken (or None): a map epoch's work queue frees room.
    on_take: Callable[[], None] | None = None
    #: The batches left ready when the last one was taken, before a deferred job took the
    #: slot it freed (the statistics' occupancy of the buffer).
    left = 0

    def __init__(self, capacity: int, in_order: bool, skips: bool = False) -> None:
        self._capacity = max(1, capacity)
        self._in_order = in_order
        self._skips = skips  # hand over SKIP too (a worker answers every job)
        self._ready: dict[int, tuple[Any, BaseException | None]] = {}
        self._fifo: deque[tuple[Any, BaseException | None]] = deque()
        self._fifo_seqs: deque[int] = deque()  # the jobs of _fifo's batches, in _fifo's order
        self.taken = 0
        self.last = -1  # the job whose batch (or error) was handed out last
        self._reserved = 0
        self._total: int | None = None
        self._closed: BaseException | None = None
        self._changed = Signal()
        # Deferred finishes: job -> finish in order, (job, finish) in deferral order otherwise.
        self._deferred: dict[int, Callable[[], None]] = {}
        self._deferred_fifo: deque[Callable[[], None]] = deque()

    def defer(self, seq: int, finish: Callable[[], None]) -> None:
        """Run ``finish`` (which publishes job ``seq``) once the job has its output slot: now
        if it has one, else from the :meth:`poll` that frees it. ``finish`` must not raise."""
        if self._in_order:
            if seq < self.taken + self._capacity:
                finish()
            else:
                self._deferred[seq] = finish
        elif self._reserved < self._capacity:
            self._reserved += 1
            finish()
        else:
            self._deferred_fifo.append(finish)

    async def reserve(self, seq: int) -> None:
        """Wait until job ``seq`` may collate and publish without exceeding the capacity."""
        if self._in_order:
            while seq >= self.taken + self._capacity:
                await self._changed.wait()
        else:
            while self._reserved >= self._capacity:
                await self._changed.wait()
            self._reserved += 1

    def publish(self, seq: int, value: Any, error: BaseException | None = None) -> None:
        if self.snapshot is not None:
            self.metas[seq] = self.snapshot()
        if self._in_order:
            self._ready[seq] = (value, error)
        else:
            self._fifo.append((value, error))
            self._fifo_seqs.append(seq)
        self._changed.notify()

    @property
    def capacity(self) -> int:
        """The batches that may wait for the consumer."""
        return self._capacity

    def ready(self) -> int:
        """Batches published and not yet taken."""
        return len(self._ready) if self._in_order else len(self._fifo)

    def finish(self, total: int) -> None:
        """No job numbered ``total`` or above will be published."""
        self._total = total
        self._changed.notify()

    def close(self, error: BaseException) -> None:
        """The pipeline stopped: the consumer gets ``error`` once the ready batches are taken."""
        if self._closed is None:
            self._closed = error
        self._changed.notify()

    def poll(self) -> tuple[Any, BaseException | None] | None:
        """The next batch (value, error) if it is ready now, else None (never waits).

        The end of the epoch and a closed pipeline are reported by :meth:`take`.
        """
        while True:
            if self._in_order:
                item = self._ready.pop(self.taken, None)
                seq = self.taken
            else:
                item = self._fifo.popleft() if self._fifo else None
                if item is not None:
                    self._reserved -= 1
                    seq = self._fifo_seqs.popleft()
            if item is None:
                return None
            self.last = seq
            if self.metas is not None:
                self.meta = self.metas.pop(seq, None)
            self.taken += 1
            self.left = self.ready()
            self._changed.notify()
            if self.on_take is not None:
                self.on_take()
            if self._in_order:
                if self._deferred:
                    finish = self._deferred.pop(self.taken + self._capacity - 1, None)
                    if finish is not None:
                        finish()
            elif self._deferred_fifo:
                self._reserved += 1
                self._deferred_fifo.popleft()()
            if item[0] is not SKIP or self._skips:
                return item

    async def take(self) -> tuple[Any, BaseException | None]:
        """The next batch (value, error); StopAsyncIteration at the end of the epoch."""
        while True:
            item = self.poll()
            if item is not None:
                return item
            if self._total is not None and self.taken >= self._total:
                raise StopAsyncIteration
            if self._closed is not None:
                # Reported once, then dropped: kept, its traceback (the consumer's frames)
                # would keep the consumer's objects alive as long as the epoch.
                error, self._closed = self._closed, _CLOSED
                raise error if error is not _CLOSED else LoaderClosedError()
            await self._changed.wait()


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


def _note(error: BaseException, text: str) -> BaseException:
    if not isinstance(error, FailureBudgetExceeded):  # one object for every job after it
        error.add_note(text)
    return error


def _describe(key: Any) -> str:
    if isinstance(key, np.ndarray):
        key = key.tolist()
    text = repr(key)
    return text if len(text) <= 200 else text[:197] + "..."


class _Abandon:
    """Waits for threads, until the epoch gives up on them (after a ``timeout`` fired).

    A wait is shielded from cancellation, so that a stopping epoch still waits for the fetches
    in its threads (the next fetch must not overlap one that holds the dataset), yet
    :meth:`give_up` ends every wait at once, now and later.
    """

    def __init__(self) -> None:
        self.given_up = False
        self._waits: set[anyio.CancelScope] = set()

    async def wait(self, blocking: Callable[[], object]) -> None:
        """Return once ``blocking()`` returns in a thread, or once the epoch gives up."""
        if self.given_up:
            return
        with anyio.CancelScope(shield=True) as scope:
            self._waits.add(scope)
            try:
                await anyio.to_thread.run_sync(blocking, abandon_on_cancel=True)
            finally:
                self._waits.discard(scope)

    def give_up(self) -> None:
        self.given_up = True
        for scope in self._waits:
            scope.cancel()

    def __getstate__(self) -> dict[str, Any]:  # travels with a plan to worker processes
        return {"given_up": False, "_waits": set()}


class _FetchThreads:
    """OS threads fetching single items of jobs, for blocking synchronous datasets.

    Per item they cost a queue read and no event-loop round trip: the loop hears only of
    finished jobs, which keeps it (and the GIL) free at thousands of blocking fetches a second.
    A thread starts only when there are more unfinished items than threads, up to ``count``.
    """

    def __init__(self, get_item: Callable[[Any], Any], count: int, abandon: _Abandon,
                 absorb: Callable[[Any, BaseException], BaseException | None],
                 stats: Collector) -> None:
        self._get_item = get_item
        self._absorb = absorb
        self._stats = stats
        self._count = count
        self._abandon = abandon
        self._work: queue.SimpleQueue[tuple[_Job, int, Any] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._call_soon = threadsafe_caller()
        self._stopping = False
        self._unfinished = 0  # items submitted and not yet done (under the lock)
        self._threads: list[threading.Thread] = []

    def submit(self, job: _Job, items: list[Any]) -> None:
        job.fetched = anyio.Event()
        with self._lock:
            self._unfinished += len(items)
            wanted = min(self._count, self._unfinished)
        for position, index in enumerate(items):
            self._work.put((job, position, index))
        while len(self._threads) < wanted:
            thread = threading.Thread(target=self._run, name="aloader-fetch", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            job, position, index = work
            error: BaseException | None = None
            if job.error is None and not self._stopping:
                stats = self._stats
                started, cpu = _now(), _cpu()
                try:
                    job.samples[position] = self._get_item(index)
                except Exception as exc:
                    error = self._absorb(index, _note(exc, f"raised while fetching index "
                                                           f"{index!r} of batch {job.seq}"))
                    if error is None:
                        job.samples[position] = _FAILED
                except BaseException as exc:  # ends the epoch: see Epoch._worker
                    error = exc
                finally:
                    stats.fetched_in_thread(_now() - started, _cpu() - cpu)
            with self._lock:
                if error is not None and job.error is None:
                    job.error = error
                job.remaining -= 1
                self._unfinished -= 1
                done = job.remaining == 0
            if done:
                assert job.fetched is not None
                self._call_soon(job.fetched.set)

    async def close(self) -> None:
        """Let the threads finish the fetch in hand, skip the rest, and wait until they exit.

        Once the epoch has given up on its threads, a thread stuck in the dataset is left
        running (a daemon thread that exits when its fetch returns) and not waited for.
        """
        self._stopping = True
        threads = self._threads
        if not threads:
            return
        for _ in threads:
            self._work.put(None)

        def join() -> None:
            for thread in threads:
                thread.join()

        await self._abandon.wait(join)


class Remote(Protocol):
    """Where a ``"process"`` plan's jobs are fetched and collated (a pool of worker processes).

    ``serve`` runs beside the epoch's fetch workers until the epoch cancels it; an exception
    from it ends the epoch with that error. ``stop`` is called (from any thread) when the epoch
    is asked to stop, and ``close`` once the epoch has ended. ``fetch`` gets the job's
    sequence number in the epoch with its key, so that where and when the job runs may depend
    on its place in the epoch rather than on the order its task wakes up in.
    """

    async def fetch(self, key: Any, seq: int) -> Any: ...

    async def serve(self) -> None: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class FetchPlan:
    """How one epoch turns a key into a batch: the fetch and collate half of the pipeline.

    Attributes:
        dataset: the dataset.
        mode: "async" (awaitable fetches on the loop), "inline" (fast synchronous fetches on the
            loop), "thread" (blocking fetches in worker threads) or "process" (the remote
            fetches and collates whole jobs).
        auto_batch: whether keys are index batches (``__getitems__`` / per-item fetch then
            ``collate_fn``) or single indices (``collate_fn(dataset[index])``).
        collate_fn: turns fetched samples into a batch; plain or async.
        granularity: "job" fetches a batch in one call; "item" overlaps single-item fetches.
        concurrency: fetch calls in flight (items or jobs, by granularity).
        window: jobs admitted and not yet collated.
        array_indices: the dataset takes numpy index arrays as well as lists.
        transform: applied to every finished batch (pin_memory), or None.
        remote: the worker processes of a "process" plan.
        seed: the loader's sample seed, for :func:`aloader.sample_rng` (None: no scope).
        epoch: the loader's epoch (set per request in a worker process).
        failures: the epoch's failure budget (see :mod:`aloader.pipeline._failures`), or None (the
            first error is the batch's error).
        stats: the epoch's statistics (see :mod:`aloader._stats`).
        on_consumer: an "inline" plan of a dataset that would fetch in a thread under
            ``async for`` (a sync ``for``'s): its fetches' CPU time is measured, as in a
            thread, so that the statistics tell a blocking dataset from a computing one.
    """

    dataset: Any
    mode: FetchMode
    auto_batch: bool
    collate_fn: Callable[[Any], Any]
    granularity: Granularity
    concurrency: int
    window: int
    array_indices: bool = False
    transform: Callable[[Any], Any] | None = None
    remote: Remote | None = None
    seed: int | None = None
    epoch: int = 0
    failures: Failures | None = None
    stats: Collector = field(default_factory=Collector)
    on_consumer: bool = False

    @classmethod
    def for_dataset(
        cls,
        dataset: Any,
        *,
        iterable: bool,
        auto_batch: bool,
        collate_fn: Callable[[Any], Any],
        batch_size: int | None,
        max_concurrency: int | None,
        transform: Callable[[Any], Any] | None = None,
        remote: Remote | None = None,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        seed: int | None = None,
        epoch: int = 0,
        here: bool = False,
    ) -> FetchPlan:
        """The one place that decides how an epoch fetches: mode, granularity, concurrency, window.

        Without ``remote``: async datasets run ``max_concurrency`` (default
        :data:`DEFAULT_MAX_CONCURRENCY`) fetches on the loop, item by item unless a batch
        comes from ``__getitems__``; in-memory datasets fetch inline; other synchronous
        datasets fetch a batch per thread call, or, given ``max_concurrency``, that many
        items at once in threads. With ``here`` (a sync ``for``, which has no event loop to
        keep free) and no ``max_concurrency``, a synchronous map-style dataset fetches
        inline too, on the consumer's call, as torch's loader without workers does: its
        ``__getitem__`` then draws from the global ``random``, numpy and torch generators in
        the same order as the consumer's own code, run after run (fetched in a thread ahead of
        the consumer, the draws of both threads interleave as they happen to run). Iterable
        datasets pull one batch at a time (``"async"`` for ``__aiter__``, else in a thread,
        or with ``here`` inline).
        A worker process fetches with this same plan.

        With ``remote`` (``num_workers`` worker processes): ``"process"``, whole jobs, at
        most ``prefetch_factor`` per worker in flight.

        Args:
            dataset: the dataset.
            iterable: whether it is an iterable dataset (see
                :func:`aloader.data._dataset.is_iterable_dataset`).
            auto_batch: whether jobs are batches (the loader's ``_auto_collation``).
            collate_fn: the loader's ``collate_fn``.
            batch_size: the loader's ``batch_size``.
            max_concurrency: the loader's ``max_concurrency``.
            transform: applied to every finished batch (pin_memory), or None.
            remote: the worker processes that fetch, or None to fetch here.
            num_workers: how many worker processes ``remote`` has.
            prefetch_factor: the loader's ``prefetch_factor``.
            seed: the loader's sample seed (see :mod:`aloader.pipeline._sample_rng`), or None.
            epoch: the loader's epoch number.
            here: the plan of a sync ``for`` on its consumer's thread.
        """
        if remote is not None:
            window = max(1, prefetch_factor) * num_workers
            return cls(
                dataset=dataset,
                mode="process",
                auto_batch=auto_batch,
                collate_fn=collate_fn,
                granularity="job",
                concurrency=window,
                window=window,
                transform=transform,
                remote=remote,
                seed=seed,
                epoch=epoch,
            )
        on_consumer = False
        if iterable:
            mode: FetchMode = ("async" if aiter_of(dataset) is not None
                               else "inline" if here else "thread")
        else:
            mode = fetch_mode(dataset)
            on_consumer = mode == "thread" and here and max_concurrency is None
            if on_consumer:
                mode = "inline"
        if mode == "async":
            concurrency = max_concurrency or DEFAULT_MAX_CONCURRENCY
        else:
            concurrency = max_concurrency or 1
        getitems = getattr(dataset, "__getitems__", None)
        item_level = (
            not iterable
            and mode != "inline"
            and (not auto_batch or not getitems)
            and (mode == "async" or max_concurrency is not None)
        )
        per_job = batch_size if auto_batch else 1
        if iterable:
            window = 1
        elif item_level:
            window = window_for(concurrency, per_job)
        elif mode == "async":
            window = window_for(concurrency, per_job)
            concurrency = window
        else:
            window = concurrency = 1 if max_concurrency is None else window_for(
                max_concurrency, per_job
            )
        return cls(
            dataset=dataset,
            mode=mode,
            auto_batch=auto_batch,
            collate_fn=collate_fn,
            granularity="item" if item_level else "job",
            concurrency=concurrency,
            window=window,
            array_indices=bool(getattr(dataset, "_array_indices", False)),
            transform=transform,
            seed=seed,
            epoch=epoch,
            on_consumer=on_consumer,
        )

    def __post_init__(self) -> None:
        getitems = getattr(self.dataset, "__getitems__", None)
        self._getitems: Callable[[Any], Any] | None = getitems if getitems else None
        self._async_collate = is_async_callable(self.collate_fn)
        # Whether collate_fn returns plain values (None: not called on the loop yet).
        self._collate_plain: bool | None = False if self._async_collate else None
        # A user's collate_fn gets the list torch's loader gives it: a column-wise batch (a
        # vectorised __getitems__'s) is no list (no sort, no append), only default_collate
        # reads it whole.
        self._listed = self.collate_fn is not default_collate
        self.abandon = _Abandon()

    def _call_collate(self, samples: Any) -> Any:
        """``collate_fn(samples)``, a :class:`ColumnBatch` given to a user's as its list."""
        if self._listed and type(samples) is ColumnBatch:
            samples = list(samples)
        return self.collate_fn(samples)

    async def in_thread(
        self, fn: Callable[..., Any], *args: Any, limiter: anyio.CapacityLimiter
    ) -> Any:
        """``fn(*args)`` in a worker thread; cancelled, it waits for the call to return.

        Unless the epoch gives up on its threads (:class:`_Abandon`): then a call still running
        is left to finish on its own and its result is discarded.
        """
        claim = threading.Lock()  # held while the call runs; taken first, the call is skipped

        def call() -> Any:
            if not claim.acquire(blocking=False):
                return None  # cancelled before it started
            try:
                return fn(*args)
            finally:
                claim.release()

        try:
            return await anyio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=limiter)
        except anyio.get_cancelled_exc_class():
            if not claim.acquire(blocking=False):
                await self.abandon.wait(claim.acquire)
            raise

    def indices(self, key: Any) -> Any:
        """The index batch as the dataset receives it."""
        if isinstance(key, np.ndarray) and not self.array_indices:
            return key.tolist()
        return key

    def items_of(self, key: Any) -> list[Any]:
        """The single indices of a job fetched item by item."""
        if key is KNOWN_FAILED:
            return []
        if not self.auto_batch:
            return [key]
        return key.tolist() if isinstance(key, np.ndarray) else list(key)

    # sample_rng: every fetch of the dataset runs in a Scope naming the sample.
    def _scope(self, index: Any = BATCH) -> Scope | None:
        return None if self.seed is None else Scope(self.seed, self.epoch, index)

    def get_item(self, index: Any) -> Any:
        """``dataset[index]`` in the sample's scope (synchronous datasets)."""
        scope = self._scope(index)
        if scope is None:
            return self.dataset[index]
        token = scope_var.set(scope)
        try:
            return self.dataset[index]
        finally:
            scope_var.reset(token)

    def absorb(self, index: Any, error: BaseException) -> BaseException | None:
        """None when the failure budget absorbs the failure of sample ``index`` (the sample
        is left out), else the error the job fails with (``error``, or the budget's)."""
        failures = self.failures
        if failures is None or not isinstance(error, Exception) or isinstance(
            error, FailureBudgetExceeded
        ):
            return error
        try:
            failures.record(index, error)
        except FailureBudgetExceeded as exc:
            return exc
        return None

    # Synchronous halves, run inline on the loop or in a worker thread.
    def fetch_sync(self, key: Any) -> Any:
        """The samples of ``key``; with a failure budget, those that did not fail (a failing
        batch call retried item by item), or :data:`SKIP` when none is left."""
        if key is KNOWN_FAILED:
            return SKIP
        if self.failures is None:
            return self._fetch_sync(key)
        try:
            return self._fetch_sync(key)
        except Exception as exc:
            if not self.auto_batch:
                return self._absorbed(key, exc)
        samples = []
        for index in self.items_of(key):
            try:
                samples.append(self._fetch_sync([index])[0])
            except Exception as exc:
                self._absorbed(index, exc)
        return samples if samples else SKIP

    def _absorbed(self, index: Any, error: Exception) -> Any:
        """:data:`SKIP` when the budget absorbs ``error``; else raise the job's error."""
        final = self.absorb(index, _note(error, f"raised while fetching index {index!r}"))
        if final is not None:
            raise final
        return SKIP

    def _fetch_sync(self, key: Any) -> Any:
        scope = self._scope()
        if scope is None:
            if not self.auto_batch:
                return self.dataset[key]
            if self._getitems is not None:
                return self._getitems(self.indices(key))
            return [self.dataset[i] for i in self.indices(key)]
        token = scope_var.set(scope)
        try:
            if not self.auto_batch:
                return self.dataset[scope.at(key).index]
            if self._getitems is not None:
                return self._getitems(self.indices(key))
            dataset = self.dataset
            return [dataset[scope.at(i).index] for i in self.indices(key)]
        finally:
            scope_var.reset(token)

    def collate_sync(self, samples: Any) -> Any:
        if samples is SKIP:  # every sample failed within the budget
            return SKIP
        started = _now()
        batch = self._call_collate(samples)
        batch = batch if self.transform is None else self.transform(batch)
        self.stats.collated_in_thread(samples, _now() - started)
        return batch

    def load_sync(self, key: Any) -> Any:
        started, cpu = _now(), _cpu()
        samples = self.fetch_sync(key)
        self.stats.fetched_in_thread(_now() - started, _cpu() - cpu)
        return self.collate_sync(samples)

    def pull_sync(self, source: Iterator[Any], size: int | None, drop_last: bool) -> Any:
        started, cpu = _now(), _cpu()
        try:
            if self.failures is None:
                samples, ended = _pull_sync(source, size)
            else:
                samples, ended = _pull_sync_tolerant(source, size, self)
        finally:
            self.stats.fetched_in_thread(_now() - started, _cpu() - cpu)
        if samples is _NOTHING or (size is not None and drop_last and len(samples) < size):
            return _NOTHING, True
        return self.collate_sync(samples), ended

    @property
    def needs_event_loop(self) -> bool:
        """Whether a map-style job needs an event loop, or :meth:`load_sync` can load it."""
        return self.mode == "async" or self.granularity == "item" or self._async_collate

    @property
    def collate_in_thread(self) -> bool:
        """Whether jobs load in one thread call: fetch and a plain collate together."""
        return self.mode == "thread" and not self._async_collate

    # The loop side.
    async def fetch(self, key: Any, limiter: anyio.CapacityLimiter, seq: int = 0) -> Any:
        """The samples of job ``seq``, fetched in one call (a collated batch from a remote)."""
        if self.remote is not None:
            in_flight = self.stats.in_flight
            in_flight.change(1, _now())
            try:
                return await self.remote.fetch(key, seq)
            finally:
                in_flight.change(-1, _now())
        if key is KNOWN_FAILED:
            return SKIP
        if self.failures is None:
            return await self._fetch(key, limiter)
        try:
            return await self._fetch(key, limiter)
        except Exception as exc:
            if not self.auto_batch:
                return self._absorbed(key, exc)
        samples = []
        for index in self.items_of(key):
            try:
                samples.append((await self._fetch([index], limiter))[0])
            except Exception as exc:
                self._absorbed(index, exc)
        return samples if samples else SKIP

    async def _fetch(self, key: Any, limiter: anyio.CapacityLimiter) -> Any:
        started = _now()
        try:
            if self.mode == "thread":
                return await self.in_thread(self._fetch_sync, key, limiter=limiter)
            # An async fetch runs when awaited: the scope must span the awaits too.
            scope = self._scope(BATCH if self.auto_batch else key)
            token = None if scope is None else scope_var.set(scope)
            try:
                samples = await resolve(self._fetch_sync(key))
                if self.auto_batch and isinstance(samples, list):
                    items = self.items_of(key) if self._getitems is None else None
                    for position, sample in enumerate(samples):
                        if is_awaitable(sample):
                            if items is not None and scope is not None:
                                scope.at(items[position])
                            samples[position] = await sample
                return samples
            finally:
                if token is not None:
                    scope_var.reset(token)
        finally:
            self.stats.fetch.add(_now() - started)

    def async_getitem(self) -> Callable[[Any], Awaitable[Any]] | None:
        """The dataset's own ``async def __getitem__`` (bound), for fetches on the loop: what
        :meth:`fetch_item` returns without checking (None for any other dataset or mode)."""
        getitem = getattr(type(self.dataset), "__getitem__", None)
        if self.mode != "async" or not inspect.iscoroutinefunction(getitem):
            return None
        bound: Callable[[Any], Awaitable[Any]] = getitem.__get__(self.dataset)
        return bound

    def fetch_item(self, index: Any, limiter: anyio.CapacityLimiter) -> Awaitable[Any]:
        """What to await for sample ``index`` alone: an async dataset's own awaitable,
        without a coroutine of ours around it (with hundreds of fetches in flight, every frame
        costs on every resume). The caller times the await (the ``fetch`` stage) and, for a
        fetch on the loop (not ``"thread"``), awaits it in the sample's scope (its worker's
        :class:`~aloader.pipeline._sample_rng.FrameScope`), since an async fetch runs when
        awaited."""
        if self.mode == "thread":
            return self.in_thread(self.get_item, index, limiter=limiter)
        value = self.dataset[index]
        return value if is_awaitable(value) else resolve(value)

    async def load(self, key: Any, limiter: anyio.CapacityLimiter) -> Any:
        """Fetch and collate one job in a single thread call (``collate_in_thread`` plans)."""
        batch = await self.in_thread(self.load_sync, key, limiter=limiter)
        return await resolve(batch)

    @property
    def collates_on_loop(self) -> bool:
        """Whether :meth:`collate_now` may collate: a plain ``collate_fn``, not in a thread,
        seen by :meth:`collate` to return plain values (not awaitables)."""
        return self._collate_plain is True

    def collate_now(self, samples: Any) -> Any:
        """:meth:`collate` without an await: for SKIP, a remote's batch, or where the plan
        :attr:`collates_on_loop`."""
        if samples is SKIP:  # every sample failed within the budget, or none came
            return SKIP
        if self.remote is not None:  # collated by the worker
            batch = samples
        else:
            started = _now()
            batch = self._call_collate(samples)
            if is_awaitable(batch):
                if inspect.iscoroutine(batch):
                    batch.close()
                raise TypeError(f"collate_fn {self.collate_fn!r} returned an awaitable after "
                                "returning plain batches; make it `async def`")
            self.stats.collated(samples, _now() - started)
        return batch if self.transform is None else self.transform(batch)

    async def collate(self, samples: Any, limiter: anyio.CapacityLimiter,
                      started: int | None = None) -> Any:
        """The batch of ``samples`` (timed from ``started``, the clock read that ended the
        stage before, when the caller has one)."""
        if self.collate_in_thread:
            return await self.in_thread(self.collate_sync, samples, limiter=limiter)
        if samples is SKIP or self.remote is not None:
            return self.collate_now(samples)
        if started is None:
            started = _now()
        batch = self._call_collate(samples)
        if is_awaitable(batch):  # async def, or a plain function returning one
            self._collate_plain = False
            batch = await batch
        elif self._collate_plain is None:
            self._collate_plain = True
        self.stats.collated(samples, _now() - started)
        return batch if self.transform is None else self.transform(batch)


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


class _Guarded:
    """``with epoch._guarded:`` is :meth:`Epoch._guard` around a block, for the fetch
    workers, where a coroutine frame more would cost on every resume of every fetch."""

    __slots__ = ("_epoch",)

    def __init__(self, epoch: Epoch) -> None:
        self._epoch = epoch

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> bool:
        if error is None or isinstance(error, (Exception, anyio.get_cancelled_exc_class())):
            return False
        self._epoch._abort(error)
        return True


class Epoch:
    """The background half of one epoch: its lifecycle, shared by the two kinds of epoch.

    :class:`MapEpoch` (keys from a sampler) and :class:`IterableEpoch` (samples from an
    iterable dataset) each define ``_run``, the work of the background task.
    """

    def __init__(self, plan: FetchPlan, results: Results) -> None:
        self.plan = plan
        self.results = results
        self._task = Detached()
        self._fatal: BaseException | None = None  # a BaseException that ended the epoch
        self.done = anyio.Event()
        # The thread whose event loop runs the epoch: only that loop can wait for ``done``.
        self.loop_thread = threading.get_ident()
        self._guarded = _Guarded(self)

    # Lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._task.spawn(self._main)

    async def next(self) -> tuple[Any, BaseException | None]:
        """The next batch (value, error); StopAsyncIteration at the end of the epoch."""
        return await self.results.take()

    def stop(self) -> None:
        """Cancel every fetch; safe from any thread and from ``__del__``."""
        if self.plan.remote is not None:
            self.plan.remote.stop()
        self._task.cancel()

    def abandon_threads(self) -> None:
        """From now on, stopping does not wait for fetches in threads (a ``timeout`` fired)."""
        self.plan.abandon.give_up()

    async def _guard(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run one part of the epoch, turning a BaseException into the end of the epoch.

        ``KeyboardInterrupt``, ``SystemExit`` or any other ``BaseException`` that is not a
        cancellation must not escape a background task (asyncio re-raises the first two out
        of the event loop, trio calls any a crash): it stops the epoch and the consumer gets
        it, the same object, once the batches before it are taken.
        """
        with self._guarded:
            await fn(*args)

    def _abort(self, error: BaseException) -> None:
        if self._fatal is None:
            self._fatal = error
        self.stop()

    async def _main(self) -> None:
        error: BaseException = LoaderClosedError()
        remote = self.plan.remote
        failure: list[BaseException] = []
        try:
            with self._task.scope():
                if remote is None:
                    await self._run()
                else:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._guard, _serve, remote, tg.cancel_scope, failure)
                        await self._run()
                        tg.cancel_scope.cancel()
        except Exception as exc:  # reported to the consumer, never lost in the background
            error = exc
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:  # as in _guard, for what runs outside its parts
            self._abort(exc)
        finally:
            # Handed to the results, which drop it once reported: kept here, its traceback
            # (the consumer's frames, once raised) would keep the consumer's iterator alive
            # as long as the epoch, and the epoch as long as that iterator.
            fatal, self._fatal = self._fatal, None
            self.results.close(fatal if fatal is not None else failure[0] if failure else error)
            if remote is not None:
                remote.close()
            self.done.set()

    async def _run(self) -> None:
        raise NotImplementedError


class MapEpoch(Epoch):
    """An epoch over a map-style dataset: ``keys`` yields the jobs' keys (index batches, or
    indices without auto-batching), sync or async; the plan fetches and collates each."""

    def __init__(
        self, plan: FetchPlan, results: Results, keys: Iterator[Any] | AsyncIterator[Any]
    ) -> None:
        super().__init__(plan, results)
        if isinstance(keys, PacedKeys) and plan.mode == "inline":
            # Read on the consumer's call, one per batch: torch's schedule without pacing.
            keys = keys.unpaced()
        self._keys = keys

    @property
    def inline(self) -> bool:
        """Whether batches are made on the consumer's call, with no background task.

        Fast in-memory datasets gain nothing from a pipeline on the same thread; skipping it
        saves the task switches, which cost as much as the fetch itself.
        """
        return self.plan.mode == "inline"

    @property
    def loopless(self) -> bool:
        """Whether :meth:`next` can run with no event loop at all: an inline epoch whose keys
        and collate are plain calls never awaits a real event, so the sync facade can drive it
        on the consumer's thread (:class:`aloader._facade.LocalIterator`)."""
        return (self.inline and not self.plan.needs_event_loop
                and not isinstance(self._keys, AsyncIterator))

    def start(self) -> None:
        if self.inline:
            self._inline_keys = _Keys(self._keys)
            self._last_yield = _now()
            self.done.set()
        else:
            super().start()

    async def next(self) -> tuple[Any, BaseException | None]:
        """The next batch (value, error); StopAsyncIteration at the end of the epoch."""
        if not self.inline:
            return await self.results.take()
        stats = self.plan.stats
        while True:
            # One clock read ends a stage and starts the next (the reads cost ~0.1 us each).
            started = _now()
            try:
                key = await self._inline_keys.__anext__()
            except StopAsyncIteration:
                raise
            except Exception as exc:
                return None, _note(exc, "raised by the sampler")
            fetching = _now()
            stats.sampling.add(fetching - started)
            seq = self.results.taken
            cpu = time.thread_time_ns() if self.plan.on_consumer else 0
            try:
                try:
                    samples = self.plan.fetch_sync(key)
                finally:
                    collating = _now()
                    if cpu:
                        stats.fetched_in_thread(collating - fetching, time.thread_time_ns() - cpu)
                    else:
                        stats.fetch.add(collating - fetching)
                batch = await self.plan.collate(samples, _NO_LIMITER, collating)
            except Exception as exc:
                return None, _note(exc, f"raised while loading batch {seq} (indices "
                                        f"{_describe(key)})")
            finally:
                self.results.last = seq
                self.results.taken += 1
            if batch is not SKIP:
                if self.results.snapshot is not None:
                    self.results.meta = self.results.snapshot()
                break
        # Keep the loop responsive even if the consumer never awaits anything else (driven
        # with no loop, on the consumer's thread, there is none).
        if collating - self._last_yield > _YIELD_EVERY_NS:
            self._last_yield = collating
            if current_backend() is not None:
                await anyio.lowlevel.checkpoint()
        return batch, None

    async def _run(self) -> None:
        plan = self.plan
        limiter = anyio.CapacityLimiter(plan.concurrency)
        threads = None
        if plan.granularity == "item" and plan.mode == "thread":
            threads = _FetchThreads(plan.get_item, plan.concurrency, plan.abandon, plan.absorb,
                                    plan.stats)
        # Items fetched one by one on the loop: in a turn of a busy loop hundreds of fetches
        # finish before the consumer takes their batches, so a second window of jobs may hold
        # data, and another waits as indices, each worker finding its next fetch at once. On
        # trio a turn runs every task that is ready, and the consumer, woken by the first
        # batch of a turn, runs in the next one, anywhere in it: two windows may finish
        # between two of its takes, so a third may hold data (without it, workers idled
        # for room in ~1 fetch of 7, and parking them cost more than the fetches).
        ahead = plan.granularity == "item" and threads is None
        workers = plan.concurrency if ahead else plan.window
        new_waiter = waiters()  # the backend, looked up once for the epoch
        # Jobs started and not yet taken by the consumer: the windows, and the batches that
        # may wait for the consumer (collated, or fetched and waiting for their slot).
        holding = (3 if current_backend() == "trio" else 2) if ahead else 1
        room = holding * plan.window + self.results.capacity
        queue = _WorkQueue(workers, new_waiter, room)
        self.results.on_take = queue.free
        admission = _Admission(self, queue, threads, new_waiter,
                               room + plan.window if ahead else plan.window)
        # An ``async def __getitem__`` returns a coroutine: awaited as it is, nothing to check.
        getitem = plan.async_getitem()
        try:
            async with task_group() as tg:
                def spawn() -> None:
                    tg.start_soon(self._worker, queue, limiter, admission, getitem)

                queue.spawn = spawn
                try:
                    await self._guard(admission.produce)
                finally:
                    queue.close()
        finally:
            if threads is not None:
                await threads.close()

    async def _worker(
        self, queue: _WorkQueue, limiter: anyio.CapacityLimiter, window: _Admission,
        getitem: Callable[[Any], Awaitable[Any]] | None,
    ) -> None:
        plan = self.plan
        add = plan.stats.fetch.add
        fetch: Callable[[Any], Awaitable[Any]] = getitem if getitem is not None else (
            functools.partial(plan.fetch_item, limiter=limiter))
        # sample_rng's scope for a fetch on the loop is this frame (FrameScope): the index
        # being fetched is the local ``fetching``, IDLE between fetches. Set once in the
        # worker task's own context: a context variable's set, a Scope made or a store into
        # one per fetch cost more than the rest of a fetch's bookkeeping. Once sample_rng has
        # been asked for (``scope.asked``), each fetch is numbered, ``fetch_no`` here and in
        # fetch_var in its context, which the tasks and threads it starts copy: one that
        # outlives its fetch gets no stream, never a later fetch's.
        fetching: Any = IDLE
        fetch_no = 0
        scope: Any = _NO_SCOPE
        if plan.mode != "thread" and plan.seed is not None:
            scope = FrameScope(plan.seed, sys._getframe())
            scope_var.set(scope)
            fetch_var.set(0)  # not the number of a fetch this worker runs in (nested loaders)
        take, get = queue.take, queue.get
        # The clock at the end of this worker's last fetch while nothing but bookkeeping has
        # run since (no await, no collate): the next fetch starts then, a clock read less.
        ended: int | None = None
        with self._guarded:  # not _guard(): a frame less on every resume
            while True:
                job = take()  # without a trip through the loop while there is work
                if job is None:
                    ended = None
                    job = await get()
                    if job is None:
                        return
                position = job.next - 1  # the piece taken, read before any await
                if job.kind:  # not an item to fetch: one test on the items' path
                    ended = None
                    await self._other_piece(job, limiter, window)
                    continue
                fetching = job.indices[position]
                if scope.asked:
                    fetch_no += 1
                    fetch_var.set(fetch_no)
                started = _now() if ended is None else ended
                try:
                    job.samples[position] = await fetch(fetching)
                except Exception as exc:
                    self._fetch_failed(job, position, fetching, exc)
                fetching = IDLE
                ended = _now()
                add(ended - started)
                job.remaining -= 1
                if job.remaining == 0:
                    ended = None
                    await self._complete(job, limiter, window)

    async def _other_piece(self, job: _Job, limiter: anyio.CapacityLimiter,
                           window: _Admission) -> None:
        """A fetch worker's piece of work that is not an item to fetch (``job.kind``)."""
        if job.kind == _WHOLE_JOB:
            await self._run_job(job, limiter)
            window.release()
            return
        if job.kind == _FAILED_ITEMS:  # an item of a job already failed: not fetched
            job.remaining -= 1
            if job.remaining:
                return
        elif job.kind == _AWAIT_THREADS:
            assert job.fetched is not None
            await job.fetched.wait()
            if job.error is not None and not isinstance(job.error, Exception):
                raise job.error  # a KeyboardInterrupt in a fetch thread: see _guard
        await self._complete(job, limiter, window)  # and _NO_ITEMS

    def _fetch_failed(self, job: _Job, position: int, index: Any, error: Exception) -> None:
        """The fetch of ``job``'s item at ``position`` raised ``error``: the item is left out
        (within the failure budget), or the job fails with its first error and its items not
        yet taken are passed over (``_FAILED_ITEMS``)."""
        final = self.plan.absorb(index, _note(error, f"raised while fetching index {index!r} "
                                                     f"of batch {job.seq}"))
        if final is None:
            job.samples[position] = _FAILED
        elif job.error is None:
            job.error = final
            job.kind = _FAILED_ITEMS

    async def _run_job(self, job: _Job, limiter: anyio.CapacityLimiter) -> None:
        """Load a job fetched in one call, publishing its batch or its error."""
        plan = self.plan
        reserved = False
        try:
            if plan.collate_in_thread:
                # One thread hop for fetch and collate, so take the output slot first.
                await self.results.reserve(job.seq)
                reserved = True
                batch = await plan.load(job.key, limiter)
            else:
                samples = await plan.fetch(job.key, limiter, job.seq)
                await self.results.reserve(job.seq)
                reserved = True
                batch = await plan.collate(samples, limiter)
        except Exception as exc:
            if not reserved:
                await self.results.reserve(job.seq)
            self.results.publish(job.seq, None, _note(exc, f"raised while loading batch "
                                                           f"{job.seq} (indices "
                                                           f"{_describe(job.key)})"))
        else:
            self.results.publish(job.seq, batch)

    async def _complete(self, job: _Job, limiter: anyio.CapacityLimiter,
                        window: _Admission) -> None:
        """Collate a job whose items are all in (or publish its first error), then free its
        window slot. A plain ``collate_fn`` (``collates_on_loop``) runs without an await, and
        the job does not wait for its output slot: it is deferred to the slot's freeing
        (:meth:`Results.defer`), and the worker goes on to other work."""
        results = self.results
        if job.error is not None or self.plan.collates_on_loop:
            results.defer(job.seq, functools.partial(self._finish, job, window))
            return
        await results.reserve(job.seq)
        try:
            batch, error = await self.plan.collate(self._samples_of(job), limiter), None
        except Exception as exc:
            batch, error = None, exc
        self._publish(job, window, batch, error)

    def _finish(self, job: _Job, window: _Admission) -> None:
        """Publish a job that has its output slot: its first error, or its batch collated
        now; then free its window slot. Run by a fetch worker or by the consumer's take (see
        :meth:`Results.defer`), so a BaseException ends the epoch here as in a worker."""
        with self._guarded:
            batch, error = None, None
            if job.error is None:
                try:
                    batch = self.plan.collate_now(self._samples_of(job))
                except Exception as exc:
                    error = exc
            self._publish(job, window, batch, error)

    def _publish(self, job: _Job, window: _Admission, batch: Any,
                 collate_error: Exception | None) -> None:
        """Publish a collated job: its first error, the error its collate raised, or its
        batch; then free its window slot."""
        if job.error is not None:
            self.results.publish(job.seq, None, job.error)
        elif collate_error is not None:
            self.results.publish(job.seq, None, _note(collate_error, f"raised while collating "
                                                                     f"batch {job.seq}"))
        else:
            self.results.publish(job.seq, batch)
        job.samples = []
        window.release()

    def _samples_of(self, job: _Job) -> Any:
        """The samples to collate: SKIP for a job failed before a resume, those that did not
        fail within the budget (SKIP if none is left)."""
        samples: Any = job.samples if job.key is not KNOWN_FAILED else SKIP
        if samples is not SKIP and self.plan.failures is not None and job.error is None and any(
            sample is _FAILED for sample in samples  # not `in`: arrays compare elementwise
        ):
            samples = [sample for sample in samples if sample is not _FAILED] or SKIP
        return samples


class IterableEpoch(Epoch):
    """An epoch over an iterable dataset: ``source`` (a sync or async iterator) yields samples,
    cut into jobs of ``batch_size`` (single samples when None; the last, incomplete one
    dropped with ``drop_last``), each pulled and collated in turn."""

    def __init__(
        self,
        plan: FetchPlan,
        results: Results,
        source: Iterator[Any] | AsyncIterator[Any],
        batch_size: int | None,
        drop_last: bool,
        snapshot: Callable[[int, bool], Any] | None = None,
        before_draw: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(plan, results)
        self._use(source)
        # Called with a batch's number just before its samples are drawn (a persistent
        # worker saves its global RNGs there, see aloader.workers._worker).
        self._before_draw = before_draw
        self._batch_size = batch_size
        self._drop_last = drop_last
        # Called once a batch's samples are drawn, with the samples drawn so far and whether
        # the source ended: where the dataset is then travels with the batch (Results.meta).
        self._snapshot = snapshot
        self._drawn = 0  # samples drawn (exact but for the last batch, which ends the source)
        if snapshot is not None and results.metas is None:
            results.metas = {}

    def _use(self, source: Iterator[Any] | AsyncIterator[Any]) -> None:
        """Draw the samples from ``source`` from now on.

        Invariant: ``_async`` says whether ``_source`` is an async iterator, decided here
        once per source rather than per batch (``isinstance`` against the ABC costs a
        Python-level check each time)."""
        self._source = source
        self._async = isinstance(source, AsyncIterator)

    async def _run(self) -> None:
        if self.plan.failures is not None:
            self.plan.failures.watch_sources(self.plan.dataset)
        try:
            await self._guard(self._pull_batches)
        finally:
            # Close the stream now (files, connections), not whenever it is collected; but not
            # under a pull abandoned in its thread, which may still be running it.
            if not self.plan.abandon.given_up:
                await close_iterator(self._source)

    async def _draw(self, limiter: anyio.CapacityLimiter) -> tuple[Any, bool]:
        """The next batch of the source (async, or a sync one pulled on this thread: an
        inline epoch's), collated, and whether the source ended; the batch is _NOTHING when
        there is none (the end, or a short last one with drop_last)."""
        plan, size = self.plan, self._batch_size
        source: Any = self._source  # of the kind _async says (see _use)
        started = _now()
        try:
            if not self._async:
                samples, ended = (_pull_sync(source, size) if plan.failures is None
                                  else _pull_sync_tolerant(source, size, plan))
            elif plan.failures is None:
                samples, ended = await _pull(source, size)
            else:
                samples, ended = await _pull_tolerant(source, size, plan)
        finally:
            plan.stats.fetch.add(_now() - started)
        if samples is _NOTHING or (size is not None and self._drop_last and len(samples) < size):
            return _NOTHING, True
        return await plan.collate(samples, limiter), ended

    def final_snapshot(self) -> Any:
        """Where the dataset is once the source ended (None without snapshots): what a
        dataset's own state carries into the epochs after this one."""
        return None if self._snapshot is None else self._snapshot(self._drawn, True)

    def _drew(self, seq: int, ended: bool) -> Any:
        """Batch ``seq`` is drawn: where the dataset is now travels with it (its meta)."""
        if self._snapshot is None:
            return None
        self._drawn += 1 if self._batch_size is None else self._batch_size
        assert self.results.metas is not None
        meta = self.results.metas[seq] = self._snapshot(self._drawn, ended)
        return meta

    async def _pull_batches(self) -> None:
        plan = self.plan
        limiter = anyio.CapacityLimiter(1)
        source: Any = self._source  # of the kind _async says (see _use)
        size = self._batch_size
        seq = 0
        ended = False
        while not ended:
            await self.results.reserve(seq)
            if self._before_draw is not None:
                self._before_draw(seq)
            try:
                if self._async:
                    batch, ended = await self._draw(limiter)
                elif plan.mode == "thread":
                    batch, ended = await plan.in_thread(
                        plan.pull_sync, source, size, self._drop_last, limiter=limiter
                    )
                    batch = await resolve(batch)
                else:
                    batch, ended = plan.pull_sync(source, size, self._drop_last)
                    batch = await resolve(batch)
                if batch is _NOTHING:
                    break
            except Exception as exc:
                self.results.publish(seq, None, _batch_error(exc, seq))
                seq += 1
                break
            self._drew(seq, ended)
            self.results.publish(seq, batch)
            seq += 1
        self.results.finish(seq)


def _batch_error(error: Exception, seq: int) -> BaseException:
    """``error``, raised loading batch ``seq`` of an iterable dataset, with a note saying so."""
    return _note(error, f"raised while loading batch {seq} of the iterable dataset")


async def _serve(remote: Remote, scope: anyio.CancelScope, failure: list[BaseException]) -> None:
    """Run the remote's service; its failure ends the epoch with its error."""
    try:
        await remote.serve()
    except Exception as exc:
        failure.append(exc)
        scope.cancel()


_NOTHING: Any = object()


def _pull_sync(source: Any, size: int | None) -> tuple[Any, bool]:
    """Up to ``size`` samples (one sample when ``size`` is None) and whether the source ended."""
    if size is None:
        return next(source, _NOTHING), False
    # islice pulls at C speed (a Python loop's append and len per sample were ~40% of an
    # in-memory iterable's batch); it stops after exactly ``size`` samples, so it never
    # draws one sample more than the batch, and an error of the source propagates as is.
    samples = list(islice(source, size))
    return (samples if samples else _NOTHING), len(samples) < size


def _pull_sync_tolerant(source: Iterator[Any], size: int | None, plan: FetchPlan
                        ) -> tuple[Any, bool]:
    """:func:`_pull_sync` with a failure budget: a sample whose ``__next__`` raises is
    counted (its index: its number in the epoch) and pulling goes on, unless the iterator
    cannot go on after raising (a generator), whose error is raised as is."""
    failures = plan.failures
    assert failures is not None
    want = 1 if size is None else size
    samples: list[Any] = []
    while len(samples) < want:
        number = failures.seen
        failures.attempted(1)
        try:
            samples.append(next(source))
        except StopIteration:
            failures.seen -= 1
            return (samples if samples else _NOTHING), True
        except Exception as exc:
            if not resumable(source):
                raise
            plan._absorbed(number, exc)
    return (samples[0] if size is None else samples), False


async def _pull_tolerant(source: AsyncIterator[Any], size: int | None, plan: FetchPlan
                         ) -> tuple[Any, bool]:
    """:func:`_pull` with a failure budget (see :func:`_pull_sync_tolerant`)."""
    failures = plan.failures
    assert failures is not None
    if not resumable(source):  # a stream: its errors end it, its sources' skips count
        samples, ended = await _pull(source, size)
        if samples is not _NOTHING:
            failures.attempted(1 if size is None else len(samples))
        failures.check_skipped()
        return samples, ended
    want = 1 if size is None else size
    out: list[Any] = []
    while len(out) < want:
        number = failures.seen
        failures.attempted(1)
        try:
            out.append(await source.__anext__())
        except StopAsyncIteration:
            failures.seen -= 1
            return (out if out else _NOTHING), True
        except Exception as exc:
            if not resumable(source):
                raise
            plan._absorbed(number, exc)
    return (out[0] if size is None else out), False


async def _pull(source: AsyncIterator[Any], size: int | None) -> tuple[Any, bool]:
    if size is None:
        try:
            return await source.__anext__(), False
        except StopAsyncIteration:
            return _NOTHING, True
    take = getattr(source, "_take", None)
    if take is not None:  # a stream hands over whole slices of its read-ahead blocks
        samples = await take(size)
        return (samples if samples else _NOTHING), len(samples) < size
    samples = []
    while len(samples) < size:
        try:
            samples.append(await source.__anext__())
        except StopAsyncIteration:
            return (samples if samples else _NOTHING), True
    return samples, False


_NO_LIMITER: Any = None  # inline plans never hop to a thread


class _Keys:
    """Sync or async iteration over the sampler's keys, one ``__anext__`` for both."""

    __slots__ = ("_async", "_iterator")

    def __init__(self, keys: Iterator[Any] | AsyncIterator[Any]) -> None:
        self._iterator = keys
        self._async = isinstance(keys, AsyncIterator)

    async def __anext__(self) -> Any:
        if self._async:
            return await self._iterator.__anext__()  # type: ignore[union-attr]
        try:
            return next(self._iterator)  # type: ignore[arg-type]
        except StopIteration:
            raise StopAsyncIteration from None


class PacedKeys:
    """A sampler's keys drawn only on the consumer's calls, on its thread, as torch's loader
    draws them: the reader (the epoch's producer, on the loop) takes keys already drawn, and
    waits for more when it has taken them all.

    A user's sampler may draw from the global ``random``, numpy or torch generators as it
    yields each key; the training loop draws from them too. torch's loader pulls its sampler
    on a fixed schedule (its prefetch at ``iter()``, then one key per batch handed out), so
    the two interleave in one order, run after run; drawn by a producer running ahead as
    timing lets it, they would interleave by chance. :meth:`reach`, the loader's call
    (:meth:`aloader.loader._loader.AsyncDataLoaderIter._advance`, where the consumer calls), draws
    up to the count torch's loader has drawn by then, plus ``lead`` (an epoch without
    workers prefetching: a fixed number, so deterministic still). Only what has no array
    form comes here (a user's sampler, a :class:`~aloader.BatchSampler` over one): aloader's
    own samplers draw their epochs whole, at the point torch's draw their first key.

    The sampler's end or error is kept in its place: the reader gets it after the keys drawn
    before it. :meth:`unpaced` gives up the pacing for an epoch that reads its keys on the
    consumer's call itself (inline: torch's schedule already).

    Args:
        keys: the sampler's iterator.
        lead: keys drawn ahead of the count :meth:`reach` is given.
    """

    def __init__(self, keys: Iterator[Any], lead: int = 0) -> None:
        self._keys = keys
        self._lead = lead
        self._ready: deque[Any] = deque()
        self._drawn = 0
        self._end: Exception | None = None  # StopIteration, or the sampler's error
        self._lock = threading.Lock()
        self._signal = Signal()
        self._call_soon: Callable[[Callable[[], None]], None] | None = None
        self._parked = False  # the reader waits for keys
        self._paced = True
        #: Called with each key the reader takes (a pool's record of the keys it drew).
        self.on_read: Callable[[Any], None] | None = None

    def reach(self, count: int) -> None:
        """Draw keys until ``count + lead`` have been drawn, or the sampler's end."""
        if not self._paced:
            return
        count += self._lead
        drawn: list[Any] = []
        end: Exception | None = None
        # Drawn outside the lock: the sampler's own code runs here (it may be slow).
        while self._drawn + len(drawn) < count and self._end is None:
            try:
                drawn.append(next(self._keys))
            except Exception as exc:  # StopIteration included
                end = exc
                break
        if not drawn and end is None:
            return
        with self._lock:
            self._ready.extend(drawn)
            self._drawn += len(drawn)
            self._end = end
            wake, self._parked = self._parked, False
        if wake:
            assert self._call_soon is not None
            self._call_soon(self._signal.notify)

    def buffered(self) -> Iterator[Any]:
        """The keys drawn and not yet read, taken as they are iterated (never drawing)."""
        while True:
            with self._lock:
                if not self._ready:
                    return
                key = self._ready.popleft()
            yield key

    def unpaced(self) -> Iterator[Any]:
        """The keys as a plain iterator, drawn as it is read (and :meth:`reach` a no-op)."""
        self._paced = False
        yield from self.buffered()
        end = self._end
        if end is None:
            yield from self._keys
        elif not isinstance(end, StopIteration):
            raise end

    def __aiter__(self) -> PacedKeys:
        return self

    async def __anext__(self) -> Any:
        while True:
            with self._lock:
                if self._ready:
                    key = self._ready.popleft()
                    break
                end = self._end
                if end is None:
                    if self._call_soon is None:
                        self._call_soon = threadsafe_caller()
                    self._parked = True
            if end is not None:
                if isinstance(end, StopIteration):
                    raise StopAsyncIteration
                raise end
            # reach() notifies through the loop's call-soon, run only once this task parks.
            await self._signal.wait()
        if self.on_read is not None:
            self.on_read(key)
        return key


def window_for(concurrency: int, batch_size: int | None) -> int:
    """Jobs to admit so that ``concurrency`` item fetches can overlap.

    One job more than the concurrency fills, so that fetches never wait while a finished job
    is being collated: items held stay within ``concurrency + batch_size``.
    """
    return max(1, math.ceil(concurrency / (batch_size or 1))) + 1
