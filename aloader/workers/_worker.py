"""Worker processes: the protocol with the loader, the worker's setup, and the worker's main.

This module owns what runs inside a worker process: its setup (:class:`WorkerSetup`), how it
serves (:class:`ServeTasks` for map-style datasets, :class:`ServeReplica` for iterable ones,
chosen by the loader), and the messages it exchanges with the loader. What the worker knows
about itself (``WorkerInfo``, ``get_worker_info()``) lives in :mod:`aloader._workerinfo`, which
this module sets, so that datasets and sources can read it without importing this module.

A worker serves one loader's pool (see :mod:`aloader.workers._processes`) over a socket pair.
Messages both ways go through :mod:`aloader.workers._shm`, so arrays in batches cross in
shared memory.

The protocol (every message a :class:`Request` or a :class:`Reply`):

* Parent to worker: ``Request(kind, job, epoch, key, released, loader_epoch)``, where ``kind``
  is :attr:`Kind.TASK` (map-style: load and collate the index batch ``key``) or
  :attr:`Kind.NEXT` (iterable: the next batch of this worker's replica in epoch ``epoch``;
  ``key`` is None) or :attr:`Kind.ROLLBACK` (a persistent pool's epoch ended in a break: put
  back the global RNG states saved before task ``key``, answered with nothing; a TASK's or
  NEXT's ``mark`` says which to save, see :class:`~aloader.workers._pool_epoch.MapPoolEpoch` and
  :class:`~aloader.workers._pool_epoch.ReplicaPoolEpoch`); or
  EOF: exit. ``epoch`` tells the pool's epochs apart; ``loader_epoch`` is
  the loader's epoch number, which a stream iterated in the worker uses (see
  :attr:`WorkerInfo.epoch`). ``released`` names the worker's segments the loader no longer
  maps, for the worker to write its next batches into.
* Worker to parent: once set up, ``Reply(SETUP_JOB, Status.READY, None)`` or ``Reply(SETUP_JOB,
  Status.FAILED, error)``; then one answer per request, ``Reply(job, Status.OK, batch, stats,
  meta)``, ``Reply(job, Status.ERROR, error, stats)`` or ``Reply(job, Status.END, None, stats)``
  (replica exhausted), where ``error`` is a :class:`RemoteError`, ``stats`` is what the worker's
  sources counted since its previous report
  (:class:`~aloader.streams._sourcestats.StatsReporter`), or None, ``meta`` where the iterable
  replica was once the batch was drawn (:mod:`aloader.streams._resume`), or None, and ``extra``
  what else the worker counted: ``(failures, attempted, timings, empty, sent, rngs)``: the samples
  that failed within the failure budget as ``[(index, RemoteError), ...]`` and the samples of an
  iterable replica attempted since its previous answer (see :mod:`aloader.pipeline._failures`),
  the worker's stage timings since its previous report (:meth:`aloader._stats.Collector.report`)
  or None, whether an OK answer has no batch because every sample of it failed within the budget,
  the answer's send time (``perf_counter_ns``, the loader's transfer timing), and the global
  generators' states of a persistent worker idle after this answer (else None). The first
  ``NEXT`` request of an epoch may carry, as its ``key``, the saved state its replica resumes
  from.
* Reports (``stats`` and ``timings``) travel in blocks: making one costs about what pickling
  a small batch does. An answer carries the report when it is not OK, when no other answer
  is known to follow it (no request waits in the socket, none is being worked on), or when
  ``_REPORT_EVERY`` answers went without one; otherwise both are None. So the last answer of
  an epoch always carries one, and the loader's totals are exact once it is in.

On the socket a message is a plain tuple with int codes (:meth:`Request.wire`,
:meth:`Reply.wire`), rebuilt on receipt (:meth:`Request.of`, :meth:`Reply.of`): a NamedTuple
or an enum member would pickle by reference and cost each message two to three times as much.

The worker fetches with the same :class:`~aloader.pipeline._plan.FetchPlan` the loader would use
without workers. Plain map-style datasets are served by a loop that loads one batch per task
(the plan says whether it can: :attr:`~aloader.pipeline._plan.FetchPlan.needs_event_loop`);
async
datasets, ``max_concurrency`` and iterable datasets run the loader's own pipeline
(:class:`~aloader.pipeline._epoch.MapEpoch`, :class:`~aloader.pipeline._epoch.IterableEpoch`)
on an event
loop inside the worker, so each worker keeps ``max_concurrency`` fetches in flight.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import pickle
import random
import select
import signal
import struct
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import IntEnum
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

import anyio
import numpy as np

from .. import _workerinfo
from .._workerinfo import WorkerInfo, _set_worker_info, get_worker_info
from ..data._sampler import is_stateful
from ..pipeline._epoch import IterableEpoch, MapEpoch
from ..pipeline._plan import FetchPlan
from ..pipeline._results import NO_BATCH, Results
from ..streams._resume import adopt_world, open_replica, parse, prelude
from ..streams._sourcestats import StatsReporter, source_stats
from . import _shm, _spawn
from ._rngs import rngs_from_json

__all__ = (
    "FRAME",
    "SETUP_JOB",
    "Kind",
    "Reply",
    "Request",
    "ServeReplica",
    "ServeTasks",
    "Status",
    "WorkerInfo",
    "WorkerSetup",
    "get_worker_info",
    "replica_copy",
    "rng_state",
    "set_rng_state",
    "worker_main",
)


# The protocol (see the module docstring) ---------------------------------------------------------
class Kind(IntEnum):
    """What the loader asks of a worker (:attr:`Request.kind`)."""

    TASK = 0  # map-style: load and collate an index batch
    NEXT = 1  # iterable: the next batch of this worker's replica
    ROLLBACK = 2  # after a break: undo the global RNG draws of the tasks from ``key``


class Status(IntEnum):
    """What a worker answers (:attr:`Reply.status`)."""

    READY = 0  # set up: serving
    FAILED = 1  # setup or worker_init_fn raised: the value is the RemoteError
    OK = 2  # the value is the batch
    ERROR = 3  # the value is the RemoteError of the fetch
    END = 4  # iterable: this worker's replica is exhausted


# The job number of the setup report, which answers no request.
SETUP_JOB = -1
# Answers a busy worker sends without its report before one carries it (see the module
# docstring): a live DataLoader.stats() lags by at most this many batches per worker.
_REPORT_EVERY = 16
_now = time.perf_counter_ns
# A message's length before it on the socket: multiprocessing's framing (Connection.send_bytes
# and recv_bytes), which the loader's reader parses too (aloader.workers._processes).
FRAME = struct.Struct("!i")
_KINDS = tuple(Kind)
_STATUSES = tuple(Status)


class Request(NamedTuple):
    """A message from the loader to a worker."""

    kind: Kind
    job: int  # the pool's serial number of this request, which its Reply carries back
    epoch: int  # the pool's epoch: a new one starts a new replica (iterable)
    key: Any  # TASK: the index batch; NEXT: None
    released: list[str]  # this worker's segments the loader no longer maps
    loader_epoch: int  # the loader's epoch number (WorkerInfo.epoch)
    # TASK or NEXT of a persistent pool: (the task's sequence number in the epoch, the first
    # one torch would not have sent yet); a task at or past it runs after a snapshot of the
    # RNGs (see _Snapshots).
    mark: tuple[int, int] | None = None

    def wire(self) -> tuple[Any, ...]:
        """The message as it crosses the socket: a plain tuple, the kind as an int."""
        return (int(self.kind), self.job, self.epoch, self.key, self.released, self.loader_epoch,
                self.mark)

    @classmethod
    def of(cls, wire: tuple[Any, ...]) -> Request:
        """The message :meth:`wire` made."""
        return cls._make((_KINDS[wire[0]], *wire[1:]))


class Reply(NamedTuple):
    """A message from a worker to the loader."""

    job: int  # the Request's job, or SETUP_JOB
    status: Status
    value: Any  # the batch (OK), a RemoteError (ERROR, FAILED), or None
    stats: Any = None  # the worker's source statistics since its previous reply, or None
    meta: Any = None  # iterable: where the replica was once the batch was drawn, or None
    extra: Any = None  # (failures, attempted, timings, empty) since its previous reply, or None

    def wire(self) -> tuple[Any, ...]:
        """The message as it crosses the socket: a plain tuple, the status as an int."""
        return (self.job, int(self.status), self.value, self.stats, self.meta, self.extra)

    @classmethod
    def of(cls, wire: tuple[Any, ...]) -> Reply:
        """The message :meth:`wire` made."""
        return cls._make((wire[0], _STATUSES[wire[1]], wire[2], wire[3], wire[4], wire[5]))


# Errors ------------------------------------------------------------------------------------------
class _KeyErrorMessage(str):
    """KeyError shows its argument with repr(); this keeps the traceback readable."""

    def __repr__(self) -> str:
        return str(self)


@dataclass
class RemoteError:
    """An exception raised in a worker, carried to the loader as type, place and traceback.

    Rebuilt like torch's ``ExceptionWrapper``: the same type, with the message
    ``Caught {Type} in DataLoader worker process {id}.`` followed by the worker's traceback
    (a RuntimeError when the type cannot be rebuilt from a message or imported here). The
    error's own attributes of plain values come back too (a ``FetchError``'s
    ``status_code``, ``source`` and ``offset``: code that branches on them works with
    workers as without).
    """

    exc_type: type[BaseException] | None
    type_name: str
    where: str
    text: str
    attrs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def capture(cls, error: BaseException, where: str) -> RemoteError:
        text = "".join(traceback.format_exception(error))
        exc_type: type[BaseException] | None = type(error)
        try:
            pickle.dumps(exc_type)
        except Exception:  # not importable by name: by value (a class of __main__), or not
            import cloudpickle

            try:
                cloudpickle.dumps(exc_type)
            except Exception:
                exc_type = None
        attrs = {name: value for name, value in getattr(error, "__dict__", {}).items()
                 if not name.startswith("_") and _plain(value)}
        return cls(exc_type, type(error).__name__, where, text, attrs)

    def rebuild(self) -> BaseException:
        message = f"Caught {self.type_name} {self.where}.\nOriginal {self.text}"
        exc_type = self.exc_type
        if exc_type is None:
            return RuntimeError(message)
        if exc_type is KeyError:
            return KeyError(_KeyErrorMessage(message))
        try:
            if getattr(exc_type, "message", None):
                error = exc_type(message=message)  # type: ignore[call-arg]
            else:
                error = exc_type(message)
        except Exception:  # the type takes other arguments
            return RuntimeError(message)
        for name, value in self.attrs.items():
            with contextlib.suppress(Exception):  # a read-only property, a slot
                setattr(error, name, value)
        return error


def _plain(value: Any) -> bool:
    """A value that crosses processes as itself (an exception's attribute worth keeping)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return True
    return isinstance(value, tuple) and all(_plain(v) for v in value)


def _strip_pipeline_notes(error: BaseException) -> BaseException:
    """Drop the worker-side pipeline's notes: they count batches per worker, not per epoch."""
    notes = getattr(error, "__notes__", None)
    if notes:
        error.__notes__ = [note for note in notes if not note.startswith("raised while")]
    return error


# Setup -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeTasks:
    """How a worker serves a map-style dataset: each task is a key to load and collate."""

    def run(self, server: _WorkerServer) -> None:
        if server.setup.plan.needs_event_loop:
            anyio.run(server.serve_tasks_async)
        else:
            server.serve_tasks()


@dataclass(frozen=True)
class ServeReplica:
    """How a worker serves an iterable dataset: each task asks for the next batch of this
    worker's replica, ``batch_size`` samples (one sample when None), the last incomplete
    batch dropped with ``drop_last``."""

    batch_size: int | None
    drop_last: bool

    def run(self, server: _WorkerServer) -> None:
        anyio.run(server.serve_replica, self)


@dataclass
class WorkerSetup:
    """What every worker of a pool receives once, at start.

    Attributes:
        plan: the fetch plan the loader would use without workers (no pin-memory transform).
        serve: how the worker serves its tasks (map-style keys, or its iterable replica).
        base_seed: the seed of the epoch that started the pool.
        num_workers: workers in the pool.
        worker_init_fn: called with the worker id once the worker is seeded.
        prefetch: batches each worker may run ahead (the loader's prefetch_factor).
        owner: the loader's process's shared-memory owner tag (:func:`aloader.workers._shm.owner`).
        preludes: per worker, the dataset state it starts with (an encoded final replica
            state, see :func:`aloader.streams._resume.prelude`), loaded after
            ``worker_init_fn`` as torchdata's workers load theirs; None: as pickled.
    """

    plan: FetchPlan
    serve: ServeTasks | ServeReplica
    base_seed: int
    num_workers: int
    worker_init_fn: Callable[[int], None] | None
    prefetch: int
    owner: str = field(default_factory=_shm.owner)
    preludes: list[Any] | None = None
    #: Persistent workers send their global generators' states with an answer after which
    #: they are idle (see aloader.workers._rngs).
    persistent: bool = False
    #: Per worker, the generators' states (JSON, see aloader.workers._rngs) it starts with,
    #: after worker_init_fn: a resumed state's; None: as seeded.
    rngs: list[Any] | None = None


def seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed this process's global RNGs for worker ``worker_id``; returns its seed.

    Python's ``random`` gets ``base_seed + worker_id``; numpy's global RNG gets the state
    ``SeedSequence([worker_id, base_seed]).generate_state(4)``, the very state torch derives
    with its ``_generate_state(base_seed, worker_id)``; torch is seeded with the seed too when
    the worker has imported it.
    """
    seed = base_seed + worker_id
    random.seed(seed)
    np.random.seed(np.random.SeedSequence([worker_id, base_seed]).generate_state(4))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
        torch.set_num_threads(1)  # as torch's workers: one intra-op thread each
    return seed


def rng_state() -> tuple[Any, Any, Any]:
    """This process's global RNG states: ``random``'s, numpy's, torch's (None unless the
    worker has imported torch)."""
    torch = sys.modules.get("torch")
    return (random.getstate(), np.random.get_state(),
            None if torch is None else torch.get_rng_state())


def set_rng_state(state: tuple[Any, Any, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch = sys.modules.get("torch")
    if torch is not None and state[2] is not None:
        torch.set_rng_state(state[2])


class _Snapshots:
    """A persistent worker's global RNG states, saved before each task of the epoch that
    torch's loader had not sent yet (a request's ``mark``: see :class:`~aloader.workers._pool_epoch.
    MapPoolEpoch`), so that after a break (``ROLLBACK``) the worker has drawn exactly what
    torch's has. A task is known by its job's sequence number in the epoch."""

    def __init__(self) -> None:
        self._due: int | None = None  # the tasks torch had sent, as of the latest mark
        self._saved: deque[tuple[int, tuple[Any, Any, Any]]] = deque()

    def clear(self) -> None:
        """A new epoch: nothing is saved, nothing marked."""
        self._due = None
        self._saved.clear()

    def note(self, mark: tuple[int, int] | None) -> None:
        """A request's mark: torch has sent the tasks before ``due`` since."""
        if mark is not None:
            self._due = due = mark[1]
            while self._saved and self._saved[0][0] < due:
                self._saved.popleft()

    def before(self, seq: int) -> None:
        """Task ``seq`` is about to draw: save the RNGs first if torch had not sent it."""
        if self._due is not None and seq >= self._due:
            self._saved.append((seq, rng_state()))

    def rollback(self, first: int) -> None:
        """Put back the RNGs as they were before task ``first`` (if it ran) and forget."""
        for seq, state in self._saved:
            if seq >= first:
                set_rng_state(state)
                break
        self._saved.clear()


