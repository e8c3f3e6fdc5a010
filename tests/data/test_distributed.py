"""DistributedSampler: torch's shard, padding and seeding rules."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aloader import BatchSampler, DistributedSampler
from aloader.data._batchsampler import epoch_batches
from aloader.data._indices import epoch_indices
from aloader.data._random import torch_randperm
from aloader.sources._sharding import resolve_world

SETTINGS = settings(max_examples=80, deadline=None)


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def _expected_global_order(n: int, replicas: int, drop_last: bool, order: list[int]) -> list[int]:
    """torch's padded/truncated order, written out from its source."""
    if drop_last and n % replicas:
        num_samples = math.ceil((n - replicas) / replicas)
    else:
        num_samples = math.ceil(n / replicas)
    total = num_samples * replicas
    indices = list(order)
    if not drop_last:
        padding = total - len(indices)
        if padding <= len(indices):
            indices += indices[:padding]
        else:
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
    else:
        indices = indices[:total]
    return indices


def test_reference_example() -> None:
    shards = [list(DistributedSampler(range(10), 4, r, shuffle=False)) for r in range(4)]
    assert shards == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    dropped = [
        list(DistributedSampler(range(10), 4, r, shuffle=False, drop_last=True)) for r in range(4)
    ]
    assert dropped == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_padding_larger_than_dataset_repeats_it_whole() -> None:
    shards = [list(DistributedSampler(range(2), 5, r, shuffle=False)) for r in range(5)]
    assert shards == [[0], [1], [0], [1], [0]]


def test_attributes_and_len() -> None:
    sampler = DistributedSampler(range(10), num_replicas=4, rank=3, seed=5, drop_last=True)
    assert (sampler.num_replicas, sampler.rank, sampler.seed, sampler.epoch) == (4, 3, 5, 0)
    assert sampler.shuffle is True and sampler.drop_last is True
    assert sampler.num_samples == len(sampler) == 2
    assert sampler.total_size == 8


