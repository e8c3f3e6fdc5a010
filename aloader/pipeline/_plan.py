"""How one epoch turns a key into a batch: the :class:`FetchPlan` (mode, granularity,
concurrency, window), decided in one place for the loader and its worker processes alike.

Invariant: :meth:`FetchPlan.for_dataset` is the only place that decides how an epoch fetches;
every fetch of the dataset runs in its sample's scope (:mod:`aloader.pipeline._sample_rng`)
where the loader has a sample seed; a plan's statistics are timed where the work runs (on the
loop, or in the thread that ran it).
"""

from __future__ import annotations

import inspect
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

import anyio
import numpy as np

from .._exceptions import FailureBudgetExceeded
from .._stats import Collector
from .._util import is_async_callable, is_awaitable, resolve
from ..data._collate import ColumnBatch, default_collate
from ..data._dataset import aiter_of, fetch_mode
from ..data._fetch import DatasetFetchMode
from ._errors import _note
from ._failures import KNOWN_FAILED, Failures
from ._pull import _NOTHING, _pull_sync, _pull_sync_tolerant
from ._results import NO_BATCH
from ._sample_rng import BATCH, Scope, scope_var
from ._threads import _Abandon

if TYPE_CHECKING:
    from .._epoch_setup import EpochSetup

__all__ = ("DEFAULT_MAX_CONCURRENCY", "FetchPlan", "Remote", "window_for")

# Fetches in flight for async datasets when max_concurrency is not given.
DEFAULT_MAX_CONCURRENCY = 64

# How a plan fetches: as its dataset's own fetches run (an "inline" plan may also be a
# "thread" dataset's on the consumer's thread), or in worker processes ("process").
FetchMode: TypeAlias = DatasetFetchMode | Literal["process"]
# How a job's data is fetched: one call per job, or one call per item with items overlapping.
Granularity = Literal["job", "item"]


_now = time.perf_counter_ns
_cpu = time.thread_time_ns


class Remote(Protocol):
    """Where a ``"process"`` plan's jobs are fetched and collated (a pool of worker processes).

    ``serve`` runs beside the epoch's fetch workers until the epoch cancels it; an exception
    from it ends the epoch with that error. ``stop`` is called (from any thread) when the epoch
    is asked to stop, and ``close`` once the epoch has ended. ``fetch`` gets the job's
    sequence number in the epoch with its key, so that where and when the job runs may depend
    on its place in the epoch rather than on the order its task wakes up in, and the plan's
    statistics and failure budget, into which it records what the workers counted.
    """

    async def fetch(self, key: Any, seq: int, stats: Collector,
                    failures: Failures | None) -> Any: ...

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
        setup: EpochSetup | None = None,
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

        An epoch's plan is built from its ``setup``, as are its statistics and its failure
        budget (which the plan holds); without one (a plan asked only what it would decide,
        or the workers' plan), the statistics count nothing for anyone and there is no budget.

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
            setup: the epoch the plan is for (see :mod:`aloader._epoch_setup`), or None.
            here: the plan of a sync ``for`` on its consumer's thread.
        """
        epoch = 0 if setup is None else setup.epoch
        if remote is not None:
            window = max(1, prefetch_factor) * num_workers
            stats, failures = _recorders(setup, "process", window, auto_batch)
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
                failures=failures,
                stats=stats,
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
        stats, failures = _recorders(setup, mode, concurrency if item_level else window,
                                     auto_batch)
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
            failures=failures,
            stats=stats,
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
        batch call retried item by item), or :data:`NO_BATCH` when none is left."""
        if key is KNOWN_FAILED:
            return NO_BATCH
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
        return samples if samples else NO_BATCH

    def _absorbed(self, index: Any, error: Exception) -> Any:
        """:data:`NO_BATCH` when the budget absorbs ``error``; else raise the job's error."""
        final = self.absorb(index, _note(error, f"raised while fetching index {index!r}"))
        if final is not None:
            raise final
        return NO_BATCH

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
        if samples is NO_BATCH:  # every sample failed within the budget
            return NO_BATCH
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
                return await self.remote.fetch(key, seq, self.stats, self.failures)
            finally:
                in_flight.change(-1, _now())
        if key is KNOWN_FAILED:
            return NO_BATCH
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
        return samples if samples else NO_BATCH

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
        """:meth:`collate` without an await: for NO_BATCH, a remote's batch, or where the plan
        :attr:`collates_on_loop`."""
        if samples is NO_BATCH:  # every sample failed within the budget, or none came
            return NO_BATCH
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
        if samples is NO_BATCH or self.remote is not None:
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



def _recorders(setup: EpochSetup | None, mode: FetchMode, in_flight_limit: int,
               auto_batch: bool) -> tuple[Collector, Failures | None]:
    """The statistics and the failure budget of the epoch ``setup`` describes, for a plan
    that fetches in ``mode`` with at most ``in_flight_limit`` fetches in flight."""
    if setup is None:
        return Collector(), None
    stats = Collector.for_epoch(setup, mode, in_flight_limit, auto_batch)
    return stats, Failures.for_epoch(setup, stats) if setup.max_failures else None


def window_for(concurrency: int, batch_size: int | None) -> int:
    """Jobs to admit so that ``concurrency`` item fetches can overlap.

    One job more than the concurrency fills, so that fetches never wait while a finished job
    is being collated: items held stay within ``concurrency + batch_size``.
    """
    return max(1, math.ceil(concurrency / (batch_size or 1))) + 1
