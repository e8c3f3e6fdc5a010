"""A loader's worker processes, driven from its event loop without blocking it.

:class:`WorkerPool` owns the processes and the loader's ends of their socket pairs; it holds no
event-loop object, so persistent workers serve epochs run by different loops (the synchronous
facade runs each epoch on a loop of its own). :class:`PoolEpoch` is one epoch's use of a pool:
it is the ``remote`` of a ``"process"`` :class:`~aloader.pipeline._pipeline.FetchPlan`, so the
epoch's
pipeline keeps doing what it does without workers (admitting at most ``window`` jobs, ordering
results, bounding what waits for the consumer) while each job's fetch becomes "send the key to a
worker and await the collated batch".

Waiting costs no thread: one task per worker reads its socket whenever it is readable (on
asyncio through a reader the loop calls, registered once per epoch; on trio waiting with
``anyio.wait_readable``), cuts whole frames and wakes the jobs they answer. A worker that dies
closes its socket, so its reader sees EOF at once, waits for the exit status and fails the epoch
with torch's message ("DataLoader worker (pid N) is killed by signal: Killed. "). Sends never
block the loop either: the socket is non-blocking and what does not fit waits in an outbox.

Start method: by default workers are forks of a template of the loader's process, forked when
the first loader with workers is built (see :mod:`aloader.workers._spawn`; ``spawn`` where there is
no
fork server). ``fork`` itself is unsafe in a process that runs threads, and a loader always has
some once it iterates (the synchronous facade's loop thread, anyio's worker threads); the
template is single-threaded, already has every module the user's process had imported, and
never runs the user's main module, so a worker starts in milliseconds and a script needs no
``__main__`` guard. The dataset, ``collate_fn`` and ``worker_init_fn`` are pickled once per
pool with cloudpickle (by value where they are not importable by name: lambdas, local
functions, classes of ``__main__``), their large arrays into one shared-memory segment that
every worker maps copy-on-write. A setup that cannot be pickled at all (a lock, an open file, a
database connection) makes the pool fork its workers from the loader's process instead, on
Linux, as torch's default start method does (explicit ``spawn`` or ``forkserver`` contexts keep
pickling, and fail with a note saying what to do): the workers inherit the setup. Those forks
are made from the thread that starts the workers while the loader's loop runs, as torch forks
while the user's threads run, so torch's caveat holds: a lock another thread holds at that
moment (one the dataset shares with a thread of the user's, a stream's buffer lock mid-write)
stays held in the workers. aloader's own threads are then waiting (the synchronous facade's
loop thread on the start, its consumer on the loop), and the locks of aloader's that a worker
takes are made anew in a forked child (``_shm``, ``_cache``, ``_parquet``); obstore's runtime,
whose threads do not survive a fork, turns the fallback off once it has started.

Shutdown: the loader closes its socket ends (a worker reading its next task exits at once),
waits briefly, then terminates and kills what is left, and removes any shared-memory segment a
worker left behind. It happens in a background thread after an epoch (non-persistent workers),
when the loader is closed or garbage-collected (persistent workers), and synchronously at
interpreter exit. Workers exit by themselves when the loader's process dies (they watch it).

An epoch's use of the pool has two kinds, as epochs have: :class:`MapPoolEpoch` sends index
batches to the workers in turn, :class:`ReplicaPoolEpoch` asks each worker's replica of an
iterable dataset for its next batch; the loader's epoch kind (:mod:`aloader.loader._epochs`) picks
one.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import multiprocessing
import multiprocessing.context
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import anyio
import anyio.from_thread

from .._backend import Waiter, current_backend, waiters
from .._exceptions import WorkerError
from .._log import worker_log
from .._stats import Collector
from .._util import Signal
from ..pipeline._failures import Failures
from ..pipeline._pipeline import SKIP, PacedKeys
from ..streams._sourcestats import merge_stats, source_stats
from . import _shm, _spawn
from ._worker import FRAME, SETUP_JOB, Kind, Reply, Request, Status, WorkerSetup, worker_main

__all__ = (
    "Delivered",
    "MapPoolEpoch",
    "PoolEpoch",
    "ReplicaPoolEpoch",
    "WorkerPool",
    "default_context",
    "exit_message",
    "resolve_context",
)

# Seconds a worker may take to exit after its socket closes before it is terminated.
_GRACE = 0.5
_CHUNK = 1 << 18
_FRAME = FRAME
_pool_serial = itertools.count()
# The loader's socket ends of every live pool: a forked worker closes them all.
_LOADER_FDS: set[int] = set()


def resolve_context(context: Any) -> multiprocessing.context.BaseContext:
    """Validate a ``multiprocessing_context`` argument (torch's checks and messages).

    Raises:
        ValueError: a string that names no start method of this platform.
        TypeError: neither a string nor a multiprocessing context.
    """
    if isinstance(context, str):
        methods = multiprocessing.get_all_start_methods()
        if context not in methods:
            raise ValueError(
                "multiprocessing_context option should specify a valid start method in "
                f"{methods!r}, but got multiprocessing_context={context!r}"
            )
        context = multiprocessing.get_context(context)
    if not isinstance(context, multiprocessing.context.BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string "
            f"specifying the start method, but got multiprocessing_context={context}"
        )
    return context


def default_context() -> multiprocessing.context.BaseContext:
    """Forks of the template (:mod:`aloader.workers._spawn`) where the platform has a fork server,
    else spawn: both safe with threads."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        return _spawn.CONTEXT
    return multiprocessing.get_context("spawn")


def prepare_context(context: multiprocessing.context.BaseContext, *, warm: bool) -> None:
    """Get the server of ``context`` ready for the first epoch.

    The default context forks its template now if this process may fork (only its main thread
    runs: a loader being built, an epoch starting); when ``warm`` and it may not, it starts the
    exec'd fork server instead. An explicit ``forkserver`` context gets numpy and aloader added
    to its preloaded modules (``numpy.random`` too, which every worker seeds: importing it
    costs a worker 20 ms), which only applies before the server starts, and is started when
    ``warm``. Starting is a head start (a fork, or a process launch, not a wait); it is never
    done while this process imports ``__main__`` for ``spawn``, and only warms in a program's
    main process.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    if isinstance(context, _spawn.Context):
        # Only a head start: if no server can start, the first epoch says why.
        with contextlib.suppress(Exception):
            _spawn.prepare(warm=warm and multiprocessing.parent_process() is None)
        return
    if context.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    server: Any = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is not None:
        return
    modules = list(getattr(server, "_preload_modules", None) or [])
    wanted = [name for name in ("numpy", "numpy.random", "aloader") if name not in modules]
    if wanted:
        forkserver.set_forkserver_preload(modules + wanted)
    if warm and multiprocessing.parent_process() is None:
        # Only a head start: if the server cannot start, the first epoch says why.
        with contextlib.suppress(Exception):
            forkserver.ensure_running()


def exit_message(pid: int | None, exitcode: int | None) -> str:
    """torch's message for a worker that exited without being asked to."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.strsignal(-exitcode) or f"signal {-exitcode}"
        except ValueError:
            name = f"Unknown signal: {-exitcode}"
        message = f"DataLoader worker (pid {pid}) is killed by signal: {name}. "
        if -exitcode == signal.SIGBUS:
            message += ("It is possible that dataloader's workers are out of shared memory. "
                        "Please try to raise your shared memory limit.")
        return message
    if exitcode:
        return (f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}. "
                "Details are lost due to multiprocessing. Rerunning with num_workers=0 may give "
                "better error trace.")
    return f"DataLoader worker (pid(s) {pid}) exited unexpectedly"


