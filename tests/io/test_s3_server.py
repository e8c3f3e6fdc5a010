"""The S3 mode of the demo's ShardServer (``bucket=``), the S3 benchmark's server: aloader's
s3:// sources read it exactly (records, listings with pages, a ranged resume after a cut body,
the errors), on asyncio and trio, so that the benchmark's S3 rows measure a tested server."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import collect

pytest.importorskip("obstore")

from aloader import BucketNotFoundError, FetchError, JsonLines, ObjectNotFoundError, TextLines
from aloader._stats import SourceStats
from aloader.io._objstore import ObjectAccess

pytestmark = pytest.mark.anyio

SHARDS = make_jsonl_shards(4, 30)  # shard-0000i.jsonl, ids 0..119
OBJECTS = {f"data/{name}": body for name, body in SHARDS.items()} | {
    "data/.hidden.jsonl": b'{"id": -1}\n',
    "data/sub/deep.jsonl": b'{"id": -2}\n',
    "data/notes.txt": b"a\nb\n",
    "other/x.jsonl": b'{"id": -3}\n',
}
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}


def store(server: FaultyServer) -> Any:
    """An obstore S3Store for the server's bucket, without obstore's own retries."""
    from obstore.store import S3Store

    return S3Store(server.bucket, endpoint=server.endpoint, access_key_id="any",
                   secret_access_key="any", region="us-east-1",
                   client_options={"allow_http": True}, retry_config={"max_retries": 0})


def s3_server(serve: Callable[..., FaultyServer], bucket: str = "bench-bucket",
              page: int = 1000) -> FaultyServer:
    server = serve(OBJECTS, bucket=bucket)
    server.list_page = page
    return server


async def test_records_exact_through_the_environment(
        serve: Callable[..., FaultyServer], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path, anyio_backend: str) -> None:
    # A bucket of its own: aloader keeps one store per s3://bucket in the process.
    server = s3_server(serve, bucket=f"env-{anyio_backend}")
    for key, value in {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "any",
                       "AWS_SECRET_ACCESS_KEY": "any", "AWS_REGION": "us-east-1",
                       "AWS_ALLOW_HTTP": "true"}.items():
        monkeypatch.setenv(key, value)
    for name, body in SHARDS.items():
        (tmp_path / name).write_bytes(body)
    source = JsonLines(f"s3://{server.bucket}/data/*.jsonl", concurrency=3, chunk_size=500)
    records = await collect(source)
    assert records == await collect(JsonLines(str(tmp_path), chunk_size=500))
    assert [r["id"] for r in records] == list(range(120))
    assert (source.stats.records, source.stats.shards, source.stats.retries) == (120, 4, 0)
    assert source.stats.bytes == sum(map(len, SHARDS.values()))


async def test_listing_pages_match_the_local_glob(serve: Callable[..., FaultyServer],
                                                  tmp_path: Path, anyio_backend: str) -> None:
    server = s3_server(serve, page=2)  # every listing takes several pages
    for key, body in OBJECTS.items():
        path = tmp_path / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    for tail in ("", "*.jsonl", "shard-0000[1-2].jsonl", "**/*.jsonl", ".*"):
        remote = TextLines(f"s3://{server.bucket}/data/{tail}", store=store(server)).shards
        here = TextLines(str(tmp_path / "data") + ("/" + tail if tail else "")).shards
        assert [u.removeprefix(f"s3://{server.bucket}/") for u in remote] == [
            os.path.relpath(p, tmp_path) for p in here], tail
    listings = [rng for name, rng in server.requests if name == ""]
    assert len(listings) >= 5 * 3  # paged: at least 3 pages per listing of data/
    lines = await collect(TextLines(f"s3://{server.bucket}/data/notes.txt",
                                    store=store(server)))
    assert lines == ["a", "b"]


async def test_a_cut_body_resumes_by_range(serve: Callable[..., FaultyServer],
                                           anyio_backend: str) -> None:
    server = s3_server(serve)
    key = "data/shard-00001.jsonl"
    server.cut(key, 700)
    server.cut(key, 900)  # of the rest
    source = JsonLines(f"s3://{server.bucket}/{key}", store=store(server), chunk_size=256,
                       **FAST)
    records = await collect(source)
    assert [r["id"] for r in records] == list(range(30, 60))  # none lost, none twice
    assert source.stats.retries == 2 and source.stats.bytes == len(OBJECTS[key])
    gets = [rng for name, rng in server.requests if name == key]
    assert gets[0] is None and len(gets) == 3
    first = int(gets[1].removeprefix("bytes=").rstrip("-"))
    second = int(gets[2].removeprefix("bytes=").rstrip("-"))
    assert 0 < first <= 700 and first < second <= first + 900


async def test_bounded_ranges_and_versions(serve: Callable[..., FaultyServer],
                                           anyio_backend: str) -> None:
    server = s3_server(serve)
    key = "data/shard-00002.jsonl"
    url = f"s3://{server.bucket}/{key}"
    access = ObjectAccess(store=store(server))
    versions: list[tuple[int | None, str | None, str | None]] = []
    part = b"".join([chunk async for chunk in access.chunks(
        url, SourceStats(), start=100, end=350, on_version=lambda *v: versions.append(v))])
    assert part == OBJECTS[key][100:350]
    size, etag, modified = versions[0]
    assert size == len(OBJECTS[key]) and etag and modified
    same = b"".join([c async for c in access.chunks(url, SourceStats(), start=5, etag=etag)])
    assert same == OBJECTS[key][5:]
    with pytest.raises(FetchError, match="the object changed in the store"):
        async for _ in access.chunks(url, SourceStats(), etag='"another"'):
            pass


async def test_missing_object_and_bucket(serve: Callable[..., FaultyServer],
                                         anyio_backend: str) -> None:
    server = s3_server(serve)
    with pytest.raises(ObjectNotFoundError, match="no object 'data/absent.jsonl'"):
        await collect(JsonLines(f"s3://{server.bucket}/data/absent.jsonl",
                                store=store(server), **FAST))
    from obstore.store import S3Store

    other = S3Store("no-such-bucket", endpoint=server.endpoint, access_key_id="any",
                    secret_access_key="any", region="us-east-1",
                    client_options={"allow_http": True}, retry_config={"max_retries": 0})
    with pytest.raises(BucketNotFoundError, match="the bucket 'no-such-bucket' does not"):
        await collect(JsonLines("s3://no-such-bucket/x.jsonl", store=other, **FAST))


def test_http_mode_unchanged(serve: Callable[..., FaultyServer]) -> None:
    """Without ``bucket`` the server is the plain HTTP one: no S3 answers, no HEAD."""
    import http.client

    server = serve({"a.jsonl": b'{"id": 1}\n'})
    assert server.url("a.jsonl").startswith("http://")
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request("GET", "/a.jsonl")
    response = connection.getresponse()
    assert (response.status, response.read()) == (200, b'{"id": 1}\n')
    assert response.getheader("Last-Modified") is None
    connection.request("HEAD", "/a.jsonl")
    response = connection.getresponse()
    response.read()
    assert response.status == 501
    connection.close()


# ------------------------------------------------------------------ Parquet's local reads


def write_parquet(path: Path, start: int, rows: int, group_rows: int) -> str:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    ids = list(range(start, start + rows))
    pq.write_table(pa.table({"id": ids, "x": [i * 0.5 for i in ids]}), path,
                   row_group_size=group_rows)
    return str(path)


async def test_parquet_passes_share_an_idle_read_thread(tmp_path: Path,
                                                        anyio_backend: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The epochs' passes over local files are read by one thread, not one started per pass
    (whose start waited for it to be scheduled), with every row once."""
    from aloader import ParquetRows
    from aloader.sources import _parquet_read

    paths = [write_parquet(tmp_path / f"{i}.parquet", 100 * i, 100, 30) for i in range(3)]
    threads: set[Any] = set()
    next_batch = _parquet_read._UnitReader.next

    def spy(self: Any) -> Any:
        threads.add(threading.current_thread())
        return next_batch(self)

    monkeypatch.setattr(_parquet_read._UnitReader, "next", spy)
    monkeypatch.setattr(_parquet_read, "_LINGER", 30.0)  # idle for longer than the test lasts
    source = ParquetRows(paths, columns=["id"], batch_rows=40, as_batches=True)
    for _ in range(3):
        batches = [batch async for batch in source]
        assert [int(i) for b in batches for i in b["id"]] == list(range(300))
    assert len(threads) == 1
    assert source.stats.records == 900 and source.stats.shards == 9


