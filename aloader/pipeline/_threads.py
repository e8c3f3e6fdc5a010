"""Fetches in OS threads: the threads that fetch single items of blocking datasets, and the
epoch's wait for its threads.

Invariant: a stopping epoch waits for every fetch running in its threads (the next fetch must
not overlap one that holds the dataset), unless it has given up on them after a ``timeout``
fired (:class:`_Abandon`): a thread stuck in the dataset is then left running, its result
discarded.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from .._backend import threadsafe_caller
from .._exceptions import Throttled
from ._errors import _note
from ._failures import _FAILED

if TYPE_CHECKING:
    from ._plan import FetchPlan
    from ._schedule import _Job

__all__ = ()

_now = time.perf_counter_ns
_cpu = time.thread_time_ns


class _Abandon:
    """Waits for threads, until the epoch gives up on them (after a ``timeout`` fired).

    A wait is shielded from cancellation, so that a stopping epoch still waits for the fetches
    in its threads (the next fetch must not overlap one that holds the dataset), yet
    :meth:`give_up` ends every wait at once, now and later.
    """

    def __init__(self) -> None:
        self.given_up = False
        self._waits: set[anyio.CancelScope] = set()

    async def wait(self, blocking: Callable[[], object]) -> None:
        """Return once ``blocking()`` returns in a thread, or once the epoch gives up."""
        if self.given_up:
            return
        with anyio.CancelScope(shield=True) as scope:
            self._waits.add(scope)
            try:
                await anyio.to_thread.run_sync(blocking, abandon_on_cancel=True)
            finally:
                self._waits.discard(scope)

    def give_up(self) -> None:
        self.given_up = True
        for scope in self._waits:
            scope.cancel()

    def __getstate__(self) -> dict[str, Any]:  # travels with a plan to worker processes
        return {"given_up": False, "_waits": set()}


class _FetchThreads:
    """OS threads fetching single items of jobs, for blocking synchronous datasets.

    Per item they cost a queue read and no event-loop round trip: the loop hears only of
    finished jobs, which keeps it (and the GIL) free at thousands of blocking fetches a second.
    A thread starts only when there are more unfinished items than threads, up to ``count``,
    which :meth:`resize` may change (``"auto"`` concurrency: threads above it leave after
    their item). A fetch the dataset throttles (:class:`~aloader.Throttled`) waits in its
    thread and is made again (see :meth:`FetchPlan.throttled`).
    """

    def __init__(self, plan: FetchPlan, count: int) -> None:
        self._plan = plan
        self._get_item = plan.get_item
        self._absorb = plan.absorb
        self._stats = plan.stats
        self._tuner = plan.tuner
        self._count = count
        self._abandon = plan.abandon
        self._work: queue.SimpleQueue[tuple[_Job, int, Any] | None] = queue.SimpleQueue()
        self._lock = threading.RLock()  # the controller may resize the threads from under it
        self._call_soon = threadsafe_caller()
        self._stopping = False
        self._stopped = threading.Event()  # wakes the throttled fetches' waits
        self._unfinished = 0  # items submitted and not yet done (under the lock)
        self._running = 0  # threads started and not left (under the lock)
        self._threads: list[threading.Thread] = []

    def submit(self, job: _Job, items: list[Any]) -> None:
        job.fetched = anyio.Event()
        with self._lock:
            self._unfinished += len(items)
        for position, index in enumerate(items):
            self._work.put((job, position, index))
        self._start()

    def _start(self) -> None:
        """Start threads while there are more unfinished items than threads (up to count),
        never once closing began (a thread started then would wait for work for ever)."""
        while True:
            with self._lock:
                if self._stopping or self._running >= min(self._count, self._unfinished):
                    return
                self._running += 1
                thread = threading.Thread(target=self._run, name="aloader-fetch", daemon=True)
                if len(self._threads) > 2 * self._count:  # threads that left, as it fell
                    self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def resize(self, count: int) -> None:
        """At most ``count`` threads from now on (more start for waiting items; the surplus
        leave after the item in hand)."""
        self._count = count
        self._start()

    def _fetch(self, index: Any) -> Any:
        """``dataset[index]``, made again after a wait as long as it is throttled."""
        plan = self._plan
        in_a_row = 0
        while True:
            started = _now()
            try:
                value = self._get_item(index)
            except Throttled as exc:
                in_a_row += 1
                delay = plan.throttled(exc, in_a_row, self._lock)
                if self._stopped.wait(delay):
                    raise
                continue
            if self._tuner is not None:
                now = _now()
                with self._lock:
                    self._tuner.done(now - started, now)
            return value

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            job, position, index = work
            error: BaseException | None = None
            if job.error is None and not self._stopping:
                stats = self._stats
                started, cpu = _now(), _cpu()
                try:
                    job.samples[position] = self._fetch(index)
                except Exception as exc:
                    error = self._absorb(index, _note(exc, f"raised while fetching index "
                                                           f"{index!r} of batch {job.seq}"))
                    if error is None:
                        job.samples[position] = _FAILED
                except BaseException as exc:  # ends the epoch: see Epoch._worker
                    error = exc
                finally:
                    stats.fetched_in_thread(_now() - started, _cpu() - cpu)
            with self._lock:
                if error is not None and job.error is None:
                    job.error = error
                job.remaining -= 1
                self._unfinished -= 1
                done = job.remaining == 0
                leave = self._running > self._count
                if leave:
                    self._running -= 1
            if done:
                assert job.fetched is not None
                self._call_soon(job.fetched.set)
            if leave:
                return

    async def close(self) -> None:
        """Let the threads finish the fetch in hand, skip the rest, and wait until they exit.

        Once the epoch has given up on its threads, a thread stuck in the dataset is left
        running (a daemon thread that exits when its fetch returns) and not waited for.
        """
        with self._lock:  # no thread starts from now on (see _start)
            self._stopping = True
            threads = list(self._threads)
        self._stopped.set()
        if not threads:
            return
        for _ in threads:
            self._work.put(None)

        def join() -> None:
            for thread in threads:
                thread.join()

        await self._abandon.wait(join)
