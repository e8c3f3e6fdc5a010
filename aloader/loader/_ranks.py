"""The loader's state across the ranks of a distributed job: merged, split on any world size.

This module owns the merged state of a job's ranks (:func:`merge_rank_states`) and the part of
it each rank of any world size takes (:func:`rank_part`); one rank's state is
aloader.loader._checkpoint's, and the merged state as a ``torch.distributed.checkpoint``
``Stateful`` aloader.loader._dcp's.

Invariant: the ranks of any world size ``W'`` that load one merged state of an epoch taken on
``W`` ranks deliver, together, exactly the samples the ``W`` ranks had not delivered of it,
none twice (map-style beyond ``DistributedSampler``'s padding), then ordinary epochs on
``W'``:

* the same world size: rank ``r`` takes rank ``r``'s state, as saved;
* map-style over a :class:`~aloader.DistributedSampler`: every rank takes the epoch's global
  order and each saved rank's progress (the batches it had, which may differ from rank to
  rank), and the rest of the order is split over the new ranks by the sampler's own rule
  (:meth:`DistributedSampler._resume_elastic`);
* a :class:`~aloader.Stream` over sharded sources: the epoch's *replicas* (each saved rank's
  loader workers, or its one process; their positions are in the states) are dealt to the new
  ranks, each finishing its replicas as *virtual replicas* (see
  :class:`aloader.loader._epochs.IterableEpochs`) on the saved replica's own rank and worker
  (:func:`aloader.streams._resume.adopt_world`): the batches are those the saved run would
  have made, shuffle buffers included, on other ranks. Replica ``i`` of saved rank ``c``
  (``i``-th in that rank's state) is numbered ``g = i * W + c`` and goes to new rank ``g %
  W'``: with ``W'`` dividing ``W``, whole saved ranks move together, so ranks that were
  even stay even (required where the source promises it, ``records_per_rank``). A replica
  is never split: a new rank dealt none has nothing left of the epoch.

A state taken between epochs (on every rank) starts the next epoch on any world size.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..streams._resume import promises_equal_ranks, saved_world
from ..streams._stream import Stream
from ._checkpoint import STATE_FORMAT, STATE_VERSION, place_of
from ._epochs import MapEpochs

if TYPE_CHECKING:
    from ._dataloader import DataLoader

__all__ = ("RANKS_FORMAT", "merge_rank_states", "rank_part")

RANKS_FORMAT = "aloader.DataLoader.ranks"


# --------------------------------------------------------------------------- merging


def merge_rank_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge the ranks' loader states into one that every rank of any world size loads.

    Each rank of a distributed job calls ``loader.state_dict()`` at the same step; gather
    them (``torch.distributed.all_gather_object``, or one file per rank), merge them here,
    and give the result to ``load_state_dict`` on every rank of the new job, which takes its
    part: on the same world size, rank ``r`` resumes rank ``r``'s state exactly; on another,
    the ranks together deliver exactly the rest of the interrupted epoch (map-style through a
    :class:`~aloader.DistributedSampler`; a :class:`~aloader.Stream` over sharded sources
    such as ``JsonLines``, shuffle buffers included), then ordinary epochs on the new world
    size. :class:`DistributedState` does the gathering for
    ``torch.distributed.checkpoint``.

    Args:
        states: one ``DataLoader.state_dict()`` per rank, in rank order.

    Returns:
        The merged state (JSON builtins: ``json`` and ``pickle`` take it).

    Raises:
        ValueError: a state missing or out of rank order, states of different datasets or
            loaders, of other epochs (not taken at the same step), or a malformed state; the
            message names the rank and the field.
        TypeError: ``states`` is not a list of dicts.
    """
    checked = _checked_ranks(states)
    _lanes(checked)  # the replicas of a stream's epoch: every one once
    return {"format": RANKS_FORMAT, "version": STATE_VERSION, "world_size": len(checked),
            "ranks": checked}