def _watch_parent(owner: str) -> None:
    """Exit as soon as the loader's process dies, removing the segments left for it."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        _shm.WRITE_LOCK.acquire()  # for good: no segment may appear after the sweep
        _shm.sweep(_shm.prefix(owner))
        os._exit(1)

    threading.Thread(target=watch, name="aloader-parent-watch", daemon=True).start()


# The worker's main -------------------------------------------------------------------------------
class _WorkerServer:
    """The worker's side of the protocol: receives requests, sends replies."""

    def __init__(self, conn: Connection, worker_id: int, setup: WorkerSetup) -> None:
        self.conn = conn
        self.id = worker_id
        self.setup = setup
        self.where = f"in DataLoader worker process {worker_id}"
        self.codec = _shm.Codec(setup.owner, os.getpid(), tensors=True,
                                recycle=2 * max(1, setup.prefetch) + 2)
        self.stats = StatsReporter(setup.plan.dataset)
        self.failures = setup.plan.failures
        self._unreported = 0  # answers sent since the last that carried a report
        self._fd = conn.fileno()
        self._readable = select.poll()
        self._readable.register(self._fd, select.POLLIN)
        #: Whether a request received is still being worked on (the async loop's jobs).
        self.working: Callable[[], bool] = bool

    def _extra(self, empty: bool, timings: Any, rngs: Any = None) -> Any:
        report = None if self.failures is None else self.failures.take_unreported()
        failed, seen = report or ([], 0)
        return ([(index, RemoteError.capture(_strip_pipeline_notes(error), self.where))
                 for index, error in failed], seen, timings, empty, _now(), rngs)

    def _more(self) -> bool:
        """Whether another answer is known to follow: a request waits in the socket, or one
        received is still being worked on."""
        return self.working() or bool(self._readable.poll(0))

    def send(self, job: int, status: Status, value: Any, meta: Any = None) -> None:
        empty = value is NO_BATCH  # every sample failed within the budget: no batch
        if empty:
            value = None
        self._unreported += 1
        stats = timings = None
        idle = not self._more()
        if status != Status.OK or self._unreported >= _REPORT_EVERY or idle:
            self._unreported = 0
            stats = self.stats.report()
            plan = self.setup.plan
            timings = plan.stats.report(plan.tuner)
        # A persistent worker idle after this answer (the last of an epoch always is): its
        # generators as the next epoch starts drawing from them, for a state between epochs.
        extra = self._extra(empty, timings,
                            rng_state() if idle and self.setup.persistent else None)
        try:
            # By value only what plain pickling cannot take (a class the setup brought by
            # value): what is importable by name resolves to the loader's own object.
            data = self.codec.encode(Reply(job, status, value, stats, meta, extra).wire(),
                                     by_value="fallback")
        except Exception as exc:  # an unpicklable batch reaches the consumer as its error
            error = RemoteError.capture(exc, self.where)
            data = self.codec.encode(Reply(job, Status.ERROR, error, stats, None,
                                           extra).wire())
        self._write(data)

    def _write(self, data: bytes) -> None:
        """Send a message, its length and it in one write: ``Connection.send_bytes`` makes
        two above 16 KiB, and a loader waiting for the answer would wake for each."""
        header = FRAME.pack(len(data))
        total = len(header) + len(data)
        sent = os.writev(self._fd, (header, data))
        if sent < total:  # interrupted: the rest, in order
            rest = memoryview(header + data)[sent:]
            while rest:
                rest = rest[os.write(self._fd, rest):]

    def fail(self, job: int, error: BaseException) -> None:
        self.send(job, Status.ERROR,
                  RemoteError.capture(_strip_pipeline_notes(error), self.where))

    def receive(self) -> Request | None:
        try:
            request = Request.of(_shm.decode(self.conn.recv_bytes()))
        except EOFError:  # the loader closed its end
            return None
        if request.released:
            self.codec.release(request.released)
        _workerinfo._set_served_epoch(request.loader_epoch)
        self.setup.plan.epoch = request.loader_epoch  # sample_rng's epoch
        return request

    async def areceive(self) -> Request | None:
        if not self._readable.poll(0):  # a busy worker's next request is there already
            await anyio.wait_readable(self.conn.fileno())
        return self.receive()

    # Plain map-style datasets: one batch per task, no event loop. A persistent pool's tasks
    # come marked: one torch would not have sent yet runs after a snapshot of the global RNGs,
    # so that after a break (ROLLBACK) the worker has drawn exactly what torch's has.
    def serve_tasks(self) -> None:
        plan = self.setup.plan
        state = state_of(self.setup.plan.dataset)
        snapshots = _Snapshots()
        epoch = None
        while (request := self.receive()) is not None:
            if request.epoch != epoch:  # an epoch that ended without a break left these
                epoch = request.epoch
                snapshots.clear()
            if request.kind == Kind.ROLLBACK:
                snapshots.rollback(request.key)
                continue
            if request.mark is not None:
                snapshots.note(request.mark)
                snapshots.before(request.mark[0])
            try:
                batch = plan.throttled_sync(plan.load_sync, request.key)
                meta = state()
            except Exception as exc:
                self.fail(request.job, exc)
            else:
                self.send(request.job, Status.OK, batch, meta)

    # Async datasets and max_concurrency: the loader's pipeline over the keys received.
    async def serve_tasks_async(self) -> None:
        jobs: deque[int] = deque()
        self.working = lambda: bool(jobs)

        async def keys() -> AsyncIterator[Any]:
            while (request := await self.areceive()) is not None:
                jobs.append(request.job)
                yield request.key

        epoch = MapEpoch(self.setup.plan, Results(self.setup.prefetch, True, skips=True),
                         keys())
        state = state_of(self.setup.plan.dataset)  # as of its answer: concurrent fetches interleave
        epoch.start()
        try:
            while True:
                try:
                    batch, error = await epoch.next()
                except StopAsyncIteration:
                    return
                job = jobs.popleft()
                if error is not None:
                    self.fail(job, error)
                else:
                    try:
                        meta = state()
                    except Exception as exc:
                        self.fail(job, exc)
                    else:
                        self.send(job, Status.OK, batch, meta)
        finally:
            epoch.stop()

    # Iterable datasets: one replica iterator per epoch, batched by the loader's pipeline;
    # several (virtual replicas, each a lane) in an epoch resumed from another num_workers.
    # A persistent pool's requests come marked (see
    # aloader.workers._pool_epoch.ReplicaPoolEpoch): the replica draws each batch past torch's
    # requests after a snapshot of the global RNGs (it draws one batch ahead of the requests),
    # put back by a ROLLBACK after a break.
    async def serve_replica(self, serve: ServeReplica) -> None:
        current: int | None = None
        # This epoch's replicas by lane; None: one that failed to start (its requests END).
        epochs: dict[int, IterableEpoch | None] = {}
        # This worker's own replica's state once it ended, sent with END (see final_state).
        final: list[Any] = []
        snapshots = _Snapshots()
        count = self.setup.num_workers

        def before_draw(batch: int) -> None:  # this worker's batch n is the epoch's job n
            snapshots.before(self.id + count * batch)

        async def stop() -> None:
            for epoch in epochs.values():
                if epoch is not None:
                    epoch.stop()
                    await epoch.done.wait()
            epochs.clear()
            final.clear()

        try:
            while (request := await self.areceive()) is not None:
                job, epoch_id = request.job, request.epoch
                if epoch_id != current:
                    current = epoch_id
                    await stop()
                    snapshots.clear()
                if request.kind == Kind.ROLLBACK:  # nothing more is drawn in this epoch
                    await stop()
                    snapshots.rollback(request.key)
                    current = None
                    continue
                snapshots.note(request.mark)
                lane, state, slot = self._lane(request.key)
                if lane not in epochs:
                    epochs[lane] = None
                    try:
                        epochs[lane] = self._open_replica(
                            serve, lane, state, slot, request.loader_epoch,
                            before_draw if slot is None else None)
                    except Exception as exc:  # __iter__ failed: this replica is done
                        self.fail(job, exc)
                        continue
                epoch = epochs[lane]
                if epoch is None:
                    self.send(job, Status.END, None)
                    continue
                try:
                    batch, error = await epoch.next()
                except StopAsyncIteration:
                    if slot is None and not final:
                        final.append(final_state(epoch))
                    self.send(job, Status.END, None, final[0] if slot is None else None)
                    continue
                if error is not None:
                    self.fail(job, error)
                else:
                    self.send(job, Status.OK, batch, epoch.results.meta)
        finally:
            for epoch in epochs.values():
                if epoch is not None:
                    epoch.stop()

    def _lane(self, key: Any) -> tuple[int, Any, tuple[int, int, int | None] | None]:
        """A NEXT request's (lane, saved state or None, the saved worker slot of a virtual
        replica: (id, num_workers, base seed or None for this loader's), num_workers 0 for
        the loader's process; None for this worker's own replica)."""
        if isinstance(key, tuple) and key and key[0] == "replica":
            _, lane, slot, state = key
            return lane, state, slot
        return self.id, key, None

    def _open_replica(self, serve: ServeReplica, lane: int, state: Any,
                      slot: tuple[int, int, int | None] | None, loader_epoch: int,
                      before_draw: Callable[[int], None] | None = None) -> IterableEpoch:
        """Start a replica's epoch: this worker's own, or a virtual replica (a copy of the
        dataset that sees worker ``slot`` of the saved run, see aloader._workerinfo)."""
        setup = self.setup
        dataset = setup.plan.dataset
        if slot is None:
            parsed = parse(dataset, state, (self.id, setup.num_workers))
            source, snapshot = open_replica(dataset, parsed)
            epoch = IterableEpoch(setup.plan, Results(1, True), source, serve.batch_size,
                                  serve.drop_last, snapshot, before_draw)
            epoch.start()
            return epoch
        replica = replica_copy(dataset)
        adopt_world(replica, state)  # a replica of another rank: on that rank's shards
        lane_id, saved, seed = slot
        info = None if saved == 0 else WorkerInfo(
            id=lane_id, num_workers=saved,
            seed=setup.base_seed + lane_id if seed is None else seed, dataset=replica)
        with _workerinfo.as_replica(info, None if info is None else loader_epoch):
            parsed = parse(replica, state, (lane_id, saved) if saved else (0, 1))
            source, snapshot = open_replica(replica, parsed)
            epoch = IterableEpoch(setup.plan, Results(1, True), source, serve.batch_size,
                                  serve.drop_last, snapshot)
            epoch.start()  # its task copies this context (the worker's loop is asyncio's)
        return epoch


