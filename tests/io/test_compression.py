"""Compressed shards (.gz, .zst, .bz2): every format reads them exactly as the plain shard,
over local files and HTTP; corrupt, truncated and bomb-like streams are located errors with
bounded memory; a body decoded by the HTTP layer is not decoded twice."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import struct
import sys
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import collect, read_as_consumers, write

from aloader import (
    BinaryRecords,
    DataLoader,
    JsonLines,
    NpyRows,
    RecordError,
    SourceError,
    TextLines,
)
from aloader.io._compression import Decompressor, shard_compression

zstandard = pytest.importorskip("zstandard")

pytestmark = pytest.mark.anyio

FAST = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}


def zst(data: bytes) -> bytes:
    return bytes(zstandard.ZstdCompressor().compress(data))


def gz_members(data: bytes) -> bytes:
    third = len(data) // 3
    return gzip.compress(data[:third]) + gzip.compress(data[third : 2 * third]) \
        + gzip.compress(data[2 * third :])


def bz2_streams(data: bytes) -> bytes:
    half = len(data) // 2
    return bz2.compress(data[:half]) + bz2.compress(data[half:])


def zst_frames(data: bytes) -> bytes:
    half = len(data) // 2
    skippable = struct.pack("<II", 0x184D2A50, 5) + b"meta!"
    return zst(data[:half]) + skippable + zst(data[half:])


CODECS: dict[str, tuple[str, Callable[[bytes], bytes]]] = {
    "gzip": (".gz", gzip.compress),
    "gzip-members": (".gz", gz_members),
    "bz2": (".bz2", bz2.compress),
    "bz2-streams": (".bz2", bz2_streams),
    "zstd": (".zst", zst),
    "zstd-frames": (".zst", zst_frames),
}


def jsonl(count: int) -> bytes:
    return b"".join(json.dumps({"i": i, "pad": "x" * (i % 50)}).encode() + b"\n"
                    for i in range(count))


# --------------------------------------------------------------------------- every format


@pytest.mark.parametrize("codec", sorted(CODECS))
async def test_line_formats_equal_the_plain_reading(tmp_path: Path, anyio_backend: str,
                                                    codec: str) -> None:
    suffix, compress = CODECS[codec]
    body = jsonl(3000)
    plain = write(tmp_path, "a.jsonl", body)
    packed = write(tmp_path, f"b.jsonl{suffix}", compress(body))
    for cls in (JsonLines, TextLines):
        expected = await collect(cls(plain))
        source = cls(packed, chunk_size=1000)
        assert await collect(source) == expected
        assert len(expected) == 3000
        assert source.stats.shards == 1 and source.stats.bytes == len(body)


@pytest.mark.parametrize("codec", ["gzip-members", "bz2", "zstd-frames"])
async def test_binary_and_npy_formats(tmp_path: Path, anyio_backend: str, codec: str) -> None:
    suffix, compress = CODECS[codec]
    records = [bytes([i % 256]) * (i % 300) for i in range(500)]
    body = b"".join(struct.pack("<I", len(r)) + r for r in records)
    path = write(tmp_path, f"r.bin{suffix}", compress(body))
    assert await collect(BinaryRecords(path, chunk_size=700)) == records

    array = np.arange(6000, dtype=np.float32).reshape(2000, 3)
    buffer = io.BytesIO()
    np.save(buffer, array)
    path = write(tmp_path, f"a.npy{suffix}", compress(buffer.getvalue()))
    rows = await collect(NpyRows(path, chunk_size=999))
    np.testing.assert_array_equal(np.stack(rows), array)


async def test_compression_argument(tmp_path: Path, anyio_backend: str) -> None:
    body = jsonl(100)
    odd = write(tmp_path, "data.bin", gzip.compress(body))  # no telling suffix
    assert len(await collect(JsonLines(odd, compression="gzip"))) == 100
    with pytest.raises(RecordError):
        await collect(JsonLines(odd))  # auto: read as it is: not UTF-8
    plain = write(tmp_path, "plain.jsonl.gz", body)  # misnamed
    assert len(await collect(JsonLines(plain, compression=None))) == 100
    with pytest.raises(RecordError, match=r"plain\.jsonl\.gz: gzip stream, compressed byte "
                                          r"offset 0: not a gzip stream") as info:
        await collect(JsonLines(plain))
    assert info.value.source == plain and info.value.offset == 0
    with pytest.raises(ValueError, match="compression should be one of"):
        JsonLines(plain, compression="lz4")  # type: ignore[arg-type]


def test_suffixes() -> None:
    assert shard_compression("a/b.jsonl.gz", "auto") == "gzip"
    assert shard_compression("x.TGZ", "auto") == "gzip"
    assert shard_compression("x.tar.zst", "auto") == "zstd"
    assert shard_compression("x.txt.bz2", "auto") == "bz2"
    assert shard_compression("x.jsonl", "auto") is None
    assert shard_compression("dir.gz/x", "auto") is None
    assert shard_compression("http://h/x.jsonl.gz?sig=1#f", "auto") == "gzip"
    assert shard_compression("http://h/x.jsonl?name=a.gz", "auto") is None
    assert shard_compression("x.jsonl", "zstd") == "zstd"
    assert shard_compression("x.jsonl.gz", None) is None


async def test_sharding_exactly_once(tmp_path: Path, anyio_backend: str) -> None:
    shards = make_jsonl_shards(5, 40)
    for index, (name, body) in enumerate(sorted(shards.items())):
        suffix, compress = CODECS[("gzip", "bz2", "zstd")[index % 3]]
        write(tmp_path, name + suffix, compress(body))
    records = await read_as_consumers(  # 8 consumers, 5 shards
        lambda rank: JsonLines(str(tmp_path), rank=rank, world_size=2, shuffle_shards=True,
                               seed=3, even_ranks=False), 2, 4)
    seen = [r["id"] for r in records]
    assert sorted(seen) == list(range(200))


async def test_loader_with_workers(tmp_path: Path, anyio_backend: str) -> None:
    for name, body in make_jsonl_shards(4, 50).items():
        write(tmp_path, name + ".gz", gzip.compress(body))
    ids: list[int] = []
    async for batch in DataLoader(JsonLines(str(tmp_path)), batch_size=16, num_workers=2):
        ids.extend(batch["id"].tolist())
    assert sorted(ids) == list(range(200))


# --------------------------------------------------------------------------- bad streams


@pytest.mark.parametrize("codec", ["gzip", "bz2", "zstd"])
async def test_truncated_stream_is_an_error(tmp_path: Path, anyio_backend: str,
                                            codec: str) -> None:
    suffix, compress = CODECS[codec]
    body = jsonl(2000)
    packed = compress(body)
    path = write(tmp_path, f"t.jsonl{suffix}", packed[: len(packed) * 2 // 3])
    for cls in (JsonLines, TextLines):
        source = cls(path, chunk_size=500)
        got: list[Any] = []
        with pytest.raises(RecordError, match="truncated: the shard ends before the end of "
                                              "the compressed stream") as info:
            async for record in source:
                got.append(record)
        assert info.value.source == path
        # Every record delivered is a whole line of the shard, in order; none after the cut.
        assert got == (await collect(cls(write(tmp_path, "p.jsonl", body))))[: len(got)]
        assert source.stats.shards == 0
    # Skipping: the records before the cut, the rest counted as one skipped record.
    source = JsonLines(path, chunk_size=500, skip_errors=True)
    got = await collect(source)
    assert [r["i"] for r in got] == list(range(len(got))) and len(got) < 2000
    assert got or codec != "gzip"  # bz2 and zstd decode whole blocks: this one is cut
    assert source.stats.skipped == 1 and source.stats.shards == 1


async def test_truncated_in_the_middle_of_a_line_gives_no_partial_line(
        tmp_path: Path, anyio_backend: str) -> None:
    body = b"".join(b"line %d " % i + b"y" * 5000 + b"\n" for i in range(20))
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    packed = compressor.compress(body) + compressor.flush(zlib.Z_FULL_FLUSH)
    # A complete deflate flush point in the middle of a line, without the gzip trailer.
    path = write(tmp_path, "cut.txt.gz", packed)
    source = TextLines(path, skip_errors=True)
    lines = await collect(source)
    assert lines == body.decode().split("\n")[: len(lines)]
    assert source.stats.skipped == 1
    assert all(line.endswith("y" * 5000) for line in lines)  # no line cut short


@pytest.mark.parametrize("codec", ["gzip", "bz2", "zstd"])
async def test_corrupt_stream_is_a_located_error(tmp_path: Path, anyio_backend: str,
                                                 codec: str) -> None:
    suffix, compress = CODECS[codec]
    packed = bytearray(compress(jsonl(5000)))
    middle = len(packed) // 2
    packed[middle : middle + 64] = b"\xa5" * 64
    path = write(tmp_path, f"c.jsonl{suffix}", bytes(packed))
    source = TextLines(path, chunk_size=1000, encoding="latin-1")  # any byte decodes
    with pytest.raises(RecordError, match=rf"c\.jsonl\{suffix}: {codec} stream, compressed "
                                          r"bytes \d+ to \d+: ") as info:
        await collect(source)
    assert info.value.source == path and info.value.offset is not None
    assert middle - 1000 < info.value.offset <= len(packed)
    assert source.stats.shards == 0


async def test_gzip_crc_catches_altered_data(tmp_path: Path, anyio_backend: str) -> None:
    body = jsonl(3000)
    packed = bytearray(gzip.compress(body, compresslevel=0))  # stored: bytes as they are
    at = packed.index(b'"i": 1500')
    packed[at + 6] ^= 1  # 1500 becomes 1400: still valid JSON, only the CRC can tell
    path = write(tmp_path, "crc.jsonl.gz", bytes(packed))
    got: list[Any] = []
    with pytest.raises(RecordError, match="incorrect data check"):
        async for record in JsonLines(path):
            got.append(record)
    assert len(got) <= 3000


async def test_trailing_garbage_is_an_error(tmp_path: Path, anyio_backend: str) -> None:
    path = write(tmp_path, "g.jsonl.gz", gzip.compress(jsonl(10)) + b"not gzip at all")
    with pytest.raises(RecordError, match="gzip stream"):
        await collect(JsonLines(path))


@pytest.mark.parametrize("content", [b"", b"\x1f", b"\x1f\x8b"])
async def test_empty_or_tiny_local_files_are_errors(tmp_path: Path, anyio_backend: str,
                                                    content: bytes) -> None:
    path = write(tmp_path, "e.jsonl.gz", content)
    with pytest.raises(RecordError, match="gzip stream"):
        await collect(JsonLines(path))


async def test_missing_zstandard_names_the_shard_and_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: str) -> None:
    for module in ("zstandard", "compression.zstd"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    path = write(tmp_path, "x.jsonl.zst", zst(jsonl(10)))
    with pytest.raises(SourceError, match=r"x\.jsonl\.zst: a zstd shard needs the zstandard "
                                          r"package .*pip install zstandard") as info:
        await collect(JsonLines(path))
    assert not isinstance(info.value, RecordError)  # not a bad record: never skipped


@pytest.mark.parametrize("codec", ["gzip", "bz2", "zstd"])
def test_bomb_is_decompressed_a_bounded_piece_at_a_time(codec: str) -> None:
    # Zeros compress about 1000:1 (gzip, bz2) and far more with zstd's blocks.
    size = (48 if codec == "zstd" else 16) << 20
    if codec == "gzip":
        packed = gzip.compress(bytes(size), compresslevel=9)
    elif codec == "bz2":
        packed = bz2.compress(bytes(size), 1)
    else:
        packed = bytes(zstandard.ZstdCompressor(level=1).compress(bytes(size)))
    assert len(packed) < size // 500
    decompressor = Decompressor("bomb", codec, 1 << 16)
    tracemalloc.start()
    try:
        total = largest = 0
        for start in range(0, len(packed), 1 << 16):
            for piece in decompressor.feed(packed[start : start + (1 << 16)]):
                total += len(piece)
                largest = max(largest, len(piece))
        decompressor.end()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total == size and decompressor.offset == len(packed)
    if codec == "zstd":  # what 512 compressed bytes can hold: 128 blocks of 128 KiB
        assert largest <= 17 << 20 and peak < 40 << 20
    else:
        assert largest <= 1 << 16 and peak < 4 << 20


# --------------------------------------------------------------------------- HTTP


@pytest.mark.parametrize("codec", ["gzip-members", "bz2", "zstd"])
async def test_over_http(serve: Callable[..., FaultyServer], anyio_backend: str,
                         codec: str) -> None:
    suffix, compress = CODECS[codec]
    shards = make_jsonl_shards(3, 400)
    server = serve({name + suffix: compress(body) for name, body in shards.items()})
    source = JsonLines(server.urls, concurrency=2, chunk_size=2000)
    assert [r["id"] for r in await collect(source)] == list(range(1200))
    assert source.stats.shards == 3 and source.stats.retries == 0


@pytest.mark.parametrize("ranges", [True, False])
@pytest.mark.parametrize("codec", ["gzip", "zstd"])
async def test_http_cut_mid_body_loses_and_repeats_nothing(
        serve: Callable[..., FaultyServer], anyio_backend: str, ranges: bool,
        codec: str) -> None:
    suffix, compress = CODECS[codec]
    body = jsonl(5000)
    name = f"cut.jsonl{suffix}"
    packed = compress(body)
    server = serve({name: packed}, ranges=ranges)
    server.cut(name, len(packed) // 3 + 5, times=2)
    source = JsonLines(server.url(name), chunk_size=1000, **FAST)
    assert [r["i"] for r in await collect(source)] == list(range(5000))
    assert source.stats.retries == 2 and source.stats.bytes == len(body)
    # The compressed bytes were resumed by range where they stopped (the decompressor kept
    # its state across the retry), or skipped when the server ignores ranges.
    if ranges:
        assert server.requests[1] == (name, f"bytes={len(packed) // 3 + 5}-")


async def test_http_truncated_body_without_length_is_an_error(anyio_backend: str) -> None:
    from test_http import Scripted, reply

    packed = gzip.compress(jsonl(2000))
    server = Scripted()
    try:
        # No Content-Length: the connection's close looks like the end of the body.
        url = server.route("x.jsonl.gz", lambda h, n: reply(h, 200, packed[:-40], length=None))
        with pytest.raises(RecordError, match="truncated"):
            await collect(JsonLines(url, **FAST))
    finally:
        server.close()


async def test_gz_served_with_content_encoding_is_decoded_once(anyio_backend: str) -> None:
    from test_http import Scripted, reply

    body = jsonl(500)
    server = Scripted()
    try:
        # An object store holding x.jsonl.gz with Content-Encoding: gzip in its metadata: the
        # HTTP layer decodes it, the body arrives plain.
        once = server.route("once.jsonl.gz", lambda h, n: reply(
            h, 200, gzip.compress(body), headers={"Content-Encoding": "gzip"}))
        # A server compressing a .gz file on the fly: two layers, each decoded once.
        twice = server.route("twice.jsonl.gz", lambda h, n: reply(
            h, 200, gzip.compress(gzip.compress(body)), headers={"Content-Encoding": "gzip"}))
        # The common case: served as application/gzip, no content coding.
        plain = server.route("plain.jsonl.gz", lambda h, n: reply(
            h, 200, gzip.compress(body), headers={"Content-Type": "application/gzip"}))
        for url in (once, twice, plain):
            assert [r["i"] for r in await collect(JsonLines(url, **FAST))] == list(range(500))
        # compression= given: the bytes must be of that codec.
        with pytest.raises(RecordError, match="not a gzip stream"):
            await collect(JsonLines(once, compression="gzip", **FAST))
    finally:
        server.close()
