"""DistributedSampler: one rank's shard of a map-style dataset, with torch's padding rules."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sized

import numpy as np

from ._random import IndexArray, permutation
from ._sampler import Sampler, _iter_ints

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

    def _epoch_indices(self) -> IndexArray:
        n = len(self.dataset)
        if self.shuffle:
            seed = int(self.seed) + int(self.epoch)
            # Like torch.manual_seed, a negative seed wraps around to an unsigned one.
            rng = np.random.default_rng(seed % _UINT64 if seed < 0 else seed)
            indices = permutation(rng, n)
        else:
            indices = np.arange(n, dtype=np.int64)

        if not self.drop_last:
            # Pad by repeating the order cyclically (whole copies first if padding exceeds N).
            if 0 < n <= self.total_size:
                indices = np.resize(indices, self.total_size)
        else:
            indices = indices[: self.total_size]
        if len(indices) != self.total_size:
            raise AssertionError(
                f"Number of indices ({len(indices)}) does not match total_size ({self.total_size})"
            )

        shard = np.ascontiguousarray(indices[self.rank : self.total_size : self.num_replicas])
        if len(shard) != self.num_samples:
            raise AssertionError(
                f"Number of subsampled indices ({len(shard)}) does not match "
                f"num_samples ({self.num_samples})"
            )
        return shard

    def __iter__(self) -> Iterator[int]:
        """Iterate over this rank's indices for the current epoch."""
        # Built eagerly, as torch does: a set_epoch() after iter() does not affect this epoch.
        return _iter_ints(self._epoch_indices())

    def __len__(self) -> int:
        """``num_samples``: the number of indices this rank gets per epoch."""
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds the next shuffle together with ``seed``.

        Args:
            epoch: epoch number.
        """
        self.epoch = epoch
