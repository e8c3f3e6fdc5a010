"""Inference micro-batcher: concurrent single requests in, batches of them through a model out.

:class:`Batcher` wraps a *batch function* (``list of items -> sequence of results``) so that
callers await one item each::

    async with Batcher(model_fn, max_batch_size=32, max_wait=0.002, max_queue=1024) as model:
        y = await model(x)  # from many concurrent tasks

The design answers the problems users report with Ray Serve's ``@serve.batch``:

* **Backpressure.** The queue is bounded (``max_queue``); a full queue raises
  :class:`QueueFullError` at once (O(1)), so a server can answer 503 instead of piling up
  memory and latency.
* **Cancellation and deadlines.** A caller that times out or is cancelled leaves the queue at
  once (its item never reaches the batch function and takes no slot in a batch). Cancelling a
  caller whose batch is already running never aborts the batch for the others.
* **Full batches under load.** A batch is formed only when an execution slot
  (``max_concurrent_batches``) is free, so requests that arrive while the model is busy join the
  next batch instead of being frozen into small batches that then wait for a slot.
* **Errors.** An exception from the batch function reaches every caller of that batch; a result
  slot holding an exception is raised for that caller alone; a result that is not one indexable
  result per item (wrong length, ``None``, a generator, a string, a ``len()`` or indexing that
  raises) is a :class:`BatchResultError` for every caller of that batch, never a part of it.
  The dispatcher survives every error and goes on serving the later batches.
* **KeyboardInterrupt, SystemExit** (any non-cancellation ``BaseException``) from the batch
  function reach the callers of that batch as themselves: each caller re-raises it in its own
  task, which stops the program as it would had the caller raised it, while the dispatcher goes
  on serving the other callers meanwhile (none is left waiting). When every caller of that
  batch has already left, the dispatcher raises it itself rather than swallowing it, and the
  queued requests fail with :class:`BatcherClosedError` chained to it.
* **Shutdown.** ``async with`` / :meth:`Batcher.aclose` stop admitting, drain running and queued
  requests within a timeout and fail what remains with :class:`BatcherClosedError`. No task is
  left behind.
* **Metrics** as a plain dict (:meth:`Batcher.metrics`), without a metrics server.
* Plain (sync) batch functions run in a worker thread; asyncio and trio both work (anyio).

Batch formation follows Triton's dynamic batcher: the wait starts when the oldest queued
request arrived; a batch goes out as soon as ``max_batch_size`` requests (or the smallest of
``preferred_batch_sizes``) are queued, or when the oldest request has waited ``max_wait``
seconds. ``max_wait=0`` (the default) takes whatever is queued when a slot is free: a lone
request is served at once, and under load batches fill by themselves while the previous batch
runs.

All times come from the event loop's clock (:func:`anyio.current_time`), so trio's
``MockClock`` drives batch formation, timeouts and the metrics deterministically in tests.

Cost (the hot path, counted in tests/serve/test_batcher_costs.py and
tests/serve/test_batcher_trio.py): a request is one ``_Request`` and one waiter of the bound
loop, with no anyio object: a plain future on asyncio, trio's low-level park and reschedule on
trio (both
:func:`~aloader._backend.waiters`, no ``trio.Event``). Its timeout is answered, never a cancellation
of the caller: one loop timer on asyncio, one entry in a heap that the batcher's one alarm task
serves on trio (:class:`_TrioTimeouts`: a cancel scope per request cost more there than the
rest of the request). A lone request costs two scheduler steps (the caller wakes the
dispatcher, which answers it), with or without a timeout; under load the next batch starts in
the loop step the previous one ended, before its callers run again.

The module owns four pieces, each with its own contract: :class:`Batcher` is the batching
policy (admission, batch formation, running a batch, answering its callers, shutdown);
:class:`_LoopBinding` says which event loop its dispatcher task lives on and how a call from
another loop is routed; :class:`_TrioTimeouts` times requests out on trio;
:class:`_BatcherMetricsRecorder` holds what :meth:`Batcher.metrics` reports. Checks that need
no batcher state are functions beside them: the arguments (``_check_*``) and the batch
function's results (``_unpack``). :func:`batch` and :class:`BatchMethod` give each instance of
a class its own batcher.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import inspect
import math
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from types import CoroutineType as _Coroutine
from types import TracebackType
from typing import Any, Generic, Protocol, TypedDict, TypeVar, cast, overload

import anyio
from anyio.abc import TaskGroup

from .._backend import Waiter, spawn_background, waiters
from .._exceptions import (
    BatcherClosedError,
    BatcherTimeoutError,
    BatchResultError,
    QueueFullError,
)
from .._util import check_int, check_seconds, is_async_callable, is_awaitable

__all__ = (
    "Batcher",
    "BatcherClosedError",
    "BatcherMetrics",
    "BatchMethod",
    "BatchResultError",
    "BatcherTimeoutError",
    "LatencySummary",
    "QueueFullError",
    "batch",
)

T = TypeVar("T")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
C = TypeVar("C")
S = TypeVar("S")


class _Results(Protocol[R_co]):
    """What a batch function returns: anything sized and indexable (list, tuple, ndarray)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> R_co: ...


class LatencySummary(TypedDict):
    """Percentiles, in seconds, over the most recent samples (``None`` before any sample)."""

    count: int
    p50: float | None
    p99: float | None
    max: float | None


class BatcherMetrics(TypedDict):
    """The plain dict :meth:`Batcher.metrics` returns."""

    submitted: int
    """Requests admitted to the queue."""
    completed: int
    """Requests answered with a result."""
    failed: int
    """Requests answered with an exception (batch error, per-item error, closed)."""
    rejected: int
    """Requests refused with :class:`QueueFullError`."""
    timed_out: int
    """Requests whose caller's timeout expired (queued or running)."""
    cancelled: int
    """Requests whose caller was cancelled (queued or running)."""
    queued: int
    """Requests waiting in the queue now."""
    running_batches: int
    """Batches being executed now."""
    batches: int
    """Batches executed so far."""
    batch_size_histogram: dict[int, int]
    """Batch size -> number of batches of that size."""
    queue_wait: LatencySummary
    """Time from admission to the start of the request's batch."""
    execution: LatencySummary
    """Time the batch function took, per batch (collate included)."""


