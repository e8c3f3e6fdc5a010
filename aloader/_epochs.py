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
``serve`` (what the workers run) and ``pool_epoch`` (the remote's kind); and for checkpoints
(:meth:`DataLoader.state_dict`), ``state_dict(progress)`` and ``load_state_dict(sub)``, given
the consumer's :class:`Progress`.

Map-style resume: the order of an epoch is never stored. The loader records, when each epoch
starts, what the epoch is drawn from (its generator's state; the index sampler's
``state_dict()``, torchdata's protocol, which aloader's samplers implement), and the consumer's
progress: the batches received, as a contiguous prefix and the batch numbers received beyond it
(``in_order=False``). A resume restores those states, draws the same epoch again and leaves out
the batches received: an array-backed sampler drops them by slicing its index chunks (no
fetch, no per-batch work); any other sampler is fast-forwarded by drawing and discarding them
(torchdata's way: it costs the sampler's iteration over them, never a fetch).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias, cast

from ._dataset import iterate
from ._distributed import DistributedSampler
from ._pipeline import Epoch, FetchPlan, IterableEpoch, MapEpoch, Results
from ._pool import MapPoolEpoch, PoolEpoch, ReplicaPoolEpoch
from ._sampler import (
    BatchSampler,
    epoch_batches,
    epoch_indices,
    load_sampler_state,
    sampler_state,
)
from ._worker import ServeReplica, ServeTasks

__all__ = ("EpochKind", "IterableEpochs", "MapEpochs", "Progress", "Skip")


@dataclass(frozen=True)
class Progress:
    """How far the consumer is in the epoch a checkpoint describes.

    Attributes:
        epoch: the loader's epoch number the state is in.
        yielded: batches the consumer received in it.
        delivered: batch numbers received beyond the contiguous prefix (``in_order=False``,
            or after a batch that raised); empty otherwise. The prefix is
            ``yielded - len(delivered)`` batches long.
        batch_meta: the metadata that came with the last batch received, or None.
        epoch_done: the state is at an epoch boundary (after an epoch ended, or before the
            first): the kind records its current state, not the epoch's starting one.
    """

    epoch: int
    yielded: int
    delivered: frozenset[int] = field(default_factory=frozenset)
    batch_meta: Any = None
    epoch_done: bool = False


@dataclass(frozen=True)
class Skip:
    """The batches a resumed map-style epoch leaves out: its first ``prefix`` ones and those
    numbered in ``delivered``."""

    prefix: int
    delivered: frozenset[int] = field(default_factory=frozenset)

    def global_number(self, seq: int) -> int:
        """The epoch's batch number of the resumed pipeline's job ``seq``."""
        number = self.prefix + seq
        for done in sorted(self.delivered):
            if done <= number:
                number += 1
            else:
                break
        return number


def _without(keys: Iterator[Any], skip: Skip) -> Iterator[Any]:
    for number, key in enumerate(keys, skip.prefix):
        if number not in skip.delivered:
            yield key


async def _askip(keys: AsyncIterator[Any], skip: Skip) -> AsyncIterator[Any]:
    number = 0
    async for key in keys:
        if number >= skip.prefix and number not in skip.delivered:
            yield key
        number += 1


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
        # What the latest epoch was drawn from (taken by begin()), and the next epoch's skip.
        self._start_state: Any = None
        self.resume: Skip | None = None
        self.loaded_skip: Skip | None = None

    # Checkpoints ---------------------------------------------------------------------------
    def begin(self) -> None:
        """An epoch starts (before anything of it is drawn): record what it is drawn from."""
        self._start_state = sampler_state(self.index_sampler)

    def epoch_length(self) -> int | None:
        """Batches in the next epoch, or None when the index sampler has no length."""
        try:
            return len(self.index_sampler)
        except TypeError:
            return None

    def state_dict(self, progress: Progress) -> dict[str, Any]:
        """The ``"map"`` part of a checkpoint: the index sampler's state the epoch is drawn
        from, and the batches received beyond the prefix."""
        sampler = sampler_state(self.index_sampler) if progress.epoch_done else (
            self._start_state
        )
        delivered = sorted(progress.delivered)
        return {"sampler": sampler, "delivered": delivered,
                "prefix": progress.yielded - len(delivered)}

    def _distributed(self) -> DistributedSampler | None:
        sampler = self.index_sampler
        if self.auto_collation:
            if type(sampler) is not BatchSampler:
                return None
            sampler = sampler.sampler
        return sampler if isinstance(sampler, DistributedSampler) else None

    def load_state_dict(self, sub: Any) -> None:
        """Check and apply the ``"map"`` part of a checkpoint (never half-applied by aloader's
        samplers); the skip of the next epoch is left in :attr:`loaded_skip`.

        Raises:
            ValueError, TypeError: the state is malformed or does not fit this loader.
        """
        if not isinstance(sub, dict):
            raise TypeError(f"state['map'] should be a dict, but got {type(sub).__name__}")
        prefix = sub.get("prefix")
        delivered = sub.get("delivered")
        if not isinstance(prefix, int) or isinstance(prefix, bool) or prefix < 0:
            raise TypeError(f"state['map']['prefix'] should be a non-negative int, "
                            f"but got {prefix!r}")
        if not isinstance(delivered, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > prefix for d in delivered
        ):
            raise TypeError("state['map']['delivered'] should be a list of batch numbers "
                            f"after the prefix ({prefix}), but got {delivered!r}")
        state = sub.get("sampler")
        load_sampler_state(self.index_sampler, state, apply=False)
        skip = Skip(prefix, frozenset(delivered))
        distributed = self._distributed()
        inner = state.get("sampler") if self.auto_collation and isinstance(state, dict) else (
            state
        )
        elastic = (
            distributed is not None and isinstance(inner, dict)
            and inner.get("num_replicas") != distributed.num_replicas
        )
        load_sampler_state(self.index_sampler, state)
        if elastic:
            assert distributed is not None and isinstance(inner, dict)
            size = cast(BatchSampler, self.index_sampler).batch_size if self.auto_collation else 1
            distributed._resume_elastic(
                inner, prefix * size, [[d * size, (d + 1) * size] for d in sorted(delivered)]
            )
            skip = Skip(0)
        self.loaded_skip = skip

    def length(self) -> int:
        """Batches (indices without auto-batching) in one epoch: the index sampler's length."""
        return len(self.index_sampler)

    def reported_length(self) -> int | None:
        """A map-style epoch yields exactly its length: nothing to warn about."""
        return None

    def keys(self) -> Iterator[Any] | AsyncIterator[Any]:
        """This epoch's keys: index batches, or indices without auto-batching; a resumed
        epoch's (:attr:`resume`, consumed here) without the batches already received."""
        skip, self.resume = self.resume, None
        if skip is None or (skip.prefix == 0 and not skip.delivered):
            return self._keys(0)
        keys = self._keys(skip.prefix)
        if not skip.delivered:
            return keys
        if isinstance(keys, AsyncIterator):
            return _askip(keys, Skip(0, frozenset(d - skip.prefix for d in skip.delivered)))
        return _without(keys, skip)

    def _keys(self, skip: int) -> Iterator[Any] | AsyncIterator[Any]:
        """The keys after the first ``skip`` (left out by slicing where the sampler has an
        array form; else drawn and discarded, except by an async iterator: see keys())."""
        sampler = self.index_sampler
        if self.auto_collation:
            batches = epoch_batches(sampler, skip)
            if batches is not None:
                return batches
        else:
            indices = epoch_indices(sampler)
            if indices is not None:
                return iter(cast(list[Any], indices[skip:].tolist()))
        if skip and type(sampler) is BatchSampler:
            after = sampler._batches_after(skip)
            if after is not None:
                return after
        # Async samplers (and batch samplers over them) are walked with async iteration.
        aiter_ = getattr(sampler, "__aiter__", None)
        if aiter_ is not None:
            keys = cast(AsyncIterator[Any], aiter_())
            return keys if not skip else _askip(keys, Skip(skip))
        return itertools.islice(cast(Iterator[Any], iter(sampler)), skip, None)

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
