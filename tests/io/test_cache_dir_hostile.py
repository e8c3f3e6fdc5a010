"""Attacks on a shared shard cache directory (aloader.io._cachedir): another user or job puts
symlinks, FIFOs or directories where aloader keeps its locks, notes and copies. aloader must
never create, write, stamp or read a file outside the cache through them, never hang on them,
and every record still comes once (from the store where the cache cannot serve it). Over the
local HTTP server, with the real file system."""

from __future__ import annotations

import os
import stat
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import collect, ids

from aloader import JsonLines
from aloader.io._cache import ShardCache, make_version

pytestmark = [pytest.mark.hostile, pytest.mark.anyio]

SHARDS = make_jsonl_shards(2, 50)  # ids 0..99
NAMES = sorted(SHARDS)
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}


def copy_of(cache: Path, server: FaultyServer, name: str) -> Path:
    body = server.files[name]
    version = make_version(len(body), f'"{zlib.crc32(body):08x}"', None)
    assert version is not None
    return Path(ShardCache(str(cache)).path(server.url(name), version))


def base_of(cache: Path, url: str) -> Path:
    return cache / ShardCache(str(cache))._base(url)


def outside_state(outside: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``outside``: its bytes and modification time."""
    return {str(path): (path.read_bytes(), path.stat().st_mtime_ns)
            for path in sorted(outside.rglob("*")) if path.is_file()}


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path]:
    """(the cache directory, a directory outside it holding a victim's file)."""
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    cache.mkdir()
    outside.mkdir()
    (outside / "victim.txt").write_bytes(b"do not touch\n")
    os.utime(outside / "victim.txt", ns=(10**18, 10**18))
    return cache, outside


@pytest.mark.parametrize("target", ["victim.txt", "missing.txt"])
async def test_symlinked_locks_and_notes_are_not_followed(
        serve: Callable[..., FaultyServer], places: tuple[Path, Path], anyio_backend: str,
        target: str) -> None:
    """Every URL's lock and version note, and the eviction lock, replaced by symlinks to a
    file outside (existing, or not: it would be created): nothing outside changes."""
    cache, outside = places
    server = serve(SHARDS)
    for url in server.urls:
        for suffix in (".lock", ".json"):
            os.symlink(outside / target, f"{base_of(cache, url)}{suffix}")
    os.symlink(outside / target, cache / ".lru.lock")
    before = outside_state(outside)
    source = JsonLines(server.urls, cache_dir=cache, cache_limit=1 << 20, **FAST)
    for _ in range(2):
        assert sorted(ids(await collect(source))) == list(range(100))
    assert outside_state(outside) == before
    assert not (outside / "missing.txt").exists()
    assert source.stats.cache_hits == 2  # the symlinks removed, the shards cached
    for url in server.urls:
        assert not os.path.islink(f"{base_of(cache, url)}.lock")


async def test_a_symlinked_copy_is_never_read(
        serve: Callable[..., FaultyServer], places: tuple[Path, Path],
        anyio_backend: str) -> None:
    """A copy replaced by a symlink to a file outside of the same length (and its checksum
    file by one to a matching checksum file): neither is read, the shard comes from the
    store, the symlinks are removed and the target untouched."""
    cache, outside = places
    server = serve(SHARDS)
    source = JsonLines(server.urls, cache_dir=cache, **FAST)
    assert sorted(ids(await collect(source))) == list(range(100))
    copy = copy_of(cache, server, NAMES[0])
    forged = SHARDS[NAMES[0]].replace(b'"id": 7,', b'"id": 8,')
    (outside / "forged").write_bytes(forged)
    os.replace(copy, outside / "genuine")  # keep the real one out of the way
    copy.symlink_to(outside / "forged")
    before = outside_state(outside)
    requests = len(server.requests)
    assert sorted(ids(await collect(source))) == list(range(100))
    assert len(server.requests) == requests + 1
    assert outside_state(outside) == before
    assert not copy.is_symlink() and copy.read_bytes() == SHARDS[NAMES[0]]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
async def test_a_fifo_or_directory_in_place_of_a_copy_does_not_hang(
        serve: Callable[..., FaultyServer], places: tuple[Path, Path], anyio_backend: str,
        kind: str) -> None:
    cache, _ = places
    server = serve(SHARDS)
    source = JsonLines(server.urls, cache_dir=cache, **FAST)
    assert sorted(ids(await collect(source))) == list(range(100))
    copy = copy_of(cache, server, NAMES[0])
    copy.unlink()
    if kind == "fifo":
        os.mkfifo(copy)
    else:
        copy.mkdir()
    with anyio.fail_after(30):
        assert sorted(ids(await collect(source))) == list(range(100))
        assert sorted(ids(await collect(JsonLines(server.urls, cache_dir=cache,
                                                  **FAST)))) == list(range(100))


async def test_a_fifo_in_place_of_a_lock_does_not_hang(
        serve: Callable[..., FaultyServer], places: tuple[Path, Path],
        anyio_backend: str) -> None:
    cache, _ = places
    server = serve(SHARDS)
    for url in server.urls:
        os.mkfifo(f"{base_of(cache, url)}.lock")
    with anyio.fail_after(30):
        source = JsonLines(server.urls, cache_dir=cache, **FAST)
        assert sorted(ids(await collect(source))) == list(range(100))
    for url in server.urls:
        assert stat.S_ISREG(os.lstat(f"{base_of(cache, url)}.lock").st_mode)


def test_a_directory_every_user_may_write_is_worth_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o1777)
    with caplog.at_level("WARNING", logger="aloader.http"):
        for _ in range(3):
            JsonLines("http://127.0.0.1:1/x.jsonl", cache_dir=cache)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "writable by every user" in warnings[0]
    assert str(cache) in warnings[0]
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with caplog.at_level("WARNING", logger="aloader.http"):
        JsonLines("http://127.0.0.1:1/x.jsonl", cache_dir=private)
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
