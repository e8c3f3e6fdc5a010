"""Streaming JSON Lines shards over HTTP and from local files.

Run: ``python benchmarks/bench_sources.py [--http-only] [--no-torch] [--breakdown]
[--profile] [--count PROGRAM]``.
Everything below is measured in the same run.

HTTP: 64 shards of 1,000 JSON Lines records (~106 bytes each) served by a local HTTP server
(a separate process, ``aloader._demo.ShardServer``) that waits 20 ms before answering each
request. One epoch, batches of 256, best of 3, every program run once in each round (the
parse floor three times: its best of 9, the limit being the figure luck moves most),
interleaved:

* aloader: ``DataLoader(JsonLines(urls, concurrency=16), batch_size=256)`` on one event loop.
* PyTorch: ``torch.utils.data.DataLoader`` over an ``IterableDataset`` whose workers each fetch
  their share of the URLs with ``urllib.request`` (blocking) and ``json.loads`` every line,
  ``num_workers`` 0, 2 and 8 (workers started by each epoch, as by default).
* limit: one event loop cannot beat both (a) the latency floor, 64 requests x 20 ms / 16 in
  flight, and (b) the parse floor, the time to turn the same bytes into records and batches in
  memory on one core (aloader's chunk parser + ``default_collate``, measured here). The limit
  is ``max(a, b)`` (perfect overlap of waiting and parsing); ``a + b`` (no overlap) is shown
  too. Both aloader rows are quoted against it (the targets: 0.7x in one process,
  0.85x with 2 worker processes). The load average is printed with the table: the server
  and the loader share the machine's cores, and so does anything else running.
* no loader (the fastest honest program for the same work): aiohttp on one session, a
  sliding window of 16 requests, each body parsed and collated in order as the floor does
  (``no_loader``); and the bare fetch alone (aiohttp, 16 in flight, no parsing), which shows
  what the server and the client deliver without parsing (the latency floor's real value).
* the 2-worker row's CPU: per epoch (median), this process's, each worker's and the server's
  CPU time (``/proc``), and the bound they set together: all four share the machine's cores,
  so the epoch takes at least their CPU sum over the cores; quoted against the limit, that is
  the most the row can reach on this machine however the loader overlaps its work.
* first-response bound: no program parses a record before its first response, so
  ``latency + parse`` (one request's wait, then the parse floor) bounds every program in one
  process; the limit ``max(a, b)`` assumes the parsing overlaps that first wait too. Nor can
  it parse without its HTTP client's CPU on the same core: ``latency + parse + the bare
  fetch's CPU time`` ("with the client's CPU") is the tightest bound of the three; the CPU
  time of this process per epoch is printed for aloader, the no-loader program and the floor.

``--profile`` adds the CPU difference by function between aloader and the no-loader
program (cProfile over 3 epochs each, the two programs' epochs interleaved: own time per
epoch and calls per epoch, the largest differences first; cProfile inflates Python-level
costs, so read it for where, not how much).

``--count PROGRAM`` (``aloader``, ``no-loader``, ``floor`` or ``fetch``) runs a warm-up epoch
of one program, then 2 epochs between two ``os.getppid()`` calls, and prints nothing: run it
under ``valgrind --tool=callgrind --dump-before=os_getppid --callgrind-out-file=x.out`` and
``x.out.2`` holds the instructions of those 2 epochs by function, a count that a busy machine
does not move (``callgrind_annotate --inclusive=no x.out.2``). ``--count workers`` does the
same for the 2-worker row (persistent workers, forked: the template of the default start
method cannot start under valgrind), its source calling ``os.getppid()`` as each worker's
epoch starts: with ``--callgrind-out-file=x.%p.out``, the loader's ``x.PID.out.2`` holds its 2
epochs, and each worker's ``x.PID.out.3`` and ``.4`` one epoch each (a warm-up, 2 counted
epochs and a last one run).

``--breakdown`` adds where one HTTP epoch's time goes: the parse floor's two halves alone,
the bare HTTP client fetching the same bodies (aiohttp, 16 at once, one session), the
no-loader program (the same fetches, parsed and collated), aloader over
local files holding the same bytes (the loader without HTTP), and aloader over HTTP; each with
its wall time, this process's CPU time and the cyclic garbage collector's time, interleaved,
best of 5 (the server's CPU is its own process's).

Local files (``python benchmarks/bench_sources.py local`` runs only these): the same records
in 32 files of 20,000 lines (~68 MB, in the page cache), read with ``TextLines`` and
``JsonLines`` (``async for`` over every record, one event loop) against plain loops over the
same files: ``for line in open(f)``, and ``json.loads(line)`` in it. Candidate JSON parsers in
the same plain loop (msgspec per line and per chunk with ``decode_lines``, orjson per line,
when installed) show why JsonLines parses with msgspec, and ``async for`` over the same lines
already in memory shows what the iteration protocol alone costs per item (through a Python
``__anext__``, and through an async generator; the lines are those of 4 files, repeated).
``TextLines`` is measured under ``async for`` and under a plain ``for`` (its sync iterator,
which reads and splits on the consumer's thread with no event loop), and batched by a
``DataLoader`` (``batch_size=256``, lines counted per batch) both ways (its sync ``for``, the
drop-in shape, on the consumer's thread too, batched and collated inline), against the plain
loop and against the plain loop handing on lists of 256 lines;
the "no loader" rows are its limits: the same 64 KiB reads split into lines by a bare
program, handed over by an async generator (what ``async for`` costs per line at the least)
and by a plain loop. Every figure is the best of 3, the programs interleaved in each round.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# The aloader of the checkout this script is in, not whichever one is installed (a worktree's
# run would otherwise measure the editable install's): before anything imports it.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import anyio
from common import (
    BATCH,
    CONCURRENCY,
    LATENCY,
    RECORDS,
    RUNS,
    SHARDS,
    TOTAL,
    best,
    count_torch,
    run_aloader,
    serve_shards,
)

import aloader
from aloader import DataLoader, JsonLines, TextLines, default_collate
from aloader._demo import make_jsonl_shards
from aloader._stats import SourceStats
from aloader.sources._formats import BadRecords


def _cpu_of(pid: int) -> float:
    """CPU seconds (user and system) that process ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class WorkerEpochs:
    """Epochs of one loader with 2 persistent worker processes, each parsing its own shards;
    each epoch's CPU time is kept per process (this one, each worker, the server ``server``)
    where ``/proc`` tells it, for :meth:`summary`."""

    def __init__(self, urls: list[str], server: int) -> None:
        self.loader = DataLoader(JsonLines(urls, concurrency=CONCURRENCY), batch_size=BATCH,
                                 num_workers=2, persistent_workers=True, prefetch_factor=4,
                                 in_order=False)
        self.server = server
        self.cpu: list[tuple[float, float, list[float], float]] = []  # wall, main, workers, server

    def __call__(self) -> int:
        async def epoch() -> int:
            count = 0
            async for batch in self.loader:
                count += len(batch["id"])
            return count

        pool = self.loader._pool
        pids = [w.process.pid for w in pool.workers] if pool is not None else []
        try:
            before = [_cpu_of(pid) for pid in (*pids, self.server)]
        except OSError:  # no /proc: no CPU figures
            before = []
        main, wall = time.process_time(), time.perf_counter()
        count = anyio.run(epoch)
        main, wall = time.process_time() - main, time.perf_counter() - wall
        if before and pids:  # not the first epoch, which starts the workers
            after = [_cpu_of(pid) for pid in (*pids, self.server)]
            spent = [b - a for a, b in zip(before, after, strict=True)]
            self.cpu.append((wall, main, spent[:-1], spent[-1]))
        return count

    def summary(self, limit_seconds: float) -> str:
        """Where the 2-worker epoch's CPU goes (medians over the timed epochs), and the bound
        it sets: the CPU of all four processes over the 2 cores, as a fraction of the limit."""
        if not self.cpu:
            return "2 workers: no CPU figures (no /proc)"
        import statistics

        wall = statistics.median(c[0] for c in self.cpu)
        main = statistics.median(c[1] for c in self.cpu)
        workers = [statistics.median(c[2][k] for c in self.cpu)
                   for k in range(len(self.cpu[0][2]))]
        server = statistics.median(c[3] for c in self.cpu)
        total = main + sum(workers) + server
        cores = os.cpu_count() or 1
        bound = min(1.0, limit_seconds / (total / cores)) if total else 1.0
        return (f"2 workers, CPU per epoch (median of {len(self.cpu)}): main "
                f"{main * 1e3:.0f} ms, workers "
                + " + ".join(f"{w * 1e3:.0f}" for w in workers)
                + f" ms, server {server * 1e3:.0f} ms, wall {wall * 1e3:.0f} ms; all four over "
                f"{cores} cores: {total / cores * 1e3:.0f} ms, so at most {bound:.2f}x the limit")


