"""torchdata's StatefulDataLoader contract: a dataset's (or its iterator's, or a sampler's)
``state_dict()`` / ``load_state_dict()`` are called and restored, in the loader's process and
in each worker, and a state taken at any point (before the first batch, between epochs,
after the last batch) resumes what the uninterrupted run would have done.

The datasets here are written the way torchdata's users (and its own tests) write them; the
checks are ours: a resumed run equals the uninterrupted one, batch for batch."""

from __future__ import annotations

import copy
import json
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import aloader
from aloader import DataLoader, Dataset, IterableDataset

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def as_list(batch: list[Any]) -> list[Any]:
    return list(batch)


def ints(batch: Any) -> Any:
    return np.asarray(batch).tolist()


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


def rest_after(make: Callable[[], DataLoader[Any]], k: int, epochs_before: int = 0,
               ) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """The uninterrupted epoch, and the rest of it from a state taken after ``k`` batches
    (taken on one loader, resumed on a new one)."""
    ref = make()
    for _ in range(epochs_before):
        list(ref)
    full = list(ref)
    ref.close()
    loader = make()
    for _ in range(epochs_before):
        list(loader)
    it = iter(loader)
    got = [next(it) for _ in range(k)]
    state = roundtrip(loader.state_dict())
    it.close()
    loader.close()
    assert got == full[:k]
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    resumed.close()
    return full, rest, state


