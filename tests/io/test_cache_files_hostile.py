"""Attacks on the shard cache's files (aloader.io._cache): a committed copy cut short or grown
(a machine's crash before its bytes reached the disk, a hand), a cache directory that cannot
be written, a ``cache_limit`` below one shard, two processes racing on one shard whose body
is cut. A copy that is not its object's is never served; a directory that cannot be used is
an error naming it; every record comes once."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import collect, ids

from aloader import JsonLines
from aloader.io._cache import ShardCache, make_version

pytestmark = [pytest.mark.hostile, pytest.mark.anyio]

SHARDS = make_jsonl_shards(2, 50)  # ids 0..99
NAMES = sorted(SHARDS)
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}
ROOT = Path(__file__).resolve().parents[2]


def copy_of(cache: Path, server: FaultyServer, name: str) -> Path:
    """Where the cache keeps the server's ``name`` (its ETag is the body's CRC)."""
    body = server.files[name]
    version = make_version(len(body), f'"{zlib.crc32(body):08x}"', None)
    assert version is not None
    return Path(ShardCache(str(cache)).path(server.url(name), version))


def cut_at_a_line(body: bytes) -> bytes:
    """``body`` up to the end of a line near its middle: a shorter shard that parses."""
    return body[: body.index(b"\n", len(body) // 2) + 1]


@pytest.mark.parametrize("damage", ["cut", "grown", "emptied"])
async def test_a_copy_of_the_wrong_length_is_never_served(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        damage: str) -> None:
    server = serve(SHARDS)
    name = NAMES[0]
    source = JsonLines(server.url(name), cache_dir=tmp_path, **FAST)
    assert ids(await collect(source)) == list(range(50))
    copy = copy_of(tmp_path, server, name)
    body = SHARDS[name]
    copy.write_bytes({"cut": cut_at_a_line(body), "grown": body + body,
                      "emptied": b""}[damage])
    # The same source (its version pinned: the copy is read inline) and a new one.
    for reader in (source, JsonLines(server.url(name), cache_dir=tmp_path, **FAST)):
        misses = reader.stats.cache_misses
        assert ids(await collect(reader)) == list(range(50))
        assert reader.stats.cache_misses == misses + 1
        assert copy.read_bytes() == body  # downloaded again
        copy.write_bytes(cut_at_a_line(body))


def test_a_copy_cut_short_is_not_served_to_a_sync_for(serve: Callable[..., FaultyServer],
                                                       tmp_path: Path) -> None:
    """A sync ``for`` reads a pinned copy on its own thread (a loopless epoch); one of the
    wrong length is fetched again on a loop of its own."""
    server = serve(SHARDS)
    source = JsonLines(server.urls, cache_dir=tmp_path, **FAST)
    assert sorted(ids(list(source))) == list(range(100))
    for name in NAMES:
        copy_of(tmp_path, server, name).write_bytes(cut_at_a_line(SHARDS[name]))
    assert sorted(ids(list(source))) == list(range(100))
    assert source.stats.cache_misses == 4


async def test_a_cache_dir_whose_files_cannot_be_made_streams_with_one_warning(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Creating its files refused (the tests run as root, whom permissions do not stop: the
    refusal is the kernel's answer, simulated): a write error only stops caching, so every
    record streams from the store, one warning says why, nothing is left behind."""
    server = serve(SHARDS)
    cache = tmp_path / "cache"
    source = JsonLines(server.urls, cache_dir=cache, **FAST)
    real_open = os.open

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if kwargs.get("dir_fd") is not None and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    with caplog.at_level("WARNING", logger="aloader.http"):
        assert sorted(ids(await collect(source))) == list(range(100))
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "not caching" in warnings[0].getMessage()
    assert str(cache) in warnings[0].getMessage()
    assert source.stats.cache_misses == 2 and list(cache.iterdir()) == []
    monkeypatch.undo()
    assert sorted(ids(await collect(source))) == list(range(100))  # writable again: kept
    assert len([p for p in cache.iterdir() if p.name.endswith(".shard")]) == 2


