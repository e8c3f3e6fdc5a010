"""Where a batcher runs: the event loop its dispatcher is bound to, that loop's clock, the
per-request timeouts on trio, and the dispatcher task's life.

:class:`_LoopBinding` says which event loop the dispatcher task lives on and how a call from
another loop is routed; :class:`_TrioTimeouts` times requests out on trio (one alarm task per
batcher); :func:`dispatcher_of` makes the dispatcher task's function, which holds its batcher
weakly while idle. The functions beside them identify the running loop and pick its clock.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import math
import sys
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

from .._backend import Waiter, spawn_background, threadsafe_caller, waiters
from ._request import _DONE, _Request

__all__ = (
    "_LoopBinding",
    "_TrioTimeouts",
    "_cancel_is_ours",
    "_clock_of",
    "_current_loop",
    "_leaf",
    "_loop_is_alive",
    "dispatcher_of",
)


class _TrioTimeouts:
    """The per-request deadlines of a batcher on trio: one alarm task and one cancel scope for
    all of its requests. A cancel scope per request cost ~15 us on trio (its deadline added to
    and removed from trio's deadline heap, its cancel status swapped in and out), most of the
    added latency of a request with a timeout; on asyncio a loop timer per request is cheap.

    Invariant: ``heap`` holds ``(deadline, seq, request, action)`` for every deadline of a
    request whose caller is still waiting (``state < _DONE``), and answered ones, dropped
    lazily: from the top as entries come, or all at once when the heap has doubled since it
    was last compacted (so it holds at most ``2 * waiting + 64`` entries: memory bound by the
    waiting requests, not by the traffic; a caller takes its answer out of its request, so an
    answered entry holds no result). The alarm task sleeps until ``alarm_at``, never later
    than the earliest deadline of a waiting request, and then calls ``action(owner, request)`` for
    each waiting request whose deadline has passed (a timeout, or a queue deadline that drops
    it: the action checks which still applies): it is answered, never cancelled, as on asyncio.
    ``owner`` is the batcher, held weakly (the entries hold their actions unbound).

    Thread-safety: none needed; the bound trio run's tasks use it, one at a time.
    """

    __slots__ = ("alarm_at", "compact_at", "heap", "now", "owner", "scope", "seq")

    def __init__(self, owner: Callable[[], Any]) -> None:
        # The batcher, weakly: an entry holds its action unbound (``action(owner, request)``),
        # so a deadline left in the heap never keeps a batcher that nobody holds alive.
        self.owner = owner
        self.now: Callable[[], float] = anyio.current_time  # trio's clock, from run()
        self.heap: list[tuple[float, int, _Request, Callable[[Any, _Request], None]]] = []
        self.alarm_at = math.inf
        self.compact_at = 64
        self.scope: Any = None  # the alarm task's trio.CancelScope while it sleeps
        self.seq = itertools.count()  # orders equal deadlines, never compares requests

    def add(
        self, deadline: float, request: _Request, action: Callable[[Any, _Request], None]
    ) -> None:
        """Call ``action(owner, request)`` at ``deadline`` unless the request is answered
        first."""
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
        heapq.heappush(heap, (deadline, next(self.seq), request, action))
        if deadline < self.alarm_at:
            # Rare under a batcher's one timeout: deadlines come in order, the alarm is set.
            self.alarm_at = deadline
            if self.scope is not None:
                self.scope.deadline = deadline

    def expire_due(self) -> float:
        """Act on the waiting requests whose deadline has passed, drop the answered ones on
        top; return the next deadline to wake at (inf: none)."""
        heap = self.heap
        now = self.now()
        owner = self.owner()
        if owner is None:  # collected: nobody waits any more
            heap.clear()
        while heap:
            deadline, _, request, action = heap[0]
            waiting = request.state < _DONE
            if waiting and deadline > now:
                return deadline
            heapq.heappop(heap)
            if waiting:
                action(owner, request)
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
    """The batcher's clock on ``loop``: what request times, batch times and metrics read."""
    if isinstance(loop, asyncio.AbstractEventLoop):
        # asyncio's own loop.time() is time.monotonic() behind a Python frame. uvloop's counts
        # whole milliseconds (libuv's cached loop time), which would round every latency in
        # metrics() to 1 ms: a loop whose clock reads monotonic time gets time.monotonic
        # itself; only a loop with a clock of its own (a test's virtual time) keeps it.
        if type(loop).time is asyncio.BaseEventLoop.time:
            return time.monotonic
        if abs(loop.time() - time.monotonic()) < 0.5:
            return time.monotonic
        return loop.time
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


def _leaf(exc: BaseException | None) -> BaseException | None:
    """The first exception inside task-group wrappers (the one the dispatcher raised)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


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
            the batcher's :class:`_TrioTimeouts` does). Its timers take deadlines on the
            batcher's clock: the same monotonic time as the loop's, read finer where the loop
            rounds it (uvloop's ``time()`` counts whole milliseconds, so a timer fires at most
            that much late, never early).
        alive: a dispatcher is running, or about to.
        managed: the dispatcher was started by ``async with`` (it stays so after the block).
        stopped: set when the latest dispatcher has ended (None before the first start).
        scope: the running dispatcher's cancel scope (a drain that times out cancels it).
        idle: the waiter the dispatcher sleeps on while no request is queued (None while it
            works). Then it holds its batcher weakly: :meth:`batcher_gone` (the callback of
            that weak reference) wakes it, from whatever thread collected the batcher, and it
            ends.
        call_soon: runs a callback on the bound loop from any thread (:func:`threadsafe_caller`).
    """

    __slots__ = (
        "alive", "call_soon", "idle", "loop", "managed", "new_waiter", "now", "scope",
        "stopped", "timers",
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
        self.idle: Waiter | None = None
        self.call_soon: Callable[[Callable[[], None]], None] | None = None

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
        self.idle = None
        if task_group is None:
            self.call_soon = spawn_background(serve)
        else:
            self.managed = True
            self.call_soon = threadsafe_caller()
            task_group.start_soon(serve, name=name)

    def stop(self) -> None:
        """The dispatcher ended: nothing is bound until the next start."""
        self.scope = None
        self.alive = False
        self.idle = None

    def batcher_gone(self, _ref: object = None) -> None:
        """The batcher was collected (a weak reference's callback, on any thread): wake its
        idle dispatcher, which then ends."""
        call_soon = self.call_soon
        if call_soon is not None:
            call_soon(self._wake_idle)

    def _wake_idle(self) -> None:
        idle = self.idle
        if idle is not None and not idle.done():
            idle.set_result(None)



# -- the dispatcher task --------------------------------------------------------------------------


class _Dispatched(Protocol):
    """The batcher's side of its dispatcher task (:class:`~aloader.serve._batcher.Batcher`)."""

    _binding: _LoopBinding
    _trio_timeouts: _TrioTimeouts
    _name: str

    async def _dispatch(self, task_group: TaskGroup) -> Waiter | None: ...

    def _stop(self, cause: BaseException | None = None) -> None: ...


def dispatcher_of(batcher: _Dispatched) -> Callable[[], Coroutine[Any, Any, None]]:
    """The dispatcher task's function for ``batcher``. It holds the batcher weakly: while no
    request is queued nothing of the dispatcher's keeps the batcher (and a batched method's
    instance) alive, so one that nobody holds any more is collected, and its dispatcher ends
    (the weak reference's callback wakes it)."""
    ref = weakref.ref(batcher, batcher._binding.batcher_gone)
    return functools.partial(_serve, ref)


async def _serve(ref: weakref.ref[_Dispatched]) -> None:
    batcher = ref()
    if batcher is None:
        return  # collected before its dispatcher started
    binding = batcher._binding
    timeouts = batcher._trio_timeouts
    name = batcher._name
    del batcher
    stopped = binding.stopped
    assert stopped is not None
    try:
        with anyio.CancelScope() as scope:
            binding.scope = scope
            if binding.timers is None:
                async with anyio.create_task_group() as alarm_group:
                    alarm_group.start_soon(timeouts.run, name=f"aloader.Batcher({name}) timeouts")
                    async with anyio.create_task_group() as task_group:
                        await _serve_batches(ref, task_group)
                    alarm_group.cancel_scope.cancel()  # every batch has ended
            else:
                async with anyio.create_task_group() as task_group:
                    await _serve_batches(ref, task_group)
    except BaseException as exc:
        # A cancellation (maybe inside a task-group wrapper), or a BaseException that no
        # caller of its batch received.
        cause = _leaf(exc)
        cancelled = isinstance(cause, anyio.get_cancelled_exc_class())
        _stopped(ref, binding, None if cancelled else cause)
        if cancelled or cause is None or binding.managed:
            raise  # `async with`'s exit unwraps it
        # Lazily started: out of the event loop as itself, as from Ray's batch task (asyncio
        # stops there for KeyboardInterrupt and SystemExit; in an exception group it would
        # only be logged once the task is collected).
        raise cause from cause.__cause__
    else:
        _stopped(ref, binding)
    finally:
        stopped.set()


async def _serve_batches(ref: weakref.ref[_Dispatched], task_group: TaskGroup) -> None:
    """Dispatch while there is work; in between, sleep on the idle waiter holding no strong
    reference to the batcher (see :func:`dispatcher_of`)."""
    while True:
        batcher = ref()
        if batcher is None:
            return  # collected while idle: no caller, nothing queued
        binding = batcher._binding
        idle = await batcher._dispatch(task_group)
        del batcher
        if idle is None:
            return  # closing
        binding.idle = idle
        await idle
        binding.idle = None


def _stopped(
    ref: weakref.ref[_Dispatched], binding: _LoopBinding, cause: BaseException | None = None
) -> None:
    batcher = ref()
    if batcher is None:
        binding.stop()  # collected: nothing was queued
    else:
        batcher._stop(cause)
