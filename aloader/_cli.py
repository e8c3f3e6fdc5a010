"""``python -m aloader`` (or ``aloader``): the ``demo`` and ``bench`` commands, ``--version``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from . import __version__, _demo_http
from ._dataset import Dataset
from ._loader import DataLoader
from ._progress import Progress

__all__ = ("RemoteDataset", "main")

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


async def _demo(args: argparse.Namespace) -> int:
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
        f"every item delivered exactly once: {'yes' if exactly_once else 'NO'}\n"
    )
    out.flush()
    return 0 if exactly_once else 1


def _bench(args: argparse.Namespace) -> int:
    from ._bench import format_table, run_bench

    def log(line: str) -> None:
        print(f"[bench] {line}", file=sys.stderr, flush=True)

    workloads: list[str] = args.workloads or ["all"]
    started = time.perf_counter()
    rows = run_bench(workloads, quick=args.quick, repeat=args.repeat,
                     with_torch=not args.no_torch, log=log)
    elapsed = time.perf_counter() - started
    print(f"aloader loader benchmarks ({', '.join(workloads)}{', quick' if args.quick else ''}): "
          f"best of {args.repeat} per figure, ratios against limits measured in the same run; "
          f"Python {sys.version.split()[0]}, numpy {np.__version__}")
    print()
    print(format_table(rows))
    print()
    missed = [row.workload for row in rows if row.met is False]
    print(f"{len(rows)} rows in {elapsed:.0f} s; targets missed: {len(missed)}")
    for name in missed:
        print(f"  MISSED: {name}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"should be a positive integer, but got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"should be a number >= 0, but got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    from ._bench import WORKLOADS

    parser = argparse.ArgumentParser(
        prog="python -m aloader",
        description="aloader: an asyncio-native streaming data loader.",
    )
    parser.add_argument("--version", action="version", version=f"aloader {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="the main job: an async dataset with simulated latency vs sequential fetching, "
             "then JSON Lines shards streamed from a local HTTP server",
        description="Part 1 streams an async dataset with simulated network latency through "
                    "the DataLoader and compares with fetching the items one after another. "
                    "Part 2 starts an HTTP server on 127.0.0.1 serving generated shards with "
                    "latency and streams them through the sharded, shuffled JsonLines source "
                    "and the DataLoader (`python -m aloader demo-http --help` for its options).",
    )
    demo.add_argument("--only", choices=("latency", "http"), default=None,
                      help="run one part only")
    demo.add_argument("--items", type=_positive_int, default=20_000,
                      help="items (default 20000)")
    demo.add_argument("--latency-ms", type=_non_negative_float, default=5.0,
                      help="mean latency of one fetch in ms, +- 50%% jitter (default 5)")
    demo.add_argument("--concurrency", type=_positive_int, default=256,
                      help="max_concurrency: fetches in flight (default 256)")
    demo.add_argument("--batch-size", type=_positive_int, default=32,
                      help="batch size (default 32)")
    demo.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio",
                      help="event loop to run on (default asyncio)")

    commands.add_parser(
        "demo-http",
        help="part 2 of the demo on its own, with its options",
        add_help=False,
    )

    bench = commands.add_parser(
        "bench",
        help="measure the loader against the limits of its workloads",
        description="Print a markdown table of the loader's throughput on each workload, as a "
                    "ratio against its limit measured in the same run. io: async dataset and "
                    "the sync `for` facade; sync: a synchronous dataset doing blocking I/O in "
                    "threads; mem: in-memory ArrayDataset; lag: event-loop lag while a "
                    "synchronous dataset loads.",
    )
    bench.add_argument("workloads", nargs="*", choices=[*WORKLOADS, "all"], metavar="WORKLOAD",
                       help=f"any of {', '.join([*WORKLOADS, 'all'])} (default all)")
    bench.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    bench.add_argument("--repeat", type=_positive_int, default=3,
                       help="runs per figure, best kept (default 3)")
    bench.add_argument("--no-torch", action="store_true", help="skip torch's figures")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo-http"]:
        return _demo_http.main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "demo":
        status = 0
        if args.only in (None, "latency"):
            status = int(anyio.run(_demo, args, backend=args.backend))
        if args.only in (None, "http"):
            print()
            status = max(status, _demo_http.main([]))
        return status
    return _bench(args)
