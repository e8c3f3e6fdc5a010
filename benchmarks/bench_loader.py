"""The loader's benchmark table: throughput per workload as a ratio against its limit.

Run: ``python benchmarks/bench_loader.py [io|sync|mem|lag|all] [--quick] [--no-torch]``, the same
as ``python -m aloader bench``. The workloads live in ``benchmarks/engine.py``; this is a wrapper.
"""

from __future__ import annotations

import sys

from aloader._cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
