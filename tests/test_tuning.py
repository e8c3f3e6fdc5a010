"""The controller of "auto" concurrency, the hedging budget and the throttling waits
(aloader._tuning): decisions only, fed synthetic completions on a fake clock (a
discrete-event model of a store), never timed."""

from __future__ import annotations

import heapq
import json
import math
import random
from typing import Any

import pytest

from aloader._tuning import (
    MAX_THROTTLED,
    Controller,
    Hedger,
    check_concurrency,
    check_hedge,
    throttle_delay,
)

MS = 1_000_000
SECOND = 1_000_000_000


class Store:
    """A store on a fake clock: ``parallel`` requests served at once (FIFO queue beyond) in
    ``service`` ns (+-20%, seeded), and optionally a token bucket of ``rate`` requests per
    second (``burst`` deep) answering the others "throttled" after 1 ms."""

    def __init__(self, parallel: int = 200, service: int = 100 * MS, rate: float | None = None,
                 burst: float = 0.0, seed: int = 0) -> None:
        self.parallel, self.service = parallel, service
        self.rate, self.burst, self.tokens, self.last = rate, burst, burst, 0
        self.rng = random.Random(seed)
        self.busy = 0
        self.queue: list[int] = []
        self.events: list[tuple[int, int, str, int]] = []
        self.seq = 0

    def push(self, at: int, kind: str, sent: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, sent))

    def arrive(self, now: int) -> None:
        if self.rate is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.last) / SECOND * self.rate)
            self.last = now
            if self.tokens < 1:
                self.push(now + MS, "throttled", now)
                return
            self.tokens -= 1
        if self.busy < self.parallel:
            self.busy += 1
            self.push(now + self.duration(), "done", now)
        else:
            self.queue.append(now)

    def duration(self) -> int:
        return int(self.service * (0.8 + 0.4 * self.rng.random()))

    def finished(self, now: int) -> None:
        if self.queue:
            sent = self.queue.pop(0)
            self.push(now + self.duration(), "done", sent)
        else:
            self.busy -= 1


def drive(controller: Controller, store: Store, seconds: float, *, demand: int | None = None,
          retry_after: float = 1.0) -> dict[str, Any]:
    """Run ``controller`` against ``store`` for ``seconds`` of fake time, as the loader's
    fetch workers do: fetches start while fewer than the limit (and ``demand``, if given) are
    out; a throttled fetch gives its slot back and is due again ``retry_after`` later, first
    in line for the next free slot. Returns the counts and the limits seen each tenth of a
    second."""
    out = 0
    due: list[int] = []  # throttled fetches whose wait is over
    completed = throttled = 0
    limits: list[int] = []

    def fill(now: int) -> None:
        nonlocal out
        cap = controller.limit if demand is None else min(controller.limit, demand)
        while out < cap:
            out += 1
            if due:
                due.pop()
            store.arrive(now)

    fill(0)
    end = int(seconds * SECOND)
    next_sample = 0
    while store.events:
        now, _, kind, sent = heapq.heappop(store.events)
        if now > end:
            break
        while now >= next_sample:
            limits.append(controller.limit)
            next_sample += SECOND // 10
        if kind == "done":
            completed += 1
            out -= 1
            controller.done(now - sent, now)
            store.finished(now)
        elif kind == "throttled":
            throttled += 1
            out -= 1
            controller.throttled(now)
            store.push(now + int(retry_after * SECOND), "again", now)
        else:  # its wait is over: it takes the next free slot
            due.append(now)
        fill(now)
    return {"rate": completed / seconds, "throttled": throttled, "limits": limits}


# --------------------------------------------------------------------------- the knee


@pytest.mark.parametrize(("parallel", "service"), [(200, 100 * MS), (200, 10 * MS), (50, 10 * MS),
                                                    (600, 20 * MS)])
