"""The loader benchmarks' engine: each workload measured beside its limit, in the same run.

It lives with the benchmarks, not in the package: ``python -m aloader bench`` and
``benchmarks/bench_loader.py`` load it from a source checkout (``aloader._cli.load_bench_engine``).

Workloads follow the project's anchors (``shared/reference/anchors.md``):

* io: fetching one item waits 5 ms (``asyncio.sleep``), the payload is
  ``np.full(16, i, float32)``, batch 32. The limit is the tightest bare asyncio program for
  the work: a sliding window of 512 coroutines, each taking the next index, awaiting its fetch
  and writing the item into its batch's slot, batches stacked in order as they complete
  (``_io_window_limit``; stacked with ``np.array``, 3.4x faster than ``np.stack`` on a list
  of 32 small arrays, as ``default_collate`` stacks them). The anchors' ``asyncio_limit.py``
  (gather in groups of 4,096 under a Semaphore(512), waiting for the slowest of each group)
  stays as a labelled info row. The same
  on trio (``trio.sleep``) against a bare trio nursery doing the same work.
* sync: the io fetch as a blocking ``time.sleep(0.005)`` in a synchronous dataset, fetched 64
  at a time in threads; the limit is 64 / latency.
* mem: a 200,000 x 128 float32 table, shuffled, batch 256; the limit is numpy's fastest
  gather of the same batches (``x.take(perm[s:s+256], axis=0)``, in sampler order); the
  anchor's fancy-indexing (sorted within each batch) and plain indexing are info rows.
* lag: how late a 1 ms ticker task wakes up while a synchronous dataset loads.

Every figure is the best of ``repeat`` runs, the runs of a row's figures interleaved so that
they see the same machine; the io rows also quote the median of the rounds' paired ratios, and
the log says the machine's load. torch is imported only here, only when asked, and only if present.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from aloader import ArrayDataset, DataLoader, Dataset
from aloader._facade import UVLOOP_ENV

__all__ = (
    "FULL",
    "QUICK",
    "WORKLOADS",
    "Row",
    "Sizes",
    "format_table",
    "run_bench",
)

WORKLOADS = ("io", "sync", "mem", "lag")

LATENCY = 0.005
IO_BATCH = 32
IO_CONCURRENCY = 512
SYNC_CONCURRENCY = 64
MEM_COLS = 128
MEM_BATCH = 256
LAG_WORK = 0.002
LAG_TICK = 0.001
# The anchor's limit gathers this many fetches per asyncio.gather call.
_GATHER_CHUNK = 4096

# Targets: the ratio each row must reach.
IO_TARGET = 0.9
FACADE_TARGET = 0.9  # the sync `for` against `async for`, on the io and mem workloads
SYNC_TARGET = 0.8
MEM_TARGET = 0.6
LAG_P99_TARGET_MS = 5.0


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one benchmark run.

    Attributes:
        io_items: items of the async io workload (loader, facade and limit).
        sync_items: items of the blocking synchronous io workload.
        torch_io_items: items of torch's io run (one item at a time: 5 ms each).
        mem_rows: rows of the in-memory table.
        lag_items: items loaded while the ticker measures event-loop lag.
    """

    io_items: int
    sync_items: int
    torch_io_items: int
    mem_rows: int
    lag_items: int


FULL = Sizes(io_items=20_000, sync_items=4_000, torch_io_items=640, mem_rows=200_000,
             lag_items=1_000)
QUICK = Sizes(io_items=2_000, sync_items=640, torch_io_items=64, mem_rows=20_000,
              lag_items=160)


@dataclass
class Row:
    """One line of the table; text cells are already formatted.

    Attributes:
        workload: what was measured.
        aloader: aloader's figure (items/s).
        limit: the limit's figure (items/s), or None.
        limit_label: what the limit is.
        ratio: the figure against the limit (or the lag figures).
        target: the target and whether it was met.
        torch: torch's figure, or why there is none.
        met: whether the target was met (None: no target).
    """

    workload: str
    aloader: float
    limit: float | None
    limit_label: str
    ratio: str
    target: str
    torch: str
    met: bool | None


