"""A map-style dataset's own state in a DataLoader's checkpoints (torchdata's protocol).

A map-style dataset with ``state_dict()`` / ``load_state_dict()`` (torchdata's ``Stateful``)
has one copy per process that fetches: the loader's own without workers, each worker's
with them. Each copy's state is taken once a batch is loaded (a worker's travels with its
answer), and the checkpoint keeps, per copy, the state after the last of its batches the
consumer received, as torchdata's does; before a copy has delivered anything in the epoch,
its state at the epoch's start. A resume loads each state into the copy of the same number
before it fetches anything (a worker's after ``worker_init_fn``), as torchdata does.

The checkpoint's ``map`` part holds it as ``"datasets": {"num_workers": W, "states": [...],
"drawn": bool}`` (None without the protocol): the states of the ``max(1, W)`` copies (None:
a worker's own start, nothing to load), and whether they were taken after the epoch's keys
were drawn. Without workers that matters: the sampler's draws (a ``RandomSampler`` without a
generator draws its seed from torch's global generator) and the dataset's (one drawing from
that same generator, saved in its state) share a generator, so a state taken before the keys
were drawn is loaded before they are drawn again, and one taken after a batch is loaded
after.

Another ``num_workers`` than the saved one resumes the copies' states only where they are
all equal (each copy then starts with it): which copy made which batch depends on the count,
so differing states cannot be given to other copies and be what they were.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

from ..data._sampler import is_stateful
from ..streams._positions import check_field

__all__ = ("DatasetStates",)

_WHERE = "map"


def _same(a: Any, b: Any) -> bool:
    """Whether two states are equal (a state may hold arrays or tensors, whose ``==`` is
    elementwise): by value where ``==`` answers, else by their pickles."""
    try:
        return bool(a == b)
    except Exception:  # an array's elementwise answer
        try:
            return pickle.dumps(a) == pickle.dumps(b)
        except Exception:
            return False


def as_prelude(state: Any) -> Any:
    """A copy's state as a worker's start state (see :func:`aloader.streams._resume.prelude`)."""
    if state is None:
        return None
    return {"kind": "protocol", "dataset": state, "iterator": None, "ended": True}


class DatasetStates:
    """A map-style dataset's own state: taken, kept per copy, checked and given back.

    Args:
        dataset: the loader's dataset.

    Invariant: :attr:`begin` is the ``"datasets"`` entry of the epoch under way at its start
    (None without the protocol); a loaded entry is spent by the next epoch: loaded into the
    loader's copy (now, or once the keys are drawn: :meth:`after_keys`), or given to the
    next workers started (:meth:`take_preludes`).
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.stateful = dataset is not None and is_stateful(dataset)
        self.begin: dict[str, Any] | None = None
        self._after_keys: Any = None
        self._preludes: list[Any] | None = None
        # The pool epoch that ran the latest epoch on workers (its copies' latest states).
        self._remote: Any = None

    def own(self) -> Any:
        """The loader's copy's state now (copied: it may be the dataset's own dict)."""
        return copy.deepcopy(self.dataset.state_dict())

    def _pool_states(self, num_workers: int) -> list[Any]:
        """The persistent workers' latest states (None: a worker that delivered nothing)."""
        remote = self._remote
        if remote is not None:
            pool = remote.pool
            if pool.persistent and not (pool.closed or pool.broken):
                states = getattr(remote.delivered, "states", None)
                if states is not None and len(states) == num_workers:
                    return list(states)
        return [None] * num_workers

    def epoch_begins(self, num_workers: int) -> None:
        """An epoch starts (before its keys are drawn): note where each copy starts."""
        if not self.stateful:
            self.begin = None
        elif num_workers == 0:
            self.begin = {"num_workers": 0, "states": [self.own()], "drawn": False}
        else:
            self.begin = {"num_workers": num_workers, "states": self._pool_states(num_workers),
                          "drawn": False}

    def on_workers(self, remote: Any) -> None:
        """The epoch runs on ``remote`` (a pool epoch): its workers' states arrive there."""
        self._remote = remote

    def local(self) -> None:
        """The epoch runs in this process."""
        self._remote = None

    def entry(self, meta: Any, epoch_done: bool) -> dict[str, Any] | None:
        """The checkpoint's ``"datasets"`` entry: between epochs (``epoch_done``), where the
        next epoch's copies start; during one, as of the batch received last (its ``meta``:
        ``("local", state)`` or ``("workers", states, turn)``), or the epoch's start."""
        if not self.stateful:
            return None
        if epoch_done:
            remote = self._remote
            if remote is not None and remote.pool.persistent and not (
                    remote.pool.closed or remote.pool.broken):
                count = remote.pool.num_workers
                return {"num_workers": count, "states": self._pool_states(count),
                        "drawn": False}
            return {"num_workers": 0, "states": [self.own()], "drawn": False}
        begin = self.begin
        if meta is not None and meta[0] == "local":
            return {"num_workers": 0, "states": [meta[1]], "drawn": True}
        if begin is None or (meta is None and not begin["num_workers"]):
            return None if begin is None else copy.deepcopy(begin)
        # On workers: each one's state after the last of its batches taken; one none of
        # whose batches was taken is as it started (its report, which may come after the
        # batch taken last), or as the epoch began.
        states = [None] * begin["num_workers"] if meta is None else list(meta[1])
        remote = self._remote
        live = None if remote is None else remote.delivered.starts
        if live is not None and len(live) == len(states):
            states = [s if s is not None else x for s, x in zip(states, live, strict=True)]
        if len(begin["states"]) == len(states):
            states = [s if s is not None else b
                      for s, b in zip(states, begin["states"], strict=True)]
        return {"num_workers": len(states), "states": copy.deepcopy(states),
                "drawn": meta is not None}

    def check(self, entry: Any, num_workers: int) -> dict[str, Any] | None:
        """Validate a checkpoint's ``"datasets"`` entry for a loader with ``num_workers``;
        nothing is applied.

        Raises:
            ValueError: the entry is malformed, holds states for a dataset without the
                protocol, or differing states for another number of workers.
        """
        if entry is None:
            return None
        if not isinstance(entry, dict):
            raise ValueError(f"cannot load this state: field 'datasets' should be a dict or "
                             f"None, but is {type(entry).__name__}")
        count = check_field(entry, "num_workers", int, _WHERE)
        states = check_field(entry, "states", list, _WHERE)
        check_field(entry, "drawn", bool, _WHERE)
        if len(states) != max(1, count):
            raise ValueError(f"cannot load this state: field 'datasets' has {len(states)} "
                             f"states for num_workers={count}")
        if not self.stateful and any(state is not None for state in states):
            raise ValueError(f"cannot load this state: field 'datasets' holds a dataset's "
                             f"state, but this dataset ({type(self.dataset).__name__}) has "
                             "no state_dict() and load_state_dict()")
        if count != num_workers and not all(_same(state, states[0]) for state in states):
            raise ValueError(
                f"cannot load this state: field 'datasets' holds the differing states of the "
                f"dataset copies of {max(1, count)} "
                f"{'workers' if count else 'process'}; which copy fetches which batch depends "
                f"on num_workers: it resumes with num_workers={count} only")
        return entry

    def apply(self, entry: dict[str, Any] | None, num_workers: int) -> None:
        """Apply an entry :meth:`check` passed: the loader's copy's state is loaded now (or
        after the resumed epoch's keys are drawn), the workers' go to the next workers."""
        self._after_keys = None
        self._preludes = None
        self.begin = None
        self._remote = None
        if entry is None:
            return
        count, states, drawn = entry["num_workers"], entry["states"], entry["drawn"]
        if count == num_workers and count:
            self._preludes = [as_prelude(state) for state in states]
            return
        state = states[0]  # the loader's copy's, or every copy's (all equal)
        if state is None:
            return
        if num_workers == 0 and drawn:
            self._after_keys = state
        else:
            self.dataset.load_state_dict(copy.deepcopy(state))

    def after_keys(self) -> None:
        """The resumed epoch's keys are drawn (without workers): load the state saved after
        them."""
        state, self._after_keys = self._after_keys, None
        if state is not None:
            self.dataset.load_state_dict(copy.deepcopy(state))

    def take_preludes(self) -> list[Any] | None:
        """The states the workers about to start load first (see :class:`WorkerSetup`)."""
        preludes, self._preludes = self._preludes, None
        return preludes
