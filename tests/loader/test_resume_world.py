"""Resume on another world size: the ranks' states of an interrupted epoch, merged
(``aloader.merge_rank_states``), loaded by every rank of a job of another size.

The ranks are simulated in this process (a stream's sources and a DistributedSampler take
their rank and world size as arguments; the loader reads its place from them), so each case
compares exactly: the batches the new ranks deliver together, as a multiset, are the batches
the uninterrupted ranks had left (a stream's batches are cut by its saved replicas, so even
their contents match); the epoch after is an ordinary epoch of the new world. The real process
groups (torchrun's environment, gloo, DCP) are in tests/compat/test_process_groups.py.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import anyio
import pytest
from sourcetools import write

import aloader
from aloader import DataLoader, DistributedSampler, JsonLines, merge_rank_states

BATCH = 3
# Worker processes on a machine with fewer cores: torch's warning says so.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def as_list(samples: list[Any]) -> list[Any]:
    return list(samples)


def roundtrip(state: Any) -> Any:
    return json.loads(json.dumps(state))


def record(r: dict[str, Any]) -> tuple[int, int]:
    return int(r["s"]), int(r["r"])


@cache
def shard_paths(root: str) -> list[str]:
    # 12 shards of unequal lengths: replicas end at different batches.
    return [write(Path(root), f"part-{s:02d}.jsonl", "".join(
        json.dumps({"s": s, "r": r}) + "\n" for r in range(5 + (7 * s) % 11)).encode())
        for s in range(12)]


def every_record(root: str) -> Counter[tuple[int, int]]:
    return Counter((s, r) for s in range(12) for r in range(5 + (7 * s) % 11))


def stream_loader(root: str, rank: int, world: int, workers: int = 0,
                  **source: Any) -> DataLoader[Any]:
    options: dict[str, Any] = {"even_ranks": None if source else False, **source}
    stream = JsonLines(shard_paths(root), rank=rank, world_size=world, shuffle_shards=True,
                       seed=3, chunk_size=64, **options).shuffle(8, seed=1).map(record)
    return DataLoader(stream, batch_size=BATCH, num_workers=workers, collate_fn=as_list,
                      generator=11)


async def epochs(loader: DataLoader[Any], count: int) -> list[list[Any]]:
    out = [[b async for b in loader] for _ in range(count)]
    await loader.aclose()
    return out


async def states_after(make: Callable[[int], DataLoader[Any]], world: int, taken: list[int]
                       ) -> list[dict[str, Any]]:
    """Each rank's state after it took ``taken[rank]`` batches."""
    states = []
    for rank in range(world):
        loader = make(rank)
        iterator = loader.__aiter__()
        for _ in range(taken[rank]):
            await iterator.__anext__()
        states.append(roundtrip(loader.state_dict()))
        await iterator.aclose()
        await loader.aclose()
    return states


def batches(groups: list[list[Any]]) -> Counter[Any]:
    return Counter(json.dumps(batch) for group in groups for batch in group)


async def check_stream(root: str, saved: int, workers: int, now: int, now_workers: int,
                       taken: int) -> None:
    whole = [await epochs(stream_loader(root, r, saved, workers), 1) for r in range(saved)]
    rest = [whole[r][0][taken:] for r in range(saved)]
    merged = roundtrip(merge_rank_states(await states_after(
        lambda r: stream_loader(root, r, saved, workers), saved, [taken] * saved)))
    got, later = [], []
    for rank in range(now):
        loader = stream_loader(root, rank, now, now_workers)
        loader.load_state_dict(merged)
        got.append([b async for b in loader])
        later.append([b async for b in loader])
        await loader.aclose()
    assert batches(got) == batches(rest), (saved, workers, now, now_workers)
    records = Counter(x for group in got for batch in group for x in batch)
    assert all(count == 1 for count in records.values())
    # The epoch after is the new world's, as an uninterrupted run on it has it.
    fresh = [(await epochs(stream_loader(root, r, now, now_workers), 2))[1] for r in range(now)]
    assert later == fresh
    assert sum(records.values()) + sum(len(b) for g in whole for b in g[0][:taken]) == sum(
        every_record(root).values())


