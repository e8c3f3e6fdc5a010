"""The instructions a local source's epoch costs, for an A/B of the stats' counting (or any
change on the hot path): callgrind counts that load does not move.

Run under callgrind, once per checkout to compare (the aloader of CHECKOUT is measured)::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --dump-before=os_getppid \\
        --callgrind-out-file=x.out python benchmarks/bench_stats_cost.py CHECKOUT text 2
    grep summary x.out.2

The second dump holds exactly ``EPOCHS`` epochs of one source (``text``: TextLines over 8
files of 50 000 lines; ``json``: JsonLines over 8 files of 10 000 records), after a warm-up
epoch and with the garbage collector's objects frozen (so that a collection's timing moves
the count less). Measured (base 811483b vs the branch h-stats, counting once per epoch): text
1 139-1 147 M vs 1 134.5 M, json 646.4-647.7 M vs 648.4-648.6 M instructions per 2 epochs.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile


def main() -> None:
    checkout, kind, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.path.insert(0, checkout)
    import aloader

    if not aloader.__file__ or not os.path.abspath(aloader.__file__).startswith(
            os.path.abspath(checkout)):
        raise SystemExit(f"measuring {aloader.__file__}, not {checkout}'s aloader")
    data = os.path.join(tempfile.gettempdir(), "aloader_bench_stats_cost")
    if not os.path.isdir(data):
        os.makedirs(data)
        for s in range(8):
            with open(f"{data}/t{s}.txt", "w") as f:
                f.writelines(f"line {s} {i} some text here\n" for i in range(50_000))
            with open(f"{data}/j{s}.jsonl", "w") as f:
                f.writelines(f'{{"s": {s}, "i": {i}, "t": "x"}}\n' for i in range(10_000))
    source = (aloader.TextLines(f"{data}/t*.txt") if kind == "text"
              else aloader.JsonLines(f"{data}/j*.jsonl"))
    items = sum(1 for _ in source)  # warm-up: imports, the page cache
    gc.collect()
    gc.freeze()
    os.getppid()  # the marker: callgrind dumps before it
    for _ in range(epochs):
        for _ in source:
            items += 1
    os.getppid()
    print(items, source.stats.counts()[:3])


if __name__ == "__main__":
    main()
