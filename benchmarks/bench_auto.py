"""Fetching that tunes itself, against a local server that models an object store
(``store_model.py``, in a process of its own on 127.0.0.1). Every ratio is of figures measured
in the same run.

* knee: each request takes ``SERVICE`` seconds, ``PARALLEL`` served at once, the rest queue.
  An async dataset GETs one object per item (aiohttp); the DataLoader runs it with each fixed
  ``max_concurrency`` of a sweep (16 ... 1024, 64 being the default) and with ``"auto"``, each
  for ``KNEE_SECONDS``, its rate measured after ``WARMUP`` seconds (the same for all).
  Targets: "auto" >= 0.9x the best of the sweep, and >= 2x the default.
* rate limit: the same server refusing more than ``RATE`` requests per second (a token
  bucket ``BURST`` deep) with ``429`` and ``Retry-After: 1``; the dataset raises
  ``aloader.Throttled``. "auto" over ``RATE_ITEMS`` items (a whole run, start-up included):
  target >= 0.9x ``RATE``, no failure; a fixed 1024 shows the throttled count.
* heavy tail: 1% of requests answer 50x late (``TAIL_SERVICE`` x 50). ``JsonLines`` reads
  ``TAIL_SHARDS`` small shards (one request each) at ``concurrency=16``, batches of 32 records
  (4 shards), with ``hedge=None`` and ``hedge="auto"``: target p99 of the time per in-order
  batch at least halved, for at most 5% extra requests.

Run: ``python benchmarks/bench_auto.py [knee] [rate] [tail]`` (all three by default; about
three minutes). The machine's load is printed first: other processes move the absolute
rates, the same-run ratios less.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import numpy as np
import store_model  # the script's folder is sys.path[0]

from aloader import DataLoader, JsonLines, Throttled

SERVICE = 0.25  # seconds per request at the knee's store
PARALLEL = 200  # requests it serves at once
SWEEP = (16, 32, 64, 128, 256, 512, 1024)
DEFAULT = 64  # max_concurrency's default for async datasets
KNEE_SECONDS = 10.0
WARMUP = 4.0
RATE = 400.0  # requests per second the rate-limited store lets through
BURST = 100.0
RATE_ITEMS = 16_000
HIGH = 1024
TAIL_SERVICE = 0.01
TAIL_SHARDS = 2_000
BATCH = 32


@contextmanager
def serving(model: store_model.Model) -> Iterator[int]:
    """A store process for ``model``; yields its port."""
    context = multiprocessing.get_context("spawn")
    ports: Any = context.Queue()
    stop = context.Event()
    process = context.Process(target=store_model.serve, args=(model, ports, stop),
                              daemon=True)
    process.start()
    try:
        yield int(ports.get(timeout=30))
    finally:
        stop.set()
        process.join(10)


async def server_stats(port: int) -> dict[str, int]:
    """The store's counters since the last call (served, throttled, slow)."""
    async with aiohttp.ClientSession() as session, \
            session.get(f"http://127.0.0.1:{port}/_stats") as response:
        return dict(await response.json(content_type=None))


class Objects:
    """An async map-style dataset: item ``i`` is a GET of object ``i`` of the store; a 429 is
    :class:`aloader.Throttled` with the store's ``Retry-After``."""

    def __init__(self, port: int, n: int, objects: int) -> None:
        self.base = f"http://127.0.0.1:{port}/"
        self.n, self.objects = n, objects
        self.session: aiohttp.ClientSession | None = None

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False))
        async with self.session.get(f"{self.base}{index % self.objects}") as response:
            if response.status == 429:
                raise Throttled(float(response.headers.get("Retry-After", "1")))
            return len(await response.read())

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


async def _timed_run(port: int, concurrency: int | str, seconds: float) -> dict[str, Any]:
    """One loader over ``Objects`` for ``seconds``: items/s after WARMUP, and in all."""
    dataset = Objects(port, 10**7, 1000)
    loader = DataLoader(dataset, batch_size=BATCH, max_concurrency=concurrency, collate_fn=len)
    start = time.perf_counter()
    count = warm = 0
    warm_at = None
    try:
        async for size in loader:
            count += size
            now = time.perf_counter() - start
            if warm_at is None and now >= WARMUP:
                warm_at, warm = now, count
            if now >= seconds:
                break
    finally:
        await loader.aclose()
        await dataset.close()
    elapsed = time.perf_counter() - start
    stats = loader.stats()
    assert warm_at is not None
    return {"steady": (count - warm) / (elapsed - warm_at), "all": count / elapsed,
            "limit": stats.in_flight_limit, "concurrency": stats.concurrency}


async def knee() -> list[str]:
    model = store_model.Model(service=SERVICE, parallel=PARALLEL, objects=1000)
    lines = [f"knee: {SERVICE * 1e3:.0f} ms per request, {PARALLEL} served at once (the "
             f"store's best: {PARALLEL / SERVICE:.0f} items/s); each run {KNEE_SECONDS:.0f} s, "
             f"rate after {WARMUP:.0f} s"]
    with serving(model) as port:
        rates: dict[Any, dict[str, Any]] = {}
        for concurrency in (*SWEEP, "auto"):
            rates[concurrency] = result = await _timed_run(port, concurrency, KNEE_SECONDS)
            lines.append(f"  max_concurrency={concurrency!s:>5}: {result['steady']:7.0f} "
                         f"items/s steady, {result['all']:7.0f} over the run"
                         + (f" (limit now {result['limit']})" if concurrency == "auto" else ""))
    best = max(SWEEP, key=lambda c: rates[c]["steady"])
    auto = rates["auto"]
    history = auto["concurrency"]["history"] if auto["concurrency"] else []
    lines.append(f"  auto / best fixed ({best}): {auto['steady'] / rates[best]['steady']:.2f}x "
                 f"(target >= 0.9x); over the whole run "
                 f"{auto['all'] / rates[best]['all']:.2f}x")
    lines.append(f"  auto / default ({DEFAULT}): {auto['steady'] / rates[DEFAULT]['steady']:.2f}x"
                 " (target >= 2x)")
    lines.append(f"  auto's first changes: {history[:8]}")
    return lines


