"""The cost of the statistics and of an unused failure budget, on the io and mem workloads.

Statistics are always collected (there is no switch), so "stats off" is this same build with
the :class:`~aloader._stats.Collector`'s record methods replaced by no-ops (:func:`no_stats`):
what remains in both is the pipeline's clock reads around each stage. "Budget off" is
``max_failures=0``, "on" a budget no sample uses (``max_failures=5``, no failures). Each pair
runs in this one process in ``--repeat`` rounds (default 15), which of the two runs first
alternating: the best of each, and the median over the rounds of the cost within a round (a
drift of the machine's speed hits both halves of a round alike, so the median resolves a
smaller cost than two best-of figures on a noisy machine). The io and mem workloads are those
of ``engine.py`` (full sizes; ``--quick`` for the small ones).

The clock reads the two share are costed apart, without timing an epoch: the
``perf_counter_ns`` calls per batch of a mem epoch (counted) times the cost of one call
(timed alone), against the epoch's time per batch; so are the record calls of one batch
(timed alone, :func:`record_cost`): their sum is what statistics cost a mem batch, a figure
this machine's spread does not blur.

``--baseline ROOT`` adds the older comparison against another checkout (e.g. one without
statistics: ``git archive <commit> | tar -x -C /tmp/base`` and copy the built ``_cperm``
extension beside its package), each figure in a fresh process, alternating.

    python benchmarks/bench_stats.py [--repeat 15] [--quick] [--baseline /tmp/base]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
import timeit
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: this checkout's aloader
    sys.path.insert(0, str(ROOT))

from aloader import ArrayDataset, DataLoader, _stats  # noqa: E402
from aloader._cli import load_bench_engine  # noqa: E402

engine: Any = load_bench_engine()


# A C callable taking one to three arguments and doing nothing: the cheapest no-op, so that
# "off" costs no Python call where "on" records (Python functions would add their own).
_noop: Any = slice


class _NoopStage(_stats.Stage):
    """A stage that records nothing (``add`` is a no-op)."""

    def __init__(self) -> None:
        super().__init__()
        self.add = _noop


@contextlib.contextmanager
def no_stats() -> Iterator[None]:
    """The Collector's record methods (and its stages' ``add``) replaced by no-ops."""
    names = ("collated", "collated_in_thread", "fetched_in_thread", "delivered",
             "asked_again", "merge")
    saved = {name: getattr(_stats.Collector, name) for name in names}
    stage, change = _stats.Stage, _stats.Occupancy.change
    try:
        for name in names:
            setattr(_stats.Collector, name, _noop)
        _stats.Occupancy.change = _noop  # type: ignore[method-assign]
        _stats.Stage = _NoopStage  # type: ignore[misc]  # the Collector builds its stages so
        yield
    finally:
        for name, method in saved.items():
            setattr(_stats.Collector, name, method)
        _stats.Occupancy.change = change  # type: ignore[method-assign]
        _stats.Stage = stage  # type: ignore[misc]


def io_epoch(max_failures: int, n: int) -> float:
    loader = engine._io_loader(n)
    loader.max_failures = max_failures
    return float(anyio.run(engine._consume_async, loader, n, "io"))


def mem_epoch(max_failures: int, n: int) -> float:
    x = np.random.default_rng(0).standard_normal((n, engine.MEM_COLS), dtype=np.float32)
    loader = DataLoader(ArrayDataset(x), batch_size=engine.MEM_BATCH, shuffle=True,
                        generator=0, max_failures=max_failures)
    anyio.run(engine._consume_columns, loader, n)  # warm up
    # An epoch is a fraction of a second: the best of three, as the engine's mem row.
    return max(float(anyio.run(engine._consume_columns, loader, n)) for _ in range(3))


def interleaved(a: Callable[[], float], b: Callable[[], float], repeat: int
                ) -> tuple[float, float, float]:
    """Best items/s of ``a`` and of ``b``, run in ``repeat`` rounds (a then b, b then a in
    turn), and the median over the rounds of b's cost against a (``1 - b / a``): a drift of
    the machine's speed hits both halves of a round alike, so the median of the pairs
    resolves a smaller cost than two best-of figures do."""
    best_a = best_b = 0.0
    costs = []
    for round_ in range(repeat):
        if round_ % 2:
            rate_b, rate_a = b(), a()
        else:
            rate_a, rate_b = a(), b()
        best_a, best_b = max(best_a, rate_a), max(best_b, rate_b)
        costs.append(1 - rate_b / rate_a)
    return best_a, best_b, statistics.median(costs)


def _off(run: Callable[[int, int], float], n: int) -> float:
    with no_stats():
        return run(0, n)


def calls_per_batch(stats_on: bool, max_failures: int = 0,
                    n: int = 25_600) -> tuple[float, float, float]:
    """Python and C function calls per batch of a mem epoch (every thread), stats on or off,
    with a budget or not, and the clock reads among the C calls: a load-independent measure
    of their cost."""
    x = np.random.default_rng(0).standard_normal((n, engine.MEM_COLS), dtype=np.float32)
    loader = DataLoader(ArrayDataset(x), batch_size=engine.MEM_BATCH, shuffle=True, generator=0,
                        max_failures=max_failures)
    counts = {"call": 0, "c_call": 0, "clock": 0}
    clock = time.perf_counter_ns

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in counts:
            counts[event] += 1
            if arg is clock:
                counts["clock"] += 1

    with contextlib.nullcontext() if stats_on else no_stats():
        anyio.run(engine._consume_columns, loader, n)  # warm up
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            anyio.run(engine._consume_columns, loader, n)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    batches = n / engine.MEM_BATCH
    return counts["call"] / batches, counts["c_call"] / batches, counts["clock"] / batches


def record_cost(batches: int = 400) -> float:
    """The record calls of one in-memory batch, timed alone (ns, best of 5): the sampling and
    fetch appends, ``collated`` and ``delivered``, with the folds they trigger."""
    samples = list(range(engine.MEM_BATCH))

    def epoch(record: bool) -> Callable[[], None]:
        def run() -> None:
            stats = _stats.Collector("inline", 1, 2, 0, 0, "map", True)
            for _ in range(batches):
                if record:
                    stats.sampling.add(100)
                    stats.fetch.add(100)
                    stats.collated(samples, 100)
                    stats.delivered(1, 2, 0)
        return run

    timed = [min(timeit.repeat(epoch(record), number=20, repeat=5)) for record in (True, False)]
    return (timed[0] - timed[1]) / 20 / batches * 1e9


def clock_cost(n: int) -> tuple[float, float]:
    """The cost of one ``perf_counter_ns`` call (ns, best of 5 loops) and a mem epoch's time
    per batch (ns, best of 5 epochs)."""
    clock = time.perf_counter_ns
    per_call = min(timeit.timeit(clock, number=200_000) / 200_000 for _ in range(5)) * 1e9
    rate = max(mem_epoch(0, n) for _ in range(5))
    return per_call, engine.MEM_BATCH / rate * 1e9


_RUN = r"""
import sys, anyio, numpy as np
from aloader import ArrayDataset, DataLoader
from aloader._cli import load_bench_engine
engine = load_bench_engine()
which = sys.argv[1]
if which == "io":
    n = engine.FULL.io_items
    rate = anyio.run(engine._consume_async, engine._io_loader(n), n, "io")
