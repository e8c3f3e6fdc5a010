"""A plain ``for`` over any async iterable: ``for batch in loader``, ``for item in stream``.

This module owns the synchronous side of aloader: :class:`SyncIterator` drives an async
iterator (one epoch of a :class:`~aloader.DataLoader`, of a :class:`~aloader.Stream`, or any
other) from synchronous code, on a :class:`PrivateLoop`, an asyncio event loop in a background
thread named ``aloader-loop``. It knows nothing of loaders: the owner of the async iterable
decides which loop runs it.

A loader keeps one loop for all its ``for`` epochs (:func:`loop_of`), started by the first
``for`` and kept for as long as the loader lives, so that what the dataset binds to the running
loop (an ``httpx.AsyncClient``, an ``aiohttp`` session, a lock) stays usable from one epoch to
the next. That loop is closed by :meth:`aloader.DataLoader.close`, when the loader is
garbage-collected, and at interpreter exit; nothing on the loop holds the loader between
epochs, so the loop never keeps it alive. A stream's ``for`` gets a loop of its own, closed
with its iterator.

The private loop is uvloop's when uvloop is installed (``pip install 'aloader[fast]'``), else
asyncio's; ``ALOADER_UVLOOP=0`` in the environment keeps asyncio's (read when a loop starts).

An epoch that needs no event loop at all (an in-memory dataset's: see
:attr:`aloader.pipeline._epoch.MapEpoch.loopless`; a loopless stream's, batched on the consumer's
call: :class:`aloader.loader._epochs.InlineIterableEpoch`) runs on the consumer's thread instead,
with no loop and no thread: :class:`LocalIterator` drives its steps with :func:`run_here`.

A pump task on the loop moves items into a thread-safe queue, at most ``_Pump.AHEAD`` ahead
of the consumer, so a ``next()`` that finds its item ready costs one queue read rather than a
round trip through the loop; items cross in blocks both ways, the pump woken once the
consumer has drained the queue, and a consumer waiting on the empty queue once for what a step
of the loop made (see :class:`_Pump`). The async iterator is closed (``aclose()``, when it
has one) when it ends, and when the sync iterator is closed, garbage-collected or still open
when the loop closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import importlib
import os
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sized
from typing import Any, Generic, Protocol, TypeVar, cast

import anyio

from ._backend import current_backend, threadsafe_caller

# sniffio's context variable (anyio sets it in anyio.run()); anyio may run without sniffio.
_LIBRARY_VAR: contextvars.ContextVar[str | None] | None
try:
    from sniffio import current_async_library_cvar as _LIBRARY_VAR
except ImportError:  # pragma: no cover - anyio without sniffio
    _LIBRARY_VAR = None

__all__ = (
    "LocalIterator",
    "LoopOwner",
    "PrivateLoop",
    "SyncIterator",
    "forbid_running_loop",
    "loop_factory",
    "loop_of",
    "parked",
    "run_here",
)

T = TypeVar("T")

#: The environment variable that turns uvloop off for the private loops (``0``).
UVLOOP_ENV = "ALOADER_UVLOOP"
T_co = TypeVar("T_co", covariant=True)

_END = object()


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes a private loop: uvloop's ``new_event_loop`` when uvloop is installed, unless
    the environment says ``ALOADER_UVLOOP=0`` (or ``false``, ``no``, ``off``); else None, for
    asyncio's own loop."""
    if os.environ.get(UVLOOP_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return None
    return cast(Callable[[], asyncio.AbstractEventLoop], uvloop.new_event_loop)


class PrivateLoop:
    """An asyncio event loop running in a daemon thread, for one loader's ``for`` epochs:
    uvloop's when :func:`loop_factory` says so.

    Invariant: once :meth:`close` has begun, nothing more is submitted, and everything
    submitted before has run (or been cancelled) by the time the thread exits, so no caller
    waits for a coroutine that will never run. A BaseException raised by a submitted
    coroutine (KeyboardInterrupt, SystemExit) goes to its caller, never into the loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._resume: threading.Event | None = None  # the last parked() hold's
        self._pid = os.getpid()
        ready: concurrent.futures.Future[tuple[asyncio.AbstractEventLoop, asyncio.Event]]
        ready = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="aloader-loop", daemon=True
        )
        self._thread.start()
        self._loop, self._stop = ready.result()
        _LOOPS.add(self)

    @staticmethod
    def _run(
        ready: concurrent.futures.Future[tuple[asyncio.AbstractEventLoop, asyncio.Event]],
    ) -> None:
        async def main() -> None:
            stop = asyncio.Event()
            ready.set_result((asyncio.get_running_loop(), stop))
            await stop.wait()

        # Closing the runner cancels what is left and waits for it: every epoch winds down first.
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(main())

    @property
    def closed(self) -> bool:
        """Closed, or inherited by a forked child (which has the object but not the thread)."""
        return self._closed or self._pid != os.getpid()

    def submit(self, fn: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run ``fn()`` on the loop. Cancelling the future cancels the task; the future is
        cancelled too if the loop closes before the task has run."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        async def run() -> None:
            try:
                result = await fn()
            except BaseException as exc:  # the caller's, never the loop's
                # A cancellation too ends the task here, not re-raised: a cancelled task keeps
                # its CancelledError, whose traceback holds fn's frames (an epoch's iterator,
                # its loader) in a cycle that only a later garbage collection would free,
                # after the caller was told that everything had ended.
                _settle(future.set_exception, exc)
            else:
                _settle(future.set_result, result)

        def start() -> None:
            if future.cancelled():
                return
            task = self._loop.create_task(run())
            # A task cancelled before its first step never runs its body to settle the future.
            task.add_done_callback(lambda _: future.cancel())
            future.add_done_callback(lambda f: self._cancel_soon(task) if f.cancelled() else None)

        with self._lock:
            if self.closed:
                future.cancel()
                return future
            # The caller's context goes with the task (its context variables are the
            # dataset's too), less the async library it names: code run under anyio.run()
            # with trio (or any sniffio user) would make anyio read this asyncio loop as trio.
            context = contextvars.copy_context()
            if _LIBRARY_VAR is not None:
                context.run(_LIBRARY_VAR.set, None)
            self._loop.call_soon_threadsafe(start, context=context)
        return future

    def _cancel_soon(self, task: asyncio.Task[None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: the task is long done
            self._loop.call_soon_threadsafe(task.cancel)

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` on the loop and wait for its result (from another thread)."""
        return self.submit(fn).result()

    @property
    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self) -> None:
        """Stop the loop, cancelling what still runs there, and wait until its thread exits.

        From the loop's own thread (a finalizer run by the garbage collector there) it only
        asks the loop to stop.
        """
        with self._lock:
            if self.closed:
                return
            self._closed = True
            if self._resume is not None:
                self._resume.set()  # held by parked(): let go, or the join below never ends
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop is already gone (interpreter shutdown)
                return
        if not self.in_loop_thread:
            self._thread.join()