async def _rate_run(port: int, concurrency: int | str, items: int) -> dict[str, Any]:
    dataset = Objects(port, items, 1000)
    loader = DataLoader(dataset, batch_size=BATCH, max_concurrency=concurrency, collate_fn=len)
    await server_stats(port)  # reset the counters
    start = time.perf_counter()
    count = 0
    try:
        async for size in loader:
            count += size
    finally:
        await dataset.close()
    elapsed = time.perf_counter() - start
    stats = loader.stats()
    served = await server_stats(port)
    assert count == items
    return {"rate": count / elapsed, "throttled": stats.throttled, "failures": stats.failures,
            "seconds": elapsed, "server": served, "concurrency": stats.concurrency}


async def rate() -> list[str]:
    model = store_model.Model(service=SERVICE, parallel=PARALLEL, rate=RATE, burst=BURST,
                              objects=1000)
    lines = [f"rate limit: {RATE:.0f} requests/s (bucket {BURST:.0f} deep), 429 with "
             f"Retry-After: 1 above it; {SERVICE * 1e3:.0f} ms per request, {PARALLEL} at once"]
    with serving(model) as port:
        auto = await _rate_run(port, "auto", RATE_ITEMS)
        high = await _rate_run(port, HIGH, RATE_ITEMS // 4)
    ceiling = auto["concurrency"]["ceiling"] if auto["concurrency"] else None
    lines.append(f"  auto: {auto['rate']:.0f} items/s over {auto['seconds']:.1f} s = "
                 f"{auto['rate'] / RATE:.2f}x the rate limit (target >= 0.9x), "
                 f"{auto['failures']} failures, {auto['throttled']} throttled, ceiling "
                 f"{ceiling and round(ceiling)} items/s, limit {auto['concurrency']['limit']}")
    lines.append(f"  auto's changes: {auto['concurrency']['history'][:12]}")
    lines.append(f"  max_concurrency={HIGH}: {high['rate']:.0f} items/s = "
                 f"{high['rate'] / RATE:.2f}x, {high['failures']} failures, "
                 f"{high['throttled']} throttled ({high['server']['throttled']} 429s served for "
                 f"{high['server']['served']} answers)")
    return lines


async def _tail_run(port: int, hedge: Any) -> dict[str, Any]:
    urls = [f"http://127.0.0.1:{port}/{i}.jsonl" for i in range(TAIL_SHARDS)]
    source = JsonLines(urls, concurrency=16, hedge=hedge, timeout=30.0)
    loader = DataLoader(source, batch_size=BATCH, collate_fn=len)
    await server_stats(port)
    gaps: list[float] = []
    count = 0
    last = time.perf_counter()
    start = last
    async for size in loader:
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        count += size
    elapsed = time.perf_counter() - start
    served = await server_stats(port)
    gaps = gaps[1:]  # the first batch waits for the start-up
    return {"p99": float(np.percentile(gaps, 99)), "p50": statistics.median(gaps),
            "count": count, "seconds": elapsed, "hedged": source.stats.hedged,
            "requests": served["served"], "slow": served["slow"]}


async def tail() -> list[str]:
    model = store_model.Model(service=TAIL_SERVICE, parallel=10_000, tail=0.01,
                              tail_factor=50.0, objects=TAIL_SHARDS, records=8)
    lines = [f"heavy tail: {TAIL_SERVICE * 1e3:.0f} ms per request, 1% of them 50x late; "
             f"{TAIL_SHARDS} shards of 8 records, concurrency=16, batches of {BATCH}"]
    with serving(model) as port:
        plain = await _tail_run(port, None)
        hedged = await _tail_run(port, "auto")
    extra = hedged["hedged"] / TAIL_SHARDS
    for name, run in (("hedge=None", plain), ("hedge='auto'", hedged)):
        lines.append(f"  {name}: p99 per batch {run['p99'] * 1e3:.1f} ms (p50 "
                     f"{run['p50'] * 1e3:.1f} ms), {run['count'] / run['seconds']:.0f} "
                     f"records/s, {run['hedged']} hedged, {run['slow']} slow answers")
    lines.append(f"  p99 hedged / plain: {hedged['p99'] / plain['p99']:.2f}x (target <= 0.5x), "
                 f"extra requests {extra:.1%} (target <= 5%)")
    return lines


def main() -> None:
    chosen = sys.argv[1:] or ["knee", "rate", "tail"]
    print(_load(), flush=True)
    for name in chosen:
        lines = asyncio.run({"knee": knee, "rate": rate, "tail": tail}[name]())
        print("\n".join(lines), flush=True)
    print(_load(), flush=True)


if __name__ == "__main__":
    main()
