"""The cost of the statistics, measured in one process: the library's Collector against a
no-op one swapped in for this benchmark only (collection stays always on in aloader).

The io and mem workloads of ``engine.py`` (full sizes), the two collectors interleaved run by
run, best of ``--repeat``. The no-op collector removes the recording (the hooks' work), not
the calls to them nor the clock reads around each stage, so the cost shown is a lower bound
of what the statistics cost against a build without any.

    python benchmarks/bench_stats_cost.py [--repeat 5] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any, cast

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aloader._loader as loader_module
from aloader import ArrayDataset, DataLoader
from aloader._stats import Collector, Stage

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine


class _NoStage(Stage):
    __slots__ = ()

    def __init__(self) -> None:
        super().__init__()
        # A builtin that does next to nothing with its one argument: a Python no-op would
        # cost more than the list append it replaces.
        self.add = cast(Any, id)


class NoCollector(Collector):
    """A Collector that records nothing (its hooks return at once)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in ("sampling", "fetch", "collate", "transfer", "wait", "consumer"):
            setattr(self, name, _NoStage())

    def collated(self, samples: Any, ns: int) -> None:
        return None

    def collated_in_thread(self, samples: Any, ns: int) -> None:
        return None

    def fetched_in_thread(self, ns: int, cpu: int) -> None:
        return None

    def delivered(self, asked: int, now: int, ready: int) -> None:
        return None

    def asked_again(self, asked: int) -> None:
        return None


def _with(collector: type[Collector], run: Any) -> float:
    setattr(loader_module, "Collector", collector)  # noqa: B010 - swapped for the benchmark
    try:
        return float(run())
    finally:
        setattr(loader_module, "Collector", Collector)  # noqa: B010


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = engine.QUICK if args.quick else engine.FULL
    n = sizes.io_items
    x = np.random.default_rng(0).standard_normal((sizes.mem_rows, engine.MEM_COLS),
                                                 dtype=np.float32)
    mem: DataLoader[Any] = DataLoader(ArrayDataset(x), batch_size=engine.MEM_BATCH,
                                      shuffle=True, generator=0)

    def io() -> float:
        return asyncio.run(engine._consume_async(engine._io_loader(n), n, "io"))

    def mem_run() -> float:
        # An epoch lasts a few tens of ms: five of them per figure, or noise hides the cost.
        async def epochs() -> float:
            rates = [await engine._consume_columns(mem, len(x)) for _ in range(5)]
            return len(rates) / sum(1 / rate for rate in rates)

        return asyncio.run(epochs())

    print("| workload | stats off items/s | stats on items/s | cost |")
    print("|---|---|---|---|")
    for name, run in (("io", io), ("mem", mem_run)):
        def off_run(run: Any = run) -> float:
            return _with(NoCollector, run)

        def on_run(run: Any = run) -> float:
            return _with(Collector, run)

        off, on = engine._best_of(args.repeat, off_run, on_run)
        print(f"| {name} | {off:,.0f} | {on:,.0f} | {(off - on) / off:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