#: The private loops of this process, for :func:`parked`.
_LOOPS: weakref.WeakSet[PrivateLoop] = weakref.WeakSet()


@contextlib.contextmanager
def parked(timeout: float = 1.0) -> Iterator[frozenset[threading.Thread] | None]:
    """Hold every running private loop between two of its callbacks for the ``with`` block,
    and yield the threads known to be quiet meanwhile (None if a loop did not stop in
    ``timeout`` seconds: one busy in a long step).

    For a fork of this process (:mod:`aloader.workers._spawn`'s template), which copies only the
    forking thread: a thread that held a lock at that moment leaves it held in the child.
    A held loop thread is inside this module's own callback, holding nothing, and so is an
    idle anyio worker thread of that loop (one the loop lists as idle waits for its next job
    on its own queue, and only the held loop hands out jobs). The caller decides what to do
    with other threads (a user's, a busy worker's).

    Called from a thread that is not a private loop's; a loop closed meanwhile is let go
    first (its ``close`` would otherwise wait for its held thread).
    """
    resume = threading.Event()
    holds: list[tuple[PrivateLoop, threading.Event]] = []

    def hold(stopped: threading.Event) -> None:
        stopped.set()
        resume.wait(timeout + 60)  # never forever, whatever the holder does

    try:
        for loop in list(_LOOPS):
            stopped = threading.Event()
            with loop._lock:
                if loop.closed:
                    continue
                loop._resume = resume
                loop._loop.call_soon_threadsafe(hold, stopped)
            holds.append((loop, stopped))
        deadline = time.monotonic() + timeout
        if not all(stopped.wait(max(0.0, deadline - time.monotonic())) for _, stopped in holds):
            yield None
            return
        quiet: set[threading.Thread] = set()
        for loop, _ in holds:
            quiet.add(loop._thread)
            for thread in threading.enumerate():
                # anyio's asyncio worker threads: ``loop``, and the loop's deque of the idle.
                idle = getattr(thread, "idle_workers", None)
                if getattr(thread, "loop", None) is loop._loop and idle is not None \
                        and thread in idle:
                    quiet.add(thread)
        yield frozenset(quiet)
    finally:
        resume.set()


