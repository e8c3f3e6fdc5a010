"""What every stage of one epoch's chain shares (:class:`_Context`): the epoch, the worker
slot, the task group helper tasks run in, and what the epoch's reading has counted."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import anyio.abc
import numpy as np

_UINT64 = 1 << 64
# Items per block when a stage builds blocks itself (sync iterables, interleave).
_BLOCK = 256


@dataclass(frozen=True, eq=False)
class _Context:
    """What every stage of one epoch's chain shares.

    Attributes:
        epoch: the epoch (seeds shard orders and shuffles).
        worker_id: this loader worker's id (0 without workers).
        num_workers: loader workers per rank (1 without workers).
        group: the background task's task group, for stages that run helper tasks; None
            for an inline epoch (:meth:`Stream._loopless`), which no task may be started in:
            its chain runs in the consumer's own task, or with no event loop at all.
        reading: what the epoch's reading has counted so far, for the stages that count
            (the sources' stats, see :class:`aloader.sources._sharded.ShardedSource`), each under a
            key of its own. One dict per reading of an epoch (:meth:`Stream._reading_of`),
            kept by every chain that reading opens: one reopened after an interrupt, a
            shuffle or mix replaying its input, the stream resumed from a state it saved
            itself. So what is read again is never counted again.
        blocking: the chain runs with no event loop (a sync ``for``, :class:`_LocalPairs`):
            its stages must never await a real event (a local file is read on this thread).
    """

    epoch: int
    worker_id: int
    num_workers: int
    group: anyio.abc.TaskGroup | None
    reading: dict[Any, Any]
    blocking: bool = False

    @property
    def inline(self) -> bool:
        """Whether the chain runs with no task group (in the consumer's task, or with no
        event loop when ``blocking``): one stage step at a time, no helper task."""
        return self.group is None

    def spawn(self, fn: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Start ``fn`` as a helper task of the epoch (never in an inline one)."""
        if self.group is None:
            raise AssertionError("an inline epoch cannot start a task")
        self.group.start_soon(fn)

    def rng(self, base_seed: int) -> np.random.Generator:
        """A generator for one stage in this epoch and worker, reproducible from its seed."""
        return np.random.default_rng(
            [base_seed, self.epoch % _UINT64, self.worker_id, self.num_workers]
        )