# Datasets ------------------------------------------------------------------------------------
class _Position(Iterator[int]):
    """An iterator with the protocol over a dataset without it."""

    def __init__(self, items: list[int]) -> None:
        self.items = items
        self.i = 0

    def __next__(self) -> int:
        if self.i >= len(self.items):
            raise StopIteration
        self.i += 1
        return self.items[self.i - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["i"]


class StatefulIterator(IterableDataset[int]):
    """No protocol itself; its iterator has it (each worker iterates its own share)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> _Position:
        info = aloader.get_worker_info()
        if info is None:
            return _Position(list(range(self.n)))
        return _Position(list(range(info.id, self.n, info.num_workers)))


class SelfIterating(IterableDataset[int]):
    """Its own iterator: ``__iter__`` builds the position and returns ``self`` (so its state
    exists only once ``iter()`` was called, and must be loaded after it)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.iter_calls = 0

    def __iter__(self) -> SelfIterating:
        self.iter_calls += 1
        info = aloader.get_worker_info()
        wid, count = (0, 1) if info is None else (info.id, info.num_workers)
        self.position = {"at": wid, "step": count}
        return self

    def __next__(self) -> int:
        at = self.position["at"]
        if at >= self.n:
            raise StopIteration
        self.position["at"] = at + self.position["step"]
        return at

    def state_dict(self) -> dict[str, Any]:
        return {"position": dict(self.position)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = dict(state["position"])


class Exhaustible(IterableDataset[int]):
    """Its own iterator, never reset: a second epoch of the same object is empty."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.i = 0

    def __iter__(self) -> Exhaustible:
        return self

    def __next__(self) -> int:
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["i"]


class Epochs(IterableDataset[tuple[int, int]]):
    """Counts its own epochs (in whichever copy iterates it): the state says which."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0
        self.resume_at: int | None = None
        self.i = 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        info = aloader.get_worker_info()
        wid, count = (0, 1) if info is None else (info.id, info.num_workers)
        start, self.resume_at = self.resume_at or 0, None
        self.i = start
        for i in range(wid + start * count, self.n, count):
            self.i += 1
            yield i, self.epoch
        self.i = 0
        self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resume_at, self.epoch = state["i"], state["epoch"]


class Drawing(Dataset[int]):
    """A map-style dataset drawing from a generator of its own (per copy): its state is the
    generator's, which torchdata's users save so a resumed epoch draws the same."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(7)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index * 1000 + int(self.rng.integers(1000))

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]


class Calls(Dataset[int]):
    """A map-style dataset whose state is the same in every copy."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.config = {"scale": 1}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index * self.config["scale"]

    def state_dict(self) -> dict[str, Any]:
        return {"config": dict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.config = dict(state["config"])


# Tests ---------------------------------------------------------------------------------------
def test_snapshot_every_n_steps_is_accepted() -> None:
    """torchdata's knob of how often workers send their state: aloader's states are always
    exact, so it changes nothing; its type is checked."""
    for value in (None, 0, 1, 17):
        loader = DataLoader(list(range(6)), batch_size=2, snapshot_every_n_steps=value)
        assert loader.snapshot_every_n_steps == value
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    for bad in (-1, 1.5, "2", True):
        with pytest.raises((ValueError, TypeError), match="snapshot_every_n_steps"):
            DataLoader(list(range(6)), snapshot_every_n_steps=bad)


def test_stateful_is_torchdatas_protocol() -> None:
    assert isinstance(_Position([]), aloader.Stateful)
    assert isinstance(Drawing(1), aloader.Stateful)
    assert not isinstance(StatefulIterator(1), aloader.Stateful)
    assert "Stateful" in aloader.__all__


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_an_iterators_own_state_resumes(workers: int, k: int) -> None:
    """A dataset without the protocol whose iterator has it: the state was written, then
    refused ('protocol' where the dataset resumes by 'count')."""
    def make() -> DataLoader[Any]:
        return DataLoader(StatefulIterator(20), batch_size=2, num_workers=workers,
                          collate_fn=as_list)

    full, rest, state = rest_after(make, k)
    assert rest == full[k:]
    if k:
        replicas = state["iterable"]["replicas"]
        assert {r["kind"] for r in replicas if r is not None} == {"protocol"}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_self_iterating_dataset_is_loaded_after_iter(workers: int) -> None:
    """``__iter__`` makes the state ``load_state_dict`` fills: loaded before it, the resumed
    epoch failed (AttributeError in a worker's fresh copy) or started over (iter reset it)."""
    def make() -> DataLoader[Any]:
        # One sample per batch: each is drawn with next() alone.
        return DataLoader(SelfIterating(30), batch_size=None, num_workers=workers,
                          collate_fn=int)

    for k in (1, 3, 6):
        full, rest, state = rest_after(make, k)
        assert rest == full[k:]
        for replica in filter(None, state["iterable"]["replicas"]):
            # Stored once, as the iterator's: the dataset is its own iterator.
            assert replica["dataset"] is None and replica["iterator"] is not None


def test_a_state_before_the_first_batch_keeps_the_datasets_state() -> None:
    """The same self-iterating object in a second loader: the state taken before its first
    batch must bring it back to its start (it was exhausted by then)."""
    dataset = Exhaustible(10)
    loader = DataLoader(dataset, batch_size=4, collate_fn=as_list)
    it = iter(loader)
    state = roundtrip(loader.state_dict())
    full = list(it)
    assert full == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert list(loader) == []  # never reset: its second epoch is empty, as under torch
    again = DataLoader(dataset, batch_size=4, collate_fn=as_list)
    again.load_state_dict(state)
    assert list(again) == full


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, True)])
def test_a_state_between_epochs_keeps_the_datasets_own_state(workers: int,
                                                              persistent: bool) -> None:
    """A dataset counting its epochs in the copy that iterates it (the loader's, or each
    persistent worker's): the count is part of a state taken between epochs."""
    def make() -> DataLoader[Any]:
        return DataLoader(Epochs(8), batch_size=None, num_workers=workers,
                          persistent_workers=persistent, collate_fn=tuple)

    ref = make()
    epochs = [list(ref) for _ in range(3)]
    assert [{e for _, e in epoch} for epoch in epochs] == [{0}, {1}, {2}]
    loader = make()
    list(loader)
    state = roundtrip(loader.state_dict())
    assert state["iterable"]["mode"] == "between"
    resumed = make()
    resumed.load_state_dict(state)
    assert [list(resumed), list(resumed)] == epochs[1:]
    for one in (ref, loader, resumed):
        one.close()