def _settle(setter: Callable[[Any], None], value: Any) -> None:
    # The future stays pending while its task runs (so that cancel() works): it may have been
    # cancelled meanwhile.
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        setter(value)


class LoopOwner(Protocol):
    """An object that keeps one private loop for its ``for`` iterations (a DataLoader)."""

    _sync_loop: PrivateLoop | None
    _sync_loop_close: weakref.finalize[[], Any] | None


def loop_of(owner: LoopOwner) -> PrivateLoop:
    """The owner's private loop, started on first use (again once closed)."""
    loop: PrivateLoop | None = owner._sync_loop
    if loop is None or loop.closed:
        loop = owner._sync_loop = PrivateLoop()
        # The finalizer holds the loop, not the owner: collecting the owner closes it.
        owner._sync_loop_close = weakref.finalize(owner, loop.close)
    return loop


def forbid_running_loop(owner: str, target: str) -> None:
    """Refuse a ``for`` inside a running event loop, which it would block.

    Raises:
        RuntimeError: an event loop runs in this thread (the message names ``owner`` and
            suggests ``async for {target}``).
    """
    if current_backend() is not None:
        raise RuntimeError(
            f"{owner}: `for {target}` was used inside a running event loop, where it would "
            f"block the loop; use `async for {target}` instead"
        )


