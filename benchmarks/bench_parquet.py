"""ParquetRows against pyarrow's own ``ParquetFile.iter_batches`` over the same local files.

Run: ``python benchmarks/bench_parquet.py [--quick]`` (needs pyarrow). Everything is measured
in the same run, best of 5, the contestants interleaved within each round (so a noisy moment
hits them alike), all inside one event loop (a loader's loop lives as long as the training:
its start is not an epoch's cost).

The comparison the target (at least 0.8x) is about is ``iter_batches`` producing the SAME
output as aloader: the batches converted to what aloader hands on (dicts of writable numpy
arrays, or row dicts taken one by one, or lists of 256 rows). Bare ``iter_batches``, which
leaves Arrow batches unconverted, is an info row: the rate of pyarrow's reader alone, which no
loader that hands on numpy or Python values can reach. Each row also gives the CPU time of the
process (all its threads) per epoch, best of the rounds, and its ratio, with the median of the
rounds' paired ratios (each round's two epochs ran next to each other): figures the other
programs of a loaded machine disturb less than the wall clock.

The rows programs make their dicts with ``RecordBatch.to_pylist``, what a program without a
loader would write; aloader makes the same dicts (equal, same key order, same value types:
tests/sources/test_parquet_row_maker.py) from the columns' ``to_pylist`` with a comprehension
per schema and the cyclic collector paused per piece (``aloader.sources._parquet._rows_of``),
measured at ~0.72x
``to_pylist``'s time per 4096 rows.

Data: 8 files of 4 row groups, 1M rows in all (with ``--quick`` 200k): ``id`` int64, ``x``
float64, ``label`` int32 with some nulls, ``text`` a short string, ``blob`` 64 random bytes.

* batches: ``ParquetRows(files, as_batches=True)``, one epoch iterated as a stream, against a
  loop over ``pq.ParquetFile(f).iter_batches(batch_size=65536)`` doing the same conversion to
  a dict of writable numpy arrays; and against ``iter_batches`` alone (no conversion: the
  rate of pyarrow's reader).
* two columns: the same with ``columns=["id", "x"]``.
* rows: ``ParquetRows(files)`` (dicts, ``RecordBatch.to_pylist``, taken one by one with
  ``async for``) against ``iter_batches`` + ``to_pylist`` of slices of ``PIECE`` rows and a
  ``for`` over the rows; and in ``DataLoader(..., batch_size=256, collate_fn=list)`` batches
  against the same slices' ``to_pylist`` cut into lists of 256. The slices make the pyarrow
  program the fastest one we found: ``to_pylist`` of whole 65536-row batches cost it ~1.4x the
  CPU time (the dicts of a batch outgrow the caches before they are consumed); slices of
  1024-4096 rows measured alike, 256 a little slower.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from aloader import DataLoader, ParquetRows

FILES = 8
GROUPS = 4
BATCH = 65536
LOADER_BATCH = 256
RUNS = 5
PIECE = 2048  # rows per to_pylist in the pyarrow rows programs (see the module's description)


def make_files(directory: Path, rows: int) -> list[str]:
    rng = np.random.default_rng(0)
    per_file = rows // FILES
    paths = []
    for f in range(FILES):
        ids = np.arange(f * per_file, (f + 1) * per_file, dtype=np.int64)
        labels = pa.array(rng.integers(0, 1000, per_file, dtype=np.int32),
                          mask=rng.random(per_file) < 0.01)
        table = pa.table({
            "id": ids,
            "x": rng.standard_normal(per_file),
            "label": labels,
            "text": pa.array([f"item {i}" for i in ids.tolist()]),
            "blob": pa.array([rng.bytes(64) for _ in range(per_file)], pa.binary()),
        })
        path = directory / f"part-{f}.parquet"
        pq.write_table(table, path, row_group_size=per_file // GROUPS)
        paths.append(str(path))
    return paths


def to_arrays(batch: Any) -> dict[str, Any]:
    return {name: column.to_numpy(zero_copy_only=False, writable=True)
            for name, column in zip(batch.schema.names, batch.columns, strict=True)}


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector paused meanwhile, as ``aloader.sources._parquet._rows_of`` pauses
    it
    (rows of Arrow values hold no cycles: see the module's description)."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def known_rows(piece: Any) -> list[dict[str, Any]]:
    """A piece's rows as a program that knows its five columns writes them: each column's
    ``to_pylist`` zipped into dict displays. The same dicts as ``to_pylist`` (checked)."""
    columns = [column.to_pylist() for column in piece.columns]  # a batch's: equal lengths
    return [{"id": a, "x": b, "label": c, "text": d, "blob": e}
            for a, b, c, d, e in zip(*columns, strict=False)]


def pyarrow_loop(paths: list[str], columns: list[str] | None, convert: str,
                 seen: list[tuple[int, int, int]] | None = None) -> int:
    """One epoch of the no-loader programs; ``convert`` says what each makes of the batches
    (see the module's description). ``seen``, where given, gets (length, first id, last id) of
    each list of ``LOADER_BATCH`` rows a "lists" program hands on.

    The target programs (no ``-pylist``) make their rows with :func:`known_rows`, the collector
    paused while they make them and, in the lists program, while they cut them into lists
    (the consumer, here doing nothing, runs with it on); the ``-pylist`` ones are those of
    earlier runs (``to_pylist``, collector on)."""
    rows = 0
    pylist = convert.endswith("-pylist")
    make: Callable[[Any], list[Any]] = (lambda piece: piece.to_pylist()) if pylist \
        else known_rows
    pause = contextlib.nullcontext if pylist else collector_paused
    carried: list[Any] = []  # rows of the last piece not yet in a full list (the lists program)
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH, columns=columns):
            if convert == "arrays":
                to_arrays(batch)
            elif convert.startswith("lists"):
                for piece in range(0, batch.num_rows, PIECE):
                    with pause():
                        listed = make(batch.slice(piece, PIECE))
                        if carried:
                            listed = carried + listed
                        full = len(listed) - len(listed) % LOADER_BATCH
                        lists = [listed[start : start + LOADER_BATCH]
                                 for start in range(0, full, LOADER_BATCH)]
                        carried = listed[full:]
                        del listed
                    for out in lists:  # the consumer
                        if seen is not None:
                            seen.append((len(out), out[0]["id"], out[-1]["id"]))
                    del lists
            elif convert.startswith("rows"):
                for piece in range(0, batch.num_rows, PIECE):
                    with pause():
                        made = make(batch.slice(piece, PIECE))
                    for _ in made:  # one by one, as aloader's
                        rows += 1
                    del made
                continue
            rows += batch.num_rows
    if carried and seen is not None:  # the last, short list, as aloader's last batch
        seen.append((len(carried), carried[0]["id"], carried[-1]["id"]))
    return rows


async def aloader_epoch(paths: list[str], columns: list[str] | None, as_batches: bool) -> int:
    rows = 0
    source = ParquetRows(paths, columns=columns, batch_rows=BATCH, as_batches=as_batches)
    if as_batches:
        async for item in source:
            rows += len(item["id"])
    else:
        async for _ in source:  # rows reach their consumer one by one, as in pyarrow_loop
            rows += 1
    return rows


async def aloader_loader(paths: list[str], seen: list[tuple[int, int, int]] | None = None
                         ) -> int:
    rows = 0
    loader = DataLoader(ParquetRows(paths, batch_rows=BATCH), batch_size=LOADER_BATCH,
                        collate_fn=list)
    async for batch in loader:
        rows += len(batch)
        if seen is not None:
            seen.append((len(batch), batch[0]["id"], batch[-1]["id"]))
    return rows


async def same_lists(paths: list[str]) -> None:
    """The lists programs hand on the batches aloader's DataLoader does: same lengths, same
    rows (by id) at both ends of each, across pieces and files."""
    ours: list[tuple[int, int, int]] = []
    await aloader_loader(paths, ours)
    for convert in ("lists", "lists-pylist"):
        theirs: list[tuple[int, int, int]] = []
        pyarrow_loop(paths, None, convert, theirs)
        assert theirs == ours, (convert, len(theirs), len(ours))
    first = next(pq.ParquetFile(paths[0]).iter_batches(batch_size=PIECE)).slice(0, PIECE)
    assert known_rows(first) == first.to_pylist()


async def race(contestants: dict[str, Callable[[], Any]], expected: int
               ) -> tuple[dict[str, float], dict[str, float], float]:
    """Best wall-clock and best CPU seconds of each contestant, interleaved rounds; and the
    median over the rounds of the CPU ratio same / aloader of that round (paired: the two
    ran next to each other, so a slow phase of the machine hits both)."""
    best = dict.fromkeys(contestants, float("inf"))
    cpu = dict.fromkeys(contestants, float("inf"))
    paired: list[float] = []
    for _ in range(RUNS):
        used: dict[str, float] = {}
        for name, fn in contestants.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            rows = fn()
            if not isinstance(rows, int):
                rows = await rows
            elapsed = time.perf_counter() - start
            assert rows == expected, (name, rows, expected)
            best[name] = min(best[name], elapsed)
            used[name] = time.process_time() - start_cpu
            cpu[name] = min(cpu[name], used[name])
        paired.append(used["same"] / used["aloader"])
    return best, cpu, statistics.median(paired)


def report(label: str, rows: int, best: dict[str, float], cpu: dict[str, float],
           paired: float) -> None:
    ours, same, alone = (rows / best[k] for k in ("aloader", "same", "alone"))
    ratio = ours / same
    print(f"| {label} | aloader ParquetRows | {ours:,.0f} | {cpu['aloader'] * 1e3:,.0f} | | |")
    print(f"| | iter_batches + the same output (target) | {same:,.0f} | "
          f"{cpu['same'] * 1e3:,.0f} | **{ratio:.2f}x** ({'met' if ratio >= 0.8 else 'not met'})"
          f" | {cpu['same'] / cpu['aloader']:.2f}x (paired median {paired:.2f}x) |")
    if "pylist" in best:
        pylist = rows / best["pylist"]
        print(f"| | iter_batches + ``to_pylist`` of the pieces (info: the target of earlier "
              f"runs) | {pylist:,.0f} | {cpu['pylist'] * 1e3:,.0f} | {ours / pylist:.2f}x | "
              f"{cpu['pylist'] / cpu['aloader']:.2f}x |")
    print(f"| | bare iter_batches, Arrow batches (info) | {alone:,.0f} | "
          f"{cpu['alone'] * 1e3:,.0f} | {ours / alone:.2f}x | "
          f"{cpu['alone'] / cpu['aloader']:.2f}x |")


async def main() -> None:
    quick = "--quick" in sys.argv
    rows = 200_000 if quick else 1_000_000
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_files(Path(tmp), rows)
        size = sum(Path(p).stat().st_size for p in paths)
        print(f"{FILES} files x {GROUPS} row groups, {rows:,} rows, {size / 1e6:.1f} MB; "
              f"best of {RUNS}, interleaved\n")
        print("| workload | program | rows/s | CPU ms per epoch | aloader's rate vs it | "
              "aloader's CPU vs it |")
        print("|---|---|---|---|---|---|")
        cases: list[tuple[str, list[str] | None, bool]] = [
            ("batches, all columns", None, True),
            ("batches, id + x", ["id", "x"], True),
            ("rows (dicts), all columns", None, False),
        ]
        for label, columns, as_batches in cases:
            convert = "arrays" if as_batches else "rows"
            contestants: dict[str, Callable[[], Any]] = {
                "aloader": lambda c=columns, b=as_batches: aloader_epoch(paths, c, b),
                "same": lambda c=columns, v=convert: pyarrow_loop(paths, c, v),
                "alone": lambda c=columns: pyarrow_loop(paths, c, "none"),
            }
            if not as_batches:
                contestants["pylist"] = lambda: pyarrow_loop(paths, None, "rows-pylist")
            best, cpu, paired = await race(contestants, rows)
            report(label, rows, best, cpu, paired)
        await same_lists(paths)
        best, cpu, paired = await race({
            "aloader": lambda: aloader_loader(paths),
            "same": lambda: pyarrow_loop(paths, None, "lists"),
            "pylist": lambda: pyarrow_loop(paths, None, "lists-pylist"),
            "alone": lambda: pyarrow_loop(paths, None, "none"),
        }, rows)
        report(f"rows in DataLoader batches of {LOADER_BATCH} (collate_fn=list)", rows, best,
               cpu, paired)


if __name__ == "__main__":
    anyio.run(main)
