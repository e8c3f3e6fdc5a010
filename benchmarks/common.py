"""Helpers the source benchmarks share: the timing loop and the shard server's process.

Imported by the scripts as ``common`` (a script run as ``python benchmarks/bench_x.py`` has
``benchmarks/`` on its path); the spawned server process imports it the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aloader._demo import ShardServer, make_jsonl_shards

__all__ = ("RUNS", "best", "serve_shards")

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


def serve_shards(port_queue: Any, stop: Any, shards: int, records: int, latency: float) -> None:
    """Server process: serve ``shards`` JSON Lines shards of ``records`` records each (the demo's
    :class:`ShardServer`, ``latency`` seconds per request), put its port on ``port_queue``, and
    serve until ``stop`` is set."""
    server = ShardServer(make_jsonl_shards(shards, records), latency=latency).start()
    port_queue.put(server.port)
    stop.wait()
    server.close()