# --------------------------------------------------------------------------- datasets


def _payload(i: int) -> npt.NDArray[np.float32]:
    return np.full(16, i, dtype=np.float32)


class _IODataset(Dataset[npt.NDArray[np.float32]]):
    """``n`` payloads, each fetch waiting ``latency`` seconds (how it waits: the subclass's)."""

    def __init__(self, n: int, latency: float = LATENCY) -> None:
        self.n = n
        self.latency = latency

    def __len__(self) -> int:
        return self.n


class AsyncIODataset(_IODataset):
    """The io workload: each fetch waits ``latency`` seconds on the event loop."""

    async def __getitem__(self, i: int) -> npt.NDArray[np.float32]:
        await asyncio.sleep(self.latency)
        return _payload(i)


class BlockingIODataset(_IODataset):
    """The io workload as blocking I/O: each fetch sleeps ``latency`` seconds in its thread."""

    def __getitem__(self, i: int) -> npt.NDArray[np.float32]:
        time.sleep(self.latency)
        return _payload(i)


class BusyDataset(Dataset[npt.NDArray[np.float32]]):
    """Each fetch spins ``work`` seconds of GIL-holding Python."""

    def __init__(self, n: int, work: float) -> None:
        self.n = n
        self.work = work

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> npt.NDArray[np.float32]:
        end = time.perf_counter() + self.work
        while time.perf_counter() < end:
            pass
        return _payload(i)


# --------------------------------------------------------------------------- measuring


def _rounds(repeat: int, *runs: Callable[[], float]) -> list[list[float]]:
    """The items/s of each run in each of ``repeat`` rounds (``[round][run]``), the runs
    interleaved per round, so that the runs of one round see the same machine."""
    rounds = []
    for _ in range(repeat):
        rates = []
        for run in runs:
            gc.collect()
            rates.append(run())
        rounds.append(rates)
    return rounds


def _best_of(repeat: int, *runs: Callable[[], float]) -> list[float]:
    """The highest items/s of each run over ``repeat`` rounds, runs interleaved per round."""
    return [max(rates) for rates in zip(*_rounds(repeat, *runs), strict=True)]


def _paired_median(rounds: list[list[float]], run: int, limit: int) -> float:
    """The median over rounds of run ``run``'s items/s against run ``limit``'s in the same
    round: a paired ratio, which load that shifts between rounds moves less than the best."""
    return statistics.median(rates[run] / rates[limit] for rates in rounds)


def _check(what: str, got: int, expected: int) -> None:
    if got != expected:
        raise RuntimeError(f"{what}: delivered {got} items, expected {expected}")


async def _io_limit(n: int, concurrency: int = IO_CONCURRENCY) -> float:
    # The anchors' asyncio_limit.py, verbatim in substance.
    sem = asyncio.Semaphore(concurrency)

    async def fetch(i: int) -> npt.NDArray[np.float32]:
        await asyncio.sleep(LATENCY)
        return np.full(16, i, dtype=np.float32)

    async def one(i: int) -> npt.NDArray[np.float32]:
        async with sem:
            return await fetch(i)

    start = time.perf_counter()
    out: list[npt.NDArray[np.float32]] = []
    for s in range(0, n, _GATHER_CHUNK):
        out += await asyncio.gather(*[one(i) for i in range(s, min(n, s + _GATHER_CHUNK))])
    batches = [np.stack(out[k : k + IO_BATCH]) for k in range(0, n, IO_BATCH)]
    elapsed = time.perf_counter() - start
    _check("io limit", sum(len(b) for b in batches), n)
    return n / elapsed


