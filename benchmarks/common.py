"""What the source benchmarks share: their shard workload, the timing loop, the server process
and the aloader epoch they measure.

``bench_sources.py`` and ``bench_objstore.py`` measure the same workload (:data:`SHARDS`
shards of :data:`RECORDS` JSON Lines records, :data:`LATENCY` seconds per request, read
with :data:`CONCURRENCY` requests in flight in batches of :data:`BATCH`). Imported by the
scripts as ``common`` (a script run as ``python benchmarks/bench_x.py`` has ``benchmarks/`` on
its path); the spawned server process imports it the same way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import anyio

from aloader import DataLoader, JsonLines
from aloader._demo import ShardServer, make_jsonl_shards

__all__ = (
    "BATCH",
    "CONCURRENCY",
    "LATENCY",
    "RECORDS",
    "RUNS",
    "SHARDS",
    "TOTAL",
    "best",
    "count_torch",
    "run_aloader",
    "serve_shards",
)

SHARDS = 64
RECORDS = 1000
LATENCY = float(os.environ.get("BENCH_LATENCY", "0.02"))
CONCURRENCY = 16
BATCH = 256
TOTAL = SHARDS * RECORDS
# Each figure is the best of this many runs.
RUNS = 3


def best(fn: Callable[[], int], runs: int = RUNS) -> tuple[float, int]:
    """(best seconds, items) over ``runs`` calls of ``fn`` (which returns the items seen)."""
    times = []
    items = 0
    for _ in range(runs):
        start = time.perf_counter()
        items = fn()
        times.append(time.perf_counter() - start)
    return min(times), items


def serve_shards(port_queue: Any, stop: Any) -> None:
    """Server process: serve the workload's shards (the demo's :class:`ShardServer`, with its
    latency per request), put its port on ``port_queue``, and serve until ``stop`` is set."""
    server = ShardServer(make_jsonl_shards(SHARDS, RECORDS), latency=LATENCY).start()
    port_queue.put(server.port)
    stop.wait()
    server.close()


def run_aloader(urls: list[str], backend: str = "asyncio") -> int:
    """One epoch of ``DataLoader(JsonLines(urls, concurrency=CONCURRENCY), batch_size=BATCH)``
    on ``backend`` (URLs, or local paths and directories); the records seen."""

    async def epoch() -> int:
        count = 0
        async for batch in DataLoader(JsonLines(urls, concurrency=CONCURRENCY),
                                      batch_size=BATCH):
            count += len(batch["id"])
        return count

    return anyio.run(epoch, backend=backend)


def count_torch(loader: Any) -> int:
    """One epoch of a torch DataLoader of the workload's records; the records seen."""
    count = 0
    for batch in loader:
        count += len(batch["id"])
    return count
