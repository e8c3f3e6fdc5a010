"""A cached epoch read inline, as local files are (so that a cached epoch reads at the local-file
rate): when every shard a consumer reads in an epoch is kept in the
cache at the version its source pinned, the chain runs in the consumer's task (``async for``,
the loader) or on its thread with no event loop (a sync ``for``), with the same items, stats
and states as the background path; a copy that goes missing after that look is still read
right, from the store."""

from __future__ import annotations

import gzip
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import as_worker, collect, ids, local_s3, object_gets, open_handles, roundtrip

from aloader import DataLoader, JsonLines, TextLines
from aloader.io import _cachedir
from aloader.io._cache import ShardCache
from aloader.sources._formats import JsonLinesDecoder
from aloader.streams import _runtime, _stream

SHARDS = make_jsonl_shards(3, 50)  # shard-0000i.jsonl, ids 0..149
ALL_IDS = list(range(150))
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}


def gets(server: FaultyServer) -> int:
    return len(server.requests)


def forbid_background(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the background path (a driver task, a loop in a thread) an error."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cached epoch should run inline")

    monkeypatch.setattr(_runtime._Driver, "start", refuse)
    monkeypatch.setattr(_stream, "PrivateLoop", refuse)


def stats_of(source: Any) -> tuple[int, ...]:
    s = source.stats
    return (s.records, s.bytes, s.shards, s.skipped, s.cache_hits, s.cache_misses,
            s.cache_bytes)


def cached_source(server: FaultyServer, cache: Path, **options: Any) -> JsonLines:
    """A source over ``server``'s shards whose first epoch (read here, by a sync ``for``)
    filled ``cache``."""
    source = JsonLines(server.urls, cache_dir=cache, **FAST, **options)
    for _ in source:  # the threaded path (not pinned yet): the store is asked for each shard
        pass
    assert source.stats.cache_hits + source.stats.cache_misses == len(server.urls)
    return source


async def filled(server: FaultyServer, cache: Path, **options: Any) -> JsonLines:
    """:func:`cached_source`, its first epoch read by ``async for``."""
    source = JsonLines(server.urls, cache_dir=cache, **FAST, **options)
    assert not source._loopless()
    await collect(source)
    assert source.stats.cache_hits + source.stats.cache_misses == len(server.urls)
    return source


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a worker thread: a sync ``for`` from an async test."""
    return await anyio.to_thread.run_sync(fn, *args)


def copy_of(source: Any, url: str) -> str:
    cache: ShardCache = source._shard_cache
    return cache.path(url, source._versions[url])


pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


@pytest.mark.anyio
async def test_a_cached_epoch_runs_in_the_consumers_task(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``async for`` and the loader: no background task, the same records and stats as the
    background path, no request."""
    server = serve(SHARDS)
    source = await filled(server, tmp_path)
    background = await filled(server, tmp_path)  # the same cache, pinned alike
    monkeypatch.setattr(background, "_loopless", lambda: False)
    requests = gets(server)
    before, expected_before = stats_of(source), stats_of(background)
    expected = ids(await collect(background))
    forbid_background(monkeypatch)
    assert source._loopless()
    assert ids(await collect(source)) == expected == ALL_IDS
    count = 0
    async for batch in DataLoader(source, batch_size=32):
        count += len(batch["id"])
    assert count == 150
    assert gets(server) == requests
    delta = [b - a for a, b in zip(before, stats_of(source), strict=True)]
    expected_delta = [b - a for a, b in zip(expected_before, stats_of(background),
                                             strict=True)]
    assert delta == [2 * d for d in expected_delta]
    assert source.stats.cache_hits == 6 and source.stats.cache_misses == 3
    assert source.stats.cache_bytes == 2 * sum(map(len, SHARDS.values()))


