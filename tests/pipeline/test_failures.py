"""The failure budget (``max_failures``): which samples are delivered, what is counted, when
the epoch fails, on every kind of fetch (see aloader.pipeline._failures)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aloader
from aloader import DataLoader, FailureBudgetExceeded

# A loader an error's frames still hold is closed after each test (see conftest).
pytestmark = pytest.mark.usefixtures("close_stray_loaders")


BAD = {3, 4, 5, 6, 7, 15}  # batch 1 (4..7) loses every sample
GOOD_BATCHES = [[0, 1, 2], [8, 9, 10, 11], [12, 13, 14], [16, 17, 18, 19]]


class Sync:
    """A blocking synchronous dataset (fetched in a thread)."""

    def __init__(self, bad: set[int] = BAD, n: int = 20) -> None:
        self.bad, self.n = bad, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        return i


class Inline(Sync):
    _inline_fetch = True


class Async(Sync):
    async def __getitem__(self, i: int) -> int:  # type: ignore[override]
        return Sync.__getitem__(self, i)


class GetItems(Sync):
    """``__getitems__`` that fails for any batch holding a bad sample."""

    def __init__(self, bad: set[int] = BAD, n: int = 20) -> None:
        super().__init__(bad, n)
        self.calls: list[list[int]] = []

    def __getitems__(self, indices: list[int]) -> list[int]:
        self.calls.append(list(indices))
        bad = [i for i in indices if i in self.bad]
        if bad:
            raise ValueError(f"bad samples {bad}")
        return list(indices)


class AsyncGetItems(GetItems):
    _async_fetch = True

    async def __getitems__(self, indices: list[int]) -> list[int]:  # type: ignore[override]
        return GetItems.__getitems__(self, indices)


class Iterating:
    """An iterable dataset whose iterator's ``__next__`` raises for the bad samples."""

    def __init__(self, bad: set[int] = BAD, n: int = 20) -> None:
        self.bad, self.n = bad, n

    def __iter__(self) -> Any:
        return _Iterator(self.bad, self.n)


class _Iterator:
    def __init__(self, bad: set[int], n: int) -> None:
        self.i, self.bad, self.n = 0, bad, n

    def __iter__(self) -> _Iterator:
        return self

    def __next__(self) -> int:
        i = self.i
        self.i += 1
        if i >= self.n:
            raise StopIteration
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        return i


KINDS = [
    pytest.param(Inline, {}, id="inline"),
    pytest.param(Sync, {}, id="thread-batch"),
    pytest.param(Sync, {"max_concurrency": 3}, id="thread-items"),
    pytest.param(Async, {}, id="async"),
    pytest.param(GetItems, {}, id="getitems"),
    pytest.param(AsyncGetItems, {}, id="async-getitems"),
]


def drain(dl: DataLoader[Any]) -> list[Any]:
    """One epoch, then close the loader (an epoch that raised must not keep its loop)."""
    try:
        return list(dl)
    finally:
        dl.close()


def loader(dataset: Any, **kwargs: Any) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=4, collate_fn=list, **kwargs)


@pytest.mark.parametrize(("cls", "kwargs"), KINDS)
def test_within_budget_delivers_exactly_the_good_samples(cls: Any, kwargs: Any) -> None:
    it = iter(loader(cls(), max_failures=6, **kwargs))
    assert list(it) == GOOD_BATCHES
    failures = it._source.failures
    assert failures is not None
    assert failures.count == 6
    assert sorted(failures.indices) == sorted(BAD)
    assert sorted(it.failed_indices) == sorted(BAD)


@pytest.mark.parametrize(("cls", "kwargs"), KINDS)
def test_over_budget_fails_the_epoch(cls: Any, kwargs: Any) -> None:
    it = iter(loader(cls(), max_failures=5, **kwargs))
    got = []
    with pytest.raises(FailureBudgetExceeded) as info:
        for batch in it:
            got.append(batch)
    error = info.value
    assert isinstance(error, aloader.AloaderError)
    assert "6 samples failed" in str(error) and "max_failures=5" in str(error)
    assert isinstance(error.__cause__, ValueError)
    assert "bad sample" in str(error.__cause__)
    assert error.count == 6 and error.budget == 5
    assert len(error.errors) == 6 and error.errors[-1] is error.__cause__
    assert sorted(error.indices) == sorted(BAD)
    assert got == GOOD_BATCHES[:2]  # the batch holding the sixth failure is not delivered
    assert next(it, None) is None  # the epoch is over


