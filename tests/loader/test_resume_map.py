"""Checkpoints of map-style epochs: DataLoader.state_dict() / load_state_dict().

Every resume test interrupts a loader after k batches of some epoch (k = 0, mid-epoch, the
last batch; the first and a later epoch), round-trips the state through JSON, loads it into a
FRESH loader built with the same arguments, and compares what it yields, batch by batch, with
an uninterrupted run: the rest of the interrupted epoch, then the later epochs.
"""

from __future__ import annotations

import json
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aloader
from aloader import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from aloader.loader._checkpoint import _EpochRecord
from aloader.loader._epochs import AlreadyDelivered

N = 23
BS = 4  # 6 batches, the last one of 3


class Counting(aloader.Dataset[Any]):
    """A map-style dataset that counts the samples it is asked for."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.fetched: list[int] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getstate__(self) -> dict[str, Any]:  # workers get a copy without the lock
        return {"n": self.n, "fetched": []}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def __getitem__(self, index: int) -> Any:
        with self._lock:
            self.fetched.append(int(index))
        return np.array([index, index * 10])


class AsyncCounting(Counting):
    async def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        await anyio.sleep(0.0005 * (index % 3))
        return super().__getitem__(index)


def listed(batch: Any) -> Any:
    return batch.tolist() if hasattr(batch, "tolist") else batch


def epoch_of(loader: DataLoader[Any]) -> list[Any]:
    return [listed(b) for b in loader]


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    loaded = json.loads(json.dumps(state))
    assert pickle.loads(pickle.dumps(state)) == state
    return loaded  # type: ignore[no-any-return]


class Job:
    """A training job: builds its loader (and samplers) from the same arguments each time."""

    def __init__(self, build: Callable[[], DataLoader[Any]],
                 before_epoch: Callable[[DataLoader[Any], int], None] | None = None) -> None:
        self.build = build
        self.before_epoch = before_epoch or (lambda loader, epoch: None)

    def uninterrupted(self, epochs: int) -> list[list[Any]]:
        loader = self.build()
        out = []
        for e in range(epochs):
            self.before_epoch(loader, e)
            out.append(epoch_of(loader))
        return out

    def interrupted(self, epoch: int, k: int) -> tuple[list[Any], dict[str, Any]]:
        loader = self.build()
        for e in range(epoch):
            self.before_epoch(loader, e)
            epoch_of(loader)
        self.before_epoch(loader, epoch)
        it = iter(loader)
        got = [listed(next(it)) for _ in range(k)]
        state = roundtrip(loader.state_dict())
        it.close()
        loader.close()
        return got, state

    def resumed(self, state: dict[str, Any], epochs: int) -> list[list[Any]]:
        loader = self.build()
        loader.load_state_dict(state)
        out = []
        for e in range(state["epoch"], state["epoch"] + epochs):
            self.before_epoch(loader, e)
            out.append(epoch_of(loader))
        loader.close()
        return out


def check_resume(job: Job, epoch: int, k: int, resumed: Job | None = None) -> None:
    ref = job.uninterrupted(epoch + 3)
    got, state = job.interrupted(epoch, k)
    assert got == ref[epoch][:k]
    rest = (resumed or job).resumed(state, 2)
    # After the last batch (before the epoch ended), as torchdata's: the epoch's empty rest,
    # then the next one.
    assert state["epoch"] == epoch and state["yielded"] == k
    assert rest == [ref[epoch][k:], ref[epoch + 1]]


class Stateful:
    """A custom sampler with torchdata's protocol: its own seeded generator."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(seed)

    def __iter__(self) -> Iterator[int]:
        yield from self.rng.permutation(self.n).tolist()

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]


