"""``Stream.map(fn, concurrency="auto")``: the calls in flight follow the stage's controller
(kept from epoch to epoch and in the stream's state), ``Throttled`` from ``fn`` waits and
calls again in place, and bad values are refused naming the argument. No test is timed."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import anyio
import httpx
import pytest
from sourcetools import collect

from aloader import DataLoader, Throttled, as_stream
from aloader._tuning import Controller

pytestmark = pytest.mark.anyio


class Scripted(Controller):
    """The limit is 30, then 2 from the 100th completion to the 300th."""

    def __init__(self) -> None:
        super().__init__(1024, initial=30)
        self.completions = 0

    def done(self, latency: int, now: int) -> None:
        self.completions += 1
        limit = 2 if 100 <= self.completions < 300 else 30
        if limit != self.limit:
            self.limit = limit
            if self.on_change is not None:
                self.on_change(limit)


async def test_auto_maps_every_item_in_order_and_reports_its_controller() -> None:
    async def work(x: int) -> int:
        await anyio.sleep(0.001)
        return x * 3

    mapped = as_stream(range(500)).map(work, concurrency="auto", concurrency_limit=64)
    assert await collect(mapped) == [x * 3 for x in range(500)]
    tuning = mapped.tuning  # type: ignore[attr-defined]
    assert tuning["maximum"] == 64 and 1 <= tuning["limit"] <= 64
    assert tuning["throttled"] == 0
    assert all(why in ("startup", "knee", "steady") for _, _, why in tuning["history"])
    assert mapped.max_running <= 64  # type: ignore[attr-defined]
    json.dumps(tuning)


async def test_the_calls_in_flight_follow_the_controller() -> None:
    tuner = Scripted()
    running = 0
    starts: list[tuple[int, int]] = []

    async def work(x: int) -> int:
        nonlocal running
        running += 1
        starts.append((tuner.completions, running))
        await anyio.sleep(0.001)
        running -= 1
        return x

    mapped = as_stream(range(600)).map(work, concurrency="auto")
    mapped.tuner = tuner  # type: ignore[attr-defined]
    assert await collect(mapped) == list(range(600))
    low = [flight for done, flight in starts if 100 + 30 <= done < 300]
    assert low and max(low) <= 2
    assert max(flight for done, flight in starts if done >= 300 + 2) > 2
    assert max(flight for _, flight in starts) <= 30


async def test_a_throttled_call_waits_and_is_made_again_in_place(serve: Any) -> None:
    server = serve({str(i): str(i).encode() for i in range(30)})

    async with httpx.AsyncClient() as client:
        async def fetch(i: int) -> int:
            response = await client.get(server.url(str(i)))
            if response.status_code == 429:
                raise Throttled(float(response.headers["Retry-After"]))
            return int(response.content)

        for concurrency in (1, 5, "auto"):
            for i in range(0, 30, 4):
                server.fail(str(i), 429, times=1, retry_after="0")
            mapped = as_stream(range(30)).map(fetch, concurrency=concurrency)
            assert await collect(mapped) == list(range(30))
            assert mapped.throttled == 8  # type: ignore[attr-defined]


async def test_a_plain_function_throttled_at_concurrency_one() -> None:
    attempts: Counter[int] = Counter()

    def fn(x: int) -> int:
        attempts[x] += 1
        if x % 3 == 0 and attempts[x] == 1:
            raise Throttled(0)
        return x

    mapped = as_stream(range(12)).map(fn)
    assert await collect(mapped) == list(range(12))
    assert mapped.throttled == 4  # type: ignore[attr-defined]


async def test_the_stage_state_keeps_the_limit() -> None:
    async def work(x: int) -> int:
        await anyio.sleep(0)
        return x

    stream = as_stream(range(100)).map(work, concurrency="auto")
    iterator: Any = stream.__aiter__()
    for _ in range(10):
        await iterator.__anext__()
    state = json.loads(json.dumps(stream.state_dict()))
    await iterator.aclose()
    assert state["position"]["concurrency"]["limit"] >= 1
    state["position"]["concurrency"]["limit"] = 5
    state["position"]["concurrency"]["phase"] = "steady"
    resumed = as_stream(range(100)).map(work, concurrency="auto")
    resumed.load_state_dict(state)
    rest = await collect(resumed)
    assert rest == list(range(10, 100))
    assert resumed.tuning["phase"] == "steady"  # type: ignore[attr-defined]
    bad = json.loads(json.dumps(state))
    bad["position"]["concurrency"]["limit"] = 0
    with pytest.raises(ValueError, match="concurrency"):
        as_stream(range(100)).map(work, concurrency="auto").load_state_dict(bad)


def test_a_loader_over_an_auto_map() -> None:
    async def work(x: int) -> int:
        await anyio.sleep(0)
        return x + 1

    loader = DataLoader(as_stream(range(64)).map(work, concurrency="auto"), batch_size=8)
    assert [int(x) for batch in loader for x in batch] == list(range(1, 65))


@pytest.mark.parametrize("value", ["fast", 0, -2, 1.5, True])
def test_a_bad_concurrency_is_a_value_error_naming_it(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^concurrency should be a positive integer or 'auto'"):
        as_stream(range(3)).map(str, concurrency=value)


def test_a_bad_concurrency_limit_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^concurrency_limit should be a positive integer"):
        as_stream(range(3)).map(str, concurrency="auto", concurrency_limit=0)
    with pytest.raises(ValueError, match=r"concurrency_limit bounds concurrency='auto'"):
        as_stream(range(3)).map(str, concurrency=4, concurrency_limit=8)
