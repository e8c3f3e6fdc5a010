"""The two kinds of a DataLoader's epochs: over a map-style dataset, over an iterable one.

This module owns what differs between them, so that the loader asks rather than branches. The
loader picks the kind once, when it is built, with the arguments that kind needs:

* :class:`MapEpochs`: keys from the index sampler (torch's ``_index_sampler``: the batch
  sampler with auto-batching, else the sampler), fetched by the plan in this process
  (:class:`~aloader.pipeline._epoch.MapEpoch`) or sent to the workers in turn
  (:class:`~aloader.workers._pool_epoch.MapPoolEpoch`, served by
  :class:`~aloader.workers._worker.ServeTasks`);
* :class:`IterableEpochs`: samples from the dataset's iterator cut into batches here
  (:class:`~aloader.pipeline._epoch.IterableEpoch`; a loopless stream's on the consumer's call,
  :class:`InlineIterableEpoch`), or each worker's replica batched there
  (:class:`~aloader.workers._worker.ServeReplica`) and asked for its next batch in turn
  (:class:`~aloader.workers._pool_epoch.ReplicaPoolEpoch`).

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

import contextlib
import itertools
import math
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias, cast

import anyio

from .._facade import run_here
from .._util import ataken, close_iterator, is_async_callable, taken
from .._workerinfo import WorkerInfo, as_replica
from ..data._batchsampler import BatchSampler, epoch_batches, torch_epoch
from ..data._dataset import aiter_of
from ..data._distributed import DistributedSampler
from ..data._indices import _owner, epoch_indices
from ..data._sampler import load_sampler_state, sampler_state
from ..pipeline._epoch import _NO_LIMITER, Epoch, IterableEpoch, MapEpoch
from ..pipeline._errors import _batch_error
from ..pipeline._failures import KnownFailed
from ..pipeline._keys import PacedKeys
from ..pipeline._plan import FetchPlan
from ..pipeline._pull import _NOTHING
from ..pipeline._results import Results
from ..streams._positions import check_field
from ..streams._resume import (
    adopt_world,
    encode,
    open_replica,
    parse,
    prelude,
    protocol_state,
    saved_world,
    snapshotter,
    start_snapshot,
)
from ..streams._runtime import _StreamIterator
from ..streams._stream import Stream
from ..workers._pool_epoch import Delivered, MapPoolEpoch, PoolEpoch, ReplicaPoolEpoch
from ..workers._worker import ServeReplica, ServeTasks, replica_copy
from ._datasetstate import DatasetStates

__all__ = ("AlreadyDelivered", "EpochKind", "InlineIterableEpoch", "IterableEpochs", "MapEpochs",
           "Progress", "StateTypeError", "VirtualReplicas")


class StateTypeError(ValueError, TypeError):
    """A checkpoint field of the wrong type: a ``ValueError`` as every state that does not fit
    the loader (a tampered or truncated one included), and a ``TypeError`` as it was."""


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
class AlreadyDelivered:
    """The batches a resumed map-style epoch leaves out: its first ``prefix`` ones and those
    numbered in ``delivered``."""

    prefix: int
    delivered: frozenset[int] = field(default_factory=frozenset)

    def global_number(self, seq: int) -> int:
        """The epoch's batch number of the resumed pipeline's job ``seq``."""
        number = self.prefix + seq
        if not self.delivered:  # every epoch but a resumed one's: no sort per batch
            return number
        for done in sorted(self.delivered):
            if done <= number:
                number += 1
            else:
                break
        return number


def _checked_progress(ranks: Any, sampler: Any) -> list[tuple[int | None, list[int]]] | None:
    """A map part's ``"ranks"`` (each saved rank's ``[prefix, delivered]``, prefix None for
    all of its batches: the part a rank of another world size takes of merged states),
    checked against the saved sampler state (``sampler``; None when the world is the same,
    where it must be absent)."""
    if ranks is None:
        return None
    where = "cannot load this state: field 'map.ranks'"
    if sampler is None:
        raise ValueError(f"{where} is for a DistributedSampler on another world size")
    if not (isinstance(ranks, list) and len(ranks) == sampler.get("num_replicas")):
        raise ValueError(f"{where} should list the {sampler.get('num_replicas')} saved ranks' "
                         f"progress, but is {ranks!r}")
    out: list[tuple[int | None, list[int]]] = []
    for entry in ranks:
        ok = isinstance(entry, list) and len(entry) == 2
        prefix, done = (entry[0], entry[1]) if ok else (None, None)
        if not ok or not (prefix is None or (type(prefix) is int and prefix >= 0)) \
                or not isinstance(done, list) or not all(
                    type(d) is int and prefix is not None and d > prefix for d in done):
            raise ValueError(f"{where} holds {entry!r}, not [batches received (None: all), "
                             "batch numbers received beyond them]")
        out.append((prefix, list(done)))
    return out


def _without(keys: Iterator[Any], skip: AlreadyDelivered) -> Iterator[Any]:
    for number, key in enumerate(keys, skip.prefix):
        if number not in skip.delivered:
            yield key


async def _askip(keys: AsyncIterator[Any], skip: AlreadyDelivered) -> AsyncIterator[Any]:
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
        dataset: the loader's dataset, whose own state (torchdata's protocol) checkpoints
            keep (:class:`~aloader.loader._datasetstate.DatasetStates`).
    """

    pool_epoch: ClassVar[type[PoolEpoch]] = MapPoolEpoch

    def __init__(self, sampler: Any, batch_sampler: Any, dataset: Any = None) -> None:
        self.datasets = DatasetStates(dataset)
        self.auto_collation = batch_sampler is not None
        self.index_sampler = batch_sampler if self.auto_collation else sampler
        self.serve = ServeTasks()
        # What the latest epoch was drawn from (taken by begin()), and the next epoch's skip.
        self._start_state: Any = None
        self.resume: AlreadyDelivered | None = None
        # A resumed epoch's failed samples, left out of its keys (see aloader.pipeline._failures).
        self.known_failed: KnownFailed | None = None
        self.loaded_skip: AlreadyDelivered | None = None
        # Set by keys(): where the consumer tells an epoch drawn as torch's sampler draws it
        # (aloader.data._sampler.TorchDraws), or drawn on its calls
        # (aloader.pipeline._keys.PacedKeys),
        # how many keys torch's loader would have asked for; else None.
        self.asked: Callable[[int], None] | None = None
        self._generic = False  # see _keys
        self._first = 0  # the epoch's batch number of its first key (a resumed epoch's)

    # Checkpoints ---------------------------------------------------------------------------
    def begin(self, num_workers: int = 0) -> None:
        """An epoch starts (before anything of it is drawn): record what it is drawn from,
        and where the dataset's copies start (``num_workers`` of them, or the loader's)."""
        self._start_state = sampler_state(self.index_sampler)
        self.datasets.epoch_begins(num_workers)

    def new_workers(self) -> None:
        """An epoch starts new workers: what torch's iterator does then before its epoch,
        ``iter()`` of the index sampler once, dropped (its ``__init__`` takes one, its
        ``_reset`` the epoch's). A user's sampler whose ``__iter__`` draws at once (a new
        order from the global generator, a count of epochs) draws once more, as under torch,
        so its orders are torch's. aloader's own samplers and the builtin sequences draw
        nothing until iterated (as torch's, whose ``__iter__`` are generators): left alone."""
        sampler = self.index_sampler
        owner = _owner(type(sampler), "__iter__")
        if owner is None or owner.__module__.split(".")[0] in ("aloader", "builtins"):
            return
        if aiter_of(sampler) is None:
            iter(sampler)

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
                "prefix": progress.yielded - len(delivered),
                "datasets": self.datasets.entry(progress.batch_meta, progress.epoch_done)}

    def _distributed(self) -> DistributedSampler | None:
        sampler = self.index_sampler
        if self.auto_collation:
            if type(sampler) is not BatchSampler:
                return None
            sampler = sampler.sampler
        return sampler if isinstance(sampler, DistributedSampler) else None

    def load_state_dict(self, sub: Any, num_workers: int = 0) -> None:
        """Check and apply the ``"map"`` part of a checkpoint (never half-applied by aloader's
        samplers) for a loader with ``num_workers``; the skip of the next epoch is left in
        :attr:`loaded_skip`.

        Raises:
            ValueError, TypeError: the state is malformed or does not fit this loader.
        """
        if not isinstance(sub, dict):
            raise StateTypeError(f"state['map'] should be a dict, but got {type(sub).__name__}")
        prefix = sub.get("prefix")
        delivered = sub.get("delivered")
        if not isinstance(prefix, int) or isinstance(prefix, bool) or prefix < 0:
            raise StateTypeError(f"state['map']['prefix'] should be a non-negative int, "
                            f"but got {prefix!r}")
        if not isinstance(delivered, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > prefix for d in delivered
        ):
            raise StateTypeError("state['map']['delivered'] should be a list of batch numbers "
                            f"after the prefix ({prefix}), but got {delivered!r}")
        state = sub.get("sampler")
        load_sampler_state(self.index_sampler, state, apply=False)
        datasets = self.datasets.check(sub.get("datasets"), num_workers)
        skip = AlreadyDelivered(prefix, frozenset(delivered))
        distributed = self._distributed()
        inner = state.get("sampler") if self.auto_collation and isinstance(state, dict) else (
            state
        )
        elastic = (
            distributed is not None and isinstance(inner, dict)
            and inner.get("num_replicas") != distributed.num_replicas
        )
        length = self.epoch_length()
        if length is not None and not elastic and (
                prefix > length or any(d >= length for d in delivered)):
            raise ValueError(f"state['map'] says {prefix + len(delivered)} batches were "
                             f"received (field 'prefix' {prefix}, 'delivered' {delivered}), "
                             f"past this loader's epoch of {length} batches")
        ranks = _checked_progress(sub.get("ranks"), inner if elastic else None)
        load_sampler_state(self.index_sampler, state)
        if elastic:
            assert distributed is not None and isinstance(inner, dict)
            size = cast(BatchSampler, self.index_sampler).batch_size if self.auto_collation else 1
            if ranks is None:  # one rank's state: the ranks went in lockstep
                distributed._resume_elastic(
                    inner, prefix * size,
                    [[d * size, (d + 1) * size] for d in sorted(delivered)])
            else:  # each rank's own progress (aloader.loader._ranks)
                distributed._resume_elastic(
                    inner, [None if p is None else p * size for p, _ in ranks],
                    [[d * size, (d + 1) * size, r] for r, (_, done) in enumerate(ranks)
                     for d in done])
            skip = AlreadyDelivered(0)
        self.loaded_skip = skip
        self.datasets.apply(datasets, num_workers)

    def take_preludes(self) -> list[Any] | None:
        """The dataset states the workers about to start load first (a loaded state's)."""
        return self.datasets.take_preludes()

    def length(self) -> int:
        """Batches (indices without auto-batching) in one epoch: the index sampler's length."""
        return len(self.index_sampler)

    def reported_length(self) -> int | None:
        """A map-style epoch yields exactly its length: nothing to warn about."""
        return None

    def keys(self, lead: Callable[[], int | None] = lambda: None
             ) -> Iterator[Any] | AsyncIterator[Any]:
        """This epoch's keys: index batches, or indices without auto-batching; a resumed
        epoch's (:attr:`resume`, consumed here) without the batches already received, and
        without the samples that failed before the checkpoint (:attr:`known_failed`).

        Where ``lead()`` is not None (asked only then), keys of a sampler without an array
        form (a user's) are drawn only as the consumer asks
        (:class:`~aloader.pipeline._keys.PacedKeys`, ``lead()`` ahead of torch's count;
        :attr:`asked` is its ``reach``). Never with a failure budget: a batch whose samples
        all failed is passed over within one consumer call, whose next key would then never
        be asked for."""
        known, self.known_failed = self.known_failed, None
        self.asked = None
        self._generic = False
        keys = self._resumed_keys()
        if known is not None:
            return cast("Iterator[Any] | AsyncIterator[Any]", known.keys(keys))
        if self.asked is not None or not self._generic or not isinstance(keys, Iterator):
            return keys
        ahead = lead()
        if ahead is None:
            return keys
        paced = PacedKeys(keys, ahead)
        self.asked = paced.reach
        return paced

    def _resumed_keys(self) -> Iterator[Any] | AsyncIterator[Any]:
        skip, self.resume = self.resume, None
        self._first = 0 if skip is None else skip.prefix
        if skip is None or (skip.prefix == 0 and not skip.delivered):
            # Only a whole epoch is drawn as torch's is: a resumed one has no torch twin.
            lazy = torch_epoch(self.index_sampler, self.auto_collation)
            if lazy is not None:
                torch_keys, self.asked = lazy
                return torch_keys
            return self._keys(0)
        keys = self._keys(skip.prefix)
        if not skip.delivered:
            return keys
        if isinstance(keys, AsyncIterator):
            return _askip(keys, AlreadyDelivered(
                0, frozenset(d - skip.prefix for d in skip.delivered)))
        return _without(keys, skip)

    def _keys(self, skip: int) -> Iterator[Any] | AsyncIterator[Any]:
        """The keys after the first ``skip`` (left out by slicing where the sampler has an
        array form; else drawn and discarded, except by an async iterator: see keys()).
        Sets :attr:`_generic`: whether they are the sampler's own iteration (no array form)."""
        sampler = self.index_sampler
        self._generic = False
        if self.auto_collation:
            batches = epoch_batches(sampler, skip)
            if batches is not None:
                return batches
        else:
            indices = epoch_indices(sampler)
            if indices is not None:
                return iter(cast(list[Any], indices[skip:].tolist()))
        self._generic = True
        if type(sampler) is BatchSampler:  # over a sync sampler: sync keys (no loop needed)
            after = sampler._batches_after(skip)
            if after is not None:
                return after
        # Async samplers (and batch samplers over them) are walked with async iteration.
        aiter_ = getattr(sampler, "__aiter__", None)
        if aiter_ is not None:
            # Taken once: every loop over them (skips, failure filters) is over this.
            keys = ataken(cast(AsyncIterator[Any], aiter_()))
            return keys if not skip else _askip(keys, AlreadyDelivered(skip))
        return itertools.islice(taken(cast(Iterator[Any], iter(sampler))), skip, None)

    def local(self, plan: FetchPlan, results: Results, keys: Iterator[Any] | AsyncIterator[Any]
              ) -> Epoch:
        """An epoch fetched in this process, of ``keys`` (:meth:`keys`)."""
        datasets = self.datasets
        datasets.local()
        datasets.after_keys()
        if datasets.stateful:  # the dataset's state travels with each batch
            results.metas = {}
            results.snapshot = lambda: ("local", datasets.own())
        return MapEpoch(plan, results, keys)

    def on_workers(self, plan: FetchPlan, results: Results, remote: PoolEpoch,
                   keys: Iterator[Any] | AsyncIterator[Any]) -> Epoch:
        """An epoch whose ``keys`` go to the workers (``remote`` is a :class:`MapPoolEpoch`)."""
        assert isinstance(remote, MapPoolEpoch)
        remote.shift = self._first % remote.pool.num_workers  # batch k: worker k % n
        datasets = self.datasets
        if datasets.stateful:  # each worker's state travels with its batches
            begin = datasets.begin
            remote.delivered = Delivered(
                [None] * remote.pool.num_workers if begin is None else list(begin["states"]), 0)
            results.metas = remote.delivered
        datasets.on_workers(remote)
        return MapEpoch(plan, results, remote.keys(keys))


