"""Worker processes: ``get_worker_info()``, the read-only ``WorkerInfo``, and the worker's main.

A worker serves one loader's pool (see :mod:`aloader._pool`) over a socket pair. Messages both
ways go through :mod:`aloader._shm`, so arrays in batches cross in shared memory.

The protocol (every message a :class:`Request` or a :class:`Reply`):

* Parent to worker: ``Request(kind, job, epoch, key, released, loader_epoch)``, where ``kind``
  is :attr:`Kind.TASK` (map-style: load and collate the index batch ``key``) or
  :attr:`Kind.NEXT` (iterable: the next batch of this worker's replica in epoch ``epoch``;
  ``key`` is None); or EOF: exit. ``epoch`` tells the pool's epochs apart; ``loader_epoch`` is
  the loader's epoch number, which a stream iterated in the worker uses (see
  :attr:`WorkerInfo.epoch`). ``released`` names the worker's segments the loader no longer
  maps, for the worker to write its next batches into.
* Worker to parent: once set up, ``Reply(SETUP_JOB, Status.READY, None)`` or
  ``Reply(SETUP_JOB, Status.FAILED, error)``; then one answer per request,
  ``Reply(job, Status.OK, batch, stats)``, ``Reply(job, Status.ERROR, error, stats)`` or
  ``Reply(job, Status.END, None, stats)`` (replica exhausted), where ``error`` is a
  :class:`RemoteError` and ``stats`` is what the worker's sources counted since its previous
  answer (:class:`~aloader._sources.StatsReporter`), or None.

On the socket a message is a plain tuple with int codes (:meth:`Request.wire`,
:meth:`Reply.wire`), rebuilt on receipt (:meth:`Request.of`, :meth:`Reply.of`): a NamedTuple
or an enum member would pickle by reference and cost each message two to three times as much.

The worker fetches with the same :class:`~aloader._pipeline.FetchPlan` the loader would use
without workers. Plain map-style datasets are served by a loop that loads one batch per task;
async datasets, ``max_concurrency`` and iterable datasets run the loader's own pipeline
(:class:`~aloader._pipeline.Epoch`) on an event loop inside the worker, so each worker keeps
``max_concurrency`` fetches in flight.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import random
import signal
import sys
import threading
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import IntEnum
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

import numpy as np

from . import _shm

__all__ = ("WorkerInfo", "get_worker_info")



# The protocol (see the module docstring) ---------------------------------------------------------
class Kind(IntEnum):
    """What the loader asks of a worker (:attr:`Request.kind`)."""

    TASK = 0  # map-style: load and collate an index batch
    NEXT = 1  # iterable: the next batch of this worker's replica


class Status(IntEnum):
    """What a worker answers (:attr:`Reply.status`)."""

    READY = 0  # set up: serving
    FAILED = 1  # setup or worker_init_fn raised: the value is the RemoteError
    OK = 2  # the value is the batch
    ERROR = 3  # the value is the RemoteError of the fetch
    END = 4  # iterable: this worker's replica is exhausted


# The job number of the setup report, which answers no request.
SETUP_JOB = -1
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

    def wire(self) -> tuple[Any, ...]:
        """The message as it crosses the socket: a plain tuple, the kind as an int."""
        return (int(self.kind), self.job, self.epoch, self.key, self.released, self.loader_epoch)

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

    def wire(self) -> tuple[Any, ...]:
        """The message as it crosses the socket: a plain tuple, the status as an int."""
        return (self.job, int(self.status), self.value, self.stats)

    @classmethod
    def of(cls, wire: tuple[Any, ...]) -> Reply:
        """The message :meth:`wire` made."""
        return cls._make((wire[0], _STATUSES[wire[1]], wire[2], wire[3]))


class WorkerInfo:
    """What a worker process knows about itself (torch's ``WorkerInfo``).

    Attributes:
        id: this worker's number, in ``range(num_workers)``.
        num_workers: how many workers the loader runs.
        seed: this worker's seed (``base_seed + id``).
        dataset: this worker's own copy of the dataset.
        epoch: the loader's epoch this worker is serving (not in torch; see
            :attr:`epoch`).
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any
    __initialized = False

    def __init__(self, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.__keys = tuple(kwargs.keys())
        self.__initialized = True

    def __setattr__(self, key: str, value: Any) -> None:
        if self.__initialized:
            raise RuntimeError(f"Cannot assign attributes to {self.__class__.__name__} objects")
        super().__setattr__(key, value)

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={getattr(self, k)}" for k in self.__keys)
        return f"{self.__class__.__name__}({items})"

    @property
    def epoch(self) -> int:
        """The loader's epoch this worker is serving (0 before its first task).

        For a :class:`~aloader.Stream` dataset it is the epoch the loader's own copy of the
        stream claimed for this epoch (its ``set_epoch`` value, else its counter, which the
        loader advances as if it had iterated the stream); for other datasets it counts the
        loader's epochs from 0. A stream iterated in a worker without ``set_epoch`` uses it,
        so that shard orders and shuffles change every epoch, with persistent workers or not.
        """
        return _served_epoch if _served_epoch is not None else 0


_worker_info: WorkerInfo | None = None
# The loader epoch of this worker's latest task; None outside workers.
_served_epoch: int | None = None


def served_epoch() -> int | None:
    """The loader epoch this worker process is serving, or None outside workers."""
    return _served_epoch


def get_worker_info() -> WorkerInfo | None:
    """This worker process's :class:`WorkerInfo`, or None in the main process.

    An iterable dataset uses it to shard itself so that each worker reads a distinct part::

        info = aloader.get_worker_info()
        shards = all_shards if info is None else all_shards[info.id :: info.num_workers]
    """
    return _worker_info


def _set_worker_info(info: WorkerInfo | None) -> None:
    global _worker_info
    _worker_info = info


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
    (a RuntimeError when the type cannot be rebuilt from a message or imported here).
    """

    exc_type: type[BaseException] | None
    type_name: str
    where: str
    text: str

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
        return cls(exc_type, type(error).__name__, where, text)

    def rebuild(self) -> BaseException:
        message = f"Caught {self.type_name} {self.where}.\nOriginal {self.text}"
        exc_type = self.exc_type
        if exc_type is None:
            return RuntimeError(message)
        if exc_type is KeyError:
            return KeyError(_KeyErrorMessage(message))
        try:
            if getattr(exc_type, "message", None):
                return exc_type(message=message)  # type: ignore[call-arg]
            return exc_type(message)
        except Exception:  # the type takes other arguments
            return RuntimeError(message)


def _strip_pipeline_notes(error: BaseException) -> BaseException:
    """Drop the worker-side pipeline's notes: they count batches per worker, not per epoch."""
    notes = getattr(error, "__notes__", None)
    if notes:
        error.__notes__ = [note for note in notes if not note.startswith("raised while")]
    return error


# Setup -------------------------------------------------------------------------------------------
@dataclass
class WorkerSetup:
    """What every worker of a pool receives once, at start.

    Attributes:
        plan: the fetch plan the loader would use without workers (no pin-memory transform).
        iterable: whether the dataset is an iterable dataset.
        batch_size: samples per batch of an iterable dataset (None: no batching).
        drop_last: drop an iterable replica's last incomplete batch.
        base_seed: the seed of the epoch that started the pool.
        num_workers: workers in the pool.
        worker_init_fn: called with the worker id once the worker is seeded.
        prefetch: batches each worker may run ahead (the loader's prefetch_factor).
        owner: the loader's process's shared-memory owner tag (:func:`aloader._shm.owner`).
    """

    plan: Any
    iterable: bool
    batch_size: int | None
    drop_last: bool
    base_seed: int
    num_workers: int
    worker_init_fn: Callable[[int], None] | None
    prefetch: int
    owner: str = field(default_factory=_shm.owner)


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
        from ._sources import StatsReporter

        self.stats = StatsReporter(setup.plan.dataset)

    def send(self, job: int, status: Status, value: Any) -> None:
        reply = Reply(job, status, value, self.stats.report())
        try:
            # By value only what plain pickling cannot take (a class the setup brought by
            # value): what is importable by name resolves to the loader's own object.
            data = self.codec.encode(reply.wire(), by_value="fallback")
        except Exception as exc:  # an unpicklable batch reaches the consumer as its error
            error = RemoteError.capture(exc, self.where)
            data = self.codec.encode(Reply(job, Status.ERROR, error).wire())
        self.conn.send_bytes(data)

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
        global _served_epoch
        _served_epoch = request.loader_epoch
        return request

    async def areceive(self) -> Request | None:
        import anyio

        await anyio.wait_readable(self.conn.fileno())
        return self.receive()

    # Plain map-style datasets: one batch per task, no event loop.
    def serve_tasks(self) -> None:
        plan = self.setup.plan
        while (request := self.receive()) is not None:
            try:
                batch = plan.load_sync(request.key)
            except Exception as exc:
                self.fail(request.job, exc)
            else:
                self.send(request.job, Status.OK, batch)

    # Async datasets and max_concurrency: the loader's pipeline over the keys received.
    async def serve_tasks_async(self) -> None:
        from ._pipeline import Epoch, Results

        jobs: deque[int] = deque()

        async def keys() -> AsyncIterator[Any]:
            while (request := await self.areceive()) is not None:
                jobs.append(request.job)
                yield request.key

        epoch = Epoch(self.setup.plan, Results(self.setup.prefetch, True), keys=keys())
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
                    self.send(job, Status.OK, batch)
        finally:
            epoch.stop()

    # Iterable datasets: one replica iterator per epoch, batched by the loader's pipeline.
    async def serve_replica(self) -> None:
        from ._loader import _aiter_of
        from ._pipeline import Epoch, Results

        setup = self.setup
        dataset = setup.plan.dataset
        current: int | None = None
        epoch: Epoch | None = None
        try:
            while (request := await self.areceive()) is not None:
                job, epoch_id = request.job, request.epoch
                if epoch_id != current:
                    current = epoch_id
                    if epoch is not None:
                        epoch.stop()
                        await epoch.done.wait()
                        epoch = None
                    try:
                        aiter_ = _aiter_of(dataset)
                        source = aiter_() if aiter_ is not None else iter(dataset)
                    except Exception as exc:  # __iter__ failed: this replica is done
                        self.fail(job, exc)
                        continue
                    epoch = Epoch(setup.plan, Results(1, True), source=source,
                                  batch_size=setup.batch_size, drop_last=setup.drop_last)
                    epoch.start()
                if epoch is None:
                    self.send(job, Status.END, None)
                    continue
                try:
                    batch, error = await epoch.next()
                except StopAsyncIteration:
                    self.send(job, Status.END, None)
                    continue
                if error is not None:
                    self.fail(job, error)
                else:
                    self.send(job, Status.OK, batch)
        finally:
            if epoch is not None:
                epoch.stop()

    def needs_loop(self) -> bool:
        plan = self.setup.plan
        return (
            self.setup.iterable
            or plan.mode == "async"
            or plan.granularity == "item"
            or plan._async_collate
        )


def worker_main(
    conn: Connection,
    worker_id: int,
    owner: str,
    setup: WorkerSetup | None,
    inherited_fds: list[int],
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
    """
    for fd in inherited_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    from ._spawn import forget_placeholder

    forget_placeholder()
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
    except Exception as exc:
        codec = _shm.Codec(owner, os.getpid())
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            failed = Reply(SETUP_JOB, Status.FAILED, RemoteError.capture(exc, where))
            conn.send_bytes(codec.encode(failed.wire(), by_value="fallback"))
        return
    worker = _WorkerServer(conn, worker_id, setup)
    try:
        conn.send_bytes(worker.codec.encode(Reply(SETUP_JOB, Status.READY, None).wire()))
        if not worker.needs_loop():
            worker.serve_tasks()
        else:
            import anyio

            main = worker.serve_replica if setup.iterable else worker.serve_tasks_async
            anyio.run(main)
    except (BrokenPipeError, ConnectionResetError):  # the loader has gone
        pass
    finally:
        # Answers still unread when the loader closed this worker's socket (or died) never
        # will be: remove their segments, and all the loader's if it died.
        parent = multiprocessing.parent_process()
        dead = parent is not None and bool(wait([parent.sentinel], 0))
        _shm.sweep(_shm.prefix(owner) if dead else _shm.prefix(owner, os.getpid()))
