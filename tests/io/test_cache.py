"""The local shard cache (``cache_dir=``, ``cache_limit=``): later epochs without requests,
one download for several processes at once, LRU eviction under the limit, no half-written or
truncated file ever read or committed, changed objects downloaded again, resume inside cached
and uncached shards; over HTTP and the local S3 server, on asyncio and trio."""

from __future__ import annotations

import fcntl
import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import collect, ids, local_s3, object_gets

from aloader import DataLoader, FetchError, JsonLines, TarShards, TextLines, interleave
from aloader._demo._server import ShardHandler
from aloader.io import _cache
from aloader.io._cache import ShardCache, make_version

pytestmark = pytest.mark.anyio

SHARDS = make_jsonl_shards(3, 50)  # shard-0000i.jsonl, ids 0..149
NAMES = sorted(SHARDS)
ALL_IDS = list(range(150))
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}
ROOT = Path(__file__).resolve().parents[2]


def gets(server: FaultyServer, name: str | None = None) -> int:
    """GET requests the server received (for ``name``, if given)."""
    return sum(1 for got, _ in server.requests if name is None or got == name)


def committed(cache: Path) -> dict[str, bytes]:
    """The committed copies in ``cache``, by file name."""
    return {path.name: path.read_bytes() for path in cache.iterdir()
            if path.name.endswith(".shard")}


def leftovers(cache: Path) -> list[str]:
    return sorted(path.name for path in cache.iterdir() if ".tmp-" in path.name)


def http_path(cache: Path, server: FaultyServer, name: str) -> Path:
    """Where the cache keeps the server's current ``name`` (its ETag is the body's CRC)."""
    body = server.files[name]
    version = make_version(len(body), f'"{zlib.crc32(body):08x}"', None)
    assert version is not None
    return Path(ShardCache(str(cache)).path(server.url(name), version))


# --------------------------------------------------------------------------- HTTP, one process