def torch_loader(urls: list[str], workers: int, persistent: bool = False) -> Any:
    import urllib.request

    import torch.utils.data as tud

    class UrlJsonLines(tud.IterableDataset):  # type: ignore[type-arg,misc]
        def __iter__(self) -> Any:
            info = tud.get_worker_info()
            mine = urls if info is None else urls[info.id :: info.num_workers]
            for url in mine:
                with urllib.request.urlopen(url) as response:
                    for line in response:
                        yield json.loads(line)

    return tud.DataLoader(UrlJsonLines(), batch_size=BATCH, num_workers=workers,
                          persistent_workers=persistent)


def run_torch(urls: list[str], workers: int) -> int:
    return count_torch(torch_loader(urls, workers))


class _Batches:
    """The parse floor's consumer: records decoded from each body the way ``JsonLines``
    decodes it (the decoder it makes, ``_decoder``, fed pieces of its ``piece`` size, 16 KiB,
    which the GC finds cheaper than 64 KiB ones: so the floor parses with whatever parser and
    pieces aloader uses, and a faster parse makes a tighter limit), collated in batches of
    BATCH across bodies; ``count`` is the records batched."""

    def __init__(self) -> None:
        self.source = JsonLines(["http://127.0.0.1/x.jsonl"])
        self.stats = SourceStats()
        self.count = 0
        self.pending: list[Any] = []

    def feed(self, body: bytes) -> None:
        decoder = self.source._decoder("x", BadRecords(False, self.stats))
        piece = decoder.piece or 1 << 16
        pending = self.pending
        for start in range(0, len(body), piece):
            pending.extend(decoder.feed(body[start : start + piece]))
            while len(pending) >= BATCH:
                default_collate(pending[:BATCH])
                self.count += BATCH
                del pending[:BATCH]

    def finish(self) -> int:
        if self.pending:
            default_collate(self.pending)
            self.count += len(self.pending)
            self.pending = []
        return self.count


