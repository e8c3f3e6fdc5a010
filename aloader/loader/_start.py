"""How a :class:`~aloader.loader._dataloader.DataLoader`'s epoch starts: its plan, its setup,
and workers or not.

Invariants: what an epoch needs is decided as it starts, once, from the loader as it is then
(``num_workers``, ``max_failures`` or ``generator`` may change between epochs): one
:class:`~aloader._epoch_setup.EpochSetup` (:func:`epoch_setup`) builds the epoch's statistics
and failure budget through its :class:`~aloader.pipeline._plan.FetchPlan` (:func:`fetch_plan`,
which :meth:`FetchPlan.for_dataset` decides for the loader and its worker processes alike), and
:func:`start_epoch` runs it here or on the workers. A map-style epoch's keys are drawn once, by
the iterator (:meth:`~aloader.loader._dataloader.AsyncDataLoaderIter._draw`), as far ahead of
the consumer as :func:`key_lead` says. The worker processes (:func:`pool_epoch`): a persistent
pool serves an epoch only while it is healthy and its workers' failure budget (none, or the
unlimited one they report under) matches the loader's ``max_failures``; otherwise it is
restarted (a free one) or the epoch gets workers of its own (a busy one).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .._epoch_setup import EpochSetup
from .._log import worker_log
from .._stats import Collector
from .._tuning import DEFAULT_MAX_LIMIT
from ..data._random import draw_seed
from ..pipeline._epoch import Epoch
from ..pipeline._failures import Failures
from ..pipeline._plan import FetchPlan
from ..pipeline._results import Results
from ..streams._sourcestats import source_stats
from ..streams._stream import Stream
from ..workers._context import prepare_context
from ..workers._pool_epoch import PoolEpoch
from ..workers._processes import WorkerPool
from ..workers._worker import WorkerSetup
from ._epochs import IterableEpochs, MapEpochs
from ._pin_memory import _pin_memory_transform

if TYPE_CHECKING:
    from ._dataloader import AsyncDataLoaderIter, DataLoader

__all__ = ("claim_epoch", "epoch_seed", "epoch_setup", "fetch_plan", "key_lead", "pool_epoch",
           "start_epoch", "workers_live")


def fetch_plan(loader: DataLoader[Any], transform: Callable[[Any], Any] | None,
               remote: PoolEpoch | None = None, setup: EpochSetup | None = None,
               here: bool = False) -> FetchPlan:
    """The plan of an epoch in this process (or a worker's), or whose jobs go to ``remote``;
    ``setup``: the epoch it is for, which its statistics and failure budget are built from
    too (None: a plan asked what it would decide, or the workers'); ``here``: one on the
    sync ``for``'s own thread (see :meth:`FetchPlan.for_dataset`). ``"auto"`` concurrency's
    controller is the first epoch's, kept by the loader for the later ones (a checkpoint's
    state loaded into it when it is made)."""
    plan = FetchPlan.for_dataset(
        loader.dataset,
        iterable=isinstance(loader._kind, IterableEpochs),
        auto_batch=loader._auto_collation,
        collate_fn=loader.collate_fn,
        batch_size=loader.batch_size,
        max_concurrency=loader.max_concurrency,
        transform=transform,
        remote=remote,
        num_workers=loader.num_workers,
        prefetch_factor=loader.prefetch_factor,
        seed=None if isinstance(loader._kind, IterableEpochs) else loader.sample_seed,
        setup=setup,
        here=here,
        max_concurrency_limit=loader.max_concurrency_limit or DEFAULT_MAX_LIMIT,
        tuner=loader._tuner,
        hedge_after=loader.hedge_after,
    )
    if plan.tuner is not None and plan.tuner is not loader._tuner:
        loader._tuner = plan.tuner  # the first epoch's: later ones go on with it
        if loader._tuner_state is not None:
            plan.tuner.load_state_dict(loader._tuner_state)
            loader._tuner_state = None
            plan.window = plan.tuned_window()
    return plan


def claim_epoch(loader: DataLoader[Any], count: int) -> int:
    """Epoch ``count``'s number, as the workers see it (:attr:`WorkerInfo.epoch`).

    A stream claims it from its own copy as iterating it here would (so its counter
    advances, and ``set_epoch`` holds); other datasets get the loader's epoch count.
    """
    if isinstance(loader.dataset, Stream):
        return loader.dataset._claim_epoch()
    return count


def workers_live(loader: DataLoader[Any]) -> bool:
    """Whether persistent workers from an earlier epoch are alive to serve the next."""
    pool = loader._pool
    return pool is not None and not (pool.closed or pool.broken)


def epoch_seed(loader: DataLoader[Any]) -> tuple[int, bool]:
    """The next epoch's ``base_seed``, and whether it was drawn: drawn from the generator,
    except by an epoch that the live persistent workers will serve, which keep their first
    epoch's seeds; torch resets its one iterator then and draws nothing, so the sampler's
    draws stay torch's. A run resumed from persistent workers' epoch keeps their seed."""
    pool = loader._pool
    if pool is not None and workers_live(loader):
        return int(pool.setup.base_seed), False
    if loader._resume_seed is not None:
        return loader._resume_seed, False
    return draw_seed(loader._rng), True


def key_lead(it: AsyncDataLoaderIter[Any], plan: FetchPlan | None) -> int | None:
    """How far ahead of torch's count a user's sampler is drawn (see
    :class:`aloader.pipeline._keys.PacedKeys`), or None to draw it as the pipeline reads it.

    With workers 0: torch's schedule exactly. Without, an epoch in this process reads
    its keys on the consumer's call when it is inline (torch's schedule, nothing ahead);
    one fetching ahead (threads, an async dataset) gets keys for two windows of jobs
    and the batches that may wait for the consumer: always the same count, so what the
    sampler draws interleaves with the consumer's own draws in one order, run after run.
    None with a failure budget (see :meth:`aloader.loader._epochs.MapEpochs.keys`)."""
    loader = it._loader
    if loader.max_failures:
        return None
    if loader.num_workers > 0:
        return 0
    if plan is None:
        plan = fetch_plan(loader, None)
    if plan.mode == "inline":
        return 0
    return 2 * plan.window + max(1, loader.prefetch_factor)


def epoch_setup(it: AsyncDataLoaderIter[Any]) -> EpochSetup:
    """What the iterator's epoch is built from, decided as it starts (see
    :class:`~aloader._epoch_setup.EpochSetup`)."""
    loader = it._loader
    resumed = it._resumed_failures  # the budget goes on where the checkpoint left it
    return EpochSetup(
        epoch=it.epoch,
        base_seed=it.base_seed,
        kind="iterable" if isinstance(loader._kind, IterableEpochs) else "map",
        num_workers=loader.num_workers,
        prefetch_factor=loader.prefetch_factor,
        stats_epoch=loader._stats_epochs,
        max_failures=loader.max_failures,
        samples=loader._epoch_samples() if loader.max_failures else None,
        resumed_failures=None if resumed is None else (resumed[0], tuple(resumed[1])),
        sources=tuple(source_stats(loader.dataset)),
        sources_of=source_stats,
        in_order=loader.in_order,
    )


def start_epoch(it: AsyncDataLoaderIter[Any], here: bool = False) -> Epoch:
    """Start the iterator's epoch (with ``here``, an iterable one on the consumer's call: see
    :meth:`~aloader.loader._dataloader.AsyncDataLoaderIter._start_here`): its plan, and
    through it its statistics and failure budget, are built from one :func:`epoch_setup`."""
    loader = it._loader
    kind = loader._kind
    results = Results(loader.prefetch_factor, loader.in_order)
    transform = _pin_memory_transform(loader)
    setup = epoch_setup(it)
    # Workers or not: decided here, once per epoch (num_workers may change between epochs).
    epoch: Epoch
    if loader.num_workers > 0:
        # The batches the consumer took (the sync facade's pump runs ahead of it).
        record, before = it._record, it._record.yielded
        remote = pool_epoch(loader, it.base_seed, claim_epoch(loader, it.epoch),
                            lambda: record.yielded - before)
        plan = fetch_plan(loader, transform, remote, setup)
        epoch = (kind.on_workers(plan, results, remote, it._draw())
                 if isinstance(kind, MapEpochs) else kind.on_workers(plan, results, remote))
    else:
        plan = fetch_plan(loader, transform, setup=setup, here=here)
        epoch = (kind.local(plan, results, it._draw(plan)) if isinstance(kind, MapEpochs)
                 else kind.local(plan, results, here=here, base_seed=it.base_seed))
    # The iterator's own view of its epoch; the record (what a checkpoint says of the
    # epoch, which the iterator keeps up to date) holds the budget for state_dict().
    it.failures = it._record.failures = epoch.plan.failures
    it._stats = epoch.plan.stats
    if loader._trace is not None:
        loader._trace._attach(it._stats)
    epoch.start()
    loader._started(epoch)
    return epoch


def pool_epoch(loader: DataLoader[Any], base_seed: int, epoch: int,
               taken: Callable[[], int]) -> PoolEpoch:
    """This epoch's use of the worker processes: the persistent pool when it is free;
    ``taken`` counts the batches the consumer has taken."""
    pool = loader._pool
    if pool is not None and (pool.closed or pool.broken):
        if pool.broken:
            worker_log.warning("restarting the persistent workers after an earlier error")
        pool.shutdown()
        pool = loader._pool = None
    # The workers' budget (none, or the unlimited one they report under) is fixed at their
    # start: a budget turned on or off between epochs needs other workers (a free pool is
    # restarted, keeping its seed; a busy one is left to its epoch).
    stale = pool is not None and (pool.setup.plan.failures is None) == bool(
        loader.max_failures)
    if pool is not None and stale and pool.holder is None:
        worker_log.info("restarting the persistent workers: max_failures is now %r",
                        loader.max_failures)
        pool.shutdown()
        pool = loader._pool = None
    if pool is not None and not stale and (pool.holder is None or pool.holder.stopping):
        return loader._kind.pool_epoch(pool, epoch, taken)
    plan = fetch_plan(loader, None)
    # The workers' own statistics of the items they fetch, and (with a budget) an unlimited
    # budget they report their failures under: the epoch's budget is counted here.
    plan = replace(plan, stats=Collector(plan.mode, auto_batch=plan.auto_batch),
                   failures=Failures(math.inf, sources_of=source_stats)
                   if loader.max_failures else None)
    # A second epoch while the persistent pool serves a live one gets workers of its own.
    persistent = loader.persistent_workers and pool is None
    rngs, loader._resume_rngs = loader._resume_rngs, None
    setup = WorkerSetup(
        plan=plan,
        serve=loader._kind.serve,
        base_seed=base_seed,
        num_workers=loader.num_workers,
        worker_init_fn=loader.worker_init_fn,
        prefetch=loader.prefetch_factor,
        preludes=loader._kind.take_preludes(),
        persistent=persistent,
        rngs=rngs if persistent else None,
    )
    context = loader._context()
    prepare_context(context, warm=False)
    pool = WorkerPool(setup, context, persistent=persistent)
    if persistent:
        loader._pool = pool
        weakref.finalize(loader, pool.shutdown)
    return loader._kind.pool_epoch(pool, epoch, taken)