def _no_state() -> None:
    return None


def state_of(dataset: Any) -> Callable[[], Any]:
    """What a map-style task's answer carries besides its batch: the dataset's
    ``state_dict()`` once the batch is loaded, where it has torchdata's protocol (the loader
    keeps each worker's as of the batches its consumer took), else None."""
    return dataset.state_dict if is_stateful(dataset) else _no_state


def final_state(epoch: IterableEpoch) -> Any:
    """The protocol state of an ended replica (what its dataset and iterator say once the
    source is exhausted: a counter of epochs, a random generator), or None: what a
    persistent worker's dataset carries into the next epoch, which a state taken between
    epochs keeps (see aloader.loader._epochs.IterableEpochs)."""
    snapshot = epoch.final_snapshot()
    return snapshot if snapshot is not None and snapshot[0] == "protocol" else None


def replica_copy(dataset: Any) -> Any:
    """A virtual replica's own copy of ``dataset``, whose sources count into ``dataset``'s
    (the counters are shared), so that statistics and failure budgets see its reads."""
    try:
        return copy.deepcopy(dataset, {id(stats): stats for stats in source_stats(dataset)})
    except Exception as exc:
        exc.add_note("raised while copying the dataset for a replica of an epoch saved with "
                     "another num_workers (each saved worker's replica resumes in a copy)")
        raise