# Request states: a caller still waiting is _QUEUED or _RUNNING (below _DONE).
_QUEUED = 0
_RUNNING = 1
_DONE = 2
_ABANDONED = 3
_TIMED_OUT = 4

_UNSET: Any = object()
_NEVER = sys.maxsize


class _Request:
    """One caller's item and answer. The caller waits on ``waiter`` (one :class:`Waiter` of
    the bound loop, woken once); whoever moves ``state`` from ``_QUEUED``/``_RUNNING`` to
    another state answers it, and only then sets the waiter (unless the waiter is done: a
    cancelled caller's future on asyncio)."""

    __slots__ = ("enqueued", "error", "item", "result", "state", "tb", "waiter")

    def __init__(self, item: Any, enqueued: float, waiter: Waiter) -> None:
        self.item = item
        self.enqueued = enqueued
        self.state = _QUEUED
        self.result: Any = None
        self.error: BaseException | None = None
        self.tb: TracebackType | None = None
        self.waiter = waiter

    def wake(self) -> None:
        waiter = self.waiter
        if not waiter.done():
            waiter.set_result(None)


class _TrioTimeouts:
    """The per-request timeouts of a batcher on trio: one alarm task and one cancel scope for
    all of its requests. A cancel scope per request cost ~15 us on trio (its deadline added to
    and removed from trio's deadline heap, its cancel status swapped in and out), most of the
    added latency of a request with a timeout; on asyncio a loop timer per request is cheap.

    Invariant: ``heap`` holds ``(deadline, seq, request)`` for every request with a deadline
    whose caller is still waiting (``state < _DONE``), and answered ones, dropped lazily: from
    the top as requests come, or all at once when the heap has doubled since it was last compacted
    (so it holds at most ``2 * waiting + 64`` entries: memory bound by the waiting requests,
    not by the traffic; a caller takes its answer out of its request, so an answered entry
    holds no result). The alarm task sleeps until ``alarm_at``, never later than the earliest
    deadline of a waiting request, and then ``expire`` s each waiting request whose deadline
    has passed: it is answered with a timeout, never cancelled, as on asyncio.

    Thread-safety: none needed; the bound trio run's tasks use it, one at a time.
    """

    __slots__ = ("alarm_at", "compact_at", "expire", "heap", "now", "scope")

    def __init__(self, expire: Callable[[_Request], None]) -> None:
        self.now: Callable[[], float] = anyio.current_time  # trio's clock, from run()
        self.expire = expire
        self.heap: list[tuple[float, int, _Request]] = []
        self.alarm_at = math.inf
        self.compact_at = 64
        self.scope: Any = None  # the alarm task's trio.CancelScope while it sleeps

    def add(self, deadline: float, seq: int, request: _Request) -> None:
        """Time ``request`` out at ``deadline`` (``seq``: unique, orders equal deadlines)."""
        heap = self.heap
        # Answered requests on top go at once: under one timeout deadlines come in order, so
        # at low load the heap holds the one request in flight, and no compaction (a pause of
        # O(heap) every few dozen requests, a p99 of its own) is ever due.
        while heap and heap[0][2].state >= _DONE:
            heapq.heappop(heap)
        if len(heap) >= self.compact_at:
            heap[:] = [entry for entry in heap if entry[2].state < _DONE]
            heapq.heapify(heap)
            self.compact_at = 2 * len(heap) + 64
        heapq.heappush(heap, (deadline, seq, request))
        if deadline < self.alarm_at:
            # Rare under a batcher's one timeout: deadlines come in order, the alarm is set.
            self.alarm_at = deadline
            if self.scope is not None:
                self.scope.deadline = deadline

    def expire_due(self) -> float:
        """Expire the waiting requests whose deadline has passed, drop the answered ones on
        top; return the next deadline to wake at (inf: none)."""
        heap = self.heap
        now = self.now()
        while heap:
            deadline, _, request = heap[0]
            waiting = request.state < _DONE
            if waiting and deadline > now:
                return deadline
            heapq.heappop(heap)
            if waiting:
                self.expire(request)
        return math.inf

    async def run(self) -> None:
        """The alarm task: runs until cancelled (when its dispatcher ends)."""
        import trio

        self.now = trio.current_time
        while True:
            with trio.CancelScope(deadline=self.alarm_at) as scope:
                self.scope = scope
                await trio.sleep_forever()
            self.scope = None
            self.alarm_at = self.expire_due()

    def clear(self) -> None:
        """Forget every request (their callers are answered, or gone with their loop)."""
        self.heap.clear()
        self.alarm_at = math.inf
        self.compact_at = 64
        self.scope = None


def _current_loop() -> object:
    """An identity for the running event loop: the asyncio loop or trio's run token."""
    loop = asyncio._get_running_loop()  # None rather than an exception to catch on trio
    if loop is not None:
        return loop
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            return trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
    raise RuntimeError("a Batcher can only be called from a running asyncio or trio event loop")


def _clock_of(loop: object) -> Callable[[], float]:
    if isinstance(loop, asyncio.AbstractEventLoop):
        # asyncio's own loop.time() is time.monotonic() behind a Python frame.
        return time.monotonic if type(loop).time is asyncio.BaseEventLoop.time else loop.time
    import trio

    # The run's own clock (trio's SystemClock, or a test's MockClock), which trio.current_time()
    # reaches through two frames more; a lone request reads it three times (its admission, its
    # batch's start and end). Called on the bound run's thread: that run's clock.
    now: Callable[[], float] = trio.lowlevel.current_clock().current_time
    return now


def _loop_is_alive(loop: object) -> bool:
    if isinstance(loop, asyncio.AbstractEventLoop):
        return not loop.is_closed() and loop.is_running()
    # A trio run cancels its system tasks when it ends, so a live dispatcher means a live run.
    return True


# The C-level getter: a subclass may override __traceback__ with a property that raises.
_traceback_of: Callable[[BaseException], TracebackType | None] = vars(BaseException)[
    "__traceback__"
].__get__