@dataclass(eq=False)
class _WorkerHandle:
    """The loader's side of one worker process (the worker's is ``_worker._WorkerServer``)."""

    id: int
    process: Any
    conn: Connection
    fd: int
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    outstanding: int = 0  # tasks sent and not answered, across epochs
    ready: bool = False  # set up and serving
    # Its setup or worker_init_fn failed (the RemoteError): the answer to each of its tasks,
    # as torch answers a failed worker's first task with it, so that the batches before come
    # first whichever message arrives first.
    setup_error: Any = None
    # Segments of this worker's batches that no array views any more (appended from any
    # thread), handed back with its next task.
    released: deque[str] = field(default_factory=deque)

    def frames(self, chunk: bytes) -> list[bytes | memoryview]:
        """Append what was read; return the frames now complete.

        A read that starts with no partial frame waiting (the usual one) is cut into views of
        ``chunk`` itself, which no one changes, and only its incomplete tail is kept; frames
        completed from a kept tail are copied out of it.
        """
        inbox = self.inbox
        data: bytes | bytearray = chunk
        if inbox:
            inbox += chunk
            data = inbox
        out: list[bytes | memoryview] = []
        start = 0
        view = memoryview(data)
        while len(data) - start >= 4:
            size = _FRAME.unpack_from(data, start)[0]
            end = start + 4 + size
            if len(data) < end:
                break
            if data is chunk:
                out.append(view[start + 4 : end])
            else:
                with view[start + 4 : end] as frame:
                    out.append(bytes(frame))
            start = end
        if data is chunk:
            inbox += view[start:]
        else:
            view.release()  # the bytearray cannot resize under a view
            del inbox[:start]
        return out


class _Processes:
    """The part of a pool that must outlive it: processes to stop and segments to sweep."""

    def __init__(self, owner: int, shm_owner: str, tag: str) -> None:
        self.owner = owner
        self.shm_owner = shm_owner
        self.tag = tag
        self.workers: list[_WorkerHandle] = []
        self._lock = threading.Lock()
        self._closing = False
        self._reaper: threading.Thread | None = None

    def add(self, worker: _WorkerHandle) -> None:
        """Adopt a started worker; stop it at once if the pool was stopped meanwhile."""
        with self._lock:
            if not self._closing:
                self.workers.append(worker)
                _LOADER_FDS.add(worker.fd)
                return
        worker.conn.close()
        worker.process.terminate()
        worker.process.join()
        raise WorkerError("DataLoader workers were stopped while starting")

    def stop(self, wait: bool = False) -> None:
        """Close the sockets, then (in a thread unless ``wait``) reap the workers and sweep."""
        if os.getpid() != self.owner:  # a forked copy of the loader's process owns nothing
            return
        with self._lock:
            first = not self._closing
            self._closing = True
            if first:
                for worker in self.workers:
                    _LOADER_FDS.discard(worker.fd)
                    with contextlib.suppress(OSError):
                        worker.conn.close()
                if not wait:
                    self._reaper = threading.Thread(target=self._reap, name="aloader-reaper",
                                                    daemon=True)
                    self._reaper.start()
            reaper = self._reaper
        if wait:
            if reaper is not None:
                reaper.join()
            else:
                self._reap()

    def _reap(self) -> None:
        processes = [worker.process for worker in self.workers]
        deadline = time.monotonic() + _GRACE
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.exitcode is None:
                process.terminate()
                process.join(1.0)
            if process.exitcode is None:
                process.kill()
                process.join()
        _shm.sweep(_shm.prefix(self.shm_owner, self.tag))
        for process in processes:
            _shm.sweep(_shm.prefix(self.shm_owner, process.pid))
        _LIVE.discard(self)