def parse_work(bodies: list[bytes]) -> Callable[[], int]:
    """The parse floor's work: decode all bodies (as 64 KiB network reads) and collate them
    in batches (:class:`_Batches`); returns the records."""

    def work() -> int:
        batches = _Batches()
        for body in bodies:
            batches.feed(body)
        return batches.finish()

    return work


def no_loader(urls: list[str]) -> int:
    """The whole HTTP workload with no loader, as tight as one event loop can run it: aiohttp
    on one session, a sliding window of CONCURRENCY requests (the next one sent as each body
    is taken), the bodies parsed and collated in order (:class:`_Batches`). The fastest
    honest program for the same work: it has to wait for the first response too, and pays
    the HTTP client's CPU on the same core as the parsing."""
    import asyncio

    import aiohttp

    async def main() -> int:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=CONCURRENCY)) as session:

            async def body(url: str) -> bytes:
                async with session.get(url) as response:
                    return await response.read()

            queue = iter(urls)
            window = deque(asyncio.ensure_future(body(url))
                           for url in itertools.islice(queue, CONCURRENCY))
            batches = _Batches()
            while window:
                data = await window.popleft()
                if (url := next(queue, None)) is not None:
                    window.append(asyncio.ensure_future(body(url)))
                batches.feed(data)
            return batches.finish()

    return asyncio.run(main())


def parse_floor(bodies: list[bytes]) -> float:
    """Best seconds of :func:`parse_work` over the benchmark's runs."""
    seconds, items = best(parse_work(bodies))
    assert items == TOTAL
    return seconds


def interleaved(programs: list[tuple[str, Callable[[], int]]], runs: int = RUNS,
                cpu: dict[str, float] | None = None) -> dict[str, float]:
    """Best seconds of each program over ``runs`` rounds, each round running every program
    once in turn (so that a busy spell of the machine hits them all alike); with ``cpu``,
    each program's least CPU time of this process (seconds) is put there too."""
    seconds = {label: float("inf") for label, _ in programs}
    for _ in range(runs):
        for label, fn in programs:
            start, used = time.perf_counter(), time.process_time()
            items = fn()
            seconds[label] = min(seconds[label], time.perf_counter() - start)
            if cpu is not None:
                cpu[label] = min(cpu.get(label, float("inf")), time.process_time() - used)
            assert items == TOTAL, (label, items, TOTAL)
    return seconds


def _bare_fetch(urls: list[str]) -> int:
    """The 64 bodies through aiohttp alone, CONCURRENCY at once on one session: the HTTP
    client's own cost in an epoch. Returns TOTAL (the bytes are checked, not parsed)."""
    import asyncio

    import aiohttp

    async def main() -> int:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=CONCURRENCY)) as session:
            slots = asyncio.Semaphore(CONCURRENCY)

            async def one(url: str) -> int:
                async with slots, session.get(url) as response:
                    lines = 0
                    while piece := await response.content.readany():
                        lines += piece.count(b"\n")
                    return lines

            return sum(await asyncio.gather(*(one(url) for url in urls)))

    return asyncio.run(main())


