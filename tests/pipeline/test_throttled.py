"""``aloader.Throttled`` raised by a dataset: the loader waits and fetches the same index
again, in order and exactly once, counted as throttled (not a failure, not against
``max_failures``), and with ``max_concurrency="auto"`` its controller backs off.

Datasets throttle by rule (which attempt of which index), or read a local HTTP server that
answers 429 with ``Retry-After: 0``; waits are zero, so nothing here is timed.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import anyio
import httpx
import pytest

import aloader
from aloader import DataLoader, Throttled
from aloader._tuning import MAX_THROTTLED

pytestmark = pytest.mark.anyio


class Throttling:
    """An async dataset that throttles the first ``times`` attempts at every index that is a
    multiple of ``every``, and counts its attempts."""

    def __init__(self, n: int = 100, every: int = 7, times: int = 2) -> None:
        self.n, self.every, self.times = n, every, times
        self.attempts: Counter[int] = Counter()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def attempt(self, index: int) -> int:
        with self.lock:
            self.attempts[index] += 1
            count = self.attempts[index]
        if index % self.every == 0 and count <= self.times:
            raise Throttled(retry_after=0)
        return index

    async def __getitem__(self, index: int) -> int:
        await anyio.sleep(0)
        return self.attempt(index)

    def expected_throttles(self) -> int:
        return len(range(0, self.n, self.every)) * self.times


class SyncThrottling(Throttling):
    def __getitem__(self, index: int) -> int:  # type: ignore[override]
        return self.attempt(index)


class BatchThrottling(Throttling):
    async def __getitems__(self, indices: list[int]) -> list[int]:
        await anyio.sleep(0)
        return [self.attempt(index) for index in indices]


class InlineThrottling(SyncThrottling):
    _inline_fetch = True


def _items(batches: list[Any]) -> list[int]:
    return [int(x) for batch in batches for x in batch]


@pytest.mark.parametrize("concurrency", [None, 4, "auto"])
async def test_a_throttled_index_is_fetched_again_in_order_exactly_once(
        concurrency: Any) -> None:
    dataset = Throttling()
    loader = DataLoader(dataset, batch_size=8, max_concurrency=concurrency)
    assert _items([b async for b in loader]) == list(range(100))
    stats = loader.stats()
    assert stats.throttled == dataset.expected_throttles() and stats.failures == 0
    assert all(dataset.attempts[i] == (3 if i % 7 == 0 else 1) for i in range(100))
    assert "throttled 30" in stats.table()


@pytest.mark.parametrize("kind", [SyncThrottling, BatchThrottling, InlineThrottling])
@pytest.mark.parametrize("concurrency", [None, "auto"])
async def test_every_way_of_fetching_waits_and_fetches_again(kind: type[Throttling],
                                                             concurrency: Any) -> None:
    dataset = kind()
    loader = DataLoader(dataset, batch_size=8, max_concurrency=concurrency)
    assert _items([b async for b in loader]) == list(range(100))
    assert loader.stats().throttled >= dataset.expected_throttles()  # a batch call: more
    assert loader.stats().failures == 0


def test_a_sync_for_and_worker_processes_wait_too() -> None:
    loader = DataLoader(SyncThrottling(), batch_size=8)
    assert _items(list(loader)) == list(range(100))
    assert loader.stats().throttled == 30
    workers = DataLoader(SyncThrottling(), batch_size=8, num_workers=2)
    try:
        assert _items(list(workers)) == list(range(100))
    finally:
        workers.close()
    asynchronous = DataLoader(Throttling(), batch_size=8, num_workers=2, max_concurrency="auto")
    try:
        assert _items(list(asynchronous)) == list(range(100))
        assert asynchronous.stats().throttled == 30  # reported by the workers
    finally:
        asynchronous.close()


async def test_throttling_is_not_a_failure() -> None:
    loader = DataLoader(Throttling(), batch_size=8, max_failures=1)
    assert _items([b async for b in loader]) == list(range(100))
    assert loader.stats().failures == 0


async def test_auto_backs_off_when_throttled() -> None:
    dataset = Throttling(n=400, every=3, times=1)
    loader = DataLoader(dataset, batch_size=8, max_concurrency="auto")
    assert _items([b async for b in loader]) == list(range(400))
    concurrency = loader.stats().concurrency
    assert concurrency is not None
    assert any(why == "throttled" for _, _, why in concurrency["history"])
    assert concurrency["throttles"] == loader.stats().throttled == 134


async def test_a_fetch_throttled_too_often_fails_with_the_throttling() -> None:
    dataset = Throttling(n=16, every=5, times=10**9)
    loader = DataLoader(dataset, batch_size=4, max_concurrency=4)
    with pytest.raises(Throttled) as caught:
        async for _ in loader:
            pass
    assert any(f"throttled {MAX_THROTTLED + 1} times in a row" in note
               for note in getattr(caught.value, "__notes__", []))
    assert dataset.attempts[0] == MAX_THROTTLED + 1


async def test_a_fetch_throttled_too_often_is_a_failure_within_the_budget() -> None:
    dataset = Throttling(n=16, every=5, times=10**9)
    loader = DataLoader(dataset, batch_size=4, max_concurrency=4, max_failures=10)
    assert _items([b async for b in loader]) == [i for i in range(16) if i % 5]
    assert loader.stats().failures == 4


async def test_a_store_answering_429_through_the_dataset(serve: Any) -> None:
    files = {str(i): b"x" * i for i in range(20)}
    server = serve(files)
    for i in range(0, 20, 3):
        server.fail(str(i), 429, times=2, retry_after="0")

    class Remote:
        client: httpx.AsyncClient | None = None

        def __len__(self) -> int:
            return 20

        async def __getitem__(self, index: int) -> int:
            if self.client is None:
                self.client = httpx.AsyncClient()
            response = await self.client.get(server.url(str(index)))
            if response.status_code in (429, 503):
                raise Throttled(float(response.headers.get("Retry-After", "1")))
            return len(response.content)

    dataset = Remote()
    loader = DataLoader(dataset, batch_size=5, max_concurrency="auto")
    try:
        got = _items([b async for b in loader])
    finally:
        if dataset.client is not None:
            await dataset.client.aclose()
    assert got == list(range(20))
    assert loader.stats().throttled == 14


async def test_sample_rng_draws_as_if_never_throttled() -> None:
    class Drawing(Throttling):
        async def __getitem__(self, index: int) -> float:  # type: ignore[override]
            value = float(aloader.sample_rng().random())
            await anyio.sleep(0)
            self.attempt(index)
            return value

    plain = DataLoader(Drawing(times=0), batch_size=8, generator=3, max_concurrency=4)
    throttled = DataLoader(Drawing(), batch_size=8, generator=3, max_concurrency=4)
    expected = [float(x) for batch in [b async for b in plain] for x in batch]
    assert [float(x) for batch in [b async for b in throttled] for x in batch] == expected


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan"), "soon", True])
def test_a_bad_retry_after_is_a_value_error_naming_it(value: Any) -> None:
    with pytest.raises(ValueError, match="retry_after"):
        Throttled(retry_after=value)


def test_throttled_carries_its_wait() -> None:
    assert Throttled(2).retry_after == 2.0 and "retry after 2 s" in str(Throttled(2))
    assert Throttled().retry_after is None and isinstance(Throttled(), aloader.AloaderError)
