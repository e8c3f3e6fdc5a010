"""DistributedSampler: one rank's shard of a map-style dataset, with torch's padding rules.

This module owns :class:`DistributedSampler` and the reading of a rank's place from the
process group or the environment (:func:`default_place`), which the sources' sharding
(:mod:`aloader.sources._sharding`) uses too.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np

from ._indices import _EPOCH_MAX, _blocks, _concat, _iter_chunks
from ._random import IndexArray, torch_randperm
from ._sampler import Sampler, _Stateful

__all__ = ("DistributedSampler", "default_place")


def default_place(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` with each None filled in as torch's DistributedSampler fills it.

    An initialized ``torch.distributed`` default process group gives its rank and world size,
    as torch's sampler asks it: a script that calls ``init_process_group(rank=r,
    world_size=w)`` itself (``mp.spawn``) sets no ``RANK``/``WORLD_SIZE``, and read from the
    environment alone each of its ranks would load the whole dataset. Without a group, the
    ``RANK`` and ``WORLD_SIZE`` environment variables torchrun sets, else rank 0 of 1.
    torch.distributed is only read if it is imported already.

    Raises:
        ValueError: if an environment variable used is not an integer.
    """
    if rank is not None and world_size is not None:
        return rank, world_size
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        if world_size is None:
            world_size = int(dist.get_world_size())
        if rank is None:
            rank = int(dist.get_rank())
        return rank, world_size
    if world_size is None:
        world_size = _env_int("WORLD_SIZE", 1)
    if rank is None:
        rank = _env_int("RANK", 0)
    return rank, world_size


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name} should be an integer, but got {name}={raw!r}"
        ) from None


def _slice_index(value: Any) -> None:
    """Raise what slicing a list with ``value`` raises when it is not an integer."""
    if not hasattr(type(value), "__index__"):
        raise TypeError("slice indices must be integers or None or have an __index__ method")


