"""One epoch of a DataLoader, run: the epoch runners that schedule fetches, order results and
collate.

An epoch is a stream of *jobs*. A job is one batch (an index batch from the batch sampler, or
one index when auto-batching is off, or up to ``batch_size`` items of an iterable dataset). The
pipeline runs in a background task (see :mod:`aloader._backend`) and has three parts:

* a producer that walks the sampler and admits jobs, at most ``window`` at a time (the
  admission window of :mod:`aloader.pipeline._schedule`);
* fetch workers that pull work from the work queue (whole jobs, or single items of jobs when
  item fetches overlap) and collate a job once its last item is in; a worker starts only when
  work arrives that no idle worker can take, so there are never more workers than the work in
  the window, whatever the concurrency allowed;
* :class:`~aloader.pipeline._results.Results`, which hands finished batches to the consumer in
  sampler order (or in completion order) and lets at most ``capacity`` collated batches wait
  for it.

Two kinds of epoch share it: :class:`MapEpoch` walks a sampler's keys (index batches or
indices, see :mod:`aloader.pipeline._keys`), :class:`IterableEpoch` cuts an iterable dataset's
samples into batches (:mod:`aloader.pipeline._pull`). How a job turns into a batch is the
epoch's :class:`~aloader.pipeline._plan.FetchPlan`, decided in one place
(:meth:`~aloader.pipeline._plan.FetchPlan.for_dataset`) for the loader and its worker processes
alike; the fetch calls themselves are :mod:`aloader.data._fetch`'s, shared with the wrapper
datasets. Blocking fetches of single items run in the fetch threads of
:mod:`aloader.pipeline._threads`.

With worker processes (``mode="process"``) the same pipeline runs; a job's fetch sends its key
to a worker and awaits the batch the worker collated (see :mod:`aloader.workers._pool_epoch`),
and the plan's ``remote`` runs a service task beside the fetch workers for as long as the epoch
lasts.

The hot path, hundreds of single-item fetches in flight, costs little beyond the fetches' own
awaits: a worker takes work without awaiting while there is some, parks on a waiter of the
running loop (:func:`aloader._backend.waiters`: a plain future on asyncio, looked up once per
epoch) only when there is none, awaits the dataset's own awaitable with no coroutine of ours
around it, and a plain ``collate_fn`` runs without an await.

Invariant: memory is bounded whatever the consumer does: a job holds a window slot from
admission until its batch is collated, and a batch is collated only once it has an output slot.

With a failure budget (the plan's ``failures``, see :mod:`aloader.pipeline._failures`), a sample
whose fetch raises is left out of its batch instead (marked ``_FAILED`` until the job collates;
a job left with no sample publishes :data:`~aloader.pipeline._results.NO_BATCH`), until the budget
is exceeded. A resumed epoch's job whose samples all failed before the checkpoint has the key
``KNOWN_FAILED`` and publishes ``NO_BATCH`` unfetched. Every epoch records its statistics into the
plan's ``stats`` (see :mod:`aloader._stats`): a timestamp pair per job, or per item where items
are fetched one by one.

An ``Exception`` from the dataset, the sampler or ``collate_fn`` is that batch's error (noted
where it was raised: :mod:`aloader.pipeline._errors`); any other ``BaseException``
(``KeyboardInterrupt``, ``SystemExit``...) ends the epoch and reaches the consumer as itself
(see :meth:`Epoch._guard`), never the event loop. Stopping an epoch waits for the fetches in
threads to return, unless the epoch has abandoned its threads (after a ``timeout`` fired): a
thread stuck in the dataset is then left running, its result discarded.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel

from .._backend import Detached, current_backend, task_group, threadsafe_caller, waiters
from .._exceptions import LoaderClosedError, Throttled
from .._tuning import Controller
from .._util import close_iterator, resolve
from ._errors import _batch_error, _describe, _note
from ._failures import _FAILED, KNOWN_FAILED
from ._keys import PacedKeys, _Keys
from ._plan import FetchPlan, Remote, window_for
from ._pull import _NOTHING, _pull, _pull_sync, _pull_sync_tolerant, _pull_tolerant
from ._results import NO_BATCH, Results
from ._sample_rng import IDLE, FrameScope, fetch_var, scope_var
from ._schedule import (
    _AWAIT_THREADS,
    _FAILED_ITEMS,
    _RETRY,
    _WHOLE_JOB,
    _Admission,
    _Job,
    _Retry,
    _WorkQueue,
)
from ._threads import _FetchThreads

__all__ = ("Epoch", "IterableEpoch", "MapEpoch")

# A fetch worker's stand-in for a FrameScope where sample_rng has none (fetches in threads):
# never asked, so its fetches are never numbered.
_NO_SCOPE = SimpleNamespace(asked=False)

# Inline epochs give other tasks a turn at least this often (ns).
_YIELD_EVERY_NS = 1_000_000


_NO_LIMITER: Any = None  # inline plans never hop to a thread


_now = time.perf_counter_ns


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
        self._group: Any = None  # the fetch workers' task group, while it runs
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
                    samples = await self._fetch_inline(key)
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
            if batch is not NO_BATCH:
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

    async def _fetch_inline(self, key: Any) -> Any:
        """An inline epoch's fetch of ``key``, made again while the dataset throttles (waiting
        on the loop, or on the consumer's thread where there is none)."""
        plan = self.plan
        in_a_row = 0
        while True:
            try:
                return plan.fetch_sync(key)
            except Throttled as exc:
                in_a_row += 1
                delay = plan.throttled(exc, in_a_row)
            if current_backend() is None:
                time.sleep(delay)
            else:
                await anyio.sleep(delay)

    async def _run(self) -> None:
        plan = self.plan
        tuner = plan.tuner
        limiter = anyio.CapacityLimiter(plan.concurrency)
        # With "auto" concurrency the fetches in flight follow the controller's limit; the
        # plan's concurrency is its maximum.
        limit = plan.concurrency if tuner is None else tuner.limit
        threads = None
        if plan.granularity == "item" and plan.mode == "thread":
            threads = _FetchThreads(plan, limit)
        # Items fetched one by one on the loop: in a turn of a busy loop hundreds of fetches
        # finish before the consumer takes their batches, so a second window of jobs may hold
        # data, and another waits as indices, each worker finding its next fetch at once. On
        # trio a turn runs every task that is ready, and the consumer, woken by the first
        # batch of a turn, runs in the next one, anywhere in it: two windows may finish
        # between two of its takes, so a third may hold data (without it, workers idled
        # for room in ~1 fetch of 7, and parking them cost more than the fetches).
        ahead = plan.granularity == "item" and threads is None
        workers = limit if ahead else plan.window
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
                self._group = tg  # the waits of throttled items run in it

                def spawn() -> None:
                    tg.start_soon(self._worker, queue, limiter, admission, getitem)

                queue.spawn = spawn
                if tuner is not None:
                    self._follow(tuner, queue, admission, threads, holding, ahead)
                try:
                    await self._guard(admission.produce)
                finally:
                    queue.close()
        finally:
            if tuner is not None:
                tuner.on_change = None
            if threads is not None:
                await threads.close()

    def _follow(self, tuner: Controller, queue: _WorkQueue, admission: _Admission,
                threads: _FetchThreads | None, holding: int, ahead: bool) -> None:
        """Have the epoch follow the controller's limit: the fetch workers (or threads), the
        window and the room change with it as they would for that fixed ``max_concurrency``,
        so what the pipeline holds stays bounded as it does there."""
        plan = self.plan
        window = plan.window
        tuner.resume(_now())  # a round begun in an earlier epoch does not count

        def resize(limit: int) -> None:
            nonlocal window
            if tuner.on_change is None:  # the epoch ended meanwhile
                return
            new = window_for(limit, plan.per_job) if plan.granularity == "item" else limit
            delta, window = new - window, new
            queue.resize(limit if ahead else new, holding * delta)
            admission.release((holding + 1) * delta if ahead else delta)

        loop_thread = threading.get_ident()
        call_soon = threadsafe_caller()

        def on_change(limit: int) -> None:
            if threads is not None:  # at once, from the thread that reported: it may leave
                threads.resize(limit)
            if threading.get_ident() == loop_thread:
                resize(limit)
            else:  # the window and the room are the loop's
                call_soon(functools.partial(resize, limit))

        tuner.on_change = on_change
        if window != plan.tuned_window():
            on_change(tuner.limit)  # changed since the plan was made (a state loaded)

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
        # "auto": each item's latency, a bare list append; the controller looks at them once
        # per batch (in _complete).
        tuner: Any = plan.tuner
        record = None if tuner is None else tuner.record
        if plan.hedge is not None:
            fetch = functools.partial(self._hedged, fetch)
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
                throttles = 0
                if job.kind:  # not an item to fetch: one test on the items' path
                    ended = None
                    if job.kind != _RETRY:
                        await self._other_piece(job, limiter, window)
                        continue
                    retry: Any = job  # a throttled item, due again
                    job, position, throttles = retry.job, retry.position, retry.throttles
                fetching = job.indices[position]
                if scope.asked:
                    fetch_no += 1
                    fetch_var.set(fetch_no)
                started = _now() if ended is None else ended
                try:
                    job.samples[position] = await fetch(fetching)
                except Exception as exc:
                    if isinstance(exc, Throttled) and self._throttled(queue, job, position, exc,
                                                                      throttles + 1):
                        fetching = IDLE
                        ended = None
                        continue  # due again later: not done
                    self._fetch_failed(job, position, fetching, exc)
                fetching = IDLE
                ended = _now()
                if record is None:
                    add(ended - started)
                else:
                    took = ended - started
                    add(took)
                    record(took)
                    if tuner.measuring:  # a throttling episode: every completion's time
                        tuner.tick(ended)
                job.remaining -= 1
                if job.remaining == 0:
                    ended = None
                    await self._complete(job, limiter, window)

    def _throttled(self, queue: _WorkQueue, job: _Job, position: int, error: Throttled,
                   throttles: int) -> bool:
        """The dataset throttled ``job``'s item at ``position`` (``throttles`` times in a
        row): it is due again after the wait (:meth:`FetchPlan.throttled`), first in line,
        and its worker goes on meanwhile, so that the wait holds no slot of the limit. False
        once it was throttled too often (then it fails with ``error``)."""
        try:
            delay = self.plan.throttled(error, throttles)
        except Throttled:
            return False
        queue.pending += 1
        piece = _Retry(job, position, throttles)

        async def due() -> None:
            await anyio.sleep(delay)
            queue.retry(piece)

        assert self._group is not None
        self._group.start_soon(due)
        return True

    async def _hedged(self, fetch: Callable[[Any], Awaitable[Any]], index: Any) -> Any:
        """``fetch(index)`` hedged (``hedge_after``, see :meth:`FetchPlan.hedged`)."""
        return await self.plan.hedged(fetch, index, self.plan.epoch)

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
        tuner = self.plan.tuner
        if tuner is not None and self.plan.mode != "thread":  # (threads report on their own)
            tuner.tick(_now())
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
        """The samples to collate: NO_BATCH for a job failed before a resume, those that did not
        fail within the budget (NO_BATCH if none is left)."""
        samples: Any = job.samples if job.key is not KNOWN_FAILED else NO_BATCH
        if samples is not NO_BATCH and self.plan.failures is not None and job.error is None and any(
            sample is _FAILED for sample in samples  # not `in`: arrays compare elementwise
        ):
            samples = [sample for sample in samples if sample is not _FAILED] or NO_BATCH
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



async def _serve(remote: Remote, scope: anyio.CancelScope, failure: list[BaseException]) -> None:
    """Run the remote's service; its failure ends the epoch with its error."""
    try:
        await remote.serve()
    except Exception as exc:
        failure.append(exc)
        scope.cancel()
