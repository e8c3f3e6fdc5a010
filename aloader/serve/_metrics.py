"""What :meth:`Batcher.metrics` reports: the plain dicts it returns and the recorder behind them."""

from __future__ import annotations

import math
from collections import deque
from typing import TypedDict

from ._request import _Request

__all__ = ("BatcherMetrics", "LatencySummary", "_BatcherMetricsRecorder")


class LatencySummary(TypedDict):
    """Percentiles, in seconds, over the most recent samples (``None`` before any sample)."""

    count: int
    p50: float | None
    p99: float | None
    max: float | None


class BatcherMetrics(TypedDict):
    """The plain dict :meth:`Batcher.metrics` returns."""

    submitted: int
    """Requests admitted to the queue."""
    completed: int
    """Requests answered with a result."""
    failed: int
    """Requests answered with an exception (batch error, per-item error, closed)."""
    rejected: int
    """Requests refused with :class:`QueueFullError`."""
    timed_out: int
    """Requests whose caller's timeout expired (queued or running)."""
    cancelled: int
    """Requests whose caller left before its answer (queued or running): cancelled,
    interrupted, or a stream closed before its end."""
    dropped: int
    """Requests dropped from the queue because their ``queue_timeout`` passed before their
    batch started (their callers got :class:`BatcherTimeoutError`)."""
    queued: int
    """Requests waiting in the queue now."""
    running_batches: int
    """Batches being executed now."""
    batches: int
    """Batches executed so far."""
    batch_size_histogram: dict[int, int]
    """Batch size -> number of batches of that size."""
    queue_wait: LatencySummary
    """Time from admission to the start of the request's batch."""
    execution: LatencySummary
    """Time the batch function took, per batch (collate included)."""



def _summary(samples: deque[float]) -> LatencySummary:
    if not samples:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(samples)
    n = len(ordered)

    def rank(q: float) -> float:
        # Nearest-rank percentile: the smallest sample with at least q of the samples <= it.
        return ordered[max(0, math.ceil(q * n) - 1)]

    return {"count": n, "p50": rank(0.50), "p99": rank(0.99), "max": ordered[-1]}


class _BatcherMetricsRecorder:
    """What :meth:`Batcher.metrics` reports, recorded as the batcher works.

    Records the request counters (``submitted``, ``completed``, ``failed``, ``rejected``,
    ``timed_out``, ``cancelled``, ``dropped``: the batcher adds to them directly, an int
    increment each on the hot path), the batches and their sizes (:meth:`batch_started`), and
    the two latency windows: each request's queue wait and each batch's execution time, the most
    recent ``window`` samples of each (bounded deques: memory grows with the work up to that
    bound).

    Thread-safety: none needed, none given. It is written on the batcher's event loop only;
    :meth:`snapshot` reads it there too (from another thread a snapshot could be torn).

    Cost: O(1) per request and per batch item; :meth:`snapshot` sorts the windows,
    O(window log window).
    """

    __slots__ = (
        "batches", "cancelled", "completed", "dropped", "execution", "failed", "queue_waits",
        "rejected", "size_hist", "submitted", "timed_out",
    )  # fmt: skip

    def __init__(self, window: int) -> None:
        self.submitted = 0
        self.completed = 0
        self.failed = 0
        self.rejected = 0
        self.timed_out = 0
        self.cancelled = 0
        self.dropped = 0
        self.batches = 0
        self.size_hist: dict[int, int] = {}
        self.queue_waits: deque[float] = deque(maxlen=window)
        self.execution: deque[float] = deque(maxlen=window)

    def batch_started(self, start: float, batch: list[_Request]) -> None:
        """Count a batch of ``batch`` going out at ``start``, and its requests' queue waits."""
        append = self.queue_waits.append
        for request in batch:
            append(start - request.enqueued)
        n = len(batch)
        self.batches += 1
        self.size_hist[n] = self.size_hist.get(n, 0) + 1

    def batch_ended(self, seconds: float) -> None:
        """Record a batch's execution time (answered, failed or cancelled alike)."""
        self.execution.append(seconds)

    def snapshot(self, queued: int, running_batches: int) -> BatcherMetrics:
        """The metrics now, as a new dict; ``queued`` and ``running_batches`` are the
        batcher's current state."""
        return {
            "submitted": self.submitted,
            "completed": self.completed,
            "failed": self.failed,
            "rejected": self.rejected,
            "timed_out": self.timed_out,
            "cancelled": self.cancelled,
            "dropped": self.dropped,
            "queued": queued,
            "running_batches": running_batches,
            "batches": self.batches,
            "batch_size_histogram": dict(sorted(self.size_hist.items())),
            "queue_wait": _summary(self.queue_waits),
            "execution": _summary(self.execution),
        }


# Counts are refused above sys.maxsize: no container could hold that many, so the batcher