def test_persistent_workers_states_need_their_count() -> None:
    """Each persistent worker's own (differing) dataset state resumes only with as many
    persistent workers: elsewhere it would be given to a copy that never had it."""
    def make(workers: int, persistent: bool) -> DataLoader[Any]:
        # 13 items: 7 for worker 0, 6 for worker 1, so their final states differ.
        return DataLoader(StatefulIterator(13), batch_size=2, num_workers=workers,
                          persistent_workers=persistent, collate_fn=as_list)

    loader = make(2, True)
    list(loader)
    state = roundtrip(loader.state_dict())
    loader.close()
    with pytest.raises(ValueError, match="'replicas'.*num_workers=2 and persistent_workers"):
        make(3, True).load_state_dict(state)
    with pytest.raises(ValueError, match="'replicas'"):
        make(2, False).load_state_dict(state)
    same = make(2, True)
    same.load_state_dict(state)
    assert sorted(x for b in same for x in b) == list(range(13))
    same.close()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_map_style_datasets_state_is_kept_per_copy(workers: int, shuffle: bool) -> None:
    """A map-style dataset drawing from its own generator, in each copy: its state_dict() was
    never called, so a resumed epoch drew other values than the uninterrupted one."""
    def make() -> DataLoader[Any]:
        return DataLoader(Drawing(24), batch_size=3, shuffle=shuffle, generator=3,
                          num_workers=workers, collate_fn=as_list)

    for k in (0, 1, 3, 5):
        full, rest, state = rest_after(make, k)
        assert rest == full[k:], k
        datasets = state["map"]["datasets"]
        assert datasets["num_workers"] == workers
        assert len(datasets["states"]) == max(1, workers)


def test_a_workers_state_is_the_consumers_not_the_prefetchers() -> None:
    """With workers, batches are taken from them ahead of the consumer (the sync `for`'s
    pump): a worker none of whose batches the consumer has yet is as it started, not as the
    batch taken ahead of the consumer left it."""
    def make() -> DataLoader[Any]:
        return DataLoader(Drawing(40), batch_size=2, num_workers=4, collate_fn=as_list)

    full = list(make())
    for k in (1, 2, 5):
        loader = make()
        it = iter(loader)
        got = [next(it) for _ in range(k)]
        threading.Event().wait(0.2)  # the pump takes the next batches meanwhile
        state = roundtrip(loader.state_dict())
        it.close()
        resumed = make()
        resumed.load_state_dict(state)
        assert got + list(resumed) == full, k
        for one in (loader, resumed):
            one.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_map_style_datasets_state_between_epochs(workers: int) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Drawing(12), batch_size=3, shuffle=True, generator=1,
                          num_workers=workers, persistent_workers=workers > 0,
                          collate_fn=as_list)

    ref = make()
    epochs = [list(ref) for _ in range(3)]
    loader = make()
    list(loader)
    state = roundtrip(loader.state_dict())
    resumed = make()
    resumed.load_state_dict(state)
    assert [list(resumed), list(resumed)] == epochs[1:]
    for one in (ref, loader, resumed):
        one.close()


