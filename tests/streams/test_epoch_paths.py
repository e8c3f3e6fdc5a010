"""The fast ways through a stream's epoch give what the general one gives.

``async for`` over a stream runs an async generator over each block's list iterator, a plain
``for`` gets whole blocks from the private loop's thread, and the loader slices batches off the
same iterator (``_take``): every way must deliver the same items, count the same stats and,
mid-epoch, save the same state, which resumes exactly (aloader.streams._runtime,
``_StreamIterator``).
"""

from __future__ import annotations

import gc
import itertools
from pathlib import Path
from typing import Any

import anyio
import pytest
from sourcetools import as_worker, collect, open_handles, read_as_consumers, roundtrip

from aloader import DataLoader, JsonLines, RecordError, TextLines, _facade

# 3 shards of 40 lines; chunks of 64 bytes hold about 6 lines, so blocks are short and the
# cuts below land on block boundaries, just before and just after them.
SHARDS = 3
LINES = 40
CUTS = (0, 1, 5, 6, 7, 13, 39, 40, 41, 64, 119, 120)


def write_shards(directory: Path) -> list[Path]:
    paths = []
    for shard in range(SHARDS):
        path = directory / f"part-{shard}.txt"
        path.write_text("".join(f"s{shard}-line{i:03d}\n" for i in range(LINES)))
        paths.append(path)
    return paths


def make(directory: Path, **options: Any) -> TextLines:
    return TextLines(directory, chunk_size=64, concurrency=2, **options)


async def general_path(source: TextLines, k: int) -> tuple[list[str], dict[str, Any]]:
    """The first ``k`` items and the state after them, through the iterator the loader uses,
    one ``__anext__`` at a time; the iterator is closed after."""
    iterator = source._open()
    head = [await iterator.__anext__() for _ in range(k)]
    state = source.state_dict()
    await iterator.aclose()
    return head, state


async def test_async_for_same_items_and_stats(tmp_path: Path, anyio_backend: str) -> None:
    write_shards(tmp_path)
    expected = [f"s{s}-line{i:03d}" for s in range(SHARDS) for i in range(LINES)]
    fast, general = make(tmp_path), make(tmp_path)
    assert await collect(fast) == expected
    iterator = general._open()
    assert [item async for item in iterator] == expected
    assert (fast.stats.records, fast.stats.bytes, fast.stats.shards) == (
        general.stats.records, general.stats.bytes, general.stats.shards)
    assert fast.stats.records == len(expected)


async def test_async_for_state_is_the_general_paths(tmp_path: Path,
                                                    anyio_backend: str) -> None:
    write_shards(tmp_path)
    full = await collect(make(tmp_path))
    for k in CUTS:
        source = make(tmp_path)
        iterator = aiter(source)
        head = [await anext(iterator) for _ in range(k)]
        state = roundtrip(source.state_dict())
        await iterator.aclose()  # type: ignore[attr-defined]
        assert head == full[:k]
        assert state == roundtrip((await general_path(make(tmp_path), k))[1]), k
        fresh = make(tmp_path)
        fresh.load_state_dict(state)
        assert await collect(fresh) == full[k:], k


async def test_async_for_state_inside_the_loop_body(tmp_path: Path,
                                                    anyio_backend: str) -> None:
    # A state taken in the body of the async for names the item just received as delivered.
    write_shards(tmp_path)
    full = await collect(make(tmp_path))
    source = make(tmp_path)
    states = []
    async for _ in source:
        states.append(roundtrip(source.state_dict()))
    assert len(states) == len(full)
    for k in (1, 6, 7, 50, len(full) - 1):
        fresh = make(tmp_path)
        fresh.load_state_dict(states[k - 1])
        assert await collect(fresh) == full[k:], k


