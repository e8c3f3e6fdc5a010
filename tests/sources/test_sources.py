"""File sources and sharding: exact counts, exactly-once across ranks x workers, errors with
locations, skipping bad records, cleanup of file handles."""

from __future__ import annotations

import errno
import gc
import json
import os
import pickle
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sourcetools import as_worker, collect, open_handles

import aloader
from aloader import (
    BinaryRecords,
    DataLoader,
    JsonLines,
    NpyRows,
    RecordError,
    TextLines,
)
from aloader.io import _files
from aloader.io._files import file_chunks
from aloader.sources._sharding import assign_shards, expand_shards

pytestmark = pytest.mark.anyio


# --------------------------------------------------------------------------- helpers


def write_jsonl(directory: Path, shards: int, per_shard: int) -> list[Path]:
    paths = []
    for shard in range(shards):
        path = directory / f"part-{shard:03d}.jsonl"
        with open(path, "w") as f:
            for i in range(per_shard):
                f.write(json.dumps({"id": shard * per_shard + i, "shard": shard}) + "\n")
        paths.append(path)
    return paths


async def settle(condition: Any, rounds: int = 200) -> bool:
    """Let the loop run until ``condition()`` holds (bounded); whether it did."""
    for _ in range(rounds):
        gc.collect()
        if condition():
            return True
        await anyio.sleep(0.01)
    return bool(condition())


# --------------------------------------------------------------------------- formats