def test_finds_the_knee_and_keeps_the_store_busy(parallel: int, service: int) -> None:
    controller = Controller(1024)
    result = drive(controller, Store(parallel, service), 20)
    best = parallel / (service / SECOND)
    assert result["rate"] >= 0.9 * best
    late = result["limits"][-50:]  # the last 5 seconds: near the knee, not far past it
    assert min(late) >= 0.7 * parallel
    assert max(late) <= 1.6 * parallel
    assert controller.phase == "steady"


def test_startup_doubles_every_round_while_the_rate_grows() -> None:
    controller = Controller(1024)
    drive(controller, Store(parallel=400, service=100 * MS), 1.5)
    history = list(controller.history)
    assert [limit for _, limit, why in history[:4]] == [32, 64, 128, 256]
    assert all(why == "startup" for _, _, why in history[:4])
    # Past the knee the rate stopped growing and latency rose: the startup ends near it.
    assert any(why == "knee" and 400 <= limit <= 600 for _, limit, why in history)


def test_backs_off_when_latency_rises_without_throughput() -> None:
    controller = Controller(1024)
    controller.load_state_dict({"limit": 900, "phase": "steady", "latency": 0.02})
    result = drive(controller, Store(parallel=100, service=20 * MS), 10)
    assert max(result["limits"][-20:]) <= 1.6 * 100
    assert result["rate"] >= 0.9 * 100 / 0.02


def test_a_held_back_pipeline_does_not_raise_the_limit() -> None:
    controller = Controller(1024)
    drive(controller, Store(parallel=1000, service=10 * MS), 5, demand=20)
    # Never more than 20 in flight: the store's knee is unknown, and the limit stays where
    # the first rounds left it instead of growing to the maximum.
    assert controller.limit <= 64


def test_stays_within_its_bounds() -> None:
    controller = Controller(48, minimum=4)
    result = drive(controller, Store(parallel=5000, service=10 * MS), 5)
    assert max(result["limits"]) == 48
    assert result["limits"][-10:].count(48) >= 7  # but for a probe round now and then
    slow = Controller(1024, initial=8, minimum=8)
    result = drive(slow, Store(parallel=1, service=10 * MS), 5)
    assert min(result["limits"]) >= 8


def test_changes_reach_on_change() -> None:
    controller = Controller(1024)
    seen: list[int] = []
    controller.on_change = seen.append
    drive(controller, Store(parallel=200, service=10 * MS), 2)
    assert seen and seen[-1] == controller.limit
    assert seen[:3] == [32, 64, 128]


# --------------------------------------------------------------------------- throttling


@pytest.mark.parametrize(("rate", "burst"), [(1000, 200), (500, 50), (2000, 400)])
def test_under_a_rate_limit_it_settles_just_below_it(rate: float, burst: float) -> None:
    controller = Controller(1024)
    result = drive(controller, Store(parallel=1000, service=100 * MS, rate=rate, burst=burst),
                   30)
    assert result["rate"] >= 0.9 * rate
    ceiling = controller.state_dict()["ceiling"]
    assert ceiling is not None and 0.85 * rate <= ceiling <= rate
    # Two episodes at most: one to learn the rate, maybe one to correct a burst's overshoot.
    episodes = [entry for entry in controller.history if entry[2] == "throttled"]
    assert 1 <= len(episodes) <= 2
    assert controller.held == "ceiling"


def test_a_throttling_episode_measures_the_rate_the_store_lets_through() -> None:
    controller = Controller(1024)
    controller.load_state_dict({"limit": 100, "phase": "steady", "latency": 0.1})
    now = 0
    for _ in range(120):  # a round at 100 in flight: its latency is 100 ms
        now += MS
        controller.done(100 * MS, now)
    first, kept = now, controller.limit
    controller.throttled(now)
    assert controller.throttles == 1 and controller.measuring
    assert controller.limit == kept  # kept while the store refuses (one wait for all)
    # For 300 ms the store refuses some requests and takes 500 a second: those it takes
    # complete 100 ms later, one every 2 ms.
    while now < first + 400 * MS:
        now += 2 * MS
        if now <= first + 300 * MS:
            controller.throttled(now)
        controller.done(100 * MS, now)
    assert controller.measuring  # until no refusal came for a latency and a half
    while controller.measuring:
        now += 2 * MS
        controller.done(100 * MS, now)
    assert controller.state_dict()["ceiling"] == pytest.approx(0.97 * 500, rel=0.03)
    assert controller.limit == pytest.approx(0.97 * 500 * 0.1, abs=2)
    assert [why for _, _, why in controller.history][-2:] == ["throttled", "ceiling"]


