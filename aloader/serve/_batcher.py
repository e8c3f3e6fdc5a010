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
  caller whose batch is already running never aborts the batch for the others. A request
  whose ``queue_timeout`` passes before its batch starts is dropped (Triton's queue policy).
* **Full batches under load** (adaptive wait). A batch is formed only when an execution slot
  (``max_concurrent_batches``) is free, so requests that arrive while every slot is busy join
  the next batch instead of being frozen into small batches that then wait for a slot.
* **Budgets and priorities.** A batch holds at most ``max_batch_size`` items, and at most
  ``max_batch_cost`` of their summed ``cost(item)`` (tokens, as vLLM's
  ``max_num_batched_tokens``), or at most ``max_batch_size`` as measured by Ray's
  ``batch_size_fn``; it closes before the first item that would exceed a budget. Callers pass
  ``priority=``: higher priorities are served first, and a request that has waited
  ``promote_after`` seconds goes before all of them (no priority starves).
* **Errors.** An exception from the batch function reaches every caller of that batch; a result
  slot holding an exception is raised for that caller alone; a result that is not one indexable
  result per item (wrong length, ``None``, a generator, a string, a ``len()`` or indexing that
  raises) is a :class:`BatchResultError` for every caller of that batch, never a part of it.
  The dispatcher survives every error and goes on serving the later batches. What a caller's
  own item causes (its ``cost``, its ``batch_size_fn`` size) fails that caller alone.
* **KeyboardInterrupt, SystemExit** (any non-cancellation ``BaseException``) from the batch
  function reach the callers of that batch as themselves: each caller re-raises it in its own
  task, which stops the program as it would had the caller raised it, while the dispatcher goes
  on serving the other callers meanwhile (none is left waiting). When every caller of that
  batch has already left, the dispatcher raises it itself rather than swallowing it, and the
  queued requests fail with :class:`BatcherClosedError` chained to it.
* **Shutdown.** ``async with`` / :meth:`Batcher.aclose` stop admitting, drain running and queued
  requests within a timeout and fail what remains with :class:`BatcherClosedError`. No task is
  left behind; an exception raised in the ``async with`` body leaves it as itself. A batcher
  that nobody holds any more (a batched method's, with its instance) is garbage collected, and
  the dispatcher its first call started ends: an idle dispatcher holds its batcher weakly.
* **Streaming.** An ``async def`` generator batch function yields one list of results per
  step; :meth:`Batcher.stream` gives each caller its own elements as an async iterator
  (:class:`~aloader.serve._results.BatchStream`).
* **Metrics** as a plain dict (:meth:`Batcher.metrics`), without a metrics server.
* Plain (sync) batch functions run in a worker thread; asyncio and trio both work (anyio).

Batch formation follows Triton's dynamic batcher: the wait starts when the oldest queued
request arrived; a batch goes out as soon as it is full (``max_batch_size`` requests, or the
smallest of ``preferred_batch_sizes``, or a budget reached), or when the oldest request has
waited ``max_wait`` seconds. ``max_wait=0`` (the default) takes whatever is queued when a slot
is free: a lone request is served at once, and under load batches fill by themselves while the
previous batch runs. The settings in force when a batch starts to form (``max_batch_size``,
``max_wait``) hold for that batch: :meth:`Batcher.set_max_batch_size` and
:meth:`Batcher.set_max_wait` change the next one, as in Ray.

All times come from the event loop's clock (:func:`anyio.current_time`), so trio's
``MockClock`` drives batch formation, timeouts and the metrics deterministically in tests; on
asyncio the batcher reads ``time.monotonic`` (uvloop's loop clock counts whole milliseconds).

Cost (the hot path, counted in tests/serve/test_batcher_costs.py and
tests/serve/test_batcher_trio.py): a request is one ``_Request`` and one waiter of the bound
loop, with no anyio object: a plain future on asyncio, trio's low-level park and reschedule on
trio (both :func:`~aloader._backend.waiters`, no ``trio.Event``). Its timeout is answered,
never a cancellation of the caller: one loop timer on asyncio, one entry in a heap that the
batcher's one alarm task serves on trio (:class:`_TrioTimeouts`: a cancel scope per request
cost more there than the rest of the request). A lone request costs two scheduler steps (the
caller wakes the dispatcher, which answers it), with or without a timeout; under load the next
batch starts in the loop step the previous one ended, before its callers run again. Without
priorities, budgets or queue deadlines a batch is taken from the queue's head in O(batch);
with them formation walks the queue in order of service (:class:`_RequestQueue`).

The wing's modules: this one is the batching policy (admission, batch formation, running a
batch, answering its callers, shutdown); :mod:`._request` the requests and the queue's order;
:mod:`._loop` which event loop the dispatcher lives on, its task's life and the timeouts on
trio; :mod:`._metrics` what :meth:`Batcher.metrics` reports; :mod:`._results` the checks of what a
batch function returns and the stream a caller reads; :mod:`._checks` the arguments;
:mod:`._decorator` :func:`batch`, Ray Serve's decorator.
"""

from __future__ import annotations

import asyncio
import functools
import math
import sys
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from types import CoroutineType as _Coroutine
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar, overload

import anyio
from anyio.abc import TaskGroup

from .._backend import Waiter
from .._exceptions import (
    BatchCostError,
    BatcherClosedError,
    BatcherTimeoutError,
    BatchResultError,
    QueueFullError,
)
from .._util import is_async_callable, is_awaitable
from ._checks import (
    check_batch_size,
    check_cost,
    check_count,
    check_optional_seconds,
    check_preferred,
    check_priority,
    check_wait,
    is_async_gen_callable,
)
from ._formation import _Formation
from ._loop import (
    _cancel_is_ours,
    _current_loop,
    _leaf,
    _LoopBinding,
    _TrioTimeouts,
    dispatcher_of,
)
from ._metrics import BatcherMetrics, _BatcherMetricsRecorder
from ._request import (
    _ABANDONED,
    _DONE,
    _DROPPED,
    _QUEUED,
    _RUNNING,
    _TIMED_OUT,
    _Request,
    _RequestQueue,
)
from ._results import BatchStream, _answer_error, _deliver, _fail_batch, _stream_steps, _unpack

# The exceptions' old home (they live in aloader._exceptions): still importable from here.
__all__ = (
    "BatchCostError",
    "BatchResultError",
    "Batcher",
    "BatcherClosedError",
    "BatcherTimeoutError",
    "QueueFullError",
)

T = TypeVar("T")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
C = TypeVar("C")

_UNSET: Any = object()
_NEVER = sys.maxsize

# The batcher whose batch function runs in this context (its task, the tasks it starts, its
# worker thread): a close from there cannot wait for the batch it is called from.
_RUNNING_BATCH_OF: ContextVar[object] = ContextVar("aloader_running_batch_of", default=None)


class _Results(Protocol[R_co]):
    """What a batch function returns: anything sized and indexable (list, tuple, ndarray)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> R_co: ...


class Batcher(Generic[T, R]):
    """Batches concurrent single requests into calls of a batch function.

    ``await batcher(item)`` queues ``item`` and returns its result once a batch containing it
    has run. The batch function receives the list of queued items (or ``collate_fn`` of that
    list) and must return a sequence of the same length (a list, tuple or ndarray); result ``i``
    answers item ``i`` (``results[i]``). Anything else fails the whole batch with
    :class:`BatchResultError`. A result that is an :class:`Exception` instance is raised for
    that caller alone; an exception raised by the batch function is raised for every caller of
    the batch. The function's return value is awaited whenever it is awaitable, whatever the
    function looks like. An ``async def`` generator batch function streams: it yields one
    sequence of results per step, and its callers read theirs with :meth:`stream`.

    The batcher needs a dispatcher task. Either use ``async with Batcher(...) as b:`` (the
    dispatcher lives in a task group for the block, and the exit drains and closes it), or just
    call it: the first call starts the dispatcher in the background of the running event loop
    (an asyncio task, or a trio system task) and :meth:`aclose` stops it. A batcher serves one
    event loop at a time.

    Args:
        fn: The batch function, ``async def fn(items)``, an ``async def`` generator, or a plain
            ``def fn(items)``; plain functions run in a worker thread (see ``to_thread``).
        max_batch_size: The most items in one batch (with ``batch_size_fn``: the most
            ``batch_size_fn(items)`` of one batch). An int from 1 to ``sys.maxsize``, or an
            integral float, as in Ray; nothing is allocated in proportion to it.
        max_wait: Seconds the oldest queued request may wait for its batch to fill before the
            batch goes out anyway (finite; Ray's name ``batch_wait_timeout_s`` is accepted
            too). ``0`` takes whatever is queued when an execution slot is free (no timer:
            lowest latency, and batches still fill while the model is busy).
        max_concurrent_batches: How many batches may run at once.
        max_queue: The most requests waiting in the queue; a request beyond it raises
            :class:`QueueFullError` at once.
        timeout: Default per-request timeout in seconds (queueing and execution together);
            ``None`` (or ``inf``) waits forever. A late request raises
            :class:`BatcherTimeoutError`, which is a :class:`TimeoutError`.
        queue_timeout: Default per-request deadline, in seconds from submission, for its
            batch to *start* (Triton's queue policy): a request still queued then is dropped
            (it never reaches the batch function) and its caller gets
            :class:`BatcherTimeoutError`; once its batch runs, only ``timeout`` applies.
            ``None`` (or ``inf``): none.
        collate_fn: Turns the list of items into the batch function's argument, e.g.
            :func:`aloader.default_collate` to stack arrays, or a function that pads.
            ``None`` (default) passes the list as is.
        preferred_batch_sizes: Batch sizes to prefer (Triton's ``preferred_batch_size``): a
            batch goes out as soon as the smallest of them is queued, with the largest that
            the queue allows; when ``max_wait`` expires first, whatever is queued goes out.
        batch_size_fn: Ray Serve's measure of a batch: ``batch_size_fn(items) -> number``
            replaces ``len(items)``, and ``max_batch_size`` bounds it (a batch closes before
            the item that would exceed it). It is called on each submitted item alone, in
            the caller (an item too large alone is refused there with
            :class:`BatchCostError`; an exception fails that caller alone), and on candidate
            batches as they form (an exception there fails the item that was being added).
        cost: ``cost(item) -> number >= 0``, the item's share of ``max_batch_cost`` (e.g. its
            token count); called once per item, in the caller. Goes with ``max_batch_cost``.
        max_batch_cost: The most a batch's items may cost together (vLLM's
            ``max_num_batched_tokens``); the batch closes before the item that would exceed
            it, so no batch ever costs more. Goes with ``cost``.
        allow_oversized: What to do with an item that alone exceeds ``max_batch_cost`` (or,
            with ``batch_size_fn``, ``max_batch_size``): ``False`` (default, as Ray) refuses
            it with :class:`BatchCostError` when submitted; ``True`` runs it in a batch of
            its own.
        promote_after: Seconds after which a queued request is served before every request
            that has waited less, whatever their priorities (the bound on a low priority's
            wait). ``None``: strict priorities (a low priority may wait forever).
        to_thread: Run a plain batch function (and its collate) in a worker thread so the
            event loop stays responsive. ``False`` calls it on the event loop: faster for
            functions that take microseconds. Ignored for async batch functions.
        close_timeout: Seconds the exit of ``async with`` waits for queued and running
            requests to finish before failing them (``None``: wait as long as it takes).
        metrics_window: How many recent samples the latency percentiles are taken over (the
            samples are kept as they come: memory grows with the work, up to this bound).
        name: Name used in error messages and ``repr`` (default: the function's name).
        batch_wait_timeout_s: Ray Serve's name for ``max_wait`` (give one of them).

    Raises:
        TypeError: If an argument has the wrong type (a float count, a string wait), ``fn``
            or a callback is not callable, or ``cost`` and ``max_batch_cost`` come alone.
        ValueError: If an argument is out of range (a count below 1, a negative or NaN
            time, an infinite ``max_wait``); the message names it.
    """

    @overload
    def __init__(
        self: Batcher[T, R],
        fn: Callable[[list[T]], Awaitable[_Results[R]] | _Results[R] | AsyncIterator[_Results[R]]],
        *,
        max_batch_size: int = ...,
        max_wait: float = ...,
        max_concurrent_batches: int = ...,
        max_queue: int = ...,
        timeout: float | None = ...,
        queue_timeout: float | None = ...,
        collate_fn: None = ...,
        preferred_batch_sizes: Sequence[int] | None = ...,
        batch_size_fn: Callable[[list[T]], float] | None = ...,
        cost: Callable[[T], float] | None = ...,
        max_batch_cost: float | None = ...,
        allow_oversized: bool = ...,
        promote_after: float | None = ...,
        to_thread: bool = ...,
        close_timeout: float | None = ...,
        metrics_window: int = ...,
        name: str | None = ...,
        batch_wait_timeout_s: float = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: Batcher[T, R],
        fn: Callable[[C], Awaitable[_Results[R]] | _Results[R] | AsyncIterator[_Results[R]]],
        *,
        max_batch_size: int = ...,
        max_wait: float = ...,
        max_concurrent_batches: int = ...,
        max_queue: int = ...,
        timeout: float | None = ...,
        queue_timeout: float | None = ...,
        collate_fn: Callable[[list[T]], C],
        preferred_batch_sizes: Sequence[int] | None = ...,
        batch_size_fn: Callable[[list[T]], float] | None = ...,
        cost: Callable[[T], float] | None = ...,
        max_batch_cost: float | None = ...,
        allow_oversized: bool = ...,
        promote_after: float | None = ...,
        to_thread: bool = ...,
        close_timeout: float | None = ...,
        metrics_window: int = ...,
        name: str | None = ...,
        batch_wait_timeout_s: float = ...,
    ) -> None: ...

    def __init__(
        self,
        fn: Callable[[Any], Any],
        *,
        max_batch_size: int = 32,
        max_wait: float = _UNSET,
        max_concurrent_batches: int = 1,
        max_queue: int = 1024,
        timeout: float | None = None,
        queue_timeout: float | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        preferred_batch_sizes: Sequence[int] | None = None,
        batch_size_fn: Callable[[list[Any]], float] | None = None,
        cost: Callable[[Any], float] | None = None,
        max_batch_cost: float | None = None,
        allow_oversized: bool = False,
        promote_after: float | None = 1.0,
        to_thread: bool = True,
        close_timeout: float | None = 30.0,
        metrics_window: int = 10_000,
        name: str | None = None,
        batch_wait_timeout_s: float = _UNSET,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"Batcher needs a callable batch function, but got {fn!r}")
        for what, callback in (
            ("collate_fn", collate_fn), ("batch_size_fn", batch_size_fn), ("cost", cost),
        ):  # fmt: skip
            if callback is not None and not callable(callback):
                raise TypeError(f"{what} must be a callable or None, got {type(callback)}")
        self._max_batch_size = check_batch_size("max_batch_size", max_batch_size)
        if max_wait is _UNSET:
            wait_name = "batch_wait_timeout_s"
            max_wait = 0.0 if batch_wait_timeout_s is _UNSET else batch_wait_timeout_s
        elif batch_wait_timeout_s is not _UNSET:
            raise TypeError("give max_wait or its other name batch_wait_timeout_s, not both")
        else:
            wait_name = "max_wait"
        self._max_wait = check_wait(wait_name, max_wait)
        self._max_concurrent = check_count("max_concurrent_batches", max_concurrent_batches)
        self._max_queue = check_count("max_queue", max_queue)
        self._timeout = check_optional_seconds("timeout", timeout, allow_zero=False)
        self._queue_timeout = check_optional_seconds(
            "queue_timeout", queue_timeout, allow_zero=False
        )
        self._close_timeout = check_optional_seconds(
            "close_timeout", close_timeout, allow_zero=True
        )
        window = check_count("metrics_window", metrics_window)
        self._preferred = check_preferred(preferred_batch_sizes, self._max_batch_size)
        if batch_size_fn is not None and self._preferred:
            raise ValueError("preferred_batch_sizes count items; they do not go with batch_size_fn")
        if (cost is None) != (max_batch_cost is None):
            raise TypeError("cost and max_batch_cost go together: give both or neither")
        self._max_cost: float = math.inf
        if max_batch_cost is not None:
            self._max_cost = check_cost(max_batch_cost, "max_batch_cost (as a value)")
            if not self._max_cost > 0:
                raise ValueError(f"max_batch_cost must be > 0, got {max_batch_cost!r}")
        promote = check_optional_seconds("promote_after", promote_after, allow_zero=True)
        self._promote_after = math.inf if promote is None else promote
        self._fn = fn
        self._collate = collate_fn
        self._streaming = is_async_gen_callable(fn)
        # Called on the loop (async, or to_thread=False), or in a worker thread.
        self._in_loop = is_async_callable(fn) or self._streaming or not to_thread
        self._name = name if name is not None else getattr(fn, "__name__", type(fn).__name__)

        self._queue = _RequestQueue()
        self._binding = _LoopBinding()
        self._formation = _Formation(
            self._queue, self._binding, name=self._name, preferred=self._preferred,
            size_fn=batch_size_fn, cost_fn=cost, max_cost=self._max_cost,
            allow_oversized=bool(allow_oversized), promote_after=self._promote_after,
            drop=self._drop, fail=self._fail_one,
        )  # fmt: skip
        self._running = 0
        self._closing = False
        self._task_group: TaskGroup | None = None  # the `async with` block's
        # The dispatcher sleeps on _wake; callers set it once the queue holds _wake_at items
        # (or costs _wake_cost).
        self._wake: Waiter | None = None
        self._wake_at = _NEVER
        self._wake_cost = math.inf
        # The settings of the batch being formed, read when it started to form (None: none).
        self._plan_size: int | None = None
        self._plan_wait = 0.0
        self._plan_fill = _NEVER

        self._metrics = _BatcherMetricsRecorder(window)
        self._trio_timeouts = _TrioTimeouts(weakref.ref(self))

    # -- settings ------------------------------------------------------------------------------

    @property
    def max_batch_size(self) -> int:
        """The most items in one batch (or ``batch_size_fn`` units)."""
        return self._max_batch_size

    @property
    def max_wait(self) -> float:
        """Seconds the oldest queued request may wait for its batch to fill."""
        return self._max_wait

    batch_wait_timeout_s = max_wait

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

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Change ``max_batch_size`` from the next batch on (one forming keeps its own).

        Raises:
            TypeError, ValueError: As the constructor; ValueError too if a preferred batch
                size would exceed it.
        """
        size = check_batch_size("max_batch_size", max_batch_size)
        if self._preferred and self._preferred[-1] > size:
            raise ValueError(
                f"preferred_batch_sizes item {self._preferred[-1]} is larger than "
                f"max_batch_size={size}"
            )
        self._max_batch_size = size

    def set_max_wait(self, max_wait: float) -> None:
        """Change ``max_wait`` from the next batch on (one forming keeps its own)."""
        self._max_wait = check_wait("max_wait", max_wait)

    def set_batch_wait_timeout_s(self, batch_wait_timeout_s: float) -> None:
        """Ray Serve's name for :meth:`set_max_wait`."""
        self._max_wait = check_wait("batch_wait_timeout_s", batch_wait_timeout_s)

    def _get_max_batch_size(self) -> int:
        """Ray Serve's getter, kept for code written against ``@serve.batch``."""
        return self._max_batch_size

    def _get_batch_wait_timeout_s(self) -> float:
        """Ray Serve's getter, kept for code written against ``@serve.batch``."""
        return self._max_wait

    def __repr__(self) -> str:
        state = "closed" if self._closing else ("running" if self._binding.alive else "idle")
        return (
            f"<Batcher {self._name!r} {state} max_batch_size={self._max_batch_size} "
            f"max_wait={self._max_wait} queued={len(self._queue)}/{self._max_queue}>"
        )

    # -- requests ------------------------------------------------------------------------------

    async def __call__(
        self,
        item: T,
        /,
        *,
        timeout: float | None = _UNSET,
        priority: int = 0,
        queue_timeout: float | None = _UNSET,
    ) -> R:
        """Submit one item and wait for its result.

        Args:
            item: The item; it becomes one element of the list given to the batch function.
            timeout: Seconds to wait for the result (queueing and execution together),
                overriding the batcher's ``timeout``; ``None`` waits forever.
            priority: The request's priority (any int, default 0): higher ones are served
                first (see ``promote_after``).
            queue_timeout: Seconds from now by which the request's batch must start, or it is
                dropped; overrides the batcher's ``queue_timeout``.

        Returns:
            The batch function's result for this item.

        Raises:
            TypeError: If the batch function streams (use :meth:`stream`), or an option has
                the wrong type.
            QueueFullError: At once, when ``max_queue`` requests are already waiting.
            BatchCostError: At once, when the item alone costs more than a batch may.
            BatcherClosedError: If the batcher is closed, or closed before serving the item.
            BatcherTimeoutError: If the timeout expired (the request leaves the queue; a
                running batch goes on for the others), or the queue_timeout passed before its
                batch started.
            BatchResultError: If the batch function did not return one indexable result per
                item (the message names what it returned and what failed).
            BaseException: Whatever the batch function (or ``collate_fn``, ``cost``,
                ``batch_size_fn`` for this item) raised, ``KeyboardInterrupt`` and
                ``SystemExit`` included, or the exception instance it returned in this
                item's result slot.
        """
        if self._streaming:
            raise TypeError(
                f"batch function {self._name!r} is an async generator: read its results "
                "with `async for result in batcher.stream(item)`"
            )
        request = self._admit(item, timeout, priority, queue_timeout)
        try:
            await request.waiter
        except BaseException as exc:
            self._leave(request, exc)
            raise
        self._finish(request)
        result: R = request.result
        request.result = None
        return result

    def stream(
        self,
        item: T,
        /,
        *,
        timeout: float | None = _UNSET,
        priority: int = 0,
        queue_timeout: float | None = _UNSET,
    ) -> BatchStream[R]:
        """Submit one item now and return the stream of its results.

        For an ``async def`` generator batch function: each list it yields gives this item
        one result (see :class:`~aloader.serve._results.BatchStream`). For any other batch
        function the stream gives the one result. The request is queued at once (this is a
        plain method, called from a running event loop), so streams made together batch
        together even when read one after another. Takes the options of :meth:`__call__`;
        ``timeout`` bounds the whole stream.

        Raises:
            QueueFullError, BatchCostError, BatcherClosedError: As :meth:`__call__`, at once.
        """
        request = self._admit(item, timeout, priority, queue_timeout)
        request.chunks = deque()
        stream: BatchStream[R] = BatchStream._open(self, request)
        return stream

    def _admit(
        self, item: Any, timeout: float | None, priority: int, queue_timeout: float | None
    ) -> _Request:
        """Queue ``item`` for the calling task (binding the batcher to its loop first)."""
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
        waiting = queue.fifo  # the queued requests, without _RequestQueue's Python-level len
        metrics = self._metrics
        if len(waiting) >= self._max_queue:
            metrics.rejected += 1
            raise QueueFullError(
                f"batcher {self._name!r} queue is full ({self._max_queue} requests waiting); "
                "retry later"
            )
        if timeout is _UNSET:
            timeout = self._timeout
        elif timeout is not None:
            timeout = check_optional_seconds("timeout", timeout, allow_zero=False)
        if queue_timeout is _UNSET:
            queue_timeout = self._queue_timeout
        elif queue_timeout is not None:
            queue_timeout = check_optional_seconds("queue_timeout", queue_timeout, allow_zero=False)
        formation = self._formation
        cost = formation.item_cost(item, self._max_batch_size) if formation.budgeted else 0
        request = _Request(item, binding.now(), binding.new_waiter())
        if priority:
            request.priority = check_priority(priority)
        elif priority.__class__ is not int:
            check_priority(priority)  # 0.0, None, False: refused
        if cost:
            request.cost = cost
        if timeout is not None:
            request.timeout = timeout
            if binding.timers is not None:
                # A loop timer answers the late request (no cancel scope, no cancellation);
                # its deadline counts from admission. The batcher's clock reads the loop's
                # monotonic time (finer than uvloop's whole milliseconds, never earlier).
                request.timer = binding.timers.call_at(
                    request.enqueued + timeout, self._expire, request
                )
            else:
                # trio: the batcher's alarm task answers the late request.
                self._trio_timeouts.add(request.enqueued + timeout, request, Batcher._expire)
        if queue_timeout is not None:
            request.drop_at = request.enqueued + queue_timeout
            if binding.timers is not None:
                request.drop_timer = binding.timers.call_at(request.drop_at, self._drop, request)
            else:
                self._trio_timeouts.add(request.drop_at, request, Batcher._drop)
        queue.push(request)
        metrics.submitted += 1
        if len(waiting) >= self._wake_at or queue.cost >= self._wake_cost:
            self._wake_dispatcher()
        return request

    def _leave(self, request: _Request, exc: BaseException | None) -> None:
        """The caller of ``request`` stopped waiting (``exc``: what interrupted it; None: it
        closed its stream): it leaves the queue, or its batch goes on without answering it."""
        for timer in (request.timer, request.drop_timer):
            if timer is not None:
                timer.cancel()
        if request.state < _DONE:
            self._abandon(request)
            self._metrics.cancelled += 1  # cancelled, interrupted, or its stream closed

    def _stream_dropped(self, request: _Request) -> None:
        """The stream of ``request`` was collected before its end, on any thread: it leaves
        on the loop (not within whatever the collection interrupted there)."""
        call_soon = self._binding.call_soon
        if call_soon is not None:
            call_soon(functools.partial(self._leave_dropped, request))

    def _leave_dropped(self, request: _Request) -> None:
        if request.state == _QUEUED and request not in self._queue.fifo:
            return  # left behind by an event loop that ended
        self._leave(request, None)

    def _raise_timeout(self, request: _Request) -> None:
        if request.state == _DROPPED:
            raise BatcherTimeoutError(
                f"batcher {self._name!r}: request dropped, its batch had not started within "
                f"its queue_timeout of {request.drop_at - request.enqueued:g} s"
            ) from None
        raise BatcherTimeoutError(
            f"batcher {self._name!r}: request not served within {request.timeout} s"
        ) from None

    def _finish(self, request: _Request) -> None:
        """``request`` is answered (or its stream has given every result): stop its timers
        and raise how it ended, if not well. The answer leaves the request: on trio a
        timeout's heap may hold it a while longer."""
        timer = request.timer
        if timer is not None:
            timer.cancel()
        if request.drop_timer is not None:
            request.drop_timer.cancel()
        if request.state != _DONE:
            self._raise_timeout(request)
        error = request.error
        if error is not None:
            tb = request.tb
            request.error = request.tb = None
            raise error.with_traceback(tb)

    # -- lifecycle -----------------------------------------------------------------------------

    async def aclose(self, timeout: float | None = _UNSET) -> None:
        """Stop admitting requests, drain the queued and running ones, then stop the dispatcher.

        Queued requests are dispatched at once (without waiting for ``max_wait``). Whatever
        is still queued or running when ``timeout`` expires fails with
        :class:`BatcherClosedError` (a batch function still running in a worker thread is
        abandoned). Calling it again waits for the first call to finish.

        Called from inside the batch function (a model that gives up), it cannot wait for
        the batch it is called from: it starts the shutdown and returns at once (that batch
        and the queued requests are still served).

        Args:
            timeout: Seconds to wait for the drain; default: the batcher's ``close_timeout``.
                ``0`` fails everything pending at once; ``None`` waits as long as it takes.
        """
        if timeout is _UNSET:
            timeout = self._close_timeout
        else:
            timeout = check_optional_seconds("timeout", timeout, allow_zero=True)
        self._closing = True
        self._wake_dispatcher()
        binding = self._binding
        stopped = binding.stopped
        if stopped is None or not binding.alive:
            self._fail_queued()
            return
        if _RUNNING_BATCH_OF.get() is self:
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
        self._binding.start(_current_loop(), dispatcher_of(self), task_group,
                            name=f"aloader.Batcher({self._name}) dispatcher")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Drain and close (see :meth:`aclose`), then leave the task group.

        An exception raised in the block leaves it as itself: the task group, which only
        holds the dispatcher (ended by now), never sees it, so it is not wrapped in an
        exception group. A cancellation of the block goes to the task group, whose cancel
        scopes need it.
        """
        task_group = self._task_group
        assert task_group is not None
        try:
            await self.aclose()
        finally:
            self._task_group = None
            if exc is None or isinstance(exc, anyio.get_cancelled_exc_class()):
                passed = (exc_type, exc, tb)
            else:
                passed = (None, None, None)
            try:
                await task_group.__aexit__(*passed)
            except BaseExceptionGroup as group:
                # The dispatcher's own BaseException (no caller was left to receive it): as
                # itself too.
                leaf = _leaf(group)
                if leaf is None or len(group.exceptions) != 1:
                    raise
                raise leaf from leaf.__cause__
        return None

    def metrics(self) -> BatcherMetrics:
        """Counters, batch-size histogram and latency percentiles, as a plain dict.

        Returns:
            A new :class:`BatcherMetrics` dict; latencies are in seconds.
        """
        return self._metrics.snapshot(len(self._queue), self._running)

    # -- dispatcher ----------------------------------------------------------------------------

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
        self._wake_cost = math.inf
        self._plan_size = None
        binding.start(loop, dispatcher_of(self))

    def _stop(self, cause: BaseException | None = None) -> None:
        self._binding.stop()
        self._fail_queued(cause)
        self._trio_timeouts.clear()  # every caller is answered now

    def _wake_dispatcher(self) -> None:
        wake = self._wake
        if wake is not None:
            self._wake = None
            self._wake_at = _NEVER
            self._wake_cost = math.inf
            if not wake.done():
                wake.set_result(None)

    def _sleep(
        self, wake_at: int, deadline: float = math.inf, wake_cost: float = math.inf
    ) -> Awaitable[None]:
        """What the dispatcher awaits to sleep until ``wake_at`` requests are queued (or
        ``wake_cost`` of them), a wake-up, or ``deadline`` (on the batcher's clock).

        Without a deadline it is the waiter itself (no coroutine, no cancel scope: the idle ->
        busy path stays cheap): only :meth:`_wake_dispatcher` completes it, and it unsets
        ``_wake`` first; a dispatcher cancelled meanwhile leaves a waiter that wakes nobody
        (a cancelled future on asyncio, a task-less waiter on trio) until the next start
        replaces it.
        """
        waiter = self._arm(wake_at, wake_cost)
        if deadline == math.inf:
            return waiter
        return self._sleep_until(waiter, deadline)

    def _arm(self, wake_at: int, wake_cost: float = math.inf) -> Waiter:
        """The waiter that :meth:`_wake_dispatcher` sets once ``wake_at`` requests are queued
        (or ``wake_cost`` of them)."""
        waiter = self._binding.new_waiter()
        self._wake = waiter
        self._wake_at = wake_at
        self._wake_cost = wake_cost
        return waiter

    async def _sleep_until(self, waiter: Waiter, deadline: float) -> None:
        try:
            # The delay, not the deadline: the loop's clock may differ from the batcher's
            # (uvloop's whole milliseconds); trio's is the same clock, MockClock included.
            with anyio.move_on_after(max(0.0, deadline - self._binding.now())):
                await waiter
        finally:
            if self._wake is waiter:  # the deadline came first
                self._wake = None
                self._wake_at = _NEVER
                self._wake_cost = math.inf

    async def _dispatch(self, task_group: TaskGroup) -> Waiter | None:
        """Form and start batches until none is queued; return the waiter to sleep on until
        one is (None: the batcher is closing)."""
        queue = self._queue
        waiting = queue.fifo  # the same dict for the batcher's life (cleared, never replaced)
        formation = self._formation
        while True:
            if self._running >= self._max_concurrent:
                await self._sleep(_NEVER)  # a finishing batch wakes us
                continue
            if not waiting:
                self._plan_size = None  # nothing forms: the next batch takes new settings
                if self._closing:
                    return None
                return self._arm(1)
            size = self._plan_size
            if size is None:
                # A batch starts to form: its settings hold until it goes out (as Ray's).
                size = self._plan_size = self._max_batch_size
                self._plan_wait = self._max_wait
                self._plan_fill = self._preferred[0] if self._preferred else size
            if self._plan_wait > 0 and not self._closing:
                now = self._binding.now()
                deadline = queue.oldest().enqueued + self._plan_wait
                if now < deadline and not formation.full(size, self._plan_fill, now):
                    # With batch_size_fn every arrival may fill the batch: look at each.
                    wake_at = self._plan_fill if formation.size_fn is None else len(waiting) + 1
                    await self._sleep(wake_at, deadline, formation.max_cost)
                    continue  # re-evaluate: the queue may have grown, shrunk or emptied
            self._plan_size = None
            batch, items = formation.take(size)
            if not batch:
                continue  # every candidate was dropped or failed
            self._running += 1
            if self._max_concurrent == 1:
                # No other batch can start meanwhile: run inline, saving a task per batch.
                await self._run_batch(batch, items)
            else:
                task_group.start_soon(self._run_batch_task, batch, items)

    async def _run_batch_task(self, batch: list[_Request], items: list[Any]) -> None:
        """Run a batch in a task of its own, which starts a scheduler step after the batch was
        formed: a caller that left in that step is not run (as Ray drops the cancelled requests
        of a batch before calling the function), and a batch that all of them left never runs
        (a streaming one would hold its slot until its first step)."""
        if any(request.state != _RUNNING for request in batch):
            kept = [i for i, request in enumerate(batch) if request.state == _RUNNING]
            if not kept:
                self._slot_freed()
                return
            batch = [batch[i] for i in kept]
            items = [items[i] for i in kept]
        await self._run_batch(batch, items)

    def _slot_freed(self) -> None:
        self._running -= 1
        if self._wake is not None and self._wake_at == _NEVER:
            self._wake_dispatcher()  # it waits for a free slot

    async def _run_batch(self, batch: list[_Request], items: list[Any]) -> None:
        """Run one batch (``items``, one per request of ``batch``) and answer every caller
        still waiting for it.

        Invariant: whatever the batch function does or returns, each request of ``batch``
        that is still running leaves this method answered (a result or an error), and no
        exception escapes except a real cancellation of the dispatcher or a BaseException
        that no caller is left to receive. All user code (the batch function and its collate,
        awaiting what it returned, ``len`` and indexing of the results) runs inside the
        ``try`` and before any caller is answered, so a broken batch fails all of its callers
        and never a part of them; a streaming batch answers its callers step by step, and an
        error ends the streams of those still reading.
        """
        start = self._binding.now()
        self._metrics.batch_started(start, batch)
        n = len(batch)
        running = _RUNNING_BATCH_OF.set(self)
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
                if self._streaming and hasattr(type(result), "__anext__"):
                    await _stream_steps(batch, result, self._name, self._metrics)
                else:
                    _deliver(batch, _unpack(result, n, self._name), self._metrics)
            except anyio.get_cancelled_exc_class() as exc:
                if _cancel_is_ours():
                    closed = BatcherClosedError(
                        f"batcher {self._name!r} closed while the request's batch was running"
                    )
                    _fail_batch(batch, closed, None, self._metrics)
                    raise
                # The batch function raised CancelledError without being cancelled. Handing
                # CancelledError to the callers would make them look cancelled: wrap it.
                error = RuntimeError(
                    f"batch function {self._name!r} raised {type(exc).__name__} "
                    "without being cancelled"
                )
                error.__cause__ = exc
                _fail_batch(batch, error, None, self._metrics)
            except Exception as exc:
                _fail_batch(batch, exc, exc.__traceback__, self._metrics)
            except BaseException as exc:
                # KeyboardInterrupt, SystemExit...: a request to stop, not a bad batch. Each
                # caller re-raises it in its own task, which ends the program as it would had
                # the caller raised it, and the dispatcher goes on serving meanwhile. Only when
                # no caller is left to receive it does the dispatcher raise it, never
                # swallowing it.
                if not _fail_batch(batch, exc, exc.__traceback__, self._metrics):
                    raise
        finally:
            _RUNNING_BATCH_OF.reset(running)
            self._metrics.batch_ended(self._binding.now() - start)
            self._slot_freed()

    async def _in_thread(self, items: list[Any]) -> Any:
        """The batch function (and its collate) called in a worker thread."""
        collate = self._collate
        fn = self._fn
        if collate is None:
            return await anyio.to_thread.run_sync(fn, items, abandon_on_cancel=True)
        return await anyio.to_thread.run_sync(lambda: fn(collate(items)), abandon_on_cancel=True)

    def _fail_one(self, request: _Request, error: BaseException) -> None:
        _answer_error(request, error, self._metrics)

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
            request = queue.pop_oldest()
            if request.drop_timer is not None:
                request.drop_timer.cancel()
            request.error = error
            request.state = _DONE
            request.wake()
            self._metrics.failed += 1

    def _abandon(self, request: _Request, state: int = _ABANDONED) -> None:
        """``request`` stops waiting (``state``): it leaves the queue, or its batch goes on
        without answering it; a streaming batch that nobody reads any more is cancelled."""
        if request.state == _QUEUED:
            self._queue.remove(request)
        elif request.batch is not None and request.state == _RUNNING:
            shared = request.batch
            shared.live -= 1
            if not shared.live and shared.scope is not None:
                shared.scope.cancel()
        request.state = state

    def _expire(self, request: _Request) -> None:
        """``request``'s timeout expired: time it out unless it was answered first."""
        if request.state < _DONE:
            self._abandon(request, _TIMED_OUT)
            self._metrics.timed_out += 1
            request.wake()

    def _drop(self, request: _Request) -> None:
        """``request``'s queue deadline passed: drop it unless its batch has started."""
        if request.drop_timer is not None:
            request.drop_timer.cancel()  # formation dropped it first: the timer holds it no more
        if request.state == _QUEUED:
            self._abandon(request, _DROPPED)
            self._metrics.dropped += 1
            request.wake()

