"""Part 2 of ``python -m aloader demo`` (and ``demo-http``): shards streamed over HTTP.

Owns the HTTP streaming demo: it starts a :class:`~aloader._demo._server.ShardServer` serving
generated JSON Lines shards with a simulated latency per request, then streams them through
``JsonLines(urls, shuffle_shards=True)``, a shuffle buffer and the DataLoader, with a live
progress line, and checks that every record arrived exactly once in every epoch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from textwrap import indent
from typing import Any, TextIO

import anyio

from .. import DataLoader, JsonLines
from ._progress import Progress
from ._server import ShardServer, make_jsonl_shards

__all__ = ("main", "stream")


async def stream(args: argparse.Namespace, shards: str | Sequence[str], out: TextIO,
                 **options: Any) -> int:
    """Stream ``JsonLines(shards, **options)`` through a shuffle buffer and the DataLoader for
    ``args.epochs`` epochs, checking that each of the ``args.shards * args.records`` records
    (ids 0, 1, ...) arrives exactly once per epoch; ends with the loader's stage table.

    Returns 0, or 1 (after saying so) when a record was missing or repeated. Shared by the HTTP
    and S3 parts, so that both check and report the same way.
    """
    source = JsonLines(shards, shuffle_shards=True, seed=args.seed,
                       concurrency=args.concurrency, **options).shuffle(args.buffer,
                                                                         seed=args.seed)
    loader: DataLoader[Any] = DataLoader(source, batch_size=args.batch_size)
    total = args.shards * args.records
    first_ids: list[int] = []
    for epoch in range(args.epochs):
        progress = Progress(out, total, label=f"epoch {epoch + 1}/{args.epochs}")
        seen = bytearray(total)
        items = batches = 0
        async for batch in loader:
            ids = batch["id"]
            for ident in ids.tolist():
                seen[ident] += 1
            if epoch == 0 and len(first_ids) < 8:
                first_ids.extend(ids[: 8 - len(first_ids)].tolist())
            items += len(ids)
            batches += 1
            progress.update(batches, items)
        elapsed = progress.finish(batches, items)
        if items != total or seen.count(1) != total:
            out.write(f"  ERROR: expected each of {total:,} records exactly once, got {items:,} "
                      f"items, {seen.count(0):,} missing\n")
            return 1
        out.write(f"  every record exactly once; {elapsed:.2f} s\n")
    out.write(f"  first ids of epoch 1 (shuffled): {first_ids}\n")
    out.write(f"  where the loader's time went in the last epoch (DataLoader.stats()):\n"
              f"{indent(loader.stats().table(), '    ')}\n")
    return 0


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """Run the HTTP streaming demo; returns the exit status.

    Args:
        argv: command-line arguments (``--help`` lists them); None reads ``sys.argv``.
        out: where to print (default: standard output).
    """
    parser = argparse.ArgumentParser(
        prog="python -m aloader demo-http",
        description="Stream generated JSON Lines shards from a local HTTP server through a "
                    "sharded, shuffled source and the DataLoader.",
    )
    parser.add_argument("--shards", type=int, default=128, help="number of shards")
    parser.add_argument("--records", type=int, default=2000, help="records per shard")
    parser.add_argument("--latency", type=float, default=0.02,
                        help="seconds the server waits before each response")
    parser.add_argument("--concurrency", type=int, default=8, help="shards read at once")
    parser.add_argument("--buffer", type=int, default=8192, help="shuffle buffer size")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = out or sys.stdout

    files = make_jsonl_shards(args.shards, args.records)
    with ShardServer(files, latency=args.latency) as server:
        size = sum(len(body) for body in files.values())
        out.write(f"aloader HTTP streaming demo: {args.shards} JSON Lines shards x "
                  f"{args.records:,} records ({size / 1e6:.1f} MB) served by "
                  f"http://127.0.0.1:{server.port}/ with {args.latency * 1e3:.0f} ms latency "
                  "per request\n")
        out.write(f"  JsonLines(urls, shuffle_shards=True, concurrency={args.concurrency})"
                  f".shuffle({args.buffer}) -> DataLoader(batch_size={args.batch_size})\n")
        status = anyio.run(stream, args, server.urls, out)
        out.write(f"  {len(server.requests)} requests served, "
                  f"{server.max_open_connections} connections at most\n")
    return status