_LIVE: set[_Processes] = set()
_atexit_registered = False


def _stop_all() -> None:
    for processes in list(_LIVE):
        processes.stop(wait=True)
    _shm.sweep(_shm.prefix(_shm.owner()))


class WorkerPool:
    """A loader's worker processes (see the module docstring).

    Args:
        setup: what every worker receives at start.
        context: the multiprocessing context to start workers with.
        persistent: whether the pool serves several epochs.
    """

    def __init__(self, setup: WorkerSetup, context: multiprocessing.context.BaseContext, *,
                 persistent: bool) -> None:
        self.setup = setup
        self.context = context
        self.persistent = persistent
        self.num_workers = setup.num_workers
        self.owner = os.getpid()
        self.shm_owner = setup.owner
        self.tag = f"p{next(_pool_serial)}"
        self.codec = _shm.Codec(self.shm_owner, self.tag)
        self.workers: list[_WorkerHandle] = []
        self.started = False
        self.closed = False
        # A worker failed: the pool serves no more epochs. A flag, not the error itself, which
        # must not outlive its report (its traceback holds the consumer's frames).
        self.broken = False
        self.holder: PoolEpoch | None = None
        # The epoch that ended last, settled when the next one starts (PoolEpoch.settle).
        self.unsettled: PoolEpoch | None = None
        self.jobs = itertools.count()
        self.epochs = itertools.count()
        self._ready = 0
        self._message: bytes | None = None
        self._setup_segment: str | None = None
        self._processes = _Processes(self.owner, self.shm_owner, self.tag)
        self._finalizer = weakref.finalize(self, self._processes.stop)
        self._finalizer.atexit = False  # _stop_all reaps synchronously at exit

    def start(self, on_started: Callable[[], None]) -> None:
        """Start the workers one after the other (blocking: run it in a thread).

        ``on_started`` is called as soon as each worker is up, so that it takes tasks while the
        next one starts.
        """
        self.prepare()
        for worker_id in range(self.num_workers):
            self.start_worker(worker_id)
            on_started()

    def prepare(self) -> None:
        """Pickle the setup for the workers (blocking: run it in a thread)."""
        global _atexit_registered
        if not _atexit_registered:
            atexit.register(_stop_all)  # after multiprocessing's, so it runs before
            _atexit_registered = True
            _shm.sweep_stale()  # segments of loaders that were killed
        _LIVE.add(self._processes)
        self.started = True
        if self.context.get_start_method() == "fork":
            return  # a forked worker inherits the setup
        may_fork = isinstance(self.context, _spawn.Context) and _spawn.may_fork_workers()
        # The dataset's tensors travel as arrays, out of band as its numpy arrays do, and in
        # dtypes torch's own pickle cannot load back (uint16, float8); requests skip that hook.
        # A tensor in shared memory is refused where the workers may be forked instead: under
        # torch's fork, what they write into it (a cache, counters) is seen by all, not lost.
        codec = _shm.Codec(self.shm_owner, self.tag, tensors=True, shared_tensors=not may_fork)
        try:
            self._message = codec.encode(self.setup, by_value="always")
        except Exception as exc:
            if may_fork and not isinstance(exc, OSError):
                # What torch's default start method takes without pickling (a lock, an open
                # file, a database connection, a shared tensor): this pool's workers are plain
                # forks of this process, as under torch, and inherit the setup.
                worker_log.info("the dataset, collate_fn or worker_init_fn cannot be pickled "
                                "(%s: %s): forking this loader's workers", type(exc).__name__,
                                exc)
                self.context = multiprocessing.get_context("fork")
                return
            exc.add_note(
                "DataLoader workers receive the dataset, collate_fn and worker_init_fn "
                "pickled with cloudpickle (by value where they are not importable): what "
                "cannot be pickled at all (an open file, a lock, a generator, a client "
                "connection) must be made in the worker (lazily, or in worker_init_fn), or "
                "pass multiprocessing_context='fork' (unsafe when the process runs threads)."
            )
            raise
        self._setup_segment = codec.last_segment

    def start_worker(self, worker_id: int) -> _WorkerHandle:
        """Start worker ``worker_id`` (blocking: run it in a thread)."""
        fork = self._message is None
        mine, theirs = self.context.Pipe(duplex=True)
        inherited = sorted(_LOADER_FDS | {mine.fileno()}) if fork else []
        process = self.context.Process(  # type: ignore[attr-defined]
            target=worker_main,
            args=(theirs, worker_id, self.shm_owner, self.setup if fork else None, inherited),
            name=f"aloader-worker-{worker_id}",
            daemon=True,
        )
        try:
            process.start()
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        worker = _WorkerHandle(worker_id, process, mine, mine.fileno())
        self._processes.add(worker)
        if self._message is not None:
            mine.send_bytes(self._message)
        os.set_blocking(worker.fd, False)
        self.workers.append(worker)
        return worker

    def note_ready(self) -> None:
        self._ready += 1
        if self._ready == self.num_workers:
            self._unlink_setup()

    def _unlink_setup(self) -> None:
        name, self._setup_segment = self._setup_segment, None
        if name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_shm.SHM_DIR, name))

    def shutdown(self) -> None:
        """Stop the workers without waiting for them (a background thread reaps them).

        While an epoch still uses the pool, that epoch stops it when it ends, so that no
        socket closes under a task waiting on it.
        """
        self.closed = True
        self._unlink_setup()
        if self.holder is None:
            self._finalizer()