@pytest.mark.parametrize(("cls", "kwargs"), KINDS)
def test_default_raises_the_first_error_with_its_type(cls: Any, kwargs: Any) -> None:
    with pytest.raises(ValueError, match="bad sample") as info:
        drain(loader(cls(), **kwargs))
    assert type(info.value) is ValueError


def test_default_first_batch_error() -> None:
    with pytest.raises(ValueError, match="bad sample 3"):
        drain(loader(Sync()))


def test_getitems_is_retried_item_by_item() -> None:
    dataset = GetItems()
    assert drain(loader(dataset, max_failures=6)) == GOOD_BATCHES
    # Batches with a bad sample are retried one index at a time; the others are one call.
    assert dataset.calls[:5] == [[0, 1, 2, 3], [0], [1], [2], [3]]
    assert [8, 9, 10, 11] in dataset.calls and [8] not in dataset.calls


def test_fraction_of_the_epoch() -> None:
    # 6 of 20 failed: 0.3 allows floor(6.0) = 6, 0.25 allows 5.
    assert drain(loader(Sync(), max_failures=0.3)) == GOOD_BATCHES
    with pytest.raises(FailureBudgetExceeded, match=r"max_failures=0.25: 5 of 20 samples"):
        drain(loader(Sync(), max_failures=0.25))


def test_fraction_of_the_sampler() -> None:
    # A sampler over 10 of the samples: the fraction is of its 10 (5 failures: 3 to 7).
    sampler = list(range(10))
    assert drain(DataLoader(Sync(), batch_size=4, sampler=sampler, collate_fn=list,
                           max_failures=0.5)) == [[0, 1, 2], [8, 9]]
    with pytest.raises(FailureBudgetExceeded, match="4 of 10 samples"):
        drain(DataLoader(Sync(), batch_size=4, sampler=sampler, collate_fn=list,
                        max_failures=0.4))


def test_without_auto_batching_a_failed_sample_is_skipped() -> None:
    got = drain(DataLoader(Sync(), batch_size=None, max_failures=6))
    assert got == [i for i in range(20) if i not in BAD]


def test_budget_is_per_epoch() -> None:
    dl = loader(Sync(), max_failures=6)
    for _ in range(2):
        it = iter(dl)
        assert list(it) == GOOD_BATCHES
        assert it._source.failures is not None and it._source.failures.count == 6


def test_failed_indices_without_a_budget() -> None:
    it = iter(loader(Sync(bad=set())))
    list(it)
    assert it.failed_indices == [] and it._source.failures is None


def test_no_failure_within_a_budget() -> None:
    it = iter(loader(Sync(bad=set()), max_failures=3))
    assert [x for b in it for x in b] == list(range(20))
    assert it._source.failures is not None and it._source.failures.count == 0


@pytest.mark.parametrize("kwargs", [{}, {"max_concurrency": 3}])
def test_array_samples(kwargs: dict[str, Any]) -> None:
    class Arrays(Async):
        async def __getitem__(self, i: int) -> Any:  # type: ignore[override]
            return np.full(3, await Async.__getitem__(self, i))

    got = drain(DataLoader(Arrays(), batch_size=4, max_failures=6, **kwargs))
    assert [batch[:, 0].tolist() for batch in got] == GOOD_BATCHES


def test_collate_errors_are_not_absorbed() -> None:
    def collate(samples: list[int]) -> list[int]:
        raise KeyError("collate")

    with pytest.raises(KeyError):
        drain(DataLoader(Sync(bad=set()), batch_size=4, collate_fn=collate, max_failures=5))


@pytest.mark.anyio
async def test_async_for(anyio_backend: str) -> None:
    got = [batch async for batch in loader(Async(), max_failures=6)]
    assert got == GOOD_BATCHES