def _leaf(exc: BaseException | None) -> BaseException | None:
    """The first exception inside task-group wrappers (the one the dispatcher raised)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _summary(samples: deque[float]) -> LatencySummary:
    if not samples:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(samples)
    n = len(ordered)

    def rank(q: float) -> float:
        # Nearest-rank percentile: the smallest sample with at least q of the samples <= it.
        return ordered[max(0, math.ceil(q * n) - 1)]

    return {"count": n, "p50": rank(0.50), "p99": rank(0.99), "max": ordered[-1]}


def _cancel_is_ours() -> bool:
    """Whether a cancellation exception comes from a real cancellation of the running task."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return True  # trio: Cancelled only comes from an enclosing cancel scope
    if task is None:
        return True
    return task.cancelling() > 0


class _LoopBinding:
    """Which event loop a batcher's dispatcher task lives on, and how other loops' calls go.

    The dispatcher is one task on one event loop (an asyncio loop, or a trio run), started
    either by ``async with`` (*managed*: it lives in the block's task group) or by the first
    call (*lazy*: a background task of the caller's loop, see :func:`spawn_background`).

    A call from the loop ``L`` (:func:`_current_loop`; from a thread without a running loop it
    is a ``RuntimeError``) is routed by :meth:`Batcher._bind`:

    * ``L`` is the bound loop and the dispatcher is alive: served (the hot path: two compares).
    * the batcher is managed: ``RuntimeError`` (its task group belongs to the block's loop).
    * the bound loop still runs its live dispatcher: ``RuntimeError`` (one batcher per loop;
      there is no hand-off of requests between loops or threads).
    * otherwise (never started, stopped, or its loop ended): the batcher moves to ``L``; the
      requests the old loop left have no caller any more and are dropped.

    Thread-safety: none needed, none given. A binding is written on one thread at a time: the
    bound loop's (its callers' tasks and the dispatcher, one at a time), or, when the batcher
    moves, the new loop's once the old one has ended. A call from another live loop only reads
    it before it is refused.

    Attributes:
        loop: the bound loop's identity (the asyncio loop or trio's run token), None before
            the first start.
        now: that loop's clock (what :func:`anyio.current_time` returns there).
        new_waiter: that loop's :class:`Waiter` factory (:func:`waiters`: a plain future on
            asyncio, trio's low-level park and reschedule on trio).
        timers: the asyncio loop, whose timers time requests out there (None on trio, where
            the batcher's :class:`_TrioTimeouts` does).
        alive: a dispatcher is running, or about to.
        managed: the dispatcher was started by ``async with`` (it stays so after the block).
        stopped: set when the latest dispatcher has ended (None before the first start).
        scope: the running dispatcher's cancel scope (a drain that times out cancels it).
    """

    __slots__ = (
        "alive", "loop", "managed", "new_waiter", "now", "scope", "stopped", "timers",
    )  # fmt: skip

    def __init__(self) -> None:
        self.loop: object = None
        self.now: Callable[[], float] = anyio.current_time
        self.new_waiter: Callable[[], Waiter] = lambda: waiters()()  # until start binds a loop
        self.timers: asyncio.AbstractEventLoop | None = None
        self.alive = False
        self.managed = False
        self.stopped: anyio.Event | None = None
        self.scope: anyio.CancelScope | None = None

    def check_move(self, loop: object, name: str) -> None:
        """Raise unless a call from ``loop`` (not served now) may move the dispatcher there."""
        if self.managed:
            raise RuntimeError(
                f"batcher {name!r} was started by `async with`, and its dispatcher is not "
                "running in this event loop"
            )
        if self.alive and self.loop is not None and _loop_is_alive(self.loop):
            raise RuntimeError(
                f"batcher {name!r} is serving another event loop; create one Batcher per event loop"
            )

    def start(
        self,
        loop: object,
        serve: Callable[[], Coroutine[Any, Any, None]],
        task_group: TaskGroup | None = None,
        name: str = "",
    ) -> None:
        """Bind to ``loop`` and start ``serve`` there: in ``task_group`` (managed), or in the
        background of the loop (lazy)."""
        self.loop = loop
        self.now = _clock_of(loop)
        self.new_waiter = waiters()
        self.timers = loop if isinstance(loop, asyncio.AbstractEventLoop) else None
        self.alive = True
        self.stopped = anyio.Event()
        if task_group is None:
            spawn_background(serve)
        else:
            self.managed = True
            task_group.start_soon(serve, name=name)

    def stop(self) -> None:
        """The dispatcher ended: nothing is bound until the next start."""
        self.scope = None
        self.alive = False


class _BatcherMetricsRecorder:
    """What :meth:`Batcher.metrics` reports, recorded as the batcher works.

    Records the request counters (``submitted``, ``completed``, ``failed``, ``rejected``,
    ``timed_out``, ``cancelled``: the batcher adds to them directly, an int increment each on
    the hot path), the batches and their sizes (:meth:`batch_started`), and the two latency
    windows: each request's queue wait and each batch's execution time, the most recent
    ``window`` samples of each (bounded deques: memory grows with the work up to that bound).

    Thread-safety: none needed, none given. It is written on the batcher's event loop only;
    :meth:`snapshot` reads it there too (from another thread a snapshot could be torn).

    Cost: O(1) per request and per batch item; :meth:`snapshot` sorts the windows,
    O(window log window).
    """

    __slots__ = (
        "batches", "cancelled", "completed", "execution", "failed", "queue_waits", "rejected",
        "size_hist", "submitted", "timed_out",
    )  # fmt: skip

    def __init__(self, window: int) -> None:
        self.submitted = 0
        self.completed = 0
        self.failed = 0
        self.rejected = 0
        self.timed_out = 0
        self.cancelled = 0
        self.batches = 0
        self.size_hist: dict[int, int] = {}
        self.queue_waits: deque[float] = deque(maxlen=window)
        self.execution: deque[float] = deque(maxlen=window)

    def batch_started(self, start: float, batch: list[_Request]) -> None:
        """Count a batch of ``batch`` going out at ``start``, and its requests' queue waits."""
        append = self.queue_waits.append
        for request in batch:
            append(start - request.enqueued)
        n = len(batch)
        self.batches += 1
        self.size_hist[n] = self.size_hist.get(n, 0) + 1

    def batch_ended(self, seconds: float) -> None:
        """Record a batch's execution time (answered, failed or cancelled alike)."""
        self.execution.append(seconds)

    def snapshot(self, queued: int, running_batches: int) -> BatcherMetrics:
        """The metrics now, as a new dict; ``queued`` and ``running_batches`` are the
        batcher's current state."""
        return {
            "submitted": self.submitted,
            "completed": self.completed,
            "failed": self.failed,
            "rejected": self.rejected,
            "timed_out": self.timed_out,
            "cancelled": self.cancelled,
            "queued": queued,
            "running_batches": running_batches,
            "batches": self.batches,
            "batch_size_histogram": dict(sorted(self.size_hist.items())),
            "queue_wait": _summary(self.queue_waits),
            "execution": _summary(self.execution),
        }


