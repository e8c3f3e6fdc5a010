"""TarShards: webdataset-style samples from plain and compressed tar shards (made with
tarfile), sharded exactly once across ranks x workers, over HTTP, against webdataset's own
reading, and with hostile headers that must give located errors and bounded memory."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faulty_server import FaultyServer
from sourcetools import collect, interrupted, local_s3, read_as_consumers, write

from aloader import DataLoader, RecordError, TarShards
from aloader.sources._tar import split_key

pytestmark = pytest.mark.anyio


def member(name: str, data: bytes, **attrs: Any) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, data


def make_tar(members: list[tuple[tarfile.TarInfo, bytes]],
             fmt: int = tarfile.GNU_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buffer.getvalue()


def samples(start: int, count: int, prefix: str = "") -> list[tuple[tarfile.TarInfo, bytes]]:
    out = []
    for i in range(start, start + count):
        key = f"{prefix}{i:06d}"
        out.append(member(f"{key}.jpg", bytes([i % 256]) * (i % 700 + 1)))
        out.append(member(f"{key}.cls", str(i % 10).encode()))
        out.append(member(f"{key}.JSON", json.dumps({"i": i}).encode()))
    return out


@pytest.fixture
def server() -> Iterator[FaultyServer]:
    shard_server = FaultyServer({}).start()
    yield shard_server
    shard_server.close()


# --------------------------------------------------------------------------- reading


def test_split_key() -> None:
    assert split_key("a/b/000017.seg.png") == ("a/b/000017", "seg.png")
    assert split_key("x.jpg") == ("x", "jpg")
    assert split_key("dir.d/x.jpg") == ("dir.d/x", "jpg")
    assert split_key("noext") is None
    assert split_key("dir.d/noext") is None
    assert split_key(".hidden") is None


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
async def test_samples_grouped_by_key(tmp_path: Path, anyio_backend: str, fmt: int) -> None:
    path = write(tmp_path, "a.tar", make_tar(samples(0, 50), fmt))
    source = TarShards(path, chunk_size=700)
    got = await collect(source)
    assert len(got) == 50 and source.stats.records == 50 and source.stats.shards == 1
    for i, sample in enumerate(got):
        assert sample == {"__key__": f"{i:06d}", "__url__": path,
                          "jpg": bytes([i % 256]) * (i % 700 + 1),
                          "cls": str(i % 10).encode(), "json": json.dumps({"i": i}).encode()}


async def test_decoders(tmp_path: Path, anyio_backend: str) -> None:
    path = write(tmp_path, "a.tar", make_tar([*samples(0, 5), member("x.seg.png", b"p")]))
    got = await collect(TarShards(path, decoders={"json": json.loads, "CLS": int,
                                                  "png": len}))
    assert [s["json"] for s in got[:5]] == [{"i": i} for i in range(5)]
    assert [s["cls"] for s in got[:5]] == [i % 10 for i in range(5)]
    assert got[5] == {"__key__": "x", "__url__": path, "seg.png": 1}


async def test_long_names_pax_dirs_links_meta(tmp_path: Path, anyio_backend: str) -> None:
    deep = "d" * 150 + "/" + "k" * 120  # past ustar's 100 + 155
    members = [
        member("dir", b"", type=tarfile.DIRTYPE),
        member("__meta__", b"ignored"),
        member(f"{deep}.txt", b"long"),
        member(f"{deep}.bin", b"name"),
        member("link.txt", b"", type=tarfile.SYMTYPE, linkname="x" * 200),
        member("ü/ñ.txt", "é".encode()),
    ]
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        path = write(tmp_path, f"l{fmt}.tar", make_tar(members, fmt))
        got = await collect(TarShards(path))
        assert got == [{"__key__": deep, "__url__": path, "txt": b"long", "bin": b"name"},
                       {"__key__": "ü/ñ", "__url__": path, "txt": "é".encode()}]


async def test_large_member_spanning_chunks(tmp_path: Path, anyio_backend: str) -> None:
    blob = bytes(range(256)) * 4000
    path = write(tmp_path, "big.tar", make_tar([member("a.bin", blob), member("b.bin", b"")]))
    got = await collect(TarShards(path, chunk_size=4099))
    assert got[0]["bin"] == blob and got[1]["bin"] == b""


@pytest.mark.parametrize("suffix", [".tar.gz", ".tgz", ".tar.zst", ".tar.bz2"])
async def test_compressed_tars(tmp_path: Path, anyio_backend: str, suffix: str) -> None:
    raw = make_tar(samples(0, 30))
    if suffix in (".tar.gz", ".tgz"):
        packed = gzip.compress(raw)
    elif suffix == ".tar.bz2":
        import bz2

        packed = bz2.compress(raw)
    else:
        zstandard = pytest.importorskip("zstandard")
        packed = zstandard.ZstdCompressor().compress(raw)
    plain = await collect(TarShards(write(tmp_path, "p.tar", raw)))
    path = write(tmp_path, "c" + suffix, packed)
    got = await collect(TarShards(path, chunk_size=1000))
    assert [{**s, "__url__": None} for s in got] == [{**s, "__url__": None} for s in plain]


async def test_exactly_once_across_ranks_and_workers(tmp_path: Path,
                                                     anyio_backend: str) -> None:
    for shard in range(5):
        write(tmp_path, f"s{shard}.tar", make_tar(samples(shard * 20, 20)))
    read = await read_as_consumers(  # 8 consumers, 5 shards
        lambda rank: TarShards(str(tmp_path), rank=rank, world_size=2, shuffle_shards=True,
                               seed=5, even_ranks=False), 2, 4)
    seen = [s["__key__"] for s in read]
    assert sorted(seen) == [f"{i:06d}" for i in range(100)]


async def test_loader_with_two_workers(tmp_path: Path, anyio_backend: str) -> None:
    for shard in range(4):
        write(tmp_path, f"s{shard}.tar", make_tar(samples(shard * 10, 10)))
    source = TarShards(str(tmp_path), decoders={"cls": int})
    keys: list[str] = []
    async for batch in DataLoader(source, batch_size=8, num_workers=2):
        keys.extend(batch["__key__"])
    assert sorted(keys) == [f"{i:06d}" for i in range(40)]
    assert source.stats.records == 40 and source.stats.shards == 4


async def test_over_http_with_a_cut(server: FaultyServer, anyio_backend: str) -> None:
    raw = make_tar(samples(0, 40))
    server.files.update({"a.tar": raw, "b.tar.gz": gzip.compress(raw)})
    server.cut("a.tar", 5000)
    server.cut("b.tar.gz", 1000)
    source = TarShards([server.url("a.tar"), server.url("b.tar.gz")], backoff=0.01)
    got = await collect(source)
    assert [s["__key__"] for s in got] == [f"{i:06d}" for i in range(40)] * 2
    assert source.stats.retries == 2


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # webdataset's side is blocking
async def test_same_samples_as_webdataset(tmp_path: Path, anyio_backend: str) -> None:
    wds = pytest.importorskip("webdataset")
    members = [*samples(0, 20, prefix="train/"), member("__meta__", b"m"), *samples(20, 5)]
    paths = [write(tmp_path, "a.tar", make_tar(members)),
             write(tmp_path, "b.tar.gz", gzip.compress(make_tar(samples(30, 7))))]
    expected = [{k: v for k, v in s.items() if not k.startswith("__local")}
                for s in wds.WebDataset(paths, shardshuffle=False)]
    assert await collect(TarShards(paths)) == expected and len(expected) == 32


# --------------------------------------------------------------------------- bad tars


def offsets(raw: bytes) -> list[tuple[int, int]]:
    """(header offset, end of padded data) of each member."""
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        return [(m.offset, m.offset_data + -(-m.size // 512) * 512) for m in tar.getmembers()]


async def test_truncated_tar(tmp_path: Path, anyio_backend: str) -> None:
    raw = make_tar(samples(0, 10))
    spans = offsets(raw)
    for cut, inside in ((spans[12][0] + 600, "inside the data of member '000004.jpg'"),
                        (spans[7][0] + 100, "inside a header"),
                        (spans[20][1], "without the tar end-of-archive block")):
        path = write(tmp_path, "t.tar", raw[:cut])
        with pytest.raises(RecordError, match=rf"t\.tar: .*truncated.*{inside}") as info:
            await collect(TarShards(path))
        assert info.value.source == path and info.value.offset is not None
        source = TarShards(path, skip_errors=True)
        got = await collect(source)
        assert source.stats.skipped == 1
        assert [s["__key__"] for s in got] == [f"{i:06d}" for i in range(len(got))]
        assert all(len(s) == 5 for s in got)  # whole samples only


async def test_missing_end_of_archive(tmp_path: Path, anyio_backend: str) -> None:
    raw = make_tar(samples(0, 3))
    path = write(tmp_path, "noend.tar", raw[: offsets(raw)[-1][1]])  # no zero blocks
    with pytest.raises(RecordError, match="without the tar end-of-archive block"):
        await collect(TarShards(path))


async def test_bad_checksum(tmp_path: Path, anyio_backend: str) -> None:
    raw = bytearray(make_tar(samples(0, 5)))
    second = 512 + 512  # the header after the first member (1 data block)
    raw[second + 10] ^= 0x20
    path = write(tmp_path, "bad.tar", bytes(raw))
    with pytest.raises(RecordError, match=rf"header at tar byte offset {second}: bad header "
                                          "checksum") as info:
        await collect(TarShards(path))
    assert info.value.offset == second


async def test_orphans_and_duplicates(tmp_path: Path, anyio_backend: str) -> None:
    members = [*samples(0, 2), member("README", b"x"), *samples(2, 2),
               member("000003.jpg", b"again"), *samples(4, 1)]
    path = write(tmp_path, "o.tar", make_tar(members))
    with pytest.raises(RecordError, match=r"member 'README' at tar byte offset \d+: a member "
                                          "without an extension"):
        await collect(TarShards(path))
    source = TarShards(path, skip_errors=True)
    got = await collect(source)
    assert [s["__key__"] for s in got] == ["000000", "000001", "000002", "000004"]
    assert source.stats.skipped == 2
    assert "second member with the extension 'jpg'" in str(source.stats.skipped_errors[1])


async def test_key_again_later_is_a_new_sample(tmp_path: Path, anyio_backend: str) -> None:
    members = [member("a.x", b"1"), member("b.x", b"2"), member("a.y", b"3")]
    got = await collect(TarShards(write(tmp_path, "k.tar", make_tar(members))))
    assert [(s["__key__"], sorted(s)) for s in got] == [
        ("a", ["__key__", "__url__", "x"]), ("b", ["__key__", "__url__", "x"]),
        ("a", ["__key__", "__url__", "y"])]


async def test_decoder_failure_drops_the_sample(tmp_path: Path, anyio_backend: str) -> None:
    members = samples(0, 3)
    members[4] = member("000001.cls", b"not a number")
    path = write(tmp_path, "d.tar", make_tar(members))
    with pytest.raises(RecordError, match=r"member '000001.cls' .*the decoder for 'cls' "
                                          "failed: ValueError"):
        await collect(TarShards(path, decoders={"cls": int}))
    got = await collect(TarShards(path, decoders={"cls": int}, skip_errors=True))
    assert [s["__key__"] for s in got] == ["000000", "000002"]


def hostile_header(name: bytes, size_field: bytes, kind: bytes = b"0") -> bytes:
    block = bytearray(512)
    block[: len(name)] = name
    block[100:108] = b"0000644\0"
    block[124:136] = size_field
    block[156:157] = kind
    block[257:265] = b"ustar  \0"
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


@pytest.mark.parametrize(("size_field", "message"), [
    (b"77777777777\0", "truncated: the header promises"),  # 8 GiB, shard far smaller
    (b"\x80" + (1 << 80).to_bytes(11, "big"), "truncated: the header promises"),
    (b"\xff" * 12, "negative size"),
    (b"12x4\0       ", "not an octal number"),
])
async def test_hostile_sizes(tmp_path: Path, anyio_backend: str, size_field: bytes,
                             message: str) -> None:
    data = make_tar(samples(0, 1)) [:-10240] + hostile_header(b"../../etc/x.bin", size_field) \
        + bytes(4096)
    path = write(tmp_path, "h.tar", data)
    source = TarShards(path)
    with pytest.raises(RecordError, match=message):
        await collect(source)


async def test_hostile_size_unknown_length_is_bounded(server: FaultyServer,
                                                      anyio_backend: str) -> None:
    # Compressed: the shard's size is unknown, so the promise is only found out at the end;
    # the data is never held (above max_sample_bytes).
    data = hostile_header(b"a.bin", b"\x80" + (1 << 40).to_bytes(11, "big")) + bytes(200_000)
    path_name = "h.tar.gz"
    server.files[path_name] = gzip.compress(data)
    source = TarShards(server.url(path_name), max_sample_bytes=1 << 20, skip_errors=True)
    assert await collect(source) == []
    assert source.stats.skipped == 2  # the oversized member, then the truncation
    assert "more than max_sample_bytes" in str(source.stats.skipped_errors[0])


async def test_huge_pax_header_refused(tmp_path: Path, anyio_backend: str) -> None:
    data = hostile_header(b"pax", b"%011o\0" % (1 << 30), b"x") + bytes(1024)
    path = write(tmp_path, "p.tar", data)
    with pytest.raises(RecordError, match="'x' header of 1073741824 bytes"):
        await collect(TarShards(path, compression=None))


def test_bad_arguments(tmp_path: Path) -> None:
    path = write(tmp_path, "a.tar", make_tar(samples(0, 1)))
    with pytest.raises(TypeError, match="decoders should map"):
        TarShards(path, decoders={"x": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="max_sample_bytes"):
        TarShards(path, max_sample_bytes=0)


# --------------------------------------------------------------------------- object stores

TAR_BUCKET = "tar-bucket"


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    """moto's S3 server with 5 shards under tars/ (20 samples each; the last one gzipped)."""
    shards = {f"tars/s{shard}.tar": make_tar(samples(shard * 20, 20)) for shard in range(4)}
    shards["tars/s4.tar.gz"] = gzip.compress(make_tar(samples(80, 20)))
    with local_s3(TAR_BUCKET, {**shards, "tars/.hidden.tar": make_tar(samples(500, 1))}
                  ) as server:
        yield server


