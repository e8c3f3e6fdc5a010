"""DistributedSampler: one rank's shard of a map-style dataset, with torch's padding rules.

This module owns :class:`DistributedSampler` and the reading of a rank's place from the
environment (``RANK``, ``WORLD_SIZE``; :func:`_env_int`), which the sources' sharding
(:mod:`aloader._sharding`) uses too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sized

import numpy as np

from ._random import IndexArray, permutation
from ._sampler import _EPOCH_MAX, Sampler, _blocks, _concat, _iter_chunks

__all__ = ("DistributedSampler",)

_UINT64 = 1 << 64


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


class DistributedSampler(Sampler[int]):
    """Sampler that restricts data loading to one rank's share of the dataset.

    Every rank builds the same order (a permutation seeded by ``seed + epoch`` when shuffling,
    else ``range(N)``), pads it by repeating it from its start (or truncates it with
    ``drop_last``) to a multiple of ``num_replicas``, and takes every ``num_replicas``-th index
    starting at ``rank``. For 10 items over 4 ranks without shuffling, rank 1 gets
    ``[1, 5, 9]`` and rank 3 gets ``[3, 7, 1]``.

    Call :meth:`set_epoch` before each epoch to get a new order; otherwise every epoch repeats
    the same one. The dataset is assumed to keep its size.

    Index ``j`` of the shard is ``order[(rank + j * num_replicas) % N]``, computed a block at a
    time: without shuffling, a shard of a huge dataset starts at once in bounded memory (with
    shuffling the permutation of ``N`` is built first, as torch builds it).

    Args:
        dataset: the dataset to sample from (only its ``len()`` is used).
        num_replicas: number of processes; defaults to the ``WORLD_SIZE`` environment variable
            (set by torchrun), else 1.
        rank: this process's rank; defaults to the ``RANK`` environment variable, else 0.
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
        if num_replicas is None:
            num_replicas = _env_int("WORLD_SIZE", 1)
        if rank is None:
            rank = _env_int("RANK", 0)
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

    def _epoch_chunks(self) -> Iterator[IndexArray]:
        """This epoch's shard as consecutive int64 arrays; the order is drawn now."""
        n = len(self.dataset)
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
            seed = int(self.seed) + int(self.epoch)
            # Like torch.manual_seed, a negative seed wraps around to an unsigned one.
            rng = np.random.default_rng(seed % _UINT64 if seed < 0 else seed)
            order = permutation(rng, n)
        return self._shard(order, n)

    def _shard(self, order: IndexArray | None, n: int) -> Iterator[IndexArray]:
        for start, size in _blocks(self.num_samples):
            positions = np.arange(start, start + size, dtype=np.int64)
            positions *= self.num_replicas
            positions += self.rank
            if self.total_size > n:  # padded: positions past N wrap to the start
                positions %= n
            yield positions if order is None else order[positions]

    def _epoch_indices(self) -> IndexArray | None:
        if self.num_samples > _EPOCH_MAX:
            return None
        return _concat(self._epoch_chunks())

    def __iter__(self) -> Iterator[int]:
        """Iterate over this rank's indices for the current epoch."""
        # The order is drawn now, as torch does: a set_epoch() after iter() does not affect
        # this epoch. Only the arithmetic on it is lazy.
        return _iter_chunks(self._epoch_chunks())

    def __len__(self) -> int:
        """``num_samples``: the number of indices this rank gets per epoch."""
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds the next shuffle together with ``seed``.

        Args:
            epoch: epoch number.
        """
        self.epoch = epoch
