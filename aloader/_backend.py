"""The little that differs between asyncio and trio: which one runs, and background tasks.

A loader iterator must keep fetching while the consumer's ``async for`` body runs, yet a plain
``async for`` gives it no task group to live in. So the pipeline runs as a detached background
task (an asyncio task, or a trio system task) that owns its own task group, and the iterator
cancels it explicitly on close, cancellation or garbage collection.

The hot paths wait with :func:`waiters`' one-shot waiters, made by a factory looked up once
(per epoch, per :class:`~aloader._util.Signal`): a plain future of the running asyncio loop,
or trio's low-level park and reschedule (:func:`_trio_waiters`), with none of anyio's per-object
look-up of the running library.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any, Protocol, cast

import anyio

__all__ = (
    "Detached",
    "Spawner",
    "Waiter",
    "current_backend",
    "spawn_background",
    "task_group",
    "threadsafe_caller",
    "waiters",
)

# asyncio only keeps weak references to tasks: hold them until they finish.
_ASYNCIO_TASKS: set[asyncio.Task[Any]] = set()


def current_backend() -> str | None:
    """Name of the async library running in this thread ("asyncio" or "trio"), or None."""
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            pass
        else:
            return "trio"
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return None
    return "asyncio"


class Waiter(Protocol):
    """A one-shot wake-up for ONE task, shaped like a future: ``await waiter`` returns once
    ``set_result(None)`` ran; set it only while not :meth:`done`.

    One task only: on asyncio it is the loop's plain future, which a cancelled waiter cancels
    (so a waiter is never shared, and a cancelled one is :meth:`done`, never woken). Set it on
    the loop's thread.
    """

    def done(self) -> bool: ...

    def set_result(self, result: None, /) -> None: ...

    def __await__(self) -> Generator[Any, None, Any]: ...


_DONE_ITER: Generator[Any, None, Any] = cast("Generator[Any, None, Any]", iter(()))


@functools.cache
def _trio_waiters() -> Callable[[], Waiter]:
    """The :class:`Waiter` class on trio, made once trio is running (trio is never imported
    at module load): trio's own low-level pair (park with ``wait_task_rescheduled``, wake
    with ``reschedule``), without ``trio.Event``'s set of tasks, its abort closure and its
    checkpoint (measured on the batcher: a request and the dispatcher's wake-up cost 8 us
    less per request than with two Events).

    Like the asyncio future it stands for, awaiting it once done returns at once (no
    checkpoint), and a cancelled wait leaves it not done, so a later ``set_result`` wakes
    nobody.
    """
    from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

    class _TrioWaiter:
        __slots__ = ("_done", "_task")

        def __init__(self) -> None:
            self._done = False
            self._task: Any = None

        def done(self) -> bool:
            return self._done

        def set_result(self, result: None, /) -> None:
            self._done = True
            task = self._task
            if task is not None:
                self._task = None
                reschedule(task)

        def _abort(self, raise_cancel: object) -> Abort:
            self._task = None  # cancelled: trio raises in the task, never reschedule it
            return Abort.SUCCEEDED

        def __await__(self) -> Generator[Any, None, Any]:
            if self._done:
                return _DONE_ITER
            if self._task is not None:
                # A second task would take the first one's wake-up (and leave it parked).
                raise RuntimeError("a Waiter is awaited by one task at a time")
            self._task = current_task()
            # Trio's own awaitable, not a generator around it: one frame less per wake-up.
            return wait_task_rescheduled(self._abort).__await__()

    return _TrioWaiter


def waiters() -> Callable[[], Waiter]:
    """The factory of :class:`Waiter` s for the running event loop (look it up once, use it
    for many waits on this loop): the loop's ``create_future`` on asyncio.

    Raises:
        RuntimeError: outside an asyncio or trio event loop.
    """
    backend = current_backend()
    if backend == "trio":
        return _trio_waiters()
    if backend == "asyncio":
        return asyncio.get_running_loop().create_future
    raise RuntimeError("aloader needs a running asyncio or trio event loop")


class Spawner(Protocol):
    """What :func:`task_group` yields: ``start_soon(fn, *args)`` runs ``fn(*args)`` as a child."""

    def start_soon(self, fn: Callable[..., Awaitable[Any]], /, *args: Any) -> None: ...


class _AsyncioSpawner:
    __slots__ = ("_group",)

    def __init__(self, group: asyncio.TaskGroup) -> None:
        self._group = group

    def start_soon(self, fn: Callable[..., Awaitable[Any]], /, *args: Any) -> None:
        self._group.create_task(fn(*args))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def task_group() -> AsyncIterator[Spawner]:
    """A task group for many short-lived children (a :class:`Spawner`).

    The contract of anyio's task group: the block exits once every child has; a child's
    exception cancels the others and the block, and is raised in an ``ExceptionGroup``;
    cancelling the block's task (an enclosing cancel scope) cancels the children and waits
    for them. It is the backend's own group, ``asyncio.TaskGroup`` or a trio nursery, whose
    children are plain tasks: anyio's start costs several times a task's creation (on asyncio
    a cancel scope, an event and a wrapper coroutine each, the wrapper a frame more on every
    resume), which an epoch of hundreds of fetch workers paid at every start.
    """
    backend = current_backend()
    if backend == "asyncio":
        async with asyncio.TaskGroup() as group:
            yield _AsyncioSpawner(group)
    elif backend == "trio":
        import trio

        async with trio.open_nursery() as nursery:
            yield cast(Spawner, nursery)  # its start_soon takes a coroutine function, as here
    else:
        raise RuntimeError("aloader needs a running asyncio or trio event loop")


def threadsafe_caller() -> Callable[[Callable[[], None]], None]:
    """A function that runs a plain callback on the running event loop, from any thread.

    It does nothing once the loop has closed (there is nothing left to notify then).
    """
    backend = current_backend()
    if backend == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def call_soon_trio(callback: Callable[[], None]) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(callback)

        return call_soon_trio
    if backend == "asyncio":
        loop = asyncio.get_running_loop()

        def call_soon_asyncio(callback: Callable[[], None]) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(callback)

        return call_soon_asyncio
    raise RuntimeError("aloader needs a running asyncio or trio event loop")


def spawn_background(fn: Callable[[], Awaitable[None]]) -> Callable[[Callable[[], None]], None]:
    """Start ``fn()`` as a detached task of the running event loop.

    ``fn`` must handle its own exceptions. Returns :func:`threadsafe_caller`'s function for that
    loop (used to cancel the task from ``__del__``, whatever thread runs it).
    """
    call_soon = threadsafe_caller()
    if current_backend() == "trio":
        import trio

        # In the spawner's context, as asyncio's tasks are: a virtual replica's worker facts
        # (aloader._workerinfo) reach the tasks its iteration starts.
        trio.lowlevel.spawn_system_task(fn, context=contextvars.copy_context())
    else:
        loop = asyncio.get_running_loop()

        async def main() -> None:
            await fn()

        task = loop.create_task(main())
        _ASYNCIO_TASKS.add(task)
        task.add_done_callback(_ASYNCIO_TASKS.discard)
    return call_soon


class Detached:
    """A detached background task whose work anyone may cancel.

    ``__del__`` of an iterator, another thread, or a call that comes before the task has even
    started: :meth:`cancel` covers them all. The task runs its work inside :meth:`scope`.
    """

    __slots__ = ("_call_soon", "_cancel_requested", "_scope")

    def __init__(self) -> None:
        self._scope: anyio.CancelScope | None = None
        self._cancel_requested = False
        self._call_soon: Callable[[Callable[[], None]], None] | None = None

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Start ``fn()`` with :func:`spawn_background`."""
        self._call_soon = spawn_background(fn)

    def scope(self) -> anyio.CancelScope:
        """The cancel scope for the task's work (already cancelled if cancel came first)."""
        scope = self._scope = anyio.CancelScope()
        if self._cancel_requested:
            scope.cancel()
        return scope

    def cancel(self) -> None:
        """Cancel the task's work; safe from any thread and from ``__del__``."""
        self._cancel_requested = True
        if self._call_soon is not None:
            self._call_soon(self._cancel_now)

    def _cancel_now(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
