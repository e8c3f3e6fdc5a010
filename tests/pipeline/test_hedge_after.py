"""``hedge_after=``: an async dataset's item fetch that has not answered after that many
seconds gets a second one; the first answer is kept, the other cancelled; hedges stay within
5% of the fetches; ``stats().hedged`` counts them. Opt-in: a fetch may not be idempotent.

The slow first attempts are slow by rule (which attempt of which index), and what is asserted
is which attempt won and what was cancelled, never how long it took.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import numpy as np
import pytest

import aloader
from aloader import DataLoader

pytestmark = pytest.mark.anyio


class Straggling:
    """An async dataset whose first attempt at each index in ``slow`` takes ``seconds`` (the
    straggler); every other attempt answers at once. Records attempts and cancellations."""

    def __init__(self, n: int, slow: set[int], seconds: float = 5.0) -> None:
        self.n, self.slow, self.seconds = n, slow, seconds
        self.attempts: Counter[int] = Counter()
        self.cancelled: list[int] = []

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> tuple[int, int]:
        self.attempts[index] += 1
        attempt = self.attempts[index]
        try:
            if index in self.slow and attempt == 1:
                await anyio.sleep(self.seconds)
            else:
                await anyio.sleep(0)
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(index)
            raise
        return index, attempt


async def test_a_late_fetch_is_hedged_the_first_answer_kept_the_other_cancelled() -> None:
    slow = {60, 90, 130}
    dataset = Straggling(200, slow)
    loader = DataLoader(dataset, batch_size=10, max_concurrency=8, hedge_after=0.05,
                        collate_fn=list)
    got = [item async for batch in loader for item in batch]
    assert [index for index, _ in got] == list(range(200))
    # The stragglers' second attempts answered; their first were cancelled.
    assert {index: attempt for index, attempt in got if index in slow} == {i: 2 for i in slow}
    assert sorted(dataset.cancelled) == sorted(slow)
    assert loader.stats().hedged == 3


async def test_hedges_stay_within_five_percent_of_the_fetches() -> None:
    dataset = Straggling(200, set(range(200)), seconds=0.3)
    loader = DataLoader(dataset, batch_size=10, max_concurrency=64, hedge_after=0.01,
                        collate_fn=list)
    got = [item async for batch in loader for item in batch]
    assert [index for index, _ in got] == list(range(200))
    hedged = loader.stats().hedged
    assert 1 <= hedged <= 0.05 * 200
    assert sum(dataset.attempts.values()) == 200 + hedged


async def test_errors_count_once_both_attempts_failed() -> None:
    class Failing(Straggling):
        async def __getitem__(self, index: int) -> tuple[int, int]:
            self.attempts[index] += 1
            attempt = self.attempts[index]
            if index == 50:
                if attempt == 1:
                    await anyio.sleep(0.5)
                raise KeyError(f"attempt {attempt}")
            return index, attempt

    loader = DataLoader(Failing(100, set()), batch_size=10, max_concurrency=4,
                        hedge_after=0.01, collate_fn=list)
    with pytest.raises(KeyError, match="attempt 2"):  # the first to fail: the hedge
        async for _ in loader:
            pass


async def test_an_error_before_the_hedge_is_raised_at_once() -> None:
    class Broken(Straggling):
        async def __getitem__(self, index: int) -> tuple[int, int]:
            self.attempts[index] += 1
            if index == 3:
                raise ValueError("bad index")
            return index, 1

    dataset = Broken(20, set())
    loader = DataLoader(dataset, batch_size=4, max_concurrency=4, hedge_after=30.0)
    with pytest.raises(ValueError, match="bad index"):
        async for _ in loader:
            pass
    assert dataset.attempts[3] == 1


async def test_a_hedged_fetch_draws_what_a_single_fetch_draws() -> None:
    class Drawing(Straggling):
        async def __getitem__(self, index: int) -> float:  # type: ignore[override]
            value = float(aloader.sample_rng().random())
            await super().__getitem__(index)
            return value

    slow = {40, 41, 77}
    plain = DataLoader(Drawing(100, set()), batch_size=10, generator=5, max_concurrency=8)
    hedged = DataLoader(Drawing(100, slow), batch_size=10, generator=5, max_concurrency=8,
                        hedge_after=0.02)
    expected = np.concatenate([b async for b in plain])
    assert np.array_equal(np.concatenate([b async for b in hedged]), expected)
    assert hedged.stats().hedged == 3


@pytest.mark.parametrize("value", ["fast", 0, -1, float("inf"), "auto", True])
def test_a_bad_hedge_after_is_a_value_error_naming_it(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^hedge_after should be a positive number of seconds"):
        DataLoader(Straggling(4, set()), hedge_after=value)


def test_hedge_after_needs_item_fetches_of_an_async_dataset() -> None:
    class Sync:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> int:
            return index

    with pytest.raises(ValueError, match="synchronous"):
        DataLoader(Sync(), hedge_after=1.0)

    class Batches(Straggling):
        async def __getitems__(self, indices: list[int]) -> list[int]:
            return indices

    with pytest.raises(ValueError, match="__getitems__"):
        DataLoader(Batches(4, set()), batch_size=2, hedge_after=1.0)
    with pytest.raises(ValueError, match="iterable"):
        DataLoader(aloader.as_stream(range(4)), hedge_after=1.0)
