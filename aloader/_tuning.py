"""Fetching that tunes itself: the controller behind ``"auto"`` concurrency, the waits of
throttled fetches, and when to hedge a late read.

Pure logic: no I/O and no clock of its own (every call is given ``now``, in
``time.perf_counter_ns()`` nanoseconds), so that the loader's map epochs, ``Stream.map`` and
the sources' reads share one mechanism, and its decisions are tested by feeding it synthetic
completions on a fake clock.

:class:`Controller` sets the limit of fetches in flight from what completes: each completion
brings its latency; every *round* (``max(16, limit)`` completions, about one latency when the
limit is reached) gives a delivery rate ``X`` (completions per second), a mean latency ``L``
and, by Little's law, the fetches that were in flight on average (``X * L``).

Design: AIMD's skeleton (grow gently, cut on a hard signal) with a delay-based steady state
(TCP Vegas's) and a fast start (TCP's slow start), plus a rate ceiling for throttling stores.

* Startup: the limit doubles every round while the rate grows by 25% or more; it stops when
  the rate does not grow for two rounds or latency doubled (a queue formed: the knee, past
  which more fetches only queue at the store, is passed), and sets the limit at 1.1 times the
  best rate times the least latency seen. A knee of 200 is found from 16 in about five
  rounds, not the ~200 rounds of an additive increase.
* Steady state: each round estimates the fetches that waited in a queue, ``limit * (1 -
  L0 / L)``, where ``L0`` (the latency with no queue) is the least round latency of the last
  64 rounds. Below a tenth of the limit it grows by 10% (throughput can still grow), above a
  quarter it shrinks by 10% (latency rose without throughput), between it holds: the limit
  settles between 1.1 and 1.33 times the knee, where the store always has work and throughput
  is its best. Every 16 rounds a round at 0.75 times the limit lets a queue drain, so that
  ``L0`` is measured again and does not creep up with a standing queue (Vegas's and
  Gradient2's drift).
* Throttling (429, 503 SlowDown, :class:`~aloader.Throttled`) is a hard signal, and a rate
  limit gives no latency signal before it refuses. At the first refusal of an *episode* the
  limit is kept for a while (the refused fetches wait their ``Retry-After`` all at once, so
  the episode costs one wait): the requests the store took between its first and last
  refusals (each completion's clock less its latency), over the busiest latency-long
  stretch, are the rate it lets through; 97% of it becomes a *ceiling* the limit keeps to
  (``ceiling * L`` in flight), the limit is cut under it, and the ceiling holds 30 s before it
  is raised by 5%; a raise refused again waits twice as long before the next. So the rate is
  learnt in one episode and kept, where probing it every few rounds would cost a
  ``Retry-After`` each time.
* Rounds where fewer than half the limit were in flight (the consumer, or the pipeline's
  memory bound, held fetches back) neither double nor grow the limit: a limit that nothing
  reaches measures nothing. After any cut, the fetches in flight then complete before a round
  counts (they queued under the old limit).

Why not the alternatives: AIMD halving on congestion averages ~75% of the knee (its sawtooth)
and grows by one a round; a pure latency gradient (Gradient2) or a pure Vegas cannot see a
rate limit, and drift with a standing queue; BBR's rate times least latency over windowed
extremes drifted up where latency has no plateau (a client bound by its own CPU) and
collapsed with a median, in this project's measurements. Both knobs a user sees stay
bounded: the limit is within ``[minimum, maximum]`` (``max_concurrency_limit``), and what the
pipeline holds follows the limit as it does a fixed ``max_concurrency``.

:class:`Hedger` decides when a read whose first byte is late gets a second request: after the
95th percentile of recent first-byte latencies (or a fixed delay), within a budget of 5% extra
requests. :func:`throttle_delay` is the wait before a throttled fetch is made again.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._exceptions import Throttled

__all__ = (
    "DEFAULT_MAX_LIMIT",
    "MAX_THROTTLED",
    "Controller",
    "Hedger",
    "ReadTuning",
    "check_concurrency",
    "check_hedge",
    "on_throttled",
    "throttle_delay",
)

#: The default ``max_concurrency_limit``: the most fetches "auto" lets run at once.
DEFAULT_MAX_LIMIT = 1024
#: A fetch throttled this many times in a row fails (with the last throttling as its
#: error): throttling is not failure, but a store that never answers must not hang a job.
MAX_THROTTLED = 64

_INITIAL = 16  # the limit "auto" starts from
_MIN_ROUND = 16  # completions per round at least (a rate from fewer is noise)
_GROWTH = 1.25  # startup goes on while a round's rate grows by this much
_STALLS = 2  # rounds without growth that end the startup
_QUEUED = 2.0  # a round's latency over the unloaded one that means a queue formed
_LATENCIES = 64  # rounds whose least latency is the one with no queue
_HEADROOM = 1.1  # the limit over the knee found at the end of the startup
_FEW = 0.1  # queued fetches (as a share of the limit) below which the limit grows
_MANY = 0.25  # ... and above which it shrinks
_STEP = 1.1  # a round's growth (or shrinking) factor
_PROBE_EVERY = 16  # rounds between two probes below the limit
_PROBE = 0.75  # a probe round's limit, as a share of the limit
_BUSY = 0.5  # in flight over the limit below which a round was held back (app-limited)
_CUT = 0.8  # the cut when the store refuses before any fetch completed
_CUT_MAX = 0.9  # the least cut at the end of a throttling episode
_SHARE = 0.97  # the ceiling: this share of the rate delivered while throttled
_RAISE = 1.05  # the ceiling's raise once its hold has passed
_HOLD_NS = 30_000_000_000  # how long a ceiling holds before its first raise
_MAX_HOLD_NS = 600_000_000_000
_CALM_NS = 100_000_000  # the calm after a cut made with no latency known
_EPISODE_NS = 200_000_000  # a throttling episode's refusals count for 4 latencies at least
_HISTORY = 64  # changes kept in the history
_HEDGE_BURST = 10.0  # hedges the budget may save up for stragglers that come together
_NOTABLE = 1.25  # a change this large (either way) enters the history


def check_concurrency(name: str, value: object, *, allow_none: bool = False) -> int | str | None:
    """``value`` as a concurrency: a positive int or ``"auto"`` (or None where allowed).

    Raises:
        ValueError: naming ``name``: anything else ("fast", 0, a negative number, a bool).
    """
    if value is None and allow_none:
        return None
    if value == "auto" and isinstance(value, str):
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        none = ", None" if allow_none else ""
        raise ValueError(f"{name} should be a positive integer or 'auto'{none}, but got "
                         f"{name}={value!r}")
    return value


def check_hedge(name: str, value: object, *, auto: bool) -> float | str | None:
    """``value`` as a hedging option: None (off), a positive number of seconds, or (where
    ``auto``) ``"auto"``.

    Raises:
        ValueError: naming ``name``: anything else.
    """
    if value is None:
        return None
    if auto and value == "auto" and isinstance(value, str):
        return "auto"
    if (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value) and value > 0):
        return float(value)
    what = "'auto', a positive number of seconds or None" if auto else (
        "a positive number of seconds or None")
    raise ValueError(f"{name} should be {what}, but got {name}={value!r}")


def throttle_delay(retry_after: float | None, in_a_row: int, *, backoff: float = 0.1,
                   max_backoff: float = 10.0, jitter: Callable[[], float] = random.random
                   ) -> float:
    """Seconds to wait before a throttled fetch is made again.

    The store's ``retry_after`` when it gave one (at most ``max_backoff``, and up to 10% more,
    so that the fetches it sent back together do not return together); else an exponential
    backoff from ``backoff`` for ``in_a_row`` throttlings in a row (1 for the first), at most
    ``max_backoff``, with jitter.
    """
    if retry_after is not None and retry_after >= 0:
        return min(retry_after, max_backoff) * (1.0 + 0.1 * jitter())
    delay = min(max_backoff, backoff * 2.0 ** min(max(in_a_row, 1) - 1, 64))
    return delay * (0.5 + 0.5 * jitter())


def on_throttled(error: Throttled, in_a_row: int, tuner: Controller | None, now: int) -> float:
    """A fetch was throttled for the ``in_a_row``-th time in a row at ``now``: tell the
    controller (if any) and return the seconds to wait before fetching again.

    Raises:
        Throttled: ``error`` (with a note saying so), once a fetch was throttled more than
            :data:`MAX_THROTTLED` times in a row.
    """
    if in_a_row > MAX_THROTTLED:
        error.add_note(f"throttled {in_a_row} times in a row: given up")
        raise error
    if tuner is not None:
        tuner.throttled(now)
    return throttle_delay(error.retry_after, in_a_row)


class Controller:
    """The in-flight limit of ``"auto"`` concurrency (see the module's description).

    The pipeline reads :attr:`limit`, reports each completion with :meth:`done` and each
    throttling answer with :meth:`throttled`; ``on_change`` (if set) is called with the new
    limit whenever it changes. Not thread-safe: a caller from several threads holds a lock.

    Invariant: a round counts only completions of fetches the current limit let start: after
    a cut, the fetches in flight then (some queued at the store) come back first and are left
    out (a *draining* round of as many completions), so that the latency a round measures is
    the one its limit causes.

    Args:
        maximum: the highest limit (``max_concurrency_limit``).
        initial: the limit to start from (default 16, at most ``maximum``).
        minimum: the lowest limit.
    """

    __slots__ = ("_best", "_calm_until", "_ceiling", "_ceiling_until", "_cycle", "_draining",
                 "_episode", "_hold", "_latencies", "_latency", "_origin", "_probing", "_raised",
                 "_rate", "_recorded", "_resume_limit", "_round", "_stalls", "_start",
                 "_unloaded", "_window", "history", "limit", "maximum", "measuring", "minimum",
                 "on_change", "phase", "record", "throttles")

    def __init__(self, maximum: int = DEFAULT_MAX_LIMIT, *, initial: int | None = None,
                 minimum: int = 1) -> None:
        self.maximum = max(1, maximum)
        self.minimum = max(1, min(minimum, self.maximum))
        start = _INITIAL if initial is None else initial
        self.limit = max(self.minimum, min(self.maximum, start))
        self.phase = "startup"
        self.throttles = 0  #: throttling answers reported
        #: Called with the new limit when it changes (on the thread that reported).
        self.on_change: Callable[[int], None] | None = None
        #: The notable changes: (seconds since the first report, limit, why).
        self.history: deque[tuple[float, int, str]] = deque(maxlen=_HISTORY)
        self._origin: int | None = None  # the clock of the first report
        self._recorded = self.limit
        # The latencies (ns) of this round's completions so far. ``record`` appends one:
        # a bare list append, for the loader's hot path, which then calls :meth:`tick` once
        # per batch; :meth:`done` does both.
        self._latencies: list[int] = []
        self.record: Callable[[int], None] = self._latencies.append
        self._start: int | None = None  # this round's start
        self._round = max(_MIN_ROUND, self.limit)  # completions that end this round
        self._draining = False  # this round only lets a cut's excess come back
        self.measuring = False  # this round measures the rate the store lets through
        # A throttling episode: the clock of its first and last refusals, the latency, the
        # last clock a refusal extends it to; and the clocks its completed requests were sent.
        self._window = (0, 0, 0, 0)
        self._episode: list[int] = []
        self._rate = 0.0  # the last round's rate, per ns (0: none yet)
        self._latency = 0.0  # the last round's mean latency (ns)
        # The latencies of the last rounds (ns): the least is the latency with no queue.
        self._unloaded: deque[float] = deque(maxlen=_LATENCIES)
        self._probing = False  # the round under way is a probe below the limit
        self._resume_limit = self.limit  # the limit after the probe
        self._best = 0.0  # startup's best rate
        self._stalls = 0
        self._cycle = 0
        self._ceiling: float | None = None  # per ns
        self._ceiling_until: int | None = None  # when the ceiling rises (None: not set)
        self._raised: int | None = None  # when the ceiling was last raised
        self._hold = _HOLD_NS
        self._calm_until = 0  # throttles before it belong to the episode being handled

    def __getstate__(self) -> dict[str, Any]:  # travels with a plan to worker processes
        state = {name: getattr(self, name) for name in self.__slots__}
        state["on_change"] = None  # the epoch's, which does not travel
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.record = self._latencies.append  # the copy's own list

    def resume(self, now: int) -> None:
        """Fetching starts (again, after a pause: a new epoch) at ``now``: a round starts, and
        one under way is dropped, as its span would count the pause."""
        if self._origin is None:
            self._origin = now
        if not self.measuring:
            self._restart(now)

    # The hot path ---------------------------------------------------------------------------
    def done(self, latency: int, now: int) -> None:
        """A fetch completed at ``now`` after ``latency`` ns (its last attempt's)."""
        self._latencies.append(latency)
        if len(self._latencies) >= self._round:
            self._end_round(now)

    def tick(self, now: int) -> None:
        """The completions :attr:`record` ed so far are in at ``now`` (a batch's end)."""
        if len(self._latencies) >= self._round:
            self._end_round(now)

    # Rounds ---------------------------------------------------------------------------------
    def _restart(self, now: int, size: int | None = None, draining: bool = False) -> None:
        """Start a round at ``now`` of ``size`` completions (default: the limit's)."""
        self._latencies.clear()
        self._start = now
        self._round = max(_MIN_ROUND, self.limit) if size is None else max(1, size)
        self._draining = draining

    def _end_round(self, now: int) -> None:
        start = self._start
        latencies = self._latencies
        count, busy = len(latencies), sum(latencies)
        if start is None:  # the first round: from the first fetch's start, near enough
            start = now - busy // max(1, count)
            if self._origin is None:
                self._origin = start
        span = max(1, now - start)
        if self.measuring:
            self._measure(now, [now - latency for latency in latencies])
            return
        if self._draining:
            self._restart(now)
            return
        self._restart(now)
        rate = count / span
        latency = busy / count
        held_back = busy / span < _BUSY * self.limit
        self._latency = latency
        self._rate = rate
        self._cycle += 1
        unloaded = self._unloaded
        unloaded.append(latency)
        least = min(unloaded)
        if self._probing:  # a round below the limit: only its latency, with no queue, counts
            self._probing = False
            self._set(self._resume_limit, now, "steady")
            return
        if self.phase == "startup":
            if held_back:
                return
            if rate >= _GROWTH * self._best and latency < _QUEUED * least:
                self._best = rate
                self._stalls = 0
                self._set(self.limit * 2, now, "startup")
                return
            self._stalls += 1
            if self._stalls < _STALLS and latency < _QUEUED * least:
                return  # a round more at this limit before deciding
            self.phase = "steady"
            # The knee: the fetches the best rate needs with no queue (and a little more).
            self._set(_HEADROOM * self._best * least, now, "knee")
            return
        # Fetches that waited in a queue this round (Vegas's estimate): the limit grows while
        # there are hardly any, and backs off when latency rose without throughput.
        queued = self.limit * (1.0 - least / latency)
        if queued < _FEW * self.limit and not held_back:
            target = self.limit * _STEP
        elif queued > _MANY * self.limit:
            target = self.limit / _STEP
        else:
            target = self.limit
        ceiling = self._ceiling
        if ceiling is not None:
            if self._ceiling_until is None:
                self._ceiling_until = now + self._hold
            elif now >= self._ceiling_until:
                ceiling = self._ceiling = ceiling * _RAISE
                self._ceiling_until = now + self._hold
                self._raised = now
                self._note(now, self.limit, "ceiling raised")
            target = min(target, ceiling * latency)
        if self._cycle % _PROBE_EVERY == 0 and ceiling is None:
            # Now and then a round below the limit lets any queue drain, so that the latency
            # with no queue is measured again (else it would creep up with the queue).
            self._resume_limit = max(self.minimum, min(self.maximum, int(target + 0.5)))
            self._probing = True
            self._set(target * _PROBE, now, "steady")
            return
        self._set(target, now, "steady")

    def _measure(self, now: int, sent: list[int]) -> None:
        """Completions at ``now`` during a throttling episode (see :meth:`throttled`), of
        requests ``sent`` at those clocks: the episode ends once no refusal came for a
        latency and a half; then the requests the store took while it refused others give
        its rate."""
        self._episode.extend(sent)
        first, last, latency, end = self._window
        self._restart(now, 1, draining=True)  # one completion at a time, while it lasts
        last = min(last, end)
        if now < last + 1.5 * latency:
            return
        self.measuring = False
        self._calm_until = now + 2 * int(latency)
        # The requests sent between its first and last refusals that it took (each sent at its
        # completion's clock less its latency: the burst it took before it ran out is left
        # out exactly). The pipeline may have stalled for a while meanwhile (in-order batches
        # wait for the refused fetches' Retry-After), offering the store less than it takes:
        # so the rate is that of the busiest latency-long stretch.
        taken = _busiest(sorted(self._episode), first, last, max(latency, 1))
        self._episode = []
        self._restart(now)
        if last - first < latency / 2 or taken < _MIN_ROUND:
            # Too short to measure (a burst refused, not a rate): cut, set no ceiling.
            self._set(self.limit * _CUT, now, "throttled")
            return
        cap = _SHARE * taken / min(max(latency, 1), last - first)
        if self._ceiling is not None and cap >= self._ceiling:
            cap = _SHARE * self._ceiling  # throttled at the ceiling itself: lower it
        self._ceiling = cap
        self._ceiling_until = now + self._hold
        self._set(min(self.limit * _CUT_MAX, cap * latency), now, "ceiling")

    def _set(self, limit: float, now: int, why: str) -> None:
        new = max(self.minimum, min(self.maximum, int(limit + 0.5)))
        old = self.limit
        if new == old:
            return
        self.limit = new
        if new < old:
            # Every fetch in flight now started under the old limit (some queued at the
            # store): they all come back before a round measures the new one.
            self._restart(now, old, draining=True)
        else:
            self._round = max(_MIN_ROUND, new)
        recorded = self._recorded
        if why != "steady" or new >= _NOTABLE * recorded or new * _NOTABLE <= recorded:
            self._note(now, new, why)
        if self.on_change is not None:
            self.on_change(new)

    def _note(self, now: int, limit: int, why: str) -> None:
        if self._origin is None:
            self._origin = now
        self._recorded = limit
        self.history.append((round((now - self._origin) / 1e9, 3), limit, why))

    # Throttling -----------------------------------------------------------------------------
    def throttled(self, now: int) -> None:
        """The store refused a fetch at ``now`` (429, 503 SlowDown, :class:`Throttled`).

        The first of an episode starts a round that measures the rate the store lets through
        at this limit (the refused fetches wait meanwhile, so the episode costs one wait);
        its end sets the ceiling and cuts the limit under it. Throttling before any fetch
        completes (nothing to measure) cuts the limit at once.
        """
        self.throttles += 1
        if self.measuring:  # the same episode: its refusals so far
            first, last, latency, end = self._window
            self._window = (first, max(last, now), latency, end)
            return
        if now < self._calm_until:
            return  # refusals of requests sent before the cut
        raised = self._raised
        if raised is not None and now - raised < self._hold:
            self._hold = min(_MAX_HOLD_NS, 2 * self._hold)  # the raise was too much
        self._raised = None
        self.phase = "steady"
        self._probing = False
        self._note(now, self.limit, "throttled")
        if not self._latency and not self._latencies:
            # Refused before anything completed: no rate to measure, cut and wait a while.
            self._calm_until = now + _CALM_NS
            self._set(self.limit * _CUT, now, "throttled")
            return
        # The episode: the limit is kept while the store refuses (the refused fetches wait
        # meanwhile, all at once, so the episode costs one wait), and each completion's time
        # is noted, to count the requests it took while it refused others.
        latency = int(self._latency)
        self.measuring = True
        self._window = (now, now, latency, now + max(4 * latency, _EPISODE_NS))
        self._episode = []
        self._restart(now, 1, draining=True)

    # Checkpoints and statistics -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The controller's state as JSON builtins: a resumed job starts where it was."""
        return {
            "limit": self.limit,
            "phase": self.phase,
            "rate": self._rate * 1e9 or None,  # per second
            "latency": min(self._unloaded) / 1e9 if self._unloaded else None,  # no queue
            "ceiling": None if self._ceiling is None else self._ceiling * 1e9,
            "throttles": self.throttles,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (the limit within this controller's
        bounds); the measurements start again, the estimates as saved.

        Raises:
            ValueError: a field is missing or of the wrong kind (naming it).
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"the concurrency state should be a dict, but got {state!r}")
        limit = state.get("limit")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"the concurrency state's 'limit' should be a positive integer, "
                             f"but got {limit!r}")
        phase = state.get("phase")
        if phase not in ("startup", "steady"):
            raise ValueError(f"the concurrency state's 'phase' should be 'startup' or "
                             f"'steady', but got {phase!r}")
        numbers: dict[str, float] = {}
        for field in ("rate", "latency", "ceiling"):
            value = state.get(field)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"the concurrency state's {field!r} should be a positive "
                                 f"number or None, but got {value!r}")
            numbers[field] = 0.0 if value is None else float(value)
        throttles = state.get("throttles", 0)
        if isinstance(throttles, bool) or not isinstance(throttles, int) or throttles < 0:
            raise ValueError(f"the concurrency state's 'throttles' should be a non-negative "
                             f"integer, but got {throttles!r}")
        self.limit = max(self.minimum, min(self.maximum, limit))
        self._recorded = self.limit
        self.phase = phase
        self.throttles = throttles
        self._rate = self._best = numbers["rate"] / 1e9
        self._unloaded.clear()
        if numbers["latency"]:
            self._unloaded.append(numbers["latency"] * 1e9)
        self._ceiling = numbers["ceiling"] / 1e9 or None
        self._ceiling_until = None  # its hold starts with the first round
        self._start = None
        self._latencies.clear()
        self._round = max(_MIN_ROUND, self.limit)
        self._draining = self.measuring = self._probing = False
        self._episode = []
        if self.on_change is not None:
            self.on_change(self.limit)

    def snapshot(self) -> dict[str, Any]:
        """What ``stats()`` shows: the limit, its bounds, the phase, the estimates and the
        history of notable changes."""
        return {**self.state_dict(), "maximum": self.maximum,
                "history": [list(entry) for entry in self.history]}

    @property
    def held(self) -> str | None:
        """What holds the limit below its maximum: ``"ceiling"`` (the store throttled),
        ``"knee"`` (more in flight only queued), or None (startup, or at the maximum)."""
        if self.limit >= self.maximum or self.phase == "startup":
            return None
        return "ceiling" if self._ceiling is not None else "knee"


