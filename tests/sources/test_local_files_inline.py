"""A sync ``for`` over local files runs the stream's chain on the consumer's thread, with no
event loop and no thread (``Stream._loopless``, ``aloader.streams._syncfor._LocalPairs``), and gives
exactly what the threaded path (the chain on a private loop in another thread) and ``async for``
give: the same items in the same order, stats and mid-epoch states, which resume exactly.
"""

from __future__ import annotations

import bz2
import gzip
import itertools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from sourcetools import as_worker, collect, open_handles, roundtrip

from aloader import JsonLines, RecordError, TextLines
from aloader.sources._formats import TextDecoder

CUTS = (0, 1, 6, 7, 31, 59, 60, 61, 119, 120)


def write_text(directory: Path, shards: int = 4, lines: int = 30) -> None:
    for shard in range(shards):
        (directory / f"part-{shard}.txt").write_text(
            "".join(f"s{shard}-line{i:03d}\n" for i in range(lines)))


def threaded(source: Any) -> Any:
    """``source`` with its sync ``for`` forced onto the private loop's thread."""
    source._loopless = lambda: False
    return source


def test_local_sync_for_runs_on_this_thread(tmp_path: Path) -> None:
    write_text(tmp_path)
    source = TextLines(tmp_path, chunk_size=64)
    assert source._loopless()
    # Threads compared as sets (an earlier test's loop may still be closing: not a count).
    before = set(threading.enumerate())
    iterator = iter(source)
    assert next(iterator) == "s0-line000"
    assert set(threading.enumerate()) - before == set()
    assert len(list(iterator)) == 4 * 30 - 1
    # The check sees the other path's thread.
    other = iter(threaded(TextLines(tmp_path, chunk_size=64)))
    next(other)
    started = set(threading.enumerate()) - before
    assert sum(t.name.startswith("aloader-loop") for t in started) == 1
    other.close()  # type: ignore[attr-defined]


def test_remote_shards_take_the_loop(tmp_path: Path) -> None:
    write_text(tmp_path, shards=1)
    assert not TextLines("http://127.0.0.1:9/a.txt")._loopless()
    assert not TextLines([str(tmp_path / "part-0.txt"), "https://127.0.0.1:9/b.txt"])._loopless()
    # A transform's epoch runs on the loop (its stages do not say they are loopless).
    assert not TextLines(tmp_path).map(str.upper)._loopless()


def _configs(directory: Path) -> dict[str, Callable[[], Any]]:
    write_text(directory)
    records = [{"shard": s, "i": i} for s in range(3) for i in range(25)]
    for s in range(3):
        body = "".join(json.dumps(r) + "\n" for r in records if r["shard"] == s).encode()
        (directory / f"j{s}.jsonl").write_bytes(body)
        (directory / f"z{s}.txt.gz").write_bytes(gzip.compress(body))
        (directory / f"b{s}.txt.bz2").write_bytes(bz2.compress(body))
    (directory / "bad.txt").write_bytes(b"".join(b"line%03d\n" % i for i in range(30))
                                        + b"bad \xff line\n" + b"after\n" * 40)
    text = sorted(str(p) for p in directory.glob("part-*.txt"))
    return {
        "text": lambda: TextLines(text, chunk_size=64),
        "jsonl": lambda: JsonLines(str(directory / "j*.jsonl"), chunk_size=100),
        "gzip": lambda: TextLines(str(directory / "z*.txt.gz"), chunk_size=50),
        "bz2": lambda: TextLines(str(directory / "b*.txt.bz2"), chunk_size=50),
        "shuffled": lambda: TextLines(text, chunk_size=64, shuffle_shards=True, seed=3),
        "rank": lambda: TextLines(text, chunk_size=64, rank=1, world_size=2),
        "quota": lambda: TextLines(text[:1], chunk_size=64, records_per_rank=70),
        "skip": lambda: TextLines(str(directory / "bad.txt"), chunk_size=64, skip_errors=True),
        "big chunks": lambda: TextLines(text, chunk_size=1 << 20, concurrency=1),
    }


