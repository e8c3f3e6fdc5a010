"""ParquetRows' fast path for rows: rows made in pieces of ROW_BLOCK on the consumer's side,
one Arrow batch read ahead in the read thread. The output, the counts, resume, early close and
errors must be exactly what they were with whole batches converted in the thread."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aloader.sources._parquet as parquet_module
from aloader import ParquetRows, RecordError

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None,
                       reason="pyarrow is not installed"),
]


def write(path: Path, start: int, rows: int, group_rows: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = np.arange(start, start + rows, dtype=np.int64)
    table = pa.table({
        "id": ids,
        "name": [f"row{i}" for i in ids.tolist()],
        "label": pa.array([None if i % 7 == 0 else int(i) % 5 for i in ids.tolist()],
                          pa.int32()),
        "point": [{"x": float(i), "y": -i} for i in ids.tolist()],
    })
    pq.write_table(table, path, row_group_size=group_rows)
    return path


def files(tmp_path: Path) -> list[Path]:
    """3 files: 23 rows in groups of 10, 10 rows in one group, 31 rows in groups of 8."""
    return [write(tmp_path / "a.parquet", 0, 23, 10), write(tmp_path / "b.parquet", 23, 10, 10),
            write(tmp_path / "c.parquet", 33, 31, 8)]


def expected(paths: list[Path]) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return [row for path in paths for row in pq.read_table(path).to_pylist()]


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Pieces of 4 rows, so that batches of 9 end within a piece and pieces within groups."""
    monkeypatch.setattr(parquet_module, "ROW_BLOCK", 4)
    return 4


async def test_rows_made_in_pieces_are_the_files_rows(tmp_path: Path, anyio_backend: str,
                                                      small_blocks: int) -> None:
    paths = files(tmp_path)
    source = ParquetRows(paths, batch_rows=9)
    rows = [row async for row in source]
    assert rows == expected(paths)
    # the same Python types as to_pylist gives (a null stays None, a struct is a dict)
    assert [type(v) for v in rows[7].values()] == [int, str, type(None), dict]
    assert (source.stats.records, source.stats.shards) == (64, 3)
    assert source.stats.bytes > 0
    # again, a second epoch (the shared read thread taken again)
    assert [row async for row in source] == rows


async def test_blocks_handed_on_hold_at_most_row_block_rows(
        tmp_path: Path, anyio_backend: str, small_blocks: int) -> None:
    """The rows of a batch of 9 reach the stream as blocks of at most 4 rows, made in the
    event loop's thread (the consumer's), not in the read thread."""
    paths = files(tmp_path)
    source = ParquetRows(paths, batch_rows=9)
    sizes: list[int] = []
    threads: set[int] = set()
    make = source._items

    def items(got: Any) -> Any:
        for block in make(got):
            sizes.append(len(block))
            threads.add(threading.get_ident())
            yield block

    source._items = items  # type: ignore[method-assign]
    rows = [row async for row in source]
    assert rows == expected(paths)
    assert max(sizes) == small_blocks and sum(sizes) == 64
    assert threads == {threading.get_ident()}


@pytest.mark.parametrize("taken", [0, 1, 4, 5, 9, 22, 23, 33, 40, 63])
async def test_resume_mid_piece_is_exact(tmp_path: Path, anyio_backend: str, small_blocks: int,
                                         taken: int) -> None:
    paths = files(tmp_path)
    source = ParquetRows(paths, batch_rows=9)
    iterator = aloader_iter(source)
    got = [await iterator.__anext__() for _ in range(taken)]
    state = json.loads(json.dumps(source.state_dict()))
    await iterator.aclose()
    fresh = ParquetRows(paths, batch_rows=9)
    fresh.load_state_dict(state)
    assert got + [row async for row in fresh] == expected(paths)


def aloader_iter(source: ParquetRows) -> Any:
    return source.__aiter__()


async def test_closing_early_waits_for_the_read_ahead(tmp_path: Path, anyio_backend: str,
                                                      small_blocks: int) -> None:
    """Leaving after the first rows closes the pass while the next batch's read may be queued:
    every file ends closed, and the next epoch reads everything again."""
    paths = files(tmp_path)
    source = ParquetRows(paths, batch_rows=9)
    iterator = aloader_iter(source)
    first = [await iterator.__anext__() for _ in range(2)]
    await iterator.aclose()
    assert first == expected(paths)[:2]
    assert [row async for row in source] == expected(paths)


async def test_records_per_rank_stops_within_a_batch(tmp_path: Path, anyio_backend: str,
                                                     small_blocks: int) -> None:
    paths = files(tmp_path)
    source = ParquetRows(paths, batch_rows=9, records_per_rank=30)
    assert [row async for row in source] == expected(paths)[:30]


async def test_a_corrupt_file_after_good_ones_with_the_read_ahead(
        tmp_path: Path, anyio_backend: str, small_blocks: int) -> None:
    """The read ahead meets the corrupt file while the rows before it are still being made:
    they are all handed on first, then the located error (or, skipping, the rest)."""
    paths = files(tmp_path)
    bad = tmp_path / "b.parquet"
    bad.write_bytes(b"PAR1" + b"\x00" * 64)
    good = [p for p in paths if p != bad]
    got: list[dict[str, Any]] = []
    with pytest.raises(RecordError, match="b.parquet"):
        async for row in ParquetRows(paths, batch_rows=9):
            got.append(row)
    assert got == expected(good[:1])
    skipping = ParquetRows(paths, batch_rows=9, skip_errors=True)
    assert [row async for row in skipping] == expected(good)
    assert skipping.stats.skipped == 1


async def test_batches_keep_batch_rows(tmp_path: Path, anyio_backend: str,
                                       small_blocks: int) -> None:
    """ROW_BLOCK is about rows: column batches still hold up to batch_rows rows."""
    paths = files(tmp_path)
    batches = [b async for b in ParquetRows(paths, batch_rows=9, as_batches=True)]
    assert [len(b["id"]) for b in batches] == [9, 9, 5, 9, 1, 9, 9, 9, 4]
    assert np.concatenate([b["id"] for b in batches]).tolist() == list(range(64))


@pytest.mark.parametrize("skip", [False, True])
async def test_a_value_python_cannot_hold_keeps_its_error(tmp_path: Path, anyio_backend: str,
                                                          small_blocks: int, skip: bool) -> None:
    """A timestamp past datetime's range fails in to_pylist, now made on the consumer's side:
    the same OverflowError as before (it is not a corrupt file, so skip_errors does not skip
    it), after the rows before it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    values = [0] * 6 + [2**62]
    pq.write_table(pa.table({"t": pa.array(values, pa.timestamp("us"))}), path)
    got: list[Any] = []
    with pytest.raises(OverflowError):
        async for row in ParquetRows(path, batch_rows=9, skip_errors=skip):
            got.append(row)
    assert len(got) == 4  # the first piece of 4 rows; the second holds the bad value