@pytest.mark.parametrize(("saved", "workers", "now", "now_workers"), [
    (4, 0, 2, 0), (4, 0, 3, 0), (4, 0, 1, 0), (2, 2, 3, 0), (4, 2, 3, 0), (2, 2, 4, 2),
])
def test_a_stream_resumes_on_another_world_size(tmp_path: Path, saved: int, workers: int,
                                                now: int, now_workers: int) -> None:
    anyio.run(check_stream, str(tmp_path), saved, workers, now, now_workers, 2)


def test_a_state_taken_in_a_resumed_epoch_resumes_again(tmp_path: Path) -> None:
    root = str(tmp_path)

    async def run() -> None:
        whole = [(await epochs(stream_loader(root, r, 4), 1))[0] for r in range(4)]
        merged = merge_rank_states(await states_after(
            lambda r: stream_loader(root, r, 4), 4, [1] * 4))

        def resumed(world: int) -> Callable[[int], DataLoader[Any]]:
            def make(rank: int) -> DataLoader[Any]:
                loader = stream_loader(root, rank, world)
                loader.load_state_dict(merged)
                return loader
            return make

        # 4 ranks -> 3 (each takes one more batch, then saves) -> 2, to the end.
        middle = roundtrip(merge_rank_states(await states_after(resumed(3), 3, [1] * 3)))
        assert middle["ranks"][0]["iterable"]["lanes"]  # the saved replicas, named
        got = []
        for rank in range(3):  # what the 3 ranks took before saving
            loader = resumed(3)(rank)
            got.append([await loader.__aiter__().__anext__()])
            await loader.aclose()
        merged = middle
        for rank in range(2):
            loader = resumed(2)(rank)
            got.append([b async for b in loader])
            await loader.aclose()
        assert batches(got) == batches([w[1:] for w in whole])

    anyio.run(run)


def test_even_ranks_stay_even_on_a_world_size_that_divides(tmp_path: Path) -> None:
    root = str(tmp_path)

    async def run() -> None:
        make = lambda r: stream_loader(root, r, 4, records_per_rank=20)  # noqa: E731
        whole = [(await epochs(make(r), 1))[0] for r in range(4)]
        assert {len(w) for w in whole} == {7}  # 20 records: 7 batches on every rank
        merged = merge_rank_states(await states_after(make, 4, [3] * 4))
        got = []
        for rank in range(2):
            loader = stream_loader(root, rank, 2, records_per_rank=40)
            loader.load_state_dict(merged)
            got.append([b async for b in loader])
            await loader.aclose()
        assert [len(g) for g in got] == [8, 8]  # two saved ranks' 4 batches each
        assert batches(got) == batches([w[3:] for w in whole])
        with pytest.raises(ValueError, match="cannot split this state of 4 ranks over 3 "
                                             "evenly.*records_per_rank"):
            stream_loader(root, 0, 3, records_per_rank=27).load_state_dict(merged)

    anyio.run(run)


def test_the_same_world_size_resumes_each_rank_as_saved(tmp_path: Path) -> None:
    root = str(tmp_path)

    async def run() -> None:
        states = await states_after(lambda r: stream_loader(root, r, 2, 2), 2, [2, 3])
        whole = [(await epochs(stream_loader(root, r, 2, 2), 1))[0] for r in range(2)]
        merged = merge_rank_states(states)
        for rank, taken in ((0, 2), (1, 3)):
            loader = stream_loader(root, rank, 2)
            loader.load_state_dict(merged)
            assert [b async for b in loader] == whole[rank][taken:]
            await loader.aclose()

    anyio.run(run)


