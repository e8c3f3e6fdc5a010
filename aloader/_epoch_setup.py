"""What one epoch of a loader is built from: :class:`EpochSetup`, one value decided when the
epoch starts.

The epoch's parts are each constructed from it: the fetch plan
(:meth:`aloader.pipeline._plan.FetchPlan.for_dataset`), and through the plan the failure budget
(:meth:`aloader.pipeline._failures.Failures.for_epoch`) and the statistics
(:meth:`aloader._stats.Collector.for_epoch`). No part of an epoch is wired afterwards by
assigning into another's fields.

Invariant: a setup never changes once built (frozen); what changes as the epoch runs (the
failures counted, the batches delivered) lives in the parts built from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ("EpochSetup",)


@dataclass(frozen=True)
class EpochSetup:
    """The facts one epoch of a loader is built from.

    Attributes:
        epoch: the loader's epoch number (:func:`aloader.sample_rng`'s, ``WorkerInfo.epoch``).
        base_seed: the epoch's base seed (worker ``i`` seeds with ``base_seed + i``).
        kind: ``"map"`` (a map-style dataset) or ``"iterable"``.
        num_workers: worker processes (0: the epoch fetches in this process).
        prefetch_factor: the batches that may wait for the consumer.
        stats_epoch: the epoch's number among the loader's statistics.
        max_failures: the failure budget (see :mod:`aloader.pipeline._failures`); 0: none.
        samples: the epoch's samples when known (a fractional budget's base), else None.
        resumed_failures: ``(count, indices)`` of the failures a checkpoint recorded in the
            epoch it resumes, or None.
        sources: the dataset's streams' counters (:class:`aloader.SourceStats`).
        sources_of: finds the counters of a dataset's streams (the failure budget watches them).
        in_order: whether batches are delivered in the sampler's order.
    """

    epoch: int
    base_seed: int
    kind: Literal["map", "iterable"]
    num_workers: int
    prefetch_factor: int
    stats_epoch: int = 0
    max_failures: int | float = 0
    samples: int | None = None
    resumed_failures: tuple[int, tuple[Any, ...]] | None = None
    sources: tuple[Any, ...] = ()
    sources_of: Callable[[object], list[Any]] | None = None
    in_order: bool = True
