"""ParquetRows over s3:// (moto's S3 server on 127.0.0.1, behind the fault proxy) and http://
(the tests' server): the same rows as local files, bounded ranged reads of the footer and of
the chosen columns only, exactly-once by row group across ranks x workers, resume, retries and
located errors, on asyncio and trio."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sourcetools import collect, interrupted, local_s3, read_as_consumers, reset_proxy

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from aloader import (  # noqa: E402
    DataLoader,
    FetchError,
    ObjectNotFoundError,
    ParquetRows,
    RecordError,
)

pytestmark = pytest.mark.anyio

BUCKET = "parquet-bucket"
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}
FOOTER_READ = 64 * 1024  # what pyarrow reads at a file's end first


def parquet_bytes(tmp_path: Path, name: str, start: int, rows: int, group_rows: int) -> bytes:
    """ids start..start+rows in row groups of ``group_rows``, a string and 400 random bytes."""
    noise = np.random.default_rng(start)
    ids = np.arange(start, start + rows, dtype=np.int64)
    table = pa.table({"id": ids, "name": [f"row{i}" for i in ids.tolist()],
                      "blob": [noise.bytes(400) for _ in range(rows)]})
    path = tmp_path / name
    pq.write_table(table, path, row_group_size=group_rows)
    return path.read_bytes()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """a: 1 row group (ids 0..49), b: 2 (50..149), c: 8 of 100 rows (150..949, ~330 KB)."""
    tmp = tmp_path_factory.mktemp("parquet")
    return {"a.parquet": parquet_bytes(tmp, "a.parquet", 0, 50, 50),
            "b.parquet": parquet_bytes(tmp, "b.parquet", 50, 100, 50),
            "c.parquet": parquet_bytes(tmp, "c.parquet", 150, 800, 100)}


@pytest.fixture(scope="module")
def s3(files: dict[str, bytes]) -> Iterator[Any]:
    with local_s3(BUCKET, {f"pq/{name}": body for name, body in files.items()}
                  | {"pq/notes.txt": b"not parquet"}) as server:
        yield server


@pytest.fixture
def proxy(s3: Any) -> Iterator[Any]:
    yield from reset_proxy(s3)


def local(tmp_path: Path, files: dict[str, bytes]) -> list[str]:
    for name, body in files.items():
        (tmp_path / name).write_bytes(body)
    return [str(tmp_path / name) for name in sorted(files)]


def ranges(headers: list[str | None]) -> list[tuple[int, int]]:
    """``(start, end)`` of ``bytes=first-last`` headers; a request without a bounded range
    fails the test (a remote Parquet read asks only for what it reads)."""
    out = []
    for header in headers:
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", header or "")
        assert match is not None, f"an unbounded request: Range {header!r}"
        out.append((int(match.group(1)), int(match.group(2)) + 1))
    return out


def expected_ranges(body: bytes, columns: list[str]) -> list[tuple[int, int]]:
    """What reading ``columns`` of the Parquet file ``body`` needs: a byte to learn its size,
    its end (the footer), and each chosen column chunk of every row group."""
    metadata = pq.read_metadata(pa.BufferReader(body))
    size = len(body)
    out = [(0, 1), (size - min(size, FOOTER_READ), size)]
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for i in range(row_group.num_columns):
            chunk = row_group.column(i)
            if chunk.path_in_schema in columns:
                begin = chunk.dictionary_page_offset or chunk.data_page_offset
                out.append((begin, begin + chunk.total_compressed_size))
    return out


# --------------------------------------------------------------------------- s3://


async def test_s3_rows_are_the_local_rows(s3: Any, files: dict[str, bytes], tmp_path: Path,
                                          anyio_backend: str) -> None:
    here = ParquetRows(local(tmp_path, files), batch_rows=64)
    remote = ParquetRows(f"s3://{BUCKET}/pq/*.parquet", store=s3.store(BUCKET), batch_rows=64,
                         concurrency=3)
    assert remote.shards == [f"s3://{BUCKET}/pq/{name}" for name in sorted(files)]
    rows = await collect(remote)
    assert rows == await collect(here)
    assert [row["id"] for row in rows] == list(range(950))
    assert (remote.stats.records, remote.stats.shards, remote.stats.bytes) == (
        here.stats.records, here.stats.shards, here.stats.bytes)
    batches = await collect(ParquetRows(f"s3://{BUCKET}/pq/c.parquet", store=s3.store(BUCKET),
                                        columns=["id"], as_batches=True, batch_rows=300))
    assert np.concatenate([b["id"] for b in batches]).tolist() == list(range(150, 950))


async def test_s3_reads_the_footer_and_the_chosen_columns_only(
    s3: Any, proxy: Any, files: dict[str, bytes], anyio_backend: str
) -> None:
    body = files["c.parquet"]
    source = ParquetRows(f"s3://{BUCKET}/pq/c.parquet", store=s3.store(BUCKET), columns=["id"])
    assert [row["id"] for row in await collect(source)] == list(range(150, 950))
    asked = ranges([r for method, path, r in proxy.requests
                    if method == "GET" and path.endswith("/c.parquet")])
    assert sorted(asked) == sorted(expected_ranges(body, ["id"]))
    assert sum(end - start for start, end in asked) < len(body) / 3  # no blob was fetched


async def test_s3_row_groups_exactly_once_across_ranks_and_workers(
    s3: Any, anyio_backend: str
) -> None:
    """3 files of 1, 2 and 8 row groups for 2 ranks x 3 workers: split by row group (the
    footers are read at construction and in each epoch's plan), every row once, over epochs."""
    store = s3.store(BUCKET)
    for epoch in range(2):
        def make(rank: int, epoch: int = epoch) -> ParquetRows:
            source = ParquetRows(f"s3://{BUCKET}/pq/*.parquet", store=store, columns=["id"],
                                 rank=rank, world_size=2, shuffle_shards=True, seed=3,
                                 even_ranks=False)  # 11 row groups: none dropped
            source.set_epoch(epoch)
            return source

        rows = await read_as_consumers(make, world_size=2, num_workers=3)
        assert sorted(row["id"] for row in rows) == list(range(950))
    assert make(1).units_for(0, worker_id=0, num_workers=3)  # outside a worker thread too


async def test_s3_resume(s3: Any, anyio_backend: str) -> None:
    store = s3.store(BUCKET)

    def make() -> ParquetRows:
        return ParquetRows(f"s3://{BUCKET}/pq/*.parquet", store=store, columns=["id", "name"],
                           batch_rows=40)

    full = await collect(make())
    for k in (0, 1, 70, 400, 949, 950):
        rest, _ = await interrupted(make, k)
        assert rest == full[k:], k


async def test_s3_faults_are_retried_and_resumed(s3: Any, proxy: Any, files: dict[str, bytes],
                                                 anyio_backend: str) -> None:
    body = files["c.parquet"]
    proxy.fail(1, 503, "SlowDown")  # the size's one-byte read
    proxy.cut(2, after=1000)  # its retry (one byte: nothing to cut), then the footer's read
    source = ParquetRows(f"s3://{BUCKET}/pq/c.parquet", store=s3.store(BUCKET), **FAST)
    rows = await collect(source)
    assert rows == pq.read_table(pa.BufferReader(body)).to_pylist()
    assert (source.stats.retries, source.stats.throttled) == (1, 1)  # the cut, the SlowDown
    footer = len(body) - FOOTER_READ
    asked = ranges([r for method, path, r in proxy.requests if method == "GET"])
    # The cut read is asked for again from the last byte handed on (obstore hands on 64 KiB
    # pieces: here none), and only up to its range's end.
    assert asked[:3] == [(0, 1), (0, 1), (footer, len(body))]
    assert footer <= asked[3][0] <= footer + 1000 and asked[3][1] == len(body)


async def test_s3_missing_and_corrupt_objects_are_located(s3: Any, anyio_backend: str) -> None:
    source = ParquetRows(f"s3://{BUCKET}/pq/nope.parquet", store=s3.store(BUCKET), **FAST)
    with pytest.raises(ObjectNotFoundError, match="nope.parquet") as missing:
        await collect(source)
    assert missing.value.source == f"s3://{BUCKET}/pq/nope.parquet"
    notes = f"s3://{BUCKET}/pq/notes.txt"
    with pytest.raises(RecordError, match="notes.txt: not a readable Parquet file") as bad:
        await collect(ParquetRows(notes, store=s3.store(BUCKET)))
    assert bad.value.source == notes
    skipping = ParquetRows([notes, f"s3://{BUCKET}/pq/a.parquet"], store=s3.store(BUCKET),
                           skip_errors=True)
    assert [row["id"] for row in await collect(skipping)] == list(range(50))
    assert skipping.stats.skipped == 1
    with pytest.raises(ValueError, match="no objects match"):
        ParquetRows(f"s3://{BUCKET}/pq/*.nope", store=s3.store(BUCKET))


def same_size_other_version(body: bytes) -> bytes:
    """``body`` with a byte of its first column chunk changed: same size, another ETag."""
    middle = 200
    return body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1 :]