class Plain:
    """A custom sampler without the protocol (fast-forwarded by counting)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.iterations = 0

    def __iter__(self) -> Iterator[int]:
        self.iterations += 1
        yield from reversed(range(self.n))

    def __len__(self) -> int:
        return self.n


class Pairs:
    """A custom batch sampler without the protocol."""

    def __iter__(self) -> Iterator[list[int]]:
        for i in range(0, N - 1, 2):
            yield [i, i + 1]

    def __len__(self) -> int:
        return (N - 1) // 2


def _set_epoch(loader: DataLoader[Any], epoch: int) -> None:
    loader.sampler.set_epoch(epoch)


JOBS: dict[str, Job] = {
    "sequential": Job(lambda: DataLoader(Counting(), batch_size=BS)),
    "shuffle-int": Job(lambda: DataLoader(Counting(), batch_size=BS, shuffle=True, generator=7)),
    "shuffle-numpy": Job(lambda: DataLoader(Counting(), batch_size=BS, shuffle=True,
                                            generator=np.random.default_rng(5))),
    "drop-last": Job(lambda: DataLoader(Counting(), batch_size=BS, shuffle=True, generator=1,
                                        drop_last=True)),
    "no-batching": Job(lambda: DataLoader(Counting(), batch_size=None, shuffle=True,
                                          generator=2)),
    "weighted": Job(lambda: DataLoader(Counting(), batch_size=BS, sampler=WeightedRandomSampler(
        np.linspace(0.1, 1, N), 17, generator=np.random.default_rng(3)))),
    "subset": Job(lambda: DataLoader(Counting(), batch_size=BS, sampler=SubsetRandomSampler(
        list(range(2, 20)), generator=4))),
    "random-replacement": Job(lambda: DataLoader(Counting(), batch_size=BS, sampler=RandomSampler(
        range(N), replacement=True, num_samples=30, generator=9))),
    "distributed": Job(lambda: DataLoader(Counting(), batch_size=BS, sampler=DistributedSampler(
        range(N), num_replicas=2, rank=1, seed=11)), _set_epoch),
    "distributed-unset": Job(lambda: DataLoader(Counting(), batch_size=BS,
                                                sampler=DistributedSampler(range(N), 2, 0))),
    "custom-stateful": Job(lambda: DataLoader(Counting(), batch_size=BS, sampler=Stateful(N, 8))),
    "custom-plain": Job(lambda: DataLoader(Counting(), batch_size=BS, sampler=Plain(N))),
    "custom-batch-sampler": Job(lambda: DataLoader(Counting(), batch_sampler=Pairs())),
    "batch-sampler-over-stateful": Job(lambda: DataLoader(Counting(), batch_sampler=BatchSampler(
        Stateful(N, 3), 5, False))),
    "threads": Job(lambda: DataLoader(Counting(), batch_size=BS, shuffle=True, generator=7,
                                      max_concurrency=3)),
    "async": Job(lambda: DataLoader(AsyncCounting(), batch_size=BS, shuffle=True, generator=7)),
}


@pytest.mark.parametrize("name", sorted(JOBS))
@pytest.mark.parametrize(("epoch", "k"), [(0, 0), (0, 2), (0, -1), (1, 0), (1, 3), (1, -1)])
def test_resume_equals_the_uninterrupted_run(name: str, epoch: int, k: int) -> None:
    job = JOBS[name]
    if k < 0:
        k = len(job.uninterrupted(1)[0])
    check_resume(job, epoch, k)


@pytest.mark.parametrize("k", [0, 2, 6])
def test_resume_without_a_generator_reproduces_the_run(k: int) -> None:
    """generator=None draws fresh entropy: the state records it, so a fresh loader resumes
    exactly what the interrupted loader itself goes on to yield."""
    loader = DataLoader(Counting(), batch_size=BS, shuffle=True)
    epoch_of(loader)
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = roundtrip(loader.state_dict())
    rest = [listed(b) for b in it]  # none after the last batch (k == 6)
    then = epoch_of(loader)
    fresh = DataLoader(Counting(), batch_size=BS, shuffle=True)
    fresh.load_state_dict(state)
    assert fresh.sample_seed == loader.sample_seed
    assert epoch_of(fresh) == rest
    assert epoch_of(fresh) == then


def test_resume_with_the_global_rng_of_torch() -> None:
    torch = pytest.importorskip("torch")

    def build() -> DataLoader[Any]:
        return DataLoader(Counting(), batch_size=BS, shuffle=True)

    torch.manual_seed(0)
    ref = Job(build).uninterrupted(3)
    torch.manual_seed(0)
    got, state = Job(build).interrupted(1, 2)
    torch.manual_seed(123)  # the resume sets torch's global generator back
    rest = Job(build).resumed(state, 2)
    assert got + rest[0] == ref[1] and rest[1] == ref[2]


@pytest.mark.parametrize("k", [0, 3, 4])
def test_resume_with_a_torch_generator(k: int) -> None:
    torch = pytest.importorskip("torch")
    job = Job(lambda: DataLoader(Counting(), batch_size=BS, shuffle=True,
                                 generator=torch.Generator().manual_seed(3)))
    check_resume(job, 1, k)
    job = Job(lambda: DataLoader(Counting(), batch_size=BS, sampler=WeightedRandomSampler(
        np.ones(N), 15, generator=torch.Generator().manual_seed(1))))
    check_resume(job, 1, k)


def test_resume_async_for(anyio_backend: str) -> None:
    async def main() -> None:
        def build() -> DataLoader[Any]:
            return DataLoader(AsyncCounting(), batch_size=BS, shuffle=True, generator=3,
                              max_concurrency=5)

        async def epoch(loader: DataLoader[Any]) -> list[Any]:
            return [listed(b) async for b in loader]

        ref_loader = build()
        ref = [await epoch(ref_loader) for _ in range(3)]
        loader = build()
        await epoch(loader)
        got = []
        async for batch in loader:
            got.append(listed(batch))
            if len(got) == 4:
                state = roundtrip(loader.state_dict())
                assert state["yielded"] == 4
                break
        await loader.aclose()
        fresh = build()
        fresh.load_state_dict(state)
        assert got + await epoch(fresh) == ref[1]
        assert await epoch(fresh) == ref[2]

    anyio.run(main, backend=anyio_backend)


def test_resume_skips_without_fetching() -> None:
    """Resuming at the last batch fetches only that batch: skipped batches are never fetched,
    and an array sampler's skip draws the order once (no iteration over the skipped ones)."""
    for build in (
        lambda ds: DataLoader(ds, batch_size=BS, shuffle=True, generator=0),
        lambda ds: DataLoader(ds, batch_size=BS, sampler=Plain(N)),
        lambda ds: DataLoader(ds, batch_sampler=Pairs()),
    ):
        ds = Counting()
        loader = build(ds)
        it = iter(loader)
        batches = len(loader)
        for _ in range(batches - 1):
            next(it)
        state = loader.state_dict()
        it.close()
        fresh_ds = Counting()
        fresh = build(fresh_ds)
        fresh.load_state_dict(state)
        last = epoch_of(fresh)
        assert len(last) == 1
        assert sorted(fresh_ds.fetched) == sorted(row[0] for row in last[0])


