"""Same seed, same sequence with worker processes: who makes which batch, epochs, and stats.

Map-style batch ``k`` is made by worker ``k % n`` as its task ``k // n`` whatever the timing,
so what workers draw from their seeded RNGs reproduces; streams change order every epoch with
workers, persistent or not, as without them; the sources' counters in the loader's process add
up the workers'. Datasets live at module level so the workers can unpickle them.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aloader
from aloader import DataLoader
from aloader.sources._sharding import assign_shards

pytestmark = pytest.mark.anyio

GUARD = 60  # seconds: a hang guard, never a timing assertion


class Draws(aloader.Dataset[tuple[int, int, int, int, float]]):
    """Each sample: (index, worker id, the worker's call number, numpy draw, random draw)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int, int, int, float]:
        info = aloader.get_worker_info()
        call = self.calls
        self.calls += 1
        return (index, -1 if info is None else info.id, call, int(np.random.randint(1 << 30)),
                random.random())


class EpochProbe(aloader.IterableDataset[int]):
    """Yields the loader epoch its worker serves."""

    def __iter__(self) -> Iterator[int]:
        info = aloader.get_worker_info()
        yield -1 if info is None else info.epoch


async def run_epochs(loader: DataLoader[Any], epochs: int = 1) -> list[list[Any]]:
    out = []
    with anyio.fail_after(GUARD):
        for _ in range(epochs):
            out.append([batch async for batch in loader])
    await loader.aclose()
    return out


def as_rows(batches: list[Any]) -> list[tuple[Any, ...]]:
    return [tuple(int(x) if i < 4 else float(x) for i, x in enumerate(sample))
            for batch in batches for sample in zip(*(column.tolist() for column in batch),
                                                   strict=True)]


# Map-style: round robin, in sequence ---------------------------------------------------------
@pytest.mark.parametrize("workers", [1, 2])
async def test_map_batches_round_robin_and_worker_rng_reproducible(
    anyio_backend: str, workers: int
) -> None:
    batch_size, n = 2, 24

    def make() -> DataLoader[Any]:
        return DataLoader(Draws(n), batch_size=batch_size, num_workers=workers,
                          prefetch_factor=8, generator=7)

    loader = make()
    iterator = aiter(loader)
    with anyio.fail_after(GUARD):
        batches = [batch async for batch in iterator]
    rows = as_rows(batches)
    assert [r[0] for r in rows] == list(range(n))
    # Batch k is made by worker k % n, as that worker's task k // n.
    draws: dict[int, list[int]] = {w: [] for w in range(workers)}
    for k in range(n // batch_size):
        for j, row in enumerate(rows[k * batch_size : (k + 1) * batch_size]):
            assert row[1] == k % workers
            assert row[2] == (k // workers) * batch_size + j
            draws[row[1]].append(row[3])
    # So each worker's draws are its seeded RNG's stream, in order.
    for worker_id, values in draws.items():
        state = np.random.SeedSequence([worker_id, iterator.base_seed]).generate_state(4)
        expected = [int(np.random.RandomState(state).randint(1 << 30, size=len(values))[i])
                    for i in range(len(values))]
        assert values == expected
    for _ in range(2):  # fresh loaders, the same seed: the same batches
        assert as_rows((await run_epochs(make()))[0]) == rows


async def test_map_round_robin_holds_out_of_order(anyio_backend: str) -> None:
    loader = DataLoader(Draws(16), batch_size=2, num_workers=2, prefetch_factor=8,
                        in_order=False)
    rows = as_rows((await run_epochs(loader))[0])
    assert sorted(r[0] for r in rows) == list(range(16))
    for row in rows:
        k = row[0] // 2
        assert (row[1], row[2]) == (k % 2, (k // 2) * 2 + row[0] % 2)


# Streams: the order is a function of the seed ----------------------------------------------
def write_shards(directory: Path, count: int, records: int, bad_every: int = 0) -> list[str]:
    paths = []
    for shard in range(count):
        path = directory / f"shard-{shard:02d}.jsonl"
        lines = []
        for record in range(records):
            if bad_every and record % bad_every == bad_every - 1:
                lines.append("{not json")
            else:
                lines.append(json.dumps({"s": shard, "r": record}))
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


def keys_of(batches: list[Any]) -> list[tuple[int, int]]:
    return [(record["s"], record["r"]) for batch in batches for record in batch]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers, 2 CPUs
@pytest.mark.parametrize("workers", [1, 2, 3])
async def test_sharded_stream_order_is_the_seeds_with_workers(
    anyio_backend: str, tmp_path: Path, workers: int
) -> None:
    # 13 shards over 3 ranks, shuffled: torch's order, exactly (each worker reads its shards
    # in the epoch's order; batches come from the workers in turn), run after run.
    shards = write_shards(tmp_path, 13, 5)
    batch_size, world = 3, 3
    for rank in range(world):

        def make(rank: int = rank) -> DataLoader[Any]:
            source = aloader.JsonLines(shards, shuffle_shards=True, seed=4, rank=rank,
                                       world_size=world, concurrency=3)
            return DataLoader(source, batch_size=batch_size, num_workers=workers,
                              collate_fn=list, prefetch_factor=4)

        replicas = []
        for worker_id in range(workers):
            mine = assign_shards(13, rank=rank, world_size=world, worker_id=worker_id,
                                 num_workers=workers, epoch=0, seed=4, shuffle=True,
                                 even=None)  # the default: every shard read
            records = [(s, r) for s in mine for r in range(5)]
            replicas.append([records[i : i + batch_size]
                             for i in range(0, len(records), batch_size)])
        expected: list[tuple[int, int]] = []
        live = [w for w in range(workers) if replicas[w]]
        while live:
            for w in list(live):
                expected.extend(replicas[w].pop(0))
                if not replicas[w]:
                    live.remove(w)
        for _ in range(3):
            assert keys_of((await run_epochs(make()))[0]) == expected


# Streams: a new order every epoch, the same sequence of orders per seed ---------------------
def stream_loader(shards: list[str], workers: int, persistent: bool) -> DataLoader[Any]:
    source = aloader.JsonLines(shards, shuffle_shards=True, seed=1).shuffle(6, seed=2)
    return DataLoader(source, batch_size=4, num_workers=workers, collate_fn=list,
                      persistent_workers=persistent)


def sync_epochs(loader: DataLoader[Any], epochs: int) -> list[list[tuple[int, int]]]:
    return [keys_of(list(loader)) for _ in range(epochs)]


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
async def test_stream_epochs_differ_and_repeat_per_seed(
    anyio_backend: str, tmp_path: Path, workers: int, persistent: bool
) -> None:
    shards = write_shards(tmp_path, 6, 4)
    first = [keys_of(b) for b in await run_epochs(stream_loader(shards, workers, persistent), 3)]
    assert first[0] != first[1] and first[1] != first[2] and first[0] != first[2]
    for epoch in first:
        assert sorted(epoch) == [(s, r) for s in range(6) for r in range(4)]
    again_loader = stream_loader(shards, workers, persistent)
    again = [keys_of(b) for b in await run_epochs(again_loader, 3)]
    assert again == first
    assert again_loader.dataset.epoch == 3  # the loader's copy advanced as if iterated here


def test_stream_epochs_agree_across_configurations(tmp_path: Path) -> None:
    # One worker reads what the loader's process reads: the very orders of num_workers=0;
    # persistent or not, and `for` or `async for`, give the same sequence of epochs.
    shards = write_shards(tmp_path, 6, 4)
    alone = sync_epochs(stream_loader(shards, 0, False), 3)
    assert sync_epochs(stream_loader(shards, 1, False), 3) == alone
    assert sync_epochs(stream_loader(shards, 1, True), 3) == alone
    two = sync_epochs(stream_loader(shards, 2, False), 3)
    assert sync_epochs(stream_loader(shards, 2, True), 3) == two
    assert [keys_of(b) for b in anyio.run(run_epochs, stream_loader(shards, 2, False), 3)] == two


@pytest.mark.parametrize("persistent", [False, True])
def test_stream_set_epoch_reaches_workers(tmp_path: Path, persistent: bool) -> None:
    shards = write_shards(tmp_path, 6, 4)
    reference = stream_loader(shards, 0, False)
    reference.dataset.set_epoch(5)
    epoch5 = keys_of(list(reference))
    loader = stream_loader(shards, 1, persistent)
    first = keys_of(list(loader))  # epoch 0, starting persistent workers
    assert first != epoch5
    loader.dataset.set_epoch(5)  # after the persistent workers have their copies
    assert keys_of(list(loader)) == epoch5
    assert keys_of(list(loader)) == epoch5
    assert loader.dataset.epoch == 5


@pytest.mark.parametrize("persistent", [False, True])
async def test_worker_info_epoch_counts_the_loaders_epochs(
    anyio_backend: str, persistent: bool
) -> None:
    loader = DataLoader(EpochProbe(), batch_size=None, num_workers=1,
                        persistent_workers=persistent)
    epochs = await run_epochs(loader, 3)
    assert [[int(x) for x in epoch] for epoch in epochs] == [[0], [1], [2]]


# Stats ---------------------------------------------------------------------------------------
def record_number(record: dict[str, int]) -> int:
    return record["r"]


@pytest.mark.parametrize(("workers", "persistent"), [(2, False), (2, True)])
def test_source_stats_with_workers_equal_stats_without(
    tmp_path: Path, workers: int, persistent: bool
) -> None:
    shards = write_shards(tmp_path, 5, 6, bad_every=4)

    def stats_after(workers: int, persistent: bool) -> tuple[Any, ...]:
        source = aloader.JsonLines(shards, skip_errors=True)
        loader = DataLoader(source.map(record_number), batch_size=4, num_workers=workers,
                            persistent_workers=persistent)
        records = [sum(len(b) for b in loader) for _ in range(2)]
        stats = source.stats
        errors = sorted((e.source, e.line) for e in stats.skipped_errors)
        return (records, stats.records, stats.skipped, stats.shards, stats.bytes, errors)

    without = stats_after(0, False)
    assert without[0] == [25, 25] and without[1:4] == (50, 10, 10)
    assert stats_after(workers, persistent) == without


# In a fresh process -------------------------------------------------------------------------
# A light module (the workers import what they unpickle), run here and in a fresh process.
_PROBE = """
import json
import sys

import numpy as np

import aloader


class Draws(aloader.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, index):
        return [index, aloader.get_worker_info().id, int(np.random.randint(1 << 30))]


def run(shards):
    out = [[column.tolist() for column in batch] for batch in aloader.DataLoader(
        Draws(), batch_size=2, num_workers=2, prefetch_factor=8, generator=3)]
    source = aloader.JsonLines(shards, shuffle_shards=True, seed=5).shuffle(4, seed=6)
    loader = aloader.DataLoader(source, batch_size=3, num_workers=2, collate_fn=list)
    out += [[[r["s"], r["r"]] for b in loader for r in b] for _ in range(2)]
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1:])))
"""


def test_same_sequence_in_a_fresh_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = write_shards(tmp_path, 5, 3)
    (tmp_path / "order_probe.py").write_text(_PROBE)
    root = Path(aloader.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "order_probe.py", *shards], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=GUARD, check=False)
    assert done.returncode == 0, done.stderr
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "order_probe", raising=False)
    import order_probe  # type: ignore[import-not-found]

    here = order_probe.run(shards)
    monkeypatch.delitem(sys.modules, "order_probe")
    assert json.loads(done.stdout) == here
    assert [batch[1] for batch in here[:6]] == [[0, 0], [1, 1]] * 3  # batch k from worker k % 2
    assert here[6] != here[7]  # a new order in the second epoch
