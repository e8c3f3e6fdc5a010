"""ParquetRows: rows and batches, column selection, exactly-once by file and by row group
across ranks x workers, corrupt files, stats; pyarrow missing."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aloader
from aloader import DataLoader, ParquetRows, RecordError, SourceError
from aloader.workers._worker import WorkerInfo, _set_worker_info

pytestmark = pytest.mark.anyio
needs_pyarrow = pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None,
                                   reason="pyarrow is not installed")


@contextlib.contextmanager
def as_worker(worker_id: int, num_workers: int) -> Iterator[None]:
    """Pretend to be loader worker ``worker_id`` of ``num_workers`` (workers are simulated)."""
    _set_worker_info(WorkerInfo(id=worker_id, num_workers=num_workers, seed=worker_id,
                                dataset=None))
    try:
        yield
    finally:
        _set_worker_info(None)


async def collect(source: Any) -> list[Any]:
    return [item async for item in source]


def write(path: Path, start: int, rows: int, group_rows: int) -> Path:
    """ids start..start+rows in row groups of ``group_rows``, with a string and a struct."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = np.arange(start, start + rows, dtype=np.int64)
    noise = np.random.default_rng(start)
    table = pa.table({
        "id": ids,
        "name": [f"row{i}" for i in ids.tolist()],
        "point": [{"x": float(i), "y": -i} for i in ids.tolist()],
        "blob": [noise.bytes(200) for _ in range(rows)],  # incompressible
    })
    pq.write_table(table, path, row_group_size=group_rows)
    return path


def uneven(tmp_path: Path) -> list[Path]:
    """3 files of 1, 2 and 5 row groups (8 in all), 10 rows per group, ids 0..79."""
    return [write(tmp_path / "a.parquet", 0, 10, 10),
            write(tmp_path / "b.parquet", 10, 20, 10),
            write(tmp_path / "c.parquet", 30, 50, 10)]


def ids_of(rows: list[dict[str, Any]]) -> list[int]:
    return [row["id"] for row in rows]


# --------------------------------------------------------------------------- reading


@needs_pyarrow
async def test_rows_are_the_files_rows(tmp_path: Path, anyio_backend: str) -> None:
    import pyarrow.parquet as pq

    path = write(tmp_path / "x.parquet", 0, 250, 64)
    source = ParquetRows(path, batch_rows=50)
    rows = await collect(source)
    assert rows == pq.read_table(path).to_pylist()
    assert {k: v for k, v in rows[3].items() if k != "blob"} == {
        "id": 3, "name": "row3", "point": {"x": 3.0, "y": -3}}
    assert source.stats.records == 250 and source.stats.shards == 1
    metadata = pq.read_metadata(path)
    chunks = sum(metadata.row_group(g).column(c).total_compressed_size
                 for g in range(metadata.num_row_groups) for c in range(metadata.num_columns))
    assert source.stats.bytes == chunks + metadata.serialized_size + 8


@needs_pyarrow
async def test_only_the_requested_columns_are_read(tmp_path: Path, anyio_backend: str) -> None:
    path = write(tmp_path / "x.parquet", 0, 100, 30)
    everything = ParquetRows(path)
    await collect(everything)
    some = ParquetRows(path, columns=["id", "point.x"])
    rows = await collect(some)
    assert rows[7] == {"id": 7, "point": {"x": 7.0}}
    assert some.stats.bytes < everything.stats.bytes / 3  # the blobs were not read
    with pytest.raises(SourceError, match=r"x.parquet: no column 'nope'.*columns: blob, id"):
        await collect(ParquetRows(path, columns=["id", "nope"]))


@needs_pyarrow
async def test_batches_are_dicts_of_arrays(tmp_path: Path, anyio_backend: str) -> None:
    path = write(tmp_path / "x.parquet", 0, 250, 100)
    batches = await collect(ParquetRows(path, columns=["id", "name"], batch_rows=64,
                                        as_batches=True))
    assert all(set(b) == {"id", "name"} for b in batches)
    assert all(0 < len(b["id"]) <= 64 for b in batches)
    ids = np.concatenate([b["id"] for b in batches])
    assert ids.dtype == np.int64 and ids.tolist() == list(range(250))
    assert batches[0]["name"][1] == "row1"
    assert batches[0]["id"].flags.writeable
    loader = DataLoader(ParquetRows(path, columns=["id"], batch_rows=100, as_batches=True),
                        batch_size=None)
    assert [len(b["id"]) async for b in loader] == [100, 100, 50]


