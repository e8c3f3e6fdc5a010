"""The two kinds of a DataLoader's epochs: over a map-style dataset, over an iterable one.

This module owns what differs between them, so that the loader asks rather than branches. The
loader picks the kind once, when it is built, with the arguments that kind needs:

* :class:`MapEpochs`: keys from the index sampler (torch's ``_index_sampler``: the batch
  sampler with auto-batching, else the sampler), fetched by the plan in this process
  (:class:`~aloader._pipeline.MapEpoch`) or sent to the workers in turn
  (:class:`~aloader._pool.MapPoolEpoch`, served by :class:`~aloader._worker.ServeTasks`);
* :class:`IterableEpochs`: samples from the dataset's iterator cut into batches here
  (:class:`~aloader._pipeline.IterableEpoch`), or each worker's replica batched there
  (:class:`~aloader._worker.ServeReplica`) and asked for its next batch in turn
  (:class:`~aloader._pool.ReplicaPoolEpoch`).

Both answer the same questions: ``auto_collation``, ``length()`` (torch's ``len(loader)``),
``reported_length()``, ``local(plan, results)``, ``on_workers(plan, results, remote)``,
``serve`` (what the workers run) and ``pool_epoch`` (the remote's kind).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar, TypeAlias, cast

from ._dataset import iterate
from ._pipeline import Epoch, FetchPlan, IterableEpoch, MapEpoch, Results
from ._pool import MapPoolEpoch, PoolEpoch, ReplicaPoolEpoch
from ._sampler import epoch_batches, epoch_indices
from ._worker import ServeReplica, ServeTasks

__all__ = ("EpochKind", "IterableEpochs", "MapEpochs")


class MapEpochs:
    """The epochs of a loader over a map-style dataset.

    Args:
        sampler: the loader's sampler (indices).
        batch_sampler: the loader's batch sampler (index batches), or None without
            auto-batching.
    """

    pool_epoch: ClassVar[type[PoolEpoch]] = MapPoolEpoch

    def __init__(self, sampler: Any, batch_sampler: Any) -> None:
        self.auto_collation = batch_sampler is not None
        self.index_sampler = batch_sampler if self.auto_collation else sampler
        self.serve = ServeTasks()

    def length(self) -> int:
        """Batches (indices without auto-batching) in one epoch: the index sampler's length."""
        return len(self.index_sampler)

    def reported_length(self) -> int | None:
        """A map-style epoch yields exactly its length: nothing to warn about."""
        return None

    def keys(self) -> Iterator[Any] | AsyncIterator[Any]:
        """This epoch's keys: index batches, or indices without auto-batching."""
        sampler = self.index_sampler
        if self.auto_collation:
            batches = epoch_batches(sampler)
            if batches is not None:
                return batches
        else:
            indices = epoch_indices(sampler)
            if indices is not None:
                return iter(cast(list[Any], indices.tolist()))
        # Async samplers (and batch samplers over them) are walked with async iteration.
        aiter_ = getattr(sampler, "__aiter__", None)
        if aiter_ is not None:
            return cast(AsyncIterator[Any], aiter_())
        return cast(Iterator[Any], iter(sampler))

    def local(self, plan: FetchPlan, results: Results) -> Epoch:
        """An epoch fetched in this process."""
        return MapEpoch(plan, results, self.keys())

    def on_workers(self, plan: FetchPlan, results: Results, remote: PoolEpoch) -> Epoch:
        """An epoch whose keys go to the workers (``remote`` is a :class:`MapPoolEpoch`)."""
        return MapEpoch(plan, results, self.keys())


class IterableEpochs:
    """The epochs of a loader over an iterable dataset.

    Args:
        dataset: the iterable dataset.
        batch_size: samples per batch, or None without auto-batching.
        drop_last: drop the last incomplete batch (of each worker's replica, with workers).
    """

    pool_epoch: ClassVar[type[PoolEpoch]] = ReplicaPoolEpoch

    def __init__(self, dataset: Any, batch_size: int | None, drop_last: bool) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.auto_collation = batch_size is not None
        self.serve = ServeReplica(batch_size, drop_last)
        self._len_called: int | None = None

    def length(self) -> int:
        """torch's length of an iterable loader: the dataset's length in batches.

        The dataset's own length is remembered, so that an epoch that yields more warns
        (:meth:`reported_length`).
        """
        length = len(self.dataset)
        self._len_called = length
        if self.batch_size is not None:
            length = length // self.batch_size if self.drop_last else math.ceil(
                length / self.batch_size
            )
        return length

    def reported_length(self) -> int | None:
        """The dataset's length as the latest ``len(loader)`` read it, or None if never."""
        return self._len_called

    def local(self, plan: FetchPlan, results: Results) -> Epoch:
        """An epoch iterating the dataset in this process."""
        return IterableEpoch(plan, results, iterate(self.dataset), self.batch_size,
                             self.drop_last)

    def on_workers(self, plan: FetchPlan, results: Results, remote: PoolEpoch) -> Epoch:
        """An epoch asking the workers' replicas for batches (``remote`` is a
        :class:`ReplicaPoolEpoch`, whose requests are the jobs' keys)."""
        assert isinstance(remote, ReplicaPoolEpoch)
        return MapEpoch(plan, results, remote.keys())


EpochKind: TypeAlias = MapEpochs | IterableEpochs