def _window_program(n: int, fetch: Callable[[int], Any]
                    ) -> tuple[Callable[[], Any], list[npt.NDArray[np.float32]]]:
    """The tightest bare program's worker, run ``concurrency`` times at once by both bare
    limits (asyncio's gather, trio's nursery): each takes the next index, awaits its fetch and
    writes the item into its batch's slot; the batch that completes the head of the line is
    stacked, with any complete ones behind it, in order. Returns (worker, the batches)."""
    sizes = [min(IO_BATCH, n - s) for s in range(0, n, IO_BATCH)]
    slots: list[list[Any]] = [[None] * size for size in sizes]
    missing = sizes.copy()
    batches: list[npt.NDArray[np.float32]] = []
    taken = 0

    async def one() -> None:
        nonlocal taken
        while taken < n:
            i = taken
            taken += 1
            b, k = divmod(i, IO_BATCH)
            slots[b][k] = await fetch(i)
            missing[b] -= 1
            while len(batches) < len(sizes) and not missing[len(batches)]:
                batches.append(np.array(slots[len(batches)]))

    return one, batches


async def _io_window_limit(n: int, concurrency: int = IO_CONCURRENCY) -> float:
    one, batches = _window_program(n, AsyncIODataset(n).__getitem__)
    start = time.perf_counter()
    await asyncio.gather(*[one() for _ in range(min(concurrency, n))])
    elapsed = time.perf_counter() - start
    _check("io window limit", sum(len(b) for b in batches), n)
    return n / elapsed


class _TrioIODataset(_IODataset):
    """The io workload on trio: each fetch waits ``latency`` seconds in ``trio.sleep``."""

    async def __getitem__(self, i: int) -> npt.NDArray[np.float32]:
        import trio

        await trio.sleep(self.latency)
        return _payload(i)


async def _io_trio_limit(n: int, concurrency: int = IO_CONCURRENCY) -> float:
    # _io_window_limit as a trio nursery of ``concurrency`` tasks.
    import trio

    one, batches = _window_program(n, _TrioIODataset(n).__getitem__)
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, n)):
            nursery.start_soon(one)
    elapsed = time.perf_counter() - start
    _check("io trio limit", sum(len(b) for b in batches), n)
    return n / elapsed


def _thread_pool_limit(n: int) -> float:
    fetch = BlockingIODataset(n).__getitem__
    with ThreadPoolExecutor(SYNC_CONCURRENCY) as pool:
        start = time.perf_counter()
        out = list(pool.map(fetch, range(n)))
        batches = [np.array(out[k : k + IO_BATCH]) for k in range(0, n, IO_BATCH)]
        elapsed = time.perf_counter() - start
    _check("thread pool limit", sum(len(b) for b in batches), n)
    return n / elapsed


async def _anyio_thread_limit(n: int) -> float:
    # The mechanism the loader uses for synchronous datasets, with nothing around it.
    fetch = BlockingIODataset(n).__getitem__
    limiter = anyio.CapacityLimiter(SYNC_CONCURRENCY)
    start = time.perf_counter()
    out = await asyncio.gather(
        *[anyio.to_thread.run_sync(fetch, i, limiter=limiter) for i in range(n)]
    )
    batches = [np.array(out[k : k + IO_BATCH]) for k in range(0, n, IO_BATCH)]
    elapsed = time.perf_counter() - start
    _check("anyio thread limit", sum(len(b) for b in batches), n)
    return n / elapsed


def _io_loader(n: int) -> DataLoader[Any]:
    return DataLoader(AsyncIODataset(n), batch_size=IO_BATCH, max_concurrency=IO_CONCURRENCY)


async def _consume_async(loader: DataLoader[Any], n: int, what: str) -> float:
    start = time.perf_counter()
    count = 0
    async for batch in loader:
        count += len(batch)
    elapsed = time.perf_counter() - start
    _check(what, count, n)
    return n / elapsed


def _consume_sync(loader: DataLoader[Any], n: int, what: str) -> float:
    start = time.perf_counter()
    count = 0
    for batch in loader:
        count += len(batch)
    elapsed = time.perf_counter() - start
    _check(what, count, n)
    return n / elapsed


def _first_column(batch: Any) -> Any:
    return batch[0] if isinstance(batch, (list, tuple)) else batch


def _consume_torch(loader: Any, n: int, what: str) -> float:
    start = time.perf_counter()
    count = 0
    for batch in loader:
        count += len(_first_column(batch))
    elapsed = time.perf_counter() - start
    _check(what, count, n)
    return n / elapsed


async def _consume_columns(loader: DataLoader[Any], n: int) -> float:
    start = time.perf_counter()
    count = 0
    async for (batch,) in loader:
        count += len(batch)
    elapsed = time.perf_counter() - start
    _check("mem aloader", count, n)
    return n / elapsed


def _consume_columns_sync(loader: DataLoader[Any], n: int) -> float:
    start = time.perf_counter()
    count = 0
    for (batch,) in loader:
        count += len(batch)
    elapsed = time.perf_counter() - start
    _check("mem aloader (for)", count, n)
    return n / elapsed


def _mem_limit(x: npt.NDArray[np.float32], how: str) -> float:
    # The anchor's limit loop ("sorted"), the same in sampler order ("unsorted"), and numpy's
    # fastest gather in sampler order ("take"); the permutation is part of the epoch.
    rows = len(x)
    start = time.perf_counter()
    perm = np.random.default_rng(1).permutation(rows)
    for s in range(0, rows, MEM_BATCH):
        if how == "sorted":
            _ = x[np.sort(perm[s : s + MEM_BATCH])]
        elif how == "unsorted":
            _ = x[perm[s : s + MEM_BATCH]]
        else:
            _ = x.take(perm[s : s + MEM_BATCH], axis=0)
    return rows / (time.perf_counter() - start)


@dataclass
class _Lag:
    items_per_s: float
    p50_ms: float
    p99_ms: float


async def _ticker(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(LAG_TICK)
        lags.append(time.perf_counter() - start - LAG_TICK)


def _percentiles(lags: list[float]) -> tuple[float, float]:
    p50, p99 = np.percentile(np.asarray(lags), [50, 99]) * 1e3
    return float(p50), float(p99)


async def _lag_once(dataset: Dataset[Any], n: int) -> _Lag:
    lags: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.create_task(_ticker(lags, stop))
    try:
        rate = await _consume_async(DataLoader(dataset, batch_size=IO_BATCH), n, "lag loader")
    finally:
        stop.set()
        await ticker
    p50, p99 = _percentiles(lags)
    return _Lag(rate, p50, p99)


async def _idle_lag(seconds: float) -> tuple[float, float]:
    lags: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.create_task(_ticker(lags, stop))
    await asyncio.sleep(seconds)
    stop.set()
    await ticker
    return _percentiles(lags)


def _best_lag(repeat: int, make: Callable[[], Dataset[Any]], n: int) -> _Lag:
    runs = []
    for _ in range(repeat):
        gc.collect()
        runs.append(asyncio.run(_lag_once(make(), n)))
    best = min(runs, key=lambda lag: lag.p99_ms)
    return _Lag(max(lag.items_per_s for lag in runs), best.p50_ms, best.p99_ms)


# --------------------------------------------------------------------------- torch


class _Torch:
    """torch's figures, imported on first use and computed once per run."""

    def __init__(self, enabled: bool, sizes: Sizes, repeat: int, log: Callable[[str], None]):
        self.sizes = sizes
        self.repeat = repeat
        self.log = log
        self._module: Any = None
        self._io: str | None = None
        if not enabled:
            self.missing: str | None = "- (skipped)"
        elif importlib.util.find_spec("torch") is None:
            self.missing = "- (torch not installed)"
        else:
            self.missing = None

    def _torch(self) -> Any:
        if self._module is None:
            self._module = importlib.import_module("torch")
            importlib.import_module("torch.utils.data")
        return self._module

    def io(self) -> str:
        """torch num_workers=0 on the blocking-sleep io dataset (torch has no async path)."""
        if self.missing is not None:
            return self.missing
        if self._io is None:
            self.log("torch: io, num_workers=0, blocking sleep")
            data = self._torch().utils.data
            n = self.sizes.torch_io_items

            def run() -> float:
                loader = data.DataLoader(BlockingIODataset(n), batch_size=IO_BATCH)
                return _consume_torch(loader, n, "torch io")

            (rate,) = _best_of(self.repeat, run)
            self._io = f"{rate:,.0f} (num_workers=0, blocking sleep, N={n:,})"
        return self._io

    def mem(self, x: npt.NDArray[np.float32]) -> str:
        """torch TensorDataset, shuffled, batch 256, num_workers=0."""
        if self.missing is not None:
            return self.missing
        self.log("torch: mem, TensorDataset")
        torch = self._torch()
        dataset = torch.utils.data.TensorDataset(torch.from_numpy(x))
        loader = torch.utils.data.DataLoader(dataset, batch_size=MEM_BATCH, shuffle=True)
        (rate,) = _best_of(self.repeat, lambda: _consume_torch(loader, len(x), "torch mem"))
        return f"{rate:,.0f} (TensorDataset, num_workers=0)"


# --------------------------------------------------------------------------- rows


def _ratio_row(
    workload: str,
    value: float,
    limit: float,
    limit_label: str,
    target: float | None,
    torch: str,
    median: float | None = None,
) -> Row:
    """A row whose figure is ``value / limit`` (best of each); ``median``, the median of the
    paired rounds' ratios, is quoted beside it."""
    ratio = value / limit
    if target is None:
        target_text, met = "(info)", None
    else:
        met = ratio >= target
        target_text = f">= {target:g}x: {'ok' if met else 'MISSED'}"
    text = f"{ratio:.2f}x" if median is None else f"{ratio:.2f}x (paired median {median:.2f}x)"
    return Row(workload, value, limit, limit_label, text, target_text, torch, met)


def _load() -> str:
    """The machine's load (1-minute average) and CPUs, for the log beside paired figures."""
    try:
        load = f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):  # not on this platform
        load = "unknown"
    return f"load average {load} on {os.cpu_count()} CPUs"


def _trio_io_loader(n: int) -> DataLoader[Any]:
    return DataLoader(_TrioIODataset(n), batch_size=IO_BATCH, max_concurrency=IO_CONCURRENCY)


def _on_trio(run: Callable[[], Any]) -> float:
    import trio

    async def main() -> float:
        return float(await run())

    return float(trio.run(main))


def _io_rows(sizes: Sizes, repeat: int, torch: _Torch, log: Callable[[str], None]) -> list[Row]:
    n = sizes.io_items
    has_trio = importlib.util.find_spec("trio") is not None
    log(f"io: bare asyncio limits, async loader{', trio' if has_trio else ''}, "
        f"N={n:,}, {repeat} paired rounds; {_load()}")
    runs: list[Callable[[], float]] = [
        lambda: asyncio.run(_io_window_limit(n)),
        lambda: asyncio.run(_io_limit(n)),
        lambda: asyncio.run(_consume_async(_io_loader(n), n, "io aloader")),
    ]
    if has_trio:
        runs += [
            lambda: _on_trio(lambda: _io_trio_limit(n)),
            lambda: _on_trio(lambda: _consume_async(_trio_io_loader(n), n, "io aloader trio")),
        ]
    rounds = _rounds(repeat, *runs)
    rates = [max(rates) for rates in zip(*rounds, strict=True)]
    limit, gather_limit, async_rate = rates[:3]
    log(f"io: done, {_load()}")
    torch_io = torch.io()
    name = f"io: async dataset, max_concurrency={IO_CONCURRENCY}, N={n:,}"
    rows = [
        _ratio_row(name, async_rate, limit,
                   f"bare asyncio: {IO_CONCURRENCY} coroutines taking the next index, "
                   f"np.array per {IO_BATCH} in order", IO_TARGET, torch_io,
                   _paired_median(rounds, 2, 0)),
        _ratio_row("io: same, vs the anchors' gather program", async_rate, gather_limit,
                   f"bare asyncio gather of {_GATHER_CHUNK:,} + Semaphore({IO_CONCURRENCY}), "
                   "slowest of each group", None, torch_io, _paired_median(rounds, 2, 1)),
    ]
    if has_trio:
        trio_limit, trio_rate = rates[3:]
        rows.append(_ratio_row(f"io: same on trio (trio.sleep), N={n:,}", trio_rate, trio_limit,
                               f"bare trio nursery of {IO_CONCURRENCY} tasks, same work",
                               IO_TARGET, "- (torch has no trio path)",
                               _paired_median(rounds, 4, 3)))
    return rows + _io_loop_rows(n, repeat, torch_io, log)


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return None
    return cast(Callable[[], asyncio.AbstractEventLoop], uvloop.new_event_loop)


def _run_on(factory: Callable[[], asyncio.AbstractEventLoop] | None, main: Any) -> float:
    """``asyncio.run(main)`` on the loop ``factory`` makes (asyncio's own with None)."""
    with asyncio.Runner(loop_factory=factory) as runner:
        return cast(float, runner.run(main))


def _sync_on(uvloop: bool, n: int) -> float:
    """The io workload through the sync `for`, its private loop uvloop's or asyncio's."""
    before = os.environ.get(UVLOOP_ENV)
    os.environ[UVLOOP_ENV] = "1" if uvloop else "0"  # read when the loader's loop starts
    try:
        return _consume_sync(_io_loader(n), n, "io aloader (for)")
    finally:
        if before is None:
            del os.environ[UVLOOP_ENV]
        else:
            os.environ[UVLOOP_ENV] = before


def _io_loop_rows(n: int, repeat: int, torch_io: str, log: Callable[[str], None]) -> list[Row]:
    """`async for` on asyncio's and uvloop's loops, the sync `for` with each private loop:
    all four interleaved, so that the ratios compare runs on the same machine."""
    uvloop = _uvloop_factory()
    if uvloop is None:
        log(f"io: `async for` and the sync `for` (uvloop not installed: asyncio only), N={n:,}")
        async_rate, sync_rate = _best_of(
            repeat,
            lambda: _run_on(None, _consume_async(_io_loader(n), n, "io aloader")),
            lambda: _sync_on(False, n),
        )
        return [_ratio_row(f"io: same, through the sync `for` facade (asyncio private loop; "
                           f"uvloop not installed), N={n:,}", sync_rate, async_rate,
                           "`async for` on asyncio", FACADE_TARGET, torch_io)]
    log(f"io: `async for` and the sync `for`, each on asyncio and on uvloop, N={n:,}")
    async_rate, uv_async_rate, sync_rate, uv_sync_rate = _best_of(
        repeat,
        lambda: _run_on(None, _consume_async(_io_loader(n), n, "io aloader")),
        lambda: _run_on(uvloop, _consume_async(_io_loader(n), n, "io aloader (uvloop)")),
        lambda: _sync_on(False, n),
        lambda: _sync_on(True, n),
    )
    return [
        _ratio_row(f"io: same, `async for` on a uvloop loop, N={n:,}", uv_async_rate,
                   async_rate, "`async for` on asyncio", None, torch_io),
        _ratio_row(f"io: same, through the sync `for` facade (asyncio private loop, "
                   f"{UVLOOP_ENV}=0), N={n:,}", sync_rate, async_rate,
                   "`async for` on asyncio", FACADE_TARGET, torch_io),
        _ratio_row(f"io: same, through the sync `for` facade (uvloop private loop, the "
                   f"default with uvloop installed), N={n:,}", uv_sync_rate, uv_async_rate,
                   "`async for` on uvloop", FACADE_TARGET, torch_io),
        _ratio_row("io: same, the sync `for` on uvloop vs `async for` on asyncio",
                   uv_sync_rate, async_rate, "`async for` on asyncio", None, torch_io),
    ]


def _sync_rows(sizes: Sizes, repeat: int, torch: _Torch, log: Callable[[str], None]) -> list[Row]:
    n = sizes.sync_items
    log(f"sync: blocking-sleep dataset in threads, N={n:,}")

    def run() -> float:
        loader: DataLoader[Any] = DataLoader(
            BlockingIODataset(n), batch_size=IO_BATCH, max_concurrency=SYNC_CONCURRENCY
        )
        return asyncio.run(_consume_async(loader, n, "sync aloader"))

    rate, pool, anyio_rate = _best_of(
        repeat, run, lambda: _thread_pool_limit(n), lambda: asyncio.run(_anyio_thread_limit(n))
    )
    name = (f"sync io: sync dataset, blocking time.sleep, max_concurrency={SYNC_CONCURRENCY}, "
            f"N={n:,}")
    torch_io = torch.io()
    return [
        _ratio_row(name, rate, SYNC_CONCURRENCY / LATENCY,
                   f"{SYNC_CONCURRENCY} / {LATENCY * 1e3:g} ms", SYNC_TARGET, torch_io),
        _ratio_row("sync io: same, vs a bare thread pool", rate, pool,
                   f"ThreadPoolExecutor({SYNC_CONCURRENCY}).map + np.array", None, torch_io),
        _ratio_row("sync io: same, vs bare anyio threads", rate, anyio_rate,
                   f"gather of anyio.to_thread.run_sync, CapacityLimiter({SYNC_CONCURRENCY})",
                   None, torch_io),
    ]


def _mem_rows(sizes: Sizes, repeat: int, torch: _Torch, log: Callable[[str], None]) -> list[Row]:
    rows = sizes.mem_rows
    log(f"mem: ArrayDataset {rows:,} x {MEM_COLS} float32 vs numpy fancy-indexing")
    x = np.random.default_rng(0).standard_normal((rows, MEM_COLS), dtype=np.float32)
    loader: DataLoader[Any] = DataLoader(
        ArrayDataset(x), batch_size=MEM_BATCH, shuffle=True, generator=0
    )
    sorted_limit, unsorted_limit, take_limit, async_rate, sync_rate = _best_of(
        repeat,
        lambda: _mem_limit(x, "sorted"),
        lambda: _mem_limit(x, "unsorted"),
        lambda: _mem_limit(x, "take"),
        lambda: asyncio.run(_consume_columns(loader, rows)),
        lambda: _consume_columns_sync(loader, rows),
    )
    torch_mem = torch.mem(x)
    name = f"mem: ArrayDataset {rows:,} x {MEM_COLS} f32, shuffled, batch {MEM_BATCH}"
    return [
        # The limit is the fastest gather numpy has (the loader beat the anchor's sorted
        # indexing, which made that limit too weak); the anchor's and plain indexing stay
        # as info rows.
        _ratio_row(name, async_rate, take_limit, "numpy x.take(perm[s:s+256], axis=0)",
                   MEM_TARGET, torch_mem),
        _ratio_row("mem: same, vs the anchor's sorted indexing", async_rate, sorted_limit,
                   "numpy x[np.sort(perm[s:s+256])]", None, torch_mem),
        _ratio_row("mem: same, vs indexing in sampler order", async_rate, unsorted_limit,
                   "numpy x[perm[s:s+256]]", None, torch_mem),
        _ratio_row("mem: same, through the sync `for` (on the consumer's thread)", sync_rate,
                   async_rate, "aloader `async for` (first mem row)", FACADE_TARGET,
                   torch_mem),
    ]


def _lag_row(workload: str, lag: _Lag, idle_p99: float, target: bool) -> Row:
    limit = 1 / LAG_WORK
    text = (f"{lag.items_per_s / limit:.2f}x; lag p50 {lag.p50_ms:.2f} ms, "
            f"p99 {lag.p99_ms:.2f} ms (idle loop p99 {idle_p99:.2f} ms)")
    if target:
        met: bool | None = lag.p99_ms < LAG_P99_TARGET_MS
        target_text = f"lag p99 < {LAG_P99_TARGET_MS:g} ms: {'ok' if met else 'MISSED'}"
    else:
        met, target_text = None, "(info: GIL switch interval " \
            f"{sys.getswitchinterval() * 1e3:g} ms)"
    return Row(workload, lag.items_per_s, limit, "1 thread, sequential", text, target_text,
               "- (no event loop)", met)


def _lag_rows(sizes: Sizes, repeat: int, log: Callable[[str], None]) -> list[Row]:
    n = sizes.lag_items
    work_ms = f"{LAG_WORK * 1e3:g} ms"
    log(f"lag: {LAG_TICK * 1e3:g} ms ticker while a sync dataset loads, N={n:,}")
    idle_p99 = min(asyncio.run(_idle_lag(0.3))[1] for _ in range(repeat))
    blocking = _best_lag(repeat, lambda: BlockingIODataset(n, LAG_WORK), n)
    busy = _best_lag(repeat, lambda: BusyDataset(n, LAG_WORK), n)
    return [
        _lag_row(f"lag: sync dataset, {work_ms} blocking sleep/item, batch {IO_BATCH}, N={n:,}",
                 blocking, idle_p99, target=True),
        _lag_row(f"lag: sync dataset, {work_ms} GIL-holding work/item, batch {IO_BATCH}, "
                 f"N={n:,}", busy, idle_p99, target=False),
    ]


def run_bench(
    workloads: Sequence[str],
    *,
    quick: bool = False,
    repeat: int = 3,
    with_torch: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[Row]:
    """Measure the loader's workloads and their limits.

    Args:
        workloads: names from :data:`WORKLOADS`, or ``"all"``.
        quick: use the small :data:`QUICK` sizes (for tests).
        repeat: runs per figure; the best is kept.
        with_torch: measure torch's figures too (when torch is installed).
        log: called with a line before each measurement (e.g. a progress printer).

    Returns:
        The table's rows, in the order of :data:`WORKLOADS`.

    Raises:
        ValueError: on an unknown workload name or a repeat below 1.
    """
    unknown = [w for w in workloads if w != "all" and w not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; choose from {[*WORKLOADS, 'all']}")
    if repeat < 1:
        raise ValueError(f"repeat should be at least 1, but got repeat={repeat}")
    selected = set(WORKLOADS) if "all" in workloads or not workloads else set(workloads)
    sizes = QUICK if quick else FULL

    def say(line: str) -> None:
        if log is not None:
            log(line)

    torch = _Torch(with_torch, sizes, repeat, say)
    rows: list[Row] = []
    if "io" in selected:
        rows += _io_rows(sizes, repeat, torch, say)
    if "sync" in selected:
        rows += _sync_rows(sizes, repeat, torch, say)
    if "mem" in selected:
        rows += _mem_rows(sizes, repeat, torch, say)
    if "lag" in selected:
        rows += _lag_rows(sizes, repeat, say)
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a markdown table (workload, aloader, limit, ratio, target, torch)."""
    header = ("workload", "aloader items/s", "limit items/s", "ratio", "target", "torch items/s")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        limit = "-" if row.limit is None else f"{row.limit:,.0f} ({row.limit_label})"
        cells = (row.workload, f"{row.aloader:,.0f}", limit, row.ratio, row.target, row.torch)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
