"""A trio program: a DataLoader over an async dataset, a stream of local shards, and a
Batcher serving concurrent callers, all on trio's event loop.

    python examples/trio_app.py --items 2000 --latency-ms 5

Part 1 loads an async dataset whose items each wait ``--latency-ms`` (a remote read with
``trio.sleep``) through ``async for``, with a heartbeat task in the same nursery showing that
the event loop stays responsive, and compares with fetching the items one after another.
Part 2 streams JSON Lines shards it writes to a temporary directory, shuffled and mapped.
Part 3 answers concurrent requests through a ``Batcher``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import trio

import aloader


class Remote(aloader.Dataset[npt.NDArray[np.float32]]):
    """``n`` items behind a network wait of ``latency`` seconds each."""

    def __init__(self, n: int, latency: float) -> None:
        self.n = n
        self.latency = latency

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> npt.NDArray[np.float32]:
        await trio.sleep(self.latency)
        return np.full(4, index, dtype=np.float32)


async def load(items: int, latency: float) -> None:
    dataset = Remote(items, latency)
    loader = aloader.DataLoader(dataset, batch_size=64, shuffle=True, generator=0,
                                max_concurrency=256)
    beats = 0

    async def heartbeat() -> None:
        nonlocal beats
        while True:
            await trio.sleep(0.01)
            beats += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat)
        started = trio.current_time()
        seen: list[int] = []
        async with loader:
            async for batch in loader:
                seen.extend(int(v) for v in batch[:, 0])
        elapsed = trio.current_time() - started
        nursery.cancel_scope.cancel()
    assert sorted(seen) == list(range(items)), "every item exactly once"
    sequential = items * latency
    print(f"part 1: {items} items in {elapsed:.2f} s ({items / elapsed:,.0f} items/s), "
          f"every item once; one after another: ~{sequential:.1f} s; "
          f"heartbeats meanwhile: {beats}")
    print(f"  {loader.stats().bottleneck}")


async def stream(directory: Path) -> None:
    for shard in range(4):
        lines = (json.dumps({"id": i, "text": f"line {i}"}) for i in range(shard * 50,
                                                                         shard * 50 + 50))
        (directory / f"part-{shard}.jsonl").write_text("\n".join(lines) + "\n")
    source = aloader.JsonLines(str(directory / "*.jsonl"), shuffle_shards=True, seed=0)
    words = source.shuffle(100, seed=0).map(lambda record: len(record["text"].split()))
    total = 0
    async for batch in aloader.DataLoader(words, batch_size=32):
        total += int(batch.sum())
    print(f"part 2: {source.stats.records} records from {source.stats.shards} shards, "
          f"{total} words")


async def serve(requests: int) -> None:
    def model(xs: list[float]) -> list[float]:
        return [2 * x for x in xs]  # a plain function: it runs in a worker thread

    answers: dict[int, float] = {}
    async with aloader.Batcher(model, max_batch_size=32, max_wait=0.002) as double:

        async def caller(i: int) -> None:
            answers[i] = await double(float(i))

        async with trio.open_nursery() as nursery:
            for i in range(requests):
                nursery.start_soon(caller, i)
        metrics = double.metrics()
    assert answers == {i: 2.0 * i for i in range(requests)}
    print(f"part 3: {requests} concurrent requests answered in {metrics['batches']} batches "
          f"(sizes {dict(sorted(metrics['batch_size_histogram'].items()))})")


async def main_async(items: int, latency: float) -> None:
    await load(items, latency)
    with tempfile.TemporaryDirectory() as directory:
        await stream(Path(directory))
    await serve(200)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--latency-ms", type=float, default=5.0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    trio.run(main_async, args.items, args.latency_ms / 1000)
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
