"""What a worker process knows about itself: ``WorkerInfo``, ``get_worker_info()``, its epoch.

This module owns the per-process facts that datasets and sources read while they iterate
(which worker this is, how many there are, the loader epoch being served), and nothing else, so
that sources (:mod:`aloader.streams._stream`, :mod:`aloader.sources._sharding`) can shard
themselves without
importing the worker server (:mod:`aloader.workers._worker`), which sets these facts. Outside
workers
``get_worker_info()`` is None and :func:`served_epoch` is None.

A replica of an iterable dataset may run where it was not saved: the rest of an epoch saved
with ``W`` workers is run by ``W`` *virtual replicas* (:mod:`aloader.loader._epochs`), in the
loader's
process or several in one worker. Each must see the facts of the worker it replaces, and only
its own: :func:`as_replica` sets them in a context variable (inherited by the tasks and threads
the replica's iteration starts), which wins over the process's facts.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, NamedTuple

__all__ = ("WorkerInfo", "as_replica", "get_worker_info", "served_epoch", "worker_slot")


class WorkerInfo:
    """What a worker process knows about itself (torch's ``WorkerInfo``).

    Attributes:
        id: this worker's number, in ``range(num_workers)``.
        num_workers: how many workers the loader runs.
        seed: this worker's seed (``base_seed + id``).
        dataset: this worker's own copy of the dataset.
        rng: None, as in torch's process workers (torch's thread workers keep their
            generators there).
        worker_method: ``"multiprocessing"``, as torch's process workers say.
        epoch: the loader's epoch this worker is serving (not in torch; see
            :attr:`epoch`).
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any
    # torch's values for a process worker (recent torch's WorkerInfo has these fields).
    rng: Any = None
    worker_method: str | None = "multiprocessing"
    __initialized = False

    def __init__(self, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.__keys = tuple(kwargs.keys())
        self.__initialized = True

    def __setattr__(self, key: str, value: Any) -> None:
        if self.__initialized:
            raise RuntimeError(f"Cannot assign attributes to {self.__class__.__name__} objects")
        super().__setattr__(key, value)

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={getattr(self, k)}" for k in self.__keys)
        return f"{self.__class__.__name__}({items})"

    @property
    def epoch(self) -> int:
        """The loader's epoch this worker is serving (0 before its first task).

        For a :class:`~aloader.Stream` dataset it is the epoch the loader's own copy of the
        stream claimed for this epoch (its ``set_epoch`` value, else its counter, which the
        loader advances as if it had iterated the stream); for other datasets it counts the
        loader's epochs from 0. A stream iterated in a worker without ``set_epoch`` uses it,
        so that shard orders and shuffles change every epoch, with persistent workers or not.
        """
        epoch = served_epoch()
        return epoch if epoch is not None else 0


_worker_info: WorkerInfo | None = None
# The answer this module gave torch's get_worker_info() (see _mirror_to_torch), if any.
_torch_mirror: Any = None
# The loader epoch of this worker's latest task; None outside workers.
_served_epoch: int | None = None


class _Replica(NamedTuple):
    info: WorkerInfo | None
    epoch: int | None


# The facts of the virtual replica whose code runs in this context (None: the process's).
_replica: ContextVar[_Replica | None] = ContextVar("aloader_replica", default=None)


@contextlib.contextmanager
def as_replica(info: WorkerInfo | None, epoch: int | None) -> Iterator[None]:
    """Within the block (and the tasks and threads started in it), ``get_worker_info()`` is
    ``info`` and :func:`served_epoch` is ``epoch``: a virtual replica that stands for worker
    ``info`` (None: the loader's process) of the run that saved it."""
    token = _replica.set(_Replica(info, epoch))
    try:
        yield
    finally:
        _replica.reset(token)


def served_epoch() -> int | None:
    """The loader epoch this worker process is serving, or None outside workers."""
    replica = _replica.get()
    return _served_epoch if replica is None else replica.epoch


def get_worker_info() -> WorkerInfo | None:
    """This worker process's :class:`WorkerInfo`, or None in the main process.

    While a loader finishes an epoch saved with another ``num_workers`` (see
    :meth:`aloader.DataLoader.load_state_dict`), each saved worker's replica sees the
    ``WorkerInfo`` it was saved with (None for one saved without workers), wherever it runs.

    An iterable dataset uses it to shard itself so that each worker reads a distinct part::

        info = aloader.get_worker_info()
        shards = all_shards if info is None else all_shards[info.id :: info.num_workers]
    """
    replica = _replica.get()
    return _worker_info if replica is None else replica.info


def _set_worker_info(info: WorkerInfo | None) -> None:
    global _worker_info
    _worker_info = info
    _mirror_to_torch()


def _set_served_epoch(epoch: int | None) -> None:
    global _served_epoch
    _served_epoch = epoch
    _mirror_to_torch()  # torch may have been imported since the worker started


def _mirror_to_torch() -> None:
    """Make torch's own ``torch.utils.data.get_worker_info()`` answer in this worker.

    A torch script's iterable dataset shards itself with torch's function, not aloader's;
    answering None there would make every worker yield the whole stream (each sample
    ``num_workers`` times, silently). torch keeps the answer in a module global, which is
    set here once torch is loaded (whichever way the user imported the function). The
    virtual replicas of a resumed epoch see the process's facts there, not their own.
    """
    global _torch_mirror
    info = _worker_info
    worker: Any = sys.modules.get("torch.utils.data._utils.worker")  # torch's private module
    if worker is None:
        return
    current = getattr(worker, "_worker_info", None)
    if info is None:
        if current is not None and current is _torch_mirror:  # ours: gone with aloader's
            worker._worker_info = _torch_mirror = None
        return
    if current is not None and current.id == info.id and current.dataset is info.dataset:
        return
    worker._worker_info = _torch_mirror = worker.WorkerInfo(
        id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=info.dataset)


def worker_slot() -> tuple[int, int]:
    """(worker id, number of workers) of this process: (0, 1) outside loader workers."""
    info = get_worker_info()
    if info is None:
        return 0, 1
    return int(info.id), int(info.num_workers)
