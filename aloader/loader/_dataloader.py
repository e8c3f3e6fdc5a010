"""The DataLoader and its epochs' iterators: torch's signature, checks and attributes.

:class:`DataLoader` validates its arguments as torch does, builds the samplers, and picks once
what kind of epochs it runs (:class:`~aloader.loader._epochs.MapEpochs` or
:class:`~aloader.loader._epochs.IterableEpochs`). Each epoch's :class:`AsyncDataLoaderIter`
(``async for``) or :class:`DataLoaderIter` (``for``, through :mod:`aloader._facade`) decides
once whether workers fetch, asks :meth:`~aloader.pipeline._plan.FetchPlan.for_dataset` how,
and consumes the pipeline (:mod:`aloader.pipeline._epoch`), handing out batches with torch's
timeout and errors. torch's argument checks are :mod:`aloader.loader._arguments`'s,
checkpoints :mod:`aloader.loader._checkpoint`'s, how an epoch starts (its plan, setup and
worker processes) :mod:`aloader.loader._start`'s, ``pin_memory``
:mod:`aloader.loader._pin_memory`'s. (The loader and its iterators name each other in their
public signatures, which resolve at runtime: they live in one module.)

Invariant: the attributes torch freezes (``batch_size``, ``sampler``, ``dataset``...) cannot be
set once the loader is built; what an epoch needs is decided when it starts, so
``num_workers``, ``max_failures`` or ``generator`` may change between epochs; the background
pipeline holds no reference to an iterator, so dropping one stops its epoch.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, Literal, TypeVar, cast, overload

import anyio
import numpy as np

from .._backend import current_backend
from .._exceptions import FailureBudgetExceeded, LoaderTimeoutError
from .._facade import LocalIterator, PrivateLoop, SyncIterator, forbid_running_loop, loop_of
from .._log import SLOW_FIRST_BATCH, loader_log
from .._stats import Collector, LoaderStats
from .._trace import Trace
from .._tuning import Controller
from .._util import user_stacklevel
from ..data._batchsampler import BatchSampler
from ..data._collate import default_collate, default_convert
from ..data._dataset import is_iterable_dataset
from ..data._random import as_generator, rng_state
from ..data._sampler import RandomSampler, SequentialSampler
from ..pipeline._epoch import Epoch, MapEpoch
from ..pipeline._failures import Failures, KnownFailed
from ..pipeline._plan import FetchPlan
from ..pipeline._sample_rng import seed_of
from ..workers._context import default_context, prepare_context, resolve_context
from ..workers._processes import WorkerPool
from ._arguments import check_batching, check_hedge_after, check_loading, warn_worker_number
from ._checkpoint import _EpochRecord, _is_int, load_state, state_of
from ._epochs import AlreadyDelivered, EpochKind, IterableEpochs, MapEpochs
from ._pin_memory import _require_torch
from ._ranks import RANKS_FORMAT, rank_part
from ._start import epoch_seed, fetch_plan, key_lead, start_epoch, workers_live

__all__ = ("AsyncDataLoaderIter", "DataLoader", "DataLoaderIter")

_now = time.perf_counter_ns

T_co = TypeVar("T_co", covariant=True)

_FROZEN = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers")


class DataLoader(Generic[T_co]):
    """Combines a dataset and a sampler, and iterates over batches of the dataset.

    Each ``async for batch in loader`` is one epoch. Fetches run concurrently without blocking
    the event loop: async datasets (``async def __getitem__`` / ``__getitems__`` / ``__aiter__``)
    run up to ``max_concurrency`` item fetches at once on the loop; synchronous datasets run in a
    worker thread, a whole batch per call by default or up to ``max_concurrency`` items at once
    when it is given. At most ``prefetch_factor`` collated batches wait for the consumer.
    ``for batch in loader`` gives the same epochs to synchronous code: an in-memory dataset's
    epoch, or a stream's over local files (``TextLines``, ``JsonLines``: no workers, no
    ``timeout``, a plain ``collate_fn``), runs on the calling thread, any other on the
    loader's event loop in a background thread (uvloop's when installed;
    ``ALOADER_UVLOOP=0`` keeps asyncio's).

    With ``num_workers > 0``, worker processes fetch and collate whole batches, each with the
    same concurrency as above (async datasets keep ``max_concurrency`` fetches in flight per
    worker); arrays in batches come back through shared memory, not through pickling. Map-style
    index batch ``k`` goes to worker ``k % num_workers`` (each worker receives its batches in
    order, at most ``prefetch_factor`` ahead), as torch's do, so what workers draw from their
    seeded RNGs is reproducible; batches are delivered in sampler order (or as they finish
    with ``in_order=False``). With an iterable dataset, every worker iterates its own replica
    (shard it with :func:`get_worker_info`), batches come from the workers in turn, and the
    epoch ends when all are exhausted. A :class:`Stream` dataset iterated by workers uses the
    epoch its copy here claims (its ``set_epoch`` value, else its counter, advanced as if
    iterated here), so shard orders and shuffles change every epoch as without workers; its
    sources' ``stats`` here add up what every worker counted. Each epoch draws ``base_seed``
    from ``generator`` (an epoch of live persistent workers keeps theirs, as torch's); worker
    ``i`` seeds Python's ``random`` with ``base_seed + i`` and numpy's global RNG (and
    torch's, if it imported torch) as torch's workers do, then calls ``worker_init_fn(i)``.
    A worker's exception reaches the consumer with its type, the worker id and its traceback;
    a worker that dies raises torch's "DataLoader worker (pid N) exited unexpectedly" / "is
    killed by signal" error at once. Workers stop when the epoch ends or is abandoned
    (``break``, cancellation, garbage collection) or, with ``persistent_workers``, when the
    loader is closed or collected, and in any case when the loader's process dies.

    By default (``multiprocessing_context=None``) workers are forks of a template of this
    process, forked once, when the first loader with workers is built while only the main
    thread runs: a worker starts with every module imported by then (torch too) without
    importing anything, never re-runs the main module, and is safe in a process that runs
    threads, which ``fork`` is not. So a script needs no ``if __name__ == "__main__":`` guard,
    and the dataset, ``collate_fn`` and ``worker_init_fn`` may be lambdas, local functions or
    classes defined in ``__main__``, a notebook or ``python -c``: they are pickled once per
    start with cloudpickle, by value where they are not importable by name, their large arrays
    into shared memory that the workers map. (If threads already run when the first loader is
    built, workers come from an exec'd fork server instead, with the same guarantees; only the
    modules are imported again.) ``"fork"``, ``"spawn"`` and ``"forkserver"`` keep the standard
    library's semantics: ``spawn`` and ``forkserver`` import the main module in each worker, so
    a script needs the guard there.

    Checkpoints: :meth:`state_dict` (at any point, from ``async for`` or ``for``, or between
    epochs) and :meth:`load_state_dict` on a loader built with the same arguments resume
    exactly: the rest of the interrupted epoch, then the epochs the uninterrupted run would
    have had, with any ``num_workers``. Randomness that must not depend on the worker that
    fetches a sample comes from :func:`aloader.sample_rng`, seeded by :attr:`sample_seed`.

    The arguments, defaults, checks and error messages are those of
    ``torch.utils.data.DataLoader``, with two differences: ``generator`` also takes an int seed
    or a :class:`numpy.random.Generator`, and ``prefetch_factor`` is accepted without worker
    processes, where it bounds the batches prefetched by the event loop.

    Args:
        dataset: a map-style dataset (``__getitem__``, ``__len__``) or an iterable dataset
            (``__iter__`` or ``__aiter__``); methods may be plain or ``async def``.
        batch_size: samples per batch; None turns automatic batching off.
        shuffle: reshuffle the data at every epoch.
        sampler: an iterable (or async iterable) of indices; excludes ``shuffle``.
        batch_sampler: an iterable (or async iterable) of index lists; excludes ``batch_size``,
            ``shuffle``, ``sampler`` and ``drop_last``.
        num_workers: worker processes (0 loads in the calling process).
        collate_fn: merges a list of samples into a batch; plain or async. Defaults to
            :func:`default_collate` when batching, :func:`default_convert` otherwise.
        pin_memory: copy tensors into pinned memory (needs torch).
        drop_last: drop the last incomplete batch.
        timeout: seconds to wait for one batch before raising (0 waits forever).
        worker_init_fn: called with the worker id in each worker process.
        multiprocessing_context: start method (a string) or multiprocessing context for the
            workers; None means forks of the template described above (``"spawn"`` where
            the platform has no fork server).
        generator: None, an int seed or a numpy Generator; it seeds the random sampler and each
            epoch's ``base_seed``. The same seed gives the same sequence of epochs.
        prefetch_factor: collated batches allowed to wait for the consumer (default 2); with
            workers, also the batches each worker is asked for ahead of time.
        persistent_workers: keep worker processes (and their dataset copies) alive between
            epochs; they keep the seeds of the epoch that started them.
        pin_memory_device: deprecated in torch; kept for signature compatibility.
        in_order: deliver batches in sampler order (True) or as soon as they are ready.
        max_concurrency: fetch calls in flight. Async datasets default to 64; synchronous
            datasets default to one batch call at a time in a worker thread, and with a value
            fetch that many items at once in threads (for blocking I/O). ``"auto"``: as many
            as the store serves well, set by a controller from the fetches' measured
            throughput and latency (it grows while throughput grows, backs off when latency
            rises without it or when the dataset raises :class:`Throttled`; see
            :mod:`aloader._tuning`), up to ``max_concurrency_limit``; it goes on from epoch
            to epoch, its value and history are in :meth:`stats` (``concurrency``), its state
            in :meth:`state_dict`. What the pipeline holds follows the limit as it would a
            fixed ``max_concurrency``. With workers, each worker tunes its own fetches.
        max_failures: the failure budget of each epoch: an int is a count of samples, a
            float in (0, 1) a fraction of the epoch's samples. With a budget, a sample whose
            fetch raises is left out of its batch (a batch left with no sample is skipped),
            counted and logged to ``aloader.loader``; once the failures exceed the budget the
            epoch fails with :class:`FailureBudgetExceeded`. 0 (the default) raises the first
            error with its own type, as torch does. See :mod:`aloader.pipeline._failures` for
            ``__getitems__``, iterable datasets, streams and workers. It may change between
            epochs; with ``persistent_workers``, turning it on or off restarts the workers.
        max_concurrency_limit: the most fetches ``max_concurrency="auto"`` lets run at once
            (default 1024); only with ``"auto"``.
        hedge_after: seconds after which an item fetch of an async ``__getitem__`` that has
            not answered gets a second one (the first to answer is kept, the other
            cancelled; at most 5% extra fetches, counted in ``stats().hedged``). Opt-in:
            only for fetches that may be made twice (idempotent reads); each attempt draws
            the sample's :func:`sample_rng` stream from its start.

    A dataset whose store asks it to slow down raises :class:`Throttled` from
    ``__getitem__`` (or ``__getitems__``): the loader waits (``retry_after``, or a backoff)
    and fetches that index again, in order and exactly once, counted in ``stats().throttled``
    and not as a failure; ``"auto"`` concurrency backs off.
        snapshot_every_n_steps: torchdata's ``StatefulDataLoader`` argument, accepted so that
            its code runs unchanged (None or a non-negative int); it changes nothing here:
            :meth:`state_dict` is exact whenever it is called.
    """

    dataset: Any
    batch_size: int | None
    drop_last: bool
    #: The seed of :func:`aloader.sample_rng`: ``generator`` when it is an int, else a digest
    #: of the generator's state when the loader was built (random per process with
    #: ``generator=None`` and no torch); :meth:`load_state_dict` sets the checkpoint's.
    sample_seed: int
    sampler: Any
    batch_sampler: Any
    persistent_workers: bool
    __initialized = False
    # The event loop of `for` epochs (see aloader._facade), and the finalizer that closes it.
    _sync_loop: PrivateLoop | None = None
    _sync_loop_close: weakref.finalize[[], Any] | None = None

    @overload
    def __init__(
        self: DataLoader[Any],
        dataset: Any,
        batch_size: int | None = ...,
        shuffle: bool | None = ...,
        sampler: Iterable[Any] | Any | None = ...,
        batch_sampler: Iterable[Any] | Any | None = ...,
        num_workers: int = ...,
        collate_fn: None = ...,
        pin_memory: bool = ...,
        drop_last: bool = ...,
        timeout: float = ...,
        worker_init_fn: Callable[[int], None] | None = ...,
        multiprocessing_context: Any = ...,
        generator: int | np.random.Generator | None = ...,
        *,
        prefetch_factor: int | None = ...,
        persistent_workers: bool = ...,
        pin_memory_device: str = ...,
        in_order: bool = ...,
        max_concurrency: int | Literal["auto"] | None = ...,
        max_failures: int | float = ...,
        max_concurrency_limit: int | None = ...,
        hedge_after: float | None = ...,
        snapshot_every_n_steps: int | None = ...,
    ) -> None: ...
    @overload
    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = ...,
        shuffle: bool | None = ...,
        sampler: Iterable[Any] | Any | None = ...,
        batch_sampler: Iterable[Any] | Any | None = ...,
        num_workers: int = ...,
        collate_fn: Callable[[Any], Awaitable[T_co]] = ...,
        pin_memory: bool = ...,
        drop_last: bool = ...,
        timeout: float = ...,
        worker_init_fn: Callable[[int], None] | None = ...,
        multiprocessing_context: Any = ...,
        generator: int | np.random.Generator | None = ...,
        *,
        prefetch_factor: int | None = ...,
        persistent_workers: bool = ...,
        pin_memory_device: str = ...,
        in_order: bool = ...,
        max_concurrency: int | Literal["auto"] | None = ...,
        max_failures: int | float = ...,
        max_concurrency_limit: int | None = ...,
        hedge_after: float | None = ...,
        snapshot_every_n_steps: int | None = ...,
    ) -> None: ...
    @overload
    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = ...,
        shuffle: bool | None = ...,
        sampler: Iterable[Any] | Any | None = ...,
        batch_sampler: Iterable[Any] | Any | None = ...,
        num_workers: int = ...,
        collate_fn: Callable[[Any], T_co] = ...,
        pin_memory: bool = ...,
        drop_last: bool = ...,
        timeout: float = ...,
        worker_init_fn: Callable[[int], None] | None = ...,
        multiprocessing_context: Any = ...,
        generator: int | np.random.Generator | None = ...,
        *,
        prefetch_factor: int | None = ...,
        persistent_workers: bool = ...,
        pin_memory_device: str = ...,
        in_order: bool = ...,
        max_concurrency: int | Literal["auto"] | None = ...,
        max_failures: int | float = ...,
        max_concurrency_limit: int | None = ...,
        hedge_after: float | None = ...,
        snapshot_every_n_steps: int | None = ...,
    ) -> None: ...
    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Iterable[Any] | Any | None = None,
        batch_sampler: Iterable[Any] | Any | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: int | np.random.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        max_concurrency: int | Literal["auto"] | None = None,
        max_failures: int | float = 0,
        max_concurrency_limit: int | None = None,
        hedge_after: float | None = None,
        snapshot_every_n_steps: int | None = 1,
    ) -> None:
        prefetch_factor, max_failures = check_loading(
            num_workers, timeout, prefetch_factor, persistent_workers, max_concurrency,
            max_failures, max_concurrency_limit)
        hedge_after = check_hedge_after(hedge_after, dataset,
                                        batch_size is not None or batch_sampler is not None)
        if snapshot_every_n_steps is not None and (
            not _is_int(snapshot_every_n_steps) or snapshot_every_n_steps < 0
        ):
            raise ValueError(
                "snapshot_every_n_steps should be a non-negative integer or None, "
                f"but got snapshot_every_n_steps={snapshot_every_n_steps!r}"
            )
        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.in_order = in_order
        # torchdata's: how often its workers send their state. Every state here is exact
        # whenever it is taken (it travels with each batch), so it changes nothing.
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.max_concurrency = max_concurrency
        self.max_concurrency_limit = max_concurrency_limit
        self.hedge_after = hedge_after
        self.max_failures: int | float = max_failures
        # "auto" concurrency: the controller, kept from epoch to epoch (made by the first
        # epoch's plan), and a loaded state waiting for it.
        self._tuner: Controller | None = None
        self._tuner_state: dict[str, Any] | None = None

        iterable = is_iterable_dataset(dataset)
        batch_size, shuffle, drop_last = check_batching(
            iterable, batch_size, shuffle, sampler, batch_sampler, drop_last)

        # One Generator for the loader: it seeds the random sampler and every base_seed.
        self.generator = generator
        self._rng = as_generator(generator)
        self.sample_seed: int = seed_of(generator, self._rng)
        kind: EpochKind
        if iterable:
            kind = IterableEpochs(dataset, batch_size, drop_last)
        else:
            if sampler is None:
                if shuffle:
                    # Without a generator, torch's sampler reseeds from the global RNG per epoch.
                    sampler = RandomSampler(
                        dataset, generator=self._rng if generator is not None else None
                    )
                else:
                    sampler = SequentialSampler(dataset)
            if batch_size is not None and batch_sampler is None:
                batch_sampler = BatchSampler(cast(Any, sampler), batch_size, drop_last)
            kind = MapEpochs(sampler, batch_sampler, dataset)
        self._kind = kind

        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler

        if collate_fn is None:
            collate_fn = default_collate if self._auto_collation else default_convert
        self.collate_fn = collate_fn
        self.persistent_workers = persistent_workers
        self.multiprocessing_context = multiprocessing_context

        if pin_memory:
            _require_torch("pin_memory=True")
        self._iterators: weakref.WeakSet[AsyncDataLoaderIter[Any]] = weakref.WeakSet()
        self._epochs: set[Epoch] = set()  # started and maybe not yet wound down
        self._pool: WorkerPool | None = None
        self._epochs_started = 0  # numbers the epochs (a stream's own counter aside)
        # Checkpoints: the latest epoch's record, and a loaded state the next epoch resumes.
        self._record: _EpochRecord | None = None
        self._resume_state: dict[str, Any] | None = None
        self._resume_skip: AlreadyDelivered | None = None
        self._resume_seed: int | None = None  # the persistent workers' seed of a resumed run
        self._resume_failures: tuple[int, list[Any]] | None = None  # its failures so far
        # The persistent workers' generators of a state taken between epochs (JSON, per
        # worker: see aloader.workers._rngs), for the next persistent pool's workers.
        self._resume_rngs: list[Any] | None = None
        self._stats: Collector | None = None  # the statistics of the latest epoch
        self._stats_epochs = 0
        self._trace: Trace | None = None  # recording the epochs as they start (trace())
        if num_workers > 0:
            prepare_context(self._context(), warm=True)
        self._warned_workers = 0  # the num_workers warned about (see _check_worker_number)
        self._check_worker_number()
        self.__initialized = True

    # torch's guards --------------------------------------------------------------------------
    @property
    def multiprocessing_context(self) -> Any:
        """The start method or context of the worker processes (None: the default)."""
        return self.__multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, multiprocessing_context: Any) -> None:
        if multiprocessing_context is not None:
            if self.num_workers == 0:
                raise ValueError(
                    "multiprocessing_context can only be used with "
                    "multi-process loading (num_workers > 0), but got "
                    f"num_workers={self.num_workers}"
                )
            multiprocessing_context = resolve_context(multiprocessing_context)
        self.__multiprocessing_context = multiprocessing_context

    def _context(self) -> Any:
        return self.multiprocessing_context or default_context()

    def __setattr__(self, attr: str, val: Any) -> None:
        if self.__initialized and attr in _FROZEN:
            raise ValueError(
                f"{attr} attribute should not be set after {self.__class__.__name__} is "
                "initialized"
            )
        if attr == "generator" and self.__initialized:
            # As torch's: later epochs draw their base seeds from the new generator (the
            # sampler keeps the one it was built with).
            super().__setattr__("_rng", as_generator(val))
        super().__setattr__(attr, val)

    @property
    def _auto_collation(self) -> bool:
        return self._kind.auto_collation

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation else self.sampler

    def _epoch_samples(self) -> int | None:
        """The samples of one epoch, the base of a fractional failure budget: the sampler's
        length (map-style), the dataset's, or None when unknown."""
        if isinstance(self.max_failures, int):
            return None
        for sized in (self.sampler, self.dataset):
            try:
                return len(sized)
            except TypeError:
                continue
        return None

    def trace(self, path: str | os.PathLike[str], max_events: int = 1_000_000) -> Trace:
        """Record the per-stage timings of the epochs that start from now on, and write them
        to ``path`` as a Chrome trace (JSON: open it in https://ui.perfetto.dev or
        ``chrome://tracing``) when the returned :class:`~aloader.Trace` stops: at the end of
        a ``with`` block (``with loader.trace("epoch.json"): ...``) or at its ``stop()``.
        See :mod:`aloader._trace`."""
        return Trace(self, path, max_events)

    def stats(self) -> LoaderStats:
        """A snapshot of the statistics of the current or last epoch, with its verdict.

        Per stage (sampling, fetch, collate, transfer from workers, the consumer's wait and its
        own time): count, busy time, latency percentiles; fetches in flight and batches ready
        against their limits; items, batches, failures, items/s; and ``bottleneck``, the
        limiting stage in one sentence with the change that would help. See
        :mod:`aloader._stats`. Before the first epoch, a snapshot with nothing counted.
        """
        collector = self._stats if self._stats is not None else Collector()
        return collector.snapshot()

    def __len__(self) -> int:
        """Batches in one epoch, by torch's rules (computed at each call)."""
        return self._kind.length()

    # Iteration -------------------------------------------------------------------------------
    def __aiter__(self) -> AsyncDataLoaderIter[T_co]:
        self._check_worker_number()
        iterator = AsyncDataLoaderIter(self)
        self._iterators.add(iterator)
        return iterator

    def __iter__(self) -> DataLoaderIter[T_co]:
        forbid_running_loop("DataLoader", "batch in loader")
        return DataLoaderIter(self)

    def _check_worker_number(self) -> None:
        """torch's warning when a loader is built with more workers than there are CPUs, at
        the user's line; once per loader (torch warns again at each epoch, at lines of its
        own, which Python's filter then shows once each): again at an epoch only after
        ``num_workers`` was changed."""
        workers = self.num_workers
        if workers == 0 or workers == self._warned_workers:
            return
        self._warned_workers = workers
        warn_worker_number(workers)

    async def aclose(self) -> None:
        """Stop every epoch in progress and wait until their fetches have ended; stop workers.

        This includes epochs whose iterator was already dropped (``break``), which stop on
        their own but may still be winding down. After a ``timeout`` fired in an epoch, a fetch
        of it still stuck in a thread is abandoned rather than awaited: the thread is left
        running and its result discarded. The event loop of ``for`` epochs is closed too (see
        :meth:`close`).
        """
        for iterator in list(self._iterators):
            iterator._shutdown()
        while self._epochs:
            epoch = self._epochs.pop()
            epoch.stop()
            if epoch.loop_thread != threading.get_ident():
                continue  # a `for` epoch, on the private loop: closing that loop waits for it
            with anyio.CancelScope(shield=True):
                await epoch.done.wait()
        self._close_rest()

    def close(self) -> None:
        """Stop every epoch and the workers, and close the event loop of ``for`` epochs.

        The synchronous counterpart of :meth:`aclose`: it waits until the ``for`` epochs' fetches
        have ended (abandoning, after a ``timeout`` fired, a fetch stuck in a thread: the
        thread is left running and its result discarded). Epochs consumed with ``async for``
        on another event loop are told to stop, not awaited: use :meth:`aclose` there. A later
        epoch starts afresh (a new event loop for ``for``, new persistent workers).
        """
        for iterator in list(self._iterators):
            iterator._shutdown()
        for epoch in self._epochs:
            epoch.stop()
        self._close_rest()
        self._epochs = {e for e in self._epochs if not e.done.is_set()}

    def _close_rest(self) -> None:
        if self._sync_loop_close is not None:
            self._sync_loop_close()  # waits for the `for` epochs, which are cancelled
        if self._pool is not None:  # persistent workers
            self._pool.shutdown()
            self._pool = None

    async def __aenter__(self) -> DataLoader[T_co]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # Checkpoints (aloader.loader._checkpoint) ------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of where the consumer is: JSON builtins (``json`` and ``pickle`` take
        it), without sample data, costing well under a millisecond whatever the dataset.

        Callable at any point: during an epoch (``async for`` or ``for``) it describes the
        batches the consumer has received, never those prefetched; after an epoch's last batch
        and between epochs, the start of the next epoch. Resume with :meth:`load_state_dict` on
        a loader built with the same arguments (``num_workers`` may differ; so may a
        DistributedSampler's world size, see :class:`DistributedSampler`).

        The state: ``{"format": "aloader.DataLoader", "version": 1, "kind": "map" or
        "iterable", "epoch": E, "yielded": K, "loader": {...}, "map" or "iterable": {...}}``:
        the epoch (the loader's epoch count, :attr:`WorkerInfo.epoch`), the batches received
        in it, the loader generator's state when the epoch started (a numpy bit generator's
        state; a torch generator's bytes as ints), the base seed when it was not drawn
        (persistent workers keep theirs), :attr:`sample_seed`, and what the epoch kind records
        (map-style: the index sampler's ``state_dict()`` at the epoch's start, and the batches
        received beyond the contiguous prefix). The epoch's order is not stored: a resume
        draws it again from those states. ``"failures": {"count": N, "indices": [...]}``: with
        ``max_failures``, the failures absorbed so far in the epoch and (map-style) their
        indices; a resumed epoch's budget continues from them and leaves those samples out
        unfetched (see :mod:`aloader.pipeline._failures`). Zero and empty between epochs and
        without a
        budget.

        With ``generator=None`` the loader's draws come from fresh entropy (torch's global
        generator when torch is imported): the state records that generator's state, and
        :meth:`load_state_dict` sets it (torch's global generator included).
        """
        return state_of(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict`: the next epoch (``async for`` or ``for``) yields
        the rest of the interrupted one, and every later epoch is the uninterrupted run's.

        Everything is checked before anything is applied. Any ``num_workers`` resumes any
        state exactly: map-style, the same remaining batches; an iterable dataset's epoch
        saved with ``W`` workers is finished by its ``W`` saved replicas, each seeing the
        ``WorkerInfo`` it was saved with (several per worker, or all in this process with
        ``num_workers=0``), in the saved run's batch order, and the later epochs are split by
        the new count. A stream's state taken during an epoch resumes only on the same rank
        of the same world size (``ValueError`` naming ``'world'``); between epochs, on any.
        The states of a job's ranks merged by :func:`aloader.merge_rank_states` load on
        every rank of any world size, each taking its part of the interrupted epoch.

        Every number is checked against the dataset where it can be without reading it: a
        map-style epoch's batches received against the epoch's length, a shard's position
        against the shard (its identity: a file's size and modification time, a remote
        object's size and ETag; its offset). What only reading can check (a shard with fewer
        records than the position skips) raises ``ValueError`` naming the field when the
        resumed epoch reaches it: never a shorter epoch.

        Raises:
            ValueError: the state is of another format or version, another kind of dataset,
                another dataset length, batch size or ``drop_last`` (the message names the
                field and both values), a field is missing, has the wrong type (that error is
                a ``TypeError`` too) or a number that does not fit the dataset, or the state
                does not fit the samplers; its ``failures`` has more indices than its count,
                or indices for an iterable dataset; a shard changed since the state was
                saved (naming the shard); merged states that cannot be split over this world
                size (see :func:`aloader.merge_rank_states`).
        """
        if isinstance(state, Mapping) and state.get("format") == RANKS_FORMAT:
            state = rank_part(self, state)  # the ranks' states merged: this rank's part
        load_state(self, state)

    def _started(self, epoch: Epoch) -> None:
        """``epoch`` has started: its statistics are the loader's latest, and closing the
        loader stops it."""
        self._stats_epochs += 1
        self._stats = epoch.plan.stats
        self._epochs = {e for e in self._epochs if not e.done.is_set()}
        self._epochs.add(epoch)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dataset={self.dataset!r}, batch_size={self.batch_size}, "
            f"num_workers={self.num_workers})"
        )


class AsyncDataLoaderIter(Generic[T_co]):
    """One epoch of a :class:`DataLoader`, consumed with ``async for`` (``loader.__aiter__()``).

    The background pipeline (``aloader.pipeline._epoch``) holds no reference to this object, so
    dropping it (``break``, an exception in the loop body) lets ``__del__`` cancel every fetch
    at once; ``aclose()`` does the same and waits until they have ended.

    Attributes:
        rng_state: the state of the loader's generator when this epoch started.
        base_seed: this epoch's ``base_seed`` (the workers' seeds are ``base_seed + id``).
        num_yielded: batches delivered so far.
        failures: the epoch's failure budget and record (``count``, ``indices`` of the failed
            samples, the last ``errors``), or None without ``max_failures``.
    """

    # Until __init__ completes: an epoch whose making raised (a sampler's __len__) has
    # nothing to stop, and its __del__ must not look for what was never set.
    _closed = True

    def __init__(self, loader: DataLoader[T_co]) -> None:
        self._loader = loader
        # Explicit epoch state, so that a resume can restore it: the RNG state this epoch
        # started from, the base seed it drew, and the batches yielded so far.
        self.epoch: int = loader._epochs_started
        loader._epochs_started = self.epoch + 1
        kind = loader._kind
        if isinstance(kind, MapEpochs):
            kind.begin(loader.num_workers)  # what the epoch is drawn from, before it draws
            if loader.num_workers > 0 and not workers_live(loader):
                kind.new_workers()  # before the base seed's draw, as torch's __init__
        self.rng_state: Mapping[str, Any] = loader._rng.bit_generator.state
        start = rng_state(loader._rng)
        base_seed, drawn = epoch_seed(loader)
        self.base_seed: int = base_seed
        self._skip = loader._resume_skip or AlreadyDelivered(0)
        self._resumed_failures = loader._resume_failures
        loader._resume_skip = loader._resume_failures = None
        loader._resume_state = None
        self._record = loader._record = _EpochRecord(
            self.epoch, start, None if drawn else self.base_seed,
            kind.epoch_length() if isinstance(kind, MapEpochs) else None, self._skip,
            on_done=None if isinstance(kind, MapEpochs) else kind.ended,
        )
        # Batches of the epoch delivered so far, those before a resume included (torch's
        # iterator's count, which its length warning compares).
        self.num_yielded: int = self._record.yielded
        self._first = self.num_yielded + 1  # the number of this run's first batch
        # Under the synchronous facade's pump, which runs ahead of its consumer, a batch counts
        # as received only once the consumer takes it: its receipt (batch number, metadata)
        # travels with it (_Receipts), and DataLoaderIter records it.
        self._deferred = False
        self._receipt: tuple[int, Any] = (0, None)
        self._last_meta: Any = None  # the metadata of the batch handed out last (iterable)
        self._ended = False  # the epoch's last batch was handed out
        # The epoch's failure budget and record (None without max_failures).
        self.failures: Failures | None = None
        self._stats: Collector | None = None  # the epoch's statistics, from its start
        self._timeout = loader.timeout
        self._len_called = loader._kind.reported_length()
        self._keys: Iterator[Any] | AsyncIterator[Any] | None = None  # see _draw
        # Where the consumer's calls tell the epoch's sampler how far torch's would have been
        # asked (see _advance), and those calls so far.
        self._asked: Callable[[int], None] | None = None
        self._calls = 0
        if loader.num_workers > 0 and isinstance(kind, MapEpochs):
            self._draw()  # where torch's iterator with workers draws it: at iter()
        self._epoch: Epoch | None = None
        self._closed = False

    def __len__(self) -> int:
        """The loader's ``len()``, as torch's iterators answer (code sizes a progress bar by it)."""
        return len(self._loader)

    def __aiter__(self) -> AsyncDataLoaderIter[T_co]:
        return self

    def _start_here(self) -> bool:
        """Start the epoch now, on this thread, when it needs no event loop at all, and say
        whether it did: an inline epoch (an in-memory dataset without workers, see
        :attr:`~aloader.pipeline._epoch.MapEpoch.loopless`) with plain keys and collate and no
        ``timeout`` never awaits a real event, so the sync facade drives :meth:`__anext__`
        on the consumer's thread. An inline epoch starts no task, so one started here whose
        keys turn out to be async still runs on an event loop (the caller's choice). So does
        an iterable epoch over a loopless stream (local files: see
        :meth:`~aloader.loader._epochs.IterableEpochs.loopless`), batched and collated on the
        consumer's call (:class:`~aloader.loader._epochs.InlineIterableEpoch`)."""
        loader = self._loader
        kind = loader._kind
        if self._epoch is not None or self._timeout > 0 or loader.num_workers > 0:
            return False
        if isinstance(kind, IterableEpochs):
            if not kind.loopless(loader.collate_fn):
                return False
            self._epoch = start_epoch(self, here=True)
            return True
        if fetch_plan(loader, None, here=True).mode != "inline":  # the plan decides, as in _start
            return False
        epoch = self._epoch = start_epoch(self, here=True)
        return isinstance(epoch, MapEpoch) and epoch.loopless

    def _draw(self, plan: FetchPlan | None = None) -> Iterator[Any] | AsyncIterator[Any]:
        """A map-style epoch's keys, drawn from its sampler now, once: by the consumer, at the
        point torch's iterator draws them (:class:`DataLoaderIter`), whichever thread later
        runs the epoch; a loader's generator is drawn from in the consumer's order, not as a
        background loop gets to it (two loaders sharing one generator, side by side)."""
        keys = self._keys
        if keys is None:
            kind = self._loader._kind
            assert isinstance(kind, MapEpochs)
            kind.resume = self._skip  # taken by keys()
            resumed = self._resumed_failures
            if resumed is not None and resumed[1]:
                kind.known_failed = KnownFailed(resumed[1], kind.auto_collation)
            keys = self._keys = kind.keys(lambda: key_lead(self, plan))
            self._asked = kind.asked
            if self._asked is not None:
                # Torch's iterator asks here: at iter() with workers, prefetching; at the first
                # next() without.
                self._asked(max(1, self._ahead()))
        return keys

    def _ahead(self) -> int:
        """The batches torch's iterator asks its sampler for ahead of its consumer: with
        workers ``prefetch_factor`` per worker at ``iter()``, one more at each ``next()``."""
        loader = self._loader
        return loader.prefetch_factor * loader.num_workers if loader.num_workers else 0

    def _advance(self) -> None:
        """A consumer's call for the next batch: an epoch drawn as torch's sampler draws it
        (:class:`aloader.data._sampler.TorchDraws`) draws what torch's would have drawn by this
        call (the epoch's empty tail permutation at the call that ends it without workers),
        whatever the pipeline has read ahead. Called where the consumer calls: by
        :meth:`__anext__`, or by :class:`DataLoaderIter` when a pump runs ahead of it."""
        self._calls += 1
        if self._asked is not None:
            self._asked(self._calls + self._ahead())

    async def __anext__(self) -> T_co:
        if self._closed:
            raise StopAsyncIteration
        epoch = self._epoch
        if epoch is None:
            epoch = self._epoch = start_epoch(self)
        if not self._deferred:
            self._advance()
        asked = _now()
        stats = self._stats
        assert stats is not None
        try:
            if self._timeout > 0:
                try:
                    with anyio.fail_after(self._timeout):
                        value, error = await epoch.next()
                except TimeoutError:
                    # A fetch stuck in a thread must not make closing the epoch hang too.
                    epoch.abandon_threads()
                    raise LoaderTimeoutError(
                        f"DataLoader timed out after {self._timeout} seconds"
                    ) from None
            else:
                value, error = await epoch.next()
        except StopAsyncIteration:
            # Hand back control only once the pipeline's tasks have all returned.
            self._closed = True
            self._ended = True
            if not self._deferred:
                self._record.finish()
            stats.asked_again(asked)
            stats.ended = _now()
            if not epoch.done.is_set():  # an inline epoch's is, and may run with no loop
                await epoch.done.wait()
            if self.failures is not None:
                self.failures.finish()  # a fraction of samples counted as they came
            raise
        except BaseException as exc:
            # Cancelled: the consumer is gone, stop fetching for it. (Asked only on a loop:
            # a loopless epoch's KeyboardInterrupt comes here with none running.)
            if current_backend() is not None and isinstance(exc, anyio.get_cancelled_exc_class()):
                self._shutdown()
            raise
        if error is not None:
            if isinstance(error, FailureBudgetExceeded):
                self._shutdown()  # the budget is spent: the epoch ends here
            if (isinstance(error, RuntimeError) and str(error).endswith(" raised StopIteration")
                    and isinstance(error.__cause__, StopIteration)):
                # PEP 479's conversion, where the error crossed a coroutine (from a worker):
                # reported as the dataset's own StopIteration, workers or not.
                error = error.__cause__
            if isinstance(error, (StopIteration, StopAsyncIteration)):
                # Raised as is, it would end the epoch silently and lose the rest.
                raise RuntimeError(
                    f"the dataset raised {type(error).__name__} while loading a batch"
                ) from error
            raise error
        results = epoch.results
        meta = self._last_meta = results.meta  # an iterable's position after this batch
        number = self._skip.global_number(results.last)
        if self._deferred:
            self._receipt = (number, meta)
        else:
            self._record.received(number, meta)
        yielded = self.num_yielded = self.num_yielded + 1
        now = _now()
        stats.delivered(asked, now, results.left)
        if yielded == self._first and now - stats.started > SLOW_FIRST_BATCH * 1e9:
            loader_log.warning("the first batch took %.1f s (a cold start, or a stall: "
                               "see DataLoader.stats())", (now - stats.started) / 1e9)
        if self._len_called is not None and not self._deferred:
            self._warn_length(yielded)  # (the pump's batches: when DataLoaderIter hands them)
        batch: T_co = value  # typed by assignment: a cast() is a call per batch
        return batch

    def _warn_length(self, handed: int) -> None:
        """torch's warning, in the consumer's call that receives batch number ``handed`` (from
        1) of an iterable's epoch, past the dataset's ``len()`` read before the epoch began
        (only an iterable's epoch may outrun its length), at the consumer's line."""
        length = self._len_called
        if length is not None and handed > length:
            warnings.warn(
                f"Length of IterableDataset {self._loader.dataset} was reported to be {length}"
                f"(when accessing len(dataloader)), but {handed} samples have been "
                "fetched. " + (
                    "For multiprocessing data-loading, this could be caused by not properly "
                    "configuring the IterableDataset replica at each worker. Please see "
                    "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                    "for examples." if self._loader.num_workers > 0 else ""),
                stacklevel=user_stacklevel(),
            )

    @property
    def failed_indices(self) -> list[Any]:
        """The indices of the samples that failed within the failure budget, in the order
        they failed (the samples' numbers for an iterable dataset, None for a record a source
        skipped); empty without ``max_failures``."""
        return [] if self.failures is None else list(self.failures.indices)

    def _shutdown(self) -> None:
        self._closed = True
        if self._stats is not None and self._stats.ended is None:
            self._stats.ended = _now()
        if self._epoch is not None:
            self._epoch.stop()

    async def aclose(self) -> None:
        """Stop this epoch and wait until every fetch has ended.

        After a ``timeout`` fired, a fetch stuck in a thread is abandoned rather than awaited:
        the thread is left running and its result discarded.
        """
        self._shutdown()
        if self._epoch is not None and not self._epoch.done.is_set():
            with anyio.CancelScope(shield=True):
                await self._epoch.done.wait()

    def __del__(self) -> None:
        if not self._closed:
            self._shutdown()


class _Receipts:
    """An epoch's batches with their receipts (batch number, metadata), for the sync facade's
    pump: a batch and its receipt cross to the consumer's thread as one item, so that a
    consumer's ``next()`` interrupted after taking it (a KeyboardInterrupt) loses both, and
    the receipts of later batches stay theirs."""

    def __init__(self, source: AsyncDataLoaderIter[Any]) -> None:
        source._deferred = True  # before the pump asks for the first batch
        self.source = source

    def __aiter__(self) -> _Receipts:
        return self

    async def __anext__(self) -> tuple[Any, tuple[int, Any]]:
        batch = await self.source.__anext__()
        return batch, self.source._receipt

    async def aclose(self) -> None:
        await self.source.aclose()


class DataLoaderIter(Iterator[T_co]):
    """One epoch of a :class:`DataLoader` for synchronous code (``iter(loader)``).

    An epoch that needs no event loop (an in-memory dataset without workers, or a loopless
    stream's such as ``TextLines`` over local files, batched and collated on the consumer's
    call: see :meth:`AsyncDataLoaderIter._start_here`) runs its :class:`AsyncDataLoaderIter`
    on the consumer's thread; any other runs it on the loader's private event loop, which fetches
    ahead of the consumer (see :mod:`aloader._facade`). Leaving the ``for`` early or
    :meth:`close` stops the epoch.
    """

    def __init__(self, loader: DataLoader[T_co]) -> None:
        self._loader = loader
        source = loader.__aiter__()  # binds to no loop: made here, whichever runs it
        self._source: AsyncDataLoaderIter[T_co] = source
        # Composition, not inheritance: the facade's iterators are private machinery. Opened
        # where torch's iterator draws its sampler's epoch: at the first next() without
        # workers, here with them (see AsyncDataLoaderIter._draw); an iterable dataset's
        # here, where torch's calls its iter() (a state taken before the first batch is
        # then its iterator's, as torchdata's).
        self._sync: LocalIterator[Any] | SyncIterator[Any] | None = None
        self._closed = False
        # Batches handed to the consumer (the pump runs ahead of them), a resumed epoch's
        # before the resume included (torch's count, which its length warning compares).
        self._handed = source._record.yielded
        if loader.num_workers > 0 or isinstance(loader._kind, IterableEpochs):
            self._open()

    def _open(self) -> LocalIterator[Any] | SyncIterator[Any]:
        """The iterator that runs the epoch, made now (on the consumer's thread)."""
        sync = self._sync
        if sync is None:
            source = self._source
            if source._start_here():
                sync = LocalIterator(source)
            else:
                if isinstance(self._loader._kind, MapEpochs):
                    source._draw()  # here, not on the loop (see _draw)
                receipts = _Receipts(source)
                sync = SyncIterator(lambda: receipts, loop_of(self._loader))
            self._sync = sync
        return sync

    def __iter__(self) -> DataLoaderIter[T_co]:
        return self

    def __len__(self) -> int:
        """The loader's ``len()``, as torch's iterators answer."""
        return len(self._source)

    def __next__(self) -> T_co:
        sync = self._sync
        if sync is None:
            if self._closed:
                raise StopIteration
            sync = self._open()
        if not isinstance(sync, LocalIterator) and not self._closed:
            self._source._advance()  # the pump runs ahead of this call
        try:
            item = next(sync)
        except StopIteration:
            if self._source._ended:  # every batch before the end was received
                self._source._record.finish()
            raise
        if isinstance(sync, LocalIterator):
            return cast(T_co, item)  # the source recorded it: nothing runs ahead here
        value, receipt = item  # only a batch, not an error, has a receipt
        source = self._source
        source._record.received(*receipt)
        self._handed += 1
        if source._len_called is not None:
            source._warn_length(self._handed)
        return cast(T_co, value)

    def close(self) -> None:
        """Stop the epoch and wait until it has stopped (see :meth:`DataLoader.aclose`)."""
        self._closed = True
        if self._sync is not None:
            self._sync.close()

    @property
    def num_yielded(self) -> int:
        """Batches delivered so far in this epoch (those before a resume included): taken
        by this consumer, not run ahead by the event loop."""
        return self._source._record.yielded

    @property
    def failed_indices(self) -> list[Any]:
        """See :attr:`AsyncDataLoaderIter.failed_indices`."""
        return self._source.failed_indices
