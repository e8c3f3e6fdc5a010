"""Ranks: by default every record is read exactly once per epoch across the ranks, with a
warning (rank 0, once per epoch) when their shares differ; evened out on request
(``even_ranks=True``, ``records_per_rank``), every rank gets the same work per epoch, so a
distributed job cannot hang on a rank that ran out of batches, a shard left out is logged at
INFO, and a rank with nothing to read is refused at construction."""

from __future__ import annotations

import json
import logging
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sourcetools import as_worker, collect

from aloader import DataLoader, JsonLines
from aloader.sources._sharding import assign_shards

SIZES = [3, 5, 8, 2, 7]  # uneven shards: 5 shards, 25 records


def write_uneven(tmp_path: Path, sizes: list[int] = SIZES) -> list[int]:
    """Shards s0..s{n-1} of ``sizes`` records; ids run on across shards (id // 100 = shard)."""
    for shard, size in enumerate(sizes):
        (tmp_path / f"s{shard}.jsonl").write_text(
            "".join(json.dumps({"id": shard * 100 + i}) + "\n" for i in range(size)))
    return [shard * 100 + i for shard, size in enumerate(sizes) for i in range(size)]


async def per_rank(tmp_path: Path, world: int, workers: int, epoch: int = 0,
                   **options: Any) -> tuple[list[list[int]], list[JsonLines]]:
    """The ids each rank reads (its workers simulated in turn), and the sources used."""
    ranks, sources = [], []
    for rank in range(world):
        ids: list[int] = []
        for worker in range(workers):
            source = JsonLines(str(tmp_path), rank=rank, world_size=world, **options)
            source.set_epoch(epoch)
            with as_worker(worker, workers, dataset=source, seed=0):
                ids.extend(r["id"] for r in await collect(source))
            sources.append(source)
        ranks.append(ids)
    return ranks, sources


