"""HTTP clients for aloader's HTTP sources, by measurement: httpx, aiohttp, obstore.

Run: ``python benchmarks/bench_http_clients.py`` (needs aiohttp for its rows; the environment
variables ``BENCH_REQUESTS``, ``BENCH_RANGE``, ``BENCH_LATENCY`` and ``BENCH_CONCURRENCY``
(e.g. ``8,64``) change the workload). Everything below is measured in the same run, the clients
interleaved, best of 3.

The server is the one the tests and the other benchmarks use (``aloader._demo.ShardServer``,
a threaded HTTP/1.1 server in a separate process on 127.0.0.1) serving one 16 MiB file. Each
client makes ``REQUESTS`` GETs of ``RANGE`` bytes at random offsets (``Range: bytes=a-b``),
keeping 8, 64 or 256 in flight (a sliding window: each task takes the next request when its
last one is done), and reads every body to its end:

* httpx pool: one ``httpx.AsyncClient`` with ``max_connections`` and
  ``max_keepalive_connections`` set to the concurrency (a user's client with sane limits).
* httpx default: one ``httpx.AsyncClient()`` with httpx's default limits (100 connections, 20
  kept alive): what a map-style dataset doing its own requests usually has.
* httpx per slot: one single-connection client per task (how aloader's sources used it: no
  pool has to scan the others).
* aiohttp: one ``aiohttp.ClientSession`` with a ``TCPConnector(limit=concurrency)``.
* obstore: ``obstore.store.HTTPStore`` and ``obstore.get_range_async`` (Rust, reqwest).

Columns: requests/s and MB/s (wall clock), and the client's CPU time per request
(``time.process_time`` of the client process, all its threads, obstore's Rust ones
included): the figure that decides on a busy machine, where the server shares the cores.
On trio the rows are httpx (per slot) and obstore's blocking API in threads.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

REQUESTS = int(os.environ.get("BENCH_REQUESTS", "1000"))
RANGE = int(os.environ.get("BENCH_RANGE", str(64 << 10)))
SIZE = 16 << 20
LATENCY = float(os.environ.get("BENCH_LATENCY", "0"))
CONCURRENCIES = tuple(int(c) for c in os.environ.get("BENCH_CONCURRENCY", "8,64,256").split(","))
RUNS = 3
NAME = "blob.bin"


def _serve(port_queue: Any, stop: Any) -> None:
    from aloader._demo import ShardServer

    body = random.Random(0).randbytes(SIZE)
    server = ShardServer({NAME: body}, latency=LATENCY).start()
    port_queue.put(server.port)
    stop.wait()
    server.close()


def _ranges(n: int) -> list[tuple[int, int]]:
    rng = random.Random(1)
    return [(start, start + RANGE) for start in
            (rng.randrange(0, SIZE - RANGE) for _ in range(n))]


async def _window(concurrency: int, ranges: list[tuple[int, int]],
                  fetch: Callable[[int, int, int], Awaitable[int]]) -> int:
    """Run ``fetch(slot, start, end)`` for every range, ``concurrency`` at a time."""
    queue = iter(ranges)
    total = 0

    async def task(slot: int) -> None:
        nonlocal total
        for start, end in queue:
            n = await fetch(slot, start, end)
            total += n

    async with anyio.create_task_group() as tg:
        for slot in range(concurrency):
            tg.start_soon(task, slot)
    return total


def _ssl() -> Any:
    """One TLS context for every httpx client (as aloader keeps one per process): httpx
    loads the CA bundle again for each client made without one, ~10-100 ms each."""
    from aloader.io._http import _ssl_context

    return _ssl_context()


Runner = Callable[[str, int, list[tuple[int, int]]], Awaitable[int]]


async def _httpx_one_client(client: Any, url: str, concurrency: int,
                            ranges: list[tuple[int, int]]) -> int:
    """The ranges through one httpx client (its pool shared by every request in flight)."""
    async with client:
        async def fetch(slot: int, start: int, end: int) -> int:
            n = 0
            async with client.stream("GET", url,
                                     headers={"Range": f"bytes={start}-{end - 1}"}) as r:
                async for piece in r.aiter_raw():
                    n += len(piece)
            return n

        return await _window(concurrency, ranges, fetch)


async def httpx_pool(url: str, concurrency: int, ranges: list[tuple[int, int]]) -> int:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return await _httpx_one_client(httpx.AsyncClient(limits=limits, timeout=60, verify=_ssl()),
                                   url, concurrency, ranges)


async def httpx_default(url: str, concurrency: int, ranges: list[tuple[int, int]]) -> int:
    import httpx

    return await _httpx_one_client(httpx.AsyncClient(timeout=60, verify=_ssl()), url,
                                   concurrency, ranges)


async def httpx_slots(url: str, concurrency: int, ranges: list[tuple[int, int]]) -> int:
    import httpx

    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [httpx.AsyncClient(limits=limits, timeout=60, verify=_ssl())
               for _ in range(concurrency)]
    try:
        async def fetch(slot: int, start: int, end: int) -> int:
            n = 0
            async with clients[slot].stream(
                    "GET", url, headers={"Range": f"bytes={start}-{end - 1}"}) as r:
                async for piece in r.aiter_raw():
                    n += len(piece)
            return n

        return await _window(concurrency, ranges, fetch)
    finally:
        for client in clients:
            await client.aclose()


async def aiohttp_session(url: str, concurrency: int, ranges: list[tuple[int, int]]) -> int:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        async def fetch(slot: int, start: int, end: int) -> int:
            n = 0
            async with session.get(url, headers={"Range": f"bytes={start}-{end - 1}"}) as r:
                async for piece in r.content.iter_any():
                    n += len(piece)
            return n

        return await _window(concurrency, ranges, fetch)


def _store(url: str) -> Any:
    from obstore.store import HTTPStore

    base, _, _ = url.rpartition("/")
    return HTTPStore.from_url(base + "/", client_options={"allow_http": True,
                                                           "pool_max_idle_per_host": "1024"})


async def obstore_async(url: str, concurrency: int, ranges: list[tuple[int, int]]) -> int:
    import obstore

    store = _store(url)

    async def fetch(slot: int, start: int, end: int) -> int:
        return len(await obstore.get_range_async(store, NAME, start=start, end=end))

    return await _window(concurrency, ranges, fetch)


async def obstore_threads(url: str, concurrency: int, ranges: list[tuple[int, int]]) -> int:
    import obstore

    store = _store(url)
    limiter = anyio.CapacityLimiter(concurrency)

    async def fetch(slot: int, start: int, end: int) -> int:
        body = await anyio.to_thread.run_sync(
            lambda: obstore.get_range(store, NAME, start=start, end=end), limiter=limiter)
        return len(body)

    return await _window(concurrency, ranges, fetch)


def _measure(runner: Runner, url: str, concurrency: int, backend: str) -> tuple[float, float]:
    """(wall seconds, client CPU seconds) of one run of REQUESTS requests."""
    ranges = _ranges(REQUESTS)
    wall, cpu = time.perf_counter(), time.process_time()
    total = anyio.run(runner, url, concurrency, ranges, backend=backend)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert total == REQUESTS * RANGE, (runner.__name__, total)
    return wall, cpu


def main() -> None:
    """Measure and print the table."""
    context = multiprocessing.get_context("spawn")
    port_queue = context.Queue()
    stop = context.Event()
    process = context.Process(target=_serve, args=(port_queue, stop), daemon=True)
    process.start()
    url = f"http://127.0.0.1:{port_queue.get(timeout=60)}/{NAME}"
    rows: list[tuple[str, Runner, str]] = [
        ("httpx, one pool (limits = concurrency)", httpx_pool, "asyncio"),
        ("httpx, one pool (default limits)", httpx_default, "asyncio"),
        ("httpx, one client per slot", httpx_slots, "asyncio"),
    ]
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("aiohttp is not installed: its rows are skipped", file=sys.stderr)
    else:
        rows.append(("aiohttp, one session", aiohttp_session, "asyncio"))
    rows += [
        ("obstore HTTPStore, get_range_async", obstore_async, "asyncio"),
        ("trio: httpx, one client per slot", httpx_slots, "trio"),
        ("trio: obstore HTTPStore, get_range in threads", obstore_threads, "trio"),
    ]
    try:
        print(f"{REQUESTS:,} GETs of {RANGE >> 10} KiB ranges of a {SIZE >> 20} MiB file, "
              f"{LATENCY * 1e3:.0f} ms server latency, best of {RUNS} (interleaved)")
        print(f"{'client':46} {'in flight':>9} {'req/s':>8} {'MB/s':>7} {'CPU us/req':>10}")
        for concurrency in CONCURRENCIES:
            for _, runner, backend in rows:  # warm-up: imports, thread pools
                _measure(runner, url, concurrency, backend)
            results: dict[str, list[tuple[float, float]]] = {label: [] for label, *_ in rows}
            for _ in range(RUNS):
                for label, runner, backend in rows:
                    results[label].append(_measure(runner, url, concurrency, backend))
            for label, *_ in rows:
                wall = min(w for w, _ in results[label])
                cpu = min(c for _, c in results[label])
                print(f"{label:46} {concurrency:>9} {REQUESTS / wall:>8,.0f} "
                      f"{REQUESTS * RANGE / wall / 1e6:>7,.0f} {cpu / REQUESTS * 1e6:>10,.0f}")
            print()
    finally:
        stop.set()
        process.join(timeout=10)


if __name__ == "__main__":
    main()