# Counts are refused above sys.maxsize: no container could hold that many, so the batcher
# could never reach them.
_check_count = functools.partial(check_int, maximum=sys.maxsize, noun="integer value")


def _check_preferred(
    preferred_batch_sizes: Sequence[int] | None, max_batch_size: int
) -> tuple[int, ...]:
    """``preferred_batch_sizes`` as sorted distinct sizes, each from 1 to ``max_batch_size``
    (``()`` for None)."""
    preferred: tuple[int, ...] = ()
    if preferred_batch_sizes is not None:
        if isinstance(preferred_batch_sizes, (str, bytes)) or not hasattr(
            preferred_batch_sizes, "__iter__"
        ):
            raise TypeError(
                "preferred_batch_sizes should be a sequence of batch sizes or None, but got "
                f"preferred_batch_sizes={preferred_batch_sizes!r}"
            )
        sizes = tuple(preferred_batch_sizes)  # once: an iterator gives its items only once
        for size in sizes:
            _check_count("preferred_batch_sizes item", size)
            if size > max_batch_size:
                raise ValueError(
                    f"preferred_batch_sizes item {size} is larger than "
                    f"max_batch_size={max_batch_size}"
                )
        preferred = tuple(sorted(set(sizes)))
        if not preferred:
            raise ValueError("preferred_batch_sizes should not be empty (use None instead)")
    return preferred