def test_state_is_small_and_cheap_to_copy() -> None:
    loader = DataLoader(Counting(200_000), batch_size=BS, shuffle=True, generator=0)
    it = iter(loader)
    next(it)
    text = json.dumps(loader.state_dict())
    assert len(text) < 2_000  # positions and seeds, never the order
    it.close()


def test_state_reflects_received_batches_not_prefetched_ones() -> None:
    loader = DataLoader(Counting(), batch_size=BS, max_concurrency=4, prefetch_factor=4)
    it = iter(loader)
    next(it)
    threading.Event().wait(0.02)  # the pipeline prefetches meanwhile (whether or not it does)
    assert loader.state_dict()["yielded"] == 1
    next(it)
    assert loader.state_dict()["yielded"] == 2
    it.close()


def test_states_between_epochs() -> None:
    loader = DataLoader(Counting(), batch_size=BS, shuffle=True, generator=0)
    first = loader.state_dict()
    assert (first["epoch"], first["yielded"]) == (0, 0)
    epoch_of(loader)
    after = loader.state_dict()
    assert (after["epoch"], after["yielded"]) == (1, 0)
    fresh = DataLoader(Counting(), batch_size=BS, shuffle=True, generator=0)
    fresh.load_state_dict(after)
    assert fresh.state_dict() == after  # a pending resume describes itself
    ref = DataLoader(Counting(), batch_size=BS, shuffle=True, generator=0)
    epoch_of(ref)
    assert epoch_of(fresh) == epoch_of(ref)


def test_persistent_workers_keep_their_seeds_across_a_resume() -> None:
    """Epochs after the first of persistent workers keep the first one's base seed: a resume
    at a later epoch must start its workers with that seed, drawing nothing (the workers'
    global RNGs restart from it: their streams of the uninterrupted run are not restored, which
    is what sample_rng is for)."""

    class Seeded(Counting):
        def __getitem__(self, index: int) -> Any:
            info = aloader.get_worker_info()
            assert info is not None
            return np.array([index, info.seed - info.id])

    def build() -> DataLoader[Any]:
        return DataLoader(Seeded(12), batch_size=3, shuffle=True, generator=4, num_workers=2,
                          persistent_workers=True)

    check_resume(Job(build), 1, 2)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [0, 4])
