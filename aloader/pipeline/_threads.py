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
from .._stats import Collector
from ._errors import _note
from ._failures import _FAILED

if TYPE_CHECKING:
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
    A thread starts only when there are more unfinished items than threads, up to ``count``.
    """

    def __init__(self, get_item: Callable[[Any], Any], count: int, abandon: _Abandon,
                 absorb: Callable[[Any, BaseException], BaseException | None],
                 stats: Collector) -> None:
        self._get_item = get_item
        self._absorb = absorb
        self._stats = stats
        self._count = count
        self._abandon = abandon
        self._work: queue.SimpleQueue[tuple[_Job, int, Any] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._call_soon = threadsafe_caller()
        self._stopping = False
        self._unfinished = 0  # items submitted and not yet done (under the lock)
        self._threads: list[threading.Thread] = []

    def submit(self, job: _Job, items: list[Any]) -> None:
        job.fetched = anyio.Event()
        with self._lock:
            self._unfinished += len(items)
            wanted = min(self._count, self._unfinished)
        for position, index in enumerate(items):
            self._work.put((job, position, index))
        while len(self._threads) < wanted:
            thread = threading.Thread(target=self._run, name="aloader-fetch", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            job, position, index = work
            error: BaseException | None = None
            if job.error is None and not self._stopping:
                stats = self._stats
                started, cpu = _now(), _cpu()
                try:
                    job.samples[position] = self._get_item(index)
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
            if done:
                assert job.fetched is not None
                self._call_soon(job.fetched.set)

    async def close(self) -> None:
        """Let the threads finish the fetch in hand, skip the rest, and wait until they exit.

        Once the epoch has given up on its threads, a thread stuck in the dataset is left
        running (a daemon thread that exits when its fetch returns) and not waited for.
        """
        self._stopping = True
        threads = self._threads
        if not threads:
            return
        for _ in threads:
            self._work.put(None)

        def join() -> None:
            for thread in threads:
                thread.join()

        await self._abandon.wait(join)
