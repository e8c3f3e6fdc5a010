"""Samplers. SKELETON: the samplers helper fills this module in."""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = (
    "BatchSampler", "RandomSampler", "Sampler", "SequentialSampler", "SubsetRandomSampler",
    "WeightedRandomSampler",
)

T_co = TypeVar("T_co", covariant=True)


class Sampler(Generic[T_co]):
    pass


class SequentialSampler(Sampler[int]):
    pass


class RandomSampler(Sampler[int]):
    pass


class SubsetRandomSampler(Sampler[int]):
    pass


class WeightedRandomSampler(Sampler[int]):
    pass


class BatchSampler(Sampler[list[int]]):
    pass
