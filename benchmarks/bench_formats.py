"""Compressed JSON Lines and tar shards from local files.

Run: ``python benchmarks/bench_formats.py``. Everything below is measured in the same run, the
best of 3 epochs (5 for JSON Lines), the candidates' epochs interleaved, records iterated
straight from the source (no batching):

* JSON Lines: 16 files of 20,000 records (~106 bytes each), plain, ``.jsonl.gz`` (level 6)
  and ``.jsonl.zst`` (level 3, when zstandard is installed), read with ``JsonLines``. Target:
  the compressed rates at least 0.8x the plain one.
* Tar: 16 shards of 1,000 webdataset samples (a 10 kB ``jpg``, a ``cls`` and a ``json``),
  ``.tar`` and ``.tar.gz``, read with ``TarShards`` and with webdataset's own
  ``WebDataset(paths, shardshuffle=False)`` pipeline (when installed), both yielding raw
  bytes. Target: TarShards at least 0.8x webdataset.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Callable
from typing import Any

import anyio

from aloader import JsonLines, TarShards
from aloader._demo import make_jsonl_shards

RUNS = 3
JSON_FILES, JSON_RECORDS = 16, 20_000
TAR_SHARDS, TAR_SAMPLES = 16, 1_000


def best_of(fns: dict[str, Callable[[], int]], runs: int = RUNS) -> dict[str, tuple[float, int]]:
    """{name: (best seconds, items)}, the runs of the candidates interleaved so that a change
    of the machine's load weighs on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    items: dict[str, int] = {}
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            items[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: (min(times[name]), items[name]) for name in fns}


def count(source: Any) -> Callable[[], int]:
    async def epoch() -> int:
        n = 0
        async for _ in source:
            n += 1
        return n

    return lambda: anyio.run(epoch)


def make_tar(start: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(start, start + TAR_SAMPLES):
            for ext, data in (("jpg", os.urandom(10_000)), ("cls", str(i % 10).encode()),
                              ("json", json.dumps({"i": i, "caption": "x" * 40}).encode())):
                info = tarfile.TarInfo(f"{i:08d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def row(name: str, seconds: float, items: int, base: float | None) -> str:
    ratio = f"{base / seconds:.2f}x" if base else ""
    return f"| {name} | {items / seconds:,.0f} | {seconds * 1000:.0f} ms | {ratio} |"


def main() -> None:
    try:
        import zstandard
    except ImportError:
        zstandard = None
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("plain", "gz", "zst"):
            os.makedirs(os.path.join(tmp, kind))
        for name, body in make_jsonl_shards(JSON_FILES, JSON_RECORDS).items():
            with open(os.path.join(tmp, "plain", name), "wb") as f:
                f.write(body)
            with open(os.path.join(tmp, "gz", name + ".gz"), "wb") as f:
                f.write(gzip.compress(body, 6))
            if zstandard is not None:
                with open(os.path.join(tmp, "zst", name + ".zst"), "wb") as f:
                    f.write(zstandard.ZstdCompressor(level=3).compress(body))
        kinds = ("plain", "gz", "zst") if zstandard is not None else ("plain", "gz")
        json_results = best_of({kind: count(JsonLines(os.path.join(tmp, kind)))
                                for kind in kinds}, runs=5)
        print("| JSON Lines, local files | records/s | epoch | vs plain |")
        print("| --- | --- | --- | --- |")
        plain = json_results["plain"][0]
        for kind in kinds:
            seconds, items = json_results[kind]
            label = "plain .jsonl" if kind == "plain" else f".jsonl.{kind}"
            print(row(label, seconds, items, None if kind == "plain" else plain))

        tars = os.path.join(tmp, "tar")
        os.makedirs(tars)
        paths, gz_paths = [], []
        for shard in range(TAR_SHARDS):
            raw = make_tar(shard * TAR_SAMPLES)
            paths.append(os.path.join(tars, f"s{shard:04d}.tar"))
            gz_paths.append(paths[-1] + ".gz")
            with open(paths[-1], "wb") as f:
                f.write(raw)
            with open(gz_paths[-1], "wb") as f:
                f.write(gzip.compress(raw, 6))
        try:
            import webdataset
        except ImportError:
            webdataset = None
        print()
        print("| tar shards, local files | samples/s | epoch | vs webdataset |")
        print("| --- | --- | --- | --- |")
        for label, shards in (("tar", paths), ("tar.gz", gz_paths)):
            fns = {"aloader": count(TarShards(shards))}
            if webdataset is not None:
                def wds_epoch(shards: list[str] = shards) -> int:
                    return sum(1 for _ in webdataset.WebDataset(shards, shardshuffle=False))

                fns["webdataset"] = wds_epoch
            results = best_of(fns)
            base = results["webdataset"][0] if "webdataset" in results else None
            if base is not None:
                print(row(f"webdataset WebDataset, .{label}", base, results["webdataset"][1],
                          None))
            seconds, items = results["aloader"]
            print(row(f"aloader TarShards, .{label}", seconds, items, base))

if __name__ == "__main__":
    main()