def test_more_ranks_than_replicas_and_ranks_that_had_ended(tmp_path: Path) -> None:
    root = str(tmp_path)

    async def run() -> None:
        # 4 ranks without workers (4 replicas) resumed on 6: two new ranks get nothing.
        whole = [(await epochs(stream_loader(root, r, 4), 1))[0] for r in range(4)]
        merged = merge_rank_states(await states_after(lambda r: stream_loader(root, r, 4), 4,
                                                      [1] * 4))
        got = []
        for rank in range(6):
            loader = stream_loader(root, rank, 6)
            loader.load_state_dict(merged)
            got.append([b async for b in loader])
            assert [b async for b in loader] == (await epochs(stream_loader(root, rank, 6),
                                                              2))[1]
            await loader.aclose()
        assert [len(g) > 0 for g in got] == [True] * 4 + [False] * 2
        assert batches(got) == batches([w[1:] for w in whole])
        # Rank 0 had ended its epoch (its state: the next one's start), rank 1 had not.
        two = [(await epochs(stream_loader(root, r, 2), 1))[0] for r in range(2)]
        short = min(range(2), key=lambda r: len(two[r]))
        taken = [2, 2]
        taken[short] = len(two[short])  # all of its batches: its replica at its end
        states = await states_after(lambda r: stream_loader(root, r, 2), 2, taken)
        ended = stream_loader(root, short, 2)
        _ = [b async for b in ended]  # and past it: the state is the next epoch's start
        exhausted = list(states)
        exhausted[short] = roundtrip(ended.state_dict())
        await ended.aclose()
        assert exhausted[short]["epoch"] == 1 and states[short]["epoch"] == 0
        for merged in (merge_rank_states(states), merge_rank_states(exhausted)):
            for world in (1, 3):
                got = []
                for rank in range(world):
                    loader = stream_loader(root, rank, world)
                    loader.load_state_dict(merged)
                    got.append([b async for b in loader])
                    await loader.aclose()
                assert batches(got) == batches([two[1 - short][2:]]), world

    anyio.run(run)


def mixed_loader(root: str, rank: int, *, world: int, workers: int = 0) -> DataLoader[Any]:
    paths = shard_paths(root)
    first = JsonLines(paths[:6], rank=rank, world_size=world, even_ranks=False,
                      shuffle_shards=True, seed=1).map(record)
    second = JsonLines(paths[6:], rank=rank, world_size=world, even_ranks=False, seed=2)
    mixed = aloader.mix([first, second.map(record)], [0.5, 0.5], seed=4).shuffle(5, seed=3)
    return DataLoader(mixed, batch_size=BATCH, num_workers=workers, collate_fn=as_list,
                      generator=1)


def parquet_loader(root: str, rank: int, *, world: int, workers: int = 0) -> DataLoader[Any]:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    paths = []
    for f in range(6):  # row groups of 4 rows
        path = Path(root) / f"rows-{f}.parquet"
        if not path.exists():
            pq.write_table(pa.table({"f": [f] * (10 + f), "i": list(range(10 + f))}), path,
                           row_group_size=4)
        paths.append(str(path))
    rows = aloader.ParquetRows(paths, rank=rank, world_size=world, even_ranks=False,
                               shuffle_shards=True, seed=5)
    return DataLoader(rows.map(lambda r: (r["f"], r["i"])).shuffle(4, seed=1),
                      batch_size=BATCH, num_workers=workers, collate_fn=as_list, generator=1)


@pytest.mark.parametrize("make", [mixed_loader, parquet_loader])
def test_other_sources_and_stages_resume_on_another_world_size(
        tmp_path: Path, make: Callable[..., DataLoader[Any]]) -> None:
    root = str(tmp_path)

    async def run() -> None:
        for saved, workers, now in ((4, 0, 3), (2, 2, 3)):
            whole = [(await epochs(make(root, r, world=saved, workers=workers), 1))[0]
                     for r in range(saved)]
            merged = roundtrip(merge_rank_states(await states_after(
                functools.partial(make, root, world=saved, workers=workers), saved,
                [2] * saved)))
            got = []
            for rank in range(now):
                loader = make(root, rank, world=now)
                loader.load_state_dict(merged)
                got.append([b async for b in loader])
                await loader.aclose()
            assert batches(got) == batches([w[2:] for w in whole]), (saved, workers, now)

    anyio.run(run)


# --------------------------------------------------------------------------- map-style