def test_a_refused_burst_is_cut_without_a_ceiling() -> None:
    controller = Controller(1024)
    controller.load_state_dict({"limit": 100, "phase": "steady", "latency": 0.1})
    now = 0
    for _ in range(120):
        now += MS
        controller.done(100 * MS, now)
    kept = controller.limit
    controller.throttled(now)  # one refusal: no span to measure a rate over
    while controller.measuring:
        now += 2 * MS
        controller.done(100 * MS, now)
    assert controller.state_dict()["ceiling"] is None
    assert controller.limit == int(kept * 0.8 + 0.5)


def _ceiling_at(controller: Controller, start: int, rate: float, seconds: float) -> int:
    """Drive ``controller`` at ``rate`` completions a second of 100 ms each from ``start``
    for ``seconds``; returns the clock."""
    now = start
    step = int(SECOND / rate)
    end = now + int(seconds * SECOND)
    while now < end:
        now += step
        controller.done(100 * MS, now)
    return now


def test_the_ceiling_holds_then_rises_and_holds_longer_after_a_raise_that_was_too_much() -> None:
    controller = Controller(1024)
    controller.load_state_dict({"limit": 50, "phase": "steady", "latency": 0.1,
                                "ceiling": 400.0})
    now = _ceiling_at(controller, 0, 500, 25)
    assert controller.state_dict()["ceiling"] == 400.0  # held (the first hold is 30 s)
    now = _ceiling_at(controller, now, 500, 10)
    assert controller.state_dict()["ceiling"] == pytest.approx(420.0)  # raised 5%
    assert any(why == "ceiling raised" for _, _, why in controller.history)
    first = now
    controller.throttled(now)  # the raise was too much: the store takes 400 a second
    while controller.measuring:
        now += int(SECOND / 400)
        if now <= first + 300 * MS:
            controller.throttled(now)
        controller.done(100 * MS, now)
    before = controller.state_dict()["ceiling"]
    assert before < 420.0
    now = _ceiling_at(controller, now, 380, 50)  # the hold doubled to 60 s: no raise yet
    assert controller.state_dict()["ceiling"] == before


def test_throttled_before_anything_completed_cuts_at_once() -> None:
    controller = Controller(1024)
    controller.throttled(0)
    assert controller.limit == round(16 * 0.8)
    controller.throttled(MS)  # within the calm: the same episode
    assert controller.limit == round(16 * 0.8)
    controller.throttled(200 * MS)
    assert controller.limit == round(round(16 * 0.8) * 0.8)


# --------------------------------------------------------------------------- state


def test_state_round_trips_as_json_and_resumes_where_it_was() -> None:
    controller = Controller(1024)
    drive(controller, Store(parallel=300, service=50 * MS), 10)
    state = json.loads(json.dumps(controller.state_dict()))
    resumed = Controller(1024)
    resumed.load_state_dict(state)
    assert resumed.limit == controller.limit and resumed.phase == "steady"
    assert resumed.state_dict()["latency"] == pytest.approx(state["latency"])
    # A smaller maximum keeps the limit within it.
    small = Controller(64)
    small.load_state_dict(state)
    assert small.limit == 64