async def test_sharded_consumers_fast_and_general(tmp_path: Path, anyio_backend: str) -> None:
    # 6 shards over 2 ranks x 2 workers: the fast path reads each consumer's share, every
    # line once, and a consumer's mid-epoch state is the general path's, resuming exactly.
    for shard in range(6):
        (tmp_path / f"p{shard}.txt").write_text("".join(f"{shard}-{i}\n" for i in range(30)))

    def shard_source(rank: int) -> TextLines:
        return TextLines(tmp_path, chunk_size=64, rank=rank, world_size=2, even_ranks=False)

    seen = await read_as_consumers(shard_source, 2, 2)
    assert sorted(seen) == sorted(f"{s}-{i}" for s in range(6) for i in range(30))
    source = shard_source(1)
    with as_worker(1, 2, dataset=source, seed=0):
        full = await collect(shard_source(1))
        iterator = aiter(source)
        head = [await anext(iterator) for _ in range(17)]
        state = roundtrip(source.state_dict())
        await iterator.aclose()  # type: ignore[attr-defined]
        assert state == roundtrip((await general_path(shard_source(1), 17))[1])
        fresh = shard_source(1)
        fresh.load_state_dict(state)
        assert head + await collect(fresh) == full
    assert state["worker"] == [1, 2]


async def test_take_state_is_the_general_paths(tmp_path: Path, anyio_backend: str) -> None:
    write_shards(tmp_path)
    full = await collect(make(tmp_path))
    for size in (1, 4, 6, 7, 50):
        source = make(tmp_path)
        iterator = source._open()
        taken: list[str] = []
        for batch in itertools.count():
            got = await iterator._take(size)
            taken += got
            k = len(taken)
            assert got == full[k - len(got) : k]
            state = roundtrip(source.state_dict())
            if len(got) < size:  # the end seen: no epoch is under way any more
                assert state["position"] is None
                break
            if batch % 3 == 0:
                assert state == roundtrip((await general_path(make(tmp_path), k))[1])
        await iterator.aclose()
        assert taken == full


def test_sync_for_same_items_and_state(tmp_path: Path) -> None:
    write_shards(tmp_path)
    full = anyio.run(collect, make(tmp_path))
    assert list(make(tmp_path)) == full
    for k in CUTS:
        source = make(tmp_path)
        iterator = iter(source)
        head = list(itertools.islice(iterator, k))
        # The private loop reads blocks ahead: the state is what this thread received.
        state = roundtrip(source.state_dict())
        iterator.close()  # type: ignore[attr-defined]
        assert head == full[:k]
        assert state == roundtrip(anyio.run(general_path, make(tmp_path), k)[1]), k
        fresh = make(tmp_path)
        fresh.load_state_dict(state)
        assert list(fresh) == full[k:], k


def test_sync_for_stats_and_end(tmp_path: Path) -> None:
    write_shards(tmp_path)
    source = make(tmp_path)
    items = list(source)
    assert len(items) == source.stats.records == SHARDS * LINES
    assert source.stats.shards == SHARDS
    # The epoch ended: no epoch is under way any more.
    assert source.state_dict()["position"] is None


def test_sync_for_goes_on_after_an_interrupt_in_its_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A KeyboardInterrupt that lands while the consumer waits for a block leaves the epoch
    # going on (as a SyncIterator does), at the same position.
    write_shards(tmp_path)
    full = list(make(tmp_path))
    real = _facade._Pump.take
    calls = itertools.count()

    def take(self: Any) -> Any:
        if next(calls) == 4:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(_facade._Pump, "take", take)
    # The threaded path's wait (a loopless one has none: tests/sources/test_local_files_inline.py).
    monkeypatch.setattr(TextLines, "_loopless", lambda self: False)
    source = make(tmp_path)
    iterator = iter(source)
    got: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        for line in iterator:
            got.append(line)
    k = len(got)
    assert 0 < k < len(full)
    state = roundtrip(source.state_dict())
    got += list(iterator)
    assert got == full
    fresh = make(tmp_path)
    fresh.load_state_dict(state)
    assert list(fresh) == full[k:]