def _checked_ranks(states: Any) -> list[dict[str, Any]]:
    """Copies of the ranks' states, checked to be one job's, one per rank in rank order."""
    if isinstance(states, (str, bytes, Mapping)) or not isinstance(states, Sequence):
        raise TypeError("merge_rank_states needs a list of DataLoader states (one per rank, "
                        f"in rank order), but got {type(states).__name__}")
    if not states:
        raise ValueError("merge_rank_states needs the state of every rank, but got none")
    out: list[dict[str, Any]] = []
    for i, state in enumerate(states):
        if not isinstance(state, Mapping):
            raise TypeError(f"the state of rank {i} should be a dict, but is "
                            f"{type(state).__name__}")
        if state.get("format") == RANKS_FORMAT:
            raise ValueError(f"the state of rank {i} is already a merged state: give the "
                             "ranks' own states (DataLoader.state_dict() on each rank)")
        for name, value in (("format", STATE_FORMAT), ("version", STATE_VERSION)):
            if state.get(name) != value:
                raise ValueError(f"the state of rank {i}: field {name!r} is "
                                 f"{state.get(name)!r}, not {value!r} (a DataLoader's state)")
        out.append(copy.deepcopy(dict(state)))
    _check_places(out)
    first = out[0]
    for i, state in enumerate(out[1:], 1):
        for name in ("kind",):
            _same(state, first, i, name, state.get(name), first.get(name))
        for name in ("batch_size", "drop_last", "dataset_length"):
            _same(state, first, i, f"loader.{name}", _get(state, "loader", name),
                  _get(first, "loader", name))
        kind = first.get("kind")
        if kind == "iterable":
            _same(state, first, i, "iterable.stream.stream", _get(state, "iterable", "stream",
                  "stream"), _get(first, "iterable", "stream", "stream"))
        else:
            for name in ("seed", "shuffle", "length"):
                _same(state, first, i, f"map.sampler.{name}", _sampler_field(state, name),
                      _sampler_field(first, name))
    _epoch_of(out)
    return out


def _check_places(states: list[dict[str, Any]]) -> None:
    """Each state's ``rank`` ([rank, world_size] it was taken on, where it says) fits its
    place in the list: no rank missing, none twice, in rank order."""
    count = len(states)
    found = [state.get("rank") for state in states]
    if all(place is None for place in found):
        return  # states of an older aloader: their order is the list's
    places: list[list[int]] = []
    for i, place in enumerate(found):
        if not (isinstance(place, list) and len(place) == 2
                and all(type(v) is int for v in place) and 0 <= place[0] < place[1]):
            raise ValueError(f"the state of rank {i}: field 'rank' should be [rank, "
                             f"world_size], but is {place!r}")
        places.append(place)
    sizes = sorted({place[1] for place in places})
    if len(sizes) > 1:
        raise ValueError(f"the states were taken on different world sizes ({sizes}): give "
                         "the states of one job, one per rank")
    size = sizes[0]
    ranks = [place[0] for place in places]
    missing = sorted(set(range(size)) - set(ranks))
    if missing or size != count:
        twice = sorted({r for r in ranks if ranks.count(r) > 1})
        raise ValueError(
            f"the states were taken on {size} ranks, but {count} are given"
            + (f": the state of rank {', '.join(map(str, missing))} is missing" if missing
               else "") + (f" (rank {', '.join(map(str, twice))} given twice)" if twice else ""))
    for i, rank in enumerate(ranks):
        if rank != i:
            raise ValueError(f"the state at position {i} is rank {rank}'s: give the states "
                             "in rank order")


def _get(state: Mapping[str, Any], *path: str) -> Any:
    value: Any = state
    for name in path:
        value = value.get(name) if isinstance(value, Mapping) else None
    return value


def _sampler_field(state: Mapping[str, Any], name: str) -> Any:
    sampler = _get(state, "map", "sampler")
    if isinstance(sampler, Mapping) and isinstance(sampler.get("sampler"), Mapping):
        sampler = sampler["sampler"]  # a BatchSampler's state holds its sampler's
    return sampler.get(name) if isinstance(sampler, Mapping) else None


def _same(state: Any, first: Any, i: int, field: str, value: Any, expected: Any) -> None:
    if value != expected:
        raise ValueError(f"the state of rank {i} is of another dataset or loader: field "
                         f"{field!r} is {value!r}, rank 0's is {expected!r}")


def _finished(state: Mapping[str, Any], epoch: int) -> bool:
    """Whether ``state`` is at the start of ``epoch + 1``: its rank had ended ``epoch``."""
    return state.get("epoch") == epoch + 1 and state.get("yielded") == 0


def _epoch_of(states: list[dict[str, Any]]) -> int:
    """The epoch the states were taken in: each rank's, or the next one's start for a rank
    that had ended it."""
    found = [state.get("epoch") for state in states]
    if not all(type(e) is int for e in found):
        raise ValueError(f"the states' field 'epoch' should be ints, but they are {found!r}")
    epochs = [int(e) for e in found]  # type: ignore[arg-type]
    epoch = min(epochs)
    for i, state in enumerate(states):
        if state["epoch"] != epoch and not _finished(state, epoch):
            raise ValueError(f"the state of rank {i} is in epoch {state['epoch']}, but rank "
                             f"{epochs.index(epoch)}'s in epoch {epoch}: take the ranks' "
                             "states at the same step")
    return epoch


def _under_way(state: Mapping[str, Any], epoch: int) -> bool:
    """Whether ``state`` is within ``epoch`` (neither before its first batch nor after)."""
    if state.get("epoch") != epoch:
        return False
    if state.get("kind") == "iterable":
        return bool(_get(state, "iterable", "mode") != "between")
    return bool(state.get("yielded"))  # a map-style epoch not begun has yielded none