FRACTION_KINDS = [*KINDS, *(pytest.param(cls, {"num_workers": 2}, id=f"workers-{cls.__name__}")
                            for cls in (Sync, Async, GetItems))]


@pytest.mark.parametrize(("cls", "kwargs"), FRACTION_KINDS)
def test_fraction_within_and_over_on_every_kind(cls: Any, kwargs: Any) -> None:
    # 6 of the 20 samples fail: 0.3 allows 6, 0.25 allows 5.
    it = iter(loader(cls(), max_failures=0.3, **kwargs))
    assert list(it) == GOOD_BATCHES
    assert it._source.failures is not None and it._source.failures.count == 6
    with pytest.raises(FailureBudgetExceeded, match=r"max_failures=0.25: 5 of 20 samples"):
        drain(loader(cls(), max_failures=0.25, **kwargs))


# --- iterable datasets ---------------------------------------------------------------------------
def test_iterable_next_raising_is_counted_and_pulling_goes_on() -> None:
    it = iter(loader(Iterating(), max_failures=6))
    assert list(it) == [[0, 1, 2, 8], [9, 10, 11, 12], [13, 14, 16, 17], [18, 19]]
    assert it._source.failures is not None
    assert it._source.failures.indices == [3, 4, 5, 6, 7, 15]  # the samples' numbers


def test_iterable_over_budget() -> None:
    with pytest.raises(FailureBudgetExceeded) as info:
        drain(loader(Iterating(), max_failures=5))
    assert isinstance(info.value.__cause__, ValueError)


def test_iterable_without_batching() -> None:
    got = drain(DataLoader(Iterating(), batch_size=None, max_failures=6))
    assert got == [i for i in range(20) if i not in BAD]


def test_a_generator_cannot_go_on_after_raising() -> None:
    class Generating:
        def __iter__(self) -> Any:
            yield 0
            raise ValueError("bad sample 1")

    # Pulling on would end the epoch early without a word: the error is raised as is.
    with pytest.raises(ValueError, match="bad sample 1"):
        drain(DataLoader(Generating(), batch_size=2, collate_fn=list, max_failures=5))


# --- worker processes ----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [Sync, Async, GetItems])
def test_workers_within_and_over_budget(cls: Any) -> None:
    it = iter(loader(cls(), max_failures=6, num_workers=2))
    assert list(it) == GOOD_BATCHES
    assert it._source.failures is not None
    assert sorted(it._source.failures.indices) == sorted(BAD)
    with pytest.raises(FailureBudgetExceeded) as info:
        drain(loader(cls(), max_failures=5, num_workers=2))
    assert isinstance(info.value.__cause__, ValueError)  # rebuilt from the worker's
    assert "bad sample" in str(info.value.__cause__)


class ShardedIterating(Iterating):
    def __iter__(self) -> Any:
        info = aloader.get_worker_info()
        assert info is not None
        return _Shard(_Iterator(self.bad, self.n), info.id, info.num_workers)


class _Shard:
    def __init__(self, inner: _Iterator, wid: int, count: int) -> None:
        self.inner, self.wid, self.count = inner, wid, count

    def __iter__(self) -> _Shard:
        return self

    def __next__(self) -> int:
        while True:  # the samples i with i % count == wid; the others are not pulled here
            i = self.inner.i
            if i >= self.inner.n:
                raise StopIteration
            if i % self.count == self.wid:
                return next(self.inner)
            self.inner.i += 1


def test_workers_iterable_fraction() -> None:
    # No length: the fraction applies to the samples attempted so far (at least 1 / fraction
    # of them), which the workers report: 11 fails among the first 12, 17 among 18.
    bad = {11, 17}
    it = iter(DataLoader(ShardedIterating(bad), batch_size=None, max_failures=0.25,
                         num_workers=2))
    assert sorted(it) == [i for i in range(20) if i not in bad]
    assert it._source.failures is not None and it._source.failures.seen == 20
    assert sorted(it._source.failures.indices) == [5, 8]  # their numbers in their replica
    # Over the fraction only at the end (2 > 0.05 * 20): the end of the epoch says so.
    with pytest.raises(FailureBudgetExceeded, match="0.05: 1 of the 20 samples attempted"):
        drain(DataLoader(ShardedIterating(bad), batch_size=None, max_failures=0.05,
                        num_workers=2))