async def test_s3_object_replaced_between_reads_fails(s3: Any, files: dict[str, bytes],
                                                      anyio_backend: str) -> None:
    """The footer read from one version and column chunks from another would decode wrong
    rows silently: every read asks for the first read's version (If-Match)."""
    key = "pq/replaced.parquet"
    body = files["c.parquet"]
    s3.put(BUCKET, {key: body})
    # 10-row batches of 100-row groups: the read-ahead (a few batches) is still in the first
    # row groups when the object is replaced.
    source = ParquetRows(f"s3://{BUCKET}/{key}", store=s3.store(BUCKET), batch_rows=10,
                         **FAST)
    iterator = source.__aiter__()
    assert (await iterator.__anext__())["id"] == 150
    s3.put(BUCKET, {key: same_size_other_version(body)})
    with pytest.raises(FetchError, match="replaced.parquet: the object changed"):
        async for _ in iterator:
            pass


async def test_http_file_replaced_between_reads_fails(http: Any, files: dict[str, bytes],
                                                      anyio_backend: str) -> None:
    http.stall("c.parquet", 0)  # the size's read: answered as it is
    http.replace("c.parquet", same_size_other_version(files["c.parquet"]))  # then the footer's
    with pytest.raises(FetchError, match="c.parquet: the resource changed"):
        await collect(ParquetRows(http.url("c.parquet"), **FAST))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_s3_in_worker_processes(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 spawned workers, one file of 8 row groups: each reads its row groups' ranges."""
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    source = ParquetRows(f"s3://{BUCKET}/pq/c.parquet", columns=["id"], **FAST)
    loader = DataLoader(source, batch_size=50, num_workers=2, multiprocessing_context="spawn")
    ids = sorted(i for batch in loader for i in batch["id"].tolist())
    assert ids == list(range(150, 950))
    assert source.stats.records == 800


# --------------------------------------------------------------------------- http://


@pytest.fixture
def http(serve: Callable[..., Any], files: dict[str, bytes]) -> Any:
    return serve(dict(files))


async def test_http_rows_ranges_and_faults(http: Any, files: dict[str, bytes], tmp_path: Path,
                                           anyio_backend: str) -> None:
    urls = [http.url(name) for name in sorted(files)]
    assert await collect(ParquetRows(urls, batch_rows=64)) == await collect(
        ParquetRows(local(tmp_path, files), batch_rows=64))
    http.requests.clear()
    source = ParquetRows(http.url("c.parquet"), columns=["id"])
    assert [row["id"] for row in await collect(source)] == list(range(150, 950))
    asked = ranges([r for name, r in http.requests if name == "c.parquet"])
    assert sorted(asked) == sorted(expected_ranges(files["c.parquet"], ["id"]))
    http.fail("c.parquet", 503)  # the size's one-byte read
    http.cut("c.parquet", after=500, times=2)  # its retry (nothing to cut), the footer's read
    retried = ParquetRows(http.url("c.parquet"), columns=["id"], **FAST)
    assert [row["id"] for row in await collect(retried)] == list(range(150, 950))
    assert retried.stats.retries == 2


async def test_http_row_groups_exactly_once(http: Any, anyio_backend: str) -> None:
    def make(rank: int) -> ParquetRows:
        return ParquetRows(http.url("c.parquet"), columns=["id"], rank=rank, world_size=2,
                          even_ranks=False)

    rows = await read_as_consumers(make, world_size=2, num_workers=2)
    assert sorted(row["id"] for row in rows) == list(range(150, 950))


async def test_s3_cache_dir_keeps_whole_files_and_a_later_epoch_makes_no_request(
    s3: Any, proxy: Any, files: dict[str, bytes], tmp_path: Path, anyio_backend: str
) -> None:
    cache = tmp_path / "cache"
    s3.put(BUCKET, {f"pqc/{name}": body for name, body in files.items()})  # a prefix of its own
    here = ParquetRows(local(tmp_path, files), batch_rows=64, columns=["id", "name"])
    source = ParquetRows(f"s3://{BUCKET}/pqc/*.parquet", store=s3.store(BUCKET), batch_rows=64,
                         columns=["id", "name"], cache_dir=cache)
    expected = await collect(here)
    assert await collect(source) == expected
    kept = sorted(p.stat().st_size for p in cache.glob("*.shard"))
    assert kept == sorted(len(body) for body in files.values())  # whole files, every column
    assert source.stats.cache_misses == len(files)
    proxy.reset()
    assert await collect(source) == expected  # the next epoch reads the copies
    assert [r for r in proxy.requests if r[0] == "GET"] == []
    assert source.stats.cache_hits >= len(files)
    again = ParquetRows(f"s3://{BUCKET}/pqc/*.parquet", store=s3.store(BUCKET), batch_rows=64,
                        columns=["id", "name"], cache_dir=cache)
    assert await collect(again) == expected  # a new source: listed, so pinned, no read
    assert [r for r in proxy.requests if r[0] == "GET" and "list-type" not in r[1]] == []


async def test_http_cache_dir_and_a_limit_too_small_to_keep_a_file(
    http: Any, files: dict[str, bytes], tmp_path: Path, anyio_backend: str
) -> None:
    urls = [http.url(name) for name in sorted(files)]
    expected = await collect(ParquetRows(local(tmp_path, files), batch_rows=64))
    kept = ParquetRows(urls, batch_rows=64, cache_dir=tmp_path / "c1")
    assert await collect(kept) == expected
    assert await collect(kept) == expected
    assert kept.stats.cache_hits >= len(files)
    tiny = ParquetRows(urls, batch_rows=64, cache_dir=tmp_path / "c2", cache_limit=1000)
    assert await collect(tiny) == expected  # read by ranges, nothing kept
    assert list((tmp_path / "c2").glob("*.shard")) == []
