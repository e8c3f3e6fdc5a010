"""Checkpoints with a failure budget: the failures absorbed so far travel in the state
(``"failures": {"count", "indices"}``), a resumed epoch's budget continues from that count, and
a known failed sample of the remaining batches is left out without calling the dataset (see
aloader.pipeline._failures)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aloader
from aloader import DataLoader, FailureBudgetExceeded

N, BS = 12, 2
BAD = {3, 8}  # batch 1 ([2, 3]) and batch 4 ([8, 9]) each lose a sample


# A loader an error's frames still hold is closed after each test (see conftest).
pytestmark = pytest.mark.usefixtures("close_stray_loaders")


class Sync(aloader.Dataset[int]):
    """Counts its calls per index; raises for the bad ones."""

    def __init__(self, bad: set[int] = BAD) -> None:
        self.bad = bad
        self.calls: Counter[int] = Counter()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        self.calls[i] += 1
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        return i


class Async(Sync):
    async def __getitem__(self, i: int) -> int:  # type: ignore[override]
        return Sync.__getitem__(self, i)


class GetItems(Sync):
    def __getitems__(self, indices: list[int]) -> list[int]:
        for i in indices:
            self.calls[i] += 1
        if any(i in self.bad for i in indices):
            raise ValueError(f"bad samples in {indices}")
        return list(indices)


def make(dataset: Any, **kwargs: Any) -> DataLoader[Any]:
    kwargs.setdefault("max_failures", 5)
    return DataLoader(dataset, batch_size=BS, collate_fn=list, **kwargs)


def uninterrupted(cls: type[Sync], **kwargs: Any) -> tuple[list[Any], list[int]]:
    dl = make(cls(), **kwargs)
    it = iter(dl)
    batches = list(it)
    failed = sorted(it.failed_indices)
    dl.close()
    return batches, failed


def wait_for(it: Any, index: int) -> None:
    """Until the loader, fetching ahead of the consumer, has recorded ``index`` as failed."""
    deadline = time.monotonic() + 30
    while index not in it.failed_indices:
        assert time.monotonic() < deadline, "the loader never fetched ahead"
        time.sleep(0.001)


def checkpoint_ahead(cls: type[Sync], k: int, ahead: int, **kwargs: Any) -> dict[str, Any]:
    """A state after ``k`` batches, once the failure of ``ahead`` (in a batch not yet
    received) is recorded; round-tripped through JSON."""
    dl = make(cls(), **kwargs)
    it = iter(dl)
    for _ in range(k):
        next(it)
    wait_for(it, ahead)
    state = json.loads(json.dumps(dl.state_dict()))
    dl.close()
    return state


KINDS = [
    pytest.param(Sync, {"max_concurrency": 2}, id="thread-items"),
    # A timeout keeps a sync for's fetches in a thread, ahead of the consumer.
    pytest.param(Sync, {"max_concurrency": None, "timeout": 60}, id="thread-batch"),
    pytest.param(GetItems, {"timeout": 60}, id="getitems"),
    pytest.param(Async, {}, id="async"),
]


@pytest.mark.parametrize(("cls", "kwargs"), KINDS)
def test_resume_leaves_out_a_known_failure_unfetched(cls: type[Sync], kwargs: Any) -> None:
    expected, failed = uninterrupted(cls, **kwargs)
    assert failed == [3, 8]
    state = checkpoint_ahead(cls, 1, 3, **kwargs)  # batch 1 ([2, 3]) fetched, not received
    recorded = state["failures"]
    assert 3 in recorded["indices"] and set(recorded["indices"]) <= BAD
    assert recorded["count"] == len(recorded["indices"])

    dataset = cls()
    dl = make(dataset, **kwargs)
    dl.load_state_dict(state)
    it = iter(dl)
    assert list(it) == expected[1:]
    dl.close()
    for index in recorded["indices"]:
        assert dataset.calls[index] == 0, f"index {index} was fetched again"
    assert sorted(it.failed_indices) == failed  # two failures counted in all, as uninterrupted


@pytest.mark.anyio
async def test_resume_async_for(anyio_backend: str) -> None:
    dl = make(Async())
    it = dl.__aiter__()
    expected = [batch async for batch in it]
    failed = sorted(it.failed_indices)
    assert failed == [3, 8]
    dl = make(Async())
    it = dl.__aiter__()
    await it.__anext__()
    with anyio.fail_after(30):
        while 3 not in it.failed_indices:
            await anyio.sleep(0.001)
    state = json.loads(json.dumps(dl.state_dict()))
    await dl.aclose()

    dataset = Async()
    dl = make(dataset)
    dl.load_state_dict(state)
    it = dl.__aiter__()
    assert [batch async for batch in it] == expected[1:]
    await dl.aclose()
    assert dataset.calls[3] == 0
    assert sorted(it.failed_indices) == failed


def test_a_batch_that_lost_every_sample_is_skipped_unfetched() -> None:
    bad = {2, 3, 8}  # batch 1 loses both samples
    expected = list(make(Sync(bad), max_concurrency=2))
    assert [2, 3] not in expected
    dl = make(Sync(bad), max_concurrency=2)
    it = iter(dl)
    next(it)
    wait_for(it, 3)
    wait_for(it, 2)
    state = json.loads(json.dumps(dl.state_dict()))
    dl.close()
    dataset = Sync(bad)
    dl = make(dataset, max_concurrency=2)
    dl.load_state_dict(state)
    it = iter(dl)
    assert list(it) == expected[1:]
    dl.close()
    assert dataset.calls[2] == dataset.calls[3] == 0
    assert sorted(it.failed_indices) == [2, 3, 8]


def test_resume_on_workers_skips_a_batch_that_failed_whole() -> None:
    bad = {2, 3, 8}
    expected = list(make(Sync(bad), max_concurrency=2))
    dl = make(Sync(bad), max_concurrency=2)
    it = iter(dl)
    next(it)
    wait_for(it, 3)
    wait_for(it, 2)
    state = json.loads(json.dumps(dl.state_dict()))
    dl.close()
    dl = make(Sync(bad), num_workers=2)
    dl.load_state_dict(state)
    it = iter(dl)
    assert list(it) == expected[1:]
    dl.close()
    assert sorted(it.failed_indices) == [2, 3, 8]


def test_the_budget_continues_from_the_checkpoint() -> None:
    # max_failures=1: the uninterrupted epoch fails at batch 4 (its second failure, 8); so
    # does the resumed one, which counts the failure of 3 from before the checkpoint.
    dl = make(Sync(), max_failures=1, max_concurrency=2)
    got = []
    with pytest.raises(FailureBudgetExceeded) as uninterrupted_error:
        for batch in dl:
            got.append(batch)
    dl.close()
    assert got == [[0, 1], [2], [4, 5], [6, 7]]
    assert uninterrupted_error.value.count == 2

    state = checkpoint_ahead(Sync, 1, 3, max_failures=1, max_concurrency=2)
    assert state["failures"] == {"count": 1, "indices": [3]}
    dataset = Sync()
    dl = make(dataset, max_failures=1, max_concurrency=2)
    dl.load_state_dict(state)
    resumed = []
    with pytest.raises(FailureBudgetExceeded) as resumed_error:
        for batch in dl:
            resumed.append(batch)
    dl.close()
    assert resumed == got[1:]
    assert resumed_error.value.count == 2
    assert dataset.calls[3] == 0


def test_the_failure_over_the_budget_is_not_recorded() -> None:
    # The epoch failed at 8: a state taken before the consumer got there leaves 8 out, so
    # the resumed epoch fetches it again and fails at the same batch.
    dl = make(Sync(), max_failures=1, max_concurrency=2)
    it = iter(dl)
    next(it)
    wait_for(it, 8)  # the loader ran ahead to 8 and exceeded the budget there
    state = json.loads(json.dumps(dl.state_dict()))
    dl.close()
    assert state["failures"] == {"count": 1, "indices": [3]}


def test_between_epochs_and_without_a_budget_nothing_is_recorded() -> None:
    dl = make(Sync(), max_concurrency=2)
    list(dl)
    assert dl.state_dict()["failures"] == {"count": 0, "indices": []}
    dl = make(Sync(set()), max_failures=0)
    it = iter(dl)
    next(it)
    assert dl.state_dict()["failures"] == {"count": 0, "indices": []}
    dl.close()


def test_a_loader_without_a_budget_ignores_recorded_failures() -> None:
    state = checkpoint_ahead(Sync, 1, 3, max_concurrency=2)
    dataset = Sync()
    dl = make(dataset, max_failures=0, max_concurrency=2)
    dl.load_state_dict(state)
    with pytest.raises(ValueError, match="bad sample 3"):  # torch's behaviour: it raises
        list(dl)
    dl.close()


def test_a_non_json_index_is_refused_at_state_dict_time() -> None:
    class Complex:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: complex) -> complex:
            if i == 1j:
                raise ValueError("bad")
            return i

    dl = DataLoader(Complex(), batch_sampler=[[0j, 1j], [2j, 3j]], collate_fn=list,
                    max_failures=1)
    it = iter(dl)
    assert next(it) == [0j]
    with pytest.raises(ValueError, match="complex"):
        dl.state_dict()
    dl.close()


def test_non_int_json_indices_round_trip() -> None:
    class Keys:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, key: Any) -> str:
            if key == ("b", 1):  # a tuple index: a list in the state, matched all the same
                raise ValueError("bad")
            return str(key)

    batches = [[("a", 0)], [("b", 1), ("c", 2)], [("d", 3)]]
    dl = DataLoader(Keys(), batch_sampler=batches, collate_fn=list, max_failures=1,
                    max_concurrency=2)
    it = iter(dl)
    next(it)
    wait_for(it, ("b", 1))  # type: ignore[arg-type]
    state = json.loads(json.dumps(dl.state_dict()))
    dl.close()
    assert state["failures"] == {"count": 1, "indices": [["b", 1]]}
    dl = DataLoader(Keys(), batch_sampler=batches, collate_fn=list, max_failures=1,
                    max_concurrency=2)
    dl.load_state_dict(state)
    it = iter(dl)
    assert list(it) == [["('c', 2)"], ["('d', 3)"]]
    dl.close()


@pytest.mark.parametrize(("failures", "error", "match"), [
    ([], TypeError, "'failures' should be a dict"),
    ({"count": "1", "indices": []}, TypeError, "failures.count"),
    ({"count": -1, "indices": []}, TypeError, "failures.count"),
    ({"count": 1, "indices": 3}, TypeError, "failures.indices"),
    ({"count": 1, "indices": [3, 8]}, ValueError, "more than 'failures.count'"),
    ({"count": 1, "indices": [{1: 2}]}, TypeError, "JSON builtins"),
])
def test_load_checks_the_failures_before_applying(failures: Any, error: type[Exception],
                                                  match: str) -> None:
    state = checkpoint_ahead(Sync, 1, 3, max_concurrency=2)
    state["failures"] = failures
    dl = make(Sync(), max_concurrency=2)
    with pytest.raises(error, match=match):
        dl.load_state_dict(state)
    assert dl._resume_state is None and dl._resume_failures is None
    assert list(dl) == uninterrupted(Sync, max_concurrency=2)[0]  # nothing was applied


class Iterating(aloader.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return _Iterator()


class _Iterator:
    def __init__(self) -> None:
        self.i = 0

    def __iter__(self) -> _Iterator:
        return self

    def __next__(self) -> int:
        i = self.i
        self.i += 1
        if i >= N:
            raise StopIteration
        if i in BAD:
            raise ValueError(f"bad sample {i}")
        return i


def test_iterable_records_the_count_only() -> None:
    dl = make(Iterating())
    it = iter(dl)
    for _ in range(3):  # [0, 1], [2, 4] (3 failed), [5, 6]
        next(it)
    state = json.loads(json.dumps(dl.state_dict()))
    dl.close()
    assert state["failures"]["indices"] == []
    assert state["failures"]["count"] >= 1
    state["failures"]["indices"] = [3]
    with pytest.raises(ValueError, match="only the records its sources skipped"):
        make(Iterating()).load_state_dict(state)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_record_skipped_ahead_of_the_consumer_is_counted_once(tmp_path: Any,
                                                                workers: int) -> None:
    """Three malformed lines under max_failures=3 pass with or without a resume between:
    the source had read (and skipped) them ahead of the consumer, so the checkpoint counted
    them; the resumed epoch read them again and counted them again (4 > 3: it raised)."""
    path = tmp_path / "a.jsonl"
    path.write_text("".join("{bad\n" if r in (5, 25, 45) else json.dumps({"r": r}) + "\n"
                            for r in range(60)))

    def make() -> DataLoader[Any]:
        source = aloader.JsonLines([str(path)], skip_errors=True)  # one chunk: read ahead
        return DataLoader(source, batch_size=5, collate_fn=list, max_failures=3,
                          num_workers=workers)

    full = [r for batch in make() for r in batch]
    assert len(full) == 57
    for k in (1, 6, 11):
        loader = make()
        it = iter(loader)
        head = [r for _ in range(k) for r in next(it)]
        state = json.loads(json.dumps(loader.state_dict()))
        it.close()
        assert state["failures"]["count"] == 3  # all read ahead already
        resumed = make()
        resumed.load_state_dict(state)
        assert head + [r for batch in resumed for r in batch] == full
        for one in (loader, resumed):
            one.close()