def map_loader(n: int, rank: int, world: int, workers: int = 0) -> DataLoader[Any]:
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=5)
    return DataLoader(list(range(n)), batch_size=BATCH, sampler=sampler,
                      num_workers=workers, collate_fn=as_list)


@pytest.mark.parametrize(("now", "workers"), [(2, 0), (3, 0), (3, 2), (6, 0), (1, 0)])
def test_map_style_resumes_each_ranks_own_progress(now: int, workers: int) -> None:
    n = 120  # 30 per saved rank; the ranks took 2, 4, 3 and 1 batches (not in lockstep)
    taken = [2, 4, 3, 1]

    async def run() -> None:
        whole = [(await epochs(map_loader(n, r, 4), 1))[0] for r in range(4)]
        done = Counter(i for r in range(4) for b in whole[r][:taken[r]] for i in b)
        merged = merge_rank_states(await states_after(lambda r: map_loader(n, r, 4), 4,
                                                      taken))
        got = []
        for rank in range(now):
            loader = map_loader(n, rank, now, workers)
            loader.load_state_dict(roundtrip(merged))
            got.append([i async for b in loader for i in b])
            await loader.aclose()
        left = Counter(i for g in got for i in g)
        assert left + done == Counter(range(n))  # 90 left: every one once, on 2, 3, 6 ranks
        assert len({len(g) for g in got}) == 1  # the sampler's equal shares

    anyio.run(run)


# --------------------------------------------------------------------------- bad input


def stream_states(root: str, world: int = 4, taken: int = 1, workers: int = 0,
                  **source: Any) -> list[dict[str, Any]]:
    return anyio.run(states_after, lambda r: stream_loader(root, r, world, workers, **source),
                     world, [taken] * world)


@pytest.mark.hostile
def test_a_rank_missing_or_out_of_order_is_refused(tmp_path: Path) -> None:
    states = stream_states(str(tmp_path))
    with pytest.raises(ValueError, match="taken on 4 ranks, but 3 are given: the state of "
                                         "rank 2 is missing"):
        merge_rank_states([states[0], states[1], states[3]])
    with pytest.raises(ValueError, match="rank 2 given twice"):
        merge_rank_states([states[0], states[1], states[2], states[2], states[3]])
    with pytest.raises(ValueError, match="position 1 is rank 2's: give the states in rank "
                                         "order"):
        merge_rank_states([states[0], states[2], states[1], states[3]])
    with pytest.raises(ValueError, match="merge_rank_states needs the state of every rank"):
        merge_rank_states([])
    with pytest.raises(TypeError, match="a list of DataLoader states"):
        merge_rank_states(states[0])  # type: ignore[arg-type]
    merged = merge_rank_states(states)
    with pytest.raises(ValueError, match="already a merged state"):
        merge_rank_states([merged])
    # Without the 'rank' fields (states of an older aloader), the replicas still tell.
    bare = [{k: v for k, v in s.items() if k != "rank"} for s in states]
    with pytest.raises(ValueError, match="no position for 1 of the epoch's 4 replicas \\("
                                         "those of rank 3 of 4\\): a rank's state is missing"):
        merge_rank_states(bare[:3])
    # A merged state tampered with is checked again where it is loaded.
    merged["ranks"] = merged["ranks"][:3]
    with pytest.raises(ValueError, match="the state of rank 3 is missing"):
        stream_loader(str(tmp_path), 0, 2).load_state_dict(merged)


@pytest.mark.hostile
def test_tampered_replicas_are_refused(tmp_path: Path) -> None:
    root = str(tmp_path)
    states = stream_states(root)
    twice = json.loads(json.dumps(states[0]))
    twice["rank"] = [1, 4]  # rank 0's state passed off as rank 1's
    with pytest.raises(ValueError, match="the position of rank 0's worker 0 is in the states "
                                         "of rank 0 and rank 1"):
        merge_rank_states([states[0], twice, states[2], states[3]])
    merged = merge_rank_states(states)
    merged["ranks"][2]["iterable"]["replicas"][0]["state"]["world"] = [[7, 4]]
    with pytest.raises(ValueError, match="no position for 1 of the epoch's 4 replicas"):
        stream_loader(root, 0, 2).load_state_dict(merged)
    merged["ranks"][2]["iterable"]["replicas"][0]["state"]["world"] = [[2, 4, 0]]
    with pytest.raises(ValueError, match="field 'world' is \\[\\[2, 4, 0\\]\\], which does "
                                         "not fit"):
        stream_loader(root, 0, 2).load_state_dict(merged)