@pytest.mark.parametrize(("world", "workers"), [(2, 1), (2, 2), (3, 1), (3, 2), (2, 3)])
@pytest.mark.parametrize("shuffle", [False, True])
async def test_same_number_of_shards_with_even_ranks(tmp_path: Path, anyio_backend: str,
                                                     world: int, workers: int,
                                                     shuffle: bool) -> None:
    write_uneven(tmp_path)
    for epoch in range(3):
        ranks, sources = await per_rank(tmp_path, world, workers, epoch, even_ranks=True,
                                        shuffle_shards=shuffle, seed=2)
        shards = [{i // 100 for i in ids} for ids in ranks]
        assert [len(s) for s in shards] == [5 // world] * world
        read = [i for ids in ranks for i in ids]
        assert len(read) == len(set(read))  # still at most once
        assert set().union(*shards) <= set(range(5))
        # one shard dropped per rank holding one more, counted once (by its worker 0)
        assert sum(s.stats.shards_dropped for s in sources) == 5 % world


@pytest.mark.parametrize(("world", "workers"), [(2, 1), (3, 2), (2, 3)])
@pytest.mark.parametrize("shuffle", [False, True])
async def test_every_record_once_by_default(tmp_path: Path, anyio_backend: str, world: int,
                                            workers: int, shuffle: bool) -> None:
    """torch's DistributedSampler drops nothing unless asked: neither does a source. Unequal
    shares are warned about by rank 0 (its worker 0), once per epoch, with both remedies."""
    ids = write_uneven(tmp_path)
    for epoch in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ranks, sources = await per_rank(tmp_path, world, workers, epoch,
                                            shuffle_shards=shuffle, seed=2)
        assert sorted(i for rank in ranks for i in rank) == ids
        assert sum(s.stats.shards_dropped for s in sources) == 0
        messages = [str(w.message) for w in caught if w.category is UserWarning]
        assert len(messages) == 1
        shares = {2: "rank 0 reads 3 shards, rank 1 reads 2 shards.",
                  3: "ranks 0 to 1 read 2 shards each, rank 2 reads 1 shard."}[world]
        assert messages[0].startswith(f"epoch {epoch}: 5 shards over {world} ranks: {shares}")
        assert "even_ranks=True" in messages[0] and "records_per_rank=N" in messages[0]


async def test_seven_shards_on_three_ranks_read_all_seventy(tmp_path: Path,
                                                            anyio_backend: str) -> None:
    ids = write_uneven(tmp_path, [10] * 7)
    with pytest.warns(UserWarning, match=r"rank 0 reads 3 shards, ranks 1 to 2 read 2 shards "
                                         r"each"):
        ranks, _ = await per_rank(tmp_path, 3, 1)
    assert sorted(i for rank in ranks for i in rank) == ids


async def test_equal_shares_warn_nothing(tmp_path: Path, anyio_backend: str) -> None:
    write_uneven(tmp_path, [3, 5, 8, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ranks, _ = await per_rank(tmp_path, 2, 2)
    assert sum(len(rank) for rank in ranks) == 18


async def test_shard_left_out_on_request_is_logged(tmp_path: Path, anyio_backend: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    write_uneven(tmp_path)
    with caplog.at_level(logging.INFO, logger="aloader.sources"), warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: no warning
        await per_rank(tmp_path, 2, 2, epoch=1, even_ranks=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "aloader.sources"]
    assert len(lines) == 1  # rank 0 (by its worker 0); rank 1 leaves nothing out
    assert lines[0].startswith("epoch 1: rank 0 of 2 leaves out shard 2 (")
    assert "s2.jsonl" in lines[0] and "every rank reads 2 of the 5 shards" in lines[0]


async def test_dropped_shard_rotates(tmp_path: Path, anyio_backend: str) -> None:
    """Without shuffling, a rank keeps its own shards and drops each of them in turn: over
    len(share) epochs each is dropped once, so over 2 epochs every shard is read."""
    write_uneven(tmp_path)
    read: list[set[int]] = []
    for epoch in range(3):
        ranks, _ = await per_rank(tmp_path, 2, 1, epoch, even_ranks=True)
        read.append({i // 100 for ids in ranks for i in ids})
        assert {i // 100 for i in ranks[1]} == {1, 3}  # rank 1: its share, nothing dropped
    # rank 0's share is shards 0, 2, 4: drops 0, then 2, then 4
    assert read == [{1, 2, 3, 4}, {0, 1, 3, 4}, {0, 1, 2, 3}]
    assert read[0] | read[1] == set(range(5))


def test_split_depends_on_rank_not_workers() -> None:
    """6 shards, 2 ranks: 3 shards each whatever the workers (the old global round robin over
    ranks x workers gave rank 0 four shards and rank 1 two with 2 workers)."""
    for workers in (1, 2, 3, 4):
        for even in (None, "shards"):
            counts = [sum(len(assign_shards(6, rank=r, world_size=2, worker_id=w,
                                            num_workers=workers, even=even))
                          for w in range(workers)) for r in range(2)]
            assert counts == [3, 3], (workers, even)


@pytest.mark.parametrize(("world", "workers", "per"), [(2, 1, 12), (2, 2, 12), (3, 1, 9),
                                                       (3, 2, 7), (2, 3, 20), (3, 4, 5)])
async def test_records_per_rank_exact(tmp_path: Path, anyio_backend: str, world: int,
                                      workers: int, per: int) -> None:
    write_uneven(tmp_path)
    for epoch in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # evened out: nothing to warn about
            ranks, sources = await per_rank(tmp_path, world, workers, epoch,
                                            shuffle_shards=True, seed=1, records_per_rank=per)
        assert [len(ids) for ids in ranks] == [per] * world
        assert sum(s.stats.shards_dropped for s in sources) == 0
        for ids in ranks:
            # a rank repeats only what it has read before (a new pass from the start)
            repeats = sum(n - 1 for n in Counter(ids).values())
            assert repeats <= sum(s.stats.repeated for s in sources)


async def test_records_per_rank_stops_and_repeats(tmp_path: Path, anyio_backend: str) -> None:
    write_uneven(tmp_path)
    # 2 ranks, no shuffle: rank 0 reads s0, s2, s4 (3 + 8 + 7), rank 1 reads s1, s3 (5 + 2)
    ranks, sources = await per_rank(tmp_path, 2, 1, records_per_rank=10)
    assert ranks[0] == [*range(0, 3), *range(200, 207)]  # stops at 10
    assert ranks[1] == [*range(100, 105), 300, 301, *range(100, 103)]  # a second pass
    assert [s.stats.repeated for s in sources] == [0, 3]


async def test_batches_equal_through_the_loader(tmp_path: Path, anyio_backend: str) -> None:
    write_uneven(tmp_path)
    batches = []
    for rank in range(3):
        source = JsonLines(str(tmp_path), rank=rank, world_size=3, records_per_rank=9)
        batches.append([len(b) async for b in DataLoader(source, batch_size=4,
                                                         collate_fn=list)])
    assert batches == [[4, 4, 1]] * 3


@pytest.mark.parametrize("workers", [1, 2, 3])
async def test_workers_of_a_rank_exactly_once(tmp_path: Path, anyio_backend: str,
                                              workers: int) -> None:
    """Within a rank, its workers read its (kept) shards exactly once between them: the same
    records as the rank read by one worker."""
    write_uneven(tmp_path, [4, 4, 4, 4, 4, 4, 4])
    for epoch in range(2):
        alone, _ = await per_rank(tmp_path, 2, 1, epoch, shuffle_shards=True, seed=3,
                                  even_ranks=True)
        split, _ = await per_rank(tmp_path, 2, workers, epoch, shuffle_shards=True, seed=3,
                                  even_ranks=True)
        for one, many in zip(alone, split, strict=True):
            assert sorted(one) == sorted(many)
            assert len(many) == 12


async def test_world_size_env_leaves_it_off(tmp_path: Path, anyio_backend: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    write_uneven(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    source = JsonLines(str(tmp_path))
    assert source.even_ranks is None
    assert len(source.shards_for(0)) == 3  # its whole share
    assert len(JsonLines(str(tmp_path), even_ranks=True).shards_for(0)) == 2  # of 3
    monkeypatch.setenv("WORLD_SIZE", "1")
    single = JsonLines(str(tmp_path))
    assert single.even_ranks is None
    assert len(await collect(single)) == 25
    off = JsonLines(str(tmp_path), rank=0, world_size=2, even_ranks=False)
    assert off.even_ranks is None and len(off.shards_for(0)) == 3


def test_rank_without_a_shard_is_refused(tmp_path: Path) -> None:
    write_uneven(tmp_path, [3, 3])
    with pytest.raises(ValueError, match=r"2 shards for world_size 3: rank 2 would read no "
                                         r"shard.*this process is rank 0"):
        JsonLines(str(tmp_path), rank=0, world_size=3, even_ranks=True)
    with pytest.raises(ValueError, match=r"ranks 2 to 4"):
        JsonLines(str(tmp_path), rank=1, world_size=5, records_per_rank=4)
    # by default (or opting out) every shard is read, some ranks reading none
    assert JsonLines(str(tmp_path), rank=2, world_size=3, even_ranks=False).shards_for(0) == []
    assert JsonLines(str(tmp_path), rank=2, world_size=3).shards_for(0) == []


def test_bad_options(tmp_path: Path) -> None:
    write_uneven(tmp_path, [3, 3])
    with pytest.raises(ValueError, match="records_per_rank"):
        JsonLines(str(tmp_path), records_per_rank=0)
    with pytest.raises(ValueError, match="even_ranks=False"):
        JsonLines(str(tmp_path), records_per_rank=3, even_ranks=False)


async def test_records_per_rank_of_empty_shards_is_an_error(tmp_path: Path,
                                                            anyio_backend: str) -> None:
    write_uneven(tmp_path, [0, 0])
    source = JsonLines(str(tmp_path), records_per_rank=3)
    with pytest.raises(Exception, match="holds no records"):
        await collect(source)


async def test_records_per_rank_resumes(tmp_path: Path, anyio_backend: str) -> None:
    """A state saved in the second pass resumes there: the rest of the quota, exactly."""
    write_uneven(tmp_path)
    def make() -> JsonLines:
        return JsonLines(str(tmp_path), rank=1, world_size=2, records_per_rank=10,
                         chunk_size=16)
    full = [r["id"] for r in await collect(make())]
    for cut in (3, 6, 8, 9):
        source = make()
        it = source.__aiter__()
        head = [(await it.__anext__())["id"] for _ in range(cut)]
        state = source.state_dict()
        await it.aclose()
        again = make()
        again.load_state_dict(state)
        assert head + [r["id"] for r in await collect(again)] == full, cut


async def test_parquet_even_ranks(tmp_path: Path, anyio_backend: str) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from aloader import ParquetRows
    paths = []
    for file, size in enumerate([3, 5, 8]):
        path = tmp_path / f"f{file}.parquet"
        pq.write_table(pa.table({"id": list(range(file * 100, file * 100 + size))}), path)
        paths.append(str(path))
    counts = []
    for rank in range(2):
        rows = await collect(ParquetRows(paths, rank=rank, world_size=2, records_per_rank=6))
        counts.append(len(rows))
    assert counts == [6, 6]
    dropped = [ParquetRows(paths, rank=rank, world_size=2, even_ranks=True)
               for rank in range(2)]
    files = [len(await collect(s)) for s in dropped]
    assert files in ([8, 5], [3, 5])  # rank 0 reads one of f0, f2; rank 1 reads f1
    assert [s.stats.shards_dropped for s in dropped] == [1, 0]
    with pytest.raises(ValueError, match="row groups for world_size 3"):
        ParquetRows(paths[:1], rank=0, world_size=3, even_ranks=True)
    with pytest.warns(UserWarning, match="3 files over 2 ranks: rank 0 reads 2 files"):
        assert len(await collect(ParquetRows(paths, rank=0, world_size=2))) == 11