# --------------------------------------------------------------------------- streams' replicas


class _Lane:
    """One replica of an iterable epoch: which saved rank holds it (``holder``, at
    ``index`` in its state), its worker ``slot`` ([worker id, base seed or None]), the saved
    run's ``count`` of workers, and its encoded ``state``."""

    __slots__ = ("count", "holder", "index", "slot", "state")

    def __init__(self, holder: int, index: int, slot: list[Any], count: int,
                 state: Any) -> None:
        self.holder, self.index, self.slot, self.count, self.state = (
            holder, index, slot, count, state)

    def order(self, world_size: int) -> int:
        return self.index * world_size + self.holder


def _lanes(states: list[dict[str, Any]]) -> list[_Lane]:
    """The replicas of the epoch the (iterable) states are in, checked: a stream's each
    once (its rank and worker are in its state), all of them unless a rank had ended the
    epoch. Empty for map-style states and where no rank is within an epoch."""
    if states[0].get("kind") != "iterable":
        return []
    epoch = _epoch_of(states)
    going = [i for i, state in enumerate(states) if _under_way(state, epoch)]
    if not going:
        return []
    lanes: list[_Lane] = []
    for i, state in enumerate(states):
        if state["epoch"] != epoch:
            continue  # it had ended the epoch: its replicas are done
        if i not in going:
            raise ValueError(f"the state of rank {i} is before the start of epoch {epoch}, "
                             f"but rank {going[0]}'s is within it: take the ranks' states at "
                             "the same step")
        sub = state["iterable"]
        if not isinstance(sub, Mapping):
            raise ValueError(f"the state of rank {i}: field 'iterable' should be a dict")
        count, replicas, named = sub.get("num_workers"), sub.get("replicas"), sub.get("lanes")
        if type(count) is not int or not isinstance(replicas, list):
            raise ValueError(f"the state of rank {i}: fields 'iterable.num_workers' and "
                             "'iterable.replicas' should be an int and a list")
        seed = _get(state, "loader", "base_seed")
        slots = named if isinstance(named, list) else [
            [w, seed if count else None] for w in range(len(replicas))]
        if len(slots) != len(replicas):
            raise ValueError(f"the state of rank {i}: field 'iterable.lanes' should be as long "
                             "as 'iterable.replicas'")
        lanes.extend(_Lane(i, k, list(slot), count, replica)
                     for k, (slot, replica) in enumerate(zip(slots, replicas, strict=True)))
    counts = sorted({lane.count for lane in lanes})
    if len(counts) > 1:
        raise ValueError(f"the states' epoch was run with different num_workers ({counts}) "
                         "on different ranks: take the states of one job")
    _check_replicas(lanes, finished=len(going) < len(states))
    return lanes


def _check_replicas(lanes: list[_Lane], *, finished: bool) -> None:
    """Every replica of a stream's epoch once: ranks x workers of the run that began it
    (the ``world`` and ``worker`` in each state), all of them unless some rank had ended
    the epoch (its replicas are done)."""
    seen: dict[tuple[int, int], int] = {}
    shapes: set[tuple[int, int]] = set()
    for lane in lanes:
        world, inner = saved_world(lane.state), _get(lane.state, "state")
        worker = inner.get("worker") if isinstance(inner, Mapping) else None
        if not world or not isinstance(worker, list) or len(worker) != 2:
            return  # not a sharded stream's: the list's order is all there is
        rank, size = world[0][0], world[0][1]
        shapes.add((size, max(1, lane.count)))
        key = (rank, worker[0])
        if key in seen:
            raise ValueError(f"the position of rank {rank}'s worker {worker[0]} is in the "
                             f"states of rank {seen[key]} and rank {lane.holder}: a state "
                             "is given twice, or the stream is not split over the job's ranks "
                             "(each rank reads all of it); such a state resumes only on the "
                             "same world size")
        seen[key] = lane.holder
    if len(shapes) > 1:
        raise ValueError(f"the states' replicas come from different runs ({sorted(shapes)} "
                         "ranks x workers): take the states of one job")
    if finished or not shapes:
        return
    size, workers = shapes.pop()
    missing = [(r, w) for r in range(size) for w in range(workers) if (r, w) not in seen]
    if missing:
        ranks = sorted({r for r, _ in missing})
        raise ValueError(f"the states hold no position for {len(missing)} of the epoch's "
                         f"{size * workers} replicas (those of rank "
                         f"{', '.join(map(str, ranks))} of {size}): a rank's state is missing")


# --------------------------------------------------------------------------- one rank's part


