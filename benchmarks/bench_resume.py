"""Benchmark of checkpoints: DataLoader.state_dict(), resuming at an epoch's last batch, and
aloader.sample_rng().

Run: ``python benchmarks/bench_resume.py`` (about 20 s). Figures:

* **state_dict()**: cost of one call in the middle of an epoch of a shuffled 10M-index dataset
  (numpy generator, and a torch.Generator when torch is installed, whose state is 5 KB). Limit:
  1 ms, whatever the dataset size (the order is never stored).
* **resume at the last batch**: time from ``load_state_dict`` to the first batch of a resume at
  the last batch of a 10M-index epoch, against the time to the first batch of that epoch
  started afresh (both draw the permutation; the resume must not fetch or iterate the skipped
  batches). Also shown: a custom sampler fast-forwarded by counting (it iterates the skipped
  indices, never fetching them).
* **sample_rng()**: cost of a call inside a fetch (a new sample's stream), and of a repeated
  call in the same sample. Limit: 5 us.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import aloader
from aloader import DataLoader
from aloader.pipeline._sample_rng import Scope, scope_var

N = 10_000_000
BATCH = 256


class Indices(aloader.Dataset[int]):
    """10M samples that are their index: fetching costs next to nothing."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, indices: list[int]) -> Any:
        return np.asarray(indices)


class Reversed:
    """A custom sampler without state_dict: fast-forwarded by counting."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


def best(fn: Callable[[], Any], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_state_dict(generator: Any, label: str) -> None:
    loader = DataLoader(Indices(N), batch_size=BATCH, shuffle=True, generator=generator,
                        collate_fn=lambda b: b)
    it = iter(loader)
    for _ in range(10):
        next(it)
    calls = 200
    start = time.perf_counter()
    for _ in range(calls):
        state = loader.state_dict()
    per = (time.perf_counter() - start) / calls
    size = len(json.dumps(state))
    it.close()
    print(f"state_dict() [{label}]: {per * 1e6:8.1f} us per call (limit 1000 us), "
          f"{size} bytes of JSON")


def first_batch(build: Callable[[], DataLoader[Any]], state: dict[str, Any] | None) -> float:
    def run() -> None:
        loader = build()
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        next(it)
        it.close()

    return best(run, 3)


def bench_resume() -> None:
    def shuffled() -> DataLoader[Any]:
        return DataLoader(Indices(N), batch_size=BATCH, shuffle=True, generator=0,
                          collate_fn=lambda b: b)

    def counted() -> DataLoader[Any]:
        return DataLoader(Indices(N), batch_size=BATCH, sampler=Reversed(N),
                          collate_fn=lambda b: b)

    for name, build in (("shuffled (array sampler)", shuffled),
                        ("custom sampler (counting)", counted)):
        loader = build()
        state = loader.state_dict()
        batches = len(loader)
        state["yielded"] = batches - 1  # the state of a consumer at the last batch
        state["map"]["prefix"] = batches - 1
        fresh = first_batch(build, None)
        resumed = first_batch(build, state)
        print(f"first batch, {name}: epoch start {fresh * 1e3:8.1f} ms, resume at the last "
              f"batch {resumed * 1e3:8.1f} ms ({resumed / fresh:.2f}x)")


def per_call(fn: Callable[[int], Any], calls: int = 20_000, repeat: int = 7,
             setup: Callable[[], Any] = lambda: None) -> float:
    """The best of ``repeat`` runs of ``calls`` calls, per call: the machine's load aside."""
    times = []
    for _ in range(repeat):
        setup()
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        times.append((time.perf_counter() - start) / calls)
    return min(times)


def bench_sample_rng() -> None:
    scope = Scope(12345, 3, 0)
    token = scope_var.set(scope)
    try:
        new = per_call(lambda i: (scope.at(i), aloader.sample_rng()))
        again = per_call(lambda i: aloader.sample_rng())
        # A batch of 64 per scope, as __getitems__ sees it: every index a new sample.
        def batch_call(i: int) -> Any:
            if i % 64 == 0:
                scope_var.set(Scope(12345, 3))
            return aloader.sample_rng(i)

        indexed = per_call(batch_call)
    finally:
        scope_var.reset(token)
    draw = per_call(lambda i: np.random.Generator(np.random.PCG64(i)))
    print(f"sample_rng(): new sample {new * 1e6:.2f} us, same sample again {again * 1e6:.2f} us, "
          f"sample_rng(index) in __getitems__ {indexed * 1e6:.2f} us (limit 5 us); "
          f"numpy's Generator(PCG64(seed)) for scale: {draw * 1e6:.2f} us")


def main() -> None:
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")
    bench_state_dict(0, "numpy generator")
    try:
        import torch
    except ImportError:
        pass
    else:
        bench_state_dict(torch.Generator().manual_seed(0), "torch.Generator")
    bench_resume()
    bench_sample_rng()


if __name__ == "__main__":
    main()
