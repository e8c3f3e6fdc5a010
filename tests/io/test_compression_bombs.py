"""Attacks on compressed shards (aloader.io._compression) through the sources: a decompression
bomb inflating to hundreds of megabytes as one line (refused at ``max_record_bytes``, or
skipped through in bounded memory), concatenated and empty gzip members with header fields,
zstd skippable frames anywhere (split at every chunk size), and trailing garbage after a
valid stream (an error for every codec, even zero padding: documented)."""

from __future__ import annotations

import bz2
import functools
import gzip
import importlib.util
import io
import struct
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from sourcetools import collect, write

from aloader import RecordError, TextLines

pytestmark = [pytest.mark.hostile, pytest.mark.anyio]

HAS_ZSTD = importlib.util.find_spec("zstandard") is not None
needs_zstd = pytest.mark.skipif(not HAS_ZSTD, reason="needs zstandard")


def zst(data: bytes) -> bytes:
    import zstandard

    return bytes(zstandard.ZstdCompressor().compress(data))


def skippable(payload: bytes, magic: int = 0x184D2A50) -> bytes:
    return struct.pack("<II", magic, len(payload)) + payload


def peak_of(read: Callable[[], Any]) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        out = read()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@functools.cache
def _zeros() -> bytes:
    return gzip.compress(bytes(64 << 20), compresslevel=1)  # 64 MiB of zeros in ~280 KB


def bomb(members: int) -> bytes:
    """``members`` x 64 MiB of zero bytes, one line (gzip members one after another), then
    the line ``after``."""
    return _zeros() * members + gzip.compress(b"\nafter\n")


async def test_a_bomb_of_one_line_is_refused_at_max_record_bytes(
        tmp_path: Path, anyio_backend: str) -> None:
    path = write(tmp_path, "bomb.txt.gz", gzip.compress(b"first\n") + bomb(16))  # 1 GiB
    source = TextLines(path, max_record_bytes=1 << 20)
    with pytest.raises(RecordError, match=r"bomb\.txt\.gz: line 2 \(byte offset 6\): line "
                                          r"longer than max_record_bytes \(1048576 bytes\)"):
        await collect(source)
    # Refused as soon as the line outgrew the limit, not after inflating the gigabyte.
    assert source.stats.bytes < 8 << 20


def test_a_bomb_skipped_through_is_read_in_bounded_memory(tmp_path: Path) -> None:
    path = write(tmp_path, "bomb.txt.gz", bomb(4))  # 256 MiB of one line, then "after"
    source = TextLines(path, max_record_bytes=1 << 20, skip_errors=True)
    lines, peak = peak_of(lambda: list(source))
    assert lines == ["after"] and source.stats.skipped == 1
    assert source.stats.bytes == (256 << 20) + len("\nafter\n")
    assert peak < 8 << 20, peak


@pytest.mark.parametrize("codec", ["bz2", "zstd"])
def test_other_codecs_bombs_alike(tmp_path: Path, codec: str) -> None:
    if codec == "zstd" and not HAS_ZSTD:
        pytest.skip("needs zstandard")
    data = bytes(32 << 20) + b"\nafter\n"
    packed = bz2.compress(data, 1) if codec == "bz2" else zst(data)
    path = write(tmp_path, f"bomb.txt.{'bz2' if codec == 'bz2' else 'zst'}", packed)
    source = TextLines(path, max_record_bytes=1 << 20, skip_errors=True)
    lines, peak = peak_of(lambda: list(source))
    assert lines == ["after"] and source.stats.skipped == 1
    assert peak < (48 << 20 if codec == "zstd" else 8 << 20), peak  # zstd: 16 MiB a call


def gzip_with_fields(data: bytes) -> bytes:
    """A gzip member with a file name, a comment-free header, an mtime (as gzip(1) writes)."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="inner name.txt", mode="wb", fileobj=buffer, mtime=123) as out:
        out.write(data)
    return buffer.getvalue()


def test_concatenated_gzip_members_empty_ones_and_header_fields(tmp_path: Path) -> None:
    body = b"".join(b"l%03d\n" % i for i in range(200))
    packed = (gzip.compress(b"") + gzip_with_fields(body[:333]) + gzip.compress(b"")
              + gzip.compress(body[333:700]) + gzip_with_fields(body[700:]) + gzip.compress(b""))
    path = write(tmp_path, "m.txt.gz", packed)
    expected = body.decode().splitlines()
    for chunk_size in (1, 2, 7, 10, 64, 1 << 16):
        assert list(TextLines(path, chunk_size=chunk_size)) == expected, chunk_size
        assert anyio.run(collect, TextLines(path, chunk_size=chunk_size)) == expected


@needs_zstd
def test_zstd_skippable_frames_anywhere(tmp_path: Path) -> None:
    body = b"".join(b"z%03d\n" % i for i in range(200))
    packed = (skippable(b"meta" * 10) + zst(body[:500]) + skippable(b"", 0x184D2A5F)
              + skippable(b"x" * 300, 0x184D2A57) + zst(body[500:]) + skippable(b"end"))
    path = write(tmp_path, "s.txt.zst", packed)
    expected = body.decode().splitlines()
    for chunk_size in (1, 3, 8, 9, 13, 300, 1 << 16):
        assert list(TextLines(path, chunk_size=chunk_size)) == expected, chunk_size
    only = write(tmp_path, "only.txt.zst", skippable(b"nothing else"))
    assert list(TextLines(only)) == []


@needs_zstd
def test_a_skippable_frame_running_past_the_end_is_truncated(tmp_path: Path) -> None:
    packed = zst(b"a\nb\n") + struct.pack("<II", 0x184D2A50, 1 << 30) + b"short"
    path = write(tmp_path, "t.txt.zst", packed)
    with pytest.raises(RecordError, match=r"t\.txt\.zst: zstd stream.*truncated"):
        list(TextLines(path))


def _trailing_cases() -> list[tuple[str, bytes]]:
    cases = [("gz", gzip.compress(b"a\nb\n")), ("bz2", bz2.compress(b"a\nb\n"))]
    if HAS_ZSTD:
        cases.append(("zst", zst(b"a\nb\n")))
    return cases


@pytest.mark.parametrize(("suffix", "packed"), _trailing_cases())
@pytest.mark.parametrize("tail", [b"garbage that is long enough", b"xy", bytes(512),
                                  b"\x1f\x8b\x08\x00"])
def test_trailing_bytes_after_a_valid_stream_are_an_error(
        tmp_path: Path, suffix: str, packed: bytes, tail: bytes) -> None:
    """Not a silently short or padded shard: any bytes after the last member that do not
    make a member of their own fail the shard (zero padding included, which gzip(1) only
    warns about), after its records."""
    path = write(tmp_path, f"t.txt.{suffix}", packed + tail)
    got: list[str] = []
    with pytest.raises(RecordError, match=rf"t\.txt\.{suffix}: "):
        for line in TextLines(path, chunk_size=7):
            got.append(line)
    assert got in ([], ["a", "b"])
    source = TextLines(path, skip_errors=True)
    assert list(source) in ([], ["a", "b"]) and source.stats.skipped == 1


def test_a_raw_deflate_shard_is_not_gzip(tmp_path: Path) -> None:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw = compressor.compress(b"a\n") + compressor.flush()
    path = write(tmp_path, "r.txt.gz", raw)
    with pytest.raises(RecordError, match=r"r\.txt\.gz: gzip stream.*not a gzip stream"):
        list(TextLines(path))