def test_state_of_two_workers_resumes_with_other_counts(workers: int) -> None:
    def build(n: int) -> Callable[[], DataLoader[Any]]:
        return lambda: DataLoader(Counting(), batch_size=BS, shuffle=True, generator=6,
                                  num_workers=n)

    check_resume(Job(build(2)), 1, 2, resumed=Job(build(workers)))


def test_in_order_false_loses_and_repeats_nothing() -> None:
    class Slow(Counting):
        async def __getitem__(self, index: int) -> Any:  # type: ignore[override]
            # The first batch's samples are slow: later batches overtake them.
            await anyio.sleep(0.02 if index < 8 else 0)
            return super().__getitem__(index)

    def build() -> DataLoader[Any]:
        return DataLoader(Slow(40), batch_size=BS, in_order=False, max_concurrency=40,
                          prefetch_factor=6)

    for k in (1, 3, 5):
        loader = build()
        it = iter(loader)
        got = [next(it).tolist() for _ in range(k)]
        state = roundtrip(loader.state_dict())
        it.close()
        assert state["yielded"] == k
        assert state["map"]["prefix"] + len(state["map"]["delivered"]) == k
        fresh_ds = Slow(40)
        fresh = DataLoader(fresh_ds, batch_size=BS, in_order=False, max_concurrency=40,
                           prefetch_factor=6)
        fresh.load_state_dict(state)
        rest = [b.tolist() for b in fresh]
        rows = [row[0] for batch in got + rest for row in batch]
        assert sorted(rows) == list(range(40))  # none lost, none repeated
        assert len(fresh_ds.fetched) == 40 - 4 * k  # only the undelivered ones are fetched
        assert epoch_of(fresh) != []  # and the next epoch is whole
        again = fresh.state_dict()
        assert (again["epoch"], again["yielded"]) == (2, 0)


def test_record_and_skip_bookkeeping() -> None:
    record = _EpochRecord(0, {}, None, 10, AlreadyDelivered(2, frozenset({4, 6})))
    assert (record.prefix, record.beyond, record.yielded) == (2, {4, 6}, 4)
    record.received(3)
    assert (record.prefix, record.beyond) == (2, {3, 4, 6})
    record.received(2)
    assert (record.prefix, record.beyond) == (5, {6})
    record.received(7)
    record.received(5)
    assert (record.prefix, record.beyond, record.yielded) == (8, set(), 8)
    skip = AlreadyDelivered(2, frozenset({4, 6}))
    assert [skip.global_number(j) for j in range(5)] == [2, 3, 5, 7, 8]


def test_elastic_resume_from_two_ranks_to_three() -> None:
    """A job on 2 ranks interrupted after 3 batches resumes on 3 ranks: across all ranks every
    sample of the epoch is delivered once (beyond the new world's padding)."""
    n = 50

    def loader(world: int, rank: int) -> DataLoader[Any]:
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=5)
        sampler.set_epoch(2)
        return DataLoader(Counting(n), batch_size=BS, sampler=sampler)

    states = []
    seen: list[int] = []
    for rank in range(2):
        old = loader(2, rank)
        it = iter(old)
        for _ in range(3):
            seen.extend(row[0] for row in next(it).tolist())
        states.append(roundtrip(old.state_dict()))
        it.close()
    assert states[0]["map"]["sampler"]["sampler"]["epoch"] == 2
    rest: list[int] = []
    lengths = []
    for rank in range(3):
        new = loader(3, rank)
        new.load_state_dict(states[0])  # every rank's state says the same but the rank
        batches = epoch_of(new)
        lengths.append(sum(len(b) for b in batches))
        rest.extend(row[0] for batch in batches for row in batch)
        # The epoch after is an ordinary one of the new world.
        plain = loader(3, rank)
        plain.sampler.set_epoch(3)
        new.sampler.set_epoch(3)
        assert epoch_of(new) == epoch_of(plain)
    assert len(set(lengths)) == 1  # ranks stay in lockstep
    remaining = n - len(seen)
    padding = len(rest) - remaining
    assert 0 <= padding < 3
    assert sorted(set(seen + rest)) == list(range(n))
    assert len(set(seen)) == len(seen) and len(seen) + len(set(rest)) == n


