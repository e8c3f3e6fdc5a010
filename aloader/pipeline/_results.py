"""Finished batches waiting for the consumer: the pipeline's output buffer, :class:`Results`.

Invariant: at most ``capacity`` collated batches wait for the consumer, and the head of the
line can always publish (see :class:`Results`), so memory stays bounded whatever the consumer
does and the pipeline never deadlocks on its own output. A job that turned out to have no
batch publishes :data:`NO_BATCH`: it keeps its place in the order and the consumer passes it over.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from .._exceptions import LoaderClosedError
from .._util import Signal

__all__ = ("NO_BATCH", "Results")

# Published by a job that turned out to have no batch (a worker's exhausted iterable replica):
# it keeps its place in the order and is passed over by the consumer.
NO_BATCH: Any = object()

_CLOSED = LoaderClosedError()  # never raised itself: a fresh one is, without a traceback


class Results:
    """Finished batches waiting for the consumer, in sampler order or in completion order.

    A job must :meth:`reserve` an output slot before it collates and :meth:`publish` es. In
    order, job ``k`` may publish only while ``k < taken + capacity``, so the head of the line
    can always publish and no slot is ever held by a batch the consumer cannot take yet.

    The same buffer orders the results of ``Stream.map`` with concurrency (see
    :mod:`aloader.streams._map`), where a job is one item and a batch is its mapped value.

    Batches of an iterable dataset come with metadata (where the dataset was once the batch's
    samples were drawn, for a resume): when ``metas`` is set (a mapping from job number to
    metadata, with ``pop``), taking job ``k`` pops its entry into :attr:`meta`. Without it
    (map-style epochs) nothing of this runs.

    A job that may not publish yet and can finish without an await (a plain collate on the
    loop) need not wait for its slot either: :meth:`defer` keeps the job's ``finish`` and runs
    it when the slot frees, from the :meth:`poll` that freed it (the consumer's), so no task
    waits, and no task wakes, per batch. In order, the slot freed by taking job ``t`` belongs
    to exactly one job, ``t + capacity``; out of order to the job deferred first.
    """

    #: The metadata of the batch taken last (None without ``metas``).
    meta: Any = None
    #: Job number -> metadata of the jobs published, popped as they are taken (or None).
    metas: Any = None
    #: Called as each job publishes (or None): its result is the job's metadata (a map-style
    #: dataset's own state once the batch is loaded, see aloader.loader._datasetstate).
    snapshot: Callable[[], Any] | None = None
    #: Called each time a job is taken (or None): a map epoch's work queue frees room.
    on_take: Callable[[], None] | None = None
    #: The batches left ready when the last one was taken, before a deferred job took the
    #: slot it freed (the statistics' occupancy of the buffer).
    left = 0

    def __init__(self, capacity: int, in_order: bool, skips: bool = False) -> None:
        self._capacity = max(1, capacity)
        self._in_order = in_order
        self._skips = skips  # hand over NO_BATCH too (a worker answers every job)
        self._ready: dict[int, tuple[Any, BaseException | None]] = {}
        self._fifo: deque[tuple[Any, BaseException | None]] = deque()
        self._fifo_seqs: deque[int] = deque()  # the jobs of _fifo's batches, in _fifo's order
        self.taken = 0
        self.last = -1  # the job whose batch (or error) was handed out last
        self._reserved = 0
        self._total: int | None = None
        self._closed: BaseException | None = None
        self._changed = Signal()
        # Deferred finishes: job -> finish in order, (job, finish) in deferral order otherwise.
        self._deferred: dict[int, Callable[[], None]] = {}
        self._deferred_fifo: deque[Callable[[], None]] = deque()

    def defer(self, seq: int, finish: Callable[[], None]) -> None:
        """Run ``finish`` (which publishes job ``seq``) once the job has its output slot: now
        if it has one, else from the :meth:`poll` that frees it. ``finish`` must not raise."""
        if self._in_order:
            if seq < self.taken + self._capacity:
                finish()
            else:
                self._deferred[seq] = finish
        elif self._reserved < self._capacity:
            self._reserved += 1
            finish()
        else:
            self._deferred_fifo.append(finish)

    async def reserve(self, seq: int) -> None:
        """Wait until job ``seq`` may collate and publish without exceeding the capacity."""
        if self._in_order:
            while seq >= self.taken + self._capacity:
                await self._changed.wait()
        else:
            while self._reserved >= self._capacity:
                await self._changed.wait()
            self._reserved += 1

    def publish(self, seq: int, value: Any, error: BaseException | None = None) -> None:
        if self.snapshot is not None:
            self.metas[seq] = self.snapshot()
        if self._in_order:
            self._ready[seq] = (value, error)
        else:
            self._fifo.append((value, error))
            self._fifo_seqs.append(seq)
        self._changed.notify()

    def resize(self, capacity: int) -> None:
        """Let ``capacity`` batches wait from now on (``Stream.map``'s "auto" concurrency;
        not with :meth:`defer`, whose slots are counted at the capacity it was given)."""
        self._capacity = max(1, capacity)
        self._changed.notify()

    @property
    def capacity(self) -> int:
        """The batches that may wait for the consumer."""
        return self._capacity

    def ready(self) -> int:
        """Batches published and not yet taken."""
        return len(self._ready) if self._in_order else len(self._fifo)

    def finish(self, total: int) -> None:
        """No job numbered ``total`` or above will be published."""
        self._total = total
        self._changed.notify()

    def close(self, error: BaseException) -> None:
        """The pipeline stopped: the consumer gets ``error`` once the ready batches are taken."""
        if self._closed is None:
            self._closed = error
        self._changed.notify()

    def poll(self) -> tuple[Any, BaseException | None] | None:
        """The next batch (value, error) if it is ready now, else None (never waits).

        The end of the epoch and a closed pipeline are reported by :meth:`take`.
        """
        while True:
            if self._in_order:
                item = self._ready.pop(self.taken, None)
                seq = self.taken
            else:
                item = self._fifo.popleft() if self._fifo else None
                if item is not None:
                    self._reserved -= 1
                    seq = self._fifo_seqs.popleft()
            if item is None:
                return None
            self.last = seq
            if self.metas is not None:
                self.meta = self.metas.pop(seq, None)
            self.taken += 1
            self.left = self.ready()
            self._changed.notify()
            if self.on_take is not None:
                self.on_take()
            if self._in_order:
                if self._deferred:
                    finish = self._deferred.pop(self.taken + self._capacity - 1, None)
                    if finish is not None:
                        finish()
            elif self._deferred_fifo:
                self._reserved += 1
                self._deferred_fifo.popleft()()
            if item[0] is not NO_BATCH or self._skips:
                return item

    async def take(self) -> tuple[Any, BaseException | None]:
        """The next batch (value, error); StopAsyncIteration at the end of the epoch."""
        while True:
            item = self.poll()
            if item is not None:
                return item
            if self._total is not None and self.taken >= self._total:
                raise StopAsyncIteration
            if self._closed is not None:
                # Reported once, then dropped: kept, its traceback (the consumer's frames)
                # would keep the consumer's objects alive as long as the epoch.
                error, self._closed = self._closed, _CLOSED
                raise error if error is not _CLOSED else LoaderClosedError()
            await self._changed.wait()
