"""Per-stage statistics of an epoch, and the bottleneck verdict derived from them.

Every epoch collects (there is no switch: collection is cheap enough to leave on). A
:class:`Collector` belongs to one epoch; the pipeline records into it with a
``time.perf_counter_ns()`` pair per job (per item only where items are fetched one by one),
into plain ints and a bounded ring of recent latencies per stage, so its memory is bounded
whatever the epoch's length. :meth:`DataLoader.stats` takes a :class:`LoaderStats` snapshot of
the current or last epoch.

The stages:

* ``sampling``: the sampler producing a key (an index batch);
* ``fetch``: one fetch call (an item fetched alone, or a batch); with worker processes, the
  workers' fetches, which each worker reports every few answers and with its last;
* ``collate``: ``collate_fn`` (and ``pin_memory``) on one batch, here or in a worker;
* ``transfer``: a batch's trip from a worker to the loader (encoding, the socket, decoding);
* ``wait``: the consumer waiting in ``__anext__`` for a batch (the loader's delay as it feels);
* ``consumer``: the consumer's time between two batches (its own work).

Two bounded buffers are watched: fetches in flight against their limit, a time-weighted mean
(by Little's law, the fetches' busy time over the epoch's; with workers, measured as the
batches at the workers change) and ready batches against ``prefetch_factor`` (sampled each
time the consumer gets a batch: the others left ready).

Recording is a bare list append, from any thread, without a lock: an append is atomic (under
the GIL, and per list on free-threaded builds). Folding (a flush, a worker's report merged, a
snapshot) holds the collector's lock, against another fold, and removes exactly the prefix of
each list it read, so an append racing with it is kept for the next fold: the counts are exact.
Busy time is the sum of the latencies (overlapping fetches add up, so a stage's busy time may
exceed the wall time).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from operator import sub
from typing import TYPE_CHECKING, Any

from ._exceptions import RecordError
from ._util import usable_cpus

if TYPE_CHECKING:
    from ._epoch_setup import EpochSetup

__all__ = (
    "Collector",
    "LoaderStats",
    "Occupancy",
    "SourceStats",
    "Stage",
    "StageStats",
    "verdict",
)

_RING = 1024  # latencies kept per stage for the percentiles (the most recent ones)
# Fold the appends every 32 batches: a stage fetched item by item appends an int per item, and
# kept for 1024 batches those (~40 bytes each) outgrew a core's cache within an io epoch.
_FLUSH = 31
_REPORT = 64  # latencies a worker sends per stage with one answer, at most
STAGES = ("sampling", "fetch", "collate", "transfer", "wait", "consumer")

_now = time.perf_counter_ns


class Stage:
    """One stage's count, busy time and recent latencies (nanoseconds).

    ``add(ns)`` is a bare list append (the hot path, per item where items are fetched one by
    one; from any thread); :meth:`flush` folds what was added into the count, the busy time
    and the ring of recent latencies (between ``_RING`` and ``2 * _RING`` of them), removing
    only what it folded (see the module docstring). The collector flushes every few batches
    and before a snapshot, so what waits to be folded stays bounded; its folds hold its lock.
    """

    __slots__ = ("add", "busy", "count", "pending", "ring")

    def __init__(self) -> None:
        self.count: int = 0
        self.busy: int = 0
        self.ring: list[int] = []
        self.pending: list[int] = []
        self.add: Callable[[int], None] = self.pending.append

    def flush(self) -> None:
        folded = _take(self.pending)
        if folded:
            self.count += len(folded)
            self.busy += sum(folded)
            ring = self.ring
            ring.extend(folded)
            if len(ring) > 2 * _RING:
                del ring[: len(ring) - _RING]

    def merge(self, count: int, busy: int, latencies: list[int]) -> None:
        """Add a worker's report: ``count`` latencies summing to ``busy``, some of them."""
        self.flush()
        self.count += count
        self.busy += busy
        self.ring.extend(latencies)
        if len(self.ring) > 2 * _RING:
            del self.ring[: len(self.ring) - _RING]

    def snapshot(self, name: str) -> StageStats:
        self.flush()
        ring = sorted(self.ring[-_RING:])

        def pct(q: float) -> float:
            if not ring:
                return 0.0
            return ring[min(len(ring) - 1, int(q * len(ring)))] / 1e9

        return StageStats(name, self.count, self.busy / 1e9, pct(0.5), pct(0.9), pct(0.99))


def _take(pending: list[Any]) -> list[Any]:
    """The items of ``pending``, removed from it (an append racing with this stays)."""
    n = len(pending)
    taken = pending[:n]
    del pending[:n]
    return taken