@pytest.mark.parametrize(("state", "field"), [
    ([], "dict"),
    ({"phase": "steady"}, "'limit'"),
    ({"limit": 0, "phase": "steady"}, "'limit'"),
    ({"limit": True, "phase": "steady"}, "'limit'"),
    ({"limit": 5, "phase": "fast"}, "'phase'"),
    ({"limit": 5, "phase": "steady", "rate": -1}, "'rate'"),
    ({"limit": 5, "phase": "steady", "latency": math.inf}, "'latency'"),
    ({"limit": 5, "phase": "steady", "ceiling": "high"}, "'ceiling'"),
    ({"limit": 5, "phase": "steady", "throttles": -2}, "'throttles'"),
])
def test_a_bad_state_is_refused_naming_the_field(state: Any, field: str) -> None:
    controller = Controller(1024)
    with pytest.raises(ValueError, match=field):
        controller.load_state_dict(state)
    assert controller.limit == 16  # unchanged


def test_snapshot_has_the_limit_its_bounds_and_the_history() -> None:
    controller = Controller(256)
    drive(controller, Store(parallel=100, service=20 * MS), 3)
    snap = controller.snapshot()
    assert snap["limit"] == controller.limit and snap["maximum"] == 256
    assert snap["phase"] == "steady" and snap["rate"] > 0 and snap["latency"] > 0
    assert all(len(entry) == 3 for entry in snap["history"])
    json.dumps(snap)


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("value", ["fast", 0, -3, 2.5, True, "AUTO", None])
def test_a_bad_concurrency_is_a_value_error_naming_the_argument(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^concurrency should be a positive integer or 'auto'"):
        check_concurrency("concurrency", value)


def test_good_concurrencies() -> None:
    assert check_concurrency("c", "auto") == "auto"
    assert check_concurrency("c", 7) == 7
    assert check_concurrency("c", None, allow_none=True) is None


@pytest.mark.parametrize("value", ["fast", 0, -1.0, math.nan, math.inf, True])
def test_a_bad_hedge_is_a_value_error_naming_the_argument(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^hedge should be"):
        check_hedge("hedge", value, auto=True)
    with pytest.raises(ValueError, match=r"^hedge_after should be"):
        check_hedge("hedge_after", "auto", auto=False)


def test_good_hedges() -> None:
    assert check_hedge("hedge", "auto", auto=True) == "auto"
    assert check_hedge("hedge", None, auto=True) is None
    assert check_hedge("hedge_after", 2, auto=False) == 2.0


# --------------------------------------------------------------------------- waits, hedging


def test_throttle_delay_honours_retry_after_and_backs_off_without_it() -> None:
    assert throttle_delay(2.0, 1, jitter=lambda: 0.0) == 2.0
    assert throttle_delay(2.0, 1, jitter=lambda: 1.0) == pytest.approx(2.2)
    assert throttle_delay(120.0, 1, max_backoff=10.0, jitter=lambda: 0.0) == 10.0
    assert throttle_delay(0.0, 3, jitter=lambda: 0.5) == 0.0
    waits = [throttle_delay(None, n, backoff=0.1, max_backoff=1.0, jitter=lambda: 1.0)
             for n in range(1, 8)]
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert throttle_delay(None, 10**6, jitter=lambda: 0.0) == 5.0  # half of 10 s at least
    assert MAX_THROTTLED >= 16


def test_hedger_waits_for_its_warmup_then_hedges_after_the_95th_percentile() -> None:
    hedger = Hedger()
    for latency in range(1, 20):
        assert hedger.delay() is None
        hedger.record(latency * MS)
    hedger.record(20 * MS)
    for latency in range(21, 101):
        hedger.record(latency * MS)
    assert hedger.delay() == pytest.approx(0.096)


def test_hedging_never_exceeds_its_budget() -> None:
    hedger = Hedger(0.01, share=0.05)
    hedges = 0
    for reads in range(1, 2001):
        assert hedger.delay() == 0.01
        if hedger.spend():  # every read late: as many hedges as the budget allows
            hedges += 1
        assert hedges <= 0.05 * reads + 1e-9
    assert hedges == hedger.hedged == 100
