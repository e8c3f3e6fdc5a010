"""Attacks on aloader.sources._tar with hostile tars: a shard cut at every offset of its last member
and end blocks (size known or not), chunks split at every offset, ``..`` and absolute names,
pax headers that lie about a member's size or path, GNU long names, a repeated key and
extension, and tar bombs of many tiny members. Whole samples or a located error: never a
sample lost silently, half a sample, or memory that grows with the shard."""

from __future__ import annotations

import io
import itertools
import os
import tarfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from sourcetools import collect, write
from test_tar import hostile_header, make_tar, member, samples

from aloader import RecordError, SourceStats, TarShards
from aloader.sources._formats import BadRecords
from aloader.sources._tar import TarDecoder

pytestmark = [pytest.mark.hostile, pytest.mark.anyio]


def decode(data: bytes, *, pieces: list[int] | None = None, size: bool = True,
           skip: bool = False, max_sample_bytes: int = 1 << 30
           ) -> tuple[list[dict[str, Any]], RecordError | None, SourceStats]:
    """``data`` through a TarDecoder, fed in pieces cut at the offsets ``pieces`` (one piece
    if None), its size told or not: (samples, the error it stopped on, the stats)."""
    stats = SourceStats()
    decoder = TarDecoder("t.tar", BadRecords(skip, stats), max_sample_bytes)
    if size:
        decoder.set_size(len(data))
    out: list[dict[str, Any]] = []
    bounds = [0, *(pieces or []), len(data)]
    for start, end in itertools.pairwise(bounds):
        out += decoder.feed(data[start:end])
        if decoder.pending is not None:
            return out, decoder.pending, stats
    while block := decoder.finish():
        out += block
    return out, decoder.pending, stats


def keys(got: list[dict[str, Any]]) -> list[str]:
    return [sample["__key__"] for sample in got]


RAW = make_tar(samples(0, 2))  # 2 samples of 3 members (jpg, cls, json)
EXPECTED, _, _ = decode(RAW)