@pytest.mark.parametrize("name", ["text", "jsonl", "gzip", "bz2", "shuffled", "rank", "quota",
                                  "skip", "big chunks"])
def test_same_items_stats_and_states_as_the_threaded_path(tmp_path: Path, name: str) -> None:
    make = _configs(tmp_path)[name]
    local, other = make(), threaded(make())
    assert local._loopless()
    full = list(local)
    assert full == list(other) == anyio.run(collect, make())
    assert full
    assert local.stats.counts() == other.stats.counts()
    assert local.stats.skipped == (1 if name == "skip" else 0)
    for k in CUTS:
        if k > len(full):
            continue
        states = []
        for source in (make(), threaded(make())):
            iterator = iter(source)
            assert list(itertools.islice(iterator, k)) == full[:k]
            states.append(roundtrip(source.state_dict()))
            iterator.close()  # type: ignore[attr-defined]
        assert states[0] == states[1], (name, k)
        fresh = make()
        fresh.load_state_dict(states[0])
        assert list(fresh) == full[k:], (name, k)


def test_second_epoch_and_a_worker_slot(tmp_path: Path) -> None:
    write_text(tmp_path, shards=6)

    def make() -> TextLines:
        return TextLines(tmp_path, chunk_size=64, shuffle_shards=True, seed=1)

    local, other = make(), threaded(make())
    assert list(local) == list(other)
    assert list(local) == list(other)  # epoch 1: another shard order
    with as_worker(1, 2, seed=0):
        source = make()
        mine = list(source)
        assert mine == list(threaded(make()))
        assert sorted({line.split("-")[0] for line in mine}) == sorted(
            {f"s{name[-5]}" for name in source.shards_for(0, 1, 2)})


def test_an_interrupt_in_a_read_leaves_the_epoch_going_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No wait to land in: a KeyboardInterrupt lands in the decoding of a block on this thread.
    # The chain unwinds (its files closed); the next step reopens it after the block the
    # consumer is on, so the epoch goes on at the same position.
    write_text(tmp_path)
    full = list(TextLines(tmp_path, chunk_size=64))
    real = TextDecoder.feed
    calls = itertools.count()

    def feed(self: Any, data: bytes) -> Any:
        if next(calls) == 9:
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(TextDecoder, "feed", feed)
    source = TextLines(tmp_path, chunk_size=64)
    iterator = iter(source)
    got: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        for line in iterator:
            got.append(line)
    k = len(got)
    assert 0 < k < len(full)
    assert open_handles(tmp_path) == 0
    state = roundtrip(source.state_dict())
    got += list(iterator)
    assert got == full
    fresh = TextLines(tmp_path, chunk_size=64)
    fresh.load_state_dict(state)
    assert list(fresh) == full[k:]


def test_break_closes_the_files_at_once(tmp_path: Path) -> None:
    write_text(tmp_path)
    source = TextLines(tmp_path, chunk_size=64)
    for _ in source:
        assert open_handles(tmp_path) == 1
        break
    assert open_handles(tmp_path) == 0  # no collection needed: the iterator was dropped
    iterator = iter(source)
    next(iterator)
    iterator.close()  # type: ignore[attr-defined]
    assert open_handles(tmp_path) == 0
    assert source.state_dict()["position"] is None


def test_an_error_ends_the_epoch_after_the_items_before_it(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"".join(b"line%03d\n" % i for i in range(30))
                                     + b"bad \xff line\n" + b"after\n")
    source = TextLines(tmp_path, chunk_size=64)
    iterator = iter(source)
    got: list[str] = []
    with pytest.raises(RecordError, match=r"line 31 \(byte offset 240\)"):
        for line in iterator:
            got.append(line)
    assert got == [f"line{i:03d}" for i in range(30)]
    assert list(iterator) == []
    assert open_handles(tmp_path) == 0