async def test_text_lines_exact(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "a.txt"
    path.write_bytes(b"one\r\ntwo\n\nfour\nfive")  # CRLF, an empty line, no final newline
    assert await collect(TextLines(path)) == ["one", "two", "", "four", "five"]
    # Tiny chunks: lines cut across chunks still come out whole.
    assert await collect(TextLines(path, chunk_size=3)) == ["one", "two", "", "four", "five"]


async def test_text_lines_match_python_loop(tmp_path: Path, anyio_backend: str) -> None:
    rng = np.random.default_rng(0)
    lines = ["".join(chr(c) for c in rng.integers(97, 123, rng.integers(0, 40)))
             for _ in range(3000)]
    lines[5] = "héllo wörld ✓"
    path = tmp_path / "t.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with open(path, encoding="utf-8") as f:
        expected = [line.rstrip("\n") for line in f]
    for chunk_size in (7, 1000, 1 << 18):
        assert await collect(TextLines(path, chunk_size=chunk_size)) == expected


async def test_jsonl_list_dir_glob(tmp_path: Path, anyio_backend: str) -> None:
    paths = write_jsonl(tmp_path, 4, 250)
    expected = list(range(1000))
    for spec in (paths, str(tmp_path), str(tmp_path / "*.jsonl"), [str(p) for p in paths]):
        records = await collect(JsonLines(spec, concurrency=2))
        assert [r["id"] for r in records] == expected
    single = await collect(JsonLines(paths[1]))
    assert [r["id"] for r in single] == list(range(250, 500))


async def test_npy_not_loaded_whole(tmp_path: Path, anyio_backend: str) -> None:
    # 4,000 rows of 256 bytes; with small chunks, the first row arrives after a few reads.
    array = np.arange(4000 * 64, dtype=np.float32).reshape(4000, 64)
    np.save(tmp_path / "big.npy", array)
    source = NpyRows(tmp_path / "big.npy", chunk_size=4096, concurrency=1)
    iterator = source.__aiter__()
    first = await iterator.__anext__()
    np.testing.assert_array_equal(first, array[0])
    for _ in range(20):
        await anyio.sleep(0.005)
    assert source.stats.bytes < array.nbytes // 10
    await iterator.aclose()  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- bad input


def test_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("a\n")
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        TextLines(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="no shard files match"):
        TextLines(str(tmp_path / "*.nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        TextLines(tmp_path / "empty")
    with pytest.raises(ValueError, match="concurrency should be a positive integer"):
        TextLines(tmp_path / "x.txt", concurrency=0)
    with pytest.raises(ValueError, match="ASCII-compatible"):
        TextLines(tmp_path / "x.txt", encoding="utf-16")
    with pytest.raises(ValueError, match="header should be a struct format"):
        BinaryRecords(tmp_path / "x.txt", header="<II")
    with pytest.raises(ValueError,
                       match=r"Invalid rank 2, rank should be in the interval \[0, 1\]"):
        TextLines(tmp_path / "x.txt", rank=2, world_size=2)
    with pytest.raises(TypeError, match="shards should be"):
        TextLines(42)  # type: ignore[arg-type]


async def test_chunk_size_beyond_the_file(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "small.txt"
    path.write_bytes(b"one\ntwo\n")
    # A read of chunk_size bytes would allocate a terabyte before reading eight.
    assert await collect(TextLines(path, chunk_size=1 << 40)) == ["one", "two"]


async def _chunks(path: Path, chunk_size: int, start: int = 0) -> list[bytes]:
    sizes: list[int] = []
    out = [chunk async for chunk in file_chunks(str(path), chunk_size, sizes.append, start)]
    assert sizes == [path.stat().st_size]
    return out


@pytest.mark.parametrize("how", ["cached", "thread", "no_nowait"])
async def test_file_chunks_read_every_byte_once(
    tmp_path: Path, anyio_backend: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    path = tmp_path / "bytes.bin"
    data = bytes(range(256)) * 8 + b"tail"
    path.write_bytes(data)
    calls: list[int] = []
    if how == "thread":  # not in the page cache: every read goes to a thread
        monkeypatch.setattr(_files, "_read_cached", lambda fd, size, position: None)
    elif how == "no_nowait":  # a file system that refuses RWF_NOWAIT: threads from then on

        def refuse(fd: int, buffers: Any, position: int, flags: int) -> int:
            calls.append(position)
            raise OSError(errno.EOPNOTSUPP, "not supported")

        monkeypatch.setattr(os, "preadv", refuse)
    for chunk_size in (7, 100, 1 << 20):
        chunks = await _chunks(path, chunk_size)
        assert b"".join(chunks) == data
        assert all(len(chunk) <= chunk_size for chunk in chunks)
        # From a byte inside the file (a resumed shard), and from its end.
        assert b"".join(await _chunks(path, chunk_size, 1234)) == data[1234:]
        assert await _chunks(path, chunk_size, len(data)) == []
    if how == "no_nowait" and _files._NOWAIT is not None:
        assert calls == [0, 1234, len(data)] * 3  # asked once per file, then never again


async def test_file_chunks_short_cached_reads(tmp_path: Path, anyio_backend: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Only part of a chunk in the cache: the cached part now, the rest in a thread.
    path = write_jsonl(tmp_path, 1, 300)[0]
    data = path.read_bytes()
    real = _files._read_cached
    turn = iter(range(1 << 20))

    def flaky(fd: int, size: int, position: int) -> bytes | None:
        step = next(turn)
        if step % 3 == 2:
            return None
        return real(fd, min(size, 7 + step), position) if _files._NOWAIT else None

    monkeypatch.setattr(_files, "_read_cached", flaky)
    assert b"".join(await _chunks(path, 1000)) == data
    assert await collect(JsonLines(path, chunk_size=1000)) == [
        json.loads(line) for line in data.splitlines()]


@pytest.mark.skipif(_files._NOWAIT is None or not hasattr(os, "posix_fadvise"),
                    reason="reads from the page cache need Linux's RWF_NOWAIT")
async def test_file_chunks_not_in_the_page_cache(tmp_path: Path, anyio_backend: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Bytes that are not cached are refused on the loop's thread (EAGAIN), read in a thread.
    path = tmp_path / "cold.bin"
    data = os.urandom(1 << 18)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages: the kernel may drop them now
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    refused: list[int] = []
    real = _files._read_cached

    def watch(fd: int, size: int, position: int) -> bytes | None:
        out = real(fd, size, position)
        if out is None:
            refused.append(position)
        return out

    monkeypatch.setattr(_files, "_read_cached", watch)
    assert b"".join(await _chunks(path, 1 << 16)) == data
    if not refused:  # tmpfs, for one, keeps every page: nothing to refuse there
        pytest.skip("the file system kept the file's pages in memory")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
async def test_a_named_pipe_is_read_in_order(tmp_path: Path, anyio_backend: str) -> None:
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    lines = [f"line {i}" for i in range(5000)]

    def write() -> None:
        with open(fifo, "w") as f:
            f.write("\n".join(lines))

    async with anyio.create_task_group() as group:
        group.start_soon(anyio.to_thread.run_sync, write)
        assert await collect(TextLines(fifo, chunk_size=1000)) == lines


async def test_file_chunks_io_error_raises(tmp_path: Path, anyio_backend: str) -> None:
    with pytest.raises(FileNotFoundError):
        await _chunks(tmp_path / "missing.bin", 100)
    baseline = open_handles(tmp_path)
    with pytest.raises(IsADirectoryError):
        async for _ in file_chunks(str(tmp_path), 100):
            pass
    assert open_handles(tmp_path) == baseline


async def test_jsonl_resume_mid_file(tmp_path: Path, anyio_backend: str) -> None:
    # A resumed shard is read from the byte where the block of the next record starts.
    paths = write_jsonl(tmp_path, 2, 300)
    full = await collect(JsonLines(paths))
    for chunk_size in (100, 1 << 16):
        for k in (1, 150, 299, 300, 451):
            source = JsonLines(paths, chunk_size=chunk_size, skip_errors=True)
            iterator = source.__aiter__()
            for _ in range(k):
                await iterator.__anext__()
            state = source.state_dict()
            await iterator.aclose()  # type: ignore[attr-defined]
            fresh = JsonLines(paths, chunk_size=chunk_size, skip_errors=True)
            fresh.load_state_dict(state)
            assert await collect(fresh) == full[k:], (chunk_size, k)


@pytest.mark.parametrize("source_type", [TextLines, JsonLines, BinaryRecords, NpyRows])
def test_no_shards_is_an_error(source_type: Any) -> None:
    for empty in ([], ()):
        with pytest.raises(ValueError, match="no shards given"):
            source_type(empty)


# --------------------------------------------------------------------------- sharding


@settings(max_examples=100, deadline=None)
@given(
    num_shards=st.integers(0, 40),
    world_size=st.integers(1, 5),
    num_workers=st.integers(1, 6),
    epoch=st.integers(0, 1000),
    seed=st.integers(0, 2**32),
    shuffle=st.booleans(),
)
def test_assign_shards_exactly_once(num_shards: int, world_size: int, num_workers: int,
                                    epoch: int, seed: int, shuffle: bool) -> None:
    seen: list[int] = []
    for rank in range(world_size):
        for worker in range(num_workers):
            part = assign_shards(num_shards, rank=rank, world_size=world_size,
                                 worker_id=worker, num_workers=num_workers, epoch=epoch,
                                 seed=seed, shuffle=shuffle)
            # Consumers get equal shares up to one shard.
            assert len(part) in (num_shards // (world_size * num_workers),
                                 -(-num_shards // (world_size * num_workers)))
            seen.extend(part)
    assert sorted(seen) == list(range(num_shards))


def test_assign_shards_order_per_epoch() -> None:
    def order(epoch: int, seed: int = 0) -> list[int]:
        return assign_shards(100, rank=0, world_size=1, worker_id=0, num_workers=1,
                             epoch=epoch, seed=seed, shuffle=True)

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert order(3, seed=1) == order(4, seed=0)  # seeded by seed + epoch, like torch
    assert sorted(order(0)) == list(range(100))
    assert assign_shards(10, rank=1, world_size=2, worker_id=0, num_workers=1) == [1, 3, 5, 7, 9]


@pytest.mark.parametrize("world_size,num_workers", [(1, 1), (1, 3), (2, 2), (3, 4), (2, 8)])
async def test_exactly_once_across_ranks_and_workers(
    tmp_path: Path, anyio_backend: str, world_size: int, num_workers: int
) -> None:
    write_jsonl(tmp_path, 7, 30)  # 7 shards: some setups have more consumers than shards
    for epoch in (0, 1):
        seen: list[int] = []
        orders = []
        for rank in range(world_size):
            for worker in range(num_workers):
                source = JsonLines(tmp_path, shuffle_shards=True, seed=5, rank=rank,
                                   world_size=world_size, concurrency=3, even_ranks=False)
                source.set_epoch(epoch)
                with as_worker(worker, num_workers):
                    records = await collect(source)
                    orders.append(source.shards_for())
                seen.extend(r["id"] for r in records)
        assert sorted(seen) == list(range(7 * 30)), (epoch, world_size, num_workers)
        assert len(seen) == len(set(seen))


async def test_rank_from_environment(tmp_path: Path, anyio_backend: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    write_jsonl(tmp_path, 6, 10)
    seen: list[int] = []
    monkeypatch.setenv("WORLD_SIZE", "3")
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        source = JsonLines(tmp_path)
        assert (source.rank, source.world_size) == (rank, 3)
        seen.extend(r["id"] for r in await collect(source))
    assert sorted(seen) == list(range(60))
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK"):
        JsonLines(tmp_path)


async def test_shard_order_epochs(tmp_path: Path, anyio_backend: str) -> None:
    write_jsonl(tmp_path, 12, 3)

    def shard_sequence(records: list[Any]) -> list[int]:
        return [r["shard"] for r in records[::3]]

    source = JsonLines(tmp_path, shuffle_shards=True, seed=1)
    first = shard_sequence(await collect(source))
    second = shard_sequence(await collect(source))  # the epoch advanced by itself
    assert sorted(first) == sorted(second) == list(range(12))
    assert first != second
    again = JsonLines(tmp_path, shuffle_shards=True, seed=1)
    assert shard_sequence(await collect(again)) == first  # reproducible from the seed
    again.set_epoch(1)
    assert shard_sequence(await collect(again)) == second
    assert shard_sequence(await collect(again)) == second  # fixed epoch: same order
    plain = JsonLines(tmp_path)
    assert shard_sequence(await collect(plain)) == list(range(12))


# --------------------------------------------------------------------------- the loader


async def test_dataloader_batches(tmp_path: Path, anyio_backend: str) -> None:
    write_jsonl(tmp_path, 5, 101)
    source = JsonLines(tmp_path, shuffle_shards=True, seed=0).shuffle(64, seed=0)
    loader = DataLoader(source, batch_size=32)
    ids: list[int] = []
    sizes = []
    async for batch in loader:
        ids.extend(batch["id"].tolist())
        sizes.append(len(batch["id"]))
    assert sorted(ids) == list(range(505))
    assert sizes == [32] * 15 + [25]
    loader = DataLoader(source, batch_size=32, drop_last=True)
    assert sum([len(b["id"]) async for b in loader]) == 480


def test_sync_facade(tmp_path: Path) -> None:
    write_jsonl(tmp_path, 3, 40)
    loader = DataLoader(JsonLines(tmp_path).map(lambda r: r["id"]), batch_size=16)
    ids = [i for batch in loader for i in batch.tolist()]
    assert ids == list(range(120))


async def test_error_through_loader(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "e.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\nnope\n')
    loader = DataLoader(JsonLines(path), batch_size=1)
    got = []
    with pytest.raises(RecordError, match=r"e\.jsonl: line 3 \(byte offset 18\)"):
        async for batch in loader:
            got.append(int(batch["a"][0]))
    assert got == [1, 2]


async def test_pickle_round_trip(tmp_path: Path, anyio_backend: str) -> None:
    write_jsonl(tmp_path, 3, 20)
    source = JsonLines(tmp_path, shuffle_shards=True, seed=2).shuffle(16, seed=3).filter(bool)
    copy = pickle.loads(pickle.dumps(source))
    assert await collect(copy) == await collect(source)


def test_exports() -> None:
    for name in ("JsonLines", "TextLines", "BinaryRecords", "NpyRows", "Stream", "interleave",
                 "as_stream", "SourceError", "RecordError", "FetchError", "SourceStats"):
        assert name in aloader.__all__
    assert issubclass(aloader.SourceError, aloader.AloaderError)
    assert isinstance(JsonLines.__mro__, tuple) and issubclass(JsonLines, aloader.IterableDataset)


def test_expand_shards_sorted(tmp_path: Path) -> None:
    for name in ("b.txt", "a.txt", ".hidden", "c.txt"):
        (tmp_path / name).write_text("x\n")
    (tmp_path / "sub").mkdir()
    expected = [str(tmp_path / n) for n in ("a.txt", "b.txt", "c.txt")]
    assert expand_shards(tmp_path) == expected
    assert expand_shards(str(tmp_path / "*.txt")) == expected
    assert expand_shards(["http://h/x", tmp_path / "a.txt"]) == ["http://h/x", expected[0]]


# --------------------------------------------------------------------------- cleanup


async def test_files_closed_on_break(tmp_path: Path, anyio_backend: str) -> None:
    write_jsonl(tmp_path, 8, 2000)
    baseline = open_handles(tmp_path)
    source = JsonLines(tmp_path, concurrency=4, chunk_size=1024)
    async for _ in source:
        assert open_handles(tmp_path) > baseline  # shards are open while reading
        break
    assert await settle(lambda: open_handles(tmp_path) == baseline)

    iterator = source.__aiter__()
    await iterator.__anext__()
    await iterator.aclose()  # type: ignore[attr-defined]
    assert open_handles(tmp_path) == baseline  # aclose() returns once they are closed

    # The loader keeps a stopped epoch (and its source iterator) until its next epoch or
    # aclose(); the source's files close when the epoch lets go of it.
    loader = DataLoader(source, batch_size=10)
    async for _ in loader:
        break
    await loader.aclose()
    assert await settle(lambda: open_handles(tmp_path) == baseline)


async def test_files_closed_on_cancel(tmp_path: Path, anyio_backend: str) -> None:
    write_jsonl(tmp_path, 4, 5000)
    baseline = open_handles(tmp_path)
    source = JsonLines(tmp_path, concurrency=2, chunk_size=512)
    count = 0
    with anyio.CancelScope() as scope:
        async for _ in source:
            count += 1
            if count == 50:
                scope.cancel()  # cancelled mid-epoch, at the next checkpoint
            await anyio.sleep(0)
    assert count == 50
    assert await settle(lambda: open_handles(tmp_path) == baseline)


async def test_files_closed_after_error(tmp_path: Path, anyio_backend: str) -> None:
    write_jsonl(tmp_path, 4, 1000)
    (tmp_path / "part-002.jsonl").write_text('{"ok": 1}\nbroken\n')
    baseline = open_handles(tmp_path)
    with pytest.raises(RecordError):
        await collect(JsonLines(tmp_path, concurrency=3, chunk_size=256))
    assert open_handles(tmp_path) == baseline


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_real_worker_processes(tmp_path: Path) -> None:
    """With the loader's own worker processes (where this version has them), every record
    still arrives exactly once: the sources shard by get_worker_info(). Two ranks x 3 workers
    make 6 consumers for 5 shards."""
    write_jsonl(tmp_path, 5, 40)
    for epoch in range(2):
        ids: list[int] = []
        for rank in range(2):
            source = JsonLines(tmp_path, shuffle_shards=True, seed=3, rank=rank, world_size=2,
                               even_ranks=False)
            source.set_epoch(epoch)
            try:
                loader = DataLoader(source, batch_size=16, num_workers=3)
            except NotImplementedError:
                pytest.skip("this version of the loader has no worker processes")
            ids.extend(i for batch in loader for i in batch["id"].tolist())
        assert sorted(ids) == list(range(200))