@needs_pyarrow
async def test_loader_collates_rows(tmp_path: Path, anyio_backend: str) -> None:
    path = write(tmp_path / "x.parquet", 0, 40, 16)
    loader = DataLoader(ParquetRows(path, columns=["id", "name"]), batch_size=16)
    batches = [b async for b in loader]
    assert batches[0]["id"].tolist() == list(range(16))
    assert batches[2]["name"] == [f"row{i}" for i in range(32, 40)]


# --------------------------------------------------------------------------- sharding


async def consume(paths: list[Path], ranks: int, workers: int, epoch: int = 0,
                  **options: Any) -> list[list[int]]:
    """The ids each of ``ranks x workers`` simulated consumers reads."""
    out = []
    for rank in range(ranks):
        for worker in range(workers):
            source = ParquetRows(paths, rank=rank, world_size=ranks, columns=["id"], **options)
            source.set_epoch(epoch)
            with as_worker(worker, workers):
                out.append(ids_of(await collect(source)))
    return out


@needs_pyarrow
async def test_one_file_is_split_by_row_group(tmp_path: Path, anyio_backend: str) -> None:
    path = write(tmp_path / "x.parquet", 0, 80, 10)  # 8 row groups
    parts = await consume([path], ranks=2, workers=2)
    assert sorted(i for part in parts for i in part) == list(range(80))
    assert [len(part) for part in parts] == [20, 20, 20, 20]
    assert parts[0] == [*range(0, 10), *range(40, 50)]  # row groups 0 and 4
    source = ParquetRows(path, rank=1, world_size=2)
    # rank 1's share is row groups 1, 3, 5, 7 (every 2nd); its worker 0 takes every 2nd of it
    assert source.units_for(0, worker_id=0, num_workers=2) == [(str(path), [1, 5])]


@needs_pyarrow
@pytest.mark.parametrize(("ranks", "workers"), [(2, 2), (1, 2), (3, 1), (2, 5), (1, 1)])
async def test_uneven_files_exactly_once(tmp_path: Path, anyio_backend: str, ranks: int,
                                         workers: int) -> None:
    """3 files of 1, 2 and 5 row groups: by file for up to 3 consumers, by row group beyond
    (even more consumers than row groups), shuffled or not, over epochs."""
    paths = uneven(tmp_path)
    orders = []
    for epoch in range(2):
        for shuffle in (False, True):
            parts = await consume(paths, ranks, workers, epoch, shuffle_shards=shuffle, seed=5)
            assert sorted(i for part in parts for i in part) == list(range(80))
            orders.append(parts)
    if ranks * workers > 1:
        assert orders[1] != orders[3]  # shuffled epochs differ


@needs_pyarrow
async def test_row_group_mode_counts_each_shard_once(tmp_path: Path, anyio_backend: str) -> None:
    paths = uneven(tmp_path)
    total = 0
    for worker in range(4):
        source = ParquetRows(paths, columns=["id"])
        with as_worker(worker, 4):
            await collect(source)
        total += source.stats.shards
    assert total == 3


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@needs_pyarrow
def test_real_workers_two_ranks(tmp_path: Path) -> None:
    """1 file of 8 row groups, 2 ranks x 2 worker processes: every row once."""
    path = write(tmp_path / "x.parquet", 0, 80, 10)
    ids: list[int] = []
    for rank in range(2):
        source = ParquetRows(path, rank=rank, world_size=2, columns=["id"])
        loader = DataLoader(source, batch_size=8, num_workers=2)
        ids.extend(i for batch in loader for i in batch["id"].tolist())
        assert source.stats.records == 40
    assert sorted(ids) == list(range(80))


# --------------------------------------------------------------------------- failures