def test_a_map_style_datasets_states_and_another_worker_count() -> None:
    """States equal in every copy resume with any num_workers; differing ones only with the
    count they were taken with (which copy fetches which batch depends on it)."""
    same = DataLoader(Calls(12), batch_size=2, num_workers=2, collate_fn=as_list)
    it = iter(same)
    next(it)
    next(it)  # a batch of each worker: both states known
    equal = roundtrip(same.state_dict())
    it.close()
    other = DataLoader(Calls(12), batch_size=2, num_workers=0, collate_fn=as_list)
    other.load_state_dict(equal)
    assert sum(len(b) for b in other) == 8

    drawing = DataLoader(Drawing(12), batch_size=2, num_workers=2, collate_fn=as_list)
    it = iter(drawing)
    for _ in range(3):
        next(it)
    differing = roundtrip(drawing.state_dict())
    it.close()
    with pytest.raises(ValueError, match="'datasets'.*num_workers=2"):
        DataLoader(Drawing(12), batch_size=2, num_workers=3).load_state_dict(differing)
    for one in (same, other, drawing):
        one.close()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_a_state_after_the_last_batch_resumes_the_empty_rest(workers: int, kind: str) -> None:
    """Taken after the last batch but before the epoch ended (inside the loop, as a training
    loop saves): the resumed epoch is that epoch's empty rest, then the next one, as
    torchdata's; resuming it as the next epoch gave the loop one epoch too many."""
    dataset: Any = list(range(10)) if kind == "map" else StatefulIterator(10)

    def make() -> DataLoader[Any]:
        return DataLoader(dataset, batch_size=2, num_workers=workers, collate_fn=as_list)

    ref = make()
    first, second = list(ref), list(ref)
    loader = make()
    for _ in loader:
        inside = roundtrip(loader.state_dict())
    after = roundtrip(loader.state_dict())
    assert inside["epoch"] == 0 and inside["yielded"] == len(first)
    assert after["epoch"] == 1 and after["yielded"] == 0
    resumed = make()
    resumed.load_state_dict(inside)
    assert list(resumed) == []
    assert list(resumed) == second
    resumed = make()
    resumed.load_state_dict(after)
    assert list(resumed) == second
    for one in (ref, loader, resumed):
        one.close()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable", "stream"])
def test_yielded_goes_on_across_a_resume(workers: int, kind: str) -> None:
    """Resumed at batch 4, four batches later the state says 8, as the uninterrupted run's
    (and the iterator's num_yielded, torch's count of the epoch's batches)."""
    if kind == "map":
        dataset: Any = list(range(40))
    elif kind == "iterable":
        dataset = StatefulIterator(40)
    else:
        dataset = aloader.as_stream(list(range(40)))

    def make() -> DataLoader[Any]:
        return DataLoader(dataset, batch_size=2, num_workers=workers, collate_fn=as_list)

    loader = make()
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = roundtrip(loader.state_dict())
    it.close()
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    for _ in range(4):
        next(it)
    assert resumed.state_dict()["yielded"] == 8
    assert it.num_yielded == 8
    it.close()
    for one in (loader, resumed):
        one.close()


class GlobalDraws(Dataset[float]):
    """Draws from the worker's global numpy generator (torch's workers keep theirs going
    across the epochs of persistent workers)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> float:
        return index + float(np.random.random())


class GlobalDrawsIterable(IterableDataset[float]):
    def __iter__(self) -> Iterator[float]:
        info = aloader.get_worker_info()
        wid, count = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(wid, 12, count):
            yield i + random.random()


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_persistent_workers_generators_are_kept_between_epochs(kind: str) -> None:
    """A state between epochs of persistent workers: their global generators were reseeded on
    resume, so every later epoch's augmentations differed from the uninterrupted run's."""
    dataset: Any = GlobalDraws() if kind == "map" else GlobalDrawsIterable()

    def make(workers: int = 2, persistent: bool = True) -> DataLoader[Any]:
        return DataLoader(dataset, batch_size=3, num_workers=workers, generator=5,
                          persistent_workers=persistent, collate_fn=as_list)

    ref = make()
    epochs = [list(ref) for _ in range(3)]
    loader = make()
    list(loader)
    state = roundtrip(loader.state_dict())
    assert len(state["workers"]["rngs"]) == 2
    resumed = make()
    resumed.load_state_dict(state)
    assert [list(resumed), list(resumed)] == epochs[1:]
    other = make(3)  # another count: seeded as new workers, as it was
    other.load_state_dict(state)
    assert sorted(int(x) for b in other for x in b) == list(range(12))
    bad = copy.deepcopy(state)
    bad["workers"]["rngs"][1] = [[3, [1, 2], None], None, None]
    with pytest.raises(ValueError, match="'workers.rngs'"):
        make().load_state_dict(bad)
    for one in (ref, loader, resumed, other):
        one.close()