def rank_part(loader: DataLoader[Any], merged: Mapping[str, Any]) -> dict[str, Any]:
    """The state ``loader`` (on its rank, :func:`place_of`) loads of a merged state.

    Raises:
        ValueError: a malformed merged state, or one that cannot be split over this world
            size (see :func:`merge_rank_states`).
    """
    if merged.get("version") != STATE_VERSION:
        raise ValueError(f"merged state field 'version' is {merged.get('version')!r}, not "
                         f"{STATE_VERSION}")
    states = _checked_ranks(merged.get("ranks"))
    if merged.get("world_size") != len(states):
        raise ValueError(f"merged state field 'world_size' is {merged.get('world_size')!r}, "
                         f"but it holds {len(states)} ranks' states")
    kind = "map" if isinstance(loader._kind, MapEpochs) else "iterable"
    if states[0].get("kind") != kind:
        raise ValueError(f"state field 'kind' differs: the state has "
                         f"{states[0].get('kind')!r}, this loader expects {kind!r}")
    rank, size = place_of(loader)
    if size == len(states):
        return states[rank]
    epoch = _epoch_of(states)
    part = copy.deepcopy(states[rank % len(states)])
    part["rank"] = [rank, size]
    going = [state for state in states if _under_way(state, epoch)]
    if not going:  # between epochs: the next one starts on any world size
        return part
    part["epoch"], part["yielded"] = epoch, 0
    part["failures"] = _failures(states, epoch)
    if part.get("kind") == "iterable":
        part["iterable"] = _iterable_part(loader, states, going[0], rank, size)
    else:
        part["map"] = _map_part(loader, states, epoch, going[0], size)
    return part


def _failures(states: list[dict[str, Any]], epoch: int) -> dict[str, Any]:
    """The failures the ranks had absorbed in the epoch: counted, and their indices."""
    count = 0
    indices: list[Any] = []
    for state in states:
        failures = state.get("failures")
        if state["epoch"] == epoch and isinstance(failures, Mapping):
            count += failures.get("count", 0) if type(failures.get("count")) is int else 0
            found = failures.get("indices")
            indices.extend(i for i in (found if isinstance(found, list) else [])
                           if i not in indices)
    return {"count": max(count, len(indices)), "indices": indices}


def _map_part(loader: DataLoader[Any], states: list[dict[str, Any]], epoch: int,
              going: dict[str, Any], size: int) -> dict[str, Any]:
    kind = loader._kind
    sampler = kind._distributed() if isinstance(kind, MapEpochs) else None
    if sampler is None:
        raise ValueError(
            f"cannot split this state of {len(states)} ranks over {size}: a map-style loader "
            "resumes on another world size through a DistributedSampler, and this one's "
            f"sampler is {type(loader.sampler).__name__}; resume it on {len(states)} ranks")
    progress: list[list[Any]] = []
    for state in states:
        sub = state.get("map")
        if state["epoch"] != epoch:
            progress.append([None, []])  # it had ended the epoch: all of its part is done
        elif isinstance(sub, Mapping):
            progress.append([sub.get("prefix"), sub.get("delivered")])
        else:
            raise ValueError("a rank's state has no 'map' entry")
    sub = dict(going["map"])
    sub.update(prefix=0, delivered=[], ranks=progress)
    return sub


def _iterable_part(loader: DataLoader[Any], states: list[dict[str, Any]],
                   going: dict[str, Any], rank: int, size: int) -> dict[str, Any]:
    saved = len(states)
    dataset = loader.dataset
    if not (isinstance(dataset, Stream) and dataset._worlds()):
        raise ValueError(
            f"cannot split this state of {saved} ranks over {size}: an iterable epoch "
            "resumes on another world size only for a Stream over sharded sources (JsonLines, "
            f"TarShards, ParquetRows, ...), and this dataset is {type(dataset).__name__}; "
            f"resume it on {saved} ranks, or from a state taken between epochs")
    # A replica is not split: a rank dealt none has nothing left of the epoch (more ranks
    # than replicas, or replicas already at their end).
    lanes = sorted(_lanes(states), key=lambda lane: lane.order(saved))
    if saved % size and promises_equal_ranks(dataset):
        raise ValueError(f"cannot split this state of {saved} ranks over {size} evenly: its "
                         "source gives every rank the same records (records_per_rank), which "
                         f"the rest of the epoch keeps only on a world size dividing {saved}; "
                         "resume it on one of those, or from a state taken between epochs")
    mine = [lane for lane in lanes if lane.order(saved) % size == rank]
    sub = dict(going["iterable"])
    counters = sub.get("stream")
    if isinstance(counters, Mapping) and lanes:  # the stream's epoch (a local state has none)
        counters = dict(counters)
        counters["epoch"] = _get(lanes[0].state, "state", "epoch")
    sub.update(mode="workers", num_workers=sub.get("num_workers"), turn=0, stream=counters,
               replicas=[lane.state for lane in mine], lanes=[lane.slot for lane in mine])
    return sub
