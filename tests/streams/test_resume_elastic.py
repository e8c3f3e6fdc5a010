"""Elastic resume of iterable epochs: a state taken during an epoch with
``num_workers=W`` resumes with any other count, yielding exactly the rest of the uninterrupted
run's epoch (the W saved replicas run as virtual replicas), then the next epoch of a run with
the new count.

Each case compares, batch by batch, after a JSON round trip of the state: the rest of epoch 0
of an uninterrupted loader with W workers, then epoch 1 of an uninterrupted loader with W'.
"""

from __future__ import annotations

import json
import pickle
from functools import cache
from pathlib import Path
from typing import Any

import anyio
import pytest
from sourcetools import write

from aloader import DataLoader, IterableDataset, JsonLines, Stream, as_stream, get_worker_info
from aloader.streams._sourcestats import source_stats

BATCH = 3
# Three workers on a machine with fewer cores: torch's warning says so.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def as_list(samples: list[Any]) -> list[Any]:
    return list(samples)


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(state))
    assert pickle.loads(pickle.dumps(out)) == out
    return out  # type: ignore[no-any-return]


def share(n: int) -> range:
    """This replica's part of ``range(n)``: split by worker, all of it in the loader."""
    info = get_worker_info()
    return range(n) if info is None else range(info.id, n, info.num_workers)


class Stateful(IterableDataset[int]):
    """torchdata's protocol; splits by get_worker_info(), read lazily (in the first next())."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def __iter__(self) -> Any:
        items = share(self.n)
        while self.pos < len(items):
            self.pos += 1
            yield items[self.pos - 1]
        self.pos = 0

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = int(state["pos"])


class Plain(IterableDataset[int]):
    """No protocol (resumed by counting); splits by get_worker_info(), and its items depend
    on the worker's seed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        salt = 0 if info is None else info.seed % 89
        return iter([x * 100 + salt for x in share(self.n)])


def record(r: dict[str, Any]) -> tuple[int, int]:
    return int(r["s"]), int(r["r"])


@cache
def shard_paths(root: str) -> list[str]:
    # Shards of unequal lengths: the workers' replicas end at different batches.
    return [write(Path(root), f"part-{s}.jsonl", "".join(
        json.dumps({"s": s, "r": r}) + "\n" for r in range(7 + 3 * s)).encode())
        for s in range(4)]


def make_dataset(kind: str, root: str) -> Any:
    if kind == "stream":
        stream: Stream[Any] = JsonLines(shard_paths(root), chunk_size=40, shuffle_shards=True,
                                        seed=3)
        return stream.shuffle(4, seed=1).map(record)
    if kind == "protocol":
        return Stateful(23)
    if kind == "wrapped":  # a stream over a dataset that splits itself by worker
        return as_stream(Plain(23)).shuffle(3, seed=2)
    return Plain(23)


def make_loader(kind: str, root: str, workers: int, persistent: bool = False
                ) -> DataLoader[Any]:
    return DataLoader(make_dataset(kind, root), batch_size=BATCH, num_workers=workers,
                      collate_fn=as_list, persistent_workers=persistent and workers > 0,
                      generator=11)


async def epochs(loader: DataLoader[Any], count: int) -> list[list[Any]]:
    out = [[b async for b in loader] for _ in range(count)]
    await loader.aclose()
    return out


_uninterrupted: dict[tuple[str, str, int, bool], list[list[Any]]] = {}


async def uninterrupted(kind: str, root: str, workers: int, persistent: bool = False
                        ) -> list[list[Any]]:
    """Epochs 0 and 1 of an uninterrupted run with ``workers`` (persistent workers keep
    their first epoch's seeds)."""
    key = (kind, root, workers, persistent and workers > 0)
    if key not in _uninterrupted:
        _uninterrupted[key] = await epochs(make_loader(kind, root, workers, persistent), 2)
    return _uninterrupted[key]


async def state_after(kind: str, root: str, workers: int, k: int) -> dict[str, Any]:
    loader = make_loader(kind, root, workers)
    iterator = loader.__aiter__()
    for _ in range(k):
        await iterator.__anext__()
    state = roundtrip(loader.state_dict())
    await iterator.aclose()
    await loader.aclose()
    return state