def breakdown(urls: list[str], bodies: list[bytes], runs: int = 5) -> list[str]:
    """The lines of a table of where one HTTP epoch's time goes (see the module's
    docstring)."""
    import gc

    source = JsonLines(["http://127.0.0.1/x.jsonl"])
    records: list[Any] = []
    for body in bodies:
        decoder = source._decoder("x", BadRecords(False, SourceStats()))
        piece = decoder.piece or 1 << 16
        for start in range(0, len(body), piece):
            records.extend(decoder.feed(body[start : start + piece]))

    def parse_only() -> int:
        count = 0
        for body in bodies:
            decoder = source._decoder("x", BadRecords(False, SourceStats()))
            for start in range(0, len(body), piece):
                count += len(decoder.feed(body[start : start + piece]))
        return count

    def collate_only() -> int:
        for start in range(0, len(records), BATCH):
            default_collate(records[start : start + BATCH])
        return len(records)

    with tempfile.TemporaryDirectory() as directory:
        for i, body in enumerate(bodies):
            with open(os.path.join(directory, f"shard-{i:05d}.jsonl"), "wb") as f:
                f.write(body)

        def local() -> int:
            return run_aloader([directory])

        programs: list[tuple[str, Callable[[], int]]] = [
            ("parse only (JsonLinesDecoder.feed, its pieces)", parse_only),
            ("collate only (default_collate, batches of 256)", collate_only),
            ("parse floor (both)", parse_work(bodies)),
            ("bare aiohttp fetch of the bodies", lambda: _bare_fetch(urls)),
            ("no loader: aiohttp + parse + collate", lambda: no_loader(urls)),
            ("aloader JsonLines over local files", local),
            ("aloader JsonLines over HTTP", lambda: run_aloader(urls)),
        ]
        gc_time = [0.0, 0.0]  # total, start of the collection under way

        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                gc_time[1] = time.perf_counter()
            else:
                gc_time[0] += time.perf_counter() - gc_time[1]

        best_of: dict[str, tuple[float, float, float]] = {}
        for _, fn in programs:
            fn()  # warm-up
        gc.callbacks.append(on_gc)
        try:
            for _ in range(runs):
                for label, fn in programs:
                    gc_time[0] = 0.0
                    wall, cpu = time.perf_counter(), time.process_time()
                    items = fn()
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    assert items == TOTAL, (label, items)
                    if label not in best_of or wall < best_of[label][0]:
                        best_of[label] = (wall, cpu, gc_time[0])
        finally:
            gc.callbacks.remove(on_gc)
    lines = [f"Where an HTTP epoch's time goes (best wall of {runs}, interleaved; load "
             f"average {os.getloadavg()[0]:.2f})",
             f"{'':52} {'wall ms':>8} {'cpu ms':>8} {'gc ms':>8}"]
    for label, (wall, cpu, gc_seconds) in best_of.items():
        lines.append(f"{label:52} {wall * 1e3:>8.1f} {cpu * 1e3:>8.1f} "
                     f"{gc_seconds * 1e3:>8.1f}")
    floor_cpu = best_of["parse floor (both)"][1]
    local_cpu = best_of["aloader JsonLines over local files"][1]
    http_wall, http_cpu, _ = best_of["aloader JsonLines over HTTP"]
    bare_cpu = best_of["no loader: aiohttp + parse + collate"][1]
    lines += [
        f"the loader beyond the no-loader program (cpu): {(http_cpu - bare_cpu) * 1e3:6.1f} ms",
        f"loader without HTTP, beyond the floor (cpu):  {(local_cpu - floor_cpu) * 1e3:6.1f} ms",
        f"HTTP in the loader (cpu, over local files):   {(http_cpu - local_cpu) * 1e3:6.1f} ms",
        f"idle in the HTTP epoch (wall - cpu):          {(http_wall - http_cpu) * 1e3:6.1f} ms",
        f"floor cpu / HTTP epoch cpu:                   {floor_cpu / http_cpu:6.2f}x (the ratio "
        "to the parse bound if the epoch never waited; less sensitive to a busy machine)",
    ]
    return lines


