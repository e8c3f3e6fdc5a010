"""Part 1 of ``python -m aloader demo``: an async dataset with latency, vs sequential awaits.

Owns :class:`RemoteDataset` (items behind a simulated network latency) and :func:`run`, which
streams it through the DataLoader with a live progress line, then times the same fetches one
after another and prints the speed-up and whether every item arrived exactly once.
"""

from __future__ import annotations

import argparse
import sys
import time
from textwrap import indent
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from .. import DataLoader, Dataset
from ._progress import Progress

__all__ = ("RemoteDataset", "run")

# Items timed one after another to estimate the sequential rate (the demo stays short).
SEQUENTIAL_SAMPLE = 100


class RemoteDataset(Dataset[npt.NDArray[np.float32]]):
    """Items behind a simulated network: each fetch waits its own latency, then returns.

    Latencies are drawn once, uniformly in ``latency * (1 +- jitter)``, so every run (and the
    sequential comparison) sees the same delays.

    Args:
        n: number of items.
        latency: mean wait per fetch, in seconds.
        jitter: relative spread of the wait (0.5: from half to one and a half times latency).
        seed: seed of the latencies.
    """

    def __init__(self, n: int, latency: float, jitter: float = 0.5, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.latencies = latency * (1 + jitter * rng.uniform(-1, 1, size=n))

    def __len__(self) -> int:
        return len(self.latencies)

    async def __getitem__(self, index: int) -> npt.NDArray[np.float32]:
        """Wait the item's latency, then return its payload (16 float32s holding the index)."""
        await anyio.sleep(float(self.latencies[index]))
        return np.full(16, index, dtype=np.float32)


async def run(args: argparse.Namespace) -> int:
    """Stream ``RemoteDataset(args.items, ...)`` through the DataLoader, then time sequential
    awaits; returns the exit status (1 if an item was not delivered exactly once).

    Args:
        args: the ``demo`` command's options (``items``, ``latency_ms``, ``batch_size``,
            ``concurrency``).
    """
    out = sys.stdout
    latency = args.latency_ms / 1e3
    dataset = RemoteDataset(args.items, latency)
    loader: DataLoader[Any] = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, generator=0,
        max_concurrency=args.concurrency,
    )
    batches_total = len(loader)
    out.write(
        f"Streaming {args.items:,} items from a simulated remote store "
        f"(each fetch waits {args.latency_ms:g} ms +- 50%)\n"
        f"through aloader.DataLoader(batch_size={args.batch_size}, shuffle=True, "
        f"max_concurrency={args.concurrency}):\n"
    )
    progress = Progress(out, args.items, batches_total)
    seen = np.zeros(args.items, dtype=np.int64)
    batches = items = 0
    async for batch in loader:
        seen[batch[:, 0].astype(np.int64)] += 1
        batches += 1
        items += len(batch)
        progress.update(batches, items)
    elapsed = progress.finish(batches, items)
    stats = loader.stats()
    rate = items / elapsed
    exactly_once = bool(np.all(seen == 1))

    sample = min(SEQUENTIAL_SAMPLE, args.items)
    timing = (f"timing {sample} of them and extrapolating" if sample < args.items
              else f"timing all {sample}")
    out.write(f"\nFetching one item after another ({timing}):\n")
    out.flush()
    start = time.perf_counter()
    for index in range(sample):
        await dataset[index]
    sequential_rate = sample / (time.perf_counter() - start)
    sequential_time = args.items / sequential_rate

    how = "measured" if sample == args.items else "estimated"
    ceiling = (
        f"ceiling with {args.concurrency} fetches in flight: "
        f"{args.concurrency / latency:,.0f} items/s" if latency > 0 else "no latency: no ceiling"
    )
    out.write(
        f"  sequential: {sequential_rate:,.0f} items/s, about {sequential_time:.1f} s "
        f"for all {args.items:,} items ({how})\n\n"
        f"aloader:  {items:,} items in {elapsed:.2f} s = {rate:,.0f} items/s ({ceiling})\n"
        f"speed-up: {rate / sequential_rate:.1f}x over sequential awaits\n"
        f"every item delivered exactly once: {'yes' if exactly_once else 'NO'}\n\n"
        f"Where the loader's time went (DataLoader.stats()):\n{indent(stats.table(), '  ')}\n"
    )
    out.flush()
    return 0 if exactly_once else 1
