"""Attacks on the loopless local-file streams (``Stream._loopless``, ``_LocalPairs``, the
inline ``_StreamIterator._receive``, ``file_chunks(blocking=True)``): odd files and
compressions through every path (sync ``for``, ``async for`` on asyncio and trio, the threaded
path), a line longer than a loop turn's 512 KiB, files changed between epochs, shard orders
per seed and epoch, ranks x workers exactly once, a state resumed in a new process,
KeyboardInterrupts at several points, ``break`` then a new epoch, two iterators at once.
"""

from __future__ import annotations

import bz2
import gzip
import importlib.util
import itertools
import json
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from sourcetools import as_worker, collect, open_handles, roundtrip, through_interrupts

from aloader import BinaryRecords, JsonLines, NpyRows, TextLines

pytestmark = pytest.mark.hostile

HAS_ZSTD = importlib.util.find_spec("zstandard") is not None


def threaded(source: Any) -> Any:
    """``source`` with its epochs forced onto the driver (a private loop for a sync for)."""
    source._loopless = lambda: False
    return source


def every_path(make: Callable[[], Any]) -> list[list[Any]]:
    """One epoch of a fresh ``make()`` by each way of iterating it."""
    return [list(make()), anyio.run(collect, make()),
            anyio.run(collect, make(), backend="trio"), list(threaded(make())),
            anyio.run(collect, threaded(make()))]


def reference_lines(paths: list[Path]) -> list[str]:
    """What ``open(path, newline="")`` gives, line endings (``\\n``, ``\\r\\n``) removed."""
    out = []
    for path in paths:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
        elif path.suffix == ".bz2":
            data = bz2.decompress(data)
        elif path.suffix == ".zst":
            import zstandard

            data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
        for line in data.decode().splitlines(keepends=True):
            out.append(line.removesuffix("\n").removesuffix("\r"))
    return out


@pytest.fixture(scope="module")
def odd_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    directory = tmp_path_factory.mktemp("odd")
    files = {
        "a.txt": b"a1\r\na2\r\n\r\na3",  # CRLF, a blank line, no newline at the end
        "b.txt": b"",
        "c.txt": b"x" * (1 << 20) + b"\nshort\n" + b"y" * (600 << 10),  # > a 512 KiB turn
        "d.txt.gz": gzip.compress(b"g1\ng2\r\ng3"),
        "e.txt.bz2": bz2.compress(b""),
        "f.txt.gz": gzip.compress(b""),
        "g.txt.gz": gzip.compress(b"one\n") + gzip.compress(b"two\n"),  # two gzip members
        "h.txt": b"\n\n\n",
    }
    if HAS_ZSTD:
        import zstandard

        files["i.txt.zst"] = zstandard.ZstdCompressor().compress(b"z1\nz2\n")
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return sorted(directory.iterdir())


@pytest.mark.parametrize("chunk_size", [1, 7, 4096, 1 << 16, 1 << 20])
def test_odd_text_files_on_every_path(odd_files: list[Path], chunk_size: int) -> None:
    # The long lines only in chunks of 4 KiB and more (a byte at a time is 2.6 M chunks).
    paths = [p for p in odd_files if chunk_size >= 4096 or p.name != "c.txt"]
    expected = reference_lines(paths)

    def make() -> TextLines:
        return TextLines([str(p) for p in paths], chunk_size=chunk_size,
                         max_record_bytes=1 << 21)

    for got in every_path(make):
        assert got == expected