def profile_difference(urls: list[str], epochs: int = 3, top: int = 30) -> list[str]:
    """The lines of a table of aloader's CPU beyond the no-loader program's, by function
    (see the module's docstring)."""
    import cProfile
    import pstats

    def per_function(profile: cProfile.Profile) -> dict[str, tuple[int, float]]:
        table: dict[str, tuple[int, float]] = {}
        stats: Any = pstats.Stats(profile).stats
        for (path, _line, name), (_, calls, own, _, _) in stats.items():
            key = f"{os.path.basename(path)}:{name}"
            count, seconds = table.get(key, (0, 0.0))
            table[key] = (count + calls, seconds + own)
        return table

    # One profile per program, their epochs interleaved (a busy spell of the machine hits
    # both alike, as in the table's rounds).
    programs = [(lambda: run_aloader(urls), cProfile.Profile()),
                (lambda: no_loader(urls), cProfile.Profile())]
    for fn, _ in programs:
        fn()  # warm-up
    for _ in range(epochs):
        for fn, profile in programs:
            profile.enable()
            fn()
            profile.disable()
    ours, theirs = (per_function(profile) for _, profile in programs)

    def own(table: dict[str, tuple[int, float]], key: str) -> float:
        return table.get(key, (0, 0.0))[1]

    keys = sorted(set(ours) | set(theirs), key=lambda k: own(theirs, k) - own(ours, k))
    lines = [f"CPU by function, aloader beyond the no-loader program (cProfile, {epochs} epochs "
             f"each; per epoch; load average {os.getloadavg()[0]:.2f})",
             f"{'':60} {'aloader':>8} {'no-ldr':>8} {'diff ms':>8} {'calls':>7} {'calls':>7}"]
    for key in keys[:top]:
        a, b = ours.get(key, (0, 0.0)), theirs.get(key, (0, 0.0))
        lines.append(f"{key[:60]:60} {a[1] / epochs * 1e3:>8.1f} {b[1] / epochs * 1e3:>8.1f} "
                     f"{(a[1] - b[1]) / epochs * 1e3:>8.1f} {a[0] // epochs:>7} "
                     f"{b[0] // epochs:>7}")
    total_a = sum(v[1] for v in ours.values()) / epochs * 1e3
    total_b = sum(v[1] for v in theirs.values()) / epochs * 1e3
    lines.append(f"{'total (profiled)':60} {total_a:>8.1f} {total_b:>8.1f} "
                 f"{total_a - total_b:>8.1f}")
    return lines