else:
    x = np.random.default_rng(0).standard_normal((engine.FULL.mem_rows, engine.MEM_COLS),
                                                 dtype=np.float32)
    loader = DataLoader(ArrayDataset(x), batch_size=engine.MEM_BATCH, shuffle=True, generator=0)
    anyio.run(engine._consume_columns, loader, len(x))  # warm up
    rate = max(anyio.run(engine._consume_columns, loader, len(x)) for _ in range(3))
print(rate)
"""


def figure(root: Path, which: str) -> float:
    """One figure of checkout ``root`` in a fresh process (the ``--baseline`` comparison)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _RUN, which], env=env, cwd=root, check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="the small sizes")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="also compare with the checkout at this root (fresh processes)")
    args = parser.parse_args()
    if engine is None:
        sys.exit("bench_stats needs a source checkout (benchmarks/engine.py)")
    sizes = engine.QUICK if args.quick else engine.FULL
    workloads = {"io": (io_epoch, sizes.io_items), "mem": (mem_epoch, sizes.mem_rows)}
    print(f"same process, {args.repeat} rounds of both (alternating which runs first): best "
          "of each, and the median of the rounds' costs")
    print("| workload | comparison | off items/s | on items/s | cost (bests) | cost (median "
          "of rounds) |")
    print("|---|---|---|---|---|---|")
    for which, (run, n) in workloads.items():
        rows = [
            ("stats (record no-ops vs on)",
             lambda run=run, n=n: _off(run, n), lambda run=run, n=n: run(0, n)),
            ("budget (max_failures 0 vs 5, no failure)",
             lambda run=run, n=n: run(0, n), lambda run=run, n=n: run(5, n)),
        ]
        for name, off, on in rows:
            a, b, median = interleaved(off, on, args.repeat)
            print(f"| {which} | {name} | {a:,.0f} | {b:,.0f} | {(a - b) / a:+.1%} | "
                  f"{median:+.1%} |", flush=True)
    stats_on, stats_off = calls_per_batch(True), calls_per_batch(False)
    budget = calls_per_batch(True, max_failures=5)
    print(f"\nmem epoch, calls per batch (load-independent): {stats_on[0]:.1f} Python + "
          f"{stats_on[1]:.1f} C with stats, {stats_off[0]:.1f} + {stats_off[1]:.1f} with record "
          f"no-ops, {budget[0]:.1f} + {budget[1]:.1f} with stats and max_failures=5", flush=True)
    per_call, per_batch = clock_cost(sizes.mem_rows)
    record = record_cost()
    clocks = stats_on[2] * per_call
    print(f"clock reads (in both halves above): {stats_on[2]:.1f} perf_counter_ns calls per "
          f"batch x {per_call:.0f} ns = {clocks:.0f} ns, "
          f"{clocks / per_batch:.2%} of a mem batch ({per_batch / 1e3:.1f} us)", flush=True)
    print(f"statistics per mem batch, timed alone: {record:.0f} ns of record calls + {clocks:.0f}"
          f" ns of clock reads = {(record + clocks) / per_batch:.2%} of a batch", flush=True)
    if args.baseline is not None:
        print("\nfresh processes, alternating, best of", args.repeat)
        print("| workload | baseline items/s | this checkout items/s | cost |")
        print("|---|---|---|---|")
        for which in ("io", "mem"):
            base: list[float] = []
            mine: list[float] = []
            for _ in range(args.repeat):
                base.append(figure(args.baseline, which))
                mine.append(figure(ROOT, which))
            b, m = max(base), max(mine)
            print(f"| {which} | {b:,.0f} | {m:,.0f} | {(b - m) / b:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
