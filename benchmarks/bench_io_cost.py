"""The instructions one io epoch costs (``benchmarks/engine.py``'s io workload), for the loader
against the bare sliding-window program on asyncio and on trio: callgrind counts, which the
machine's load does not move (the timed io rows of ``bench_loader.py io`` do, by +-10%).

Run under callgrind, once per program and item count::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --dump-before=os_getppid \\
        --callgrind-out-file=x.out python benchmarks/bench_io_cost.py PROGRAM N
    grep summary x.out.2

PROGRAM is ``bare``, ``loader``, ``loader-auto`` (``max_concurrency="auto"`` with its knee
fixed at the loader's 512: the controller's cost), ``trio-bare`` or ``trio-loader``. The
second dump holds exactly one epoch of N items, after a warm-up epoch of the same program
(imports, first-use setup) and with the garbage collector's objects frozen. Two item counts
give the cost per item, ``(count(2N) - count(N)) / N``, apart from the epoch's fixed cost.

Under callgrind every 5 ms sleep has expired by the next turn of the loop, so the counts are
those of a fully CPU-bound epoch. On trio they still move with timing (which tasks a turn
runs), by a few percent between runs.

Measured (main 5ee7ec3, millions of instructions per epoch, N=3000 / N=6000): asyncio bare
207.5 / 390.9, loader 221.4 / 409.1 (0.937x / 0.955x; per item 61.1k vs 62.6k, 0.976x; the
loader's fixed cost per epoch ~9.6M more); trio bare 560.5 / 1099.3, loader 575.3 / 1179.5
(0.974x / 0.932x).
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from collections.abc import Callable
from typing import Any

import engine  # the script's folder is sys.path[0]


def _program(name: str, n: int) -> Callable[[], Any]:
    if name == "bare":
        return lambda: asyncio.run(engine._io_window_limit(n))
    if name == "loader":
        return lambda: asyncio.run(engine._consume_async(engine._io_loader(n), n, "io loader"))
    if name == "trio-bare":
        return lambda: engine._on_trio(lambda: engine._io_trio_limit(n))
    if name == "trio-loader":
        return lambda: engine._on_trio(
            lambda: engine._consume_async(engine._trio_io_loader(n), n, "io loader trio"))
    if name == "loader-auto":
        return lambda: asyncio.run(engine._consume_async(_auto_loader(n), n, "io loader auto"))
    raise SystemExit(f"unknown program {name!r}: bare, loader, loader-auto, trio-bare or "
                     "trio-loader")


def _auto_loader(n: int) -> Any:
    """The io loader with ``max_concurrency="auto"`` and the knee fixed at its 512: the
    controller's bounds pinned there, so all of its bookkeeping runs (every completion, every
    round's estimates) while its decisions leave the limit where ``loader``'s is. Its count
    against ``loader``'s is the controller's cost."""
    from aloader import DataLoader
    from aloader._tuning import Controller

    knee = engine.IO_CONCURRENCY
    loader = DataLoader(engine.AsyncIODataset(n), batch_size=engine.IO_BATCH,
                        max_concurrency="auto", max_concurrency_limit=knee)
    loader._tuner = Controller(knee, initial=knee, minimum=knee)
    return loader


def main() -> None:
    name, n = sys.argv[1], int(sys.argv[2])
    run = _program(name, n)
    run()  # warm-up: imports, first-use setup
    gc.collect()
    gc.freeze()
    os.getppid()  # the marker: callgrind dumps before it
    run()
    os.getppid()


if __name__ == "__main__":
    main()
