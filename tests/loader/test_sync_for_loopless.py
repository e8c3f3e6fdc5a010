"""The DataLoader's sync ``for`` over a loopless stream (local files, ``num_workers=0``, no
async transforms, no ``timeout``) runs its epoch on the consumer's thread with no event loop
and no thread: batching and collate inline, as the map-style in-memory epoch does. It gives
exactly what ``async for`` (the epoch's background task on a loop) gives: the same batches,
stats and mid-epoch states; ``break`` closes the files, an interrupt loses nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from sourcetools import open_handles, roundtrip

from aloader import DataLoader, JsonLines, RecordError, TextLines
from aloader.sources._formats import TextDecoder


def write_text(directory: Path, shards: int = 4, lines: int = 30) -> None:
    for shard in range(shards):
        (directory / f"part-{shard}.txt").write_text(
            "".join(f"s{shard}-line{i:03d}\n" for i in range(lines)))


def loop_threads() -> set[threading.Thread]:
    """The live loop threads, as a set: a check is that none was added (an earlier test's
    loop thread may end meanwhile, so a count is no measure)."""
    return {t for t in threading.enumerate() if t.name.startswith("aloader-loop")}


def as_list(samples: list[Any]) -> list[Any]:
    return list(samples)


def make(directory: Path, *, threaded: bool = False, **kwargs: Any) -> DataLoader[Any]:
    kwargs.setdefault("collate_fn", as_list)
    source = TextLines(directory, chunk_size=64)
    if threaded:  # the sync for on the loader's private loop, as before the inline epoch
        source._loopless = lambda: False  # type: ignore[method-assign]
    return DataLoader(source, batch_size=7, generator=3, **kwargs)


def async_batches(loader: DataLoader[Any]) -> list[Any]:
    async def run() -> list[Any]:
        return [batch async for batch in loader]

    return anyio.run(run)


def test_the_sync_for_runs_on_this_thread_and_matches_async_for(tmp_path: Path) -> None:
    write_text(tmp_path)
    # No thread is started (an earlier test's thread may still be ending: not a count).
    before = set(threading.enumerate())
    loader = make(tmp_path)
    it = iter(loader)
    first = next(it)
    assert set(threading.enumerate()) - before == set()
    batches = [first, *it]
    assert set(threading.enumerate()) - before == set()
    assert batches == async_batches(make(tmp_path))
    assert [len(b) for b in batches] == [7] * 17 + [1]
    # A later epoch too, on the same loader (the stream's epoch counter advances as one).
    assert list(loader) == batches


def test_default_collate_and_drop_last(tmp_path: Path) -> None:
    (tmp_path / "n.jsonl").write_text("".join(f'{{"x": {i}, "y": [{i}, {-i}]}}\n'
                                             for i in range(23)))

    def loader() -> DataLoader[Any]:
        return DataLoader(JsonLines(tmp_path, chunk_size=64), batch_size=5, drop_last=True)

    before = loop_threads()
    got = list(loader())
    assert loop_threads() <= before
    want = async_batches(loader())
    assert len(got) == len(want) == 4
    for mine, theirs in zip(got, want, strict=True):
        assert mine.keys() == theirs.keys()
        assert type(mine["x"]) is type(theirs["x"])
        assert np.asarray(mine["x"]).tolist() == np.asarray(theirs["x"]).tolist()
        assert [np.asarray(t).tolist() for t in mine["y"]] == [
            np.asarray(t).tolist() for t in theirs["y"]]


@pytest.mark.parametrize("k", [0, 1, 3, 17, 18])
def test_a_mid_epoch_state_equals_async_fors_and_resumes(tmp_path: Path, k: int) -> None:
    write_text(tmp_path)
    full = [x for b in list(make(tmp_path)) for x in b]
    loader = make(tmp_path)
    it = iter(loader)
    got = [next(it) for _ in range(k)]
    state = roundtrip(loader.state_dict())

    async def theirs() -> dict[str, Any]:
        other = make(tmp_path)
        n = 0
        async with contextlib.aclosing(other.__aiter__()) as batches:
            while n < k:
                await batches.__anext__()
                n += 1
            return roundtrip(other.state_dict())

    if k:  # before the first batch an async for has not started its epoch
        assert state == anyio.run(theirs)
    other = make(tmp_path, threaded=True)
    threaded = iter(other)
    assert [next(threaded) for _ in range(k)] == got
    if k:  # before it, whether the threaded epoch has started yet is a race
        assert state == roundtrip(other.state_dict())
    threaded.close()  # type: ignore[attr-defined]
    other.close()
    it.close()  # type: ignore[attr-defined]
    fresh = make(tmp_path)
    fresh.load_state_dict(state)
    assert [x for b in got for x in b] + [x for b in fresh for x in b] == full


def test_break_closes_the_files_and_the_state_resumes(tmp_path: Path) -> None:
    write_text(tmp_path)
    full = [x for b in make(tmp_path) for x in b]
    loader = make(tmp_path)
    got = []
    for batch in loader:
        got.append(batch)
        assert open_handles(tmp_path) == 1
        if len(got) == 5:
            break
    assert open_handles(tmp_path) == 0  # no collection needed
    state = roundtrip(loader.state_dict())
    fresh = make(tmp_path)
    fresh.load_state_dict(state)
    assert [x for b in got for x in b] + [x for b in fresh for x in b] == full
    it = iter(make(tmp_path))
    next(it)
    it.close()
    assert open_handles(tmp_path) == 0


def test_an_interrupt_in_a_read_loses_nothing(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # No wait to land in: a KeyboardInterrupt lands in the decoding of a block on this thread.
    # The chain unwinds (its files closed); the epoch goes on after the last batch received.
    write_text(tmp_path)
    full = [x for b in make(tmp_path) for x in b]
    real = TextDecoder.feed
    calls = itertools.count()

    def feed(self: Any, data: bytes) -> Any:
        if next(calls) in (9, 10, 20):  # twice in a row too
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(TextDecoder, "feed", feed)
    before = loop_threads()
    loader = make(tmp_path)
    it = iter(loader)
    got: list[Any] = []
    interrupts = 0
    states = []
    while True:
        try:
            got.append(next(it))
        except KeyboardInterrupt:
            interrupts += 1
            assert open_handles(tmp_path) == 0
            states.append((len(got), roundtrip(loader.state_dict())))
            continue
        except StopIteration:
            break
    assert interrupts == 3
    assert [x for b in got for x in b] == full
    assert loop_threads() <= before
    monkeypatch.setattr(TextDecoder, "feed", real)
    for n, state in states:
        assert state["yielded"] == n
        fresh = make(tmp_path)
        fresh.load_state_dict(state)
        assert [x for b in got[:n] for x in b] + [x for b in fresh for x in b] == full


def test_an_error_ends_the_epoch_with_a_note(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"".join(b"line%03d\n" % i for i in range(30))
                                     + b"bad \xff line\n" + b"after\n")
    before = loop_threads()
    loader = DataLoader(TextLines(tmp_path, chunk_size=64), batch_size=4, collate_fn=as_list)
    it = iter(loader)
    got: list[Any] = []
    with pytest.raises(RecordError, match=r"line 31 \(byte offset 240\)") as info:
        for batch in it:
            got.append(batch)
    assert any("of the iterable dataset" in note for note in info.value.__notes__)
    assert [x for b in got for x in b] == [f"line{i:03d}" for i in range(28)]
    assert list(it) == []
    assert open_handles(tmp_path) == 0
    assert loop_threads() <= before


def test_stats_count_the_epoch(tmp_path: Path) -> None:
    write_text(tmp_path)
    loader = make(tmp_path)
    n = sum(1 for _ in loader)
    stats = loader.stats()
    assert (stats.batches, stats.items, stats.kind, stats.running) == (n, 120, "iterable", False)
    assert n == 18 and stats.stages["fetch"].count > 0


def test_a_timeout_or_a_transform_still_runs_on_the_loop(tmp_path: Path) -> None:
    write_text(tmp_path)
    want = list(make(tmp_path))
    before = loop_threads()
    timed = make(tmp_path, timeout=30)
    assert list(timed) == want
    assert len(loop_threads() - before) == 1
    timed.close()
    mapped = DataLoader(TextLines(tmp_path, chunk_size=64).map(str.upper), batch_size=7,
                        collate_fn=as_list)
    assert list(mapped) == [[x.upper() for x in b] for b in want]
    assert len(loop_threads() - before) == 1
    mapped.close()
    assert loop_threads() <= before
