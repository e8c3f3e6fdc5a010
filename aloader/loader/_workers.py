"""A loader's worker processes: each epoch's use of them, and the persistent pool that serves
several epochs.

Invariant: a persistent pool serves an epoch only while it is healthy and its workers' failure
budget (none, or the unlimited one they report under) matches the loader's ``max_failures``;
otherwise it is restarted (a free one) or the epoch gets workers of its own (a busy one).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .._log import worker_log
from .._stats import Collector
from ..pipeline._failures import Failures
from ..streams._sourcestats import source_stats
from ..workers._context import prepare_context
from ..workers._pool_epoch import PoolEpoch
from ..workers._processes import WorkerPool
from ..workers._worker import WorkerSetup

if TYPE_CHECKING:
    from ._dataloader import DataLoader

__all__ = ("pool_epoch",)


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
    plan = loader._plan(None)
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