def corrupt_pages(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(8, 400):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


@needs_pyarrow
@pytest.mark.parametrize("damage", ["garbage", "truncated", "pages", "empty"])
async def test_a_corrupt_file_is_a_located_record_error(tmp_path: Path, anyio_backend: str,
                                                        damage: str) -> None:
    paths = uneven(tmp_path)
    bad = paths[1]
    if damage == "garbage":
        bad.write_bytes(b"not parquet at all" * 10)
    elif damage == "truncated":
        bad.write_bytes(bad.read_bytes()[:-100])
    elif damage == "pages":
        corrupt_pages(bad)
    else:
        bad.write_bytes(b"")
    with pytest.raises(RecordError, match="b.parquet: not a readable Parquet file") as info:
        await collect(ParquetRows(paths, columns=["id", "name"]))
    assert info.value.source == str(bad)
    source = ParquetRows(paths, columns=["id", "name"], skip_errors=True)
    ids = ids_of(await collect(source))
    assert source.stats.skipped == 1
    assert set(ids) >= {*range(10), *range(30, 80)} and set(ids) <= set(range(80))


@needs_pyarrow
async def test_corrupt_footer_in_row_group_mode(tmp_path: Path, anyio_backend: str) -> None:
    paths = uneven(tmp_path)
    paths[2].write_bytes(b"junk")
    with as_worker(0, 4), pytest.raises(RecordError, match="c.parquet"):
        await collect(ParquetRows(paths))
    ids, skipped = [], 0
    for worker in range(4):
        source = ParquetRows(paths, columns=["id"], skip_errors=True)
        with as_worker(worker, 4):
            ids += ids_of(await collect(source))
        skipped += source.stats.skipped
    assert sorted(ids) == list(range(30)) and skipped == 1


@needs_pyarrow
async def test_a_vanished_file_keeps_its_os_error(tmp_path: Path, anyio_backend: str) -> None:
    paths = uneven(tmp_path)
    source = ParquetRows(paths)
    paths[0].unlink()
    with pytest.raises(FileNotFoundError) as info:
        await collect(source)
    assert "a.parquet" in "".join(info.value.__notes__)


@needs_pyarrow
def test_bad_arguments(tmp_path: Path) -> None:
    path = write(tmp_path / "x.parquet", 0, 10, 10)
    # URLs are taken (and read only when iterated: nothing is fetched here).
    assert ParquetRows([path, "https://example.com/x.parquet"]).shards[1].startswith("https")
    with pytest.raises(TypeError, match="columns should be a sequence"):
        ParquetRows(path, columns="id")
    with pytest.raises(ValueError, match="at least one column"):
        ParquetRows(path, columns=[])
    with pytest.raises(ValueError, match="batch_rows should be a positive integer"):
        ParquetRows(path, batch_rows=0)
    with pytest.raises(FileNotFoundError):
        ParquetRows(tmp_path / "missing.parquet")
    assert "ParquetRows" in aloader.__all__


def test_without_pyarrow_the_error_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"pip install aloader\[parquet\]"):
        ParquetRows(tmp_path / "x.parquet")


@needs_pyarrow
async def test_a_broken_row_group_keeps_the_rows_before_it(tmp_path: Path,
                                                           anyio_backend: str) -> None:
    """A file whose third row group cannot be read hands on the rows pyarrow's own reader
    gives before its error, then the error (or, skipping, nothing more of that file)."""
    import pyarrow.parquet as pq

    path = write(tmp_path / "x.parquet", 0, 40, 10)
    chunk = pq.read_metadata(path).row_group(2).column(0)  # the id column of row group 2
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + 16] = b"\xff" * 16  # its first page header cannot be read
    path.write_bytes(bytes(data))
    before: list[int] = []
    with pytest.raises(OSError):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=100, columns=["id"]):
            before.extend(batch.column(0).to_pylist())
    assert len(before) < 30
    source = ParquetRows(path, columns=["id"], batch_rows=100, skip_errors=True)
    assert ids_of(await collect(source)) == before
    assert (source.stats.records, source.stats.skipped) == (len(before), 1)
    got: list[int] = []
    with pytest.raises(RecordError, match="x.parquet: not a readable Parquet file"):
        async for row in ParquetRows(path, columns=["id"], batch_rows=100):
            got.append(row["id"])
    assert got == before
