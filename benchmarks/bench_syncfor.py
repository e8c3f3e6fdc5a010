"""The sync ``for`` against ``async for`` in paired rounds, on asyncio and on uvloop.

Run: ``python benchmarks/bench_syncfor.py [--rounds 15] [--items 20000] [--mem-rows 200000]``,
or ``--only RUN --epochs K`` for one run alone (to count instructions or syscalls).

Each round runs one epoch of each of the io workload's four runs (``async for`` on asyncio's
and on uvloop's loop, the sync ``for`` with each private loop) and of the mem workload's two
(``async for``, the sync ``for``), interleaved in one process, and the script prints the
median over rounds of each sync ``for``'s items/s against its ``async for``'s in the same
round: a paired ratio, which load that shifts between rounds moves less than a best-of. The
workloads are ``engine.py``'s (``bench_loader.py io`` and ``mem``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine

from aloader import ArrayDataset, DataLoader

RUNS = ("io async asyncio", "io for asyncio", "mem async", "mem for", "io async uvloop",
        "io for uvloop")


def _runs(items: int, mem_rows: int) -> dict[str, Callable[[], float]]:
    try:
        uvloop: Any = importlib.import_module("uvloop").new_event_loop
    except ImportError:
        uvloop = None
    x = np.random.default_rng(0).standard_normal((mem_rows, engine.MEM_COLS), dtype=np.float32)
    mem: DataLoader[Any] = DataLoader(
        ArrayDataset(x), batch_size=engine.MEM_BATCH, shuffle=True, generator=0
    )
    io = engine._io_loader
    runs: dict[str, Callable[[], float]] = {
        "io async asyncio": lambda: engine._run_on(
            None, engine._consume_async(io(items), items, "io async")),
        "io for asyncio": lambda: engine._sync_on(False, items),
        "mem async": lambda: asyncio.run(engine._consume_columns(mem, mem_rows)),
        "mem for": lambda: engine._consume_columns_sync(mem, mem_rows),
    }
    if uvloop is not None:
        runs["io async uvloop"] = lambda: engine._run_on(
            uvloop, engine._consume_async(io(items), items, "io async uvloop"))
        runs["io for uvloop"] = lambda: engine._sync_on(True, items)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--items", type=int, default=engine.FULL.io_items)
    parser.add_argument("--mem-rows", type=int, default=engine.FULL.mem_rows)
    parser.add_argument("--only", choices=RUNS, help="run only this, --epochs times, and "
                        "print nothing (for callgrind and strace -c -f: the difference of two "
                        "counts over different --epochs is the cost of the extra epochs)")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args(argv)
    runs = _runs(args.items, args.mem_rows)
    if args.only is not None:
        for _ in range(args.epochs):
            runs[args.only]()
        return 0
    for run in runs.values():  # warm up: imports, the first loop, the C extension
        run()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            gc.collect()
            rates[name].append(run())
    pairs = [("io for asyncio", "io async asyncio"), ("io for uvloop", "io async uvloop"),
             ("mem for", "mem async")]
    print(f"{args.rounds} paired rounds, io N={args.items:,}, mem rows={args.mem_rows:,}")
    for sync, async_ in pairs:
        if sync not in rates:
            continue
        ratios = [s / a for s, a in zip(rates[sync], rates[async_], strict=True)]
        print(f"{sync:>16} / {async_:<17} median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}); "
              f"median items/s {statistics.median(rates[sync]):,.0f} vs "
              f"{statistics.median(rates[async_]):,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