KEYS = [f"{i:06d}" for i in range(100)]


async def test_s3_prefix_pattern_and_exactly_once(s3: Any, anyio_backend: str) -> None:
    store = s3.store(TAR_BUCKET)
    everything = TarShards(f"s3://{TAR_BUCKET}/tars/", store=store, decoders={"cls": int})
    assert TarShards(f"s3://{TAR_BUCKET}/tars/*.tar*", store=store).shards == everything.shards
    got = await collect(everything)
    assert [s["__key__"] for s in got] == KEYS
    assert got[3] == {"__key__": "000003", "__url__": f"s3://{TAR_BUCKET}/tars/s0.tar",
                      "jpg": bytes([3]) * 4, "cls": 3, "json": b'{"i": 3}'}
    assert (everything.stats.records, everything.stats.shards) == (100, 5)
    read = await read_as_consumers(  # 8 consumers, 5 shards
        lambda rank: TarShards(f"s3://{TAR_BUCKET}/tars/*", store=store, rank=rank,
                               world_size=2, shuffle_shards=True, seed=5, even_ranks=False),
        2, 4)
    assert sorted(s["__key__"] for s in read) == KEYS


async def test_s3_resume_and_a_cut(s3: Any, anyio_backend: str) -> None:
    store = s3.store(TAR_BUCKET)

    def make() -> TarShards:
        return TarShards(f"s3://{TAR_BUCKET}/tars/", store=store, chunk_size=2000,
                         backoff=0.01)

    full = await collect(make())
    for k in (1, 30, 95):  # in a plain shard, a shard's first sample, the gzipped shard
        rest, _ = await interrupted(make, k)
        assert rest == full[k:], k
    s3.proxy.reset()
    # The first shard's GET only: a read of an interrupted stream above may still be in
    # flight (a cancelled request may still reach the server).
    s3.proxy.cut(1, after=3000, path="tars/s0.tar")
    cut = make()
    assert await collect(cut) == full
    assert cut.stats.retries == 1
    s3.proxy.reset()
