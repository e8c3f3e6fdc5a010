"""The instructions per batch of an iterable epoch without workers, against the plain loops it
stands for: callgrind counts, which the machine's load does not move.

Two datasets, each under ``async for`` (asyncio), the sync ``for`` and a plain loop:

* ``iter``: an in-memory :class:`aloader.IterableDataset` yielding small ints; its plain loop
  (``iter-bare``) cuts ``range`` with ``islice`` into int64 arrays;
* ``text``: :class:`aloader.TextLines` over four local files (short lines); its plain loop
  (``text-bare``) is ``for line in open(path)`` cut into lists of lines without endings;

the loaders with ``batch_size=256`` and the default collate. Run with no arguments, it runs
every program under callgrind and prints a table (about two minutes at 200 batches)::

    python benchmarks/bench_stream_cost.py [--batches N] [--only NAME ...]

or one program alone (what the table runs)::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --dump-before=os_getppid \\
        --callgrind-out-file=x.out python benchmarks/bench_stream_cost.py PROGRAM N

PROGRAM is one of ``iter-async``, ``iter-for``, ``iter-bare``, ``text-async``, ``text-for``,
``text-bare``. One process runs a warm-up epoch of N batches (imports, first-use setup),
freezes the garbage collector's objects and turns it off, then runs an epoch of N batches and
one of 2N, each between two ``os.getppid()`` markers: dump 2 is the N-batch epoch, dump 3 the
2N one, so ``(count(3) - count(2)) / N`` is the cost of one batch, its 256 samples included,
apart from the epoch's fixed cost (``2 * count(2) - count(3)``).

Counts move by up to ~2-3k instructions a batch with unrelated changes of the code (the
layout of dicts and caches), so a change is kept here only when it moves them by more.

Measured (N=200, thousands of instructions per batch), main b1e0655 -> h-streambatch:

==============  ========  ========
case            before    after
==============  ========  ========
iter-async      593.6     487.2
iter-for        310.9     205.5
iter-bare       135.3     135.3
text-async      217.6     206.5
text-for        191.4     185.1
text-bare       410.1     410.1
==============  ========  ========

``iter-async`` pulls the plain iterable in a worker thread, one thread call per batch (~280k
instructions a batch over the sync ``for``, which pulls it on the consumer's call);
``text-async`` runs the epoch in a background task (one loop turn and two waits a batch,
~21k over the sync ``for``). A plain ``for line in open(path)`` costs twice TextLines' sync
``for`` (a Python step and a decode per line, where TextLines splits whole blocks).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np

import aloader

BATCH = 256
PROGRAMS = ("iter-async", "iter-for", "iter-bare", "text-async", "text-for", "text-bare")


class _Ints(aloader.IterableDataset[int]):
    """Small ints, ``n`` of them: the cheapest samples an iterable dataset yields."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))


def _text_files(folder: str, lines: int, shards: int = 4) -> list[str]:
    """``shards`` text files of ``lines`` short lines in all."""
    paths = []
    per = -(-lines // shards)
    for s in range(shards):
        path = os.path.join(folder, f"shard-{s}.txt")
        with open(path, "w") as f:
            f.writelines(f"line {s} {i} some text\n" for i in range(per))
        paths.append(path)
    return paths


def _program(name: str, batches: int, folder: str) -> Callable[[int], Any]:
    """The epoch of ``name`` with ``k`` times ``batches`` batches, as a call of ``k``."""
    kind, mode = name.split("-")
    loaders: dict[int, aloader.DataLoader[Any]] = {}
    for k in (1, 2):
        n = k * batches * BATCH
        if kind == "iter":
            dataset: Any = _Ints(n)
        else:
            sub = os.path.join(folder, str(k))
            os.makedirs(sub, exist_ok=True)
            dataset = aloader.TextLines(_text_files(sub, n))
        loaders[k] = aloader.DataLoader(dataset, batch_size=BATCH)

    def bare(k: int) -> int:
        """The plain loops the loader's epochs stand for: ``islice`` cuts of ``range`` into
        int64 arrays; ``for line in open(path)`` cut into lists of lines without endings."""
        count = 0
        if kind == "iter":
            it = iter(range(k * batches * BATCH))
            while batch := list(itertools.islice(it, BATCH)):
                np.array(batch, dtype=np.int64)
                count += 1
            return count
        lines: list[str] = []
        for path in cast(aloader.TextLines, loaders[k].dataset).shards:
            with open(path) as f:
                for line in f:
                    lines.append(line[:-1])
                    if len(lines) == BATCH:
                        lines = []
                        count += 1
        return count + (1 if lines else 0)

    async def consume_async(loader: aloader.DataLoader[Any]) -> int:
        count = 0
        async for _ in loader:
            count += 1
        return count

    def consume_sync(loader: aloader.DataLoader[Any]) -> int:
        count = 0
        for _ in loader:
            count += 1
        return count

    def run(k: int) -> int:
        loader = loaders[k]
        count = (asyncio.run(consume_async(loader)) if mode == "async"
                 else consume_sync(loader) if mode == "for" else bare(k))
        if count != k * batches:
            raise SystemExit(f"{name}: {count} batches, expected {k * batches}")
        return count

    return run


def _inner(name: str, batches: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        run = _program(name, batches, folder)
        run(1)  # warm-up: imports, first-use setup
        gc.collect()
        gc.freeze()
        # No collection in the counted epochs: when the young generation's collections fall
        # moves by thousands of instructions a batch with any change of the code's allocations.
        gc.disable()
        os.getppid()  # the markers: callgrind dumps before each
        run(1)
        os.getppid()
        run(2)
        os.getppid()


def _count(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith("summary:"):
                return int(line.split()[1])
    raise SystemExit(f"no summary in {path}")


def _measure(name: str, batches: int, folder: str) -> tuple[float, float]:
    """(instructions per batch, fixed instructions per epoch) of program ``name``."""
    out = os.path.join(folder, f"{name}.out")
    env = dict(os.environ, PYTHONHASHSEED="0")
    subprocess.run(
        ["valgrind", "--tool=callgrind", "--dump-before=os_getppid",
         f"--callgrind-out-file={out}", sys.executable, __file__, name, str(batches)],
        check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    one, two = _count(f"{out}.2"), _count(f"{out}.3")
    return (two - one) / batches, 2 * one - two


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in PROGRAMS and re.fullmatch(r"\d+", sys.argv[2]):
        _inner(sys.argv[1], int(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--only", choices=PROGRAMS, action="append")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        print("| case | instructions per batch | fixed per epoch |")
        print("|---|---:|---:|")
        for name in args.only or PROGRAMS:
            per, fixed = _measure(name, args.batches, folder)
            print(f"| {name} | {per / 1e3:.1f}k | {fixed / 1e6:.2f}M |", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