def _adopt_environ(environ: dict[str, str]) -> None:
    """Make ``os.environ`` (and the C environment under it) exactly ``environ``."""
    for key in [key for key in os.environ if key not in environ]:
        del os.environ[key]
    for key, value in environ.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def worker_main(
    conn: Connection,
    worker_id: int,
    owner: str,
    setup: WorkerSetup | None,
    inherited_fds: list[int],
    environ: dict[str, str] | None = None,
) -> None:
    """The worker process's target: set up, report, then serve tasks until told to stop.

    Args:
        conn: this worker's end of its socket pair with the loader.
        worker_id: this worker's number.
        owner: the shared-memory owner tag of the loader's process.
        setup: the setup itself under the fork start method; None when it arrives as the
            first message (the default, spawn, forkserver).
        inherited_fds: the loader's ends of its workers' socket pairs, inherited by a forked
            worker; closed here so that the loader's death reads as EOF everywhere.
        environ: the loader's ``os.environ`` when it started this worker (None: forked from
            it, so already its own). A worker forked from a server started earlier (the
            template, a fork server) would otherwise see the environment of that moment, not
            credentials or endpoints set since, as torch's forked workers do. (The working
            directory travels with multiprocessing's own preparation data.)
    """
    if environ is not None:
        _adopt_environ(environ)
    for fd in inherited_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _spawn.forget_placeholder()
    # Ctrl-C reaches the whole process group: the loader handles it and stops its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(owner)
    where = f"in DataLoader worker process {worker_id}"
    try:
        if setup is None:
            try:
                setup = _shm.decode(conn.recv_bytes(), unlink=False, private=True)
            except Exception as exc:
                exc.add_note(
                    "raised while unpickling the dataset, collate_fn and worker_init_fn in the "
                    "worker (what they pickled by name must be importable there too)"
                )
                raise
        assert setup is not None
        seed = seed_worker(setup.base_seed, worker_id)
        _set_worker_info(WorkerInfo(id=worker_id, num_workers=setup.num_workers, seed=seed,
                                    dataset=setup.plan.dataset))
        if setup.worker_init_fn is not None:
            setup.worker_init_fn(worker_id)
        if setup.preludes is not None and setup.preludes[worker_id] is not None:
            dataset = setup.plan.dataset
            prelude(dataset, parse(dataset, setup.preludes[worker_id],
                                   (worker_id, setup.num_workers)))
        if setup.rngs is not None and setup.rngs[worker_id] is not None:
            set_rng_state(rngs_from_json(setup.rngs[worker_id]))
        # A map-style dataset's state as this worker starts, as torchdata's workers report
        # theirs: what a checkpoint says of a worker that has delivered nothing yet.
        start = state_of(setup.plan.dataset)() if isinstance(setup.serve, ServeTasks) else None
    except Exception as exc:
        codec = _shm.Codec(owner, os.getpid())
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            failed = Reply(SETUP_JOB, Status.FAILED, RemoteError.capture(exc, where))
            conn.send_bytes(codec.encode(failed.wire(), by_value="fallback"))
        return
    worker = _WorkerServer(conn, worker_id, setup)
    try:
        conn.send_bytes(worker.codec.encode(
            Reply(SETUP_JOB, Status.READY, None, meta=start).wire(), by_value="fallback"))
        setup.serve.run(worker)
    except (BrokenPipeError, ConnectionResetError):  # the loader has gone
        pass
    finally:
        # Answers still unread when the loader closed this worker's socket (or died) never
        # will be: remove their segments, and all the loader's if it died.
        parent = multiprocessing.parent_process()
        dead = parent is not None and bool(wait([parent.sentinel], 0))
        _shm.sweep(_shm.prefix(owner) if dead else _shm.prefix(owner, os.getpid()))
