"""Collate: turn a list of samples into one batch (numpy in, numpy out).

SKELETON: the collate helper fills this module in. ``ColumnBatch`` is final.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

__all__ = ("ColumnBatch", "collate", "default_collate", "default_collate_fn_map", "default_convert")


class ColumnBatch(Sequence[tuple[Any, ...]]):
    """A batch of samples stored column-wise, as vectorised ``__getitems__`` produce it.

    Sample ``i`` is ``tuple(column[i] for column in columns)``, so user code that treats the batch
    as a list of samples works unchanged, while :func:`default_collate` returns the columns
    without unstacking and restacking them.
    """

    __slots__ = ("columns",)

    def __init__(self, columns: Sequence[Any]) -> None:
        if not columns:
            raise ValueError("ColumnBatch needs at least one column")
        self.columns = tuple(columns)

    def __len__(self) -> int:
        return len(self.columns[0])

    @overload
    def __getitem__(self, index: int) -> tuple[Any, ...]: ...
    @overload
    def __getitem__(self, index: slice) -> ColumnBatch: ...
    def __getitem__(self, index: int | slice) -> tuple[Any, ...] | ColumnBatch:
        if isinstance(index, slice):
            return ColumnBatch([column[index] for column in self.columns])
        return tuple(column[index] for column in self.columns)

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return zip(*self.columns, strict=True)

    def __repr__(self) -> str:
        return f"ColumnBatch(len={len(self)}, columns={len(self.columns)})"


CollateFnMap = dict[type | tuple[type, ...], Callable[..., Any]]
default_collate_fn_map: CollateFnMap = {}


def collate(batch: Any, *, collate_fn_map: CollateFnMap | None = None) -> Any:
    raise NotImplementedError


def default_collate(batch: Any) -> Any:
    raise NotImplementedError


def default_convert(data: Any) -> Any:
    raise NotImplementedError
