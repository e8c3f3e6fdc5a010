"""The sources' reads tune themselves: ``concurrency="auto"`` (the shards read at once follow
the source's controller), throttling is not failure (429, or 503 with ``Retry-After``: waited
for, counted in ``stats.throttled``, not against ``retries``), and ``hedge`` (a late answer
gets a second request; the first answer is read). Against the tests' HTTP server on
127.0.0.1; nothing is timed: what is asserted is what was asked and what came back."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import collect

from aloader import DataLoader, JsonLines
from aloader.sources._readahead import _Slots

pytestmark = pytest.mark.anyio

FAST = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}


def _ids(records: list[dict[str, Any]]) -> list[int]:
    return [record["id"] for record in records]


async def test_a_throttled_shard_is_waited_for_not_counted_as_a_failure(serve: Any) -> None:
    server: FaultyServer = serve(make_jsonl_shards(4, 20))
    names = sorted(server.files)
    server.fail(names[1], 429, times=3, retry_after="0")
    server.fail(names[2], 503, times=2, retry_after="0")
    source = JsonLines(server.urls, retries=0, **FAST)  # no retry allowed: none is needed
    assert _ids(await collect(source)) == list(range(80))
    assert (source.stats.throttled, source.stats.retries) == (5, 0)
    assert [name for name, _ in server.requests].count(names[1]) == 4


async def test_a_503_without_retry_after_is_a_failure_that_is_retried(serve: Any) -> None:
    server: FaultyServer = serve(make_jsonl_shards(2, 10))
    server.fail(sorted(server.files)[0], 503, times=2)
    source = JsonLines(server.urls, retries=2, **FAST)
    assert _ids(await collect(source)) == list(range(20))
    assert (source.stats.throttled, source.stats.retries) == (0, 2)


async def test_throttling_after_some_bytes_resumes_from_them(serve: Any) -> None:
    files = make_jsonl_shards(1, 300)
    server: FaultyServer = serve(files)
    name = next(iter(files))
    server.cut(name, 5000)
    server.fail(name, 429, times=2, retry_after="0")
    source = JsonLines(server.urls, chunk_size=1000, **FAST)
    assert _ids(await collect(source)) == list(range(300))
    assert (source.stats.retries, source.stats.throttled) == (1, 2)
    ranges = [spec for _, spec in server.requests]
    assert ranges[0] is None and all(spec is not None for spec in ranges[1:])
    assert source.stats.bytes == len(files[name])  # nothing read twice


async def test_auto_concurrency_reads_every_shard_in_order(serve: Any) -> None:
    server: FaultyServer = serve(make_jsonl_shards(40, 5), latency=0.002)
    source = JsonLines(server.urls, concurrency="auto", concurrency_limit=24, **FAST)
    assert _ids(await collect(source)) == list(range(200))
    tuning = source.stats.concurrency
    assert tuning is not None and tuning == source.tuning | {"history": tuning["history"]}
    assert 1 <= tuning["limit"] <= 24 and tuning["maximum"] == 24
    assert tuning["phase"] in ("startup", "steady")
    assert all(why in ("startup", "knee", "steady") for _, _, why in tuning["history"])
    json.dumps(tuning)


async def test_auto_concurrency_backs_off_when_the_store_throttles(serve: Any) -> None:
    server: FaultyServer = serve(make_jsonl_shards(60, 3))
    for name in sorted(server.files)[20:40]:
        server.fail(name, 429, retry_after="0")
    # (Not hedged: a second request could take a refusal meant for the first.)
    source = JsonLines(server.urls, concurrency="auto", hedge=None, **FAST)
    assert _ids(await collect(source)) == list(range(180))
    assert source.stats.throttled == 20
    tuning = source.stats.concurrency
    assert tuning is not None and tuning["throttles"] == 20
    assert any(why == "throttled" for _, _, why in tuning["history"])


def test_the_loaders_stats_show_a_sources_limit_and_throttling(serve: Any) -> None:
    server: FaultyServer = serve(make_jsonl_shards(6, 4))
    server.fail(sorted(server.files)[3], 429, retry_after="0")
    source = JsonLines(server.urls, concurrency="auto", **FAST)
    loader = DataLoader(source, batch_size=6, collate_fn=list)
    assert sum(len(batch) for batch in loader) == 24
    counts = loader.stats().sources[0]
    assert counts["throttled"] == 1 and counts["concurrency"] >= 1


async def test_the_sources_state_keeps_its_limit(serve: Any) -> None:
    server: FaultyServer = serve(make_jsonl_shards(10, 10))
    source = JsonLines(server.urls, concurrency="auto", **FAST)
    iterator: Any = source.__aiter__()
    for _ in range(25):
        await iterator.__anext__()
    state = json.loads(json.dumps(source.state_dict()))
    await iterator.aclose()
    assert state["position"]["concurrency"]["limit"] >= 1
    state["position"]["concurrency"].update(limit=3, phase="steady")
    resumed = JsonLines(server.urls, concurrency="auto", **FAST)
    resumed.load_state_dict(state)
    assert _ids(await collect(resumed)) == list(range(25, 100))
    assert resumed.tuning is not None and resumed.tuning["phase"] == "steady"
    state["position"]["concurrency"]["limit"] = "many"
    with pytest.raises(ValueError, match="concurrency"):
        JsonLines(server.urls, concurrency="auto", **FAST).load_state_dict(state)


async def test_a_late_answer_is_hedged_and_the_first_answer_read(serve: Any) -> None:
    server: FaultyServer = serve(make_jsonl_shards(60, 4))
    late = sorted(server.files)[45]
    server.stall(late, 5.0)  # its first request only
    source = JsonLines(server.urls, concurrency=4, hedge=0.05, **FAST)
    assert _ids(await collect(source)) == list(range(240))
    assert source.stats.hedged == 1
    assert [name for name, _ in server.requests].count(late) == 2
    assert source.stats.retries == 0 and source.stats.bytes == sum(map(len, server.files.values()))


async def test_hedging_waits_for_its_warmup_and_keeps_to_its_budget(serve: Any) -> None:
    server: FaultyServer = serve(make_jsonl_shards(40, 2))
    for name in sorted(server.files):
        server.stall(name, 0.3)  # every first request late
    source = JsonLines(server.urls, concurrency=8, **FAST)  # hedge="auto"
    assert _ids(await collect(source)) == list(range(80))
    # "auto" learns the latencies over its first 20 reads; then at most 5% of the reads.
    assert source.stats.hedged <= 0.05 * 40
    unhedged = JsonLines(server.urls, concurrency=8, hedge=None, **FAST)
    assert _ids(await collect(unhedged)) == list(range(80))
    assert unhedged.stats.hedged == 0


async def test_slots_follow_a_new_size() -> None:
    slots = _Slots(2)
    await slots.acquire()
    await slots.acquire()
    got: list[int] = []

    async def third() -> None:
        await slots.acquire()
        got.append(3)

    async with anyio.create_task_group() as group:
        group.start_soon(third)
        await anyio.sleep(0.01)
        assert got == []  # full
        slots.resize(3)
    assert got == [3] and slots.taken == 3
    slots.resize(1)
    slots.release()
    slots.release()
    assert slots.taken == 1


@pytest.mark.parametrize("value", ["fast", 0, -8, 2.5, True])
def test_a_bad_concurrency_is_a_value_error_naming_it(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^concurrency should be a positive integer or 'auto'"):
        JsonLines("x.jsonl", concurrency=value)


@pytest.mark.parametrize("value", ["fast", 0, -1, float("nan"), True])
def test_a_bad_hedge_is_a_value_error_naming_it(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^hedge should be 'auto', a positive number"):
        JsonLines("x.jsonl", hedge=value)


def test_a_bad_concurrency_limit_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^concurrency_limit should be a positive integer"):
        JsonLines("x.jsonl", concurrency="auto", concurrency_limit=0)
    with pytest.raises(ValueError, match="concurrency_limit bounds concurrency='auto'"):
        JsonLines("x.jsonl", concurrency=4, concurrency_limit=8)
