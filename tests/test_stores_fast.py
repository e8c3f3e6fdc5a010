"""The fast paths of the stores: a cached shard read as a local file, Parquet's per-file and
per-batch path, obstore's chunks (issue 14's speed targets), each checked for behaviour."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import collect

from aloader import JsonLines
from aloader._cache import ShardCache

pytestmark = pytest.mark.anyio

SHARDS = make_jsonl_shards(3, 50)  # shard-0000i.jsonl, ids 0..149
ALL_IDS = list(range(150))
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}


def ids(records: list[Any]) -> list[int]:
    return [record["id"] for record in records]


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
        assert reader.ag_code is ShardCache._local.__code__  # type: ignore[attr-defined]
        assert b"".join([piece async for piece in reader]) == SHARDS[Path(url).name]
    finally:
        await reader.aclose()
    # Without a pinned version the read goes through the locks (and the store).
    other = cache.chunks(url, fetch, {}, source.stats, 1 << 16)
    assert other.ag_code is not ShardCache._local.__code__  # type: ignore[attr-defined]
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
    kept = ShardCache.kept
    evicted: list[str] = []

    def evict_after_lookup(self: ShardCache, url: str, version: Any) -> str | None:
        path = kept(self, url, version)
        if path is not None and url == server.urls[1] and not evicted:
            os.unlink(path)
            evicted.append(path)
        return path

    monkeypatch.setattr(ShardCache, "kept", evict_after_lookup)
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

    def refuse(path: str) -> int:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("aloader._files._open", refuse)
    with pytest.raises(PermissionError) as info:
        await collect(source)
    assert any(server.urls[0] in note and str(tmp_path) in note
               for note in getattr(info.value, "__notes__", []))