class _Pending:
    """A job's wait for its answer: a :class:`~aloader._backend.Waiter` (a plain future on
    asyncio, one per job: cheaper than an event) and the answer once it is in."""

    __slots__ = ("reply", "waiter", "worker")

    def __init__(self, waiter: Waiter, worker: _WorkerHandle) -> None:
        self.waiter = waiter
        self.worker = worker  # the worker asked
        self.reply: Reply | None = None


class PoolEpoch:
    """One epoch's use of a :class:`WorkerPool`: the remote of a ``"process"`` FetchPlan.

    Which worker makes a batch, and in what order each worker receives its tasks, depend only
    on the batch's sequence number, never on timing, so that what a worker draws from its
    seeded RNGs is the same run after run (torch's order); the two kinds say how
    (:meth:`route`): :class:`MapPoolEpoch` for map-style datasets, :class:`ReplicaPoolEpoch`
    for iterable ones.

    Invariant: each lane receives its tasks in ticket order (ticket ``t`` is sent only after
    ticket ``t - 1``), and a worker has at most ``prefetch_factor`` tasks unanswered; a job
    waits, whatever the order its task wakes up in, until both hold. A lane is a worker's
    tasks, except for the virtual replicas of a resumed iterable epoch, each a lane of its
    own on a worker it may share (:class:`ReplicaPoolEpoch`): each replica's batches are
    then fixed, but how a worker interleaves its lanes is not (nor, so, what they draw from
    the worker's global RNGs). Workers start one after the
    other, each taking tasks as soon as it is up. A worker's source statistics arrive with
    its reports (every few answers, and with its last: see :mod:`aloader.workers._worker`), merged
    into the loader's dataset here.
    """

    def __init__(self, pool: WorkerPool, loader_epoch: int = 0) -> None:
        self.pool = pool
        self.epoch = next(pool.epochs)  # tells this epoch's tasks from the pool's earlier ones
        self.loader_epoch = loader_epoch  # the epoch a stream in a worker iterates
        self.stopping = False
        self.released = False
        self._previous = pool.holder
        pool.holder = self
        self._limit = max(1, pool.setup.prefetch)
        self._pending: dict[int, _Pending] = {}
        self._waiter: Callable[[], Waiter] | None = None  # the factory of the epoch's loop
        self._changed = Signal()  # a worker started, answered, or the pool failed
        self._serving = False
        self._tg: Any = None
        self._failure: BaseException | None = None
        self._exhausted: set[int] = set()  # lanes (replicas) that have ended
        self._sent = [0] * pool.num_workers  # each lane's next ticket to send
        self._stats: list[Any] | None = None  # the loader's sources, found at the first report
        self.failures: Failures | None = None  # the epoch's failure budget, set by the loader
        self.stats: Collector | None = None  # the epoch's statistics, set by the loader
        #: Batches the consumer has taken (set by the loader): None turns settling off.
        self.taken: Callable[[], int] | None = None
        self._window = self._limit * pool.num_workers  # torch's tasks sent before a take
        #: What came with the batches (positions, datasets' states) as the consumer takes
        #: them (Results.metas, where the loader asks for it).
        self.delivered = Delivered([None] * pool.num_workers, 0)

    # The FetchPlan's remote protocol ---------------------------------------------------------
    async def serve(self) -> None:
        """Start the workers if needed, then read their answers until cancelled."""
        pool = self.pool
        previous = self._previous
        while previous is not None and not previous.released:  # a stopped epoch letting go
            await anyio.sleep(0.005)
        self._previous = None
        if pool.broken:
            raise WorkerError("DataLoader workers stopped after an earlier error")
        # The consumer has left the last epoch by now: what it took of it is final.
        unsettled, pool.unsettled = pool.unsettled, None
        if unsettled is not None and unsettled is not self:
            unsettled.settle()  # its frames wait in the outboxes, flushed below, in order
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for worker_id in range(pool.num_workers):
                tg.start_soon(self._read, worker_id)
            for worker in pool.workers:
                if worker.outbox:
                    tg.start_soon(self._flush, worker)
            self._serving = True
            self._changed.notify()
            try:
                if not pool.started:
                    await anyio.to_thread.run_sync(
                        pool.start, partial(anyio.from_thread.run_sync, self._changed.notify)
                    )
            except Exception as exc:
                self._fail(exc)
        failure, self._failure = self._failure, None
        if failure is not None:
            pool.broken = True
            raise failure

    async def fetch(self, key: Any, seq: int) -> Any:
        """The collated batch of ``key`` (map-style), or the next batch of worker ``key``.

        ``seq`` is the job's sequence number in the epoch: it decides the worker (map-style)
        and the place of the task among that worker's (see the class docstring).
        """
        worker_id, lane, ticket, kind, payload = self.route(key, seq)
        workers = self.pool.workers
        while not (
            self._serving
            and worker_id < len(workers)
            and self._sent[lane] == ticket
            and (workers[worker_id].outstanding < self._limit
                 or workers[worker_id].setup_error is not None)
        ) and lane not in self._exhausted:
            await self._changed.wait()
        if lane in self._exhausted:  # its replica has ended: no need to ask
            return SKIP
        self._sent[lane] += 1
        self._changed.notify()  # the worker's next ticket may go once this one is sent
        reply = await self._call(workers[worker_id], kind, payload, self.mark(seq))
        if reply.extra is not None:
            self._absorb(worker_id, reply.status, reply.extra)
            if reply.extra[3]:  # every sample failed within the failure budget
                return SKIP
        if reply.status == Status.END:
            self.note_end(lane, reply.meta)
            self._exhausted.add(lane)
            self._changed.notify()  # its later requests need not wait for their turn
            return SKIP
        if reply.status == Status.ERROR:
            raise reply.value.rebuild()
        if reply.meta is not None:
            self.note_meta(seq, lane, reply.meta)
        return reply.value

    def note_meta(self, seq: int, lane: int, meta: Any) -> None:
        """Job ``seq``'s batch came with metadata (the position of replica ``lane``, or a
        map-style dataset's state in worker ``lane``)."""
        self.delivered.got[seq] = (lane, meta)

    def note_end(self, lane: int, meta: Any) -> None:
        """Replica ``lane`` ended; ``meta`` is its final state (or None)."""

    def mark(self, seq: int) -> tuple[int, int] | None:
        """The :attr:`~aloader.workers._worker.Request.mark` of job ``seq``'s task, sent now."""
        return None

    def settle(self) -> None:
        """The epoch has ended and its consumer has left it (the next epoch is starting, on a
        persistent pool): make the workers' state what torch's would be (after a break: see
        :class:`MapPoolEpoch`)."""

    def _due(self) -> int:
        """The tasks torch's loader has sent so far: its window, then one per batch taken."""
        assert self.taken is not None
        return self._window + self.taken()

    def _torchs(self, worker_id: int, due: int) -> int:
        """The tasks torch had sent worker ``worker_id`` once it had sent ``due`` in turn."""
        return max(0, -(-(due - worker_id) // self.pool.num_workers))

    def _absorb(self, worker_id: int, status: Status, extra: Any) -> None:
        """Record what a worker counted besides its sources: failed samples, timings (a
        report every few answers), this answer's transfer."""
        failed, attempted, timings, empty, sent = extra
        if self.stats is not None:
            if timings is not None:
                self.stats.merge(worker_id, timings)
            if status == Status.OK and not empty:
                self.stats.transferred(sent)
        if self.failures is not None:
            self.failures.attempted(attempted)
            for index, error in failed:
                self.failures.record(index, error.rebuild())

    def stop(self) -> None:
        """The epoch is stopping (any thread): a next epoch may wait for this one to let go."""
        self.stopping = True

    def close(self) -> None:
        """The epoch has ended: hand the pool back, or shut it down."""
        pool = self.pool
        if pool.persistent:
            pool.unsettled = self  # the consumer may still be taking its batches: see serve()
        self.released = True
        if pool.holder is self:
            pool.holder = None
        if not pool.persistent or pool.broken or pool.closed:
            pool.shutdown()

    def route(self, key: Any, seq: int) -> tuple[int, int, int, Kind, Any]:
        """Job ``seq`` (key ``key``): (worker, lane, its ticket in the lane, the request's
        kind, its key). A lane is a sequence of tasks answered in ticket order: a worker's
        (map-style), or one replica's (several may share a worker)."""
        raise NotImplementedError

    # Sending and receiving -------------------------------------------------------------------
    async def _call(self, worker: _WorkerHandle, kind: Kind, key: Any,
                    mark: tuple[int, int] | None = None) -> Reply:
        if worker.setup_error is not None:  # never asked: its setup's error is the answer
            return Reply(SETUP_JOB, Status.ERROR, worker.setup_error)
        job = next(self.pool.jobs)
        data = self._request(worker, kind, job, key, mark)
        if self._waiter is None:  # the epoch's loop, looked up once
            self._waiter = waiters()
        pending = _Pending(self._waiter(), worker)
        self._pending[job] = pending
        worker.outstanding += 1
        try:
            self._send(worker, data)
            await pending.waiter
        finally:
            del self._pending[job]  # a late answer to a cancelled job is dropped
        assert pending.reply is not None
        return pending.reply

    def _request(self, worker: _WorkerHandle, kind: Kind, job: int, key: Any,
                 mark: tuple[int, int] | None = None) -> bytes:
        """Request ``job`` of ``worker``, encoded, with the segments it may reuse."""
        released = worker.released
        names = [released.popleft() for _ in range(len(released))]
        request = Request(kind, job, self.epoch, key, names, self.loader_epoch, mark)
        return self.pool.codec.encode(request.wire())

    def _send(self, worker: _WorkerHandle, data: bytes, flush: bool = True) -> None:
        """Write a frame, what does not fit kept in order in the worker's outbox and flushed
        by a task of this epoch (``flush``) or of the next epoch's serve."""
        frame = _FRAME.pack(len(data)) + data
        if worker.outbox:  # a flush is under way: keep the frames in order
            worker.outbox += frame
            return
        try:
            sent = os.write(worker.fd, frame)
        except BlockingIOError:
            sent = 0
        except OSError:  # the worker is gone: its reader reports how
            return
        if sent < len(frame):
            worker.outbox += frame[sent:]
            if flush:
                self._tg.start_soon(self._flush, worker)

    async def _flush(self, worker: _WorkerHandle) -> None:
        while worker.outbox:
            await anyio.wait_writable(worker.fd)
            try:
                sent = os.write(worker.fd, worker.outbox)
            except BlockingIOError:
                continue
            except OSError:
                worker.outbox.clear()
                return
            del worker.outbox[:sent]

    async def _read(self, worker_id: int) -> None:
        while worker_id >= len(self.pool.workers):  # not started yet
            await self._changed.wait()
        worker = self.pool.workers[worker_id]
        ended: bool | None
        try:
            if current_backend() == "asyncio":
                ended = await self._read_by_callback(worker)
            else:
                while (ended := self._take_in(worker)) is None:
                    await anyio.wait_readable(worker.fd)
            if not ended:  # the epoch failed
                return
            if worker.setup_error is not None:  # it exited after reporting why: its tasks say
                return
        except Exception as exc:  # an answer that cannot be read here
            self._fail(exc)
            return
        message = exit_message(worker.process.pid, await self._exitcode(worker))
        if not worker.ready and _spawn.reruns_main(self.pool.context):
            message += (
                f" It exited before it was set up: workers started with "
                f"{self.pool.context.get_start_method()!r} import the main module, so a script "
                "must start loading under `if __name__ == '__main__':`."
            )
        if not self.stopping:
            worker_log.error("worker %d: %s", worker_id, message.strip())
        self._fail(WorkerError(message))

    def _take_in(self, worker: _WorkerHandle) -> bool | None:
        """Read what ``worker``'s socket holds and dispatch the answers it completes: None to
        read on, True at the end of the socket (the worker exited), False once the epoch
        failed. The socket is non-blocking: a read finding nothing reads on."""
        try:
            chunk = os.read(worker.fd, _CHUNK)
        except BlockingIOError:
            return None
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return True
        for frame in worker.frames(chunk):
            wire = _shm.decode(frame, on_release=worker.released.append)
            self._dispatch(worker, Reply.of(wire))
            if self._failure is not None:
                return False
        return None

    async def _read_by_callback(self, worker: _WorkerHandle) -> bool:
        """:meth:`_take_in` whenever ``worker``'s socket is readable, called by the asyncio
        loop itself (one reader registered for the epoch): an answer then costs no task step
        and no registration, where a wait per read (``wait_readable``) cost a future, two
        ``epoll_ctl`` calls and a step of this task. Returns :meth:`_take_in`'s end."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[bool] = loop.create_future()

        def readable() -> None:
            try:
                outcome = self._take_in(worker)
            except Exception as exc:
                loop.remove_reader(worker.fd)
                if not ended.done():
                    ended.set_exception(exc)
                return
            if outcome is not None:
                loop.remove_reader(worker.fd)  # nothing more to read after the end
                if not ended.done():
                    ended.set_result(outcome)

        loop.add_reader(worker.fd, readable)
        try:
            return await ended
        finally:
            loop.remove_reader(worker.fd)

    def _dispatch(self, worker: _WorkerHandle, reply: Reply) -> None:
        if reply.stats is not None:
            if self._stats is None:
                self._stats = source_stats(self.pool.setup.plan.dataset)
            merge_stats(self._stats, reply.stats)
        if reply.job == SETUP_JOB:
            if reply.status == Status.READY:
                worker.ready = True
                self.pool.note_ready()
                if reply.meta is not None:  # its dataset's state as it starts
                    self.delivered.started(worker.id, reply.meta)
            else:  # setup or worker_init_fn failed: its tasks raise it, in their turn
                worker.setup_error = reply.value
                for job, waiting in self._pending.items():  # asked before it failed
                    if waiting.worker is worker and not waiting.waiter.done():
                        waiting.reply = Reply(job, Status.ERROR, reply.value)
                        waiting.waiter.set_result(None)
                self._changed.notify()
            return
        worker.outstanding -= 1
        self._changed.notify()
        pending = self._pending.get(reply.job)
        if pending is not None and not pending.waiter.done():  # done: cancelled
            pending.reply = reply
            pending.waiter.set_result(None)

    async def _exitcode(self, worker: _WorkerHandle) -> int | None:
        # The socket closes as the process exits; its status follows within moments.
        with anyio.move_on_after(5):
            while worker.process.exitcode is None:
                await anyio.sleep(0.005)
        return worker.process.exitcode  # type: ignore[no-any-return]

    def _fail(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error
            self._tg.cancel_scope.cancel()


class MapPoolEpoch(PoolEpoch):
    """A map-style epoch on the workers: job ``k`` (an index batch, or an index) goes to
    worker ``k % num_workers`` as its task ``k // num_workers``.

    Persistent workers after a break: torch's have run exactly the tasks it had sent, which
    are ``prefetch_factor * num_workers`` plus one per batch the consumer took (the epoch's
    first ``due`` tasks), so their global RNGs (``random``, numpy's, torch's) go on from
    there in the next epoch. This pool sends as far ahead as its window lets it, whatever
    the consumer took, so its workers may have run further, or (a break before the pipeline
    sent its next tasks) less far. Rather than hold tasks back (which slowed fast epochs
    down), each task goes with its number and ``due`` as of its sending
    (:attr:`~aloader.workers._worker.Request.mark`): one past ``due`` runs after a snapshot of the
    worker's RNGs. When the epoch ends (:meth:`settle`), ``due`` is final: a worker sent
    tasks past it is told to put back the snapshot of its first one (a ``ROLLBACK``, which
    the worker answers with nothing), and one sent fewer is sent the tasks it lacks, their
    keys drawn from the sampler if the pipeline had not yet, their answers dropped as those
    of any cancelled job. No result of a task past ``due`` reaches the consumer: the epoch's
    jobs were cancelled. What a task changes besides the global RNGs (a dataset's own state)
    is not undone. Where this does not apply: an async dataset or ``max_concurrency`` (the
    worker runs its tasks concurrently: their draws interleave by timing, as no torch
    worker's do), an async sampler (its keys cannot be drawn at the end: the tasks the
    pipeline had not drawn stay unsent). Iterable datasets settle the same way (see
    :class:`ReplicaPoolEpoch`).
    """

    def __init__(self, pool: WorkerPool, loader_epoch: int = 0) -> None:
        super().__init__(pool, loader_epoch)
        #: The epoch's batch number of job 0 (a resumed epoch's first batch), modulo the
        #: workers: batch ``k`` of the epoch goes to worker ``k % num_workers``, resumed or
        #: not, as torchdata resumes its workers' cycle (each worker's own state goes on).
        self.shift = 0
        self._settles = pool.persistent and not pool.setup.plan.needs_event_loop
        self._keys: Iterator[Any] | None = None
        self._drawn: dict[int, Any] = {}  # job -> its key, drawn and not yet sent
        self._count = 0  # keys drawn

    def route(self, key: Any, seq: int) -> tuple[int, int, int, Kind, Any]:
        count, shift = self.pool.num_workers, self.shift
        worker = (seq + shift) % count
        return worker, worker, (seq + shift) // count - (worker < shift), Kind.TASK, key

    def keys(self, keys: Iterator[Any] | AsyncIterator[Any]) -> Iterator[Any] | AsyncIterator[Any]:
        """The epoch's ``keys``, kept until their tasks are sent (see the class docstring).

        Keys drawn on the consumer's calls (:class:`~aloader.pipeline._pipeline.PacedKeys`) are read
        as they are, and recorded; those the pipeline had not read are taken at the end from
        what the consumer's calls drew (exactly torch's, so never drawing more)."""
        if not self._settles:
            return keys
        if isinstance(keys, PacedKeys):
            keys.on_read = self._note
            self._keys = keys.buffered()
            return keys
        if not isinstance(keys, Iterator):
            return keys
        self._keys = keys
        return self

    def __iter__(self) -> MapPoolEpoch:
        return self

    def __next__(self) -> Any:
        assert self._keys is not None
        key = next(self._keys)
        self._note(key)
        return key

    def _note(self, key: Any) -> None:
        """The pipeline drew ``key``, the next job's."""
        self._drawn[self._count] = key
        self._count += 1

    def mark(self, seq: int) -> tuple[int, int] | None:
        if not self._settles or self.taken is None:
            return None
        self._drawn.pop(seq, None)
        return seq, self._due()

    def settle(self) -> None:
        if not self._settles or self.taken is None:
            return
        due = self._due()
        if self._keys is not None:
            with contextlib.suppress(Exception):  # the sampler's end, or its error: no more
                while self._count < due:
                    next(self)
        count = self.pool.num_workers
        for worker_id, worker in enumerate(self.pool.workers):
            if worker.setup_error is not None:  # it exited after its setup failed: nothing ran
                continue
            place = (worker_id - self.shift) % count  # its turn in the epoch's cycle
            torchs = self._torchs(place, due)  # tickets torch sent it
            first = place + count * torchs  # its first task torch would not have sent
            if self._sent[worker_id] > torchs:
                self._send(worker, self._request(worker, Kind.ROLLBACK, -1, first), False)
                continue
            for seq in range(place + count * self._sent[worker_id], first, count):
                if seq not in self._drawn:  # past the sampler's end
                    break
                worker.outstanding += 1  # answered in a later epoch, or never
                request = self._request(worker, Kind.TASK, next(self.pool.jobs),
                                        self._drawn.pop(seq))
                self._send(worker, request, False)
        self._drawn.clear()


class ReplicaPoolEpoch(PoolEpoch):
    """An iterable epoch on the workers, each iterating its own replica of the dataset.

    Its jobs' keys (:meth:`keys`) are requests for the next batch of one replica, assigned in
    turn over the replicas not yet known to be exhausted; a request answered "exhausted"
    yields :data:`~aloader.pipeline._pipeline.SKIP` (so does one assigned to a replica since found
    exhausted), and the epoch ends once every replica is exhausted. Timing only decides how
    many requests an exhausted replica is sent; the batches that remain interleave the live
    replicas in turn whatever it is.

    Replica ``w`` is worker ``w``'s, except in an epoch resumed from a state saved with
    another number of workers ``W`` (:meth:`resume` with ``saved``): its rest is made by the
    ``W`` saved replicas (one, the loader's, when ``W`` is 0), replica ``r`` served by worker
    ``r % num_workers`` as a *virtual replica* that sees the worker facts of the run that
    saved it (see :mod:`aloader._workerinfo`). Each replica is a lane of its own, so that a
    worker serving several answers each one's requests in order.

    Persistent workers after a break (:attr:`settles`, which the loader's epoch kind sets for
    a plain iterable dataset in an epoch not resumed): as with :class:`MapPoolEpoch`, torch's
    workers have drawn the batches of exactly the first ``due`` requests, sent in turn (each
    worker's replica draws a batch per request, then a new epoch starts a new iterator), so
    what their global RNGs give next follows from that. Requests go marked, and a worker's
    replica saves its RNGs before it draws a batch past ``due`` (it draws one ahead of the
    requests, :mod:`aloader.workers._worker`). When the epoch ends, each worker is sent the requests
    torch had sent it that this pool had not (their answers dropped), then a ``ROLLBACK`` to
    the first batch torch had not asked of it. Not after a replica has ended: which of
    torch's later requests skip it then depends on when its end was seen.
    """

    def __init__(self, pool: WorkerPool, loader_epoch: int = 0) -> None:
        super().__init__(pool, loader_epoch)
        count = pool.num_workers
        self._turn = 0
        self._lanes = count  # replicas
        self._saved: int | None = None  # the saved run's num_workers (virtual replicas)
        self._assigned = [0] * count  # requests assigned to each replica
        self._requests = 0  # requests assigned in all
        self._tickets: dict[int, int] = {}  # job sequence number -> ticket
        self._resume_states: list[Any] = [None] * count  # sent with each replica's ticket 0
        #: The replicas' positions as the consumer takes the batches (Results.metas).
        self.delivered = Delivered([None] * count, 0)
        #: Whether a break is settled as torch's would leave the workers (class docstring).
        self.settles = False
        #: Each worker's replica's final state once it ended (None: not ended, or not a
        #: protocol state), which a persistent worker's dataset carries to the next epoch.
        self.finals: list[Any] = [None] * count

    def resume(self, turn: int, states: list[Any], begin: list[Any],
               saved: int | None = None) -> None:
        """Start where a saved epoch was: replica ``turn`` is asked first, and replica ``r``
        resumes from ``states[r]`` (None: its start); ``begin`` are the replicas' positions
        until they deliver. ``saved``: the saved run's ``num_workers`` when it differs from
        the pool's (its ``max(1, saved)`` replicas run as virtual replicas)."""
        lanes = len(states)
        self._turn = turn
        self._lanes = lanes
        self._saved = saved
        self._assigned = [0] * lanes
        self._sent = [0] * lanes
        self._resume_states = list(states)
        self.delivered = Delivered(list(begin), turn, local=saved == 0)

    def note_end(self, lane: int, meta: Any) -> None:
        if self._saved is None:  # a worker's own replica (not a virtual one)
            self.finals[lane] = meta

    def route(self, key: Any, seq: int) -> tuple[int, int, int, Kind, Any]:
        ticket = self._tickets.pop(seq)
        state = self._resume_states[key] if ticket == 0 else None
        if self._saved is None:
            return key, key, ticket, Kind.NEXT, state
        return key % self.pool.num_workers, key, ticket, Kind.NEXT, (
            "replica", key, self._saved, state)

    def mark(self, seq: int) -> tuple[int, int] | None:
        if not self.settles or self.taken is None:
            return None
        return seq, self._due()

    def settle(self) -> None:
        if not self.settles or self.taken is None or self._exhausted:
            return
        due = self._due()
        count = self.pool.num_workers
        for worker_id, worker in enumerate(self.pool.workers):
            if worker.setup_error is not None:  # it exited after its setup failed: nothing ran
                continue
            torchs = self._torchs(worker_id, due)
            for ticket in range(self._sent[worker_id], torchs):
                worker.outstanding += 1  # answered in a later epoch, or never
                request = self._request(worker, Kind.NEXT, next(self.pool.jobs), None,
                                        (worker_id + count * ticket, due))
                self._send(worker, request, False)
            self._send(worker, self._request(worker, Kind.ROLLBACK, -1,
                                             worker_id + count * torchs), False)

    def keys(self) -> AsyncIterator[int]:
        """The replica asked for each next batch, in turn."""
        return self

    def __aiter__(self) -> ReplicaPoolEpoch:
        return self

    async def __anext__(self) -> int:
        # Called once per job, in sequence order: request number n is job n.
        count = self._lanes
        for step in range(count):
            lane = (self._turn + step) % count
            if lane not in self._exhausted:
                self._turn = lane + 1
                self._tickets[self._requests] = self._assigned[lane]
                self._assigned[lane] += 1
                self._requests += 1
                return lane
        raise StopAsyncIteration


class Delivered:
    """The replicas' positions after the batches the consumer took (a ``Results.metas``).

    Each batch's position arrives with the worker's reply (:meth:`note_meta`); taking the
    batch pops it, which records it as its replica's last and returns what the loader's
    state needs then: every replica's last position, and the replica asked next (batches are
    asked of the replicas in turn); with ``local``, the one replica's position alone (the
    rest of an epoch saved without workers).
    """

    __slots__ = ("got", "local", "states", "turn")

    def __init__(self, states: list[Any], turn: int, local: bool = False) -> None:
        self.got: dict[int, tuple[int, Any]] = {}
        self.states = states
        self.turn = turn
        self.local = local

    def started(self, lane: int, state: Any) -> None:
        """Worker ``lane`` started with ``state`` (a map-style dataset's): its state until
        the consumer takes one of its batches."""
        if self.states[lane] is None:
            self.states[lane] = state

    def pop(self, seq: int, default: Any = None) -> Any:
        got = self.got.pop(seq, None)
        if got is None:
            return default
        lane, meta = got
        if self.local:
            return meta
        self.states[lane] = meta
        self.turn = (lane + 1) % len(self.states)
        return ("workers", tuple(self.states), self.turn)
