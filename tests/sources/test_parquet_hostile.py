"""Attacks on ParquetRows' pieces (ROW_BLOCK) and read-ahead: row groups smaller and larger
than a piece, empty row groups and files, a missing column, resume inside a piece, the
sharding of row groups over ranks x workers, and a plain ``for`` (a local ParquetRows is a
loopless stream, so its sync ``for`` runs its chain with no event loop)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from sourcetools import as_worker, collect, roundtrip, through_interrupts

from aloader import ParquetRows, RecordError, SourceError

pytestmark = [pytest.mark.hostile, pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None,
                                reason="pyarrow is not installed")]


def write(path: Path, groups: list[int]) -> list[dict[str, Any]]:
    """A file of row groups of these sizes (0: an empty row group); its rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.string()), ("x", pa.int64())])
    rows: list[dict[str, Any]] = []
    with pq.ParquetWriter(path, schema) as writer:
        for g, n in enumerate(groups):
            table = pa.table({"id": [f"{path.stem}{g}_{i}" for i in range(n)],
                              "x": list(range(len(rows), len(rows) + n))}, schema=schema)
            writer.write_table(table)
            rows += table.to_pylist()
    return rows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("pq")
    layout = {"a": [3000, 3000, 3000, 1000], "b": [5000], "c": [4096, 1], "d": [],
              "e": [3, 0, 5000, 0, 0, 2], "f": [1]}
    paths, rows = [], []
    for name, groups in layout.items():
        path = directory / f"{name}.parquet"
        rows += write(path, groups)
        paths.append(str(path))
    return paths, rows


@pytest.mark.parametrize("batch_rows", [1000, 4096, 4097, 65536])
async def test_rows_whatever_the_groups_and_batches(
        dataset: tuple[list[str], list[dict[str, Any]]], batch_rows: int,
        anyio_backend: str) -> None:
    paths, rows = dataset
    source = ParquetRows(paths, batch_rows=batch_rows)
    assert await collect(source) == rows
    assert source.stats.records == len(rows)
    assert source.stats.shards == len(paths)


def test_sync_for_over_local_files(dataset: tuple[list[str], list[dict[str, Any]]]) -> None:
    # ParquetRows over local files is loopless (ShardedSource's rule): its sync for drives the
    # chain on this thread with no event loop, so its reads may not wait on a loop (they
    # waited on the read thread's waiter: "aloader needs a running asyncio or trio event
    # loop").
    paths, rows = dataset
    source = ParquetRows(paths, batch_rows=4097)
    assert source._loopless()
    assert list(source) == rows
    assert source.stats.records == len(rows) and source.stats.shards == len(paths)
    assert [b["x"].tolist() for b in ParquetRows(paths, batch_rows=4097, as_batches=True)] \
        == [b["x"].tolist() for b in anyio.run(collect, ParquetRows(paths, batch_rows=4097,
                                                                    as_batches=True))]


def test_sync_for_row_group_mode_and_quota(
        dataset: tuple[list[str], list[dict[str, Any]]]) -> None:
    # Fewer files than consumers: the plan reads footers (in a thread on a loop).
    paths, rows = dataset
    seen: list[dict[str, Any]] = []
    for worker in range(8):
        source = ParquetRows(paths, batch_rows=999)
        with as_worker(worker, 8, dataset=source):
            seen += list(source)
    assert sorted(seen, key=json.dumps) == sorted(rows, key=json.dumps)
    quota = ParquetRows(paths, batch_rows=999, records_per_rank=len(rows) + 10)
    got = list(quota)
    assert got == rows + rows[:10] and quota.stats.repeated == 10


def test_sync_for_resume_inside_a_piece(
        dataset: tuple[list[str], list[dict[str, Any]]]) -> None:
    paths, rows = dataset
    for k in (1, 4097, len(rows) - 1):
        source = ParquetRows(paths, batch_rows=5000)
        iterator = iter(source)
        head = [next(iterator) for _ in range(k)]
        state = roundtrip(source.state_dict())
        iterator.close()  # type: ignore[attr-defined]
        fresh = ParquetRows(paths, batch_rows=5000)
        fresh.load_state_dict(state)
        assert head + list(fresh) == rows, k


async def test_resume_inside_a_piece(dataset: tuple[list[str], list[dict[str, Any]]],
                                     anyio_backend: str) -> None:
    paths, rows = dataset
    for k in (0, 4095, 4096, 4097, 10001, len(rows)):
        source = ParquetRows(paths, batch_rows=5000)
        iterator = source._open()
        head = [await iterator.__anext__() for _ in range(k)]
        state = roundtrip(source.state_dict())
        await iterator.aclose()
        fresh = ParquetRows(paths, batch_rows=5000)
        fresh.load_state_dict(state)
        assert head + await collect(fresh) == rows, k


def test_resume_on_other_files_is_refused(
        dataset: tuple[list[str], list[dict[str, Any]]]) -> None:
    """ParquetRows resumes by counting rows: a count taken over one list of files means
    nothing over another (a file landed in the directory, another split), so the resume is
    refused naming the files, as the byte-stream sources refuse a shard of another name."""
    paths, rows = dataset
    source = ParquetRows(paths, batch_rows=5000)
    iterator = iter(source)
    for _ in range(7):
        next(iterator)
    state = roundtrip(source.state_dict())
    iterator.close()  # type: ignore[attr-defined]
    for other in (paths[1:], [paths[1], paths[0], *paths[2:]], [*paths, paths[0]]):
        with pytest.raises(ValueError, match="files"):
            ParquetRows(other, batch_rows=5000).load_state_dict(state)
    fresh = ParquetRows(list(paths), batch_rows=5000)
    fresh.load_state_dict(state)
    assert len(list(fresh)) == len(rows) - 7


@pytest.mark.parametrize(("world_size", "num_workers"), [(2, 1), (3, 5)])
def test_ranks_by_row_group_exactly_once(
        dataset: tuple[list[str], list[dict[str, Any]]], world_size: int,
        num_workers: int) -> None:
    paths, rows = dataset
    seen: list[dict[str, Any]] = []
    for rank in range(world_size):
        for worker in range(num_workers):
            source = ParquetRows(paths, batch_rows=777, rank=rank, world_size=world_size,
                                 even_ranks=False, shuffle_shards=True, seed=1)
            with as_worker(worker, num_workers, dataset=source, seed=0):
                seen += list(source)
    assert sorted(seen, key=json.dumps) == sorted(rows, key=json.dumps)


@pytest.mark.parametrize("columns", [["nope"], ["id", "nope"]])
async def test_a_missing_column_is_a_clear_error(
        dataset: tuple[list[str], list[dict[str, Any]]], columns: list[str],
        anyio_backend: str) -> None:
    paths, _ = dataset
    for skip in (False, True):
        with pytest.raises(SourceError, match="no column 'nope'") as caught:
            await collect(ParquetRows(paths, columns=columns, skip_errors=skip))
        assert not isinstance(caught.value, RecordError)  # never skipped as a bad record


def test_sync_for_interrupted_in_a_read_goes_on_exactly(
        dataset: tuple[list[str], list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch) -> None:
    import itertools

    import aloader.sources._parquet as parquet

    paths, rows = dataset
    real = parquet._UnitReader.next
    calls = itertools.count(1)

    def next_batch(self: Any) -> Any:
        if next(calls) in (2, 5):
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(parquet._UnitReader, "next", next_batch)
    iterator = iter(ParquetRows(paths, batch_rows=4097))
    got, interrupts = through_interrupts(iterator)
    assert interrupts == 2
    assert got == rows