def test_sync_for_close_ends_it(tmp_path: Path) -> None:
    write_shards(tmp_path)
    iterator = iter(make(tmp_path))
    assert next(iterator) == "s0-line000"
    iterator.close()  # type: ignore[attr-defined]
    assert open_handles(tmp_path) == 0
    with pytest.raises(StopIteration):
        next(iterator)


def test_sync_for_break_closes_files(tmp_path: Path) -> None:
    write_shards(tmp_path)
    source = make(tmp_path)
    for _ in source:
        break
    gc.collect()
    assert open_handles(tmp_path) == 0


async def test_async_for_break_closes_files(tmp_path: Path, anyio_backend: str) -> None:
    write_shards(tmp_path)
    source = make(tmp_path)
    async for _ in source:
        assert open_handles(tmp_path) > 0
        break
    # Collected, the generator is closed by the event loop (its async generator hooks).
    for _ in range(100):
        gc.collect()
        if open_handles(tmp_path) == 0:
            break
        await anyio.sleep(0.01)
    assert open_handles(tmp_path) == 0


async def test_aclose_closes_files_at_once(tmp_path: Path, anyio_backend: str) -> None:
    write_shards(tmp_path)
    source = make(tmp_path)
    iterator = aiter(source)
    await anext(iterator)
    await iterator.aclose()  # type: ignore[attr-defined]
    assert open_handles(tmp_path) == 0
    assert source.state_dict()["position"] is None


def write_bad(directory: Path) -> None:
    (directory / "a.txt").write_bytes(b"".join(b"line%03d\n" % i for i in range(30))
                                      + b"bad \xff line\n" + b"after\n")


async def test_decoding_error_after_the_items_before_it(tmp_path: Path,
                                                        anyio_backend: str) -> None:
    write_bad(tmp_path)
    got: list[str] = []
    with pytest.raises(RecordError, match=r"line 31 \(byte offset 240\)"):
        async for line in TextLines(tmp_path, chunk_size=64):
            got.append(line)
    assert got == [f"line{i:03d}" for i in range(30)]
    skipping = TextLines(tmp_path, chunk_size=64, skip_errors=True)
    assert [line async for line in skipping][-1] == "after"
    assert skipping.stats.skipped == 1


def test_sync_for_decoding_error_after_the_items_before_it(tmp_path: Path) -> None:
    write_bad(tmp_path)
    got: list[str] = []
    with pytest.raises(RecordError, match=r"line 31 \(byte offset 240\)"):
        for line in TextLines(tmp_path, chunk_size=64):
            got.append(line)
    assert got == [f"line{i:03d}" for i in range(30)]


async def test_loader_batches_and_state(tmp_path: Path, anyio_backend: str) -> None:
    # The loader slices batches off the same iterator; its state resumes exactly.
    write_shards(tmp_path)
    full = await collect(make(tmp_path))
    loader = DataLoader(make(tmp_path), batch_size=7, collate_fn=list)
    batches = []
    state = None
    async for batch in loader:
        batches.append(batch)
        if len(batches) == 3:
            state = roundtrip(loader.state_dict())
    assert [x for b in batches for x in b] == full
    fresh = DataLoader(make(tmp_path), batch_size=7, collate_fn=list)
    fresh.load_state_dict(state)
    rest = [x async for b in fresh for x in b]
    assert rest == full[21:]


async def test_json_lines_fast_path_resumes(tmp_path: Path, anyio_backend: str) -> None:
    for shard in range(2):
        (tmp_path / f"p{shard}.jsonl").write_text(
            "".join(f'{{"id": {shard * 100 + i}}}\n' for i in range(25)))
    full = await collect(JsonLines(tmp_path, chunk_size=64))
    for k in (3, 25, 31):
        source = JsonLines(tmp_path, chunk_size=64)
        iterator = aiter(source)
        head = [await anext(iterator) for _ in range(k)]
        state = roundtrip(source.state_dict())
        await iterator.aclose()  # type: ignore[attr-defined]
        fresh = JsonLines(tmp_path, chunk_size=64)
        fresh.load_state_dict(state)
        assert head + await collect(fresh) == full, k
