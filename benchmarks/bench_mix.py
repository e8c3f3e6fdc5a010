"""The cost of ``aloader.mix``: the same sources mixed, or read one after another.

Run: ``python benchmarks/bench_mix.py [--quick]``. Best of 5, interleaved.

* in memory: 3 sources of 400k ints each (``as_stream(range(...))``, the cheapest source there
  is, so the mixing cost shows in full): ``mix(..., [5, 3, 2], stop="all_exhausted")`` against
  iterating the three streams one after another (``async for`` each), and against
  (``interleave(..., weights=...)`` is ``mix`` now). Reported as items/s and the added ns/item.
* JSON Lines: two local sources of 8 files x 20k records, mixed 1:1 against read in turn.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from aloader import JsonLines, Stream, as_stream, mix

RUNS = 5


async def count(stream: Any) -> int:
    n = 0
    async for _ in stream:
        n += 1
    return n


def one_after_another(make: Callable[[], list[Stream[Any]]]) -> int:
    async def main() -> int:
        return sum([await count(s) for s in make()])

    return anyio.run(main)


def mixed(make: Callable[[], list[Stream[Any]]], weights: list[float]) -> int:
    return anyio.run(count, mix(make(), weights, seed=0, stop="all_exhausted"))


def race(contestants: dict[str, Callable[[], int]], expected: int) -> dict[str, float]:
    best = dict.fromkeys(contestants, float("inf"))
    for _ in range(RUNS):
        for name, fn in contestants.items():
            start = time.perf_counter()
            items = fn()
            best[name] = min(best[name], time.perf_counter() - start)
            assert items == expected, (name, items, expected)
    return best


def report(label: str, best: dict[str, float], items: int) -> None:
    base = best["one after another"]
    for name, seconds in best.items():
        extra = (seconds - base) / items * 1e9
        print(f"| {label} | {name} | {items / seconds:,.0f} | {base / seconds:.2f}x | "
              f"{extra:+.0f} |")


def main() -> None:
    quick = "--quick" in sys.argv
    n = 100_000 if quick else 400_000
    print("| sources | how | items/s | vs one after another | ns/item added |")
    print("|---|---|---|---|---|")

    def memory() -> list[Stream[Any]]:
        return [as_stream(range(i * n, (i + 1) * n)) for i in range(3)]

    weights = [5.0, 3.0, 2.0]
    best = race({
        "one after another": lambda: one_after_another(memory),
        "mix": lambda: mixed(memory, weights),
    }, 3 * n)
    report("3 x range, in memory", best, 3 * n)

    files, per_file = (4, 10_000) if quick else (8, 20_000)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = []
        for name in ("a", "b"):
            directory = Path(tmp) / name
            directory.mkdir()
            for f in range(files):
                with open(directory / f"{f}.jsonl", "w") as out:
                    for i in range(per_file):
                        out.write(json.dumps({"id": i, "text": f"record {i} of {name}"}) + "\n")
            dirs.append(directory)

        def jsonl() -> list[Stream[Any]]:
            return [JsonLines(d) for d in dirs]

        total = 2 * files * per_file
        best = race({
            "one after another": lambda: one_after_another(jsonl),
            "mix": lambda: mixed(jsonl, [1.0, 1.0]),
        }, total)
        report("2 x JsonLines, local", best, total)


if __name__ == "__main__":
    main()