async def test_a_later_epoch_reads_the_cache_without_requests(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    server = serve(SHARDS)
    source = JsonLines(server.urls, cache_dir=tmp_path, **FAST)
    assert sorted(ids(await collect(source))) == ALL_IDS
    assert gets(server) == 3
    assert source.stats.cache_misses == 3 and source.stats.cache_hits == 0
    assert sorted(committed(tmp_path).values()) == sorted(SHARDS.values())
    for epoch in (1, 2):
        assert sorted(ids(await collect(source))) == ALL_IDS, epoch
    assert gets(server) == 3  # no request at all after the first epoch
    assert source.stats.cache_hits == 6 and source.stats.cache_misses == 3
    assert source.stats.cache_bytes == 2 * sum(map(len, SHARDS.values()))
    assert source.stats.records == 450
    assert leftovers(tmp_path) == []


async def test_a_new_source_validates_then_reads_the_copy(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    """A source that has not seen the objects asks the server (one GET per shard, cut short
    after its first chunk), then reads the cached copies."""
    big = {name: body * 20 for name, body in SHARDS.items()}
    server = serve(big)
    first = JsonLines(server.urls, cache_dir=tmp_path, **FAST)
    expected = await collect(first)
    second = JsonLines(server.urls, cache_dir=tmp_path, **FAST)
    assert await collect(second) == expected
    assert gets(server) == 6
    assert second.stats.cache_hits == 3 and second.stats.cache_misses == 0
    assert second.stats.cache_bytes == sum(map(len, big.values()))


async def test_local_shards_are_not_cached(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "data.txt"
    path.write_text("a\nb\n")
    cache = tmp_path / "cache"
    source = TextLines(str(path), cache_dir=cache)
    assert await collect(source) == ["a", "b"]
    assert list(cache.iterdir()) == []
    assert source.stats.cache_hits == source.stats.cache_misses == 0


def test_bad_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache_limit"):
        JsonLines(str(tmp_path), cache_limit=10)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cache_limit"):
            JsonLines("http://127.0.0.1:1/x.jsonl", cache_dir=tmp_path, cache_limit=bad)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(ValueError, match="cache_dir"):
        JsonLines("http://127.0.0.1:1/x.jsonl", cache_dir=not_a_dir)


def _tar_gz(keys: range) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for key in keys:
            for ext, body in (("txt", f"text {key}".encode()), ("cls", str(key).encode())):
                info = tarfile.TarInfo(f"sample{key:04d}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return gzip.compress(raw.getvalue())


async def test_compressed_tar_shards_are_kept_compressed_and_read_again(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    shards = {"a.tar.gz": _tar_gz(range(10)), "b.tar.gz": _tar_gz(range(10, 25))}
    server = serve(shards)
    source = TarShards(server.urls, cache_dir=tmp_path, **FAST)
    first = await collect(source)
    assert [sample["__key__"] for sample in first] == [f"sample{k:04d}" for k in range(25)]
    assert sorted(committed(tmp_path).values()) == sorted(shards.values())
    assert await collect(source) == first
    assert gets(server) == 2 and source.stats.cache_hits == 2


def test_loader_workers_count_the_cache_in_the_loaders_source(
        serve: Callable[..., FaultyServer], tmp_path: Path) -> None:
    server = serve(SHARDS)
    source = JsonLines(server.urls, cache_dir=tmp_path, **FAST)
    loader = DataLoader(source, batch_size=16, num_workers=2, persistent_workers=True)
    for epoch in range(2):
        assert sorted(i for batch in loader for i in batch["id"].tolist()) == ALL_IDS, epoch
    counts = loader.stats().sources
    loader.close()
    assert gets(server) == 3  # the persistent workers pinned the versions
    assert source.stats.cache_misses == 3 and source.stats.cache_hits == 3
    size = sum(map(len, SHARDS.values()))
    assert source.stats.cache_bytes == size
    assert counts == [{"shards": 6, "records": 300, "bytes": 2 * size, "skipped": 0,
                       "retries": 0, "cache_hits": 3, "cache_misses": 3, "cache_bytes": size,
                       "cache_evicted": 0, "cache_corrupt": 0}]


async def test_a_cache_directory_gone_only_stops_caching(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    """The directory removed after the source was made: a write error, which only stops
    caching (or the directory is made again): every record comes."""
    server = serve(SHARDS)
    cache = tmp_path / "cache"
    source = JsonLines(server.url(NAMES[0]), cache_dir=cache, **FAST)
    cache.rmdir()
    for _ in range(2):
        assert ids(await collect(source)) == list(range(50))


# --------------------------------------------------------------------------- eviction


async def test_eviction_keeps_the_total_under_the_limit_least_recently_used_first(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    server = serve(SHARDS)
    size = max(map(len, SHARDS.values()))
    limit = 2 * size + size // 2  # room for two shards

    def read(*names: str) -> JsonLines:
        return JsonLines([server.url(name) for name in names], cache_dir=tmp_path,
                         cache_limit=limit, concurrency=1, **FAST)

    a, b, c = NAMES
    await collect(read(a, b))
    assert set(committed(tmp_path)) == {http_path(tmp_path, server, n).name for n in (a, b)}
    warm = read(a)
    await collect(warm)
    assert warm.stats.cache_hits == 1  # a is now used more recently than b
    third = read(c)
    assert sorted(ids(await collect(third))) == list(range(100, 150))
    assert third.stats.cache_evicted == 1
    assert set(committed(tmp_path)) == {http_path(tmp_path, server, n).name for n in (a, c)}
    assert sum(map(len, committed(tmp_path).values())) <= limit
    before = gets(server, b)
    again = read(b)
    assert sorted(ids(await collect(again))) == list(range(50, 100))
    assert gets(server, b) == before + 1 and again.stats.cache_misses == 1
    assert set(committed(tmp_path)) == {http_path(tmp_path, server, n).name for n in (b, c)}
    assert sum(map(len, committed(tmp_path).values())) <= limit


async def test_a_shard_larger_than_the_limit_streams_without_being_kept(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    server = serve(SHARDS)
    source = JsonLines(server.urls, cache_dir=tmp_path, cache_limit=100, **FAST)
    assert sorted(ids(await collect(source))) == ALL_IDS
    assert sorted(ids(await collect(source))) == ALL_IDS
    assert committed(tmp_path) == {} and leftovers(tmp_path) == []
    assert gets(server) == 6 and source.stats.cache_misses == 6


async def test_eviction_does_not_break_a_reader_of_the_evicted_file(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    server = serve(SHARDS)
    a, b = NAMES[:2]
    size = max(map(len, SHARDS.values()))
    options: dict[str, Any] = {"cache_dir": tmp_path, "cache_limit": size + size // 2,
                               "chunk_size": 64, **FAST}
    await collect(JsonLines(server.url(a), **options))
    reader = JsonLines(server.url(a), **options)
    records = reader.__aiter__()
    got = [await records.__anext__()]  # a's copy is open now
    await collect(JsonLines(server.url(b), **options))  # evicts a's copy
    assert not http_path(tmp_path, server, a).exists()
    got += [record async for record in records]
    assert ids(got) == list(range(50))
    assert reader.stats.cache_hits == 1


# --------------------------------------------------------------------------- never a bad copy


async def test_a_crashed_downloads_temporary_file_is_never_read(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    server = serve(SHARDS)
    name = NAMES[0]
    final = http_path(tmp_path, server, name)
    # What a downloader killed halfway leaves: a temporary file of the full size, its lock
    # released (by the kernel, with the process).
    temp = Path(f"{final}.tmp-99999-dead")
    temp.write_bytes(b"x" * len(SHARDS[name]))
    source = JsonLines(server.url(name), cache_dir=tmp_path, **FAST)
    assert ids(await collect(source)) == list(range(50))
    assert source.stats.cache_misses == 1
    assert not temp.exists()
    assert final.read_bytes() == SHARDS[name]


def test_a_killed_downloader_leaves_nothing_that_is_read(tmp_path: Path) -> None:
    """A real crash: a process killed in the middle of its download."""
    big = {"big.jsonl": b"".join(json.dumps({"id": i, "pad": "y" * 200}).encode() + b"\n"
                                 for i in range(20_000))}
    with FaultyServer(big) as server:
        code = (
            "import os, sys, anyio\n"
            "from aloader import JsonLines\n"
            "async def main():\n"
            "    source = JsonLines(sys.argv[1], cache_dir=sys.argv[2], chunk_size=4096)\n"
            "    async for record in source:\n"
            "        if record['id'] == 100:\n"
            "            os._exit(3)\n"
            "anyio.run(main)\n"
        )
        run = subprocess.run([sys.executable, "-c", code, server.url("big.jsonl"),
                              str(tmp_path)], cwd=ROOT, env=_child_env(), timeout=120)
        assert run.returncode == 3
        assert committed(tmp_path) == {}
        assert len(leftovers(tmp_path)) == 1  # what the crash left
        text = subprocess.run(
            [sys.executable, "-c",
             "import sys, anyio\nfrom aloader import JsonLines\n"
             "async def main():\n"
             "    source = JsonLines(sys.argv[1], cache_dir=sys.argv[2])\n"
             "    count = len([record async for record in source])\n"
             "    print(count, source.stats.cache_misses)\n"
             "anyio.run(main)\n", server.url("big.jsonl"), str(tmp_path)],
            cwd=ROOT, env=_child_env(), timeout=120, capture_output=True, text=True, check=True)
        assert text.stdout.split() == ["20000", "1"]
        assert leftovers(tmp_path) == []
        assert list(committed(tmp_path).values()) == [big["big.jsonl"]]


async def test_a_truncated_download_is_not_committed(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    server = serve(SHARDS)
    name = NAMES[1]
    server.cut(name, after=300)
    source = JsonLines(server.url(name), cache_dir=tmp_path, **{**FAST, "retries": 0})
    with pytest.raises(FetchError, match=server.url(name)):
        await collect(source)
    assert committed(tmp_path) == {} and leftovers(tmp_path) == []
    # Cut again, but resumed by a retry: the copy committed is the whole object.
    server.cut(name, after=300)
    resumed = JsonLines(server.url(name), cache_dir=tmp_path, **FAST)
    assert ids(await collect(resumed)) == list(range(50, 100))
    assert resumed.stats.retries == 1
    assert list(committed(tmp_path).values()) == [SHARDS[name]]


async def test_a_reader_that_stops_early_commits_nothing(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    server = serve(SHARDS)
    source = JsonLines(server.url(NAMES[0]), cache_dir=tmp_path, chunk_size=64, **FAST)
    records = source.__aiter__()
    await records.__anext__()
    # The records flow while the shard is being downloaded into the cache.
    assert committed(tmp_path) == {} and len(leftovers(tmp_path)) == 1
    await records.aclose()  # type: ignore[attr-defined]
    assert committed(tmp_path) == {} and leftovers(tmp_path) == []


async def test_two_sources_of_one_process_over_one_shard_do_not_wait_on_each_other(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Interleaved, each source needs the other's next block: the second one does not wait
    for the first one's download (which waits for the consumer), it reads the server."""
    monkeypatch.setattr(_cache, "_PATIENCE", 3600.0)  # not what ends the wait here
    server = serve(SHARDS)
    url = server.url(NAMES[0])
    first, second = (JsonLines(url, cache_dir=tmp_path, chunk_size=64, **FAST)
                     for _ in range(2))
    with anyio.fail_after(30):
        got = await collect(interleave(first, second))
    assert sorted(ids(got)) == sorted(list(range(50)) * 2)
    assert first.stats.cache_misses == second.stats.cache_misses == 1
    assert list(committed(tmp_path).values()) == [SHARDS[NAMES[0]]]
    assert leftovers(tmp_path) == []


async def test_a_stalled_download_of_another_process_is_not_waited_for_forever(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cache, "_PATIENCE", 0.2)
    server = serve(SHARDS)
    url = server.url(NAMES[0])
    # Another process's download of the shard, stuck: its lock held, never stamped.
    held = os.open(tmp_path / f"{ShardCache(str(tmp_path))._base(url)}.lock",
                   os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        source = JsonLines(url, cache_dir=tmp_path, **FAST)
        with anyio.fail_after(60):
            assert ids(await collect(source)) == list(range(50))
        assert source.stats.cache_misses == 1 and committed(tmp_path) == {}
    finally:
        os.close(held)
    await collect(source)  # the lock is free again: the shard is kept
    assert list(committed(tmp_path).values()) == [SHARDS[NAMES[0]]]


async def test_a_changed_object_is_downloaded_again(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    server = serve(SHARDS)
    name = NAMES[0]
    await collect(JsonLines(server.url(name), cache_dir=tmp_path, **FAST))
    old = http_path(tmp_path, server, name)
    changed = b"".join(json.dumps({"id": 1000 + i}).encode() + b"\n" for i in range(7))
    server.replace(name, changed)
    source = JsonLines(server.url(name), cache_dir=tmp_path, **FAST)
    assert ids(await collect(source)) == list(range(1000, 1007))
    assert source.stats.cache_misses == 1 and source.stats.cache_hits == 0
    new = http_path(tmp_path, server, name)
    assert new != old and new.read_bytes() == changed
    # Same size, other content (another ETag): downloaded again too.
    same_size = b"".join(json.dumps({"id": 2000 + i}).encode() + b"\n" for i in range(7))
    assert len(same_size) == len(changed)
    server.replace(name, same_size)
    source = JsonLines(server.url(name), cache_dir=tmp_path, **FAST)
    assert ids(await collect(source)) == list(range(2000, 2007))
    assert source.stats.cache_misses == 1


# --------------------------------------------------------------------------- resume


async def _interrupted(source: JsonLines, fresh: JsonLines, k: int) -> list[Any]:
    records = source.__aiter__()
    for _ in range(k):
        await records.__anext__()
    state = json.loads(json.dumps(source.state_dict()))
    await records.aclose()  # type: ignore[attr-defined]
    fresh.load_state_dict(state)
    return await collect(fresh)


async def test_resume_inside_a_cached_shard_seeks_in_the_copy(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    server = serve(SHARDS)

    def make() -> JsonLines:
        return JsonLines(server.urls, cache_dir=tmp_path, chunk_size=200, concurrency=1,
                         **FAST)

    source = make()
    full = await collect(source)  # epoch 0: downloads
    assert gets(server) == 3
    for k in (1, 30, 75, 149):
        # The same source: its versions are pinned, so no request at all.
        requests = gets(server)
        rest = await _interrupted(source, source, k)
        assert rest == full[k:], k
        assert gets(server) == requests, k
    # A new source: each shard's version asked once, its records read from the copy.
    fresh = make()
    hits = fresh.stats.cache_hits
    rest = await _interrupted(source, fresh, 75)
    assert rest == full[75:]
    assert fresh.stats.cache_hits - hits == 2 and fresh.stats.cache_misses == 0
    assert fresh.stats.bytes == fresh.stats.cache_bytes < sum(map(len, SHARDS.values()))


async def test_resume_inside_an_uncached_shard_reads_from_the_offset(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    server = serve(SHARDS)
    full = await collect(JsonLines(server.urls, concurrency=1, **FAST))

    def make(cache: str) -> JsonLines:
        return JsonLines(server.urls, cache_dir=tmp_path / cache, chunk_size=200,
                         concurrency=1, **FAST)

    rest = await _interrupted(make("a"), make("b"), 75)
    assert rest == full[75:]
    resumed = [header for name, header in server.requests if name == NAMES[1]]
    assert resumed[-1] is not None and resumed[-1].startswith("bytes=")  # a Range request
    # The shard resumed in the middle is not kept (the cache holds only whole objects); the
    # next one is.
    assert list(committed(tmp_path / "b").values()) == [SHARDS[NAMES[2]]]
    assert leftovers(tmp_path / "b") == []


# --------------------------------------------------------------------------- processes


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.update(extra or {})
    return env


_READER = (
    "import json, sys, anyio\n"
    "from aloader import JsonLines\n"
    "async def main():\n"
    "    source = JsonLines(json.loads(sys.argv[1]), cache_dir=sys.argv[2], timeout=60)\n"
    "    ids = sorted([record['id'] async for record in source])\n"
    "    print(json.dumps([ids, source.stats.cache_hits, source.stats.cache_misses]))\n"
    "anyio.run(main)\n"
)


class GatedServer(FaultyServer):
    """A server that holds every answer until :attr:`gate` is set."""

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(files)
        self.gate = threading.Event()

    def respond(self, handler: ShardHandler, name: str, range_header: str | None) -> None:
        self.gate.wait(60)
        super().respond(handler, name, range_header)


def _opened(pid: int, paths: set[str], timeout: float = 60.0) -> bool:
    """Wait until process ``pid`` holds all of ``paths`` open; whether it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
        except OSError:
            return False
        if paths <= held:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_two_processes_at_once_download_each_shard_once(tmp_path: Path) -> None:
    """Process A holds the shards' locks, its answers held back by the server; process B
    asks for the same shards meanwhile (seen waiting on the locks): B waits, then reads A's
    copies, with no request of its own."""
    with GatedServer(SHARDS) as server:
        urls = json.dumps(server.urls)
        start = [sys.executable, "-c", _READER, urls, str(tmp_path)]
        first = subprocess.Popen(start, cwd=ROOT, env=_child_env(), stdout=subprocess.PIPE)
        second: subprocess.Popen[bytes] | None = None
        try:
            deadline = time.monotonic() + 60
            while gets(server) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert gets(server) == 3
            cache = ShardCache(str(tmp_path))
            locks = {str(tmp_path / f"{cache._base(url)}.lock") for url in server.urls}
            second = subprocess.Popen(start, cwd=ROOT, env=_child_env(), stdout=subprocess.PIPE)
            assert _opened(second.pid, locks)
            server.gate.set()
            out_a, _ = first.communicate(timeout=120)
            out_b, _ = second.communicate(timeout=120)
        finally:
            server.gate.set()
            for process in (first, second):
                if process is not None and process.poll() is None:
                    process.kill()
        assert json.loads(out_a) == [ALL_IDS, 0, 3]
        assert json.loads(out_b) == [ALL_IDS, 3, 0]
        assert gets(server) == 3  # one GET per shard, both processes together
        assert sorted(committed(tmp_path).values()) == sorted(SHARDS.values())
        assert leftovers(tmp_path) == []


# --------------------------------------------------------------------------- S3


BUCKET = "cache-bucket"


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    with local_s3(BUCKET, {f"data/{name}": body for name, body in SHARDS.items()}) as server:
        yield server


async def test_s3_later_epochs_and_new_sources_make_no_request(
        s3: Any, tmp_path: Path, anyio_backend: str) -> None:
    """Listed objects come with their versions: only the first download asks for them."""
    s3.proxy.reset()
    pattern = f"s3://{BUCKET}/data/*.jsonl"
    source = JsonLines(pattern, store=s3.store(BUCKET), cache_dir=tmp_path, **FAST)
    assert sorted(ids(await collect(source))) == ALL_IDS
    assert object_gets(s3, BUCKET) == 3
    assert sorted(ids(await collect(source))) == ALL_IDS
    fresh = JsonLines(pattern, store=s3.store(BUCKET), cache_dir=tmp_path, **FAST)
    assert sorted(ids(await collect(fresh))) == ALL_IDS
    assert object_gets(s3, BUCKET) == 3
    assert fresh.stats.cache_hits == 3 and fresh.stats.cache_misses == 0


async def test_s3_changed_object_is_downloaded_again(
        s3: Any, tmp_path: Path, anyio_backend: str) -> None:
    key = f"data/changing-{anyio_backend}.jsonl"
    s3.put(BUCKET, {key: b'{"id": 1}\n'})
    url = f"s3://{BUCKET}/{key}"
    first = JsonLines(url, store=s3.store(BUCKET), cache_dir=tmp_path, **FAST)
    assert ids(await collect(first)) == [1]
    s3.put(BUCKET, {key: b'{"id": 2}\n'})  # same size, another ETag
    second = JsonLines(url, store=s3.store(BUCKET), cache_dir=tmp_path, **FAST)
    assert ids(await collect(second)) == [2]
    assert second.stats.cache_misses == 1
    listed = JsonLines(f"s3://{BUCKET}/data/changing-{anyio_backend}.*",
                       store=s3.store(BUCKET), cache_dir=tmp_path, **FAST)
    s3.proxy.reset()
    assert ids(await collect(listed)) == [2]
    assert object_gets(s3, BUCKET) == 0 and listed.stats.cache_hits == 1


async def test_s3_resume_inside_a_cached_shard_makes_no_request(
        s3: Any, tmp_path: Path, anyio_backend: str) -> None:
    pattern = f"s3://{BUCKET}/data/shard-*.jsonl"

    def make() -> JsonLines:
        return JsonLines(pattern, store=s3.store(BUCKET), cache_dir=tmp_path, chunk_size=200,
                         concurrency=1, **FAST)

    full = await collect(make())
    s3.proxy.reset()
    rest = await _interrupted(make(), make(), 80)
    assert rest == full[80:]
    assert object_gets(s3, BUCKET) == 0


def test_s3_two_processes_at_once_download_each_object_once(s3: Any, tmp_path: Path) -> None:
    s3.proxy.reset()
    urls = json.dumps([f"s3://{BUCKET}/data/shard-*.jsonl"])
    env = _child_env(s3.env())
    start = [sys.executable, "-c", _READER, urls, str(tmp_path)]
    processes = [subprocess.Popen(start, cwd=ROOT, env=env, stdout=subprocess.PIPE)
                 for _ in range(2)]
    outs = [json.loads(process.communicate(timeout=120)[0]) for process in processes]
    assert all(out[0] == ALL_IDS for out in outs)
    assert sum(out[1] for out in outs) == 3 and sum(out[2] for out in outs) == 3
    assert object_gets(s3, BUCKET) == 3