async def test_parquet_local_pass_goes_on_after_a_skipped_file(
        tmp_path: Path, anyio_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One reader in the read thread goes from file to file, an unreadable one skipped in
    between: every row once, in order, the counts exact, every file closed."""
    from aloader import ParquetRows
    from aloader.sources import _parquet_read

    paths = [write_parquet(tmp_path / f"{i}.parquet", 10 * i, 10, 4) for i in range(2)]
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not a parquet file PAR1")
    paths.insert(1, str(bad))
    closed: list[str] = []
    close = _parquet_read._UnitReader.close

    def spy(self: Any) -> None:
        closed.append(self.unit.name)
        close(self)

    monkeypatch.setattr(_parquet_read._UnitReader, "close", spy)
    source = ParquetRows(paths, batch_rows=3, as_batches=True, skip_errors=True)
    batches = [batch async for batch in source]
    assert [int(i) for b in batches for i in b["id"]] == list(range(20))
    assert [len(b["id"]) for b in batches] == [3, 3, 3, 1] * 2
    assert (source.stats.records, source.stats.shards, source.stats.skipped) == (20, 2, 1)
    assert set(closed) == set(paths)
    first = [b async for b in ParquetRows(paths[:1], batch_rows=3, as_batches=True)]
    assert len(first) == 4


async def test_read_thread_submit_runs_before_it_is_awaited(anyio_backend: str) -> None:
    from aloader.sources import _parquet_read
    thread = _parquet_read._ReadThread(shared=True)
    ran = threading.Event()

    def work() -> int:
        ran.set()
        return 7

    result = thread.submit(work)
    assert ran.wait(5)  # queued and run at once, not when awaited
    assert await result() == 7
    thread.close()


async def test_an_idle_shared_read_thread_exits(anyio_backend: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from aloader.sources import _parquet_read
    monkeypatch.setattr(_parquet_read, "_LINGER", 0.05)
    before = set(threading.enumerate())
    thread = _parquet_read._ReadThread(shared=True)
    assert await thread.run(lambda: 1) == 1
    started = [t for t in threading.enumerate()
               if t.name == "aloader-parquet" and t not in before]
    thread.close()
    for t in started:
        t.join(5)
        assert not t.is_alive()
