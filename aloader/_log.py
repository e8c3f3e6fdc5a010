"""Logging: aloader prints nothing; it logs to ``logging.getLogger("aloader")`` and children.

The loggers: ``aloader.loader`` (skipped samples, a slow first batch, a failure budget
exceeded), ``aloader.workers`` (worker deaths and restarts), ``aloader.http`` (HTTP retries),
``aloader.sources`` (a shard a rank leaves out of an epoch, as ``even_ranks=True`` asks).
Like any library's, ``aloader`` has only a :class:`logging.NullHandler`, so that nothing is
printed (not even by Python's last-resort handler) until the application configures logging:
``logging.basicConfig(level=logging.INFO)`` shows them all.

A flood of failures must not flood the log: :class:`RateLimited` logs the first ``first``
events of its kind, then one summary line at most every ``every`` seconds.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ("SLOW_FIRST_BATCH", "RateLimited", "brief", "http_log", "loader_log", "source_log",
           "worker_log")

logging.getLogger("aloader").addHandler(logging.NullHandler())

loader_log = logging.getLogger("aloader.loader")
worker_log = logging.getLogger("aloader.workers")
http_log = logging.getLogger("aloader.http")
source_log = logging.getLogger("aloader.sources")

# A first batch slower than this (seconds) is logged as a warning: a cold start or a stall.
SLOW_FIRST_BATCH = 10.0


def brief(error: BaseException) -> str:
    """``Type: message`` on one line; for an error carrying a traceback in its message (a
    worker's), the traceback's last line, which is that."""
    text = str(error)
    if "\n" in text:
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class RateLimited:
    """Log the first ``first`` events in full, then a summary at most every ``every`` seconds.

    Safe from any thread (fetch threads report failures). The summary says how many events
    were not logged since the last line, and the last of them.

    Args:
        logger: where to log.
        first: events logged in full.
        every: seconds between two summary lines after that.
        clock: the clock (tests pass their own).
    """

    def __init__(self, logger: logging.Logger, *, first: int = 10, every: float = 30.0,
                 clock: object = time.monotonic) -> None:
        self.logger = logger
        self.first = first
        self.every = every
        self._clock = clock
        self._lock = threading.Lock()
        self.events = 0
        self._unlogged = 0
        self._last_summary = 0.0

    def log(self, level: int, message: str, *args: object, summary: str) -> None:
        """Log one event: ``message % args`` while under ``first``, else maybe a summary.

        ``summary`` is formatted with ``count`` (events not logged since the last line) and
        ``last`` (the last event's message).
        """
        if not self.logger.isEnabledFor(level):
            with self._lock:
                self.events += 1
            return
        with self._lock:
            self.events += 1
            if self.events <= self.first:
                full = True
            else:
                full = False
                self._unlogged += 1
                now = self._clock()  # type: ignore[operator]
                if self.events == self.first + 1:
                    self._last_summary = now
                if now - self._last_summary < self.every and self.events != self.first + 1:
                    return
                self._last_summary = now
                count, self._unlogged = self._unlogged, 0
        if full:
            self.logger.log(level, message, *args)
        else:
            self.logger.log(level, summary, {"count": count, "last": message % args})