class IterableEpochs:
    """The epochs of a loader over an iterable dataset.

    Resume (:meth:`state_dict`, :meth:`load_state_dict`): each batch carries where its
    replica was once its samples were drawn (:mod:`aloader.streams._resume`); the state holds the
    position after the last batch the consumer received, of every worker's replica with
    workers, and the worker asked next. It resumes exactly with any ``num_workers``: with the
    same count each worker resumes its replica; with another, the rest of the saved epoch is
    made by the saved run's replicas as *virtual replicas* (each a copy of the dataset that
    sees the ``WorkerInfo`` and worker slot it was saved with, resumed from its position and
    batched on its own, the batches taken in the saved turn): in this process
    (:class:`VirtualReplicas`) without workers, else replica ``r`` on worker
    ``r % num_workers`` (:class:`~aloader.workers._pool_epoch.ReplicaPoolEpoch`). The epochs
    after it are split by the new count. A state taken between epochs needs nothing of this.

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

    def loopless(self, collate_fn: Any) -> bool:
        """Whether an epoch in this process (:meth:`local` with ``here``) can run with no event
        loop at all: a loopless stream's (:meth:`Stream._loopless`: local files, no task) or
        a plain iterable dataset's (``__iter__``: pulled on the consumer's call, as torch's
        loader without workers does, so what it draws from the global random generators is
        drawn in the consumer's order), collated by a plain ``collate_fn``, and not the
        saved replicas of a run with workers."""
        dataset, pending = self.dataset, self._pending
        plain = dataset._loopless() if isinstance(dataset, Stream) else aiter_of(dataset) is None
        return (plain and (pending is None or (pending["num_workers"] == 0
                                                 and pending["lanes"] is None))
                and not is_async_callable(collate_fn))

    def local(self, plan: FetchPlan, results: Results, *, here: bool = False,
              base_seed: int = 0) -> Epoch:
        """An epoch iterating the dataset in this process (from a loaded state, if any; one
        saved with workers runs its replicas here, see :class:`VirtualReplicas`, which see
        the seeds of the workers they stand for: ``base_seed + id``); with ``here`` (only
        where :meth:`loopless` says so), one made on the consumer's call with no event loop
        (:class:`InlineIterableEpoch`)."""
        pending = self._pending
        if pending is not None and (pending["num_workers"] > 0 or pending["lanes"] is not None):
            return self._virtual_local(plan, results, pending, base_seed)
        parsed = None if pending is None else parse(self.dataset, pending["replicas"][0], (0, 1))
        source, snapshot = open_replica(self.dataset, parsed)
        self._holder = ("local", source)
        self._began(snapshot(0, False), plan.epoch)
        if here:
            return InlineIterableEpoch(plan, results, self.dataset, source, self._begin,
                                       self.batch_size, self.drop_last, snapshot)
        return IterableEpoch(plan, results, source, self.batch_size, self.drop_last, snapshot)

    def _virtual_local(self, plan: FetchPlan, results: Results, pending: dict[str, Any],
                       base_seed: int) -> Epoch:
        count, turn, states = pending["num_workers"], pending["turn"], pending["replicas"]
        dataset = self.dataset
        # The epoch the saved workers served: a stream's own copy claims it (as when its
        # workers iterate it), other datasets count the loader's epochs.
        epoch = dataset._claim_epoch() if isinstance(dataset, Stream) else plan.epoch
        slots = _slots(pending)
        begin = self._begin_of(states, epoch, count, slots)
        lanes = []
        for (w, seed), state in zip(slots, states, strict=True):
            replica = replica_copy(dataset)
            adopt_world(replica, state)  # a replica of another rank: on that rank's shards
            info = None if count == 0 else WorkerInfo(
                id=w, num_workers=count, seed=base_seed + w if seed is None else seed,
                dataset=replica)
            lanes.append(_Lane(replica, parse(replica, state, (w, count) if count else (0, 1)),
                               info, epoch if count else None))
        self._began(("workers", tuple(begin), turn), plan.epoch, pending)
        self._holder = None  # the replicas are copies: the loader's own is as it was
        return VirtualReplicas(plan, results, lanes, turn, begin, self.batch_size,
                               self.drop_last)

    def _begin_of(self, states: list[Any], epoch: int, count: int,
                  slots: list[tuple[int, int | None]]) -> list[Any]:
        """The replicas' snapshots until they deliver (``count`` 0: the loader's one)."""
        return [("encoded", state) if state is not None else
                start_snapshot(self.dataset, epoch, (w, count) if count else (0, 1))
                for (w, _), state in zip(slots, states, strict=True)]

    def on_workers(self, plan: FetchPlan, results: Results, remote: PoolEpoch) -> Epoch:
        """An epoch asking the workers' replicas for batches (``remote`` is a
        :class:`ReplicaPoolEpoch`, whose requests are the jobs' keys); one saved with another
        ``num_workers`` runs the saved replicas on the workers (virtual replicas)."""
        assert isinstance(remote, ReplicaPoolEpoch)
        count = remote.pool.num_workers
        pending = self._pending
        saved = count if pending is None else pending["num_workers"]
        turn = 0 if pending is None else pending["turn"]
        states = [None] * count if pending is None else pending["replicas"]
        named = None if pending is None else pending["lanes"]
        slots: list[tuple[int, int | None]] = (
            _slots(pending) if pending is not None else [(w, None) for w in range(count)])
        begin = self._begin_of(states, remote.loader_epoch, saved, slots)
        remote.resume(turn, states, begin,
                      None if saved == count and named is None else saved, named)
        # torch's workers after a break, for what torch runs: a plain iterable, from its start
        # (a stream's extra reads would count in its statistics; see ReplicaPoolEpoch).
        dataset = self.dataset
        remote.settles = (remote.pool.persistent and pending is None
                          and not isinstance(dataset, Stream) and aiter_of(dataset) is None)
        results.metas = remote.delivered
        self._holder = ("pool", remote)
        self._began(begin[0] if saved == 0 and named is None else ("workers", tuple(begin), turn),
                    plan.epoch, pending)
        return MapEpoch(plan, results, remote.keys())

    # Resume (see aloader.streams._resume)
    # ----------------------------------------------------------
    # The sub-state (the loader's "iterable" entry): {"mode": "between" | "local" | "workers",
    # "num_workers": W (0 in this process), "turn": the worker asked for the next batch,
    # "replicas": one state per replica (None: its start), "stream": the epoch counters of a
    # Stream (None for other datasets)}. "num_workers" is the count whose split the epoch's
    # replicas follow: the saved run's, also when a state is taken in an epoch resumed with
    # another count (its replicas are still the saved ones).
    #
    # "lanes" (only in a state taken during an epoch that finishes other ranks' replicas, and
    # in this rank's part of a merged state: see aloader.loader._ranks): which saved replicas
    # the entries of "replicas" are, [worker id, base seed of its rank or None] each (None:
    # this loader's), each on the ranks its state names ("world", see
    # aloader.streams._resume.adopt_world). Without it, replica w is worker w of this rank.

    _begin: Any = None  # the snapshot of the epoch begun last, before its first batch
    _begin_epoch: int | None = None  # the loader's epoch that _begin is the start of
    # The lanes of the epoch begun last, and the ranks ("world") of each; None: this rank's.
    _lanes: list[list[Any]] | None = None
    _lanes_count = 0  # the saved run's num_workers, which the lanes' worker ids are of
    _lanes_epoch: int | None = None  # the stream's epoch they finish (for a rank with none)
    _lane_worlds: list[Any] | None = None
    _pending: dict[str, Any] | None = None  # a loaded sub-state, for the next epoch
    # Who holds the dataset's own state after the latest epoch: ("local", its iterator) for
    # the loader's copy, ("pool", the pool epoch) for workers (their replicas' final states
    # outlive the epoch when they persist), or None (the loader's copy, never iterated).
    _holder: tuple[str, Any] | None = None
    #: The between-epochs states of a loaded state for the persistent workers to start
    #: with (one per worker, encoded; see aloader.streams._resume.prelude), taken by the
    #: loader for the next pool it starts.
    worker_preludes: list[Any] | None = None

    def _began(self, begin: Any, epoch: int, pending: dict[str, Any] | None = None) -> None:
        """An epoch's replicas are open: ``begin`` is where it starts (a loaded sub-state,
        ``pending``, is spent)."""
        self._begin, self._begin_epoch = begin, epoch
        lanes = None if pending is None else pending["lanes"]
        self._lanes = lanes
        self._lanes_count = 0 if pending is None else pending["num_workers"]
        counters = None if pending is None else pending["stream"]
        self._lanes_epoch = counters.get("epoch") if isinstance(counters, dict) else None
        self._lane_worlds = None if lanes is None else [
            saved_world(state) for state in pending["replicas"]]  # type: ignore[index]
        self._pending = None

    def take_preludes(self) -> list[Any] | None:
        """The dataset states the workers about to start load first (a loaded state's)."""
        preludes, self.worker_preludes = self.worker_preludes, None
        return preludes

    def ended(self, epoch: int) -> None:
        """The consumer reached the end of the loader's epoch ``epoch``: a stream forgets what
        its workers' readings of it counted (they report them, see
        :class:`~aloader.streams._sourcestats.StatsReporter`), so that a state of that epoch
        loaded now reads it again and counts it again, as without workers."""
        readings = getattr(self.dataset, "_readings", None)
        if isinstance(self.dataset, Stream) and readings:
            for slot in [slot for slot in readings if slot != (0, 1)]:
                del readings[slot]

    def _between(self) -> tuple[int | None, list[Any] | None]:
        """The dataset's own state between epochs, as ``(num_workers, replicas)``: whose it
        is (0: the loader's copy; W: each of W persistent workers') and their encoded final
        states, loaded before the next epoch opens its iterators (torchdata keeps an ended
        worker's state so); ``(None, None)`` where there is nothing to keep (no protocol, a
        stream: its counters say it all)."""
        dataset = self.dataset
        if isinstance(dataset, Stream):
            return None, None
        holder = self._holder
        if holder is not None and holder[0] == "pool":
            remote = holder[1]
            pool = remote.pool
            finals = getattr(remote, "finals", None)
            if (pool.persistent and not (pool.closed or pool.broken) and finals is not None
                    and any(f is not None and f[0] == "protocol" for f in finals)):
                return len(finals), [encode(dataset, f) if f is not None and f[0] == "protocol"
                                     else None for f in finals]
        elif holder is not None:
            final = snapshotter(dataset, holder[1])(0, True)
            if final[0] == "protocol":
                return 0, [encode(dataset, final)]
        own = protocol_state(dataset)
        return (None, None) if own is None else (0, [encode(dataset, own)])

    def state_dict(self, progress: Any) -> dict[str, Any]:
        """The ``"iterable"`` entry of the loader's state for ``progress`` (see _loader)."""
        if self._pending is not None:
            return {key: value for key, value in self._pending.items()
                    if key != "lanes" or value is not None}
        dataset = self.dataset
        counters = dataset._state_from(None) if isinstance(dataset, Stream) else None
        meta = getattr(progress, "batch_meta", None)
        # An epoch begun (iter()) that has opened no replica yet is at its start, not at the
        # start of the epoch before it.
        begin: Any = self._begin if self._begin_epoch == progress.epoch else None
        if getattr(progress, "epoch_done", False) or (meta is None and begin is None):
            count, finals = self._between()
            return {"mode": "between", "num_workers": count, "turn": 0, "replicas": finals,
                    "stream": counters}
        if meta is None:
            meta = begin
        if meta[0] == "workers":
            _, replicas, turn = meta
            if counters is not None:
                counters["epoch"] = self._epoch_of(replicas)
            lanes = self._lanes if self._begin_epoch == progress.epoch else None
            if lanes is not None:
                worlds = self._lane_worlds
                assert worlds is not None
                if counters is not None and not replicas:  # this rank was dealt none
                    counters["epoch"] = self._lanes_epoch
                return {"mode": "workers", "num_workers": self._lanes_count, "turn": turn,
                        "replicas": [encode(dataset, r, world=world)
                                     for r, world in zip(replicas, worlds, strict=True)],
                        "lanes": [list(lane) for lane in lanes], "stream": counters}
            return {"mode": "workers", "num_workers": len(replicas), "turn": turn,
                    "replicas": [encode(dataset, r) for r in replicas], "stream": counters}
        return {"mode": "local", "num_workers": 0, "turn": 0,
                "replicas": [encode(dataset, meta)], "stream": counters}

    @staticmethod
    def _epoch_of(replicas: Any) -> int | None:
        for replica in replicas:
            if replica is not None and replica[0] == "stream":
                return int(replica[1][0])
            if replica is not None and replica[0] == "encoded":
                return int(replica[1]["state"]["epoch"])
        return None

    def load_state_dict(self, sub: dict[str, Any], num_workers: int = 0,
                        persistent: bool = False) -> None:
        """Resume from :meth:`state_dict`'s entry: validated whole, then applied, for a loader
        with ``num_workers`` (``persistent`` workers).

        A state taken between epochs may hold the dataset's own state (see
        :meth:`_between`): the loader's copy's is loaded now; each persistent worker's goes
        to the worker of the same number (:attr:`worker_preludes`), with the same
        ``num_workers`` and persistent workers; otherwise only where they are all equal
        (loaded into the loader's copy, which new workers copy).

        Raises:
            ValueError: a field of another kind of dataset or stream, or, for a stream, a
                replica state for another worker slot, or taken during an epoch on another
                rank or world size (field ``'world'``); persistent workers' differing
                dataset states for another number of workers (field ``'replicas'``).
        """
        where = "iterable"
        mode = check_field(sub, "mode", str, where)
        if mode not in ("between", "local", "workers"):
            raise ValueError(f"cannot load this state: field 'mode' is {mode!r}")
        dataset = self.dataset
        counters = check_field(sub, "stream", (dict, type(None)), where)
        if isinstance(dataset, Stream) != (counters is not None):
            raise ValueError("cannot load this state: field 'stream' does not match the "
                             f"dataset ({type(dataset).__name__})")
        main = None if counters is None else dataset._parse_state(counters, (0, 1))
        pending: dict[str, Any] | None = None
        preludes: list[Any] = []
        count: int | None = None
        if mode != "between" or check_field(sub, "replicas", (list, type(None)), where):
            count = check_field(sub, "num_workers", int, where)
            turn = check_field(sub, "turn", int, where)
            replicas = check_field(sub, "replicas", list, where)
            lanes = sub.get("lanes")
            if mode == "between":
                if len(replicas) != max(1, count) or turn or lanes is not None:
                    raise ValueError(f"cannot load this state: fields 'num_workers' ({count}), "
                                     f"'turn' ({turn}) and 'replicas' ({len(replicas)}) "
                                     "disagree")
                parsed = [parse(dataset, replica, (w, count) if count else (0, 1))
                          for w, replica in enumerate(replicas)]
                if any(p is not None and (p[0] != "protocol" or not p[-1]) for p in parsed):
                    raise ValueError("cannot load this state: field 'replicas' of a state "
                                     "between epochs holds datasets' final states only")
                preludes = parsed
                if count and not (persistent and num_workers == count) and any(
                        r != replicas[0] for r in replicas):
                    raise ValueError(
                        f"cannot load this state: field 'replicas' holds the dataset states "
                        f"of {count} persistent workers, which differ: it resumes with "
                        f"num_workers={count} and persistent_workers=True only")
            elif lanes is None:
                if len(replicas) != max(1, count) or (mode == "local") != (count == 0) \
                        or (count and turn >= count):
                    raise ValueError(f"cannot load this state: fields 'num_workers' ({count}), "
                                     f"'turn' ({turn}) and 'replicas' ({len(replicas)}) "
                                     "disagree")
                for w, replica in enumerate(replicas):
                    parse(dataset, replica, (w, count) if count else (0, 1))
            else:
                lanes = _checked_lanes(lanes, mode, count, turn, len(replicas))
                # Each replica checked on its saved ranks, in one copy put on each in turn.
                copy = replica_copy(dataset) if isinstance(dataset, Stream) else dataset
                for (w, _), replica in zip(lanes, replicas, strict=True):
                    adopt_world(copy, replica)
                    parse(copy, replica, (w, count) if count else (0, 1))
            if mode != "between":
                pending = {"mode": mode, "num_workers": count, "turn": turn,
                           "replicas": replicas, "lanes": lanes, "stream": counters}
        if main is not None and mode == "local":
            # The replica is the loader's copy itself: its counters, and the epoch under way
            # (claimed by an epoch on workers; a local one applies the whole replica state).
            replica = parse(dataset, sub["replicas"][0], (0, 1))
            if replica is not None:
                main = (*replica[1][:3], None, *replica[1][4:])
        # Checked: apply.
        if main is not None:
            dataset._apply_state(main)  # the epoch counters (and the epoch under way)
        self.worker_preludes = None
        if preludes:
            if count and persistent and num_workers == count:
                self.worker_preludes = list(sub["replicas"])
            else:  # the loader's copy's own, or every worker's (all equal)
                prelude(dataset, preludes[0])
        self._pending = pending
        self._begin = None
        self._holder = None


def _slots(pending: dict[str, Any]) -> list[tuple[int, int | None]]:
    """The lanes of a loaded sub-state: (worker id, base seed or None) of each replica."""
    lanes = pending["lanes"]
    if lanes is None:
        return [(w, None) for w in range(len(pending["replicas"]))]
    return [(w, seed) for w, seed in lanes]


def _checked_lanes(lanes: Any, mode: str, count: int, turn: int, replicas: int
                   ) -> list[list[Any]]:
    """A sub-state's ``"lanes"``, checked against its other fields."""
    where = "cannot load this state: field 'lanes'"
    if mode != "workers" or not isinstance(lanes, list) or len(lanes) != replicas:
        raise ValueError(f"{where} should be a list as long as 'replicas' ({replicas}) in mode "
                         f"'workers', but is {lanes!r} in mode {mode!r}")
    for lane in lanes:
        if not (isinstance(lane, list) and len(lane) == 2 and type(lane[0]) is int
                and 0 <= lane[0] < max(1, count)
                and (lane[1] is None or (type(lane[1]) is int and lane[1] >= 0))):
            raise ValueError(f"{where} holds {lane!r}, not [worker id below 'num_workers' "
                             f"({count}), base seed or None]")
    if turn >= max(1, replicas):
        raise ValueError(f"{where}: 'turn' ({turn}) is not one of its {replicas} replicas")
    return [list(lane) for lane in lanes]


class InlineIterableEpoch(IterableEpoch):
    """An iterable epoch made on the consumer's call, with no background task, no buffer
    between tasks and no event loop: each :meth:`next` draws one batch's samples from a
    loopless stream (its chain pulled on this thread, its reads blocking:
    :meth:`~aloader.streams._runtime._StreamIterator._pull_here`) or from a plain iterable
    dataset's iterator, and collates them, as
    :meth:`IterableEpoch._pull_batches` does for one batch. The sync facade drives it on the
    consumer's thread (:class:`aloader._facade.LocalIterator`), as it drives an in-memory map
    epoch (:attr:`aloader.pipeline._epoch.MapEpoch.loopless`).

    The same batches, notes, snapshots (``Results.meta``) and stats as the background epoch:
    each batch goes through ``results`` (reserve, publish, poll) the moment it is made.

    Invariant: ``_at`` is the snapshot of the position after the last batch handed out (the
    epoch's start before the first). A BaseException that lands in a step (a KeyboardInterrupt
    in a read or a collate: there is no wait for it to land in) closes the stream's chain and
    its files and is raised; the next step reopens the stream at ``_at`` (the resume path,
    exact), so the interrupted batch is drawn again and no sample is lost or repeated.
    """

    def __init__(self, plan: FetchPlan, results: Results, dataset: Any,
                 source: Any, begin: Any, batch_size: int | None, drop_last: bool,
                 snapshot: Any) -> None:
        super().__init__(plan, results, source, batch_size, drop_last, snapshot)
        self._dataset = dataset
        self._at = begin
        self._seq = 0
        self._ended = False
        self._broken = False  # a BaseException unwound the chain: reopen it at _at

    def start(self) -> None:
        if self.plan.failures is not None:
            self.plan.failures.watch_sources(self.plan.dataset)
        self._open_here(self._source)
        self.done.set()

    @staticmethod
    def _open_here(source: Any) -> None:
        if isinstance(source, _StreamIterator):
            source._pull_here()

    def _reopen(self) -> None:
        dataset = self._dataset
        parsed = parse(dataset, encode(dataset, self._at), (0, 1))
        source, self._snapshot = open_replica(dataset, parsed)
        self._use(source)
        self._open_here(source)
        self._broken = False

    async def next(self) -> tuple[Any, BaseException | None]:
        """The next batch (value, error); StopAsyncIteration at the end of the epoch."""
        if self._ended:
            raise StopAsyncIteration
        if self._broken:
            self._reopen()
        seq = self._seq
        error: BaseException | None = None
        try:
            # From a stream's epoch iterator, or a plain dataset's iterator.
            batch, ended = await self._draw(_NO_LIMITER)
            if batch is _NOTHING:
                await self._close()
                raise StopAsyncIteration
        except StopAsyncIteration:
            raise
        except Exception as exc:
            batch, ended = None, True
            error = _batch_error(exc, seq)
        except BaseException:
            self._broken = True
            await close_iterator(self._source)
            raise
        self._seq = seq + 1
        meta = None if error is not None else self._drew(seq, ended)
        if ended:
            await self._close()
        await self.results.reserve(seq)  # never waits: nothing else is in the buffer
        self.results.publish(seq, batch, error)
        item = self.results.poll()
        assert item is not None
        if error is None:
            self._at = meta
        return item

    async def _close(self) -> None:
        self._ended = True
        await close_iterator(self._source)

    def stop(self) -> None:
        """End the epoch and close the stream's files (on the consumer's thread: the only
        one that runs this epoch)."""
        if self._ended:
            return
        self._ended = True
        # A failing close leaves the chain to its finalizer; the epoch has ended either way.
        with contextlib.suppress(Exception):
            run_here(close_iterator(self._source))


@dataclass(frozen=True)
class _Lane:
    """One virtual replica: its own copy of the dataset, its parsed saved position (None:
    its start), and the worker facts it sees (``info`` None: the loader's process)."""

    dataset: Any
    parsed: Any
    info: WorkerInfo | None
    epoch: int | None


class VirtualReplicas(Epoch):
    """The rest of an epoch saved with ``W`` workers, made in this process (``num_workers``
    0 now) by the ``W`` saved replicas, batch by batch in the saved run's turn.

    Invariant: the consumer gets exactly the batches the saved run's workers would have
    delivered, in the same order: replica ``r`` is a copy of the dataset that sees
    ``WorkerInfo(id=r, num_workers=W)`` (:func:`~aloader._workerinfo.as_replica`, in the
    task that iterates it and whatever it starts) and resumes from its saved position, cut
    into batches on its own (its last one incomplete, or dropped with ``drop_last``, as in a
    worker); the batches are taken from the replicas in turn from the saved ``turn``,
    skipping those exhausted, as torch's round robin over its workers does. Each batch's
    metadata is the saved run's shape (every replica's position, the replica asked next), so
    a state taken now resumes with any ``num_workers`` again.

    Each replica runs its own :class:`~aloader.pipeline._epoch.IterableEpoch` (one batch ahead,
    as
    a worker) in a child task of this epoch's, started with its worker facts set.
    """

    def __init__(self, plan: FetchPlan, results: Results, lanes: list[_Lane], turn: int,
                 begin: list[Any], batch_size: int | None, drop_last: bool) -> None:
        super().__init__(plan, results)
        self._lanes = lanes
        self._turn = turn
        self._states = list(begin)
        self._batch_size = batch_size
        self._drop_last = drop_last
        results.metas = {}

    async def _run(self) -> None:
        lanes = self._lanes
        replicas: list[IterableEpoch] = []
        async with anyio.create_task_group() as tg:
            for lane in lanes:
                with as_replica(lane.info, lane.epoch):  # the child task copies the context
                    source, snapshot = open_replica(lane.dataset, lane.parsed)
                    replica = IterableEpoch(self.plan, Results(1, True), source,
                                            self._batch_size, self._drop_last, snapshot)
                    tg.start_soon(replica._main)
                replicas.append(replica)
            # Once it ends, every replica has ended too: their tasks close their sources.
            await self._guard(self._round_robin, replicas)

    async def _round_robin(self, replicas: list[IterableEpoch]) -> None:
        results, states = self.results, self._states
        count = len(replicas)
        live = [True] * count
        turn, seq = self._turn, 0
        while any(live):
            lane, turn = turn, (turn + 1) % count
            if not live[lane]:
                continue
            await results.reserve(seq)
            try:
                batch, error = await replicas[lane].next()
            except StopAsyncIteration:
                live[lane] = False
                continue
            states[lane] = replicas[lane].results.meta
            results.metas[seq] = ("workers", tuple(states), turn)
            results.publish(seq, batch, error)
            seq += 1
        results.finish(seq)


EpochKind: TypeAlias = MapEpochs | IterableEpochs
