"""HTTP sources against a real HTTP server on 127.0.0.1: counts, sharding, retries, resumption,
error messages, backpressure and connection cleanup."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable

import anyio
import numpy as np
import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import as_worker, collect, free_port

from aloader import DataLoader, FetchError, JsonLines, NpyRows, RecordError, TextLines

pytestmark = pytest.mark.anyio

FAST = {"backoff": 0.01, "max_backoff": 0.05, "timeout": 10.0}



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


async def test_url_sharding_exactly_once(serve: Callable[..., FaultyServer],
                                         anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(5, 20))
    seen: list[int] = []
    world_size, num_workers = 2, 4  # 8 consumers, 5 shards
    for rank in range(world_size):
        for worker in range(num_workers):
            source = JsonLines(server.urls, rank=rank, world_size=world_size,
                               shuffle_shards=True, seed=11)
            with as_worker(worker, num_workers, dataset=source, seed=0):
                seen.extend(r["id"] for r in await collect(source))
    assert sorted(seen) == list(range(100))
    assert len(server.requests) == 5  # each shard fetched exactly once


async def test_loader_over_http(serve: Callable[..., FaultyServer], anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(8, 125), latency=0.01)
    source = JsonLines(server.urls, shuffle_shards=True, seed=0).shuffle(200, seed=0)
    ids: list[int] = []
    async for batch in DataLoader(source, batch_size=64):
        ids.extend(batch["id"].tolist())
    assert sorted(ids) == list(range(1000))


# --------------------------------------------------------------------------- failures


async def test_404_fails_at_once(serve: Callable[..., FaultyServer], anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(1, 10))
    url = server.url("missing.jsonl")
    with pytest.raises(FetchError) as info:
        await collect(JsonLines([server.urls[0], url], retries=5, **FAST))
    assert info.value.status_code == 404
    assert info.value.source == url
    assert f"{url}: HTTP 404 Not Found (not retried)" in str(info.value)
    assert [name for name, _ in server.requests].count("missing.jsonl") == 1


async def test_transient_503_retried(serve: Callable[..., FaultyServer],
                                     anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(2, 50))
    name = sorted(server.files)[1]
    server.fail(name, 503, times=2)
    source = JsonLines(server.urls, retries=3, **FAST)
    assert [r["id"] for r in await collect(source)] == list(range(100))
    assert [n for n, _ in server.requests].count(name) == 3
    assert source.stats.retries == 2


async def test_503_until_retries_run_out(serve: Callable[..., FaultyServer],
                                         anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(1, 5))
    name = next(iter(server.files))
    server.fail(name, 503, times=10)
    with pytest.raises(FetchError, match=r"giving up after 3 failed attempts; last error: "
                                         r"HTTP 503 Service Unavailable") as info:
        await collect(JsonLines(server.urls, retries=2, **FAST))
    assert info.value.status_code == 503
    assert len(server.requests) == 3


async def test_connection_refused(anyio_backend: str) -> None:
    url = f"http://127.0.0.1:{free_port()}/shard.jsonl"
    with pytest.raises(FetchError, match="giving up after 3 failed attempts; last error: "
                                         "ConnectError") as info:
        await collect(JsonLines(url, retries=2, **FAST))
    assert info.value.source == url and info.value.status_code is None
    assert isinstance(info.value, OSError)


async def test_timeout(serve: Callable[..., FaultyServer], anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(1, 5))
    name = next(iter(server.files))
    server.stall(name, 2.5, times=2)
    # Two stalled attempts time out; the third answers.
    source = JsonLines(server.urls, retries=2, backoff=0.01, timeout=0.5)
    assert len(await collect(source)) == 5
    assert source.stats.retries == 2
    server.stall(name, 2.5, times=2)
    with pytest.raises(FetchError, match="last error: ReadTimeout"):
        await collect(JsonLines(server.urls, retries=1, backoff=0.01, timeout=0.5))


@pytest.mark.parametrize("ranges", [True, False])
async def test_resume_after_cut(serve: Callable[..., FaultyServer], anyio_backend: str,
                                ranges: bool) -> None:
    files = make_jsonl_shards(1, 400)
    server = serve(files, ranges=ranges)
    name = next(iter(files))
    cut = len(files[name]) // 3 + 7  # in the middle of a line
    server.cut(name, cut, times=2)
    source = JsonLines(server.urls, chunk_size=1000, **FAST)
    records = await collect(source)
    assert [r["id"] for r in records] == list(range(400))
    # The second attempt asked for the rest only; the third for what was still missing.
    assert server.requests[0] == (name, None)
    assert server.requests[1] == (name, f"bytes={cut}-")
    assert server.requests[2][1] is not None and source.stats.retries == 2
    assert source.stats.bytes == len(files[name])


async def test_error_location_after_resume(serve: Callable[..., FaultyServer],
                                           anyio_backend: str) -> None:
    lines = [json.dumps({"i": i}).encode() for i in range(100)]
    lines[80] = b"{oops"
    body = b"\n".join(lines) + b"\n"
    server = serve({"x.jsonl": body})
    server.cut("x.jsonl", 300)
    with pytest.raises(RecordError) as info:
        await collect(JsonLines(server.url("x.jsonl"), chunk_size=64, **FAST))
    offset = sum(len(line) + 1 for line in lines[:80])
    assert info.value.line == 81 and info.value.offset == offset
    assert f"{server.url('x.jsonl')}: line 81 (byte offset {offset}): invalid JSON" in str(
        info.value)


async def test_changed_resource_detected(serve: Callable[..., FaultyServer],
                                         anyio_backend: str) -> None:
    server = serve({"c.txt": b"a\n" * 1000})
    server.cut("c.txt", 100)
    server.replace("c.txt", b"b\n" * 1000)  # a new version (new ETag) for the retry
    with pytest.raises(FetchError, match=r"c\.txt: the resource changed on the server while "
                                         r"it was being read .* at byte offset 100"):
        await collect(TextLines(server.url("c.txt"), **FAST))


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
