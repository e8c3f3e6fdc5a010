"""The fast paths of the stores: a cached shard read as a local file, Parquet's per-file and
per-batch path, obstore's chunks (where the speed targets are measured), each checked for
behaviour."""

from __future__ import annotations

import gc
import importlib.util
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import collect, ids

from aloader import JsonLines, ParquetRows
from aloader.io._cache import ShardCache
from aloader.sources import _parquet_read

pytestmark = pytest.mark.anyio

SHARDS = make_jsonl_shards(3, 50)  # shard-0000i.jsonl, ids 0..149
ALL_IDS = list(range(150))
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}


def gets(server: FaultyServer) -> int:
    return len(server.requests)


# ------------------------------------------------------------------------------- the cache


async def test_a_pinned_copy_is_read_by_the_local_file_reader_itself(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    """A cached epoch's shard is the local-file reader (file_chunks) and the counting of its
    bytes: no lock, no retry loop, no store wrapper between them."""
    server = serve(SHARDS)
    source = JsonLines(server.urls, cache_dir=tmp_path, **FAST)
    await collect(source)  # downloads: every version pinned
    cache = source._shard_cache
    assert cache is not None
    url = server.urls[0]

    def fetch(*args: Any) -> Any:
        raise AssertionError("a pinned copy makes no request")

    reader = cache.chunks(url, fetch, source._versions, source.stats, 1 << 16)
    try:
        assert reader.ag_code is ShardCache._copy.__code__  # type: ignore[attr-defined]
        assert b"".join([piece async for piece in reader]) == SHARDS[Path(url).name]
    finally:
        await reader.aclose()
    # Without a pinned version the read goes through the locks (and the store).
    other = cache.chunks(url, fetch, {}, source.stats, 1 << 16)
    assert other.ag_code is not ShardCache._copy.__code__  # type: ignore[attr-defined]
    await other.aclose()


async def test_a_pinned_copy_evicted_before_it_is_opened_is_read_from_the_store(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy found for the pinned version vanishes (another process evicts it) between its
    look-up and its opening: the shard is downloaded again, every record once."""
    server = serve(SHARDS)
    source = JsonLines(server.urls, cache_dir=tmp_path, **FAST)
    await collect(source)
    assert gets(server) == 3
    from aloader.io import _cachedir

    open_stat = _cachedir.Directory.open_stat
    evicted: list[str] = []
    cache = source._shard_cache
    assert cache is not None
    path = cache.path(server.urls[1], source._versions[server.urls[1]])

    def evict_before_open(self: Any, name: str, *args: Any) -> Any:
        if name == os.path.basename(path) and not evicted:
            os.unlink(path)
            evicted.append(path)
        return open_stat(self, name, *args)

    monkeypatch.setattr(_cachedir.Directory, "open_stat", evict_before_open)
    assert sorted(ids(await collect(source))) == ALL_IDS
    assert evicted and gets(server) == 4  # the evicted shard only
    assert os.path.exists(evicted[0])  # and kept again
    assert source.stats.records == 300


async def test_an_unreadable_pinned_copy_names_the_url_and_the_cache(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    server = serve(SHARDS)
    source = JsonLines(server.urls[:1], cache_dir=tmp_path, **FAST)
    await collect(source)

    def refuse(directory: Any, name: str, *args: Any) -> int:
        raise PermissionError(13, "Permission denied", name)

    monkeypatch.setattr("aloader.io._cachedir.Directory.open_stat", refuse)
    with pytest.raises(PermissionError) as info:
        await collect(source)
    assert any(server.urls[0] in note and str(tmp_path) in note
               for note in getattr(info.value, "__notes__", []))


# ------------------------------------------------------------------------------- Parquet

needs_pyarrow = pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None,
                                   reason="needs pyarrow")


def write_parquet(path: Path, start: int, rows: int, group_rows: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = np.arange(start, start + rows, dtype=np.int64)
    pq.write_table(pa.table({"id": ids, "x": ids * 0.5}), path, row_group_size=group_rows)
    return str(path)


@needs_pyarrow
async def test_whole_local_files_are_planned_and_read_without_anyio_threads(
        tmp_path: Path, anyio_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole local files: the epoch's plan reads no footer (no thread call), and the batches
    are read in the pass's own thread, every row once, in order."""
    paths = [write_parquet(tmp_path / f"{i}.parquet", 100 * i, 100, 30) for i in range(3)]
    source = ParquetRows(paths, columns=["id"], batch_rows=40, as_batches=True)
    names: set[str] = set()
    next_batch = _parquet_read._UnitReader.next

    def spy(self: Any) -> Any:
        names.add(threading.current_thread().name)
        return next_batch(self)

    async def no_anyio_thread(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a thread call of anyio's")

    monkeypatch.setattr(_parquet_read._UnitReader, "next", spy)
    monkeypatch.setattr(_parquet_read.anyio.to_thread, "run_sync", no_anyio_thread)
    batches = [batch async for batch in source]
    assert np.concatenate([b["id"] for b in batches]).tolist() == list(range(300))
    assert names == {"aloader-parquet"}
    assert source.stats.records == 300 and source.stats.shards == 3


@needs_pyarrow
async def test_the_read_thread_hands_on_errors_and_ends(anyio_backend: str) -> None:
    before = set(threading.enumerate())
    thread = _parquet_read._ReadThread()
    assert await thread.run(lambda: [1]) == [1]
    running = [t for t in threading.enumerate()
               if t.name == "aloader-parquet" and t not in before]
    assert len(running) == 1

    def fail() -> Any:
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError) as info:
        await thread.run(fail)
    assert info.value.errno == 5
    assert await thread.run(lambda: None) is None  # still serving after an error
    thread.close()
    for t in running:
        t.join(5)
    assert not any(t.is_alive() for t in running)


@needs_pyarrow
async def test_a_cancelled_read_waits_for_the_call_in_hand(anyio_backend: str) -> None:
    """Cancelling the reader does not leave its call running (the file closed under it)."""
    thread = _parquet_read._ReadThread()
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def slow() -> Any:
        started.set()
        release.wait(5)
        finished.append(True)
        return [1]

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(thread.run, slow)
            await anyio.to_thread.run_sync(started.wait)
            scope.cancel()
            release.set()
    assert finished == [True]
    thread.close()


@needs_pyarrow
async def test_an_abandoned_pass_stops_its_thread(tmp_path: Path, anyio_backend: str) -> None:
    paths = [write_parquet(tmp_path / f"{i}.parquet", 100 * i, 100, 30) for i in range(3)]
    source = ParquetRows(paths, batch_rows=40, as_batches=True)
    before = {t for t in threading.enumerate() if t.name == "aloader-parquet"}
    stream = source.__aiter__()
    first = await stream.__anext__()
    assert first["id"].tolist() == list(range(40))
    await stream.aclose()  # type: ignore[attr-defined]
    for t in threading.enumerate():
        if t.name == "aloader-parquet" and t not in before:
            t.join(5)
            assert not t.is_alive()


@needs_pyarrow
async def test_a_read_thread_left_unclosed_exits_when_collected(anyio_backend: str) -> None:
    before = set(threading.enumerate())
    thread = _parquet_read._ReadThread()
    await thread.run(lambda: None)
    (started,) = [t for t in threading.enumerate()
                  if t.name == "aloader-parquet" and t not in before]
    del thread
    gc.collect()
    started.join(5)
    assert not started.is_alive()


# obstore's runtime threads ------------------------------------------------------------------------
def test_obstore_runtime_threads_are_set_until_its_first_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """aloader asks tokio for half the cores as obstore's worker threads (one thread per core
    cost an S3 epoch ~20% more CPU on 2 cores), through TOKIO_WORKER_THREADS, read when the
    runtime starts: set at obstore's first use in the process, gone after its first request,
    and never over a value the user set."""
    pytest.importorskip("obstore")
    from aloader.io import _objstore
    monkeypatch.delenv("TOKIO_WORKER_THREADS", raising=False)
    monkeypatch.setattr(_objstore, "_RUNTIME_PID", None)
    monkeypatch.setattr(_objstore, "_SET_THREADS", False)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _objstore._obstore("s3://bucket/key")
    assert os.environ["TOKIO_WORKER_THREADS"] == str(max(1, (cores or 2) // 2))
    _objstore._obstore("s3://bucket/key")  # a later use sets nothing more
    _objstore._runtime_started()
    assert "TOKIO_WORKER_THREADS" not in os.environ
    _objstore._runtime_started()  # idempotent
    assert "TOKIO_WORKER_THREADS" not in os.environ

    monkeypatch.setenv("TOKIO_WORKER_THREADS", "7")
    monkeypatch.setattr(_objstore, "_RUNTIME_PID", None)
    _objstore._obstore("s3://bucket/key")
    _objstore._runtime_started()
    assert os.environ["TOKIO_WORKER_THREADS"] == "7"


async def test_obstore_first_request_clears_the_runtime_variable(
    monkeypatch: pytest.MonkeyPatch, anyio_backend: str,
) -> None:
    """The variable goes with the first request's answer, failed ones included."""
    pytest.importorskip("obstore")
    from aloader.io import _objstore
    monkeypatch.setattr(_objstore, "_SET_THREADS", True)
    monkeypatch.setenv("TOKIO_WORKER_THREADS", "1")
    import obstore
    from obstore.store import MemoryStore

    calls = _objstore._Calls(obstore, threaded=anyio_backend == "trio")
    with pytest.raises(FileNotFoundError):
        await calls.get(MemoryStore(), "missing", {})
    assert "TOKIO_WORKER_THREADS" not in os.environ
