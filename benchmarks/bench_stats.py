"""The cost of the statistics: this checkout against a baseline checkout without them.

Statistics are always collected (there is no switch), so "stats off" is an older checkout of
aloader: pass its root with ``--baseline`` (e.g. ``git archive <commit> | tar -x -C /tmp/base``
and copy the built ``_cperm`` extension beside its package). Each figure runs in a fresh
process with ``PYTHONPATH`` set to one checkout, the two checkouts alternating, best of
``--repeat``; the io and mem workloads are those of ``engine.py`` (full sizes).

    python benchmarks/bench_stats.py --baseline /tmp/base [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

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
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _RUN, which], env=env, cwd=root, check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True,
                        help="root of a checkout without statistics")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("| workload | baseline items/s | with stats items/s | cost |")
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