@SETTINGS
@given(
    n=st.integers(0, 60),
    replicas=st.integers(1, 9),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
)
def test_shards_cover_the_padded_order(
    n: int, replicas: int, drop_last: bool, shuffle: bool, seed: int, epoch: int
) -> None:
    samplers = [
        DistributedSampler(range(n), replicas, r, shuffle=shuffle, seed=seed, drop_last=drop_last)
        for r in range(replicas)
    ]
    for s in samplers:
        s.set_epoch(epoch)
    shards = [list(s) for s in samplers]
    num_samples = samplers[0].num_samples
    assert all(
        len(shard) == len(s) == num_samples for shard, s in zip(shards, samplers, strict=True)
    )

    # Interleaving the shards rebuilds one global order shared by every rank.
    order = [shards[i % replicas][i // replicas] for i in range(num_samples * replicas)]
    base = (
        torch_randperm(n, seed + epoch).tolist() if shuffle else list(range(n))
    )
    assert order == _expected_global_order(n, replicas, drop_last, base)

    counts = Counter(order)
    if drop_last or n % replicas == 0:
        # no padding: the shards are disjoint
        assert len(counts) == len(order)
        assert len(order) == n - n % replicas
    else:
        # padding repeats from the start: every index appears, some once more (or cyclically)
        assert set(counts) == set(range(n))
        assert max(counts.values()) - min(counts.values()) <= 1
        assert len(order) == n + (-n) % replicas


def test_shuffle_depends_on_seed_and_epoch_only() -> None:
    a = DistributedSampler(range(100), 2, 0, seed=3)
    b = DistributedSampler(range(100), 2, 0, seed=3)
    first = list(a)
    assert list(a) == first  # same epoch, same order
    assert list(b) == first  # same seed, same order
    a.set_epoch(1)
    assert a.epoch == 1
    second = list(a)
    assert second != first
    b.set_epoch(1)
    assert list(b) == second
    assert list(DistributedSampler(range(100), 2, 0, seed=4)) != first
    # seed + epoch is what seeds the shuffle
    c = DistributedSampler(range(100), 2, 0, seed=4)
    assert list(c) == second


def test_no_shuffle_ignores_epoch() -> None:
    sampler = DistributedSampler(range(10), 3, 1, shuffle=False)
    first = list(sampler)
    sampler.set_epoch(7)
    assert list(sampler) == first == [1, 4, 7, 0]


def test_negative_seed_is_accepted() -> None:
    sampler = DistributedSampler(range(10), 1, 0, seed=-5)
    assert sorted(sampler) == list(range(10))


def test_iter_is_built_eagerly_like_torch() -> None:
    sampler = DistributedSampler(range(50), 1, 0, seed=0)
    it = iter(sampler)
    sampler.set_epoch(1)
    epoch0 = list(it)
    sampler.set_epoch(0)
    assert list(sampler) == epoch0


def test_iter_equals_epoch_indices() -> None:
    sampler = DistributedSampler(range(1000), 3, 2, seed=1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        arr = sampler._epoch_indices()
        assert arr.dtype == np.int64 and arr.ndim == 1 and arr.flags.c_contiguous
        assert list(sampler) == arr.tolist()
        assert all(type(i) is int for i in sampler)
        assert epoch_indices(sampler).tolist() == arr.tolist()  # type: ignore[union-attr]


def test_in_batch_sampler_uses_the_array_form() -> None:
    sampler = DistributedSampler(range(10), 4, 3, shuffle=False)
    batches = epoch_batches(BatchSampler(sampler, 2, False))
    assert batches is not None
    assert [b.tolist() for b in batches] == [[3, 7], [1]]
    assert list(BatchSampler(sampler, 2, True)) == [[3, 7]]


def test_drop_last_batches_never_duplicate() -> None:
    # torch's test_duplicating_data_with_drop_last
    seen: list[int] = []
    for rank in range(4):
        sampler = DistributedSampler(range(9), 4, rank)
        for batch in BatchSampler(sampler, 2, True):
            seen.extend(batch)
    assert len(seen) == len(set(seen))


@pytest.mark.parametrize(("replicas", "rank"), [(3, 3), (3, -1), (1, 1), (0, 0)])
def test_invalid_rank(replicas: int, rank: int) -> None:
    with pytest.raises(ValueError) as info:
        DistributedSampler(range(10), replicas, rank)
    assert str(info.value) == (
        f"Invalid rank {rank}, rank should be in the interval [0, {replicas - 1}]"
    )


def test_invalid_rank_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

    for replicas, rank in [(3, 3), (3, -1), (1, 1), (4, 10)]:
        with pytest.raises(ValueError) as ours:
            DistributedSampler(range(10), replicas, rank)
        with pytest.raises(ValueError) as theirs:
            TorchDistributedSampler(torch.arange(10), replicas, rank)
        assert str(ours.value) == str(theirs.value)


def test_environment_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = DistributedSampler(range(10))
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    assert list(DistributedSampler(range(10), shuffle=False)) == list(range(10))

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    sampler = DistributedSampler(range(10), shuffle=False)
    assert (sampler.num_replicas, sampler.rank) == (4, 3)
    assert list(sampler) == [3, 7, 1]

    # explicit arguments win over the environment
    sampler = DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=False)
    assert (sampler.num_replicas, sampler.rank) == (2, 1)
    sampler = DistributedSampler(range(10), rank=0)
    assert (sampler.num_replicas, sampler.rank) == (4, 0)

    monkeypatch.setenv("RANK", "4")
    with pytest.raises(
        ValueError, match=r"^Invalid rank 4, rank should be in the interval \[0, 3\]$"
    ):
        DistributedSampler(range(10))


def test_environment_only_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    sampler = DistributedSampler(range(10))
    assert (sampler.num_replicas, sampler.rank) == (2, 0)


@pytest.mark.parametrize("name", ["WORLD_SIZE", "RANK"])
def test_bad_environment_value(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "two")
    with pytest.raises(ValueError, match=name):
        DistributedSampler(range(10))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 9, 10, 17, 33])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_matches_torch_without_shuffle(n: int, replicas: int, drop_last: bool) -> None:
    pytest.importorskip("torch")
    from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

    for rank in range(replicas):
        ours = DistributedSampler(range(n), replicas, rank, shuffle=False, drop_last=drop_last)
        theirs = TorchDistributedSampler(
            range(n), replicas, rank, shuffle=False, drop_last=drop_last
        )
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)
        assert (ours.num_samples, ours.total_size) == (theirs.num_samples, theirs.total_size)


