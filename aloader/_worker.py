"""Worker-process identity: ``get_worker_info()`` and the read-only ``WorkerInfo``."""

from __future__ import annotations

from typing import Any

__all__ = ("WorkerInfo", "get_worker_info")


class WorkerInfo:
    """What a worker process knows about itself (torch's ``WorkerInfo``).

    Attributes:
        id: this worker's number, in ``range(num_workers)``.
        num_workers: how many workers the loader runs.
        seed: this worker's seed (``base_seed + id``).
        dataset: this worker's own copy of the dataset.
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any
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


_worker_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """This worker process's :class:`WorkerInfo`, or None in the main process.

    An iterable dataset uses it to shard itself so that each worker reads a distinct part::

        info = aloader.get_worker_info()
        shards = all_shards if info is None else all_shards[info.id :: info.num_workers]
    """
    return _worker_info


def _set_worker_info(info: WorkerInfo | None) -> None:
    global _worker_info
    _worker_info = info
