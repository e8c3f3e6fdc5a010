"""A block of ParquetRows' rows handed on is not kept by any stage of the (loopless, local
files) chain, nor by the consumer, once the next one is asked for: it is freed before the
next block is made (which then reuses its memory while it is in the CPU's caches), whether
the stream is taken by ``async for``, a plain ``for`` or a DataLoader."""

from __future__ import annotations

import importlib.util
import weakref
from pathlib import Path
from typing import Any

import pytest

import aloader.sources._parquet as parquet_module
from aloader import DataLoader, ParquetRows


class Block(list[Any]):
    """A list that a weak reference can follow."""


async def consume(stream: Any, how: str) -> list[Any]:
    if how == "async for":
        return [item async for item in stream]
    batches = [batch async for batch in DataLoader(stream, batch_size=4, collate_fn=list)]
    return [item for batch in batches for item in batch]


pytestmark = pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None,
                                reason="pyarrow is not installed")


def watched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ParquetRows, list[bool]]:
    """A source over two files of 100 rows in blocks of 8, and what is filled, for each block
    made after the first, with whether the block before it was still alive."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in range(2):
        pq.write_table(pa.table({"id": list(range(f * 100, f * 100 + 100))}),
                       tmp_path / f"part-{f}.parquet", row_group_size=50)
    monkeypatch.setattr(parquet_module, "ROW_BLOCK", 8)
    made = parquet_module._rows_of
    last: list[weakref.ref[Block]] = []
    alive: list[bool] = []

    def rows_of(piece: Any) -> list[Any]:
        if last:
            alive.append(last[-1]() is not None)
        block = Block(made(piece))
        last.append(weakref.ref(block))
        return block

    monkeypatch.setattr(parquet_module, "_rows_of", rows_of)
    return ParquetRows(sorted(map(str, tmp_path.iterdir())), batch_rows=20), alive


@pytest.mark.parametrize("how", ["async for", "loader"])
async def test_parquet_rows_free_a_block_before_making_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, anyio_backend: str) -> None:
    source, alive = watched(tmp_path, monkeypatch)
    rows = await consume(source, how)
    assert [row["id"] for row in rows] == list(range(200))
    assert len(alive) > 20
    assert not any(alive)


def test_parquet_rows_in_a_plain_for_free_a_block_before_making_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, alive = watched(tmp_path, monkeypatch)
    assert [row["id"] for row in source] == list(range(200))
    assert len(alive) > 20
    assert not any(alive)
