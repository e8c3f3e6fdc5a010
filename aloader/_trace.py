"""A loader's per-stage timings as a Chrome trace: ``loader.trace(path)``.

:class:`~aloader._stats.Collector` keeps counts, busy times and recent latencies (enough for a
verdict); a :class:`Trace` also keeps when each one happened, and writes them in the Trace
Event Format (the JSON that ``chrome://tracing``, Perfetto's UI at https://ui.perfetto.dev
and speedscope open), so that an epoch can be looked at: the consumer waiting, the fetches
in flight, a straggler holding back the batches behind it, collates, transfers from worker
processes.

What is recorded, in the loader's process, for each epoch that starts while the trace is
recording: every sampling step, fetch (an item or a batch, in the loop or in a thread),
collate, transfer of a batch from a worker, each wait of the consumer for a batch and its
own time between two batches, and the epoch itself. A worker process's fetches and collates
are not (they are reported to the loader as sums); their batches' transfers are.

The file: one process (this one); a track per kind of event (``consumer``, ``sampling``,
``fetch``, ``collate``, ``transfer``, ``epochs``), and where events of a kind overlap (fetches
in flight together) as many tracks as were busy at once (``fetch``, ``fetch 2``, ...), each
event on the first one free: complete events (``"ph": "X"``), times in microseconds from the
trace's start.

Cost: one clock read and one list append per event while recording (nothing otherwise).
Bounded: at most ``max_events`` events are kept; later ones are counted
(``otherData.dropped`` in the file), not kept.
"""

from __future__ import annotations

import heapq
import json
import os
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._stats import Collector

__all__ = ("Trace",)

_now = time.perf_counter_ns
# The tracks in the order a viewer shows them.
_ORDER = ("epochs", "consumer", "sampling", "fetch", "collate", "transfer")


class Trace:
    """A recording of a loader's per-stage timings, saved as a Chrome trace (JSON) that
    ``chrome://tracing`` and Perfetto (https://ui.perfetto.dev) open. Made by
    :meth:`DataLoader.trace <aloader.DataLoader.trace>`; see :mod:`aloader._trace`.

    It records the epochs that start while it records, from its making to :meth:`stop` (or
    the end of a ``with`` block), which writes the file::

        with loader.trace("epoch.json"):
            for batch in loader:
                ...

    Args:
        loader: the DataLoader whose epochs are recorded.
        path: where :meth:`stop` writes the trace.
        max_events: the most events kept (later ones are counted, not kept).

    Attributes:
        path: the file's path.
        events: the events recorded so far.
        dropped: the events not kept (beyond ``max_events``).
    """

    def __init__(self, loader: Any, path: str | os.PathLike[str],
                 max_events: int = 1_000_000) -> None:
        self.path: str = os.fspath(path)
        self.max_events: int = max_events
        self.dropped: int = 0
        self.started: int = _now()  # perf_counter_ns: the file's times count from here
        # (track, start ns, duration ns, name) of every event kept.
        self._events: list[tuple[str, int, int, str]] = []
        self._epochs: list[Collector] = []
        self._loader = loader
        self._stopped = False
        loader._trace = self

    @property
    def events(self) -> int:
        return len(self._events)

    def _record(self, track: str, start: int, duration: int, name: str) -> None:
        # From any thread: a list append is atomic; the bound is checked without a lock (a
        # few events over it at worst).
        if len(self._events) < self.max_events:
            self._events.append((track, start, duration, name))
        else:
            self.dropped += 1

    def _attach(self, collector: Collector) -> None:
        """Record the epoch of ``collector`` (the loader calls this as the epoch starts,
        before any event): its stages' hooks are wrapped to note when each event ended."""
        if self._stopped:
            return
        self._epochs.append(collector)
        record = self._record
        for name in ("sampling", "fetch", "transfer"):
            stage = getattr(collector, name)
            stage.add = _timed(stage.pending.append, name, record)
        collated = collector.collated

        def collate(samples: Any, ns: int) -> None:
            record("collate", _now() - ns, ns, "collate")
            collated(samples, ns)

        delivered = collector.delivered
        last: list[int] = []  # when the consumer got its last batch

        def deliver(asked: int, now: int, ready: int) -> None:
            if last:
                record("consumer", last[0], asked - last[0], "consumer")
                last[0] = now
            else:
                last.append(now)
            record("consumer", asked, now - asked, "wait")
            delivered(asked, now, ready)

        # Instance attributes shadow the methods: this collector's hooks only.
        collector.collated = collector.collated_in_thread = collate  # type: ignore[method-assign]
        collector.delivered = deliver  # type: ignore[method-assign]

    def stop(self) -> None:
        """Stop recording and write the trace to :attr:`path` (once; later calls do
        nothing). The file is written whole under a temporary name, then moved there."""
        if self._stopped:
            return
        self._stopped = True
        if getattr(self._loader, "_trace", None) is self:
            self._loader._trace = None
        temp = f"{self.path}.tmp-{os.getpid()}"
        with open(temp, "w") as out:
            json.dump(self.as_json(), out)
        os.replace(temp, self.path)

    def as_json(self) -> dict[str, Any]:
        """The trace in the Trace Event Format (what :meth:`stop` writes)."""
        base, pid = self.started, os.getpid()
        events = list(self._events)
        for epoch in self._epochs:
            end = epoch.ended if epoch.ended is not None else _now()
            events.append(("epochs", epoch.started, max(0, end - epoch.started),
                           f"epoch {epoch.epoch}"))
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": "aloader"}}]
        tids: dict[tuple[str, int], int] = {}
        by_track: dict[str, list[tuple[int, int, str]]] = {}
        for track, start, duration, name in events:
            by_track.setdefault(track, []).append((start, duration, name))
        for track in sorted(by_track, key=lambda t: _ORDER.index(t) if t in _ORDER else 99):
            lanes: list[tuple[int, int]] = []  # (end, lane) of the busy ones, a heap
            free: list[int] = []  # lanes free again, a heap
            count = 0
            for start, duration, name in sorted(by_track[track]):
                while lanes and lanes[0][0] <= start:
                    heapq.heappush(free, heapq.heappop(lanes)[1])
                if free:
                    lane = heapq.heappop(free)
                else:
                    lane, count = count, count + 1
                heapq.heappush(lanes, (start + duration, lane))
                tid = tids.get((track, lane))
                if tid is None:
                    tid = tids[track, lane] = len(tids) + 1
                    label = track if lane == 0 else f"{track} {lane + 1}"
                    out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                "args": {"name": label}})
                    out.append({"name": "thread_sort_index", "ph": "M", "pid": pid,
                                "tid": tid, "args": {"sort_index": tid}})
                out.append({"name": name, "cat": track, "ph": "X", "pid": pid, "tid": tid,
                            "ts": (start - base) / 1e3, "dur": duration / 1e3})
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"source": "aloader", "dropped": self.dropped}}

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _timed(append: Callable[[int], None], track: str,
           record: Callable[[str, int, int, str], None]) -> Callable[[int], None]:
    """``append`` (a stage's hook, given an event's duration), noting the event's start too:
    the hook is called as the event ends."""

    def add(ns: int) -> None:
        append(ns)
        record(track, _now() - ns, ns, track)

    return add

