"""The shard cache's checksums (aloader.io._cache, aloader.io._checksums): a cached copy whose
bytes changed after its download (a digit, same length), whose checksum file is missing or
damaged, is never served: it is dropped, counted in ``stats.cache_corrupt``, logged once,
and the records come from the store instead (from the byte where the copy failed: none lost,
none twice); a download whose bytes do not match the store's own checksum is not kept. Over
the local HTTP server and the local S3 server, with the real file system."""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from faulty_server import FaultyServer
from sourcetools import collect, ids, local_s3

from aloader import DataLoader, JsonLines
from aloader.io._cache import ShardCache, make_version

pytestmark = [pytest.mark.hostile, pytest.mark.anyio]

FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}
BUCKET = "checksums"


def records(first: int, count: int) -> bytes:
    return b"".join(json.dumps({"id": i, "text": f"record {i:05d}", "pad": "x" * 60}).encode()
                    + b"\n" for i in range(first, first + count))


SMALL = {"a.jsonl": records(0, 200)}  # ~20 KiB: one block
BIG = {"b.jsonl": records(0, 3000)}  # ~280 KiB: five blocks


def copy_of(cache: Path, server: FaultyServer, name: str) -> Path:
    """Where the cache keeps the server's ``name`` (its ETag is the body's CRC)."""
    body = server.files[name]
    version = make_version(len(body), f'"{zlib.crc32(body):08x}"', None)
    assert version is not None
    return Path(ShardCache(str(cache)).path(server.url(name), version))


def tamper(copy: Path, old: bytes, new: bytes) -> None:
    """Change ``old`` into ``new`` (same length) in the copy, as a disk or a hand would."""
    assert len(old) == len(new)
    data = copy.read_bytes()
    assert data.count(old) == 1
    copy.write_bytes(data.replace(old, new))


def warnings_about(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and words in r.getMessage()]


