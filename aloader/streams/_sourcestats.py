"""Source statistics across processes: each worker reports what its sources counted, and the
loader adds the reports to the sources it holds (see :class:`aloader.SourceStats`)."""

from __future__ import annotations

from typing import Any

from .._stats import SourceStats
from ._stream import Stream

__all__ = ("Report", "StatsReporter", "merge_stats", "source_stats")


def source_stats(dataset: object) -> list[SourceStats]:
    """The counters of every source in a stream chain, in a fixed order.

    The order (depth first over :meth:`Stream._upstreams`) is the same in the loader's process
    and in a worker's copy of the chain, so a worker's report lines up with the loader's
    sources. A source shared by several branches counts once.
    """
    found: list[SourceStats] = []
    seen: set[int] = set()

    def visit(stream: object) -> None:
        if not isinstance(stream, Stream) or id(stream) in seen:
            return
        seen.add(id(stream))
        stats = getattr(stream, "stats", None)
        if isinstance(stats, SourceStats) and id(stats) not in seen:
            seen.add(id(stats))
            found.append(stats)
        for upstream in stream._upstreams():
            visit(upstream)

    visit(dataset)
    return found


Report = tuple[list[tuple[int, tuple[Any, ...]]], Any]


class StatsReporter:
    """A worker's side of :func:`source_stats`: what its sources counted since the last report,
    and how far its stream's readings counted each epoch (:attr:`Stream._readings`), so that
    the loader's copy, and the workers it starts next, count a resumed epoch on from there
    (its content once, whatever was read ahead before)."""

    __slots__ = ("_before", "_dataset", "_stats")

    def __init__(self, dataset: object) -> None:
        self._dataset = dataset
        self._stats = source_stats(dataset)
        self._before = [stats.counts() for stats in self._stats]

    def report(self) -> Report | None:
        """``([(position, delta), ...], readings)`` of the sources that counted anything,
        else None."""
        if not self._stats:
            return None
        out = []
        for position, stats in enumerate(self._stats):
            delta = stats.since(self._before[position])
            if delta is not None:
                out.append((position, delta))
                self._before[position] = stats.counts()
        if not out:
            return None
        readings = getattr(self._dataset, "_readings", None)
        return out, dict(readings) if readings else None


def merge_stats(stats: list[SourceStats], report: Report, dataset: object = None) -> None:
    """Add a worker's :meth:`StatsReporter.report` to the loader's sources ``stats``, and its
    readings to the loader's ``dataset``."""
    deltas, readings = report
    for position, delta in deltas:
        if position < len(stats):
            stats[position].add(delta)
    if readings and isinstance(dataset, Stream):
        if dataset._readings is None:
            dataset._readings = {}
        dataset._readings.update(readings)
