"""Attacks on compressed shards through the loopless local-file paths: several gzip members,
bz2 streams or zstd frames one after another, with a member's end falling exactly at the end
of a read chunk, and truncated or padded streams (a RecordError, never a raw codec error or
a silently short shard)."""

from __future__ import annotations

import bz2
import gzip
import importlib.util
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from sourcetools import collect

from aloader import RecordError, TextLines

pytestmark = pytest.mark.hostile

BODY = b"".join(b"line%04d\n" % i for i in range(300))
LINES = BODY.decode().splitlines()
CUT = 1000  # where the first member's data ends


def zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


CODECS: dict[str, Callable[[bytes], bytes]] = {"gz": gzip.compress, "bz2": bz2.compress}
if importlib.util.find_spec("zstandard") is not None:
    CODECS["zst"] = zstd


def read_every_way(path: Path, chunk_size: int) -> list[list[str]]:
    def make() -> TextLines:
        return TextLines(str(path), chunk_size=chunk_size)

    threaded = make()
    threaded._loopless = lambda: False  # type: ignore[method-assign]
    return [list(make()), anyio.run(collect, make()), list(threaded)]


@pytest.mark.parametrize("suffix", sorted(CODECS))
def test_members_ending_at_a_chunk_end(tmp_path: Path, suffix: str) -> None:
    # A member that ends exactly where a read ends: the next chunk starts the next member.
    compress = CODECS[suffix]
    first = compress(BODY[:CUT])
    path = tmp_path / f"multi.txt.{suffix}"
    path.write_bytes(first + compress(BODY[CUT:]) + compress(b""))
    for chunk_size in (1, 13, len(first), len(first) // 2, 1 << 16):
        for got in read_every_way(path, chunk_size):
            assert got == LINES, (suffix, chunk_size)


@pytest.mark.parametrize("suffix", sorted(CODECS))
def test_a_truncated_stream_is_a_record_error(tmp_path: Path, suffix: str) -> None:
    compress = CODECS[suffix]
    whole = compress(BODY[:CUT]) + compress(BODY[CUT:])
    path = tmp_path / f"cut.txt.{suffix}"
    for end in (len(whole) - 5, len(compress(BODY[:CUT])) + 3):
        path.write_bytes(whole[:end])
        for chunk_size in (1, 64, 1 << 16):
            with pytest.raises(RecordError, match="cut.txt"):
                list(TextLines(str(path), chunk_size=chunk_size))
            with pytest.raises(RecordError, match="cut.txt"):
                anyio.run(collect, TextLines(str(path), chunk_size=chunk_size))
