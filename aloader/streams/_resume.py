"""Resuming an iterable dataset's epoch: where each batch left the dataset, and the way back.

An iterable epoch (in this process, or in each worker's replica) asks, right after drawing a
batch's samples, where the dataset now is (:func:`snapshotter`); that *snapshot* travels with
the batch (``Results.meta``, a worker's reply), so the loader's state reflects exactly the
batches its consumer received, whatever was prefetched. Three kinds, by what the dataset
offers:

* ``"stream"``: an aloader :class:`~aloader.Stream`: its iterator's position, a few references
  (encoded by :meth:`Stream._state_from` only when a state is asked for);
* ``"protocol"``: a dataset, or the iterator its ``__iter__`` returns, with torchdata's
  ``state_dict()`` / ``load_state_dict()``: both asked after every batch (and copied then: a
  ``state_dict()`` may return the object's own dict, which later batches change), and loaded
  as torchdata loads them: the dataset's before the resumed epoch's ``iter()``, the
  iterator's after it. An iterator that is the dataset itself (``__iter__`` returns ``self``)
  has one state, the iterator's, loaded after ``iter()`` (which may reset it);
* ``"count"``: any other iterable: the samples drawn. Resuming iterates it anew and discards
  that many samples (torchdata's fast-forward): it costs reading them again.

A snapshot is a tuple ``(kind, ...)``: plain data, cheap to take and to pickle. A replica
whose source had ended when its snapshot was taken (``ended``) resumes with nothing left; its
protocol states are still loaded (into the dataset, and into a new iterator that is then
closed unread), as torchdata loads an ended worker's, so that what they set (a dataset's epoch
counter, a random generator) holds for the epochs after it (:func:`prelude`).
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable, Iterator
from types import GeneratorType
from typing import Any

from .._util import ataken, taken
from ..data._dataset import iterate
from ..data._sampler import is_stateful
from ._positions import check_field
from ._runtime import _StreamIterator
from ._stream import Stream

__all__ = ("adopt_world", "encode", "open_replica", "parse", "prelude", "promises_equal_ranks",
           "protocol_state", "resume", "saved_world", "snapshotter", "start_snapshot")


def protocol_state(dataset: Any) -> Any:
    """The snapshot of ``dataset`` itself between epochs (no iterator open): its own state,
    or None when it has no protocol (nothing to restore)."""
    if isinstance(dataset, Stream) or not is_stateful(dataset):
        return None
    return ("protocol", copy.deepcopy(dataset.state_dict()), None, True)


def snapshotter(dataset: Any, source: Any, before: int = 0) -> Callable[[int, bool], Any]:
    """What an epoch calls after each batch's samples are drawn: ``(drawn, ended) -> snapshot``
    of ``dataset`` iterated by ``source`` (which skipped ``before`` samples, resumed by
    counting)."""
    if isinstance(source, _StreamIterator):
        position = source._snapshot
        return lambda drawn, ended: ("stream", position())
    # torchdata's rule: an iterator that is the dataset has one state, the iterator's.
    own = dataset.state_dict if is_stateful(dataset) and source is not dataset else None
    of_iterator = source.state_dict if is_stateful(source) else None
    if own is not None or of_iterator is not None:
        def protocol(drawn: int, ended: bool) -> Any:
            # Copied now: the consumer may take the batch after later ones changed them.
            states = copy.deepcopy((None if own is None else own(),
                                    None if of_iterator is None else of_iterator()))
            return ("protocol", states[0], states[1], ended)

        return protocol
    return lambda drawn, ended: ("count", before + drawn, ended)


def open_replica(dataset: Any, parsed: Any) -> tuple[Iterator[Any] | AsyncIterator[Any],
                                                     Callable[[int, bool], Any]]:
    """A new iterator over ``dataset`` resumed from ``parsed`` (see :func:`parse`; None: the
    start), and its snapshotter."""
    source = resume(dataset, parsed)
    if parsed is not None and parsed[0] in ("protocol", "count") and parsed[-1]:
        # Ended: nothing is drawn from it, and it stays where it was saved.
        return source, lambda drawn, ended: parsed
    before = parsed[1] if parsed is not None and parsed[0] == "count" else 0
    return source, snapshotter(dataset, source, before)


def prelude(dataset: Any, parsed: Any) -> None:
    """Load an ended replica's states into ``dataset`` (see the module docstring): what a
    state taken between epochs restores before the next epoch opens its iterator."""
    if parsed is None or parsed[0] != "protocol":
        return
    resume(dataset, (*parsed[:3], True))


def start_snapshot(dataset: Any, epoch: int, slot: tuple[int, int]) -> Any:
    """The snapshot of a replica that has delivered nothing yet in ``epoch`` (worker ``slot``):
    None where the start needs no saving (not a stream)."""
    if isinstance(dataset, Stream):
        return ("stream", (epoch, None, 0, False, None, slot))
    return None


def encode(dataset: Any, snapshot: Any, counters: Any = None,
           world: list[list[int]] | None = None) -> dict[str, Any] | None:
    """A snapshot as JSON builtins (None stays None: the replica's start); ``world``: the
    ranks of a replica that finishes another rank's epoch (:func:`adopt_world`), in place of
    ``dataset``'s."""
    if snapshot is None:
        return None
    kind = snapshot[0]
    if kind == "encoded":  # a resumed replica that has delivered nothing since
        return snapshot[1]  # type: ignore[no-any-return]
    if kind == "stream":
        state = dataset._state_from(snapshot[1], counters=counters, at_end=True)
        if world is not None:
            state["world"] = world
        return {"kind": "stream", "state": state}
    if kind == "protocol":
        return {"kind": "protocol", "dataset": snapshot[1], "iterator": snapshot[2],
                "ended": snapshot[3]}
    return {"kind": "count", "drawn": snapshot[1], "ended": snapshot[2]}


# Another world size. A stream's replica state names the ranks its sharded sources were on
# (``world``: ``[rank, world_size]`` each); a rank of another world size finishes it in a copy
# of its own stream put on those ranks (its sources then read the shards that rank read, from
# the saved position), so the rest of the saved epoch is made exactly as the saved rank would
# have made it. aloader.loader._ranks decides which rank finishes which replica.


def saved_world(state: Any) -> list[list[int]] | None:
    """The ``world`` of an encoded stream replica state (None for any other)."""
    if not (isinstance(state, dict) and state.get("kind") == "stream"):
        return None
    inner = state.get("state")
    world = inner.get("world") if isinstance(inner, dict) else None
    return world if isinstance(world, list) else None


def adopt_world(replica: Any, state: Any) -> None:
    """Put ``replica`` (a copy of the loader's stream) on the ranks the replica ``state`` was
    saved on, where they differ from its own.

    Raises:
        ValueError: the saved ``world`` does not fit the stream's sharded sources.
    """
    world = saved_world(state)
    if world is None or not isinstance(replica, Stream):
        return
    mine = replica._worlds()
    if world == mine:
        return
    if len(world) != len(mine) or not all(
            isinstance(w, list) and len(w) in (2, 3) and all(type(v) is int for v in w)
            and 0 <= w[0] < w[1] and (len(w) == 2 or w[2] > 0) for w in world):
        raise ValueError(f"cannot load this stream state: field 'world' is {world!r}, which "
                         f"does not fit this stream's sharded sources ({mine!r}: [rank, "
                         "world_size] each, and records_per_rank where set)")
    replica._set_worlds([list(w) for w in world])


def promises_equal_ranks(dataset: Any) -> bool:
    """Whether ``dataset`` is a stream with a source that gives every rank the same records
    per epoch (``records_per_rank``)."""
    if not isinstance(dataset, Stream):
        return False
    if getattr(dataset, "records_per_rank", None) is not None:
        return True
    return any(promises_equal_ranks(upstream) for upstream in dataset._upstreams())


def parse(dataset: Any, state: Any, slot: tuple[int, int]) -> Any:
    """Validate an encoded replica state for worker ``slot``; what :func:`resume` takes."""
    if state is None:
        return None
    where = "iterable dataset"
    kind = check_field(state, "kind", str, where)
    # A plain dataset resumes by its own protocol or its iterator's (known only once iter()
    # is called), or by counting.
    expected = ("stream",) if isinstance(dataset, Stream) else ("protocol", "count")
    if kind not in expected:
        kinds = " or ".join(map(repr, expected))
        raise ValueError(f"cannot load this state: field 'kind' is {kind!r}, but this dataset "
                         f"({type(dataset).__name__}) resumes by {kinds}")
    if kind == "stream":
        return ("stream", dataset._parse_state(state.get("state"), slot))
    if kind == "protocol":
        for name in ("dataset", "iterator"):
            if name not in state:
                raise ValueError(f"cannot load this state: field {name!r} is missing")
        own = state["dataset"]
        if own is not None and not is_stateful(dataset):
            raise ValueError(f"cannot load this state: field 'dataset' holds a dataset's "
                             f"state, but this dataset ({type(dataset).__name__}) has no "
                             "state_dict() and load_state_dict()")
        return ("protocol", own, state["iterator"], check_field(state, "ended", bool, where))
    drawn = check_field(state, "drawn", int, where)
    ended = check_field(state, "ended", bool, where)
    return ("count", drawn, ended)


def resume(dataset: Any, parsed: Any) -> Iterator[Any] | AsyncIterator[Any]:
    """A new iterator over ``dataset``, from a state :func:`parse` validated (None: the
    start)."""
    if isinstance(dataset, Stream):  # its epoch's iterator, which the loader slices batches off
        if parsed is not None:
            dataset._apply_state(parsed[1])
        return dataset._open()
    if parsed is None:
        return iterate(dataset)
    kind = parsed[0]
    if kind == "protocol":
        _, own, of_iterator, ended = parsed
        # torchdata's order: the dataset's state, then iter(), then the iterator's state.
        if own is not None:
            dataset.load_state_dict(copy.deepcopy(own))
        source = iterate(dataset)
        if of_iterator is not None:
            if not is_stateful(source):
                raise ValueError(
                    "cannot load this state: field 'iterator' holds an iterator's state, but "
                    f"iter() of this dataset ({type(dataset).__name__}) returned a "
                    f"{type(source).__name__}, which has no load_state_dict()")
            source.load_state_dict(copy.deepcopy(of_iterator))  # type: ignore[union-attr]
        if ended:  # the last batch drew the replica's last samples: nothing is left
            if isinstance(source, GeneratorType):  # not the dataset's own close()
                source.close()
            return iter(())
        return source
    drawn, ended = parsed[1], parsed[2]
    source = iterate(dataset)
    if isinstance(source, AsyncIterator):
        return _skip_async(source, drawn, ended)
    return _skip(source, drawn, ended)


def _skip(source: Iterator[Any], count: int, ended: bool) -> Iterator[Any]:
    """``source`` without its first ``count`` items (all of them once it had ended)."""
    if ended:
        return
    for _ in range(count):
        if next(source, _END) is _END:
            return
    yield from taken(source)


async def _skip_async(source: AsyncIterator[Any], count: int, ended: bool
                      ) -> AsyncIterator[Any]:
    if ended:
        return
    for _ in range(count):
        try:
            await source.__anext__()
        except StopAsyncIteration:
            return
    async for item in ataken(source):
        yield item


_END: Any = object()
