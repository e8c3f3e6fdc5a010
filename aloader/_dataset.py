"""Datasets. SKELETON: the datasets helper fills this module in."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

__all__ = (
    "ArrayDataset", "ChainDataset", "ConcatDataset", "Dataset", "IterableDataset",
    "StackDataset", "Subset", "TensorDataset", "random_split",
)

T_co = TypeVar("T_co", covariant=True)


class Dataset(Generic[T_co]):
    pass


class IterableDataset(Dataset[T_co]):
    pass


class ArrayDataset(Dataset[tuple[Any, ...]]):
    pass


TensorDataset = ArrayDataset


class StackDataset(Dataset[Any]):
    pass


class ConcatDataset(Dataset[T_co]):
    pass


class ChainDataset(IterableDataset[T_co]):
    pass


class Subset(Dataset[T_co]):
    pass


def random_split(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError
