"""Benchmark of aloader's inference micro-batcher, beside Ray Serve's ``@serve.batch``.

Run: ``python benchmarks/bench_batcher.py`` (about a minute). Every figure is a ratio against
a limit measured in the same run, in ``ROUNDS`` interleaved rounds (each round runs every
program once, on asyncio and on trio), best round of each program:

* **saturation**: the batch function sleeps ``a + b*n`` seconds; many concurrent callers keep
  the queue full. Limit: ``max_batch_size / cost(max_batch_size)``; also shown, the same batch
  function called back to back with full batches and no batcher (what sleeping really costs:
  the loop's timers overshoot, and the fastest honest program without a batcher). The loop's
  epoll timeout is rounded up to whole milliseconds, so CPU work the callers do after a batch
  starts (answering, re-submitting) delays that batch's wake-up by as much, up to 1 ms: here
  the batcher's per-request CPU cost shows up as throughput.
* **low load**: one caller at a time, ``max_wait=0``, a batch function that returns at once.
  Added latency = batcher latency minus the latency of awaiting the batch function directly,
  at p50 and at p99, with and without a per-request timeout; the three programs run in the
  same loop, interleaved in chunks of 1,000 calls (``BENCH_LOW_LOAD_CALLS`` calls each per
  round, 20,000 by default: a p99 needs samples). Beside them, figures a loaded machine does
  not move: the added CPU time per call, and the scheduler steps per call (asyncio's loop
  iterations and handles run, trio's task steps, counted by its instrument API).
* **overload**: the queue is full and the model busy; every further request must be refused.
  Rejection latency p99, and the memory held after an open-loop flood of 10k and of 50k
  requests (it must not grow with the flood).
* **unbatched**: the same model called once per request (one model, one call at a time: a
  device), against the batcher on the same load; the batch cost ``a + b*n`` grows sublinearly
  per item, so batching should at least triple the throughput.
* **token budget**: a mixed-length workload (90% of requests of 16-64 tokens, 10% of
  512-1024) on a model whose memory holds ``TOKEN_BUDGET`` tokens per batch (a batch over it
  swaps: ``SWAP_PENALTY`` times slower) and whose batch costs ``a + b*tokens``. Fixed-size
  batching either stays safe for the longest requests (``TOKEN_BUDGET // 1024`` items) or
  takes a common size (32) and sometimes swaps; the batcher's ``cost=`` /
  ``max_batch_cost=`` fills every batch up to the budget. New tokens/s and p99 latency, in the
  same run; Ray's ``batch_size_fn`` on the same budget beside them.

Ray Serve is not a dependency of aloader. If ``ray[serve]`` is importable (e.g. run this with a
venv's python where it is installed), ``@serve.batch`` runs on the same loads, standalone as a
decorator on an async method, without a cluster. Ray 2.x asks its replica context for
``max_ongoing_requests`` to print a warning and fails outside a deployment; that warning check is
patched out, nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import platform
import random
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

import aloader

# Batch cost a + b*n. asyncio's timers overshoot by up to ~1 ms (epoll rounds its timeout up to
# whole milliseconds), so the costs are tens of ms, as a real model's would be.
A_S = 0.010  # fixed cost of a batch (s)
B_S = 0.0005  # cost per item (s)
MAX_BATCH = 32
CALLERS = 256
SATURATION_SECONDS = 2.0
LOW_LOAD_CALLS = int(os.environ.get("BENCH_LOW_LOAD_CALLS", "20000"))  # per program and round
LOW_LOAD_CHUNK = 1_000
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))


def cost(n: int) -> float:
    return A_S + B_S * n


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# -- Ray Serve, if installed -----------------------------------------------------------------------


def load_ray() -> Any | None:
    try:
        from ray import serve  # type: ignore[import-not-found,unused-ignore]
        from ray.serve import batching  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    queue_cls = getattr(batching, "_BatchQueue", None)
    if queue_cls is not None and hasattr(
        queue_cls, "_warn_if_max_batch_size_exceeds_max_ongoing_requests"
    ):
        queue_cls._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda self: None
    return serve


def ray_method(
    serve: Any, fn: Callable[[list[Any]], Awaitable[list[Any]]], **options: Any
) -> Callable[[Any], Awaitable[Any]]:
    class Deployment:
        @serve.batch(**options)  # type: ignore[untyped-decorator,unused-ignore]
        async def handle(self, items: list[Any]) -> list[Any]:
            return await fn(items)

    deployment = Deployment()
    _KEEP_ALIVE.append(deployment)
    return deployment.handle  # type: ignore[no-any-return]


# -- saturation ----------------------------------------------------------------------------------


async def sleepy_batch(items: list[Any]) -> list[Any]:
    await anyio.sleep(cost(len(items)))  # asyncio.sleep or trio.sleep, nothing more
    return items


async def saturate(call: Callable[[Any], Awaitable[Any]], seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def caller() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await call(1)
            done += 1

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(CALLERS):
            group.start_soon(caller)
    return done / (time.perf_counter() - start)


async def direct_full_batches(seconds: float) -> float:
    items = [1] * MAX_BATCH
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        await sleepy_batch(items)
        done += MAX_BATCH
    return done / (time.perf_counter() - start)


async def batcher_rate(max_wait: float) -> tuple[float, float]:
    """Requests/s of a saturated Batcher and its mean batch size."""
    async with aloader.Batcher(
        sleepy_batch, max_batch_size=MAX_BATCH, max_wait=max_wait, max_queue=4 * CALLERS
    ) as batcher:
        rate = await saturate(batcher, SATURATION_SECONDS)
        hist = batcher.metrics()["batch_size_histogram"]
    return rate, sum(k * v for k, v in hist.items()) / max(1, sum(hist.values()))


def unbatched_model() -> Callable[[Any], Awaitable[Any]]:
    """The model called once per request, one call at a time (one device)."""
    lock = anyio.Lock()

    async def call(x: Any) -> Any:
        async with lock:
            return (await sleepy_batch([x]))[0]

    return call


async def saturation_round(backend: str, serve: Any | None) -> dict[str, tuple[float, str]]:
    """One round of the saturation programs on one backend: name -> (requests/s, note)."""
    out: dict[str, tuple[float, str]] = {}
    out[f"same batch fn back to back, no batcher ({backend})"] = (
        await direct_full_batches(SATURATION_SECONDS),
        "measured",
    )
    rate, mean = await batcher_rate(0.0)
    out[f"aloader Batcher (max_wait=0, {backend})"] = (rate, f"mean batch {mean:.1f}")
    out[f"unbatched: one model call per request ({backend})"] = (
        await saturate(unbatched_model(), SATURATION_SECONDS),
        "one call at a time",
    )
    if backend == "asyncio":
        rate, mean = await batcher_rate(0.01)
        out["aloader Batcher (max_wait=10 ms, asyncio)"] = (rate, f"mean batch {mean:.1f}")
        if serve is not None:
            for wait in (0.0, 0.01):
                handle = ray_method(
                    serve, sleepy_batch, max_batch_size=MAX_BATCH, batch_wait_timeout_s=wait
                )
                rate = await saturate(handle, SATURATION_SECONDS)
                out[f"ray @serve.batch (batch_wait_timeout_s={wait:g})"] = (rate, "")
    return out


# -- low load ------------------------------------------------------------------------------------


async def instant_batch(items: list[Any]) -> list[Any]:
    return items


async def latencies(call: Callable[[Any], Awaitable[Any]], n: int, out: list[float]) -> float:
    """Time ``n`` calls one at a time into ``out``; return the process CPU seconds they took."""
    perf = time.perf_counter
    cpu = time.process_time()
    for _ in range(n):
        t0 = perf()
        await call(1)
        out.append(perf() - t0)
    return time.process_time() - cpu


class _TrioSteps:
    """A trio instrument: counts task steps (a task run until it blocks again)."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: object) -> None:
        self.steps += 1


async def steps_per_call(call: Callable[[Any], Awaitable[Any]], n: int) -> tuple[float, float]:
    """Scheduler work per call, a figure load does not move: (loop iterations, task steps) on
    asyncio (``_run_once`` runs, handles run: each task step is a handle), (task steps, task
    steps) on trio (its instrument API)."""
    try:
        loop: Any = asyncio.get_running_loop()
    except RuntimeError:
        import trio

        steps = _TrioSteps()
        trio.lowlevel.add_instrument(steps)  # type: ignore[arg-type]
        try:
            for _ in range(n):
                await call(1)
        finally:
            trio.lowlevel.remove_instrument(steps)  # type: ignore[arg-type]
        return steps.steps / n, steps.steps / n
    counts = [0, 0]
    run_once = loop._run_once
    handle_cls: Any = asyncio.Handle
    handle_run = handle_cls._run

    def counting_run_once() -> None:
        counts[0] += 1
        run_once()

    def counting_handle_run(handle: asyncio.Handle) -> None:
        counts[1] += 1
        handle_run(handle)

    loop._run_once = counting_run_once
    handle_cls._run = counting_handle_run
    try:
        for _ in range(n):
            await call(1)
    finally:
        del loop._run_once
        handle_cls._run = handle_run
    return counts[0] / n, counts[1] / n


LowRow = tuple[float, float, float, tuple[float, float]]  # added p50, p99, CPU/call, steps


async def low_load_round(backend: str, serve: Any | None) -> dict[str, LowRow]:
    """One round of the low-load programs on one backend: name -> (added p50, added p99,
    added CPU per call, scheduler steps per call). The programs run interleaved in chunks of
    ``LOW_LOAD_CHUNK`` calls (a burst of load hits them all alike), each against the direct
    await measured in the same chunks."""

    async def direct(x: Any) -> Any:
        return (await instant_batch([x]))[0]

    async with contextlib.AsyncExitStack() as stack:
        programs: dict[str, Callable[[Any], Awaitable[Any]]] = {"direct": direct}
        programs[f"aloader Batcher ({backend})"] = await stack.enter_async_context(
            aloader.Batcher(instant_batch, max_wait=0.0)
        )
        programs[f"aloader Batcher, with a timeout ({backend})"] = (
            await stack.enter_async_context(
                aloader.Batcher(instant_batch, max_wait=0.0, timeout=10.0)
            )
        )
        if serve is not None and backend == "asyncio":
            programs["ray @serve.batch (batch_wait_timeout_s=0)"] = ray_method(
                serve, instant_batch, max_batch_size=MAX_BATCH, batch_wait_timeout_s=0
            )
        lat: dict[str, list[float]] = {name: [] for name in programs}
        cpu = dict.fromkeys(programs, 0.0)
        for call in programs.values():
            await latencies(call, 200, [])  # warm up
        for _ in range(LOW_LOAD_CALLS // LOW_LOAD_CHUNK):
            for name, call in programs.items():
                cpu[name] += await latencies(call, LOW_LOAD_CHUNK, lat[name])
        steps = {name: await steps_per_call(call, 1_000) for name, call in programs.items()}
    base = lat.pop("direct")
    n = len(base)
    return {
        name: (
            pct(samples, 0.5) - pct(base, 0.5),
            pct(samples, 0.99) - pct(base, 0.99),
            (cpu[name] - cpu["direct"]) / n,
            steps[name],
        )
        for name, samples in lat.items()
    }


# -- overload ------------------------------------------------------------------------------------


FLOODS = (10_000, 50_000)


async def open_loop_flood(
    call: Callable[[Any], Awaitable[Any]], floods: tuple[int, ...]
) -> list[tuple[int, int]]:
    """Offer requests open-loop (500 per loop turn, nobody waits for an answer first) while the
    model is blocked; after each flood, return (bytes still held, requests still pending)."""
    pending: set[asyncio.Future[Any]] = set()

    async def one(i: int) -> None:
        with contextlib.suppress(aloader.QueueFullError):
            await call(i)

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    out = []
    sent = 0
    for total in floods:
        while sent < total:
            for _ in range(500):
                task = asyncio.ensure_future(one(sent))
                pending.add(task)
                task.add_done_callback(pending.discard)
                sent += 1
            await asyncio.sleep(0)
        for _ in range(3):
            await asyncio.sleep(0)  # let the refused requests finish
        gc.collect()
        out.append((tracemalloc.get_traced_memory()[0] - base, len(pending)))
    tracemalloc.stop()
    return out


async def bench_overload(serve: Any | None) -> dict[str, Any]:
    max_queue = 1_000
    release = asyncio.Event()

    async def blocked(items: list[Any]) -> list[Any]:
        await release.wait()
        return items

    out: dict[str, Any] = {}
    async with aloader.Batcher(blocked, max_batch_size=MAX_BATCH, max_queue=max_queue) as batcher:
        waiting: list[asyncio.Future[Any]] = []
        while batcher.metrics()["queued"] < max_queue:
            waiting.append(asyncio.ensure_future(batcher(len(waiting))))
            await asyncio.sleep(0)
        # Rejection latency, measured one refused call at a time.
        lat = []
        perf = time.perf_counter
        for i in range(20_000):
            t0 = perf()
            with contextlib.suppress(aloader.QueueFullError):
                await batcher(i)
            lat.append(perf() - t0)
        out["reject_p50"] = pct(lat, 0.5)
        out["reject_p99"] = pct(lat, 0.99)
        out["aloader_flood"] = await open_loop_flood(batcher, FLOODS)
        out["queued"] = batcher.metrics()["queued"]
        release.set()
        await asyncio.gather(*waiting)
        await asyncio.sleep(0.05)  # the flood's admitted requests finish
    if serve is not None:
        # Ray has no queue bound: the same flood piles up.
        release2 = asyncio.Event()

        async def blocked2(items: list[Any]) -> list[Any]:
            await release2.wait()
            return items

        handle = ray_method(serve, blocked2, max_batch_size=MAX_BATCH, batch_wait_timeout_s=0)
        out["ray_flood"] = await open_loop_flood(handle, FLOODS)
        release2.set()
        await asyncio.sleep(1.0)
    return out


# -- token budget ------------------------------------------------------------------------------

TOKEN_BUDGET = 4096  # tokens the model's memory holds in one batch
SWAP_PENALTY = 4.0  # a batch over the budget runs this many times slower
TOKEN_A_S = 0.005  # fixed cost of a batch (s)
TOKEN_B_S = 4e-6  # cost per token (s)
TOKEN_CALLERS = 128
TOKEN_SECONDS = 2.0


def mixed_lengths(n: int, seed: int = 0) -> list[int]:
    """Request sizes in tokens: 90% short (16-64), 10% long (512-1024)."""
    rng = random.Random(seed)
    return [rng.randint(512, 1024) if rng.random() < 0.1 else rng.randint(16, 64) for _ in range(n)]


class TokenModel:
    """Costs ``a + b*tokens`` per batch, ``SWAP_PENALTY`` times more over ``TOKEN_BUDGET``."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    async def __call__(self, sizes: list[int]) -> list[int]:
        total = sum(sizes)
        self.batches.append(total)
        cost = TOKEN_A_S + TOKEN_B_S * total
        await anyio.sleep(cost * (SWAP_PENALTY if total > TOKEN_BUDGET else 1.0))
        return sizes


async def token_load(call: Callable[[int], Awaitable[int]]) -> tuple[float, float, float]:
    """``TOKEN_CALLERS`` closed-loop callers over the mixed workload for ``TOKEN_SECONDS``:
    (tokens/s, requests/s, p99 latency in s)."""
    sizes = mixed_lengths(100_000)
    next_size = iter(sizes)
    tokens = 0
    lat: list[float] = []
    perf = time.perf_counter
    stop = perf() + TOKEN_SECONDS

    async def caller() -> None:
        nonlocal tokens
        while perf() < stop:
            n = next(next_size)
            t0 = perf()
            await call(n)
            lat.append(perf() - t0)
            tokens += n

    start = perf()
    async with anyio.create_task_group() as group:
        for _ in range(TOKEN_CALLERS):
            group.start_soon(caller)
    wall = perf() - start
    return tokens / wall, len(lat) / wall, pct(lat, 0.99)


TokenRow = tuple[float, float, float, int, int]  # tokens/s, requests/s, p99, max, over budget


async def token_round(backend: str, serve: Any | None) -> dict[str, TokenRow]:
    """One round of the token-budget programs (asyncio): name -> TokenRow."""
    out: dict[str, TokenRow] = {}
    programs: list[tuple[str, dict[str, Any]]] = [
        (f"fixed size {TOKEN_BUDGET // 1024} (safe for the longest)",
         {"max_batch_size": TOKEN_BUDGET // 1024}),
        ("fixed size 32", {"max_batch_size": 32}),
        (f"token budget: cost=len, max_batch_cost={TOKEN_BUDGET}",
         {"max_batch_size": 1024, "cost": int, "max_batch_cost": TOKEN_BUDGET}),
    ]  # fmt: skip
    for name, options in programs:
        model = TokenModel()
        async with aloader.Batcher(model, max_queue=4 * TOKEN_CALLERS, **options) as batcher:
            row = await token_load(batcher)
        over = sum(total > TOKEN_BUDGET for total in model.batches)
        out[f"aloader Batcher, {name}"] = (*row, max(model.batches), over)
    if serve is not None:
        model = TokenModel()
        handle = ray_method(
            serve, model, max_batch_size=TOKEN_BUDGET, batch_wait_timeout_s=0.0,
            batch_size_fn=sum,
        )  # fmt: skip
        row = await token_load(handle)
        over = sum(total > TOKEN_BUDGET for total in model.batches)
        out[f"ray @serve.batch, batch_size_fn=sum, max_batch_size={TOKEN_BUDGET}"] = (
            *row, max(model.batches), over,
        )  # fmt: skip
    return out


# -- report --------------------------------------------------------------------------------------


_KEEP_ALIVE: list[Any] = []  # Ray cancels its dispatcher task in __del__: keep them to the end


def run_on(backend: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    if backend == "trio":
        import trio

        return trio.run(fn, backend, *args)
    return asyncio.run(fn(backend, *args))  # type: ignore[arg-type]


def main() -> None:
    serve = load_ray()
    gc.collect()
    gc.freeze()  # keep collections of import-time objects out of the latency tails
    ray_version = "not installed"
    if serve is not None:
        import ray

        ray_version = ray.__version__
    backends = ["asyncio"]
    try:
        import trio  # noqa: F401
    except ImportError:
        pass
    else:
        backends.append("trio")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"aloader batcher benchmark: python {platform.python_version()}, "
        f"{' and '.join(backends)}, ray serve {ray_version}; best of {ROUNDS} interleaved "
        f"rounds; load average {load:.2f} at the start"
    )

    # Interleaved: every round runs every program once; each figure is its best round.
    sat: dict[str, tuple[float, str]] = {}
    low: dict[str, LowRow] = {}
    tok: dict[str, TokenRow] = {}
    for _ in range(ROUNDS):
        for name, row in run_on("asyncio", token_round, serve).items():
            if name not in tok or row[0] > tok[name][0]:
                tok[name] = row
        for backend in backends:
            for name, (rate, note) in run_on(backend, saturation_round, serve).items():
                if name not in sat or rate > sat[name][0]:
                    sat[name] = (rate, note)
            for name, (p50, p99, cpu, steps) in run_on(backend, low_load_round, serve).items():
                best = low.get(name, (math.inf, math.inf, math.inf, steps))
                low[name] = (min(best[0], p50), min(best[1], p99), min(best[2], cpu), steps)

    limit = MAX_BATCH / cost(MAX_BATCH)
    print(
        f"\n## Saturation: batch fn sleeps {A_S * 1e3:g} ms + {B_S * 1e3:g} ms x n, "
        f"max_batch_size {MAX_BATCH}, {CALLERS} concurrent callers, {SATURATION_SECONDS:g} s\n"
    )
    print("| runner | requests/s | ratio to limit | note |\n|---|---:|---:|---|")
    print(f"| limit: {MAX_BATCH} / cost({MAX_BATCH}) | {limit:,.0f} | 1.000 | |")
    for name, (rate, note) in sat.items():
        print(f"| {name} | {rate:,.0f} | {rate / limit:.3f} | {note} |")

    print(
        f"\n## Low load: one caller at a time, max_wait=0, {LOW_LOAD_CALLS:,} calls per round, "
        f"interleaved in chunks of {LOW_LOAD_CHUNK:,}; added to a direct `await fn([x])`\n\n"
        "Steps per call, a figure load does not move: asyncio's loop iterations / handles run, "
        "trio's task steps.\n"
    )
    print(
        "| runner | added p50 us | added p99 us | added CPU per call us | steps per call |\n"
        "|---|---:|---:|---:|---:|"
    )
    for name, (p50, p99, cpu, (iterations, handles)) in low.items():
        steps = f"{iterations:.2f}"
        if handles != iterations:
            steps += f" / {handles:.2f}"
        print(f"| {name} | {p50 * 1e6:.1f} | {p99 * 1e6:.1f} | {cpu * 1e6:.1f} | {steps} |")

    print(
        f"\n## Token budget: mixed lengths (90% 16-64 tokens, 10% 512-1024), model memory "
        f"{TOKEN_BUDGET} tokens per batch (x{SWAP_PENALTY:g} slower over it), batch cost "
        f"{TOKEN_A_S * 1e3:g} ms + {TOKEN_B_S * 1e6:g} us x tokens, {TOKEN_CALLERS} callers, "
        f"{TOKEN_SECONDS:g} s, asyncio\n"
    )
    print(
        "| runner | tokens/s | requests/s | p99 ms | most tokens in a batch | batches over "
        "the budget |\n|---|---:|---:|---:|---:|---:|"
    )
    for name, (tps, rps, p99, most, over_budget) in tok.items():
        print(f"| {name} | {tps:,.0f} | {rps:,.0f} | {p99 * 1e3:.1f} | {most:,} | {over_budget} |")

    print("\n## Overload: queue full (max_queue 1,000), model busy\n")
    over = asyncio.run(bench_overload(serve))
    print("| figure | value | limit |\n|---|---:|---:|")
    print(f"| rejection p50 | {over['reject_p50'] * 1e6:.1f} us | |")
    print(f"| rejection p99 | {over['reject_p99'] * 1e6:.1f} us | 1,000 us |")
    print(f"| requests queued during the floods | {over['queued']:,} | 1,000 |")
    print(
        "\nOpen-loop flood while the model is blocked: memory still held and requests pending\n"
        "\n| runner | " + " | ".join(f"after {n // 1000}k offered" for n in FLOODS) + " |\n"
        "|---|" + "---:|" * len(FLOODS)
    )
    for key, name in (("aloader_flood", "aloader Batcher"), ("ray_flood", "ray @serve.batch")):
        if key in over:
            cells = " | ".join(f"{held / 1e6:.1f} MB, {n:,} pending" for held, n in over[key])
            print(f"| {name} | {cells} |")

    # Issue 13, target 7: saturation at least 0.93x the limit, added p99 under 100 us.
    checks = []
    for backend in backends:
        rate = sat[f"aloader Batcher (max_wait=0, {backend})"][0]
        direct = sat[f"same batch fn back to back, no batcher ({backend})"][0]
        checks.append(
            (
                f"{backend}: saturation >= 0.93 x limit ({rate / limit:.3f}; "
                f"{rate / direct:.3f} x the batch fn back to back)",
                rate / limit >= 0.93,
            )
        )
        for name in (
            f"aloader Batcher ({backend})",
            f"aloader Batcher, with a timeout ({backend})",
        ):
            p50, p99 = low[name][:2]
            checks.append((f"{name}: low-load added p50 < 0.2 ms ({p50 * 1e6:.1f} us)", p50 < 2e-4))
            checks.append((f"{name}: low-load added p99 < 100 us ({p99 * 1e6:.1f} us)", p99 < 1e-4))
        unbatched = sat[f"unbatched: one model call per request ({backend})"][0]
        checks.append(
            (
                f"{backend}: batcher >= 3 x the unbatched model ({rate / unbatched:.1f} x)",
                rate / unbatched >= 3,
            )
        )
    budget = tok[f"aloader Batcher, token budget: cost=len, max_batch_cost={TOKEN_BUDGET}"]
    safe = tok[f"aloader Batcher, fixed size {TOKEN_BUDGET // 1024} (safe for the longest)"]
    checks += [
        (
            f"token budget: tokens/s {budget[0] / safe[0]:.2f} x fixed-size safe, p99 "
            f"{budget[2] * 1e3:.0f} ms vs {safe[2] * 1e3:.0f} ms, no batch over the budget",
            budget[0] > safe[0] and budget[2] < safe[2] and budget[4] == 0,
        ),
        ("rejection p99 < 1 ms", over["reject_p99"] < 0.001),
        (
            "memory bounded under overload",
            over["aloader_flood"][-1][0] < 1.5 * over["aloader_flood"][0][0] + 1e6,
        ),
    ]
    print("\n" + "\n".join(f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in checks))


if __name__ == "__main__":
    main()