async def check(kind: str, root: str, saved: int, now: int, *, persistent: bool) -> None:
    full = (await uninterrupted(kind, root, saved))[0]
    later = (await uninterrupted(kind, root, now, persistent))[1]
    assert len(full) > 4
    assert full != (await uninterrupted(kind, root, now))[0]  # the count decides the order
    for k in (len(full) // 2, len(full) - 1, len(full)):
        state = await state_after(kind, root, saved, k)
        assert state["iterable"]["num_workers"] == saved
        fresh = make_loader(kind, root, now, persistent)
        fresh.load_state_dict(state)
        iterator = fresh.__aiter__()
        rest = [b async for b in iterator]
        assert rest == full[k:], (kind, saved, now, k)
        # A state taken within the resumed epoch resumes exactly too (here, with the count of
        # the saved run).
        assert [b async for b in fresh] == later, (kind, saved, now, k)
        await fresh.aclose()


CASES = [(2, 0, False), (2, 1, True), (2, 3, False), (0, 2, True), (1, 2, False)]


@pytest.mark.parametrize("kind", ["stream", "protocol", "plain"])
def test_resume_with_another_num_workers(kind: str, tmp_path: Path) -> None:
    async def run() -> None:
        for saved, now, persistent in CASES:
            await check(kind, str(tmp_path), saved, now, persistent=persistent)

    anyio.run(run)


def test_the_sync_for_resumes_with_another_num_workers(tmp_path: Path) -> None:
    root = str(tmp_path)
    full, later = anyio.run(uninterrupted, "stream", root, 2)[0], anyio.run(
        uninterrupted, "stream", root, 0)[1]
    state = anyio.run(state_after, "stream", root, 2, 4)
    for now in (0, 3):
        fresh = make_loader("stream", root, now)
        fresh.load_state_dict(state)
        assert [b for b in fresh] == full[4:]
        assert [b for b in fresh] == anyio.run(uninterrupted, "stream", root, now)[1]
        fresh.close()
    assert later


def test_a_state_within_a_resumed_epoch_resumes_again(tmp_path: Path) -> None:
    root = str(tmp_path)

    async def run() -> None:
        full = (await uninterrupted("stream", root, 2))[0]
        state, taken = await state_after("stream", root, 2, 2), 2
        for now in (0, 3, 1):  # each resumed run takes two batches, then saves
            loader = make_loader("stream", root, now)
            loader.load_state_dict(state)
            iterator = loader.__aiter__()
            for _ in range(2):
                assert await iterator.__anext__() == full[taken]
                taken += 1
            state = roundtrip(loader.state_dict())
            assert state["iterable"]["num_workers"] == 2  # the saved run's replicas
            await iterator.aclose()
            await loader.aclose()
        final = make_loader("stream", root, 2)
        final.load_state_dict(state)
        assert await epochs(final, 2) == [full[taken:], (await uninterrupted("stream", root,
                                                                            2))[1]]

    anyio.run(run)


async def test_virtual_replicas_in_process_on_both_backends(tmp_path: Path, anyio_backend: str
                                                            ) -> None:
    root = str(tmp_path)
    for kind in ("stream", "protocol", "wrapped"):
        full = (await uninterrupted(kind, root, 2))[0]
        later = (await uninterrupted(kind, root, 0))[1]
        state = await state_after(kind, root, 2, 3)
        fresh = make_loader(kind, root, 0)
        fresh.load_state_dict(state)
        assert [b async for b in fresh] == full[3:]
        if kind == "stream":  # the replicas' reads count in the loader's sources
            records = source_stats(fresh.dataset)[0].records
            assert records >= sum(len(batch) for batch in full[3:])
        assert await epochs(fresh, 1) == [later]

def test_a_stream_state_within_an_epoch_is_refused_on_another_world(tmp_path: Path) -> None:
    paths = shard_paths(str(tmp_path))

    def make(rank: int, world_size: int, workers: int = 0) -> DataLoader[Any]:
        return DataLoader(JsonLines(paths, rank=rank, world_size=world_size).map(record),
                          batch_size=BATCH, num_workers=workers, collate_fn=as_list)

    async def run() -> None:
        saved = make(0, 2, 2)
        iterator = saved.__aiter__()
        await iterator.__anext__()
        during = roundtrip(saved.state_dict())
        _ = [b async for b in iterator]
        between = roundtrip(saved.state_dict())
        await saved.aclose()
        for rank, world_size in ((0, 1), (0, 3), (1, 2)):
            other = make(rank, world_size)
            with pytest.raises(ValueError, match="field 'world' is \\[\\[0, 2\\]\\]"):
                other.load_state_dict(during)
            other.load_state_dict(between)  # between epochs: any world
            whole = make(rank, world_size)
            assert (await epochs(other, 1))[0] == (await epochs(whole, 2))[1]
        same = make(0, 2)
        same.load_state_dict(during)
        assert (await epochs(same, 1))[0]

    anyio.run(run)
