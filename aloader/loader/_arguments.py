"""torch's checks of a DataLoader's arguments, with torch's messages: how it loads
(workers, timeout, prefetching, concurrency, the failure budget) and how it batches (shuffle,
sampler, batch sampler, batch size, drop_last), and torch's warning about more workers than
CPUs.

Invariant: every check runs, in torch's order, before the loader keeps anything of its
arguments, so that a bad argument raises torch's exception type and message at construction.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

from .._util import usable_cpus, user_stacklevel
from ..pipeline._failures import check_max_failures

__all__ = ("DEFAULT_PREFETCH_FACTOR", "check_batching", "check_loading", "warn_worker_number")

DEFAULT_PREFETCH_FACTOR = 2


def check_process_limit(num_workers: int) -> None:
    """Refuse more workers than this user may run processes (``ulimit -u``): starting them
    would fail only after creating as many as the system allows, one by one (torch only
    warns, then does that)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    limit = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if limit != resource.RLIM_INFINITY and num_workers > limit:
        raise ValueError(
            f"num_workers={num_workers} is more worker processes than this user may run "
            f"(RLIMIT_NPROC, `ulimit -u`: {limit})"
        )


def check_loading(num_workers: int, timeout: float, prefetch_factor: int | None,
                  persistent_workers: bool, max_concurrency: int | None,
                  max_failures: int | float) -> tuple[int, int | float]:
    """Check how a loader loads; returns its ``prefetch_factor`` (the default for None) and
    its ``max_failures``, checked."""
    if num_workers < 0:
        raise ValueError(
            "num_workers option should be non-negative; "
            "use num_workers=0 to disable multiprocessing."
        )
    # torch raises these (its range() calls) at the first iteration; here, at once.
    operator.index(num_workers)
    check_process_limit(num_workers)
    if timeout < 0:
        raise ValueError("timeout option should be non-negative")
    # Unlike torch, prefetch_factor means something without workers (the loop prefetches).
    if prefetch_factor is None:
        prefetch_factor = DEFAULT_PREFETCH_FACTOR
    elif prefetch_factor < 0:
        raise ValueError("prefetch_factor option should be non-negative")
    else:
        operator.index(prefetch_factor)
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    if max_concurrency is not None and (
        isinstance(max_concurrency, bool)
        or not isinstance(max_concurrency, int)
        or max_concurrency <= 0
    ):
        raise ValueError(
            "max_concurrency should be a positive integer or None, "
            f"but got max_concurrency={max_concurrency!r}"
        )
    return prefetch_factor, check_max_failures(max_failures)


def check_batching(iterable: bool, batch_size: int | None, shuffle: bool | None, sampler: Any,
                   batch_sampler: Any, drop_last: bool
                   ) -> tuple[int | None, bool | None, bool]:
    """Check how a loader over an ``iterable`` dataset (or a map-style one) batches; returns
    its ``batch_size`` (None with a batch sampler), ``shuffle`` and ``drop_last``."""
    if iterable:
        if shuffle not in {False, None}:
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified shuffle option, "
                f"but got shuffle={shuffle}"
            )
        if sampler is not None:
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified sampler option, "
                f"but got sampler={sampler}"
            )
        if batch_sampler is not None:
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified batch_sampler "
                f"option, but got batch_sampler={batch_sampler}"
            )
    else:
        shuffle = bool(shuffle)

    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")

    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive "
                "with batch_size, shuffle, sampler, and "
                "drop_last"
            )
        batch_size = None
        drop_last = False
    elif batch_size is None and drop_last:
        raise ValueError(
            "batch_size=None option disables auto-batching "
            "and is mutually exclusive with drop_last"
        )
    return batch_size, shuffle, drop_last


def warn_worker_number(workers: int) -> None:
    """torch's warning when a loader is built, or an epoch is to start, with more workers than
    there are CPUs, blaming the user's line (the construction, or the ``for`` /
    ``async for``)."""
    cpus, cpuset = usable_cpus()
    if cpus is not None and workers <= cpus:
        return
    if cpus is None:
        suggestion = ("DataLoader is not able to compute a suggested max number of worker "
                      "in current system.")
    else:
        suggestion = (f"Our suggested max number of worker in current system is {cpus}"
                      f"{'' if cpuset else ' (`cpuset` is not taken into account)'}, which "
                      "is smaller than what this DataLoader is going to create.")
    warnings.warn(
        f"This DataLoader will create {workers} worker processes in total. {suggestion} "
        "Please be aware that excessive worker creation might get DataLoader running slow "
        "or even freeze, lower the worker number to avoid potential slowness/freeze if "
        "necessary.",
        stacklevel=user_stacklevel(),
    )