@pytest.mark.parametrize("pinned", [True, False])
async def test_a_digit_changed_in_a_cached_copy_is_never_served(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str, pinned: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    """``{"id": 123,`` became ``{"id": 923,``: the copy has the right length, so only the
    checksum tells; the next epoch delivers 123, the copy is downloaded again."""
    server = serve(SMALL)
    name = "a.jsonl"
    source = JsonLines(server.url(name), cache_dir=tmp_path, **FAST)
    assert ids(await collect(source)) == list(range(200))
    copy = copy_of(tmp_path, server, name)
    tamper(copy, b'{"id": 123,', b'{"id": 923,')
    reader = source if pinned else JsonLines(server.url(name), cache_dir=tmp_path, **FAST)
    requests = len(server.requests)
    with caplog.at_level("WARNING", logger="aloader.http"):
        assert ids(await collect(reader)) == list(range(200))
    assert reader.stats.cache_corrupt == 1
    assert copy.read_bytes() == SMALL[name]  # dropped, downloaded again, kept
    assert len(warnings_about(caplog, "is damaged")) == 1
    assert str(copy) in warnings_about(caplog, "is damaged")[0]
    assert len(server.requests) == requests + (1 if pinned else 2)
    # The new copy is served, checked, with no request (the version is pinned now).
    requests = len(server.requests)
    assert ids(await collect(reader)) == list(range(200))
    assert len(server.requests) == requests
    assert reader.stats.cache_corrupt == 1
    assert source.stats.records == (600 if pinned else 200)


async def test_a_damaged_block_in_the_middle_is_read_from_the_store_from_there(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    """The blocks before the damaged one were checked and handed on: the rest is read from
    the store from the damaged block's first byte, every record once and in order."""
    server = serve(BIG)
    name = "b.jsonl"
    source = JsonLines(server.url(name), cache_dir=tmp_path, **FAST)
    assert ids(await collect(source)) == list(range(3000))
    copy = copy_of(tmp_path, server, name)
    tamper(copy, b'{"id": 2000,', b'{"id": 9000,')
    at = BIG[name].index(b'{"id": 2000,')
    block = at - at % (1 << 16)
    server.requests.clear()
    assert ids(await collect(source)) == list(range(3000))
    assert source.stats.cache_corrupt == 1
    assert server.requests == [(name, f"bytes={block}-")]
    assert not copy.exists()  # dropped: the next read downloads it whole
    assert ids(await collect(source)) == list(range(3000))
    assert copy.read_bytes() == BIG[name]


def test_a_damaged_copy_is_not_served_to_a_sync_for(serve: Callable[..., FaultyServer],
                                                      tmp_path: Path) -> None:
    """A sync ``for`` reads a pinned copy on its own thread (no event loop): the damaged one
    is read from the store on a loop of its own."""
    server = serve(SMALL)
    source = JsonLines(server.urls, cache_dir=tmp_path, **FAST)
    assert ids(list(source)) == list(range(200))
    tamper(copy_of(tmp_path, server, "a.jsonl"), b'"record 00150"', b'"record 00950"')
    assert [r["text"] for r in source] == [f"record {i:05d}" for i in range(200)]
    assert source.stats.cache_corrupt == 1


@pytest.mark.parametrize("damage", ["missing", "zeroed", "another copy's"])
async def test_a_copy_without_its_own_checksums_is_downloaded_again(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that read the copy's checksums keeps them (and checks the copy against
    them); another process finds the checksum file damaged: the copy cannot be checked, so
    it is downloaded again."""
    from aloader.io import _cachedir

    server = serve(SMALL | {"c.jsonl": records(500, 200)})
    source = JsonLines(server.urls, cache_dir=tmp_path, **FAST)
    assert sorted(ids(await collect(source))) == list(range(200)) + list(range(500, 700))
    sums = Path(str(copy_of(tmp_path, server, "a.jsonl")) + ".sum")
    if damage == "missing":
        sums.unlink()
    elif damage == "zeroed":
        sums.write_bytes(bytes(len(sums.read_bytes())))
    else:
        sums.write_bytes(Path(str(copy_of(tmp_path, server, "c.jsonl")) + ".sum").read_bytes())
    requests = len(server.requests)
    assert sorted(ids(await collect(source))) == list(range(200)) + list(range(500, 700))
    assert source.stats.cache_corrupt == 0 and len(server.requests) == requests
    monkeypatch.setattr(_cachedir, "_TABLES", {})  # as in another process
    assert sorted(ids(await collect(source))) == list(range(200)) + list(range(500, 700))
    assert source.stats.cache_corrupt == 1
    assert len(server.requests) == requests + 1
    assert sums.exists() and copy_of(tmp_path, server, "a.jsonl").read_bytes() == SMALL["a.jsonl"]


async def test_a_loader_counts_the_damaged_copies_in_its_stats(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    server = serve(SMALL)
    source = JsonLines(server.urls, cache_dir=tmp_path, **FAST)
    loader = DataLoader(source, batch_size=50)
    assert sum([len(batch["id"]) async for batch in loader]) == 200
    tamper(copy_of(tmp_path, server, "a.jsonl"), b'{"id": 7,', b'{"id": 8,')
    assert sorted(i for batch in [b async for b in loader] for i in batch["id"].tolist()) \
        == list(range(200))
    assert loader.stats().sources[0]["cache_corrupt"] == 1


# --------------------------------------------------------------------------- object stores


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    with local_s3(BUCKET, {f"data/{name}": body for name, body in (SMALL | BIG).items()}) \
            as server:
        yield server


@pytest.mark.parametrize("path", ["obstore", "signed URLs"])
async def test_a_digit_changed_in_a_cached_s3_object_is_never_served(
        s3: Any, tmp_path: Path, anyio_backend: str, path: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through obstore's reads (``store=``) and through signed URLs (credentials from the
    environment), which also check the bytes of a download against the ETag (moto's single-
    part ETags are MD5s)."""
    from aloader.io import _objstore

    if path == "obstore":
        options: dict[str, Any] = {"store": s3.store(BUCKET)}
    else:
        for key, value in s3.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(_objstore, "_STORES", {})
        monkeypatch.setattr(_objstore, "_SIGNED", {})
        options = {}
    url = f"s3://{BUCKET}/data/a.jsonl"
    source = JsonLines(url, cache_dir=tmp_path, **options, **FAST)
    assert ids(await collect(source)) == list(range(200))
    [copy] = tmp_path.glob("*.shard")
    tamper(copy, b'{"id": 123,', b'{"id": 923,')
    assert ids(await collect(source)) == list(range(200))
    assert source.stats.cache_corrupt == 1
    assert copy.read_bytes() == SMALL["a.jsonl"]


async def test_a_damaged_parquet_copy_is_read_by_ranges_instead(
        tmp_path: Path, anyio_backend: str, serve: Callable[..., FaultyServer]) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from aloader import ParquetRows

    table = pa.table({"id": list(range(5000)), "name": [f"n{i:06d}" for i in range(5000)]})
    local = tmp_path / "t.parquet"
    pq.write_table(table, local, row_group_size=1000, compression="none")
    server = serve({"t.parquet": local.read_bytes()})
    cache = tmp_path / "cache"
    source = ParquetRows(server.urls, batch_rows=500, cache_dir=cache, **FAST)
    assert [row["id"] for row in await collect(source)] == list(range(5000))
    [copy] = cache.glob("*.shard")
    data = bytearray(copy.read_bytes())
    at = data.index(b"n004321")
    data[at : at + 7] = b"n009999"
    copy.write_bytes(bytes(data))
    rows = await collect(source)
    assert [row["id"] for row in rows] == list(range(5000))
    assert [row["name"] for row in rows] == [f"n{i:06d}" for i in range(5000)]
    assert source.stats.cache_corrupt == 1 and not copy.exists()


# --------------------------------------------------------------------------- the stores' own


def _goog(body: bytes) -> str:
    import google_crc32c

    crc = base64.b64encode(int(google_crc32c.value(body)).to_bytes(4, "big")).decode()
    md5 = base64.b64encode(hashlib.md5(body).digest()).decode()
    return f"crc32c={crc},md5={md5}"


@pytest.mark.parametrize("header", ["x-goog-hash", "x-amz-checksum-crc32c", "Content-MD5"])
async def test_a_download_that_does_not_match_the_stores_checksum_is_not_kept(
        tmp_path: Path, anyio_backend: str, header: str,
        caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("google_crc32c")
    from test_http import Scripted, reply

    body = SMALL["a.jsonl"]
    other = body.replace(b"record 00001", b"record 00002")

    def value(of: bytes) -> str:
        if header == "x-goog-hash":
            return _goog(of)
        if header == "Content-MD5":
            return base64.b64encode(hashlib.md5(of).digest()).decode()
        import google_crc32c

        return base64.b64encode(int(google_crc32c.value(of)).to_bytes(4, "big")).decode()

    server = Scripted()
    try:
        good = server.route("good.jsonl", lambda h, n: reply(h, 200, body, headers={
            header: value(body), "ETag": '"good"'}))
        bad = server.route("bad.jsonl", lambda h, n: reply(h, 200, body, headers={
            header: value(other), "ETag": '"bad"'}))
        with caplog.at_level("WARNING", logger="aloader.http"):
            kept = JsonLines(good, cache_dir=tmp_path, **FAST)
            assert ids(await collect(kept)) == list(range(200))
            refused = JsonLines(bad, cache_dir=tmp_path, **FAST)
            assert ids(await collect(refused)) == list(range(200))
        assert kept.stats.cache_corrupt == 0 and refused.stats.cache_corrupt == 1
        assert len(list(tmp_path.glob("*.shard"))) == 1  # the good one only
        [warning] = warnings_about(caplog, "do not match the store's checksum")
        assert "bad.jsonl" in warning
    finally:
        server.close()
