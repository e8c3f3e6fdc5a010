"""Cost of one shuffled epoch of 10M indices, alone and cut into batches of 256.

Run: ``python benchmarks/bench_sampler.py [n]``. Prints ns/index, best of 3 runs each. The limit
is numpy's ``Generator.permutation`` measured in the same run; the batching target is at most
2x the sampler alone.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from aloader.data._batchsampler import BatchSampler, epoch_batches
from aloader.data._random import permutation
from aloader.data._sampler import RandomSampler

N = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000_000
BATCH = 256
RUNS = 3


def best_ns_per_index(fn: Callable[[], Any], runs: int = RUNS) -> float:
    """Best wall time of ``runs`` calls of ``fn``, in ns per index."""
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best / N * 1e9


def consume(it: Any) -> None:
    for _ in it:
        pass


def main() -> None:
    """Measure and print the table."""
    rng = np.random.default_rng(0)
    data = range(N)
    sampler = RandomSampler(data, generator=0)
    batcher = BatchSampler(RandomSampler(data, generator=0), BATCH, False)

    rows: list[tuple[str, float]] = []
    limit = best_ns_per_index(lambda: rng.permutation(N))
    rows.append(("numpy Generator.permutation (limit)", limit))
    rows.append(("aloader.data._random.permutation", best_ns_per_index(lambda: permutation(rng,
    N))))
    alone = best_ns_per_index(sampler._epoch_indices)
    rows.append(("RandomSampler._epoch_indices()", alone))

    def batches() -> None:
        it = epoch_batches(batcher)
        assert it is not None
        consume(it)

    batched = best_ns_per_index(batches)
    rows.append((f"BatchSampler(RandomSampler, {BATCH})._epoch_batches()", batched))
    rows.append(("list(RandomSampler)  [Python ints]", best_ns_per_index(lambda: list(sampler))))
    rows.append(("list(BatchSampler)   [lists of ints]", best_ns_per_index(lambda: list(batcher))))

    try:
        import torch
        from torch.utils.data import BatchSampler as TorchBatchSampler
        from torch.utils.data import RandomSampler as TorchRandomSampler
    except ImportError:
        torch = None
    if torch is not None:
        gen = torch.Generator().manual_seed(0)
        t_sampler = TorchRandomSampler(data, generator=gen)
        t_batcher = TorchBatchSampler(TorchRandomSampler(data, generator=gen), BATCH, False)
        rows.append(("torch randperm (tensor)", best_ns_per_index(lambda: torch.randperm(N))))
        rows.append(("list(torch RandomSampler)", best_ns_per_index(lambda: list(t_sampler))))
        rows.append(("list(torch BatchSampler)", best_ns_per_index(lambda: list(t_batcher))))

    print(f"one epoch of {N:,} indices, best of {RUNS}")
    print(f"{'what':<52} {'ns/index':>9} {'vs limit':>9}")
    for name, ns in rows:
        print(f"{name:<52} {ns:9.2f} {ns / limit:8.2f}x")
    ratio = batched / alone
    verdict = "ok" if ratio <= 2 else "OVER TARGET"
    print(f"batching cost: {ratio:.2f}x the sampler alone (target <= 2x: {verdict})")
    print(f"RandomSampler epoch: {alone:.1f} ns/index (target <= 10 ns/index)")


if __name__ == "__main__":
    main()