def test_a_missing_file_raises_in_its_turn(tmp_path: Path) -> None:
    write_text(tmp_path, shards=2)
    source = TextLines(tmp_path, chunk_size=64)
    (tmp_path / "part-1.txt").unlink()
    got: list[str] = []
    with pytest.raises(FileNotFoundError):
        for line in source:
            got.append(line)
    assert got == [f"s0-line{i:03d}" for i in range(30)]


def test_resumed_at_the_end_gives_nothing(tmp_path: Path) -> None:
    write_text(tmp_path, shards=1)
    source = TextLines(tmp_path, chunk_size=64)
    iterator = iter(source)
    assert len(list(iterator)) == 30
    fresh = TextLines(tmp_path, chunk_size=64)
    fresh.load_state_dict({**source.state_dict(), "epoch": 0,
                           "position": {"stage": "end", "skip": 0}, "next_epoch": 1})
    assert list(fresh) == []


async def test_a_sync_for_in_a_running_loop_is_refused(tmp_path: Path,
                                                       anyio_backend: str) -> None:
    write_text(tmp_path, shards=1)
    with pytest.raises(RuntimeError):
        iter(TextLines(tmp_path))


# --------------------------------------------------------------------------- async for inline


@pytest.mark.parametrize("name", ["text", "jsonl", "gzip", "rank", "quota", "skip"])
async def test_async_for_inline_same_items_and_states(tmp_path: Path, name: str,
                                                      anyio_backend: str) -> None:
    # A loopless stream's async for pulls its chain in the consumer's task (no driver): the
    # same items, stats and states as the driver's path.
    make = _configs(tmp_path)[name]
    local, other = make(), threaded(make())
    full = await collect(local)
    assert full == await collect(other)
    assert local.stats.counts() == other.stats.counts()
    for k in (0, 1, 7, 60, 61):
        if k > len(full):
            continue
        states = []
        for source in (make(), threaded(make())):
            iterator = source._open()
            head = [await iterator.__anext__() for _ in range(k)]
            assert head == full[:k]
            assert k == 0 or (iterator._driver is None) == source._loopless()
            states.append(roundtrip(source.state_dict()))
            await iterator.aclose()
        assert states[0] == states[1], (name, k)
        fresh = make()
        fresh.load_state_dict(states[0])
        assert await collect(fresh) == full[k:], (name, k)


async def test_async_for_inline_reads_in_a_thread_what_the_cache_lacks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: str) -> None:
    write_text(tmp_path)
    full = await collect(TextLines(tmp_path, chunk_size=64))
    monkeypatch.setattr("aloader.io._files._read_cached", lambda fd, size, position: None)
    assert await collect(TextLines(tmp_path, chunk_size=64)) == full


async def test_async_for_inline_cancelled_closes_files(tmp_path: Path,
                                                       anyio_backend: str) -> None:
    write_text(tmp_path)
    source = TextLines(tmp_path, chunk_size=64)
    got: list[str] = []
    with anyio.CancelScope() as scope:
        async for line in source:
            got.append(line)
            if len(got) == 10:
                scope.cancel()
                await anyio.sleep(0)  # cancelled here, between two items
    assert len(got) == 10
    for _ in range(100):
        if open_handles(tmp_path) == 0:
            break
        await anyio.sleep(0.01)
    assert open_handles(tmp_path) == 0


async def test_an_inline_epoch_gives_the_loop_turns(tmp_path: Path, anyio_backend: str) -> None:
    # Pulled in the consumer's task, a loopless chain still lets the loop's other tasks run
    # while a consumer that never awaits reads through it (a turn per 512 KiB read).
    (tmp_path / "big.txt").write_bytes((b"x" * 99 + b"\n") * 60_000)  # 6 MB
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0)

    seen = []
    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        await anyio.sleep(0)
        n = 0
        async for _ in TextLines(tmp_path):
            if n % 20_000 == 0:  # 2 MB: about 4 turns
                seen.append(ticks)
            n += 1
        group.cancel_scope.cancel()
    assert n == 60_000
    assert seen[0] < seen[1] < seen[2], seen