@pytest.mark.parametrize("n", [1, 10, 33])
@pytest.mark.parametrize("replicas", [1, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_lengths_and_coverage_match_torch(n: int, replicas: int, drop_last: bool) -> None:
    pytest.importorskip("torch")
    from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

    ours = [
        list(DistributedSampler(range(n), replicas, r, drop_last=drop_last))
        for r in range(replicas)
    ]
    theirs = [
        list(TorchDistributedSampler(range(n), replicas, r, drop_last=drop_last))
        for r in range(replicas)
    ]
    assert [len(s) for s in ours] == [len(s) for s in theirs]
    ours_counts = Counter(i for shard in ours for i in shard)
    theirs_counts = Counter(i for shard in theirs for i in shard)
    assert sorted(ours_counts.values()) == sorted(theirs_counts.values())


# ------------------------------------------------------------------ a dataset too long for memory


class _Huge:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("drop_last", [False, True])
def test_huge_dataset_without_shuffle_starts_at_once(drop_last: bool) -> None:
    import itertools
    import tracemalloc

    n = 10**12 + 1
    tracemalloc.start()
    try:
        sampler = DistributedSampler(_Huge(n), 3, 1, shuffle=False, drop_last=drop_last)
        first = list(itertools.islice(iter(sampler), 4))
        batches = epoch_batches(BatchSampler(sampler, 2, False))
        assert batches is not None
        two = [b.tolist() for b in itertools.islice(batches, 2)]
        indices = epoch_indices(sampler)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert first == [1, 4, 7, 10]
    assert two == [[1, 4], [7, 10]]
    assert indices is None
    assert peak < 200 * 2**20, peak
    assert len(sampler) == (n // 3 if drop_last else -(-n // 3))


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a shard of more than 5 indices "huge", computed 3 at a time."""
    import aloader.data._distributed
    import aloader.data._indices
    import aloader.data._sampler

    monkeypatch.setattr(aloader.data._indices, "_EPOCH_MAX", 5)
    monkeypatch.setattr(aloader.data._indices, "_BLOCK", 3)
    monkeypatch.setattr(aloader.data._sampler, "_EPOCH_MAX", 5)
    monkeypatch.setattr(aloader.data._sampler, "_BLOCK", 3)
    monkeypatch.setattr(aloader.data._distributed, "_EPOCH_MAX", 5)


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("n", [0, 1, 2, 7, 10, 17, 33])
@pytest.mark.parametrize("replicas", [1, 2, 3, 5])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_block_by_block_shard_is_the_shard(
    n: int, replicas: int, drop_last: bool, shuffle: bool
) -> None:
    for rank in range(replicas):
        sampler = DistributedSampler(range(n), replicas, rank, shuffle=shuffle, seed=3,
                                     drop_last=drop_last)
        sampler.set_epoch(2)
        base = torch_randperm(n, 5).tolist() if shuffle else list(range(n))
        expected = _expected_global_order(n, replicas, drop_last, base)[rank::replicas]
        assert list(sampler) == expected
        batches = epoch_batches(BatchSampler(sampler, 2, False))
        assert batches is not None
        assert [i for b in batches for i in b.tolist()] == expected
        if len(sampler) > 5:
            assert epoch_indices(sampler) is None


def test_a_dataset_that_changed_size_fails_like_torch() -> None:
    data = list(range(10))
    sampler = DistributedSampler(data, 3, 0, shuffle=False, drop_last=True)
    del data[5:]
    with pytest.raises(AssertionError, match=r"Number of indices \(5\) does not match total_size"):
        list(sampler)


@pytest.mark.parametrize("n", [0, 1, 2, 10, 23, 100, 1000])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_shards_are_torchs(n: int, world: int, drop_last: bool) -> None:
    """Differential: each rank's shard, epoch after epoch, is torch's (torch's randperm of a
    generator seeded with seed + epoch, made without torch)."""
    torch = pytest.importorskip("torch")
    for seed in (0, 5, -7, 2**32 + 1):
        for rank in range(world):
            ours = DistributedSampler(range(n), world, rank, seed=seed, drop_last=drop_last)
            theirs = torch.utils.data.DistributedSampler(range(n), world, rank, seed=seed,
                                                         drop_last=drop_last)
            for epoch in (0, 1, 4):
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                assert list(ours) == list(theirs), (seed, rank, epoch)


@pytest.fixture
def process_group() -> Iterator[None]:
    """torch.distributed's default group of rank 1 in a world of 3, as mp.spawn scripts make it
    (init_process_group's own rank and world_size, no RANK/WORLD_SIZE in the environment)."""
    pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=3)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("process_group")
def test_an_initialized_process_group_gives_the_rank_and_world_like_torch() -> None:
    # Read from the environment only, every rank of such a script got the whole dataset.
    from torch.utils.data import DistributedSampler as TorchDistributedSampler

    for kwargs in ({}, {"rank": 0}, {"num_replicas": 2}):
        ours = DistributedSampler(range(10), shuffle=False, **kwargs)
        theirs = TorchDistributedSampler(range(10), shuffle=False, **kwargs)
        assert (ours.num_replicas, ours.rank) == (theirs.num_replicas, theirs.rank)
        assert list(ours) == list(theirs)
    assert resolve_world(None, None) == (1, 3)


@pytest.mark.usefixtures("process_group")
def test_the_process_group_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    sampler = DistributedSampler(range(10))
    assert (sampler.num_replicas, sampler.rank) == (3, 1)