def local_files(bodies: list[bytes]) -> list[tuple[str, float, str]]:
    """(label, lines/s, the label of the plain loop it compares with) of plain loops and
    aloader's sources over the same local files, interleaved, best of RUNS."""
    with tempfile.TemporaryDirectory() as directory:
        paths = []
        for i in range(32):
            path = os.path.join(directory, f"part-{i:03d}.jsonl")
            with open(path, "wb") as f:
                f.write(b"".join(bodies[(i * 20 + k) % SHARDS] for k in range(20)))
            paths.append(path)
        total = 0
        for path in paths:
            with open(path, "rb") as f:
                total += sum(1 for _ in f)

        def plain_lines() -> int:
            n = 0
            for path in paths:
                with open(path) as f:
                    for _line in f:
                        n += 1
            return n

        def plain_batched() -> int:
            """The plain loop handing on lists of 256 lines, as the loader's batches (the
            drop-in shape without a loader: a torch user's batches of an iterable)."""
            n = 0
            for path in paths:
                with open(path) as f:
                    batch: list[str] = []
                    for line in f:
                        batch.append(line)
                        if len(batch) == 256:
                            n += len(batch)
                            batch = []
                    n += len(batch)
            return n

        def plain_json() -> int:
            n = 0
            for path in paths:
                with open(path) as f:
                    for line in f:
                        json.loads(line)
                        n += 1
            return n

        def per_line(parse: Callable[[bytes], Any]) -> Callable[[], int]:
            def run() -> int:
                n = 0
                for path in paths:
                    with open(path, "rb") as f:
                        for line in f:
                            parse(line)
                            n += 1
                return n

            return run

        def decode_lines() -> int:
            import msgspec

            decoder = msgspec.json.Decoder()
            n = 0
            for path in paths:
                with open(path, "rb") as f:
                    carry = b""
                    while chunk := f.read(1 << 16):
                        chunk = carry + chunk
                        cut = chunk.rfind(b"\n") + 1
                        n += len(decoder.decode_lines(chunk[:cut]))
                        carry = chunk[cut:]
                    n += len(decoder.decode_lines(carry))
            return n

        def in_memory() -> Callable[[bool], int]:
            lines: list[str] = []
            for path in paths[:4]:
                with open(path) as f:
                    lines.extend(f)
            lines *= len(paths) // 4

            async def items() -> Any:
                for line in lines:
                    yield line

            class Items:
                """The cheapest ``__anext__`` a Python iterator can have, as aloader's."""

                def __init__(self) -> None:
                    self.pos = 0

                def __aiter__(self) -> Items:
                    return self

                async def __anext__(self) -> str:
                    pos = self.pos
                    if pos < len(lines):
                        self.pos = pos + 1
                        return lines[pos]
                    raise StopAsyncIteration

            def run(generator: bool) -> int:
                async def epoch() -> int:
                    n = 0
                    async for _ in items() if generator else Items():
                        n += 1
                    return n

                return anyio.run(epoch)

            assert len(lines) == total
            return run

        def source(cls: Any) -> Callable[[], int]:
            def run() -> int:
                async def epoch() -> int:
                    n = 0
                    async for _ in cls(directory):
                        n += 1
                    return n

                return anyio.run(epoch)

            return run

        def sync_source(cls: Any) -> Callable[[], int]:
            def run() -> int:
                n = 0
                for _ in cls(directory):
                    n += 1
                return n

            return run

        def loader(sync: bool) -> Callable[[], int]:
            def run() -> int:
                if sync:
                    return sum(len(batch) for batch in
                               DataLoader(TextLines(directory), batch_size=256))

                async def epoch() -> int:
                    n = 0
                    async for batch in DataLoader(TextLines(directory), batch_size=256):
                        n += len(batch)
                    return n

                return anyio.run(epoch)

            return run

        def blocks_of_lines() -> Any:
            """The lines of every file as TextLines makes them, with no loader: 64 KiB reads,
            each split into its complete lines (the floor of any block-wise reader)."""
            for path in paths:
                with open(path, "rb") as f:
                    carry = b""
                    while chunk := f.read(1 << 16):
                        chunk = carry + chunk
                        cut = chunk.rfind(b"\n")
                        yield chunk[:cut].decode().split("\n")
                        carry = chunk[cut + 1 :]
                    if carry:
                        yield [carry.decode()]

        def split_for() -> int:
            n = 0
            for block in blocks_of_lines():
                for _line in block:
                    n += 1
            return n

        def split_async_for() -> int:
            async def items() -> Any:
                for block in blocks_of_lines():
                    for line in block:
                        yield line

            async def epoch() -> int:
                n = 0
                async for _ in items():
                    n += 1
                return n

            return anyio.run(epoch)

        plain, plain_j = "plain loop: for line in open(f)", "plain loop: json.loads(line)"
        memory = in_memory()
        programs: list[tuple[str, Callable[[], int], str]] = [
            (plain, plain_lines, plain),
            ("plain loop: for line in open(f), in lists of 256", plain_batched, plain),
            ("aloader TextLines(dir)", source(TextLines), plain),
            ("aloader TextLines(dir), sync for", sync_source(TextLines), plain),
            ("aloader DataLoader(TextLines(dir), batch_size=256)", loader(False), plain),
            ("aloader DataLoader(TextLines(dir), batch_size=256), sync for", loader(True),
             plain),
            ("no loader: 64 KiB reads split, async generator", split_async_for, plain),
            ("no loader: 64 KiB reads split, for", split_for, plain),
            ("async for, a Python __anext__, lines in memory", lambda: memory(False), plain),
            ("async for, an async generator, lines in memory", lambda: memory(True), plain),
            (plain_j, plain_json, plain_j),
            ("aloader JsonLines(dir)", source(JsonLines), plain_j),
        ]
        try:
            import msgspec
        except ImportError:
            print("msgspec is not installed: its rows are skipped", file=sys.stderr)
        else:
            programs += [
                ("plain loop: msgspec decode(line)", per_line(msgspec.json.Decoder().decode),
                 plain_j),
                ("plain loop: msgspec decode_lines(64 KiB)", decode_lines, plain_j),
            ]
        try:
            import orjson
        except ImportError:
            print("orjson is not installed: its row is skipped", file=sys.stderr)
        else:
            programs.append(("plain loop: orjson.loads(line)", per_line(orjson.loads), plain_j))
        seconds = {label: float("inf") for label, _, _ in programs}
        for _ in range(RUNS):
            for label, fn, _ in programs:
                start = time.perf_counter()
                items = fn()
                seconds[label] = min(seconds[label], time.perf_counter() - start)
                assert items == total, (label, items, total)
        return [(label, total / seconds[label], base) for label, _, base in programs]