def test_a_cached_epochs_sync_for_runs_on_the_callers_thread(
        serve: Callable[..., FaultyServer], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    server = serve(SHARDS)
    source = cached_source(server, tmp_path)
    requests = gets(server)
    forbid_background(monkeypatch)
    # No thread is started: the set of live threads gains none (an earlier epoch's
    # thread may still be ending, so their count is no measure).
    threads = set(threading.enumerate())
    assert ids(list(source)) == ALL_IDS
    assert set(threading.enumerate()) - threads == set()
    assert gets(server) == requests
    assert source.stats.cache_hits == 3
    assert source.stats.cache_bytes == sum(map(len, SHARDS.values()))


@pytest.mark.anyio
async def test_a_partly_cached_epoch_reads_in_the_background(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    """A copy missing before the epoch starts: the epoch needs the store, so it gets the
    background path and its read-ahead (and the shard is kept again)."""
    server = serve(SHARDS)
    source = await filled(server, tmp_path)
    os.unlink(copy_of(source, server.urls[1]))
    assert not source._loopless()
    assert ids(await collect(source)) == ALL_IDS
    assert os.path.exists(copy_of(source, server.urls[1]))
    assert source._loopless()


def _evict(source: Any, url: str, when: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Delete ``url``'s copy after the epoch's look: ``"lookup"`` right after the look found
    it, ``"read"`` when the read opens it (it finds none)."""
    evicted: list[str] = []
    holds = ShardCache.holds
    open_stat = _cachedir.Directory.open_stat

    def evict(cache: ShardCache, version: Any) -> None:
        path = cache.path(url, version)
        if not evicted and os.path.exists(path):
            os.unlink(path)
            evicted.append(path)

    def looked(self: ShardCache, name: str, version: Any) -> bool:
        found = holds(self, name, version)
        if name == url and found:
            evict(self, version)
        return found

    def opening(self: Any, name: str, *args: Any) -> Any:
        if not evicted and os.path.basename(source._shard_cache.path(
                url, source._versions[url])) == name:
            evict(source._shard_cache, source._versions[url])
        return open_stat(self, name, *args)

    if when == "lookup":
        monkeypatch.setattr(ShardCache, "holds", looked)
    else:
        monkeypatch.setattr(_cachedir.Directory, "open_stat", opening)
    return evicted


@pytest.mark.anyio
@pytest.mark.parametrize("when", ["lookup", "read"])
async def test_a_copy_evicted_after_the_look_is_fetched_inline(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    server = serve(SHARDS)
    source = await filled(server, tmp_path)
    requests = gets(server)
    assert source._loopless()
    evicted = _evict(source, server.urls[1], when, monkeypatch)
    monkeypatch.setattr(_runtime._Driver, "start", None)  # inline, or a TypeError
    assert ids(await collect(source)) == ALL_IDS
    assert evicted and gets(server) == requests + 1
    assert os.path.exists(evicted[0])  # kept again
    assert source.stats.cache_hits == 2 and source.stats.cache_misses == 4
    sizes = [len(SHARDS[Path(url).name]) for url in server.urls]
    assert source.stats.cache_bytes == sizes[0] + sizes[2]
    assert source.stats.records == 300


@pytest.mark.parametrize("when", ["lookup", "read"])
def test_a_copy_evicted_after_a_sync_fors_look_is_fetched_on_a_loop_of_its_own(
        serve: Callable[..., FaultyServer], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """A sync ``for``'s chain runs with no event loop: the shard whose copy went missing is
    read from the store on a loop of its own, closed with it; every record once, in order."""
    server = serve(SHARDS)
    source = cached_source(server, tmp_path)
    requests = gets(server)
    evicted = _evict(source, server.urls[1], when, monkeypatch)
    threads = threading.active_count()
    got = []
    for record in source:
        got.append(record["id"])
    assert got == ALL_IDS
    assert evicted and gets(server) == requests + 1
    assert os.path.exists(evicted[0])
    assert source.stats.cache_hits == 2 and source.stats.cache_misses == 4
    assert source.stats.records == 300
    for _ in range(100):  # the shard's own loop thread ends as it closes
        if threading.active_count() <= threads:
            break
        threading.Event().wait(0.01)
    assert threading.active_count() <= threads
    assert open_handles(tmp_path) == 0


def test_an_error_of_a_missing_copys_store_keeps_its_type_on_a_sync_for(
        serve: Callable[..., FaultyServer], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from aloader import FetchError

    server = serve(SHARDS)
    source = cached_source(server, tmp_path)
    _evict(source, server.urls[1], "read", monkeypatch)
    server.fail(Path(server.urls[1]).name, 404)
    got = []
    with pytest.raises(FetchError) as info:
        for record in source:
            got.append(record["id"])
    assert got == ALL_IDS[:50]
    assert server.urls[1] in str(info.value)


@pytest.mark.anyio
@pytest.mark.parametrize("k", [1, 49, 50, 77, 149])
async def test_resume_from_an_inline_cached_epoch_is_the_background_paths(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str, k: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    server = serve(SHARDS)
    states = []
    for inline in (True, False):
        source = await filled(server, tmp_path)
        if not inline:
            monkeypatch.setattr(source, "_loopless", lambda: False)
        assert source._loopless() is inline
        iterator = source._open()
        for _ in range(k):
            await iterator.__anext__()
        assert (iterator._driver is None) is inline
        states.append(roundtrip(source.state_dict()))
        await iterator.aclose()
    assert states[0] == states[1]
    fresh = await filled(server, tmp_path)
    requests = gets(server)
    fresh.load_state_dict(states[0])
    assert fresh._loopless()
    assert ids(await collect(fresh)) == ALL_IDS[k:]
    assert gets(server) == requests


def test_a_sync_fors_state_on_a_cached_epoch_resumes_exactly(
        serve: Callable[..., FaultyServer], tmp_path: Path) -> None:
    server = serve(SHARDS)
    source = cached_source(server, tmp_path)
    items = iter(source)
    head = [next(items)["id"] for _ in range(60)]
    state = roundtrip(source.state_dict())
    items.close()  # type: ignore[attr-defined]
    fresh = cached_source(server, tmp_path)
    fresh.load_state_dict(state)
    assert head + ids(list(fresh)) == ALL_IDS


@pytest.mark.anyio
async def test_compressed_copies_are_read_inline(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    files = {f"{name}.gz": gzip.compress(body) for name, body in SHARDS.items()}
    server = serve(files)
    source = JsonLines(server.urls, cache_dir=tmp_path / "cache", **FAST)
    assert ids(await collect(source)) == ALL_IDS
    requests = gets(server)
    forbid_background(monkeypatch)
    assert ids(await collect(source)) == ALL_IDS
    assert ids(await in_thread(list, source)) == ALL_IDS
    assert gets(server) == requests
    assert source.stats.cache_bytes == 2 * sum(map(len, files.values()))


@pytest.mark.anyio
async def test_skipped_records_of_a_cached_epoch_are_counted_alike(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    files = dict(SHARDS)
    files["shard-00001.jsonl"] = files["shard-00001.jsonl"].replace(b'{"id": 60', b'{"id: 60')
    server = serve(files)
    source = JsonLines(server.urls, cache_dir=tmp_path, skip_errors=True, **FAST)
    first = ids(await collect(source))
    assert 60 not in first and len(first) == 149
    forbid_background(monkeypatch)
    assert ids(await collect(source)) == first
    assert ids(await in_thread(list, source)) == first
    assert source.stats.skipped == 3


@pytest.mark.anyio
async def test_a_consumer_needs_only_its_own_shards_kept(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    """Ranks x workers: a consumer whose shards are cached reads inline though the other
    consumers' are not (another machine's ranks, say)."""
    files = make_jsonl_shards(8, 10)
    server = serve(files)
    sources = {}
    for rank in range(2):
        for worker in range(2):
            source = JsonLines(server.urls, cache_dir=tmp_path / f"cache-{rank}", rank=rank,
                               world_size=2, shuffle_shards=True, seed=3, **FAST)
            with as_worker(worker, 2, dataset=source, seed=0):
                await collect(source)  # epoch 0, this consumer's shards only
            sources[rank, worker] = source
    for (_rank, worker), source in sources.items():
        with as_worker(worker, 2, dataset=source, seed=0):
            # epoch 1 reads other shards (shuffled): not kept by this consumer yet
            assert not source._loopless()
            source.set_epoch(0)
            assert source._loopless()
            mine = source.shards_for(0)
            assert len(mine) == 2
            assert sorted(r["id"] // 10 for r in await collect(source)) == sorted(
                int(Path(url).stem.split("-")[1]) for url in mine for _ in range(10))


@pytest.mark.anyio
async def test_leaving_an_inline_cached_epoch_closes_its_files(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    server = serve(SHARDS)
    source = await filled(server, tmp_path)
    iterator: Any = source.__aiter__()
    await iterator.__anext__()
    assert open_handles(tmp_path) == 1
    await iterator.aclose()
    assert open_handles(tmp_path) == 0

    def leave_early() -> None:
        for _ in source:
            assert open_handles(tmp_path) == 1
            break
        assert open_handles(tmp_path) == 0

    await in_thread(leave_early)


def test_text_lines_and_local_shards_mixed_with_cached_ones(
        serve: Callable[..., FaultyServer], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "local.txt"
    local.write_text("a\nb\n")
    server = serve({"x.txt": b"c\nd\n"})
    source = TextLines([str(local), *server.urls], cache_dir=tmp_path / "cache", **FAST)
    assert list(source) == ["a", "b", "c", "d"]
    forbid_background(monkeypatch)
    assert list(source) == ["a", "b", "c", "d"]
    assert source.stats.cache_hits == 1


BUCKET = "cache-fast"


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    with local_s3(BUCKET, {f"data/{name}": body for name, body in SHARDS.items()}) as server:
        yield server


@pytest.mark.parametrize("when", ["lookup", "read"])
def test_s3_cached_epochs_run_inline_and_refetch_an_evicted_copy(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """Listed objects are pinned by their listing: a new source over a warm cache reads
    inline from its first epoch; an evicted copy is fetched through obstore on the shard's
    own loop (a sync ``for``) and kept again."""
    pattern = f"s3://{BUCKET}/data/*.jsonl"
    first = JsonLines(pattern, store=s3.store(BUCKET), cache_dir=tmp_path, **FAST)
    assert ids(list(first)) == ALL_IDS
    s3.proxy.reset()
    source = JsonLines(pattern, store=s3.store(BUCKET), cache_dir=tmp_path, **FAST)
    assert source._loopless()
    evicted = _evict(source, source.shards[2], when, monkeypatch)
    assert ids(list(source)) == ALL_IDS
    assert evicted and object_gets(s3, BUCKET) == 1 and os.path.exists(evicted[0])
    assert source.stats.cache_hits == 2 and source.stats.cache_misses == 1
    monkeypatch.undo()
    forbid_background(monkeypatch)
    assert ids(list(source)) == ALL_IDS
    assert object_gets(s3, BUCKET) == 1


@pytest.mark.anyio
async def test_s3_an_evicted_copy_is_fetched_inline(
        s3: Any, tmp_path: Path, anyio_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pattern = f"s3://{BUCKET}/data/*.jsonl"
    source = JsonLines(pattern, store=s3.store(BUCKET), cache_dir=tmp_path, **FAST)
    await collect(source)
    s3.proxy.reset()
    _evict(source, source.shards[0], "read", monkeypatch)
    monkeypatch.setattr(_runtime._Driver, "start", None)  # inline, or a TypeError
    assert ids(await collect(source)) == ALL_IDS
    assert object_gets(s3, BUCKET) == 1


def test_parquet_rows_cached_copies_keep_their_own_reading(
        serve: Callable[..., FaultyServer], tmp_path: Path) -> None:
    """ParquetRows reads its cached copies its own way (threads): a cached epoch stays off the
    loopless path, and its sync ``for`` works as before."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from aloader import ParquetRows

    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": list(range(100))}), path, row_group_size=30)
    server = serve({"a.parquet": path.read_bytes()})
    source = ParquetRows(server.urls, batch_rows=16, cache_dir=tmp_path / "cache", **FAST)
    assert [row["id"] for row in source] == list(range(100))
    assert source.stats.cache_misses == 1
    assert not source._loopless()
    assert [row["id"] for row in source] == list(range(100))
    assert source.stats.cache_hits >= 1


@pytest.mark.parametrize("evict", [False, True])
def test_an_interrupt_in_a_cached_sync_for_leaves_the_epoch_going_on(
        serve: Callable[..., FaultyServer], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, evict: bool) -> None:
    """A KeyboardInterrupt landing in the decoding of a block (of a copy, or of a shard
    fetched on its own loop after its copy was evicted): files closed, and the epoch goes on
    at the same position, every record once."""
    server = serve(SHARDS)
    source = cached_source(server, tmp_path, chunk_size=1000)
    if evict:
        _evict(source, server.urls[1], "read", monkeypatch)
    real = JsonLinesDecoder.feed
    calls = itertools.count()

    def feed(self: Any, data: bytes) -> Any:
        if next(calls) == 8:  # in shard 1 (about 5 chunks a shard)
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(JsonLinesDecoder, "feed", feed)
    iterator = iter(source)
    got: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        for record in iterator:
            got.append(record["id"])
    assert 50 < len(got) < 100
    assert open_handles(tmp_path) == 0
    got += ids(list(iterator))
    assert got == ALL_IDS
    assert open_handles(tmp_path) == 0