class DistributedSampler(_Stateful, Sampler[int]):
    """Sampler that restricts data loading to one rank's share of the dataset.

    Every rank builds the same order (when shuffling torch's,
    ``torch.randperm(N, generator=torch.Generator().manual_seed(seed + epoch))``, computed
    without torch by :func:`~aloader.data._random.torch_randperm`; else ``range(N)``), pads it by
    repeating it from its start (or truncates it with ``drop_last``) to a multiple of
    ``num_replicas``, and takes every ``num_replicas``-th index starting at ``rank``. For 10
    items over 4 ranks without shuffling, rank 1 gets ``[1, 5, 9]`` and rank 3 gets
    ``[3, 7, 1]``.

    Call :meth:`set_epoch` before each epoch to get a new order; otherwise every epoch repeats
    the same one. The dataset is assumed to keep its size.

    Index ``j`` of the shard is ``order[(rank + j * num_replicas) % N]``, computed a block at a
    time: without shuffling, a shard of a huge dataset starts at once in bounded memory (with
    shuffling the permutation of ``N`` is built first, as torch builds it).

    State (``state_dict()``, torchdata's protocol, which the DataLoader records at each epoch's
    start): the epoch, the seed and the world it was drawn for. Elastic resume: a state of a
    job on ``W`` ranks loaded by a DataLoader whose DistributedSampler has ``W'`` ranks resumes
    the same global order. Ranks are assumed to progress in lockstep, as DDP's do: every rank
    has consumed the same batches, so the global order's first ``consumed * W`` positions (and
    the positions of batches delivered out of order) are done. The rest of the global order,
    without the old world's padding, is partitioned among the ``W'`` ranks by the same rule
    (every ``W'``-th position, padded by repeating its start, or truncated with ``drop_last``):
    across the new ranks no sample of the epoch is skipped, and none is delivered twice beyond
    that padding. The epochs after it are ordinary ``W'`` epochs.

    Args:
        dataset: the dataset to sample from (only its ``len()`` is used).
        num_replicas: number of processes; defaults to the world size of torch.distributed's
            initialized process group, else the ``WORLD_SIZE`` environment variable (set by
            torchrun), else 1.
        rank: this process's rank; defaults to the process group's rank, else the ``RANK``
            environment variable, else 0.
        shuffle: shuffle the indices.
        seed: shuffling seed; must be the same on every rank.
        drop_last: drop the tail so that the data divides evenly, instead of padding it.

    Raises:
        ValueError: if ``rank`` is outside ``[0, num_replicas - 1]`` or an environment variable
            is not an integer.
    """

    dataset: Sized
    num_replicas: int
    rank: int
    epoch: int
    drop_last: bool
    num_samples: int
    total_size: int
    shuffle: bool
    seed: int

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        rank, num_replicas = default_place(rank, num_replicas)
        if rank >= num_replicas or rank < 0:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        n = len(self.dataset)
        if self.drop_last and n % self.num_replicas != 0:
            # The nearest length below N that divides evenly, so every rank gets as much data.
            self.num_samples = math.ceil((n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.shuffle = shuffle
        self.seed = seed
        # An elastic resume's rest of the epoch, to be drawn next (see the class docstring).
        self._remaining: dict[str, Any] | None = None

    def _epoch_chunks(self) -> Iterator[IndexArray]:
        """This epoch's shard as consecutive int64 arrays; the order is drawn now."""
        n = len(self.dataset)
        self._check_numbers(n)
        total = self.total_size
        # The length torch's truncated (or cyclically padded) list reaches; torch asserts that
        # it is total_size.
        padded = min(n, total) if self.drop_last else total if 0 < n <= total else n
        if padded != total:
            raise AssertionError(
                f"Number of indices ({padded}) does not match total_size ({total})"
            )
        order: IndexArray | None = None
        if self.shuffle:
            # torch's own order: randperm of a generator seeded with seed + epoch (wrapped
            # modulo 2**64 as manual_seed wraps it), made without torch.
            order = torch_randperm(n, int(self.seed) + int(self.epoch))
        remaining, self._remaining = self._remaining, None
        if remaining is not None:
            return self._elastic(order, n, remaining)
        return self._shard(order, n)

    def _check_numbers(self, n: int) -> None:
        """Raise, at the epoch's start, the error torch's ``__iter__`` raises where
        ``num_replicas`` or ``rank`` is not an integer (``2.5``, ``inf``, ``5e-324`` of an empty
        dataset): torch accepts them until it pads and slices its list of indices with them.
        Its steps are followed on lengths only, so that the first one that fails gives
        torch's type and message, with a note naming the arguments."""
        world, rank, total = self.num_replicas, self.rank, self.total_size
        if all(hasattr(type(value), "__index__") for value in (world, rank, total)):
            return
        try:
            if self.drop_last:
                _slice_index(total)  # indices[:total_size]
            else:
                padding = total - n
                # indices * ceil(padding / n) when padding > n, then [:padding]
                if not padding <= n and n * math.ceil(padding / n) > sys.maxsize:
                    raise OverflowError("cannot fit 'int' into an index-sized integer")
                _slice_index(padding)
            for value in (rank, total, world):  # indices[rank:total_size:num_replicas]
                _slice_index(value)
        except Exception as exc:
            exc.add_note(f"DistributedSampler: num_replicas={world!r} and rank={rank!r} should "
                         f"be integers")
            raise

    def _elastic_size(self, remaining: dict[str, Any]) -> int:
        """This rank's share of an elastic resume's rest of the epoch."""
        m = int(remaining["size"])
        world = self.num_replicas
        if self.drop_last and m % world != 0:
            return max(0, math.ceil((m - world) / world))
        return math.ceil(m / world)

    @staticmethod
    def _rest_positions(remaining: dict[str, Any]) -> IndexArray:
        """The global order's positions left of an elastic resume's epoch: ``[start,
        stop)`` without the ``excluded`` ranges of the old ranks' shards (``[a, b]``: the
        shard positions ``a`` to ``b - 1`` of every old rank; ``[a, b, r]``: of rank ``r``)."""
        world0 = int(remaining["num_replicas"])
        positions = np.arange(int(remaining["start"]), int(remaining["stop"]), dtype=np.int64)
        excluded = remaining["excluded"]
        if excluded:
            done = np.zeros(len(positions), dtype=bool)
            rank_pos = positions // world0
            for a, b, *rank in excluded:
                hit = (rank_pos >= a) & (rank_pos < b)
                if rank:
                    hit &= positions % world0 == rank[0]
                done |= hit
            positions = positions[~done]
        return positions

    def _elastic(self, order: IndexArray | None, n: int, remaining: dict[str, Any]
                 ) -> Iterator[IndexArray]:
        positions = self._rest_positions(remaining)
        rest = positions if order is None else order[positions]
        m = len(rest)
        size = self._elastic_size(remaining)
        if size == 0 or m == 0:
            return iter(())
        picks = np.arange(size, dtype=np.int64) * self.num_replicas + self.rank
        picks %= m
        return iter((rest[picks],))

    def state_dict(self) -> dict[str, Any]:
        """The epoch, seed and world this sampler draws its next epoch for (JSON builtins)."""
        return {
            "epoch": int(self.epoch), "seed": int(self.seed), "shuffle": bool(self.shuffle),
            "drop_last": bool(self.drop_last), "num_replicas": int(self.num_replicas),
            "rank": int(self.rank), "length": len(self.dataset),
            "remaining": None if self._remaining is None else dict(self._remaining),
        }

    def _load_state(self, state: Any, *, apply: bool) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"DistributedSampler state should be a dict, "
                             f"but got {type(state).__name__}")
        for name, kind in (("epoch", int), ("seed", int), ("shuffle", bool), ("length", int),
                           ("num_replicas", int), ("drop_last", bool)):
            value = state.get(name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"DistributedSampler state: field {name!r} should be "
                                 f"{kind.__name__}, but got {value!r}")
        for name, mine in (("seed", self.seed), ("shuffle", self.shuffle),
                           ("length", len(self.dataset))):
            if state[name] != mine:
                raise ValueError(f"DistributedSampler state: {name} differs: the state has "
                                 f"{state[name]!r}, this sampler {mine!r}")
        remaining = state.get("remaining")
        if remaining is not None and state["num_replicas"] != self.num_replicas:
            raise ValueError("DistributedSampler state: an epoch already resumed on another "
                             "world size cannot be resumed on a third one")
        if apply:
            self.epoch = state["epoch"]
            self._remaining = None if remaining is None else dict(remaining)

    def _resume_elastic(self, state: dict[str, Any], consumed: int | list[int | None],
                        excluded: list[list[int]]) -> None:
        """Make the next epoch the rest of the epoch a job on ``state["num_replicas"]`` ranks
        was in, each of its ranks having consumed ``consumed`` indices (or rank ``r``
        ``consumed[r]``, None: all of its shard) and the ranges ``excluded`` of its shard
        (``[a, b]``, or ``[a, b, r]`` of rank ``r`` alone; see the class docstring)."""
        world0 = int(state["num_replicas"])
        n = len(self.dataset)
        if state["drop_last"] and n % world0 != 0:
            total0 = math.ceil((n - world0) / world0) * world0
        else:
            total0 = math.ceil(n / world0) * world0
        excluded = [[int(v) for v in entry] for entry in excluded]
        if isinstance(consumed, list):  # each rank's own progress (merged ranks' states)
            counts = [total0 // world0 if c is None else c for c in consumed]
            low = min(counts)
            excluded += [[low, c, r] for r, c in enumerate(counts) if c > low]
            consumed = low
        start = min(consumed * world0, n)
        stop = min(n, total0)
        start = min(start, stop)
        self._remaining = {"num_replicas": world0, "start": start, "stop": stop,
                           "excluded": excluded, "size": 0}
        self._remaining["size"] = len(self._rest_positions(self._remaining))

    def _shard(self, order: IndexArray | None, n: int) -> Iterator[IndexArray]:
        for start, size in _blocks(self.num_samples):
            positions = np.arange(start, start + size, dtype=np.int64)
            positions *= self.num_replicas
            positions += self.rank
            if self.total_size > n:  # padded: positions past N wrap to the start
                positions %= n
            yield positions if order is None else order[positions]

    def _epoch_indices(self) -> IndexArray | None:
        if self.num_samples > _EPOCH_MAX and self._remaining is None:
            return None
        return _concat(self._epoch_chunks())

    def __iter__(self) -> Iterator[int]:
        """Iterate over this rank's indices for the current epoch."""
        # The order is drawn now, as torch does: a set_epoch() after iter() does not affect
        # this epoch. Only the arithmetic on it is lazy.
        return _iter_chunks(self._epoch_chunks())

    def __len__(self) -> int:
        """``num_samples``: the number of indices this rank gets per epoch (this rank's share
        of the rest of the epoch when an elastic resume is pending)."""
        if self._remaining is not None:
            return self._elastic_size(self._remaining)
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds the next shuffle together with ``seed``.

        Args:
            epoch: epoch number.
        """
        self.epoch = epoch
