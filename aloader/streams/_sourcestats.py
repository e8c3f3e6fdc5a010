"""Source statistics across processes: each worker reports what its sources counted, and the
loader adds the reports to the sources it holds (see :class:`aloader.SourceStats`)."""

from __future__ import annotations

from typing import Any

from .._stats import SourceStats
from ._stream import Stream

__all__ = ("StatsReporter", "merge_stats", "source_stats")


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


class StatsReporter:
    """A worker's side of :func:`source_stats`: what its sources counted since the last report.
    """

    __slots__ = ("_before", "_stats")

    def __init__(self, dataset: object) -> None:
        self._stats = source_stats(dataset)
        self._before = [stats.counts() for stats in self._stats]

    def report(self) -> list[tuple[int, tuple[Any, ...]]] | None:
        """``[(position, delta), ...]`` of the sources that counted anything, else None."""
        if not self._stats:
            return None
        out = []
        for position, stats in enumerate(self._stats):
            delta = stats.since(self._before[position])
            if delta is not None:
                out.append((position, delta))
                self._before[position] = stats.counts()
        return out or None


def merge_stats(stats: list[SourceStats], report: list[tuple[int, tuple[Any, ...]]]) -> None:
    """Add a worker's :meth:`StatsReporter.report` to the loader's sources ``stats``."""
    for position, delta in report:
        if position < len(stats):
            stats[position].add(delta)
