"""Part 3 of ``python -m aloader demo``: shards streamed from ``s3://``, served the same way.

Owns the S3 streaming demo: it starts a :class:`~aloader._demo._s3.LocalS3` (moto's S3 server
behind a proxy adding a latency per request) on 127.0.0.1, uploads generated JSON Lines
shards to a bucket, then streams ``JsonLines("s3://demo/*.jsonl", shuffle_shards=True)``
through the same loop as the HTTP part (:func:`aloader._demo._streaming.stream`: progress,
every record exactly once, the stage table). moto and boto3 are test extras: without them the
part says it was skipped and why, and succeeds.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from functools import partial
from typing import Any, TextIO

import anyio

from ._server import make_jsonl_shards
from ._streaming import stream

__all__ = ("main",)

BUCKET = "demo"

# Small enough to upload and stream in a few seconds, with enough shards that the
# concurrency shows against the latency.
_ARGS = argparse.Namespace(shards=32, records=1000, latency=0.02, concurrency=8, buffer=4096,
                           batch_size=256, epochs=1, seed=0)


def _missing() -> str | None:
    """The first package the part needs and cannot import, or None."""
    for name in ("moto.server", "boto3", "obstore"):
        try:
            importlib.import_module(name)
        except ImportError:
            return name.partition(".")[0]
    return None


def _empty(s3: Any) -> None:
    """Delete the objects of the demo's bucket, if any: moto keeps its buckets per process,
    not per server, so an earlier run in this process (a test) would leave its shards there."""
    client = s3.client()
    with contextlib.suppress(client.exceptions.NoSuchBucket):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
            for item in page.get("Contents", ()):
                client.delete_object(Bucket=BUCKET, Key=item["Key"])


def main(out: TextIO | None = None, args: argparse.Namespace | None = None) -> int:
    """Run the S3 streaming demo; returns the exit status (0 when skipped).

    Args:
        out: where to print (default: standard output).
        args: the sizes (the fields of ``_ARGS``); None: the defaults.
    """
    out = out or sys.stdout
    args = args or _ARGS
    missing = _missing()
    if missing is not None:
        out.write(f"aloader S3 streaming demo: skipped, {missing} is not installed (it runs "
                  f"moto's S3 server on 127.0.0.1: pip install \"moto[server]\" boto3)\n")
        return 0
    from ._s3 import LocalS3

    files = make_jsonl_shards(args.shards, args.records)
    with LocalS3(latency=args.latency) as s3:
        _empty(s3)
        s3.put(BUCKET, files)
        s3.proxy.reset()
        size = sum(len(body) for body in files.values())
        out.write(f"aloader S3 streaming demo: {args.shards} JSON Lines shards x "
                  f"{args.records:,} records ({size / 1e6:.1f} MB) in s3://{BUCKET}/ on a "
                  f"local S3 (moto) at {s3.endpoint} with {args.latency * 1e3:.0f} ms latency "
                  "per request\n")
        out.write(f'  JsonLines("s3://{BUCKET}/*.jsonl", shuffle_shards=True, '
                  f"concurrency={args.concurrency}).shuffle({args.buffer}) -> "
                  f"DataLoader(batch_size={args.batch_size})\n")
        status = int(anyio.run(partial(stream, store=s3.store(BUCKET)), args,
                               f"s3://{BUCKET}/*.jsonl", out))
        out.write(f"  {len(s3.proxy.requests)} requests to the store (listing and GETs)\n")
        _empty(s3)
    return status