@dataclass
class ReadTuning:
    """What one source's remote reads share to tune themselves: the controller of its shards
    read at once (``concurrency="auto"``) and the hedger of its late first bytes
    (``hedge``); either may be None. Throttling answers and hedges are counted in the
    source's statistics."""

    tuner: Controller | None = None
    hedger: Hedger | None = None


def _busiest(times: list[int], low: int, high: int, width: int) -> int:
    """The most of ``times`` (sorted) in one of the stretches of ``width`` that cut
    ``[low, high]`` (the last one only if at least half as long; the whole when shorter)."""
    inside = [t for t in times if low <= t <= high]
    if high - low <= width:
        return len(inside)
    best = count = 0
    edge = low + width
    for t in inside:
        while t > edge:
            best, count, edge = max(best, count), 0, edge + width
        count += 1
    if high - (edge - width) >= width / 2:
        best = max(best, count)
    return best


class Hedger:
    """When a read whose first byte is late gets a second request (see the module).

    :meth:`record` each first byte's latency; :meth:`delay` says after how long a read would
    be hedged (None: not now, during the first ``warmup`` reads of an ``"auto"`` hedger);
    :meth:`spend` takes one hedge from the budget, which every read adds ``share`` of a hedge
    to (starting from none), so hedges never exceed ``share`` of the reads.

    Args:
        after: a fixed delay in seconds, or None for the ``percentile`` of recent first-byte
            latencies (``"auto"``).
        share: the most extra requests, as a share of the reads.
        percentile: which of the recent first-byte latencies a read is late beyond.
        warmup: reads before an ``"auto"`` hedger hedges.
    """

    __slots__ = ("_after", "_budget", "_fresh", "_percentile", "_ring", "_threshold",
                 "_warmup", "hedged", "reads", "share", "won")

    def __init__(self, after: float | None = None, *, share: float = 0.05,
                 percentile: float = 0.95, warmup: int = 20) -> None:
        self._after = after
        self.share = share
        self._percentile = percentile
        self._warmup = warmup
        self._ring: deque[int] = deque(maxlen=256)
        self._threshold: float | None = after
        self._fresh = 0  # latencies recorded since the threshold was computed
        self._budget = 0.0
        self.reads = 0  #: reads started
        self.hedged = 0  #: second requests started
        self.won = 0  #: second requests that answered first

    def record(self, latency: int) -> None:
        """A first byte arrived ``latency`` ns after its request was sent."""
        self._ring.append(latency)
        self._fresh += 1

    def delay(self) -> float | None:
        """A read starts now: seconds after which it would be hedged, or None (not hedged)."""
        self.reads += 1
        self._budget = min(self._budget + self.share, _HEDGE_BURST)
        if self._after is not None:
            return self._after
        if len(self._ring) < self._warmup:
            return None
        if self._threshold is None or self._fresh >= 16:
            ordered = sorted(self._ring)
            self._threshold = ordered[min(len(ordered) - 1,
                                          int(self._percentile * len(ordered)))] / 1e9
            self._fresh = 0
        return self._threshold

    def spend(self) -> bool:
        """Whether the budget allows a hedge now (taking it if so)."""
        if self._budget < 1.0:
            return False
        self._budget -= 1.0
        self.hedged += 1
        return True
