"""``python -m aloader demo``: what aloader is for, shown offline in a few seconds.

Owns the demo, which the command line (:mod:`aloader._cli`) imports only when ``demo`` or
``demo-http`` runs: part 1 (:mod:`._latency`) streams an async dataset with simulated latency
and compares with sequential awaits; part 2 (:mod:`._streaming`) streams JSON Lines shards from
a local HTTP server (:mod:`._server`, also used by ``benchmarks/bench_sources.py`` and, with
injected faults, by the tests); part 3 (:mod:`._s3stream`) streams the same kind of shards from
``s3://`` on a local S3 server (:mod:`._s3`, moto's, also used by the tests), or says it was
skipped when moto is not installed. Nothing here is part of aloader's public API.
"""

from __future__ import annotations

import argparse

import anyio

from . import _s3stream, _streaming
from ._latency import RemoteDataset, run
from ._server import ShardServer, make_jsonl_shards

__all__ = ("RemoteDataset", "ShardServer", "main", "make_jsonl_shards", "streaming_main")

streaming_main = _streaming.main


def main(args: argparse.Namespace) -> int:
    """Run the demo's parts that ``args.only`` selects (None: all); returns the exit status.

    Args:
        args: the ``demo`` command's options (see ``python -m aloader demo --help``).
    """
    status = 0
    if args.only in (None, "latency"):
        status = int(anyio.run(run, args, backend=args.backend))
    if args.only in (None, "http"):
        print()
        status = max(status, _streaming.main([]))
    if args.only in (None, "s3"):
        print()
        status = max(status, _s3stream.main())
    return status