# --- streaming sources ---------------------------------------------------------------------------
def write_shard(path: Path, bad_lines: set[int], n: int = 20) -> Path:
    lines = ["{not json" if i in bad_lines else json.dumps({"i": i}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_source_skips_count_against_the_budget(tmp_path: Path) -> None:
    shard = write_shard(tmp_path / "a.jsonl", {2, 9, 10})
    source = aloader.JsonLines(shard, skip_errors=True)
    it = iter(DataLoader(source, batch_size=4, collate_fn=list, max_failures=3))
    got = [r["i"] for batch in it for r in batch]
    assert got == [i for i in range(20) if i not in {2, 9, 10}]
    assert it._source.failures is not None and it._source.failures.count == 3
    # Where each skipped record was (its shard and byte offset): a resumed epoch reading
    # them again does not count them twice.
    lines = shard.read_bytes().split(b"\n")
    offsets = [sum(len(line) + 1 for line in lines[:k]) for k in (2, 9, 10)]
    assert it._source.failures.indices == [["skipped", str(shard), at] for at in offsets]
    assert source.stats.skipped == 3
    with pytest.raises(FailureBudgetExceeded) as info:
        drain(DataLoader(aloader.JsonLines(shard, skip_errors=True), batch_size=4,
                        collate_fn=list, max_failures=2))
    assert isinstance(info.value.__cause__, aloader.RecordError)


def test_source_skips_with_workers(tmp_path: Path) -> None:
    shards = [write_shard(tmp_path / f"{k}.jsonl", {1} if k == 0 else set(), 10)
              for k in range(2)]
    source = aloader.JsonLines(shards, skip_errors=True)
    it = iter(DataLoader(source, batch_size=4, collate_fn=list, max_failures=1, num_workers=2))
    assert sum(len(batch) for batch in it) == 19
    assert it._source.failures is not None and it._source.failures.count == 1
    twice = aloader.JsonLines([shards[0], shards[0]], skip_errors=True)  # 2 skipped records
    with pytest.raises(FailureBudgetExceeded):
        drain(DataLoader(twice, batch_size=4, collate_fn=list, max_failures=1, num_workers=2))


@pytest.mark.parametrize("workers", [0, 2], ids=["local", "workers"])
def test_source_skips_against_a_fraction(tmp_path: Path, workers: int) -> None:
    # A skipped record is a sample attempted, as a failed fetch is: 3 of the 20 records. No
    # length: the fraction applies to the records attempted so far (once 1 / fraction).
    bad = {5, 12, 19}
    shard = write_shard(tmp_path / "a.jsonl", bad)

    def load(fraction: float) -> DataLoader[Any]:
        return DataLoader(aloader.JsonLines(shard, skip_errors=True), batch_size=4,
                          collate_fn=list, max_failures=fraction, num_workers=workers)

    it = iter(load(0.25))
    assert [r["i"] for batch in it for r in batch] == [i for i in range(20) if i not in bad]
    assert it._source.failures is not None
    assert (it._source.failures.count, it._source.failures.tried) == (3, 20)
    with pytest.raises(FailureBudgetExceeded, match="0.1: 2 of the 20 samples attempted"):
        drain(load(0.1))


def test_a_stream_error_is_raised_as_is(tmp_path: Path) -> None:
    shard = write_shard(tmp_path / "a.jsonl", {2})
    with pytest.raises(aloader.RecordError):
        drain(DataLoader(aloader.JsonLines(shard), batch_size=4, collate_fn=list,
                        max_failures=3))


# --- logging -------------------------------------------------------------------------------------
def test_failures_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="aloader"):
        drain(loader(Sync(), max_failures=6))
    skipped = [r for r in caplog.records if r.name == "aloader.loader"]
    assert len(skipped) == 7  # each, then the epoch's summary
    assert all(r.levelno == logging.WARNING for r in skipped)
    assert "skipped sample 3: ValueError: bad sample 3" in skipped[0].getMessage()
    assert skipped[6].getMessage().startswith("the epoch ended with 6 failed samples, within "
                                              "the failure budget (max_failures=6); the "
                                              "first: ValueError: bad sample 3; the last: ")


def test_every_epoch_with_failures_ends_with_a_summary(
        caplog: pytest.LogCaptureFixture) -> None:
    """Hundreds of failures: ten logged, one rate-limited line, then the epoch's summary
    with the count and both ends, every epoch (none for an epoch without failures)."""
    class Many:
        def __len__(self) -> int:
            return 1000

        def __getitem__(self, index: int) -> int:
            if index % 5 == 0:
                raise ValueError(f"bad sample {index}")
            return index

    dl = DataLoader(Many(), batch_size=10, collate_fn=list, max_failures=0.25)
    with caplog.at_level(logging.WARNING, logger="aloader.loader"):
        for _ in range(2):
            assert sum(map(len, dl)) == 800
    ends = [r.getMessage() for r in caplog.records if "the epoch ended" in r.getMessage()]
    assert ends == ["the epoch ended with 200 failed samples, within the failure budget "
                    "(max_failures=0.25: 250 of 1000 samples); the first: ValueError: bad "
                    "sample 0; the last: ValueError: bad sample 995"] * 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aloader.loader"):
        assert sum(map(len, DataLoader(list(range(10)), batch_size=5, collate_fn=list,
                                       max_failures=3))) == 10
    assert not caplog.records


@pytest.mark.parametrize("concurrency", [1, 8])
def test_the_budgets_message_and_stats_agree(concurrency: int) -> None:
    """Fetches in flight when the budget ran out fail too: they are not counted, so the
    error's count and ``stats().failures`` are the same number."""
    class Third:
        def __len__(self) -> int:
            return 1000

        async def __getitem__(self, index: int) -> int:
            await anyio.sleep(0)
            if index % 3 == 0:
                raise ValueError(f"bad {index}")
            return index

    dl = DataLoader(Third(), batch_size=10, max_failures=250, max_concurrency=concurrency)
    with pytest.raises(FailureBudgetExceeded) as info:
        for _ in dl:
            pass
    assert info.value.count == 251 and "251 samples failed" in str(info.value)
    assert dl.stats().failures == 251


def test_exceeded_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="aloader"), pytest.raises(
        FailureBudgetExceeded
    ):
        drain(loader(Sync(), max_failures=1))
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "2 samples failed" in errors[0].getMessage()