@pytest.mark.hostile
def test_a_state_of_another_dataset_is_refused(tmp_path: Path) -> None:
    root = str(tmp_path)
    states = stream_states(root)
    other = anyio.run(states_after, lambda r: map_loader(40, r, 4), 4, [1] * 4)
    with pytest.raises(ValueError, match="the state of rank 1 is of another dataset or "
                                         "loader: field 'kind'"):
        merge_rank_states([states[0], other[1], states[2], states[3]])
    bigger = anyio.run(states_after, lambda r: map_loader(80, r, 4), 4, [1] * 4)
    with pytest.raises(ValueError, match="field 'loader.dataset_length' is 80, rank 0's is 40"):
        merge_rank_states([other[0], bigger[1], other[2], other[3]])
    merged = merge_rank_states(states)
    with pytest.raises(ValueError, match="'kind' differs"):
        map_loader(40, 0, 2).load_state_dict(merged)
    # Another stream over the same shards: its stages do not fit the saved positions.
    plain = JsonLines(shard_paths(root), rank=0, world_size=2, shuffle_shards=True, seed=3,
                      even_ranks=False).map(record)
    with pytest.raises(ValueError, match="cannot load this stream state"):
        DataLoader(plain, batch_size=BATCH, collate_fn=as_list,
                   generator=11).load_state_dict(merged)


@pytest.mark.hostile
def test_world_sizes_that_cannot_be_split_are_refused(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path)
    merged = merge_rank_states(stream_states(root, records_per_rank=12))
    for world in (3, 8):  # records_per_rank's even ranks cannot be kept on these
        with pytest.raises(ValueError, match=f"cannot split this state of 4 ranks over {world} "
                                             "evenly"):
            stream_loader(root, 0, world, records_per_rank=12).load_state_dict(merged)
    # A map-style loader without a DistributedSampler (its place from torchrun's variables).
    monkeypatch.setenv("WORLD_SIZE", "2")
    plain = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        plain.append(anyio.run(states_after, lambda r: DataLoader(list(range(40)),
                                                                  batch_size=4), 1, [1])[0])
    merged = merge_rank_states(plain)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="through a DistributedSampler, and this one's "
                                         "sampler is SequentialSampler"):
        DataLoader(list(range(40)), batch_size=4).load_state_dict(merged)


@pytest.mark.hostile
def test_states_of_different_steps_are_refused(tmp_path: Path) -> None:
    root = str(tmp_path)

    async def run() -> list[dict[str, Any]]:
        states = await states_after(lambda r: stream_loader(root, r, 2), 2, [1, 0])
        loader = stream_loader(root, 1, 2)
        _ = await epochs(loader, 2)
        return [states[0], roundtrip(loader.state_dict()), states[1]]

    first, later, unstarted = anyio.run(run)
    with pytest.raises(ValueError, match="the state of rank 1 is in epoch 2, but rank 0's in "
                                         "epoch 0: take the ranks' states at the same step"):
        merge_rank_states([first, later])
    with pytest.raises(ValueError, match="the state of rank 1 is before the start of epoch 0"):
        merge_rank_states([first, unstarted])


@pytest.mark.hostile
def test_a_distributed_state_that_is_not_one_is_refused() -> None:
    state = aloader.DistributedState(DataLoader(list(range(10)), batch_size=2))
    own = state.state_dict()
    assert own["world_size"] == 1 and isinstance(own["ranks"][0], str)
    state.load_state_dict(own)
    for bad in ({}, {"world_size": 2, "ranks": own["ranks"]}, {"world_size": 1, "ranks": [{}]},
                {"world_size": 1, "ranks": ["{not json"]}):
        with pytest.raises(ValueError, match="cannot load this distributed state"):
            state.load_state_dict(bad)
