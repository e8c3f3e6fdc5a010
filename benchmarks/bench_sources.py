"""Streaming JSON Lines shards over HTTP and from local files.

Run: ``python benchmarks/bench_sources.py [--http-only] [--no-torch]``. Everything below is
measured in the same run.

HTTP: 64 shards of 1,000 JSON Lines records (~106 bytes each) served by a local HTTP server
(a separate process, ``aloader._demo.ShardServer``) that waits 20 ms before answering each
request. One epoch, batches of 256, best of 3:

* aloader: ``DataLoader(JsonLines(urls, concurrency=16), batch_size=256)`` on one event loop.
* PyTorch: ``torch.utils.data.DataLoader`` over an ``IterableDataset`` whose workers each fetch
  their share of the URLs with ``urllib.request`` (blocking) and ``json.loads`` every line,
  ``num_workers`` 0, 2 and 8 (workers started by each epoch, as by default).
* limit: one event loop cannot beat both (a) the latency floor, 64 requests x 20 ms / 16 in
  flight, and (b) the parse floor, the time to turn the same bytes into records and batches in
  memory on one core (aloader's chunk parser + ``default_collate``, measured here). The limit
  is ``max(a, b)`` (perfect overlap of waiting and parsing); ``a + b`` (no overlap) is shown
  too.

Local files (``python benchmarks/bench_sources.py local`` runs only these): the same records
in 32 files of 20,000 lines (~68 MB, in the page cache), read with ``TextLines`` and
``JsonLines`` (``async for`` over every record, one event loop) against plain loops over the
same files: ``for line in open(f)``, and ``json.loads(line)`` in it. Candidate JSON parsers in
the same plain loop (msgspec per line and per chunk with ``decode_lines``, orjson per line,
when installed) show why JsonLines parses with msgspec, and ``async for`` over the same lines
already in memory shows what the iteration protocol alone costs per item (through a Python
``__anext__``, and through an async generator; the lines are those of 4 files, repeated).
``TextLines`` is measured under ``async for`` and under a plain ``for`` (its sync iterator);
the "no loader" rows are its limits: the same 64 KiB reads split into lines by a bare
program, handed over by an async generator (what ``async for`` costs per line at the least)
and by a plain loop. Every figure is the best of 3, the programs interleaved in each round.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

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

from aloader import DataLoader, JsonLines, TextLines, default_collate
from aloader._demo import make_jsonl_shards
from aloader._formats import BadRecords, SourceStats


def aloader_workers(urls: list[str]) -> Callable[[], int]:
    """Epochs of one loader with 2 persistent worker processes, each parsing its own shards."""
    loader = DataLoader(JsonLines(urls, concurrency=CONCURRENCY), batch_size=BATCH,
                        num_workers=2, persistent_workers=True, prefetch_factor=4,
                        in_order=False)

    def run() -> int:
        async def epoch() -> int:
            count = 0
            async for batch in loader:
                count += len(batch["id"])
            return count

        return anyio.run(epoch)

    return run


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


def parse_floor(bodies: list[bytes]) -> float:
    """Seconds to decode all bodies (as 64 KiB network reads) and collate them in batches.

    The decoder is the one ``JsonLines`` itself makes (``_decoder``), so the floor parses
    with whatever parser aloader uses: a faster parse makes a tighter limit."""
    source = JsonLines(["http://127.0.0.1/x.jsonl"])

    def work() -> int:
        stats = SourceStats()
        count = 0
        pending: list[Any] = []
        for body in bodies:
            decoder = source._decoder("x", BadRecords(False, stats))
            for start in range(0, len(body), 1 << 16):
                pending.extend(decoder.feed(body[start : start + (1 << 16)]))
                while len(pending) >= BATCH:
                    default_collate(pending[:BATCH])
                    count += BATCH
                    del pending[:BATCH]
        if pending:
            default_collate(pending)
            count += len(pending)
        return count

    seconds, items = best(work)
    assert items == TOTAL
    return seconds


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
            ("aloader TextLines(dir)", source(TextLines), plain),
            ("aloader TextLines(dir), sync for", sync_source(TextLines), plain),
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
    print(f"{'':58} {'lines/s':>11} {'vs plain':>10}")
    rows = local_files(bodies)
    rates = {label: rate for label, rate, _ in rows}
    for label, rate, base in rows:
        print(f"{label:58} {rate:>11,.0f} {rate / rates[base]:>9.2f}x")


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

    torch_rows = "--no-torch" not in sys.argv
    try:
        rows: list[tuple[str, float]] = []
        run_aloader(urls)  # warm-up: imports, connections, thread pools
        seconds, items = best(lambda: run_aloader(urls))
        assert items == TOTAL
        aloader_rate = items / seconds
        rows.append((f"aloader JsonLines(concurrency={CONCURRENCY}) + DataLoader",
                     aloader_rate))
        torch_rates: dict[int, float] = {}
        try:
            import torch  # noqa: F401 - only to know whether the anchor can run
        except ImportError:
            print("torch is not installed: the PyTorch rows are skipped", file=sys.stderr)
            torch_rows = False
        if torch_rows:
            for workers in (0, 2, 8):
                seconds, items = best(lambda w=workers: run_torch(urls, w))  # type: ignore[misc]
                assert items == TOTAL
                torch_rates[workers] = items / seconds
                rows.append((f"PyTorch DataLoader, urllib, num_workers={workers}",
                             torch_rates[workers]))
        # Worker processes, started once and kept (a warm-up epoch first, on both sides).
        run_workers = aloader_workers(urls)
        run_workers()
        seconds, items = best(run_workers)
        assert items == TOTAL
        workers_rate = items / seconds
        rows.append(("aloader, 2 persistent workers, in_order=False", workers_rate))
        if torch_rates:
            persistent = torch_loader(urls, 8, persistent=True)
            count_torch(persistent)
            seconds, items = best(lambda: count_torch(persistent))
            assert items == TOTAL
            torch_persistent = items / seconds
            rows.append(("PyTorch DataLoader, urllib, 8 persistent workers", torch_persistent))
            del persistent
        latency_floor = SHARDS * LATENCY / CONCURRENCY
        parse = parse_floor(bodies)
        limit = TOTAL / max(latency_floor, parse)
        rows.append((f"limit max(latency {latency_floor * 1e3:.0f} ms, parse "
                     f"{parse * 1e3:.0f} ms)", limit))
        rows.append(("no-overlap bound (latency + parse)", TOTAL / (latency_floor + parse)))
    finally:
        stop.set()
        process.join(timeout=10)

    print(f"HTTP: {SHARDS} shards x {RECORDS:,} JSON Lines records, {LATENCY * 1e3:.0f} ms per "
          f"request, batch {BATCH}, best of {RUNS}")
    print(f"{'':58} {'items/s':>11} {'vs torch-8':>10} {'of limit':>9}")
    for label, rate in rows:
        vs = f"{rate / torch_rates[8]:.2f}x" if 8 in torch_rates else "-"
        print(f"{label:58} {rate:>11,.0f} {vs:>10} {rate / limit:>8.0%}")

    if "--http-only" in sys.argv:
        return
    print()
    print_local_files(bodies)


if __name__ == "__main__":
    if sys.argv[1:] == ["local"]:
        print_local_files(list(make_jsonl_shards(SHARDS, RECORDS).values()))
    else:
        main()
