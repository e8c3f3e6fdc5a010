"""default_collate against the fastest bare stacking of the same samples (and torch's, when
installed).

Run: ``python benchmarks/bench_collate.py``. Workload: a batch of 256 samples of 128 float32
(the "mem" workload's batch). The limit is ``np.array`` of the same list, measured in this run
(``np.stack``, ~3x slower on such a list, was the limit until default_collate beat it: it
stacks plain ndarrays with ``np.array``); default_collate must stay within 1.5x of it. The
other rows are for information.
"""

from __future__ import annotations

import timeit
from collections.abc import Callable
from typing import Any

import numpy as np

from aloader.data._collate import ColumnBatch, default_collate

BATCH = 256
FEATURES = 128
LIMIT_RATIO = 1.5


def best_us(fn: Callable[[], Any], repeat: int = 15) -> float:
    """Best time of one call in microseconds, over `repeat` runs of an auto-sized loop."""
    number, _ = timeit.Timer(fn).autorange()
    number = max(1, number // 4)
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    table = rng.random((BATCH, FEATURES), dtype=np.float32)
    labels = rng.integers(0, 10, BATCH)
    arrays = list(table)
    dicts = [{"x": table[i], "y": labels[i]} for i in range(BATCH)]
    tuples = [(table[i], labels[i]) for i in range(BATCH)]
    columns = ColumnBatch([table, labels])

    # Results agree before anything is timed.
    np.testing.assert_array_equal(default_collate(arrays), np.stack(arrays))
    np.testing.assert_array_equal(np.array(arrays), np.stack(arrays))
    np.testing.assert_array_equal(default_collate(columns)[0], default_collate(tuples)[0])

    stack = best_us(lambda: np.array(arrays))
    rows: list[tuple[str, float]] = [
        ("np.array(list of arrays)  [limit]", stack),
        ("np.stack(list of arrays)", best_us(lambda: np.stack(arrays))),
        ("default_collate(list of arrays)", best_us(lambda: default_collate(arrays))),
        ("default_collate(list of dicts)", best_us(lambda: default_collate(dicts))),
        ("default_collate(list of tuples)", best_us(lambda: default_collate(tuples))),
        ("default_collate(ColumnBatch)", best_us(lambda: default_collate(columns))),
    ]
    try:
        import torch.utils.data
    except ImportError:
        print("torch not installed: skipping its rows")
    else:
        torch_collate = torch.utils.data.default_collate
        rows += [
            ("torch default_collate(list of arrays)", best_us(lambda: torch_collate(arrays))),
            ("torch default_collate(list of dicts)", best_us(lambda: torch_collate(dicts))),
            ("torch default_collate(list of tuples)", best_us(lambda: torch_collate(tuples))),
        ]

    print(f"batch of {BATCH} samples of {FEATURES} float32 (+ an int64 label in dicts/tuples)")
    print(f"{'what':40s} {'us':>10s} {'x np.array':>11s}")
    for name, us in rows:
        print(f"{name:40s} {us:10.1f} {us / stack:11.2f}")
    ratio = rows[2][1] / stack
    verdict = "PASS" if ratio <= LIMIT_RATIO else "FAIL"
    print(f"default_collate / np.array = {ratio:.2f} (limit {LIMIT_RATIO}): {verdict}")


if __name__ == "__main__":
    main()