class _Pump:
    """Runs on the private loop: fetches ahead while the consumer works on its batch.

    At most ``AHEAD`` batches wait in the hand-off queue. The pump counts them itself (the
    queue's size) and the consumer's thread wakes the loop only when the pump is actually
    waiting, so a batch costs no cross-thread call while the pump keeps ahead. Batches cross
    in blocks: a pump waiting for room is woken once the consumer has taken the queue down to
    ``LOW`` (or is about to wait for it), and refills it back to back, so that a consumer
    slower than the pipeline costs one wake-up of the loop per ``AHEAD - LOW`` batches, and
    each waiting pump is woken once.

    The other way too: while the consumer waits on the empty queue (:attr:`consumer_waits`),
    the batches that the loop makes are held in :attr:`pending` and put together when the
    step that made them ends (:meth:`flush`, called soon on the loop), or as soon as ``BLOCK``
    are held, the pipeline ends or an error comes. On asyncio's loop, whose queue of ready
    callbacks the pump can see, a flush that finds it not empty (the loop is busy: its next
    step starts at once) holds the block on to the next step, ``HOLD_STEPS`` times at most:
    each hand-off stalls a busy loop thread while the consumer's thread is scheduled and
    runs, and a busy asyncio step makes about half as many batches as uvloop's (five of the
    io workload's against nine), so that a block per step woke the consumer twice as often
    as on uvloop (uvloop's queue is not visible: its blocks stay one step's). A loop with
    nothing more ready hands the block over at once. ``BLOCK`` is above ``AHEAD``: a busy
    loop's step finishes a dozen batches at once, and capped at ``AHEAD`` such a step crossed as
    three blocks, each a hand-off of the GIL to the consumer and back (a few futex calls, and
    under load a wait of the loop thread for the consumer's to be scheduled), and while the
    consumer had not taken a block the pump stopped pulling, so the pipeline's room for
    finished batches ran out and its fetch workers parked. A consumer that waits takes a
    block at once, so the queue holds more than ``AHEAD`` only for that moment; one that does
    not wait keeps at most ``AHEAD`` waiting. The consumer's thread is woken once per block
    rather than once per batch, and handed the GIL then (woken by the put, it would otherwise
    wait for the interpreter's switch interval, 5 ms, while the busy loop thread keeps the
    GIL): each wake-up is a few futex calls and a GIL round trip, in which the loop thread
    waits for the consumer's thread to be scheduled. A consumer that does not wait gets each
    batch at once.

    Invariants: a batch held in :attr:`pending` has a flush due on the loop, so none is left
    there (a consumer interrupted meanwhile included), and everything crosses in the order the
    iterator made it. A KeyboardInterrupt may land between any two steps of the consumer's (between
    taking a batch and waking the pump too); the pump's state never depends on the consumer
    finishing a step, and every wait for an empty queue first wakes the pump, so a later
    ``next()`` never waits for a pump that waits for it.
    """

    AHEAD = 4
    LOW = 1
    BLOCK = 16
    # Bounded in steps, not waiting for BLOCK: a loop kept busy by other tasks while the
    # pipeline makes nothing more must not keep a waiting consumer's batches from it.
    HOLD_STEPS = 3
    # In the main thread a wait wakes up this often (seconds) to let CPython run a signal's
    # handler, which it does only between bytecodes: a SIGINT that trips without interrupting
    # the blocked wait (landing just before the wait starts, handled by another thread, or
    # `_thread.interrupt_main()`) would otherwise not interrupt it until a batch arrives.
    SIGNAL_CHECK = 0.1

    def __init__(self, iterator: AsyncIterator[Any]) -> None:
        self.iterator = iterator
        self.out: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()
        self.waiting: anyio.Event | None = None
        self.woken: anyio.Event | None = None  # the waiting event woken last (consumer's side)
        self.call_soon = threadsafe_caller()
        self._loop = asyncio.get_running_loop()  # made on the loop it runs on
        # asyncio's queue of the callbacks that its next step runs; uvloop shows none (None).
        self._ready: Sized | None = getattr(self._loop, "_ready", None)
        # The consumer is blocked on an empty queue (set and cleared by its thread).
        self.consumer_waits = False
        # Made while the consumer waits, put at the end of the loop's step (the loop's side).
        self.pending: list[tuple[Any, BaseException | None]] = []
        self.flushing = False  # a _flush_due is queued on the loop (exactly one)

    async def run(self) -> None:
        while True:
            while self.full():
                self.flush()  # room comes only from what the consumer can see
                waiting = self.waiting = anyio.Event()
                # Checked again after publishing the event: the consumer may have taken a batch
                # in between, and then it saw no event to set.
                if not self.full():
                    break
                await waiting.wait()
            self.waiting = None
            try:
                value = await self.iterator.__anext__()
            except StopAsyncIteration:
                self.send((_END, None), now=True)
                return
            except asyncio.CancelledError:  # the iterator or the loop is closing: no more
                self.send((_END, None), now=True)
                raise
            except BaseException as exc:  # KeyboardInterrupt too: the consumer's to handle
                self.send((None, exc), now=True)
            else:
                self.send((value, None))

    def full(self) -> bool:
        """Whether the pump must stop pulling batches: ``BLOCK`` held for a consumer waiting
        on the empty queue, else ``AHEAD`` put or held."""
        queued = self.out.qsize()
        if self.consumer_waits and not queued:
            return len(self.pending) >= self.BLOCK
        return queued + len(self.pending) >= self.AHEAD

    def send(self, item: tuple[Any, BaseException | None], now: bool = False) -> None:
        """Hand ``item`` to the consumer: held for the end of this step while it waits, put
        at once with ``now`` (an error, the end)."""
        self.pending.append(item)
        if now or not self.consumer_waits:
            # No hand-off of the GIL here: a consumer that does not wait needs none, and one
            # acting at once on an error (leaving its `for` on a KeyboardInterrupt, collecting
            # the loader) would find the error still held by the pump's frame, and with it
            # what its traceback holds: the loader stayed alive, its loop thread too.
            self.flush(hand_off=False)
        elif not self.flushing:
            self.flushing = True
            # Run in the loop's next step, after the callbacks of this one (which may make
            # more batches): the block is what one step made, or a few of a busy loop's.
            self._loop.call_soon(self._flush_due, self.HOLD_STEPS)

    def _flush_due(self, steps: int) -> None:
        """At the end of a step: flush, or hold on one more step while the loop is busy
        (``steps`` more at most)."""
        ready = self._ready
        if steps and ready is not None and len(ready) and self.pending and self.consumer_waits:
            self._loop.call_soon(self._flush_due, steps - 1)
            return
        self.flushing = False
        self.flush()

    def flush(self, hand_off: bool = True) -> None:
        """Put the held batches, in order, and hand the GIL to a consumer waiting for them."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        put = self.out.put
        for item in pending:
            put(item)
        if hand_off and self.consumer_waits:
            time.sleep(0)  # the GIL to the waiting consumer now (see the class doc)

    def take(self) -> tuple[Any, BaseException | None]:
        """The next item of the queue, waiting for it (called from the consumer's thread)."""
        try:
            item = self.out.get(block=False)
        except queue.Empty:
            main = threading.current_thread() is threading.main_thread()
            item = self._wait(self.SIGNAL_CHECK if main else None)
        if self.out.qsize() <= self.LOW:
            self.wake()
        return item

    def _wait(self, every: float | None) -> tuple[Any, BaseException | None]:
        self.consumer_waits = True
        try:
            while True:
                self.wake()  # an interrupted take may have left the pump waiting
                with contextlib.suppress(queue.Empty):
                    return self.out.get(timeout=every)
        finally:
            self.consumer_waits = False

    def wake(self) -> None:
        """Wake the pump if it waits for room in the queue (from the consumer's thread)."""
        waiting = self.waiting
        if waiting is not None and waiting is not self.woken:
            self.call_soon(waiting.set)
            self.woken = waiting  # after the call: an interrupt in between only repeats it


def _shutdown(
    loop: PrivateLoop, pump: _Pump, task: concurrent.futures.Future[None], owns_loop: bool
) -> None:
    task.cancel()
    aclose = getattr(pump.iterator, "aclose", None)
    if aclose is not None:
        future = loop.submit(aclose)
        if not loop.in_loop_thread:  # the loop's own thread cannot wait for it
            # Cancelled: the loop closed first, and nothing is left to stop.
            with contextlib.suppress(concurrent.futures.CancelledError, asyncio.CancelledError):
                future.result()
    # Errors left in the queue hold the pump through their tracebacks (its ``run`` frame), and
    # the pump holds the async iterator: dropped now, the iterator (a loader's epoch, and the
    # loader, whose collection closes its loop) goes when the pump's task ends, not at some
    # later collection of that cycle.
    with contextlib.suppress(queue.Empty):
        while True:
            pump.out.get_nowait()
    if owns_loop:
        loop.close()


def run_here(awaitable: Awaitable[T]) -> T:
    """Run ``awaitable`` to its end on this thread, with no event loop, and return its result.

    For a step that never awaits a real event (an inline epoch's, see
    :attr:`aloader.pipeline._epoch.MapEpoch.loopless`): ``send(None)`` runs it to its end at
    once.
    A bare ``yield`` (``asyncio.sleep(0)``) only gives turns, so it goes on; anything else
    waits for a loop that is not there.

    Raises:
        RuntimeError: the step awaited an event (it is closed first).
    """
    step = awaitable.__await__()
    try:
        while True:
            if step.send(None) is not None:
                step.close()
                raise RuntimeError(
                    f"{awaitable!r} awaited an event, but it runs with no event loop"
                )
    except StopIteration as done:
        return cast(T, done.value)


class LocalIterator(Generic[T_co]):
    """A plain iterator over an async iterator whose steps never await a real event, driven
    on the consumer's thread (:func:`run_here`): no loop, no thread, no hand-off per item.

    A BaseException of the async iterator (KeyboardInterrupt too) is raised by
    :meth:`__next__` as itself, and the iterator goes on. It is closed (``aclose()``, when it
    has one) at its end and by :meth:`close`; dropped, it is left to its own finalizer.

    Args:
        source: the async iterator.
    """

    def __init__(self, source: AsyncIterator[T_co]) -> None:
        self._source = source
        self._closed = False

    @property
    def source(self) -> AsyncIterator[T_co]:
        """The async iterator this iterator drives."""
        return self._source

    def __iter__(self) -> LocalIterator[T_co]:
        return self

    def __next__(self) -> T_co:
        if self._closed:
            raise StopIteration
        try:
            return run_here(self._source.__anext__())
        except StopAsyncIteration:
            self.close()
            raise StopIteration from None

    def close(self) -> None:
        """Close the async iterator (``aclose()``), once."""
        if self._closed:
            return
        self._closed = True
        aclose = getattr(self._source, "aclose", None)
        if aclose is not None:
            run_here(aclose())


class SyncIterator(Generic[T_co]):
    """A plain iterator over the async iterator that ``open_()`` returns, run on ``loop``.

    ``open_`` is called on the loop (an async iterator may bind itself to the loop it starts
    on). With ``owns_loop`` the loop is closed with this iterator. A BaseException from the
    async iterator (KeyboardInterrupt too) is raised by :meth:`__next__` as itself.

    Args:
        open_: makes the async iterator.
        loop: the event loop to run it on.
        owns_loop: close ``loop`` when this iterator is closed or collected.
    """

    def __init__(
        self, open_: Callable[[], AsyncIterator[T_co]], loop: PrivateLoop, *,
        owns_loop: bool = False,
    ) -> None:
        async def pump() -> _Pump:
            return _Pump(open_())

        try:
            started = loop.call(pump)
        except BaseException:
            if owns_loop:
                loop.close()
            raise
        task = loop.submit(started.run)
        self._pump = started
        self._loop = loop
        self._close = weakref.finalize(self, _shutdown, loop, started, task, owns_loop)

    @property
    def source(self) -> AsyncIterator[T_co]:
        """The async iterator this iterator drives."""
        return self._pump.iterator

    def __iter__(self) -> SyncIterator[T_co]:
        return self

    def __next__(self) -> T_co:
        if not self._close.alive or self._loop._closed:  # closed, or its loop was
            self.close()
            raise StopIteration
        value, error = self._pump.take()
        if value is _END:
            self.close()
            raise StopIteration
        if error is not None:
            raise error
        return cast(T_co, value)

    def close(self) -> None:
        """Close the async iterator (``aclose()``) and wait until it is closed.

        For a loader's epoch, as :meth:`aloader.DataLoader.aclose` says, a fetch stuck in a
        thread after a ``timeout`` fired is abandoned: left running, its result discarded.
        """
        self._close()