class Occupancy:
    """A level that changes over time (fetches in flight), and its time-weighted mean."""

    __slots__ = ("area", "last", "level", "peak", "start")

    def __init__(self) -> None:
        self.level: int = 0
        self.peak: int = 0
        self.area: int = 0
        self.start: int = _now()
        self.last: int = self.start

    def change(self, delta: int, now: int) -> None:
        if now > self.last:
            self.area += self.level * (now - self.last)
            self.last = now
        self.level += delta
        if self.level > self.peak:
            self.peak = self.level

    def mean(self, now: int) -> float:
        span = now - self.start
        if span <= 0:
            return float(self.level)
        return (self.area + self.level * max(0, now - self.last)) / span


@dataclass(frozen=True)
class StageStats:
    """One stage of an epoch (see :mod:`aloader._stats`): times in seconds.

    Attributes:
        name: ``sampling``, ``fetch``, ``collate``, ``transfer``, ``wait`` or ``consumer``.
        count: calls (jobs, or items where items are fetched one by one).
        busy: the sum of their durations.
        p50, p90, p99: latency percentiles of the recent calls (the last 1024).
    """

    name: str
    count: int
    busy: float
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of one epoch's statistics (:meth:`DataLoader.stats`).

    Attributes:
        epoch: the loader's epoch number (0 for the first).
        running: whether the epoch is still under way.
        elapsed: seconds from the epoch's start to its last batch (or to now).
        items: samples collated into batches (after an epoch left early, this includes the
            few batches prefetched and never delivered).
        batches: batches delivered (to the ``for`` facade's loop, which may be a batch or two
            ahead of the code consuming it).
        failures: samples that failed within the failure budget (once it is exceeded, the
            count its :class:`~aloader.FailureBudgetExceeded` names).
        items_per_second: ``items / elapsed``.
        mode: how the epoch fetched: ``async``, ``inline``, ``thread`` or ``process``.
        kind: ``map`` (a map-style dataset) or ``iterable``.
        stages: the stages, by name (see :mod:`aloader._stats`).
        in_flight: fetches in flight, time-weighted mean.
        in_flight_limit: the most fetches allowed in flight (``max_concurrency``, or jobs).
        ready: batches left ready once the consumer took one, mean (at most
            ``ready_limit - 1``: near it, the consumer is the slower side; near 0, the loader).
        ready_limit: the most batches allowed to wait (``prefetch_factor``).
        fetch_cpu: seconds of CPU the fetch threads used (synchronous datasets in threads).
        first_wait: seconds the consumer waited for the first batch (the start-up, which the
            verdict leaves out).
        workers: per worker process: ``{"batches": n, "busy": seconds}``.
        sources: the streaming sources' counters (records, bytes, retries, skipped...; with
            ``cache_dir``, also cache_hits, cache_misses, cache_bytes, cache_evicted and
            cache_corrupt),
            cumulative over the loader's epochs, each epoch's content counted once (an epoch
            interrupted and continued, or resumed by this loader from its own state, counts
            what the uninterrupted one does; see :class:`~aloader.SourceStats`).
        throttled: fetches the dataset (or a source) was throttled on (:class:`~aloader.Throttled`,
            HTTP 429 or 503): waited for and made again, not failures.
        hedged: second fetches started for fetches that were late (``hedge_after``).
        concurrency: with ``max_concurrency="auto"``, the controller: ``limit`` (fetches
            allowed in flight now), ``maximum`` (``max_concurrency_limit``), ``phase``
            (``"startup"`` or ``"steady"``), ``rate`` (items/s) and ``latency`` (seconds) it
            estimated the store's from, the ``ceiling`` (items/s) a throttling store set, and
            ``history``, its notable changes as ``[seconds, limit, why]``; with worker
            processes, ``workers`` holds each worker's own and ``limit`` is their sum. None
            with a fixed ``max_concurrency``.
        bottleneck: the limiting stage, in one sentence with the change that would help.
        cores: the CPUs this process may run on (0: unknown): the verdict never advises more
            worker processes than that.
        in_order: whether batches are delivered in the sampler's order (``in_order``).
    """

    epoch: int
    running: bool
    elapsed: float
    items: int
    batches: int
    failures: int
    items_per_second: float
    mode: str
    kind: str
    stages: dict[str, StageStats]
    in_flight: float
    in_flight_limit: int
    ready: float
    ready_limit: int
    fetch_cpu: float
    first_wait: float = 0.0
    workers: list[dict[str, float]] = field(default_factory=list)
    sources: list[dict[str, int]] = field(default_factory=list)
    throttled: int = 0
    hedged: int = 0
    concurrency: dict[str, Any] | None = None
    bottleneck: str = ""
    cores: int = 0
    in_order: bool = True

    def as_dict(self) -> dict[str, Any]:
        """The snapshot as JSON-serialisable builtins (dicts, lists, str, int, float, bool)."""
        return asdict(self)

    def table(self) -> str:
        """The per-stage table and the verdict, as printed by the demo and ``profile``."""
        lines = [f"{'stage':<10} {'count':>8} {'busy s':>8} {'p50 ms':>8} {'p90 ms':>8} "
                 f"{'p99 ms':>8}"]
        for stage in self.stages.values():
            if stage.count:
                lines.append(f"{stage.name:<10} {stage.count:>8} {stage.busy:>8.3f} "
                             f"{stage.p50 * 1e3:>8.2f} {stage.p90 * 1e3:>8.2f} "
                             f"{stage.p99 * 1e3:>8.2f}")
        auto = "" if self.concurrency is None else " (auto)"
        lines.append(f"{self.items} items, {self.batches} batches, {self.failures} failed, "
                     f"{self.items_per_second:,.0f} items/s in {self.elapsed:.2f} s; "
                     f"in flight {self.in_flight:.1f} of {self.in_flight_limit}{auto}, ready "
                     f"{self.ready:.1f} of {self.ready_limit}")
        if self.throttled or self.hedged:
            lines.append(f"throttled {self.throttled}, hedged {self.hedged}")
        lines.append(f"bottleneck: {self.bottleneck}")
        return "\n".join(lines)


class Collector:
    """What one epoch records (see the module docstring); the pipeline's hooks call it.

    Args:
        mode: the plan's fetch mode.
        kind: ``map`` (a map-style dataset) or ``iterable``.
        auto_batch: whether what is collated is a batch of samples (else one sample).
        in_flight_limit: the most fetches in flight.
        ready_limit: the most batches waiting for the consumer.
        epoch: the loader's epoch number.
        num_workers: worker processes (0: none).
        sources: the counters of the dataset's streams, read at each snapshot.
        in_order: whether batches are delivered in the sampler's order.
    """

    def __init__(self, mode: str = "inline", in_flight_limit: int = 1, ready_limit: int = 1,
                 epoch: int = 0, num_workers: int = 0, kind: str = "map",
                 auto_batch: bool = True, sources: Iterable[Any] = (),
                 in_order: bool = True) -> None:
        self.mode: str = mode
        self.in_order: bool = in_order
        self.kind: str = kind
        self.auto_batch: bool = auto_batch
        self.in_flight_limit: int = in_flight_limit
        self.ready_limit: int = ready_limit
        self.epoch: int = epoch
        self.sampling: Stage = Stage()
        self.fetch: Stage = Stage()
        self.collate: Stage = Stage()
        self.transfer: Stage = Stage()
        self.wait: Stage = Stage()
        self.consumer: Stage = Stage()
        self.in_flight: Occupancy = Occupancy()
        self.lock: threading.Lock = threading.Lock()
        # Samples collated into batches (here, or reported by workers): the folded count, and
        # the batches' sizes appended since (any thread).
        self.items: int = 0
        self._collated: list[tuple[int, int]] = []  # (ns, samples) of each batch collated
        # (asked, got, others ready) of each batch delivered, since the last fold
        self._marks: list[tuple[int, int, int]] = []
        self._marked_last: int | None = None  # the got of the last mark folded
        self._cpu: list[int] = []  # ns of CPU of each fetch in a thread, since the last fold
        self.batches: int = 0
        self.delivered_items: int = 0
        self.ready_sum: int = 0
        self.first_wait: int = 0
        self.fetch_cpu: int = 0  # ns of CPU in fetch threads (folded)
        self.workers: list[list[int]] = [[0, 0] for _ in range(num_workers)]
        self.started: int = _now()
        self.last: int = self.started  # the last batch delivered
        self.ended: int | None = None
        # Samples failed within the failure budget, counted by the epoch's Failures (which
        # this does not hold: its errors' tracebacks would tie the loader to their frames).
        self.failed: int = 0
        self.sources: list[Any] = list(sources)  # the streams' SourceStats
        self.throttled: int = 0  # fetches throttled (waited for and made again)
        self.hedged: int = 0  # second fetches started for late ones
        self.tuner: Any = None  # the Controller of "auto" concurrency, or None
        self.worker_tuning: dict[int, dict[str, Any]] = {}  # each worker's, as reported
        self._last_tuning: dict[str, Any] | None = None
        # A worker's: what was reported already (see report()).
        self._reported: dict[str, tuple[int, int]] = {}

    @classmethod
    def for_epoch(cls, setup: EpochSetup, mode: str, in_flight_limit: int,
                  auto_batch: bool, tuner: Any = None) -> Collector:
        """The statistics of the epoch ``setup`` describes, whose plan fetches in ``mode``
        with at most ``in_flight_limit`` fetches in flight (with ``tuner``, ``"auto"``
        concurrency's controller, as many as it allows)."""
        stats = cls(mode, in_flight_limit, max(1, setup.prefetch_factor), setup.stats_epoch,
                    setup.num_workers, setup.kind, auto_batch, setup.sources, setup.in_order)
        stats.tuner = tuner
        return stats

    def __reduce__(self) -> tuple[Any, ...]:  # a plan's travels to the workers: a fresh one
        return (Collector, (self.mode, self.in_flight_limit, self.ready_limit, 0, 0, self.kind,
                            self.auto_batch, (), self.in_order))

    def _fold(self) -> None:
        """Fold what was appended (the caller holds the lock; see the module docstring).

        A batch collated or delivered is one append of a tuple; here they become the collate,
        wait and consumer latencies (in C: ``zip``, ``map``), and the items.
        """
        collated = _take(self._collated)
        if collated:
            latencies, sizes = zip(*collated, strict=True)
            self.collate.pending.extend(latencies)
            self.items += sum(sizes)
        marks = _take(self._marks)
        if marks:
            asked, got, ready = zip(*marks, strict=True)
            if not self.batches:
                self.first_wait = got[0] - asked[0]
            self.batches += len(marks)
            self.ready_sum += sum(ready)
            self.last = got[-1]
            self.wait.pending.extend(map(sub, got, asked))
            # The consumer's time: from each batch to the next ask (after the first batch).
            before = got[:-1] if self._marked_last is None else (self._marked_last, *got[:-1])
            self.consumer.pending.extend(map(sub, asked[len(asked) - len(before):], before))
            self._marked_last = got[-1]
        cpu = _take(self._cpu)
        if cpu:
            self.fetch_cpu += sum(cpu)
        for name in STAGES:
            getattr(self, name).flush()

    # Hooks (each one call per job, or per item where items are fetched one by one; appends
    # only, from any thread) -----------------------------------------------------------------
    def flush(self) -> None:
        with self.lock:
            self._fold()

    def collated(self, samples: Any, ns: int) -> None:
        # A batch is any sequence (__getitems__ may return a tuple or an array), one sample
        # is one item whatever its type.
        try:
            self._collated.append((ns, len(samples) if self.auto_batch else 1))
        except TypeError:  # an unsized batch (a generator from __getitems__): one item known
            self._collated.append((ns, 1))

    collated_in_thread = collated  # appends need no lock

    def fetched_in_thread(self, ns: int, cpu: int) -> None:
        self.fetch.add(ns)
        self._cpu.append(cpu)

    def delivered(self, asked: int, now: int, ready: int) -> None:
        """The consumer, back at ``asked`` (ns), got a batch at ``now`` with ``ready`` others
        ready: one append (the fold counts the batches, sums the ready ones, keeps the last)."""
        marks = self._marks
        marks.append((asked, now, ready))
        if len(marks) > _FLUSH:
            self.flush()

    def asked_again(self, asked: int) -> None:
        """The consumer asked after its last batch and the epoch had ended."""
        self.flush()
        if self.batches:
            self.consumer.add(asked - self.last)

    def items_so_far(self) -> int:
        """The items collated so far, folded or not (for a live progress line; any thread)."""
        return self.items + sum(size for _, size in list(self._collated))

    # Worker processes -------------------------------------------------------------------------
    def last_worker_tuning(self) -> dict[str, Any] | None:
        """The ``"auto"`` controller a worker process reported last (its snapshot), or None."""
        return self._last_tuning

    def report(self, tuner: Any = None) -> tuple[Any, ...]:
        """A worker's stages since its last report (a worker sends one every few answers),
        with its throttled and hedged fetches and its controller's snapshot (``tuner``)."""
        with self.lock:
            self._fold()
        out = []
        for name in ("fetch", "collate"):
            stage: Stage = getattr(self, name)
            count, busy = self._reported.get(name, (0, 0))
            new = stage.count - count
            recent = min(new, _REPORT)
            latencies = stage.ring[len(stage.ring) - recent:] if recent else []
            out.append((new, stage.busy - busy, latencies))
            self._reported[name] = (stage.count, stage.busy)
        items = self.items - self._reported.get("items", (0, 0))[0]
        self._reported["items"] = (self.items, 0)
        throttled, hedged = self._reported.get("tuning", (0, 0))
        self._reported["tuning"] = (self.throttled, self.hedged)
        tuning = None if tuner is None else tuner.snapshot()
        return (out[0], out[1], items, self.throttled - throttled, self.hedged - hedged, tuning)

    def merge(self, worker_id: int, report: tuple[Any, ...]) -> None:
        """Add a worker's :meth:`report` (the loader's side)."""
        fetch, collate, items, throttled, hedged, tuning = report
        with self.lock:
            self.fetch.merge(*fetch)
            self.collate.merge(*collate)
            self.items += items
            self.throttled += throttled
            self.hedged += hedged
            if tuning is not None:
                self.worker_tuning[worker_id] = self._last_tuning = tuning
        if worker_id < len(self.workers):
            slot = self.workers[worker_id]
            slot[0] += collate[0]  # an answer without a batch (a replica's end) has none
            slot[1] += fetch[1] + collate[1]

    def transferred(self, sent: int) -> None:
        """A batch a worker sent at ``sent`` (``perf_counter_ns``) has arrived (the loader's
        side; every batch, whether or not its answer carried a report)."""
        self.transfer.add(max(0, _now() - sent))

    # The snapshot -----------------------------------------------------------------------------
    def snapshot(self) -> LoaderStats:
        end = self.ended if self.ended is not None else _now()
        with self.lock:
            self._fold()  # first: it sets the last batch's time
            stages = {name: getattr(self, name).snapshot(name) for name in STAGES}
        last = self.last if self.ended is not None else end
        elapsed = max(1e-9, (last - self.started) / 1e9)
        if self.mode == "process":
            in_flight = self.in_flight.mean(last)
        else:  # Little's law: the mean number in flight is their busy time over the time
            cap = self.in_flight_limit if self.tuner is None else self.tuner.maximum
            in_flight = min(self.fetch.busy / 1e9 / elapsed, float(cap))
        sources = [_source_counts(source) for source in self.sources]
        limit = self.in_flight_limit
        concurrency = None
        if self.tuner is not None:
            concurrency = self.tuner.snapshot()
            limit = concurrency["limit"]
        elif self.worker_tuning:  # auto in each worker process
            workers = [self.worker_tuning[key] for key in sorted(self.worker_tuning)]
            concurrency = {"limit": sum(w["limit"] for w in workers),
                           "maximum": sum(w["maximum"] for w in workers), "workers": workers}
        stats = LoaderStats(
            epoch=self.epoch,
            running=self.ended is None,
            elapsed=elapsed,
            items=self.items,
            batches=self.batches,
            failures=self.failed,
            items_per_second=self.items / elapsed,
            mode=self.mode,
            kind=self.kind,
            stages=stages,
            in_flight=in_flight,
            in_flight_limit=limit,
            ready=self.ready_sum / self.batches if self.batches else 0.0,
            ready_limit=self.ready_limit,
            fetch_cpu=self.fetch_cpu / 1e9,
            first_wait=self.first_wait / 1e9,
            workers=[{"batches": b, "busy": busy / 1e9} for b, busy in self.workers],
            sources=sources,
            throttled=self.throttled,
            hedged=self.hedged,
            concurrency=concurrency,
            cores=usable_cpus()[0] or 0,
            in_order=self.in_order,
        )
        return _with_verdict(stats)


def _with_verdict(stats: LoaderStats) -> LoaderStats:
    from dataclasses import replace

    return replace(stats, bottleneck=verdict(stats))


def _workers_advice(stats: LoaderStats, verb: str = "use") -> str:
    """The advice to run (more) worker processes, never beyond the cores this process may
    use: ``use num_workers (up to N, the cores here)``, or that the CPU is the limit."""
    workers, cores = len(stats.workers), stats.cores
    if not cores:
        return f"{verb} num_workers"
    if workers >= cores or cores == 1:
        return (f"the CPU is the limit: {workers or 1} process{'es' if workers > 1 else ''} "
                f"on {cores} core{'s' if cores > 1 else ''}; make each sample cheaper to load, "
                "or use a machine with more cores")
    return f"{verb} num_workers (up to {cores}, the cores here)"


def _stragglers(stats: LoaderStats, waited: float) -> str | None:
    """The verdict for a few slow fetches holding back the batches behind them, if that is
    what the measurements show: batches delivered in order, fetch latencies with a long tail
    (p99 at least 10x p50), the fetches far from their limit (the window stands still
    behind its slowest fetch) and the consumer waiting."""
    fetch = stats.stages["fetch"]
    limit = stats.in_flight_limit
    if (not stats.in_order or stats.mode not in ("async", "thread") or limit < 2
            or stats.kind == "iterable" or fetch.count < 20):
        return None
    if fetch.p99 < 10 * fetch.p50 or fetch.p99 < 1e-3:
        return None
    if stats.in_flight >= 0.5 * limit or waited < 0.25:
        return None
    return (f"stragglers: a few slow fetches (p99 {fetch.p99 * 1e3:.0f} ms, p50 "
            f"{fetch.p50 * 1e3:.1f} ms) hold back the batches behind them ({stats.in_flight:.1f} "
            f"of {limit} fetches in flight); pass in_order=False to deliver each batch as soon "
            f"as it is ready, if their order does not matter; the consumer waited "
            f"{waited:.0%} of the time")


def verdict(stats: LoaderStats) -> str:
    """The limiting stage of an epoch, in one sentence with the change that would help.

    Derived from the measurements, in this order: a consumer that never waits is the
    bottleneck; else (the consumer waits for the loader) one worker much slower than the
    others; a few slow fetches holding back the batches behind them (``in_order=False``);
    with ``max_concurrency="auto"``, the store's rate limit (throttling) or its knee; a
    map-style dataset's fetches filling their limit; ``collate_fn`` busy most of the time; a
    synchronous dataset busy on the CPU (the GIL); an iterable dataset's iterator busy most
    of the time (one pull at a time: no limit to raise); a map-style dataset blocking one
    call at a time; the transfer from the workers; the workers all busy; else the busiest
    stage. Advice to use worker processes never goes beyond the cores the process may run
    on (``stats.cores``): with as many workers as cores, it says the CPU is the limit.
    """
    if stats.batches == 0:
        return "no batch delivered yet"
    # The steady state: the wait for the first batch (workers starting, a cold cache) aside.
    first_wait = stats.first_wait
    elapsed = max(1e-9, stats.elapsed - first_wait)
    stages = stats.stages
    waited = (stages["wait"].busy - first_wait) / elapsed
    # The consumer's own work is most of the epoch, start included (not of a steady state
    # made short by a source that delivered every batch at once), and it seldom waited.
    consumer = stages["consumer"].busy / max(1e-9, stats.elapsed)
    if waited < 0.1 and consumer > 0.5:
        return (f"the consumer: batches are ready before you ask (the loader is not the "
                f"bottleneck; you waited {waited:.0%} of the time)")
    workers = [w for w in stats.workers if w["batches"]]
    if len(workers) >= 2:
        per = sorted((w["busy"] / w["batches"], i) for i, w in enumerate(stats.workers)
                     if w["batches"])
        slowest, worker = per[-1]
        others = [t for t, _ in per[:-1]]
        typical = others[len(others) // 2]
        # Much slower per batch than the others, and busy most of the steady state (so the
        # consumer waits on it): not a worker that took one slow batch of a quick epoch.
        if slowest > 3 * typical and stats.workers[worker]["busy"] >= 0.5 * elapsed:
            return (f"one slow worker: worker {worker} takes {slowest * 1e3:.0f} ms per batch, "
                    f"the others {typical * 1e3:.0f} ms; look at what it loads (its shards, "
                    "its samples) or at its host")
    stragglers = _stragglers(stats, waited)
    if stragglers is not None:
        return stragglers
    limit = stats.in_flight_limit
    busiest = max(("fetch", "collate", "transfer", "sampling"),
                  key=lambda name: stages[name].busy)
    iterable = stats.kind == "iterable" and stats.mode != "process"
    auto = _auto_verdict(stats, waited)
    if auto is not None:
        return auto
    if stats.mode == "async" and not iterable and limit and stats.in_flight >= 0.75 * limit:
        return (f"fetch latency: {stats.in_flight:.0f} of {limit} fetches in flight, raise "
                "max_concurrency")
    collate = stages["collate"].busy / elapsed
    if collate >= 0.5 and stats.mode != "process":
        advice = _workers_advice(stats, "pass")
        return (f"collate: {collate:.0%} of one core, {advice} or a cheaper collate_fn"
                if advice.startswith("pass") else f"collate: {collate:.0%} of one core; "
                f"{advice}, or a cheaper collate_fn")
    fetch = stages["fetch"].busy / elapsed
    # CPU per second of fetching: near 1 for a dataset computing (holding the GIL), near 0
    # for one blocked on I/O (a wake-up's microseconds per call: about 1%); on a loaded
    # machine the first drops to the thread's share of a core (10% with ten runnable threads
    # a core), so the bar is low.
    # An inline epoch's fetches are on the CPU, unless measured (a sync dataset fetched on a
    # sync ``for``'s thread, which may block as in a thread).
    threaded = stats.mode == "thread" or stats.fetch_cpu > 0
    on_cpu = stats.fetch_cpu / max(1e-9, stages["fetch"].busy) if threaded else 1.0
    if not iterable and stats.mode in ("inline", "thread") and fetch >= 0.5 and on_cpu >= 0.05:
        return (f"GIL-bound sync dataset: its fetches take {fetch:.0%} of the time, "
                f"{on_cpu:.0%} of it on the CPU in the loader's process; "
                f"{_workers_advice(stats)}")
    if iterable and fetch >= 0.5:
        # One pull at a time: more than all of the time is the first pull, in the start-up.
        return (f"the dataset's iterator: pulling its samples took {min(fetch, 1.0):.0%} of the "
                "time and "
                f"the consumer waited {waited:.0%}; make its __next__ cheaper, let it read "
                f"further ahead (a source's concurrency) or {_workers_advice(stats)}")
    if threaded and fetch >= 0.5:
        if limit <= 1:
            return ("blocking sync fetches, one batch call at a time: pass max_concurrency "
                    "to overlap them in threads, or make the dataset async")
        if stats.in_flight >= 0.75 * limit:
            return (f"fetch latency: {stats.in_flight:.0f} of {limit} fetches in flight, "
                    "raise max_concurrency")
    if stats.mode == "process":
        if stages["transfer"].busy / elapsed >= 0.5 and busiest == "transfer":
            return ("transfer from workers: batches take long to come back; return smaller "
                    "batches or numpy arrays (they cross in shared memory)")
        if stats.in_flight >= 0.75 * limit:
            advice = _workers_advice(stats, "raise")
            if advice.startswith("raise"):
                advice += " (or max_concurrency for an async dataset)"
            return (f"the workers: {stats.in_flight:.0f} of {limit} batches in flight on "
                    f"{len(stats.workers)} workers; {advice}")
    share = stages[busiest].busy / elapsed
    return (f"{busiest}: the busiest stage ({share:.0%} of the epoch's time); the consumer "
            f"waited {waited:.0%} of the time")


def _auto_verdict(stats: LoaderStats, waited: float) -> str | None:
    """What holds ``"auto"`` concurrency where fetching is the bottleneck: the store's rate
    limit, the most ``max_concurrency_limit`` allows, or the store's knee; None otherwise."""
    auto = stats.concurrency
    if auto is None or stats.kind == "iterable" or stats.stages["fetch"].busy <= 0:
        return None
    limit, maximum = auto["limit"], auto["maximum"]
    if stats.throttled and auto.get("ceiling"):
        return (f"the store's rate limit: {stats.throttled} fetches were throttled; "
                f"max_concurrency='auto' keeps {limit} in flight, under the "
                f"{auto['ceiling']:,.0f} items/s the store lets through (ask for a higher "
                "limit, or spread the reads over more stores or prefixes)")
    if stats.in_flight < 0.75 * limit:
        return None
    if limit >= maximum:
        return (f"fetch latency: {stats.in_flight:.0f} of {limit} fetches in flight, the most "
                "max_concurrency='auto' may run: raise max_concurrency_limit")
    return (f"the store: max_concurrency='auto' keeps {limit} fetches in flight, its knee "
            "(beyond it latency rose without more throughput); a faster store, more stores, "
            f"or smaller fetches would help (the consumer waited {waited:.0%} of the time)")


def _source_counts(source: Any) -> dict[str, int]:
    """A source's counters in a snapshot; its cache's only once it used a cache."""
    counts = {"shards": source.shards, "records": source.records, "bytes": source.bytes,
              "skipped": source.skipped, "retries": source.retries}
    if source.throttled or source.hedged:
        counts.update(throttled=source.throttled, hedged=source.hedged)
    if source.tuner is not None:
        counts["concurrency"] = source.tuner.limit
    if source.cache_hits or source.cache_misses:
        counts.update(cache_hits=source.cache_hits, cache_misses=source.cache_misses,
                      cache_bytes=source.cache_bytes, cache_evicted=source.cache_evicted,
                      cache_corrupt=source.cache_corrupt)
    return counts


# Errors kept for inspection when bad records are skipped (the count is exact regardless).
_KEEP_ERRORS = 100


class _RecentErrors(list[RecordError]):
    """A list that keeps only its last ``_KEEP_ERRORS`` items: appending beyond drops the
    oldest. A plain list otherwise (``len``, indexing, slicing, iteration, equality)."""

    __slots__ = ()

    def append(self, error: RecordError) -> None:
        super().append(error)
        if len(self) > _KEEP_ERRORS:
            del self[0]

    def extend(self, errors: Iterable[RecordError]) -> None:
        super().extend(errors)
        if len(self) > _KEEP_ERRORS:
            del self[: len(self) - _KEEP_ERRORS]


@dataclass
class SourceStats:
    """Counters of a source, cumulative over its epochs.

    With loader workers, each worker counts in its copy of the source and sends what it
    counted with each batch; the loader adds it to the source it holds, so the loader's
    process sees the totals of all workers: the sources of the stream the loader was given
    and of the streams it reads from (see :func:`aloader.streams._sourcestats.source_stats`), not
    those a dataset of your own holds.

    Each epoch's content counts once (records, bytes, skipped, shards, repeated): a part of
    an epoch read again (a chain reopened after a KeyboardInterrupt in a decoder or a
    transform, a shuffle or mix replaying its input, a stream resumed from a state it saved
    itself, which continues its reading) is not counted again, so an epoch interrupted and
    continued counts what the uninterrupted one does; the same epoch read again from its start
    counts again. A fresh source resumed from a state (a new loader or process) counts the
    rest of the epoch: the records from the position, the bytes and skipped records from the
    byte offset of the position's block in its shard's content. ``retries`` and the cache
    counters count the requests and reads made, those of a part read again included. The
    counts run ahead of the consumer by what the stream has read ahead. (:class:`ParquetRows`
    counts what it reads.)

    Attributes:
        shards: shards read to their end.
        records: records decoded (handed on by the source, before any transform).
        bytes: the shards' content decoded, in bytes: after decompression (of a compressed
            shard or a coded HTTP body), counted as each chunk is fed to the decoder.
        skipped: malformed records skipped because ``skip_errors=True``.
        retries: HTTP requests retried (connection errors, timeouts, 5xx): not those a
            store throttled.
        throttled: requests the store throttled (HTTP 429 and 503, S3's SlowDown), each
            waited for (its ``Retry-After``, or a backoff) and made again: not failures, and
            not counted against ``retries``.
        hedged: second requests made for reads whose first byte was late (``hedge``).
        shards_dropped: shards this rank left unread in an epoch to read as many shards as
            every other rank (``even_ranks``; one per epoch at most, counted by its worker 0
            when the epoch starts).
        repeated: records delivered again, from a new pass over a consumer's shards, to make
            up ``records_per_rank``.
        cache_hits: remote shards read from the local cache (``cache_dir``).
        cache_misses: remote shards read from their store while a cache was set (downloaded
            into it when they fit, see :mod:`aloader.io._cache`).
        cache_bytes: bytes read from the local cache.
        cache_evicted: cached shards this source's reads evicted to stay under
            ``cache_limit``.
        cache_corrupt: cached copies found damaged (a block that does not match the checksum
            recorded when it was downloaded, a wrong length, a symlink) and dropped, or
            downloads whose bytes did not match the store's checksum (not kept); their
            records came from the store instead.
        skipped_errors: the errors (:class:`~aloader.RecordError`) of the last skipped
            records, oldest first: a list of at most 100, the oldest dropped as new ones come
            (``stats.skipped_errors[-5:]``, ``len(...)``; the count is ``skipped``).
    """

    shards: int = 0
    records: int = 0
    bytes: int = 0
    skipped: int = 0
    retries: int = 0
    shards_dropped: int = 0
    repeated: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_bytes: int = 0
    cache_evicted: int = 0
    cache_corrupt: int = 0
    throttled: int = 0
    hedged: int = 0
    skipped_errors: list[RecordError] = field(default_factory=_RecentErrors)
    #: The source's ``"auto"`` concurrency controller (None: a fixed concurrency).
    tuner: Any = field(default=None, repr=False, compare=False)

    @property
    def concurrency(self) -> dict[str, Any] | None:
        """With ``concurrency="auto"``: the source's controller now, its limit of shards read
        at once, its estimates and history (as :attr:`LoaderStats.concurrency`); else None.
        With loader workers, each worker's source tunes its own reads (this one's is the
        state it started from)."""
        return None if self.tuner is None else self.tuner.snapshot()

    def counts(self) -> tuple[int, ...]:
        """The counters (shards, records, bytes, skipped, retries, shards_dropped, repeated,
        cache_hits, cache_misses, cache_bytes, cache_evicted, cache_corrupt, throttled,
        hedged), to diff against later."""
        return (self.shards, self.records, self.bytes, self.skipped, self.retries,
                self.shards_dropped, self.repeated, self.cache_hits, self.cache_misses,
                self.cache_bytes, self.cache_evicted, self.cache_corrupt, self.throttled,
                self.hedged)

    def since(self, before: tuple[int, ...]) -> tuple[Any, ...] | None:
        """What was counted since ``counts()`` returned ``before``, or None if nothing.

        Returns:
            ``(*counts, errors)``: the increments of :meth:`counts` and the
            errors of the records skipped since (the last ``_KEEP_ERRORS`` of them).
        """
        now = self.counts()
        if now == before:
            return None
        increments = tuple(a - b for a, b in zip(now, before, strict=True))
        new = min(increments[3], len(self.skipped_errors))
        errors = self.skipped_errors[len(self.skipped_errors) - new :] if new else []
        return (*increments, errors)

    def add(self, delta: tuple[Any, ...]) -> None:
        """Count what :meth:`since` returned (a worker's counts, in the loader's process)."""
        (shards, records, size, skipped, retries, dropped, repeated, hits, misses, cached,
         evicted, corrupt, throttled, hedged, errors) = delta
        self.shards += shards
        self.records += records
        self.bytes += size
        self.skipped += skipped
        self.retries += retries
        self.shards_dropped += dropped
        self.repeated += repeated
        self.cache_hits += hits
        self.cache_misses += misses
        self.cache_bytes += cached
        self.cache_evicted += evicted
        self.cache_corrupt += corrupt
        self.throttled += throttled
        self.hedged += hedged
        self.skipped_errors.extend(errors)