# --- arguments -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["1", None, [1], True, 1j])
def test_bad_type(value: Any) -> None:
    with pytest.raises(TypeError, match="max_failures"):
        DataLoader(Sync(), max_failures=value)


@pytest.mark.parametrize("value", [-1, 0.0, 1.0, 1.5, -0.5, math.nan, math.inf])
def test_bad_value(value: Any) -> None:
    with pytest.raises(ValueError, match="max_failures"):
        DataLoader(Sync(), max_failures=value)


def test_attribute() -> None:
    assert DataLoader(Sync()).max_failures == 0
    assert DataLoader(Sync(), max_failures=0.5).max_failures == 0.5


@pytest.mark.parametrize("first", [0, 1], ids=["on-later", "off-later"])
def test_persistent_workers_see_a_changed_budget(first: int) -> None:
    # The workers' copy of the budget is set at their start: turning it on or off between
    # epochs must reach them (on: the bad sample is left out; off: it raises, never dropped).
    dl = loader(Sync({5}, 12), max_failures=first, num_workers=2, persistent_workers=True)
    try:
        for budget in (first, 1 - first, first, first + 1):
            dl.max_failures = budget
            if budget:
                assert list(dl) == [[0, 1, 2, 3], [4, 6, 7], [8, 9, 10, 11]]
            else:
                with pytest.raises(ValueError, match="bad sample 5") as info:
                    list(dl)
                assert type(info.value) is ValueError
    finally:
        dl.close()
