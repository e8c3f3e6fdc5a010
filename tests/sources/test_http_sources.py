"""HTTP sources against a real HTTP server on 127.0.0.1: counts, sharding, backpressure and
connection cleanup (statuses, retries and resumption are _http's: tests/io/test_http.py)."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable

import anyio
import numpy as np
import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import collect, read_as_consumers

from aloader import DataLoader, JsonLines, NpyRows, RecordError, TextLines

pytestmark = pytest.mark.anyio


async def settle(condition: Callable[[], bool], rounds: int = 300) -> bool:
    for _ in range(rounds):
        gc.collect()
        if condition():
            return True
        await anyio.sleep(0.01)
    return condition()


# --------------------------------------------------------------------------- reading


async def test_urls_exact_counts(serve: Callable[..., FaultyServer], anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(6, 300))
    source = JsonLines(server.urls, concurrency=3)
    records = await collect(source)
    assert [r["id"] for r in records] == list(range(1800))
    assert source.stats.shards == 6 and source.stats.retries == 0
    assert source.stats.bytes == sum(len(b) for b in server.files.values())
    one = await collect(TextLines(server.urls[2]))
    assert len(one) == 300 and json.loads(one[0])["id"] == 600


async def test_npy_over_http(serve: Callable[..., FaultyServer], anyio_backend: str) -> None:
    import io

    array = np.arange(3000, dtype=np.float64).reshape(1000, 3)
    buffer = io.BytesIO()
    np.save(buffer, array)
    server = serve({"a.npy": buffer.getvalue()})
    rows = await collect(NpyRows(server.url("a.npy"), chunk_size=1000))
    np.testing.assert_array_equal(np.stack(rows), array)


@pytest.mark.parametrize("cut", [5, 128, 200, 1000, 12127])
async def test_npy_over_http_resumes_a_cut_body(serve: Callable[..., FaultyServer], cut: int,
                                               anyio_backend: str) -> None:
    """A body cut after some rows is resumed from the byte where it stopped, as for every
    format: the retry's answer tells the shard's size again, which the rows already read
    must not be counted against (it was a 'truncated array' RecordError)."""
    import io

    array = np.arange(3000, dtype=np.float64).reshape(500, 6)
    buffer = io.BytesIO()
    np.save(buffer, array)
    server = serve({"a.npy": buffer.getvalue()})
    server.cut("a.npy", cut)
    source = NpyRows(server.url("a.npy"), backoff=0.01, chunk_size=1000)
    rows = await collect(source)
    np.testing.assert_array_equal(np.stack(rows), array)
    assert source.stats.retries == 1


async def test_url_sharding_exactly_once(serve: Callable[..., FaultyServer],
                                         anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(5, 20))
    world_size, num_workers = 2, 4  # 8 consumers, 5 shards
    records = await read_as_consumers(
        lambda rank: JsonLines(server.urls, rank=rank, world_size=world_size,
                               shuffle_shards=True, seed=11, even_ranks=False), world_size,
        num_workers)
    seen = [r["id"] for r in records]
    assert sorted(seen) == list(range(100))
    assert len(server.requests) == 5  # each shard fetched exactly once


async def test_loader_over_http(serve: Callable[..., FaultyServer], anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(8, 125), latency=0.01)
    source = JsonLines(server.urls, shuffle_shards=True, seed=0).shuffle(200, seed=0)
    ids: list[int] = []
    async for batch in DataLoader(source, batch_size=64):
        ids.extend(batch["id"].tolist())
    assert sorted(ids) == list(range(1000))


# --------------------------------------------------------------------------- bounds, cleanup


async def test_http_backpressure(serve: Callable[..., FaultyServer], anyio_backend: str) -> None:
    server = serve({f"s{i}.txt": b"".join(b"%08d\n" % j for j in range(20_000))
                    for i in range(6)})
    source = TextLines(server.urls, chunk_size=900, concurrency=2)  # 100 lines per chunk
    iterator = source.__aiter__()
    await iterator.__anext__()
    for _ in range(50):
        await anyio.sleep(0.005)
    # 2 readers x (2 queued + 1 in hand) + the stream's 4 blocks.
    assert source.stats.records <= (3 * 2 + 4) * 100
    assert source.stats.bytes <= (3 * 2 + 4) * 900 + 2 * 900
    await iterator.aclose()  # type: ignore[attr-defined]


async def test_connections_closed_on_break(serve: Callable[..., FaultyServer],
                                           anyio_backend: str) -> None:
    server = serve({f"s{i}.txt": b"line\n" * 200_000 for i in range(6)})
    source = TextLines(server.urls, concurrency=4, chunk_size=4096)
    async for _ in source:
        break
    assert await settle(lambda: server.open_connections == 0)

    iterator = source.__aiter__()
    await iterator.__anext__()
    await iterator.aclose()  # type: ignore[attr-defined]
    assert await settle(lambda: server.open_connections == 0)

    loader = DataLoader(source, batch_size=100)
    async for _ in loader:
        break
    await loader.aclose()
    assert await settle(lambda: server.open_connections == 0)


async def test_connections_closed_after_error(serve: Callable[..., FaultyServer],
                                              anyio_backend: str) -> None:
    server = serve({"a.txt": b"x\n" * 100_000, "b.txt": b"ok\n\xff\n"})
    with pytest.raises(RecordError):
        await collect(TextLines([server.url("b.txt"), server.url("a.txt")], concurrency=2))
    assert await settle(lambda: server.open_connections == 0)
