"""Stream JSON Lines shards from S3 (or any object store URL) through the local shard cache.

The first epoch streams the shards from the store while writing them into ``--cache-dir``;
the later epochs read the local copies without any request. Credentials and the endpoint
come from the usual environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``; ``AWS_ENDPOINT_URL`` and ``AWS_ALLOW_HTTP=true`` for MinIO or a local S3)::

    python examples/s3_cache_stream.py "s3://my-bucket/train/*.jsonl" --cache-dir /tmp/shards

Each epoch prints the records and batches it read, how long it took, and the cache's
counters.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

import aloader


async def run(url: str, cache_dir: str, epochs: int, batch_size: int) -> None:
    source = aloader.JsonLines(url, shuffle_shards=True, seed=0, concurrency=8,
                               cache_dir=cache_dir, cache_limit=50 * 2**30)
    print(f"{len(source.shards)} shards under {url}")
    loader = aloader.DataLoader(source.shuffle(4096, seed=0), batch_size=batch_size,
                                collate_fn=list)
    async with loader:
        for epoch in range(epochs):
            started = time.perf_counter()
            records = batches = 0
            async for batch in loader:
                records += len(batch)
                batches += 1
            stats = source.stats  # cumulative over the epochs
            print(f"epoch {epoch}: {records} records in {batches} batches, "
                  f"{time.perf_counter() - started:.2f} s; cache misses {stats.cache_misses}, "
                  f"hits {stats.cache_hits}, {stats.cache_bytes} bytes read from the cache")
    print(f"last epoch: {loader.stats().bottleneck}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="shards: an object URL, a prefix ending in / or a pattern")
    parser.add_argument("--cache-dir", required=True, help="where the shards are kept")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)
    asyncio.run(run(args.url, args.cache_dir, args.epochs, args.batch_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
