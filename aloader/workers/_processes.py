"""A loader's worker processes: :class:`WorkerPool` starts them, owns the loader's ends of
their socket pairs, and stops them.

The pool holds no event-loop object, so persistent workers serve epochs run by different loops
(the synchronous facade runs each epoch on a loop of its own); an epoch's use of the pool is
:mod:`aloader.workers._pool_epoch`'s.

Start method: by default workers are forks of a template of the loader's process, forked when
the first loader with workers is built (see :mod:`aloader.workers._spawn`; ``spawn`` where there is
no fork server). ``fork`` itself is unsafe in a process that runs threads, and a loader always
has some once it iterates (the synchronous facade's loop thread, anyio's worker threads); the
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

Invariant: every process a pool started is reaped and every shared-memory segment its workers
left is swept, whatever ends the pool (an epoch's end, the loader's close or collection, the
interpreter's exit); a forked copy of the loader's process owns nothing and stops nothing.
"""

from __future__ import annotations

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
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from .._exceptions import WorkerError
from .._log import worker_log
from . import _shm, _spawn
from ._worker import FRAME, WorkerSetup, worker_main

if TYPE_CHECKING:
    from ._pool_epoch import PoolEpoch

__all__ = ("WorkerPool", "exit_message")

# Seconds a worker may take to exit after its socket closes before it is terminated.
_GRACE = 0.5

_FRAME = FRAME
_pool_serial = itertools.count()
# The loader's socket ends of every live pool: a forked worker closes them all.
_LOADER_FDS: set[int] = set()



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
        #: Each worker's global generators as its last idle answer left them (persistent
        #: workers send them, see aloader.workers._rngs), or None.
        self.rngs: list[Any] = [None] * setup.num_workers
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
        # A forked worker inherits this process as it is now; any other is a child of a server
        # (the template, a fork server) started earlier: it gets the environment of now.
        environ = None if fork else dict(os.environ)
        process = self.context.Process(  # type: ignore[attr-defined]
            target=worker_main,
            args=(theirs, worker_id, self.shm_owner, self.setup if fork else None, inherited,
                  environ),
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
