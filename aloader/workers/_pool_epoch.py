"""One epoch's use of a :class:`~aloader.workers._processes.WorkerPool`: :class:`PoolEpoch`, the
``remote`` of a ``"process"`` :class:`~aloader.pipeline._plan.FetchPlan`, so the epoch's
pipeline keeps doing what it does without workers (admitting at most ``window`` jobs, ordering
results, bounding what waits for the consumer) while each job's fetch becomes "send the key to a
worker and await the collated batch".

Waiting costs no thread: one task per worker reads its socket whenever it is readable (on
asyncio through a reader the loop calls, registered once per epoch; on trio waiting with
``anyio.wait_readable``), cuts whole frames and wakes the jobs they answer. A worker that dies
closes its socket, so its reader sees EOF at once, waits for the exit status and fails the epoch
with torch's message ("DataLoader worker (pid N) is killed by signal: Killed. "). Sends never
block the loop either: the socket is non-blocking and what does not fit waits in an outbox.

An epoch's use of the pool has two kinds, as epochs have: :class:`MapPoolEpoch` sends index
batches to the workers in turn, :class:`ReplicaPoolEpoch` asks each worker's replica of an
iterable dataset for its next batch; the loader's epoch kind (:mod:`aloader.loader._epochs`) picks
one.

Invariant: which worker makes a batch, and in what order each worker receives its tasks,
depend only on the batch's sequence number, never on timing (see :class:`PoolEpoch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Any

import anyio
import anyio.from_thread

from .._backend import Waiter, current_backend, waiters
from .._exceptions import WorkerError
from .._log import worker_log
from .._stats import Collector
from .._util import Signal
from ..pipeline._failures import Failures
from ..pipeline._keys import PacedKeys
from ..pipeline._results import NO_BATCH
from ..streams._sourcestats import merge_stats, source_stats
from . import _shm, _spawn
from ._processes import _FRAME, WorkerPool, _WorkerHandle, exit_message
from ._worker import SETUP_JOB, Kind, Reply, Request, Status

__all__ = ("Delivered", "MapPoolEpoch", "PoolEpoch", "ReplicaPoolEpoch")

_CHUNK = 1 << 18  # bytes read from a worker's socket at once



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

    def __init__(self, pool: WorkerPool, loader_epoch: int = 0,
                 taken: Callable[[], int] | None = None) -> None:
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
        #: Batches the consumer has taken (the loader's count): None turns settling off.
        self.taken = taken
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

    async def fetch(self, key: Any, seq: int, stats: Collector | None = None,
                    failures: Failures | None = None) -> Any:
        """The collated batch of ``key`` (map-style), or the next batch of worker ``key``.

        ``seq`` is the job's sequence number in the epoch: it decides the worker (map-style)
        and the place of the task among that worker's (see the class docstring). What the
        worker counted besides its sources goes into the epoch's ``stats`` and ``failures``.
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
            return NO_BATCH
        self._sent[lane] += 1
        self._changed.notify()  # the worker's next ticket may go once this one is sent
        reply = await self._call(workers[worker_id], kind, payload, self.mark(seq))
        if reply.extra is not None:
            self._absorb(worker_id, reply.status, reply.extra, stats, failures)
            if reply.extra[5] is not None:  # a persistent worker's generators, idle now
                self.pool.rngs[worker_id] = reply.extra[5]
            if reply.extra[3]:  # every sample failed within the failure budget
                return NO_BATCH
        if reply.status == Status.END:
            self.note_end(lane, reply.meta)
            self._exhausted.add(lane)
            self._changed.notify()  # its later requests need not wait for their turn
            return NO_BATCH
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

    @staticmethod
    def _absorb(worker_id: int, status: Status, extra: Any, stats: Collector | None,
                failures: Failures | None) -> None:
        """Record what a worker counted besides its sources into ``stats`` and ``failures``:
        failed samples, timings (a report every few answers), this answer's transfer."""
        failed, attempted, timings, empty, sent, _ = extra
        if stats is not None:
            if timings is not None:
                stats.merge(worker_id, timings)
            if status == Status.OK and not empty:
                stats.transferred(sent)
        if failures is not None:
            failures.attempted(attempted)
            for index, error in failed:
                failures.record(index, error.rebuild())

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
            merge_stats(self._stats, reply.stats, self.pool.setup.plan.dataset)
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

    def __init__(self, pool: WorkerPool, loader_epoch: int = 0,
                 taken: Callable[[], int] | None = None) -> None:
        super().__init__(pool, loader_epoch, taken)
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

        Keys drawn on the consumer's calls (:class:`~aloader.pipeline._keys.PacedKeys`) are read
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
    yields :data:`~aloader.pipeline._results.NO_BATCH` (so does one assigned to a replica since
    found exhausted), and the epoch ends once every replica is exhausted. Timing only decides how
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

    def __init__(self, pool: WorkerPool, loader_epoch: int = 0,
                 taken: Callable[[], int] | None = None) -> None:
        super().__init__(pool, loader_epoch, taken)
        count = pool.num_workers
        self._turn = 0
        self._lanes = count  # replicas
        self._saved: int | None = None  # the saved run's num_workers (virtual replicas)
        # Each virtual replica's [worker id, base seed or None] where a state names them
        # (replicas of other ranks, see aloader.loader._ranks); None: worker r's is replica r.
        self._slots: list[list[Any]] | None = None
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
               saved: int | None = None, slots: list[list[Any]] | None = None) -> None:
        """Start where a saved epoch was: replica ``turn`` is asked first, and replica ``r``
        resumes from ``states[r]`` (None: its start); ``begin`` are the replicas' positions
        until they deliver. ``saved``: the saved run's ``num_workers`` when it differs from
        the pool's (its ``max(1, saved)`` replicas run as virtual replicas), or when
        ``slots`` name the replicas ([worker id, base seed or None] each: those of other
        ranks, all run as virtual replicas)."""
        lanes = len(states)
        self._turn = turn
        self._lanes = lanes
        self._saved = saved
        self._slots = slots
        self._assigned = [0] * lanes
        self._sent = [0] * lanes
        self._resume_states = list(states)
        self.delivered = Delivered(list(begin), turn, local=saved == 0 and slots is None)

    def note_end(self, lane: int, meta: Any) -> None:
        if self._saved is None:  # a worker's own replica (not a virtual one)
            self.finals[lane] = meta

    def route(self, key: Any, seq: int) -> tuple[int, int, int, Kind, Any]:
        ticket = self._tickets.pop(seq)
        state = self._resume_states[key] if ticket == 0 else None
        if self._saved is None:
            return key, key, ticket, Kind.NEXT, state
        worker, seed = (key, None) if self._slots is None else self._slots[key]
        return key % self.pool.num_workers, key, ticket, Kind.NEXT, (
            "replica", key, (worker, self._saved, seed), state)

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

    __slots__ = ("got", "local", "starts", "states", "turn")

    def __init__(self, states: list[Any], turn: int, local: bool = False) -> None:
        self.got: dict[int, tuple[int, Any]] = {}
        self.states = states
        self.starts: list[Any] = list(states)  # each worker's state as it started
        self.turn = turn
        self.local = local

    def started(self, lane: int, state: Any) -> None:
        """Worker ``lane`` started with ``state`` (a map-style dataset's): its state until
        the consumer takes one of its batches (kept apart: the states above may be ahead of
        the consumer, taken by a pump that runs ahead of it)."""
        self.starts[lane] = state
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