def test_elastic_same_world_is_exact() -> None:
    def build() -> DataLoader[Any]:
        return DataLoader(Counting(), batch_size=BS, sampler=DistributedSampler(
            range(N), num_replicas=3, rank=2, seed=1))
    check_resume(Job(build, _set_epoch), 1, 1)


# Bad states -----------------------------------------------------------------------------------
def good_state() -> dict[str, Any]:
    loader = DataLoader(Counting(), batch_size=BS, shuffle=True, generator=0)
    it = iter(loader)
    next(it)
    state = roundtrip(loader.state_dict())
    it.close()
    return state


@pytest.mark.parametrize(("edit", "error", "match"), [
    (lambda s: s.update(format="other"), ValueError, "'format'"),
    (lambda s: s.update(version=2), ValueError, "'version'"),
    (lambda s: s.update(kind="iterable"), ValueError, "'kind'"),
    (lambda s: s.update(epoch="1"), TypeError, "'epoch'"),
    (lambda s: s.update(yielded=-1), ValueError, "'yielded'"),
    (lambda s: s["loader"].update(batch_size=5), ValueError, "batch_size.*4.*5|batch_size"),
    (lambda s: s["loader"].update(dataset_length=24), ValueError, "dataset_length"),
    (lambda s: s["loader"].update(drop_last=True), ValueError, "drop_last"),
    (lambda s: s["loader"].update(rng={"numpy": {"bit_generator": "MT19937"}}), ValueError,
     "rng"),
    (lambda s: s["loader"].update(base_seed="x"), TypeError, "base_seed"),
    (lambda s: s["map"].update(delivered="x"), TypeError, "delivered"),
    (lambda s: s["map"].update(sampler=None), ValueError, "sampler"),
    (lambda s: s["map"]["sampler"].update(sampler={"generator": 1}), ValueError, "generator"),
    (lambda s: s.pop("map"), ValueError, "'map'"),
    (lambda s: s.update(yielded=5), ValueError, "yielded"),
])
def test_bad_states_are_rejected_and_never_half_applied(
    edit: Callable[[dict[str, Any]], None], error: type[Exception], match: str
) -> None:
    state = good_state()
    edit(state)
    loader = DataLoader(Counting(), batch_size=BS, shuffle=True, generator=0)
    before = loader.state_dict()
    with pytest.raises(error, match=match):
        loader.load_state_dict(state)
    assert loader.state_dict() == before
    ref = DataLoader(Counting(), batch_size=BS, shuffle=True, generator=0)
    assert epoch_of(loader) == epoch_of(ref)


def test_distributed_sampler_state_must_match() -> None:
    state = DistributedSampler(range(10), 2, 0, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        DistributedSampler(range(10), 2, 0, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="length"):
        DistributedSampler(range(11), 2, 0, seed=1).load_state_dict(state)
    with pytest.raises(TypeError, match="should be a dict"):
        DataLoader(range(3)).load_state_dict([])  # type: ignore[arg-type]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_from_another_sampler_is_refused(workers: int) -> None:
    """A state saved with shuffle=True does not resume a shuffle=False loader (nor the other
    way round) in another order: it names both samplers."""
    data = list(range(20))
    shuffled = DataLoader(data, batch_size=4, shuffle=True, generator=0, num_workers=workers)
    it = iter(shuffled)
    next(it)
    state = shuffled.state_dict()
    with pytest.raises(ValueError, match=r"RandomSampler \(shuffle=True\).*"
                                         r"SequentialSampler \(shuffle=False\)"):
        DataLoader(data, batch_size=4, generator=0, num_workers=workers).load_state_dict(state)
    sequential = DataLoader(data, batch_size=4, generator=0, num_workers=workers)
    it = iter(sequential)
    next(it)
    with pytest.raises(ValueError, match=r"SequentialSampler.*RandomSampler"):
        DataLoader(data, batch_size=4, shuffle=True, generator=0).load_state_dict(
            sequential.state_dict())
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        DataLoader(data, batch_size=4, generator=0, sampler=aloader.WeightedRandomSampler(
            [1.0] * 20, 20, generator=0)).load_state_dict(state)