def last_member_and_end(raw: bytes) -> tuple[int, int]:
    """(offset of the last member's header, end of the first end-of-archive block)."""
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        last = tar.getmembers()[-1]
    end = last.offset_data + -(-last.size // 512) * 512
    return last.offset, end + 512


def test_the_reference_reading() -> None:
    assert keys(EXPECTED) == ["000000", "000001"]
    assert all(len(sample) == 5 for sample in EXPECTED)


@pytest.mark.parametrize("size", [True, False])
def test_cut_at_every_offset_of_the_last_member_and_the_end_blocks(size: bool) -> None:
    first, end = last_member_and_end(RAW)
    for cut in range(first, end + 1024):  # (then tarfile's padding, to 10 KiB)
        got, error, _ = decode(RAW[:cut], size=size)
        if cut >= end:  # the first end-of-archive block is whole: the archive is
            assert (got, error) == (EXPECTED, None), cut
            continue
        assert error is not None and "truncated" in str(error), cut
        assert error.source == "t.tar" and error.offset is not None
        assert got == EXPECTED[:1], cut  # the last sample is not delivered half
        got, error, stats = decode(RAW[:cut], size=size, skip=True)
        assert (got, error, stats.skipped) == (EXPECTED[:1], None, 1), cut


def test_chunks_cut_at_every_offset_frame_alike() -> None:
    _, end = last_member_and_end(RAW)
    for cut in range(1, end):
        assert decode(RAW, pieces=[cut], size=False)[:2] == (EXPECTED, None), cut
    one_byte_each = list(range(1, end))
    assert decode(RAW, pieces=one_byte_each)[:2] == (EXPECTED, None)


async def test_dot_dot_and_absolute_names_are_only_keys(tmp_path: Path,
                                                        anyio_backend: str) -> None:
    names = ["../../escape.txt", "/etc/abs.txt", "a/../../b.txt", "./c.txt"]
    shard = tmp_path / "shard"
    shard.mkdir()
    path = write(shard, "n.tar", make_tar([member(name, b"x") for name in names]))
    before = sorted(os.walk(tmp_path))
    got = await collect(TarShards(path))
    assert keys(got) == ["../../escape", "/etc/abs", "a/../../b", "./c"]
    assert sorted(os.walk(tmp_path)) == before  # nothing written anywhere


def pax_header(records: dict[str, str]) -> bytes:
    """A pax extended header ('x') block and its data, padded."""
    body = b""
    for key, value in records.items():
        record = f" {key}={value}\n".encode()
        length = len(record) + len(str(len(record)))
        length = len(record) + len(str(length))
        body += str(length).encode() + record
    head = hostile_header(b"././@PaxHeader", b"%011o\0" % len(body), b"x")
    return head + body + bytes(-len(body) % 512)


def data_member(name: bytes, data: bytes) -> bytes:
    return hostile_header(name, b"%011o\0" % len(data)) + data + bytes(-len(data) % 512)


@pytest.mark.parametrize(("records", "message"), [
    ({"size": "-5"}, "bad pax size '-5'"),
    ({"size": "1e3"}, "bad pax size '1e3'"),
    ({"size": str(1 << 40)}, "truncated: the header promises 1099511627776 bytes"),
])
def test_a_pax_size_that_lies_is_a_located_error(records: dict[str, str], message: str) -> None:
    # The sample in progress ("z": a member of its key could still follow) is dropped.
    data = data_member(b"a.txt", b"one") + data_member(b"z.txt", b"two") + pax_header(records) \
        + data_member(b"b.txt", b"two") + bytes(1024)
    got, error, _ = decode(data)
    assert keys(got) == ["a"]
    assert error is not None and message in str(error)


def test_a_pax_size_is_the_members_size() -> None:
    """pax overrides the header's size field (as tar does): the data framed by it."""
    data = pax_header({"size": "5", "path": "p/../q.bin"}) + data_member(b"zzz.txt", b"hello") \
        + data_member(b"c.txt", b"ccc") + bytes(1024)
    got, error, _ = decode(data)
    assert error is None
    assert [(s["__key__"], s.get("bin"), s.get("txt")) for s in got] == [
        ("p/../q", b"hello", None), ("c", None, b"ccc")]


@pytest.mark.parametrize("bad", [b"12 path=x\n", b"99999 path=x\n", b"3 p\n", b"x path=y\n"])
def test_a_malformed_pax_record_is_a_located_error(bad: bytes) -> None:
    head = hostile_header(b"././@PaxHeader", b"%011o\0" % len(bad), b"x")
    data = data_member(b"a.txt", b"1") + data_member(b"z.txt", b"1") + head + bad \
        + bytes(-len(bad) % 512) + data_member(b"b.txt", b"2") + bytes(1024)
    got, error, _ = decode(data)
    assert keys(got) == ["a"]
    assert error is not None and "malformed pax record" in str(error)
    assert error.offset == 2048  # the pax header's


def test_gnu_long_names_with_dots_and_dot_dot() -> None:
    long_dir = "d.e" * 60
    names = [f"{long_dir}/../0001.seg.png", f"{long_dir}/../0001.CLS", "short.txt"]
    got, error, _ = decode(make_tar([member(name, name.encode()) for name in names]))
    assert error is None
    assert got == [{"__key__": f"{long_dir}/../0001", "__url__": "t.tar",
                    "seg.png": names[0].encode(), "cls": names[1].encode()},
                   {"__key__": "short", "__url__": "t.tar", "txt": b"short.txt"}]


def test_a_gnu_long_name_cut_or_without_its_member() -> None:
    raw = make_tar([member("L" * 300 + ".txt", b"x")])
    got, error, _ = decode(raw[:700])  # inside the long name's data
    assert got == [] and error is not None and "truncated" in str(error)
    # A long name followed by the end of the archive names nothing: no sample, no error.
    long_name = raw[:1024]
    assert decode(long_name + bytes(1024))[:2] == ([], None)


@pytest.mark.parametrize("second", ["a.jpg", "a.JPG"])
def test_the_same_key_and_extension_twice_drops_the_sample(second: str) -> None:
    raw = make_tar([member("a.jpg", b"1"), member("a.cls", b"2"), member(second, b"3"),
                    member("b.jpg", b"4")])
    got, error, _ = decode(raw)
    assert got == [] and error is not None
    assert "member 'a." in str(error) and "second member with the extension 'jpg'" in str(error)
    got, error, stats = decode(raw, skip=True)
    assert keys(got) == ["b"] and error is None and stats.skipped == 1


def _peak_while(consume: Any) -> int:
    tracemalloc.start()
    try:
        consume()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_tar_bomb_of_tiny_samples_is_read_in_bounded_memory(tmp_path: Path) -> None:
    """8,000 one-member samples (an 8 MB shard of 1 KiB members): what is held at once is a
    chunk's samples, not the shard's."""
    count = 8000
    block = b"".join(data_member(b"%06d.b" % i, b"x") for i in range(count))
    path = write(tmp_path, "bomb.tar", block + bytes(1024))
    seen = 0

    def consume() -> None:
        nonlocal seen
        for _ in TarShards(path, chunk_size=1 << 16):
            seen += 1

    peak = _peak_while(consume)
    assert seen == count
    assert peak < 2 << 20, peak  # the shard is 8 MB


def test_many_tiny_members_of_one_sample_are_bounded_by_max_sample_bytes() -> None:
    """Members of no data still cost a header each (and a place in the sample): counted in
    ``max_sample_bytes``, so one key with a million extensions cannot grow without bound."""
    count = 4000
    data = b"".join(hostile_header(b"k.e%d" % i, b"%011o\0" % 0) for i in range(count))
    got, error, _ = decode(data + bytes(1024), max_sample_bytes=100 * 512)
    assert got == [] and error is not None and "more than max_sample_bytes" in str(error)