def test_a_line_over_max_record_bytes_is_an_error_on_every_path(odd_files: list[Path]) -> None:
    from aloader import RecordError

    big = [str(p) for p in odd_files if p.name == "c.txt"]
    for make_iter in (lambda: iter(TextLines(big, max_record_bytes=1 << 19)),
                      lambda: iter(threaded(TextLines(big, max_record_bytes=1 << 19)))):
        with pytest.raises(RecordError):
            list(make_iter())
    assert list(TextLines(big, max_record_bytes=1 << 19, skip_errors=True)) == ["short"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("shards")
    for s in range(5):
        lines = "".join(f"s{s}-{i}\n" for i in range(7 + 3 * s)).encode()
        (directory / f"t{s}.txt").write_bytes(lines)
        (directory / f"g{s}.txt.gz").write_bytes(gzip.compress(lines))
        (directory / f"j{s}.jsonl").write_bytes(b"".join(
            json.dumps({"s": s, "i": i}).encode() + b"\n" for i in range(7 + 3 * s)))
        (directory / f"b{s}.bin").write_bytes(b"".join(
            struct.pack("<I", len(x)) + x for x in lines.split(b"\n") if x))
        np.save(directory / f"n{s}.npy", np.arange((7 + 3 * s) * 2).reshape(-1, 2) + 100 * s)
    return directory


# Each config as the text a child process evaluates (D: the shards' directory).
CONFIGS = {
    "text": "TextLines(sorted(map(str, D.glob('t*.txt'))), chunk_size=16, shuffle_shards=True,"
            " seed=3)",
    "gzip": "TextLines(sorted(map(str, D.glob('g*.gz'))), chunk_size=16, shuffle_shards=True,"
            " seed=3)",
    "jsonl": "JsonLines(sorted(map(str, D.glob('j*.jsonl'))), chunk_size=40,"
             " shuffle_shards=True, seed=8)",
    "binary": "BinaryRecords(sorted(map(str, D.glob('b*.bin'))), chunk_size=16,"
              " shuffle_shards=True, seed=4)",
    "npy": "NpyRows(sorted(map(str, D.glob('n*.npy'))), chunk_size=16, shuffle_shards=True,"
           " seed=5)",
    "quota": "TextLines(sorted(map(str, D.glob('t*.txt'))), chunk_size=16, shuffle_shards=True,"
             " seed=3, records_per_rank=50, rank=1, world_size=2)",
}


def plain(item: Any) -> Any:
    if isinstance(item, np.ndarray):
        return item.tolist()
    return item.decode() if isinstance(item, bytes) else item


def make_config(name: str, directory: Path) -> Any:
    namespace = {"D": directory, "TextLines": TextLines, "JsonLines": JsonLines,
                 "BinaryRecords": BinaryRecords, "NpyRows": NpyRows}
    return eval(CONFIGS[name], namespace)  # the test's own expressions


CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np
from aloader import BinaryRecords, JsonLines, NpyRows, TextLines
def plain(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    return x.decode() if isinstance(x, bytes) else x
D = Path(sys.argv[1])
out = []
for expr, state in json.loads(sys.stdin.read()):
    source = eval(expr)
    source.load_state_dict(state)
    out.append([[plain(x) for x in source], [plain(x) for x in source]])
print(json.dumps(out))
"""


def test_shard_order_per_seed_and_epoch(shards: Path) -> None:
    for name in CONFIGS:
        source = make_config(name, shards)
        epochs = [[plain(x) for x in source] for _ in range(3)]
        assert epochs[0] != epochs[1] and epochs[1] != epochs[2], name
        again = make_config(name, shards)
        assert [[plain(x) for x in again] for _ in range(3)] == epochs, name
        fixed = make_config(name, shards)
        fixed.set_epoch(2)  # torch's set_epoch: that epoch's order, every time
        assert [plain(x) for x in fixed] == [plain(x) for x in fixed] == epochs[2], name
        if name != "quota":
            assert sorted(map(json.dumps, epochs[0])) == sorted(map(json.dumps, epochs[1]))


def test_resume_in_a_new_process_equals_the_uninterrupted_run(shards: Path) -> None:
    # A state taken mid-epoch 1 (a sync for), resumed by another process: the rest of epoch 1
    # then epoch 2 are exactly the uninterrupted run's.
    jobs, expected = [], []
    for name, expr in CONFIGS.items():
        reference = make_config(name, shards)
        epochs = [[plain(x) for x in reference] for _ in range(3)]
        n = len(epochs[1])
        for k in (0, 1, 5, n // 2, n - 1, n):
            source = make_config(name, shards)
            list(source)
            iterator = iter(source)
            head = [plain(x) for x in itertools.islice(iterator, k)]
            jobs.append((expr, roundtrip(source.state_dict())))
            expected.append((head, epochs[1], epochs[2]))
    done = subprocess.run([sys.executable, "-c", CHILD, str(shards)], input=json.dumps(jobs),
                          capture_output=True, text=True, timeout=120, check=True)
    for (head, epoch1, epoch2), (rest, after) in zip(expected, json.loads(done.stdout),
                                                     strict=True):
        assert head + rest == epoch1
        assert after == epoch2


@pytest.mark.parametrize(("world_size", "num_workers"), [(1, 3), (2, 2), (3, 2)])
def test_ranks_x_workers_exactly_once_in_a_sync_for(shards: Path, world_size: int,
                                                    num_workers: int) -> None:
    paths = sorted(map(str, shards.glob("g*.gz")))
    everything = sorted(TextLines(paths))
    for epoch in (0, 1):
        seen: list[str] = []
        for rank in range(world_size):
            for worker in range(num_workers):
                source = TextLines(paths, chunk_size=16, shuffle_shards=True, seed=9, rank=rank,
                                   world_size=world_size, even_ranks=False)
                source.set_epoch(epoch)
                with as_worker(worker, num_workers, dataset=source, seed=0):
                    mine = list(source)
                    assert mine == anyio.run(collect, source)
                seen += mine
        assert sorted(seen) == everything


def test_files_changed_between_epochs(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("a0\na1\n")
    b.write_text("b0\n")
    source = TextLines([str(a), str(b)], chunk_size=4)
    assert list(source) == ["a0", "a1", "b0"]
    with a.open("a") as f:
        f.write("a2\na3")  # grown, no newline at the end
    assert list(source) == ["a0", "a1", "a2", "a3", "b0"]
    a.write_text("a0\n")  # truncated
    assert anyio.run(collect, source) == ["a0", "b0"]
    b.unlink()
    got: list[str] = []
    with pytest.raises(FileNotFoundError):
        for line in source:
            got.append(line)
    assert got == ["a0"]
    assert open_handles(tmp_path) == 0


def test_break_then_a_new_epoch(shards: Path) -> None:
    source = make_config("text", shards)
    reference = make_config("text", shards)
    epochs = [list(reference) for _ in range(3)]
    for line in source:
        assert line == epochs[0][0]
        break
    assert source.state_dict()["position"] is None
    assert list(source) == epochs[1]  # the next epoch, whole
    assert open_handles(shards) == 0
    it = iter(source)
    assert next(it) == epochs[2][0]
    del it
    assert open_handles(shards) == 0


def test_two_iterators_of_one_stream_at_once(shards: Path) -> None:
    reference = make_config("jsonl", shards)
    epochs = [list(reference) for _ in range(2)]
    source = make_config("jsonl", shards)
    first, second = iter(source), iter(source)
    got: tuple[list[Any], list[Any]] = ([], [])
    for a, b in itertools.zip_longest(first, second):
        if a is not None:
            got[0].append(a)
        if b is not None:
            got[1].append(b)
    assert got == (epochs[0], epochs[1])


async def test_two_inline_iterators_at_once(shards: Path, anyio_backend: str) -> None:
    reference = make_config("gzip", shards)
    epochs = [await collect(reference) for _ in range(2)]
    source = make_config("gzip", shards)
    got: list[list[str]] = [[], []]

    async def read(index: int, iterator: Any) -> None:
        async for line in iterator:
            got[index].append(line)
            await anyio.sleep(0)

    async with anyio.create_task_group() as group:
        group.start_soon(read, 0, source.__aiter__())
        group.start_soon(read, 1, source.__aiter__())
    assert got == epochs


# --------------------------------------------------------------------------- interrupts


def interrupted_run(make: Callable[[Any], Any], at: set[int]) -> tuple[list[Any], Any, int]:
    """A sync for over ``make(loads)`` whose ``loads`` raises KeyboardInterrupt at the calls
    numbered in ``at``; the consumer catches each and goes on: (items, stats, interrupts)."""
    calls = itertools.count(1)

    def loads(text: str) -> Any:
        if next(calls) in at:
            raise KeyboardInterrupt
        return json.loads(text)

    source = make(loads)
    iterator = iter(source)
    out, interrupts = through_interrupts(iterator)
    return out, source.stats, interrupts


INTERRUPTED = {
    "jsonl": lambda loads, d: JsonLines(sorted(map(str, d.glob("j*.jsonl"))), loads=loads,
                                        chunk_size=40),
    "big chunks": lambda loads, d: JsonLines(sorted(map(str, d.glob("j*.jsonl"))),
                                             loads=loads),
    "quota": lambda loads, d: JsonLines(sorted(map(str, d.glob("j*.jsonl"))), loads=loads,
                                        chunk_size=40, records_per_rank=130),
}


@pytest.mark.parametrize("name", sorted(INTERRUPTED))
@pytest.mark.parametrize("at", [{1}, {7}, {8}, {30, 31, 60}])
def test_interrupts_in_a_decoder_lose_and_repeat_nothing(shards: Path, name: str,
                                                         at: set[int]) -> None:
    def make(loads: Any) -> Any:
        return INTERRUPTED[name](loads, shards)

    full, _, _ = interrupted_run(make, set())
    got, _, interrupts = interrupted_run(make, at)
    assert interrupts == len(at)
    assert got == full


def test_interrupts_in_a_decoder_keep_the_stats(shards: Path) -> None:
    def make(loads: Any) -> Any:
        return INTERRUPTED["jsonl"](loads, shards)

    _, full, _ = interrupted_run(make, set())
    _, stats, _ = interrupted_run(make, {8})  # the first record of the second shard
    assert stats.counts() == full.counts()


def test_an_interrupt_in_a_transform_of_a_sync_for(shards: Path) -> None:
    paths = sorted(map(str, shards.glob("t*.txt")))
    full = list(TextLines(paths, chunk_size=16))
    calls = itertools.count(1)

    def fn(line: str) -> str:
        if next(calls) == 20:
            raise KeyboardInterrupt
        return line

    iterator = iter(TextLines(paths, chunk_size=16).map(fn))
    got, interrupts = through_interrupts(iterator)
    assert interrupts == 1
    assert got == full  # or, if the epoch must end, not as if it had ended cleanly


@pytest.mark.parametrize("where", ["read", "inflate"])
@pytest.mark.parametrize("at", [1, 2, 5])
def test_interrupts_in_a_read_or_an_inflate_lose_and_repeat_nothing(
        shards: Path, monkeypatch: pytest.MonkeyPatch, where: str, at: int) -> None:
    # A KeyboardInterrupt in the blocking read of a sync for (file_chunks(blocking=True)), or
    # in the decompression of a gzip shard, on this thread.
    import os

    import aloader.io._compression as compression

    paths = sorted(map(str, shards.glob("g*.gz")))
    full = list(TextLines(paths, chunk_size=16, shuffle_shards=True, seed=3))
    calls = itertools.count(1)
    if where == "read":
        real_pread = os.pread

        def pread(fd: int, size: int, position: int) -> bytes:
            if next(calls) == at:
                raise KeyboardInterrupt
            return real_pread(fd, size, position)

        monkeypatch.setattr(os, "pread", pread)
    else:
        real_feed = compression.Decompressor.feed

        def feed(self: Any, data: bytes) -> Any:
            if next(calls) == at * 3:
                raise KeyboardInterrupt
            return real_feed(self, data)

        monkeypatch.setattr(compression.Decompressor, "feed", feed)
    iterator = iter(TextLines(paths, chunk_size=16, shuffle_shards=True, seed=3))
    got, interrupts = through_interrupts(iterator)
    assert interrupts == 1
    assert got == full
    assert open_handles(shards) == 0


def test_an_error_of_a_threaded_sync_for_leaves_no_loop_thread(odd_files: list[Path]) -> None:
    # The error raised in the consumer's thread holds its frames (the sync iterator's) in its
    # traceback: nothing on the loop may keep it, or the iterator and its loop live forever.
    import gc
    import threading
    import time

    from aloader import RecordError

    # Sets of threads, not counts: an earlier test's loop thread may end during this one.
    def loops() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("aloader-loop")}

    big = [str(p) for p in odd_files if p.name == "c.txt"]
    before = loops()
    with pytest.raises(RecordError):
        list(iter(threaded(TextLines(big, max_record_bytes=1 << 19))))
    gc.collect()
    for _ in range(200):  # the loop's thread ends a moment after it is closed
        if not loops() - before:
            break
        time.sleep(0.01)
    assert loops() - before == set()