def test_a_cache_dir_that_cannot_be_written_is_an_error_at_construction(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory the process may not write into (the answer of access(2), simulated: root
    may write anywhere) is refused when the source is made, naming it."""
    cache = tmp_path / "cache"
    cache.mkdir()
    real_access = os.access

    def access(path: Any, mode: int, **kwargs: Any) -> bool:
        return False if str(path) == str(cache) else real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", access)
    with pytest.raises(ValueError, match=r"cache_dir=.* cannot be used as a cache "
                                         r"directory: .*cannot create files in it"):
        JsonLines("http://127.0.0.1:1/x.jsonl", cache_dir=cache)


async def test_a_limit_below_one_shard_keeps_the_small_ones_and_streams_the_rest(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str) -> None:
    files = {"big.jsonl": make_jsonl_shards(1, 200)["shard-00000.jsonl"],
             "small.jsonl": make_jsonl_shards(1, 5, prefix="s")["s-00000.jsonl"]}
    server = serve(files)
    limit = len(files["small.jsonl"]) + 10
    source = JsonLines(server.urls, cache_dir=tmp_path, cache_limit=limit, **FAST)
    for _ in range(2):
        assert len(await collect(source)) == 205
    kept = sorted(path.name for path in tmp_path.iterdir() if path.name.endswith(".shard"))
    assert kept == [copy_of(tmp_path, server, "small.jsonl").name]
    assert not [path for path in tmp_path.iterdir() if ".tmp-" in path.name]
    assert [name for name, _ in server.requests].count("big.jsonl") == 2
    assert [name for name, _ in server.requests].count("small.jsonl") == 1


_READER = (
    "import json, sys, anyio\n"
    "from aloader import JsonLines\n"
    "async def main():\n"
    "    source = JsonLines(json.loads(sys.argv[1]), cache_dir=sys.argv[2], timeout=60,\n"
    "                       backoff=0.01, chunk_size=512)\n"
    "    ids = [record['id'] async for record in source]\n"
    "    print(json.dumps(ids))\n"
    "anyio.run(main)\n"
)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_two_processes_racing_on_a_shard_whose_body_is_cut(tmp_path: Path) -> None:
    """Both start at once; the first download's body is cut twice (resumed by range): each
    process reads every record once, in order, and one whole copy is committed."""
    files = {"race.jsonl": make_jsonl_shards(1, 2000)["shard-00000.jsonl"]}
    with FaultyServer(files, latency=0.05) as server:
        server.cut("race.jsonl", 10_000)
        server.cut("race.jsonl", 30_000)
        start = [sys.executable, "-c", _READER, json.dumps(server.urls), str(tmp_path)]
        processes = [subprocess.Popen(start, cwd=ROOT, env=_child_env(),
                                      stdout=subprocess.PIPE) for _ in range(2)]
        try:
            outputs = [process.communicate(timeout=120)[0] for process in processes]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
        for process, out in zip(processes, outputs, strict=True):
            assert process.returncode == 0
            assert json.loads(out) == list(range(2000))
        copies = [path for path in tmp_path.iterdir() if path.name.endswith(".shard")]
        assert [path.read_bytes() for path in copies] == [files["race.jsonl"]]
        assert not [path for path in tmp_path.iterdir() if ".tmp-" in path.name]


@pytest.mark.parametrize("note", [
    b"", b"\0" * 64, b'{"url": 1', b"[1, 2]", b'"just a string"',
    b'{"url": "URL", "version": "x", "at": 1e18}',
    b'{"url": "URL", "version": [1, 2, 3], "at": 1e18}',
    b'{"url": "URL", "version": [10, "t"], "at": "later"}',
    b'{"url": "URL", "version": [null, null], "at": 1e18}',
    b'{"url": "URL", "version": [10, ["t"]], "at": 1e18}',
])
async def test_a_version_note_damaged_or_of_another_shape_is_ignored(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        note: bytes) -> None:
    """``<url hash>.json`` notes the version last found for a URL: one cut by a crash, zeroed
    by a machine's, or written in another shape (another release, a hand) is no note."""
    server = serve(SHARDS)
    url = server.url(NAMES[0])
    (tmp_path / f"{ShardCache(str(tmp_path))._base(url)}.json").write_bytes(
        note.replace(b"URL", url.encode()))
    source = JsonLines(url, cache_dir=tmp_path, **FAST)
    assert ids(await collect(source)) == list(range(50))
    assert copy_of(tmp_path, server, NAMES[0]).read_bytes() == SHARDS[NAMES[0]]



async def test_a_directory_that_refuses_stamps_serves_its_copies_with_one_warning(
        serve: Callable[..., FaultyServer], tmp_path: Path, anyio_backend: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A cache directory gone read-only (a hit's stamp of last use refused): a write error,
    said once; the copies are still read, for the source whose versions are pinned (its
    copies read inline, no request) as for a new one (a version check each)."""
    server = serve(SHARDS)
    source = JsonLines(server.urls, cache_dir=tmp_path, **FAST)
    assert sorted(ids(await collect(source))) == list(range(100))
    real_utime = os.utime

    def refusing(path: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("dir_fd") is not None or "ns" in kwargs:  # a copy's stamp
            raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        real_utime(path, *args, **kwargs)

    monkeypatch.setattr(os, "utime", refusing)
    requests = len(server.requests)
    with caplog.at_level("WARNING", logger="aloader.http"):
        for reader in (source, JsonLines(server.urls, cache_dir=tmp_path, **FAST)):
            hits = reader.stats.cache_hits
            assert sorted(ids(await collect(reader))) == list(range(100))
            assert reader.stats.cache_hits == hits + 2
    assert len(server.requests) == requests + 2  # the new source's version checks only
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "Read-only file system" in warnings[0].getMessage()