def print_local_files(bodies: list[bytes]) -> None:
    """Measure and print the local files' table."""
    print(f"Local files: 32 files x 20,000 JSON Lines records (~68 MB), best of {RUNS}, "
          "interleaved")
    print(f"{'':64} {'lines/s':>11} {'vs plain':>10}")
    rows = local_files(bodies)
    rates = {label: rate for label, rate, _ in rows}
    for label, rate, base in rows:
        print(f"{label:64} {rate:>11,.0f} {rate / rates[base]:>9.2f}x")
    batched = rates["plain loop: for line in open(f), in lists of 256"]
    for label in ("aloader DataLoader(TextLines(dir), batch_size=256)",
                  "aloader DataLoader(TextLines(dir), batch_size=256), sync for"):
        print(f"{label}: {rates[label] / batched:.2f}x of the plain loop batched the same")
    print("load average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))


class _MarkedJsonLines(JsonLines):
    """JsonLines whose every epoch in a worker starts with ``os.getppid()``: callgrind's dump
    marker (see ``--count workers``)."""

    def _blocks_at(self, ctx: Any, at: Any) -> Any:
        os.getppid()
        return super()._blocks_at(ctx, at)


def _count_workers(urls: list[str]) -> None:
    """``--count workers``: a warm-up epoch with 2 persistent (forked) workers, 2 epochs
    between two ``os.getppid()`` calls, and one more (the workers' markers, see the module's
    docstring)."""
    loader = DataLoader(_MarkedJsonLines(urls, concurrency=CONCURRENCY), batch_size=BATCH,
                        num_workers=2, persistent_workers=True, prefetch_factor=4,
                        in_order=False, multiprocessing_context="fork")

    async def epoch() -> int:
        count = 0
        async for batch in loader:
            count += len(batch["id"])
        return count

    assert anyio.run(epoch) == TOTAL
    os.getppid()
    for _ in range(2):
        assert anyio.run(epoch) == TOTAL
    os.getppid()
    assert anyio.run(epoch) == TOTAL  # the workers' second counted epoch ends as it starts


COUNTED = {
    "aloader": lambda urls, bodies: run_aloader(urls),
    "no-loader": lambda urls, bodies: no_loader(urls),
    "floor": lambda urls, bodies: parse_work(bodies)(),
    "fetch": lambda urls, bodies: _bare_fetch(urls),
}


def count_epochs(program: str, urls: list[str], bodies: list[bytes], epochs: int = 2) -> None:
    """A warm-up epoch of ``program`` (a key of :data:`COUNTED`), then ``epochs`` epochs
    between two calls of ``os.getppid()``, a marker for callgrind: under ``valgrind
    --tool=callgrind --dump-before=os_getppid``, the second dump holds exactly those epochs'
    instructions, by function (the server runs in its own process, not counted)."""
    if program == "workers":
        _count_workers(urls)
        return
    run = COUNTED[program]
    run(urls, bodies)
    os.getppid()
    for _ in range(epochs):
        assert run(urls, bodies) == TOTAL
    os.getppid()


def main() -> None:
    """Measure and print the tables."""
    context = multiprocessing.get_context("spawn")
    port_queue = context.Queue()
    stop = context.Event()
    process = context.Process(target=serve_shards,
                              args=(port_queue, stop), daemon=True)
    process.start()
    port = port_queue.get(timeout=60)
    names = sorted(make_jsonl_shards(SHARDS, RECORDS))
    urls = [f"http://127.0.0.1:{port}/{name}" for name in names]
    bodies = list(make_jsonl_shards(SHARDS, RECORDS).values())

    if "--count" in sys.argv:
        try:
            count_epochs(sys.argv[sys.argv.index("--count") + 1], urls, bodies)
        finally:
            stop.set()
            process.join(timeout=10)
        return

    torch_rows = "--no-torch" not in sys.argv
    if torch_rows:
        try:
            import torch  # noqa: F401 - only to know whether the anchor can run
        except ImportError:
            print("torch is not installed: the PyTorch rows are skipped", file=sys.stderr)
            torch_rows = False
    one = f"aloader JsonLines(concurrency={CONCURRENCY}) + DataLoader"
    two = "aloader, 2 persistent workers, in_order=False"
    floor = "parse floor"
    bare = f"no loader: aiohttp, {CONCURRENCY} in flight, parse + collate"
    fetch = f"bare aiohttp fetch, {CONCURRENCY} in flight, no parsing"
    load_before = os.getloadavg()
    persistent: Any = None
    try:
        run_aloader(urls)  # warm-up: imports, connections, thread pools
        # Worker processes, started once and kept (a warm-up epoch first, on both sides).
        run_workers = WorkerEpochs(urls, process.pid)
        run_workers()
        programs: list[tuple[str, Callable[[], int]]] = [
            (one, lambda: run_aloader(urls)),
            (two, run_workers),
            # The floor three times a round (its best of 3 * RUNS): it is the limit, the
            # figure a lucky or unlucky run moves most, and it is cheap.
            *[(floor, parse_work(bodies))] * 3,
            (bare, lambda: no_loader(urls)),
            (fetch, lambda: _bare_fetch(urls)),
        ]
        if torch_rows:
            for workers in (0, 2, 8):
                programs.append((f"PyTorch DataLoader, urllib, num_workers={workers}",
                                 lambda w=workers: run_torch(urls, w)))  # type: ignore[misc]
            persistent = torch_loader(urls, 8, persistent=True)
            count_torch(persistent)
            programs.append(("PyTorch DataLoader, urllib, 8 persistent workers",
                             lambda: count_torch(persistent)))
        cpu: dict[str, float] = {}
        seconds = interleaved(programs, cpu=cpu)
        where = breakdown(urls, bodies) if "--breakdown" in sys.argv else []
        if "--profile" in sys.argv:
            where += ["", *profile_difference(urls)]
    finally:
        persistent = None  # its workers stop with it
        stop.set()
        process.join(timeout=10)
    load_after = os.getloadavg()
    latency_floor = SHARDS * LATENCY / CONCURRENCY
    parse = seconds.pop(floor)
    limit = TOTAL / max(latency_floor, parse)
    rows = [(label, TOTAL / seconds[label]) for label, _ in programs
            if label in seconds and label != floor]
    rows.append((f"limit max(latency {latency_floor * 1e3:.0f} ms, parse "
                 f"{parse * 1e3:.0f} ms)", limit))
    rows.append(("no-overlap bound (latency + parse)", TOTAL / (latency_floor + parse)))
    # No program parses before its first response: one request's latency + parse bounds any.
    first_wait = TOTAL / (LATENCY + parse)
    rows.append((f"first-response bound (latency {LATENCY * 1e3:.0f} ms + parse)", first_wait))
    # Nor without paying the HTTP client's CPU on the same core: the bare fetch's CPU.
    client = cpu[fetch]
    with_client = TOTAL / (LATENCY + parse + client)
    rows.append((f"with the client's CPU (+ bare fetch's {client * 1e3:.0f} ms)", with_client))
    torch_8 = seconds.get("PyTorch DataLoader, urllib, num_workers=8")

    print(f"HTTP: {SHARDS} shards x {RECORDS:,} JSON Lines records, {LATENCY * 1e3:.0f} ms per "
          f"request, batch {BATCH}, best of {RUNS}, interleaved; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after ({os.cpu_count()} cores); "
          f"aloader from {os.path.dirname(os.path.dirname(aloader.__file__))}")
    print(f"{'':58} {'items/s':>11} {'vs torch-8':>10} {'of limit':>9}")
    for label, rate in rows:
        vs = f"{rate * torch_8 / TOTAL:.2f}x" if torch_8 else "-"
        print(f"{label:58} {rate:>11,.0f} {vs:>10} {rate / limit:>8.0%}")
    for label, target in ((one, 0.7), (two, 0.85)):
        ratio = TOTAL / seconds[label] / limit
        print(f"{label}: {ratio:.2f}x the limit (target {target}x: "
              f"{'met' if ratio >= target else 'NOT met'})")
    print(run_workers.summary(TOTAL / limit))
    print(f"{bare}: {TOTAL / seconds[bare] / limit:.2f}x the limit, "
          f"{TOTAL / seconds[bare] / first_wait:.2f}x the first-response bound; {one}: "
          f"{seconds[bare] / seconds[one]:.2f}x of the no-loader program, "
          f"{TOTAL / seconds[one] / first_wait:.2f}x the first-response bound, "
          f"{TOTAL / seconds[one] / with_client:.2f}x with the client's CPU; CPU per epoch "
          f"(least of {RUNS}): {one} {cpu[one] * 1e3:.0f} ms, {bare} {cpu[bare] * 1e3:.0f} ms, "
          f"{floor} {cpu[floor] * 1e3:.0f} ms")
    if where:
        print()
        print("\n".join(where))

    if "--http-only" in sys.argv:
        return
    print()
    print_local_files(bodies)


if __name__ == "__main__":
    if sys.argv[1:] == ["local"]:
        print_local_files(list(make_jsonl_shards(SHARDS, RECORDS).values()))
    else:
        main()