def _unpack(results: Any, n: int, name: str) -> Sequence[Any]:
    """The ``n`` results of batch function ``name`` in a list (or the list or tuple itself),
    or a BatchResultError saying what is wrong with them.

    This is where the results object's own code (``__len__``, ``__getitem__``) runs.
    """
    if type(results) is list or type(results) is tuple:
        if len(results) == n:
            checked: Sequence[Any] = results
            return checked
        raise _count_error(len(results), n, name)
    what = f"batch function {name!r} returned "
    must = "; it must return a sequence (list, tuple or array) with one result per item"
    if results is None:
        raise BatchResultError(what + "None" + must)
    kind = type(results).__name__
    if isinstance(results, (str, bytes, bytearray)):
        # Indexing would hand each caller one character: a silent wrong result.
        raise BatchResultError(f"{what}a {kind}{must}")
    if inspect.isawaitable(results):
        if inspect.iscoroutine(results):
            results.close()  # never awaited: no "never awaited" warning at collection
        raise BatchResultError(f"{what}a {kind} once awaited (an `await` is missing?){must}")
    if not hasattr(type(results), "__len__"):
        raise BatchResultError(f"{what}a {kind}, which has no len(){must}")
    try:
        count = len(results)
    except Exception as exc:
        raise BatchResultError(
            f"{what}a {kind} whose len() raised {type(exc).__name__}: {exc}{must}"
        ) from exc
    if count != n:
        raise _count_error(count, n, name)
    if not hasattr(type(results), "__getitem__"):
        raise BatchResultError(
            f"{what}a {kind} of length {count} that cannot be indexed; results[i] must "
            "be the result for item i"
        )
    unpacked = []
    index = 0
    try:
        for index in range(n):
            unpacked.append(results[index])
    except Exception as exc:
        raise BatchResultError(
            f"{what}a {kind} of length {count} whose results[{index}] raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return unpacked


def _count_error(count: int, n: int, name: str) -> BatchResultError:
    return BatchResultError(
        f"batch function {name!r} returned {count} results for a batch "
        f"of {n} items; it must return exactly one result per item"
    )


class Batcher(Generic[T, R]):
    """Batches concurrent single requests into calls of a batch function.

    ``await batcher(item)`` queues ``item`` and returns its result once a batch containing it
    has run. The batch function receives the list of queued items (or ``collate_fn`` of that
    list) and must return a sequence of the same length (a list, tuple or ndarray); result ``i``
    answers item ``i`` (``results[i]``). Anything else fails the whole batch with
    :class:`BatchResultError`. A result that is an :class:`Exception` instance is raised for
    that caller alone; an exception raised by the batch function is raised for every caller of
    the batch. The function's return value is awaited whenever it is awaitable, whatever the
    function looks like.

    The batcher needs a dispatcher task. Either use ``async with Batcher(...) as b:`` (the
    dispatcher lives in a task group for the block, and the exit drains and closes it), or just
    call it: the first call starts the dispatcher in the background of the running event loop
    (an asyncio task, or a trio system task) and :meth:`aclose` stops it. A batcher serves one
    event loop at a time.

    Args:
        fn: The batch function, ``async def fn(items)`` or a plain ``def fn(items)``; plain
            functions run in a worker thread (see ``to_thread``).
        max_batch_size: The most items in one batch. This and the other counts
            (``max_concurrent_batches``, ``max_queue``, ``metrics_window``) are ints from 1 to
            ``sys.maxsize``; nothing is allocated in proportion to them.
        max_wait: Seconds the oldest queued request may wait for its batch to fill before the
            batch goes out anyway (finite). ``0`` takes whatever is queued when an execution
            slot is free (no timer: lowest latency, and batches still fill while the model is
            busy).
        max_concurrent_batches: How many batches may run at once.
        max_queue: The most requests waiting in the queue; a request beyond it raises
            :class:`QueueFullError` at once.
        timeout: Default per-request timeout in seconds (queueing and execution together);
            ``None`` (or ``inf``) waits forever. A late request raises
            :class:`BatcherTimeoutError`, which is a :class:`TimeoutError`.
        collate_fn: Turns the list of items into the batch function's argument, e.g.
            :func:`aloader.default_collate` to stack arrays, or a function that pads.
            ``None`` (default) passes the list as is.
        preferred_batch_sizes: Batch sizes to prefer (Triton's ``preferred_batch_size``): a
            batch goes out as soon as the smallest of them is queued, with the largest that
            the queue allows; when ``max_wait`` expires first, whatever is queued goes out.
        to_thread: Run a plain batch function (and its collate) in a worker thread so the
            event loop stays responsive. ``False`` calls it on the event loop: faster for
            functions that take microseconds. Ignored for async batch functions.
        close_timeout: Seconds the exit of ``async with`` waits for queued and running
            requests to finish before failing them (``None``: wait as long as it takes).
        metrics_window: How many recent samples the latency percentiles are taken over (the
            samples are kept as they come: memory grows with the work, up to this bound).
        name: Name used in error messages and ``repr`` (default: the function's name).

    Raises:
        ValueError: If an argument is out of range or of the wrong type (bool, float or NaN
            for a count, NaN for seconds, ``inf`` for ``max_wait``); the message names it.
        TypeError: If ``fn`` or ``collate_fn`` is not callable, or ``preferred_batch_sizes``
            is not an iterable.
    """

    @overload
    def __init__(
        self: Batcher[T, R],
        fn: Callable[[list[T]], Awaitable[_Results[R]] | _Results[R]],
        *,
        max_batch_size: int = ...,
        max_wait: float = ...,
        max_concurrent_batches: int = ...,
        max_queue: int = ...,
        timeout: float | None = ...,
        collate_fn: None = ...,
        preferred_batch_sizes: Sequence[int] | None = ...,
        to_thread: bool = ...,
        close_timeout: float | None = ...,
        metrics_window: int = ...,
        name: str | None = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: Batcher[T, R],
        fn: Callable[[C], Awaitable[_Results[R]] | _Results[R]],
        *,
        max_batch_size: int = ...,
        max_wait: float = ...,
        max_concurrent_batches: int = ...,
        max_queue: int = ...,
        timeout: float | None = ...,
        collate_fn: Callable[[list[T]], C],
        preferred_batch_sizes: Sequence[int] | None = ...,
        to_thread: bool = ...,
        close_timeout: float | None = ...,
        metrics_window: int = ...,
        name: str | None = ...,
    ) -> None: ...

    def __init__(
        self,
        fn: Callable[[Any], Any],
        *,
        max_batch_size: int = 32,
        max_wait: float = 0.0,
        max_concurrent_batches: int = 1,
        max_queue: int = 1024,
        timeout: float | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        preferred_batch_sizes: Sequence[int] | None = None,
        to_thread: bool = True,
        close_timeout: float | None = 30.0,
        metrics_window: int = 10_000,
        name: str | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"Batcher needs a callable batch function, but got {fn!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn should be callable or None, but got {collate_fn!r}")
        self._max_batch_size = _check_count("max_batch_size", max_batch_size)
        # max_wait=inf would keep a lone request waiting forever for its batch to fill.
        self._max_wait = check_seconds("max_wait", max_wait, allow_inf=False)
        self._max_concurrent = _check_count("max_concurrent_batches", max_concurrent_batches)
        self._max_queue = _check_count("max_queue", max_queue)
        self._timeout = (
            None if timeout is None else check_seconds("timeout", timeout, allow_zero=False)
        )
        self._close_timeout = (
            None if close_timeout is None else check_seconds("close_timeout", close_timeout)
        )
        window = _check_count("metrics_window", metrics_window)
        preferred = _check_preferred(preferred_batch_sizes, max_batch_size)
        self._preferred = preferred
        # A batch goes out without waiting once this many requests are queued.
        self._fill_target = preferred[0] if preferred else self._max_batch_size

        self._fn = fn
        self._collate = collate_fn
        # Called on the loop (async, or to_thread=False), or in a worker thread.
        self._in_loop = is_async_callable(fn) or not to_thread
        self._name = name if name is not None else getattr(fn, "__name__", type(fn).__name__)

        # OrderedDict: O(1) append, O(1) pop of the oldest, O(1) removal of a cancelled request.
        self._queue: OrderedDict[_Request, None] = OrderedDict()
        self._running = 0
        self._closing = False
        self._binding = _LoopBinding()
        self._task_group: TaskGroup | None = None  # the `async with` block's
        # The dispatcher sleeps on _wake; callers set it once the queue holds _wake_at items.
        self._wake: Waiter | None = None
        self._wake_at = _NEVER

        self._metrics = _BatcherMetricsRecorder(window)
        self._trio_timeouts = _TrioTimeouts(self._expire)

    # -- public API ------------------------------------------------------------------------

    @property
    def max_batch_size(self) -> int:
        """The most items in one batch."""
        return self._max_batch_size

    @property
    def max_wait(self) -> float:
        """Seconds the oldest queued request may wait for its batch to fill."""
        return self._max_wait

    @property
    def max_concurrent_batches(self) -> int:
        """How many batches may run at once."""
        return self._max_concurrent

    @property
    def max_queue(self) -> int:
        """The most requests waiting in the queue."""
        return self._max_queue

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called (the batcher admits no new request)."""
        return self._closing

    def __repr__(self) -> str:
        state = "closed" if self._closing else ("running" if self._binding.alive else "idle")
        return (
            f"<Batcher {self._name!r} {state} max_batch_size={self._max_batch_size} "
            f"max_wait={self._max_wait} queued={len(self._queue)}/{self._max_queue}>"
        )

    async def __call__(self, item: T, *, timeout: float | None = _UNSET) -> R:
        """Submit one item and wait for its result.

        Args:
            item: The item; it becomes one element of the list given to the batch function.
            timeout: Seconds to wait for the result (queueing and execution together),
                overriding the batcher's ``timeout``; ``None`` waits forever.

        Returns:
            The batch function's result for this item.

        Raises:
            QueueFullError: At once, when ``max_queue`` requests are already waiting.
            BatcherClosedError: If the batcher is closed, or closed before serving the item.
            BatcherTimeoutError: If the timeout expired (the request leaves the queue; a
                running batch goes on for the others).
            BatchResultError: If the batch function did not return one indexable result per
                item (the message names what it returned and what failed).
            BaseException: Whatever the batch function (or ``collate_fn``) raised for the
                batch, ``KeyboardInterrupt`` and ``SystemExit`` included, or the exception
                instance it returned in this item's result slot.
        """
        if self._closing:
            raise BatcherClosedError(f"batcher {self._name!r} is closed and admits no request")
        binding = self._binding
        # The running asyncio loop is its own identity, without a call of ours.
        loop: object = asyncio._get_running_loop()
        if loop is None:
            loop = _current_loop()  # trio's run token
        if loop is not binding.loop or not binding.alive:
            self._bind(loop)
        queue = self._queue
        metrics = self._metrics
        if len(queue) >= self._max_queue:
            metrics.rejected += 1
            raise QueueFullError(
                f"batcher {self._name!r} queue is full ({self._max_queue} requests waiting); "
                "retry later"
            )
        if timeout is _UNSET:
            timeout = self._timeout
        elif timeout is not None:
            timeout = check_seconds("timeout", timeout, allow_zero=False)
        waiter = binding.new_waiter()
        request = _Request(item, binding.now(), waiter)
        queue[request] = None
        metrics.submitted += 1
        if len(queue) >= self._wake_at:
            self._wake_dispatcher()
        try:
            if timeout is None or timeout == math.inf:
                await waiter
            elif binding.timers is not None:
                # A loop timer answers the late request (no cancel scope, no cancellation);
                # its deadline counts from admission, on the loop's own clock (binding.now).
                timer = binding.timers.call_at(request.enqueued + timeout, self._expire, request)
                try:
                    await waiter
                finally:
                    timer.cancel()
            else:
                # trio: the batcher's alarm task answers the late request.
                self._trio_timeouts.add(request.enqueued + timeout, metrics.submitted, request)
                await waiter
        except BaseException as exc:
            if request.state < _DONE:
                self._abandon(request)
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    metrics.cancelled += 1
            raise
        if request.state == _TIMED_OUT:
            raise BatcherTimeoutError(
                f"batcher {self._name!r}: request not served within {timeout} s"
            ) from None
        # The answer leaves the request: on trio a timeout's heap may hold it a while longer.
        error = request.error
        if error is not None:
            tb = request.tb
            request.error = request.tb = None
            raise error.with_traceback(tb)
        result: R = request.result
        request.result = None
        return result

    async def aclose(self, timeout: float | None = _UNSET) -> None:
        """Stop admitting requests, drain the queued and running ones, then stop the dispatcher.

        Queued requests are dispatched at once (without waiting for ``max_wait``). Whatever
        is still queued or running when ``timeout`` expires fails with
        :class:`BatcherClosedError` (a batch function still running in a worker thread is
        abandoned). Calling it again waits for the first call to finish.

        Args:
            timeout: Seconds to wait for the drain; default: the batcher's ``close_timeout``.
                ``0`` fails everything pending at once; ``None`` waits as long as it takes.
        """
        if timeout is _UNSET:
            timeout = self._close_timeout
        else:
            timeout = None if timeout is None else check_seconds("timeout", timeout)
        self._closing = True
        self._wake_dispatcher()
        binding = self._binding
        stopped = binding.stopped
        if stopped is None or not binding.alive:
            self._fail_queued()
            return
        try:
            with anyio.move_on_after(math.inf if timeout is None else timeout):
                await stopped.wait()
        finally:
            if not stopped.is_set():
                # Drain timed out (or we are being cancelled): fail what remains and stop.
                with anyio.CancelScope(shield=True):
                    self._fail_queued()
                    if binding.scope is not None:
                        binding.scope.cancel()
                    await stopped.wait()

    async def __aenter__(self) -> Batcher[T, R]:
        """Start the dispatcher in a task group that lives until the block exits."""
        if self._closing:
            raise BatcherClosedError(f"batcher {self._name!r} is closed")
        if self._binding.alive:
            raise RuntimeError(f"batcher {self._name!r} is already running")
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        self._binding.start(_current_loop(), self._serve, task_group,
                            name=f"aloader.Batcher({self._name}) dispatcher")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Drain and close (see :meth:`aclose`), then leave the task group."""
        task_group = self._task_group
        assert task_group is not None
        try:
            await self.aclose()
        finally:
            self._task_group = None
            await task_group.__aexit__(exc_type, exc, tb)
        return None

    def metrics(self) -> BatcherMetrics:
        """Counters, batch-size histogram and latency percentiles, as a plain dict.

        Returns:
            A new :class:`BatcherMetrics` dict; latencies are in seconds.
        """
        return self._metrics.snapshot(len(self._queue), self._running)

    # -- dispatcher ------------------------------------------------------------------------

    def _bind(self, loop: object) -> None:
        """Start the dispatcher lazily in the caller's event loop, or refuse (see
        :class:`_LoopBinding`)."""
        binding = self._binding
        if binding.alive and loop is binding.loop:
            return
        binding.check_move(loop, self._name)
        # Requests left by a dead loop have no caller any more: drop them.
        self._queue.clear()
        self._trio_timeouts.clear()
        self._running = 0
        self._wake = None
        self._wake_at = _NEVER
        binding.start(loop, self._serve)

    async def _serve(self) -> None:
        binding = self._binding
        stopped = binding.stopped
        assert stopped is not None
        try:
            with anyio.CancelScope() as scope:
                binding.scope = scope
                if binding.timers is None:
                    async with anyio.create_task_group() as alarm_group:
                        alarm_group.start_soon(
                            self._trio_timeouts.run,
                            name=f"aloader.Batcher({self._name}) timeouts",
                        )
                        async with anyio.create_task_group() as task_group:
                            await self._dispatch(task_group)
                        alarm_group.cancel_scope.cancel()  # every batch has ended
                else:
                    async with anyio.create_task_group() as task_group:
                        await self._dispatch(task_group)
        except BaseException as exc:
            # A cancellation (maybe inside a task-group wrapper), or a BaseException that no
            # caller of its batch received.
            cause = _leaf(exc)
            self._stop(None if isinstance(cause, anyio.get_cancelled_exc_class()) else cause)
            raise
        else:
            self._stop()
        finally:
            stopped.set()

    def _stop(self, cause: BaseException | None = None) -> None:
        self._binding.stop()
        self._fail_queued(cause)
        self._trio_timeouts.clear()  # every caller is answered now

    def _wake_dispatcher(self) -> None:
        wake = self._wake
        if wake is not None:
            self._wake = None
            self._wake_at = _NEVER
            if not wake.done():
                wake.set_result(None)

    def _sleep(self, wake_at: int, deadline: float = math.inf) -> Awaitable[None]:
        """What the dispatcher awaits to sleep until ``wake_at`` requests are queued, a
        wake-up, or ``deadline``.

        Without a deadline it is the waiter itself (no coroutine, no cancel scope: the idle ->
        busy path stays cheap): only :meth:`_wake_dispatcher` completes it, and it unsets
        ``_wake`` first; a dispatcher cancelled meanwhile leaves a waiter that wakes nobody
        (a cancelled future on asyncio, a task-less waiter on trio) until the next start
        replaces it.
        """
        waiter = self._binding.new_waiter()
        self._wake = waiter
        self._wake_at = wake_at
        if deadline == math.inf:
            return waiter
        return self._sleep_until(waiter, deadline)

    async def _sleep_until(self, waiter: Waiter, deadline: float) -> None:
        try:
            with anyio.CancelScope(deadline=deadline):
                await waiter
        finally:
            if self._wake is waiter:  # the deadline came first
                self._wake = None
                self._wake_at = _NEVER

    async def _dispatch(self, task_group: TaskGroup) -> None:
        queue = self._queue
        max_wait = self._max_wait
        while True:
            if self._running >= self._max_concurrent:
                await self._sleep(_NEVER)  # a finishing batch wakes us
                continue
            if not queue:
                if self._closing:
                    return
                await self._sleep(1)
                continue
            if max_wait > 0 and not self._closing and len(queue) < self._fill_target:
                deadline = next(iter(queue)).enqueued + max_wait
                if self._binding.now() < deadline:
                    await self._sleep(self._fill_target, deadline)
                    continue  # re-evaluate: the queue may have grown, shrunk or emptied
            batch, items = self._take()
            self._running += 1
            if self._max_concurrent == 1:
                # No other batch can start meanwhile: run inline, saving a task per batch.
                await self._run_batch(batch, items)
            else:
                task_group.start_soon(self._run_batch, batch, items)

    def _take(self) -> tuple[list[_Request], list[Any]]:
        """The next batch out of the queue, running: its requests and their items."""
        queue = self._queue
        size = min(len(queue), self._max_batch_size)
        if self._preferred and size >= self._preferred[0]:
            size = max(p for p in self._preferred if p <= size)
        popitem = queue.popitem
        batch = []
        items = []
        for _ in range(size):
            request = popitem(last=False)[0]
            request.state = _RUNNING
            batch.append(request)
            items.append(request.item)
        return batch, items

    async def _run_batch(self, batch: list[_Request], items: list[Any]) -> None:
        """Run one batch (``items``, one per request of ``batch``) and answer every caller
        still waiting for it.

        Invariant: whatever the batch function does or returns, each request of ``batch``
        that is still running leaves this method answered (a result or an error), and no
        exception escapes except a real cancellation of the dispatcher or a BaseException
        that no caller is left to receive. All user code (the batch function and its collate,
        awaiting what it returned, ``len`` and indexing of the results) runs inside the
        ``try`` and before any caller is answered, so a broken batch fails all of its callers
        and never a part of them.
        """
        start = self._binding.now()
        self._metrics.batch_started(start, batch)
        n = len(batch)
        try:
            try:
                if self._in_loop:
                    result = self._fn(items if self._collate is None else self._collate(items))
                else:
                    result = await self._in_thread(items)
                # Await whatever is awaitable rather than trusting how the function looks: a
                # plain function may return a coroutine (a lambda around one), and a callable
                # that looks async (an instance whose __call__ attribute is a coroutine
                # function) may not. A list or tuple, the common result, is never awaitable.
                if type(result) is _Coroutine or is_awaitable(result):
                    result = await result
                results = _unpack(result, n, self._name)
            except anyio.get_cancelled_exc_class() as exc:
                if _cancel_is_ours():
                    self._fail_batch(
                        batch,
                        BatcherClosedError(
                            f"batcher {self._name!r} closed while the request's batch was running"
                        ),
                        None,
                    )
                    raise
                # The batch function raised CancelledError without being cancelled. Handing
                # CancelledError to the callers would make them look cancelled: wrap it.
                error = RuntimeError(
                    f"batch function {self._name!r} raised {type(exc).__name__} "
                    "without being cancelled"
                )
                error.__cause__ = exc
                self._fail_batch(batch, error, None)
            except Exception as exc:
                self._fail_batch(batch, exc, exc.__traceback__)
            except BaseException as exc:
                # KeyboardInterrupt, SystemExit...: a request to stop, not a bad batch. Each
                # caller re-raises it in its own task, which ends the program as it would had
                # the caller raised it, and the dispatcher goes on serving meanwhile. Only when
                # no caller is left to receive it does the dispatcher raise it, never
                # swallowing it.
                if not self._fail_batch(batch, exc, exc.__traceback__):
                    raise
            else:
                self._deliver(batch, results)
        finally:
            self._metrics.batch_ended(self._binding.now() - start)
            self._running -= 1
            if self._wake is not None and self._wake_at == _NEVER:
                self._wake_dispatcher()  # it waits for a free slot

    async def _in_thread(self, items: list[Any]) -> Any:
        """The batch function (and its collate) called in a worker thread."""
        collate = self._collate
        fn = self._fn
        if collate is None:
            return await anyio.to_thread.run_sync(fn, items, abandon_on_cancel=True)
        return await anyio.to_thread.run_sync(lambda: fn(collate(items)), abandon_on_cancel=True)

    def _deliver(self, batch: list[_Request], results: Sequence[Any]) -> None:
        """Answer the waiting callers from checked results (no user code runs here)."""
        completed = failed = 0
        for request, result in zip(batch, results, strict=True):
            if request.state != _RUNNING:
                continue  # its caller gave up: never resolve it
            # type(), not isinstance(): an object faking __class__ could not be raised.
            if issubclass(type(result), Exception):
                request.error = result
                request.tb = _traceback_of(result)
                failed += 1
            else:
                request.result = result
                completed += 1
            request.state = _DONE
            waiter = request.waiter
            if not waiter.done():  # on asyncio, a cancelled caller's future is done
                waiter.set_result(None)
        metrics = self._metrics
        metrics.completed += completed
        metrics.failed += failed

    def _fail_batch(
        self, batch: list[_Request], error: BaseException, tb: TracebackType | None
    ) -> int:
        """Fail the callers of ``batch`` still waiting with ``error``; return how many."""
        failed = 0
        for request in batch:
            if request.state == _RUNNING:
                request.error = error
                request.tb = tb
                request.state = _DONE
                request.wake()
                failed += 1
        self._metrics.failed += failed
        return failed

    def _fail_queued(self, cause: BaseException | None = None) -> None:
        queue = self._queue
        if not queue:
            return
        if cause is None:
            error = BatcherClosedError(f"batcher {self._name!r} closed before serving the request")
        else:
            error = BatcherClosedError(
                f"batcher {self._name!r} stopped before serving the request: its dispatcher "
                f"ended with {type(cause).__name__}: {cause}"
            )
            error.__cause__ = cause
        while queue:
            request = queue.popitem(last=False)[0]
            request.error = error
            request.state = _DONE
            request.wake()
            self._metrics.failed += 1

    def _abandon(self, request: _Request, state: int = _ABANDONED) -> None:
        """The caller of ``request`` gives up (``state``): it leaves the queue, or its batch
        goes on without answering it."""
        if request.state == _QUEUED:
            self._queue.pop(request, None)
        request.state = state

    def _expire(self, request: _Request) -> None:
        """``request``'s timeout expired: time it out unless it was answered first."""
        if request.state < _DONE:
            self._abandon(request, _TIMED_OUT)
            self._metrics.timed_out += 1
            request.wake()


class BatchMethod(Generic[S, T, R]):
    """The descriptor :func:`batch` returns: each instance gets its own :class:`Batcher`.

    ``instance.method`` is that instance's :class:`Batcher` (created on first access), so
    ``await instance.method(item)`` batches, ``instance.method.metrics()`` reads its metrics
    and ``await instance.method.aclose()`` closes it. Accessed on the class, it is the
    descriptor itself.
    """

    def __init__(self, fn: Callable[[S, Any], Any], options: dict[str, Any]) -> None:
        self._fn = fn
        self._options = options
        self._attr = getattr(fn, "__name__", "batched")
        functools.update_wrapper(self, fn)

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self._attr = name

    @overload
    def __get__(self, instance: None, owner: type[Any] | None = None) -> BatchMethod[S, T, R]: ...

    @overload
    def __get__(self, instance: S, owner: type[Any] | None = None) -> Batcher[T, R]: ...

    def __get__(
        self, instance: S | None, owner: type[Any] | None = None
    ) -> BatchMethod[S, T, R] | Batcher[T, R]:
        if instance is None:
            return self
        try:
            namespace = vars(instance)
        except TypeError:
            raise TypeError(
                f"@batch needs instances with a __dict__ to keep one Batcher per instance; "
                f"{type(instance).__name__} has __slots__ without __dict__"
            ) from None
        batcher = namespace.get(self._attr)
        if not isinstance(batcher, Batcher):
            options = dict(self._options)
            options.setdefault("name", f"{type(instance).__name__}.{self._attr}")
            batcher = Batcher(functools.partial(self._fn, instance), **options)
            # Stored under the method's name: later lookups find it before this (non-data)
            # descriptor, so the hot path costs one dict lookup.
            namespace[self._attr] = batcher
        return cast("Batcher[T, R]", batcher)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Refuse calls on the class: ``@batch`` decorates methods."""
        raise TypeError(
            f"{self._attr} is a batched method: call it on an instance "
            "(use aloader.Batcher(fn) to batch a plain function)"
        )


@overload
def batch(
    fn: Callable[[S, list[T]], Awaitable[_Results[R]] | _Results[R]], /
) -> BatchMethod[S, T, R]: ...


@overload
def batch(
    fn: None = None,
    /,
    *,
    max_batch_size: int = ...,
    max_wait: float = ...,
    max_concurrent_batches: int = ...,
    max_queue: int = ...,
    timeout: float | None = ...,
    collate_fn: Callable[[list[Any]], Any] | None = ...,
    preferred_batch_sizes: Sequence[int] | None = ...,
    to_thread: bool = ...,
    close_timeout: float | None = ...,
    metrics_window: int = ...,
) -> Callable[
    [Callable[[S, list[T]], Awaitable[_Results[R]] | _Results[R]]], BatchMethod[S, T, R]
]: ...


def batch(
    fn: Callable[..., Any] | None = None, /, **options: Any
) -> BatchMethod[Any, Any, Any] | Callable[[Callable[..., Any]], BatchMethod[Any, Any, Any]]:
    """Decorate a method ``(self, items) -> results`` so that it batches single calls.

    The decorator form of :class:`Batcher`, like Ray Serve's ``@serve.batch``; it takes the
    same keyword arguments. Each instance gets its own batcher, started on the first call::

        class Model:
            @aloader.batch(max_batch_size=16, max_wait=0.002)
            async def predict(self, xs: list[np.ndarray]) -> list[float]:
                return self.net(np.stack(xs)).tolist()

        y = await model.predict(x)  # one item in, one result out
        await model.predict.aclose()

    Args:
        fn: The method, when used as ``@batch`` without arguments.
        **options: Keyword arguments of :class:`Batcher` (``max_batch_size``, ``max_wait``,
            ``max_concurrent_batches``, ``max_queue``, ``timeout``, ``collate_fn``,
            ``preferred_batch_sizes``, ``to_thread``, ``close_timeout``, ``metrics_window``).

    Returns:
        A :class:`BatchMethod` descriptor, or a decorator that makes one.

    Raises:
        TypeError: If an option is unknown or ``fn`` is not callable.
        ValueError: If an option is out of range.
    """
    allowed = {
        "max_batch_size", "max_wait", "max_concurrent_batches", "max_queue", "timeout",
        "collate_fn", "preferred_batch_sizes", "to_thread", "close_timeout", "metrics_window",
    }  # fmt: skip
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"batch() got unexpected keyword argument(s): {', '.join(unknown)}")
    # Validate now rather than on the first call of the first instance.
    Batcher(lambda items: items, **options)

    def decorate(method: Callable[..., Any]) -> BatchMethod[Any, Any, Any]:
        if not callable(method):
            raise TypeError(f"@batch decorates a method, but got {method!r}")
        return BatchMethod(method, options)

    if fn is None:
        return decorate
    return decorate(fn)
