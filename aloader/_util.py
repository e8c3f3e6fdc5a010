"""Small helpers every part of aloader shares, each the one place its job is done.

It owns: :class:`Signal` (wake every task waiting for a change), :func:`is_async_callable`
(whether calling something gives an awaitable to await), :func:`resolve` (await a value if it
is awaitable), :func:`single_error` (the one error inside task-group exception groups),
:func:`close_iterator` and :class:`Closing` (release a sync or async iterator's files and
connections now, shielded from cancellation), :func:`taken` and :func:`ataken` (an iterator
taken from a user's object, safe to loop over again without asking the object for another), and
the argument checks :func:`check_int` and :func:`check_seconds`, whose messages name the
argument and what it should be. It imports nothing from aloader but :mod:`aloader._backend`
(which imports nothing from aloader), so any module may use it.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import functools
import inspect
import math
import os
import sys
import types
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import numpy as np

from ._backend import Waiter, current_backend, waiters

__all__ = (
    "Signal",
    "ataken",
    "check_int",
    "check_seconds",
    "close_iterator",
    "is_async_callable",
    "is_awaitable",
    "resolve",
    "single_error",
    "taken",
    "user_stacklevel",
)

T = TypeVar("T")


class Signal:
    """A change several tasks of one event loop wait for.

    :meth:`wait` returns at the first :meth:`notify` after it started; a ``notify`` with no
    task waiting is forgotten, so a waiter re-checks its condition in a loop
    (``while not ready: await signal.wait()``) and never misses a change made before it waited.
    ``notify`` is synchronous and cheap when nobody waits (nothing is made); it must be
    called on the loop's thread (from another thread, through the loop's call-soon).

    Each wait is one :func:`~aloader._backend.waiters` waiter of its own (a plain future on
    asyncio), from a factory looked up at the first wait and again only when the running
    asyncio loop is another one (a signal outliving its loop, as a pool's does).
    """

    __slots__ = ("_loop", "_new", "_waiters")

    def __init__(self) -> None:
        self._waiters: list[Waiter] = []
        self._new: Callable[[], Waiter] | None = None
        self._loop: object = None

    def notify(self) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def wait(self) -> None:
        loop = asyncio._get_running_loop()
        if self._new is None or loop is not self._loop:
            self._new, self._loop = waiters(), loop
        waiter = self._new()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:  # cancelled: the next notify has no use for it
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            raise


def usable_cpus() -> tuple[int | None, bool]:
    """(the CPUs this process may run on, whether its cpuset was taken into account): the
    affinity mask where the platform has one, else ``os.cpu_count()`` (None if unknown)."""
    try:
        return len(os.sched_getaffinity(0)), True
    except AttributeError:
        return os.cpu_count(), False


def is_async_callable(fn: object) -> bool:
    """Whether calling ``fn`` returns a coroutine to await: an ``async def`` function or
    bound method, an object whose ``__call__`` is ``async def``, or a ``functools.partial``
    of any of those. A class is not (calling it makes an instance); None is not."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    if fn is None or isinstance(fn, type) or inspect.isroutine(fn):
        return False
    call = getattr(fn, "__call__", None)  # noqa: B004 - a callable object with async __call__
    return call is not None and inspect.iscoroutinefunction(call)


# Exact types that are never awaitable: what fetches and collates return nearly always. A
# subclass may define ``__await__``, so only these types themselves are ruled out here.
_NEVER_AWAITABLE: frozenset[type] = frozenset(
    {list, tuple, dict, str, bytes, int, float, bool, type(None), np.ndarray}
)


def is_awaitable(value: object) -> bool:
    """``inspect.isawaitable(value)``, with the builtin results of fetches and collates
    (list, tuple, dict, str, bytes, numbers, None, ``ndarray``) ruled out by their exact
    type first: ``inspect.isawaitable`` ends in an ``isinstance`` against
    ``collections.abc.Awaitable``, a Python-level ABC check, on every batch."""
    return type(value) not in _NEVER_AWAITABLE and inspect.isawaitable(value)


async def resolve(value: Any) -> Any:
    """``value``, awaited first if it is awaitable (a fetch or collate of either kind)."""
    if is_awaitable(value):
        return await value
    return value


def single_error(error: BaseException) -> BaseException | None:
    """The one error inside (nested) exception groups, or None when they hold several.

    A task group wraps the error of its one failing task in a group of one (trio and anyio
    nest them); this unwraps it so the error reaches the caller with its own type. An error
    that is no group is its own single error.
    """
    while isinstance(error, BaseExceptionGroup):
        if len(error.exceptions) != 1:
            return None
        error = error.exceptions[0]
    return error


async def close_iterator(iterator: object, *, blocking: bool = True) -> None:
    """Close ``iterator`` now (``aclose()`` or ``close()``, whichever it has), shielded from
    cancellation so that a cancelled epoch still releases its files and connections.

    A synchronous ``close()`` runs a generator's cleanup, which may block: with ``blocking``
    it runs in a worker thread, else on the loop (for iterators that were pulled on the loop
    and promise not to block). Never call it while another thread may still be running the
    iterator (a pull abandoned in its thread): the caller skips the close then.
    """
    if getattr(iterator, "ag_frame", False) is None or getattr(iterator, "gi_frame",
                                                                False) is None:
        # A generator that has finished: closing it runs nothing, so it needs neither a
        # cancel scope nor a thread (most closes of an epoch's generators are of these).
        return
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        if current_backend() is None:
            # Driven with no event loop (``_facade.run_here``): nothing can cancel it.
            await aclose()
            return
        with anyio.CancelScope(shield=True):
            await aclose()
        return
    close = getattr(iterator, "close", None)
    if close is None:
        return
    if blocking and current_backend() is not None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(close)
    else:  # with no event loop, this is the consumer's own thread: it may block
        close()


# An epoch takes its iterator from a user's object once (``iter(dataset)``, ``iter(sampler)``,
# ``dataset.__aiter__()``), then pulls from it. ``for``, ``islice``, ``zip``, ``yield from``
# and ``async for`` each take an iterator of what they are given, again: of a generator or a
# list iterator that is itself, but a user's iterator runs its ``__iter__`` again, and one that
# is its own dataset or sampler (``__iter__`` resets the position and returns ``self``, a
# common pattern) starts over: batches cut with ``islice`` would repeat the first one forever.
# Every such loop over a user's iterator goes through these two.
_TAKEN_END: Any = object()
_SELF_ITER = collections.abc.Iterator.__iter__


def taken(iterator: Iterator[T]) -> Iterator[T]:
    """``iterator`` (taken from a user's object) as an iterator whose ``iter()`` is itself,
    to loop over without calling the object's ``__iter__`` again.

    An iterator of a builtin type (generator, list or map iterator: ``__iter__`` is C's, which
    returns itself), or one whose ``__iter__`` is ``collections.abc.Iterator``'s (``return
    self``), is returned as is; any other is pulled through ``next()`` by a builtin iterator
    (its end is its ``StopIteration``; other errors pass through, and it may be pulled on
    after them).
    """
    method = getattr(type(iterator), "__iter__", None)
    if isinstance(method, types.WrapperDescriptorType) or method is _SELF_ITER:
        return iterator
    step = getattr(type(iterator), "__next__", None)
    if step is None:  # not an iterator: next() says so, at the first pull
        return iter(functools.partial(next, iterator), _TAKEN_END)
    # The class's __next__ bound to it is what next() calls (never an instance attribute),
    # without next()'s own call on top: about half the cost per item of partial(next, ...).
    return iter(types.MethodType(step, iterator), _TAKEN_END)


class _ATaken(AsyncIterator[T]):
    """An async iterator pulled by ``__anext__`` whose ``__aiter__`` is itself (see
    :func:`ataken`); its other attributes (``aclose``, ``state_dict``) are the iterator's."""

    __slots__ = ("_iterator",)

    def __init__(self, iterator: AsyncIterator[T]) -> None:
        self._iterator = iterator

    def __aiter__(self) -> _ATaken[T]:
        return self

    def __anext__(self) -> Any:  # the iterator's awaitable itself: no frame of ours per item
        return self._iterator.__anext__()

    def __getattr__(self, name: str) -> Any:
        if name == "_iterator":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._iterator, name)


def ataken(iterator: AsyncIterator[T]) -> AsyncIterator[T]:
    """:func:`taken` for an async iterator: ``async for`` over the result never calls the
    user's ``__aiter__`` again (an async generator is returned as is)."""
    if isinstance(getattr(type(iterator), "__aiter__", None), types.WrapperDescriptorType):
        return iterator
    return _ATaken(iterator)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes :func:`warnings.warn`, called by this function's caller,
    blame the user's line: the first frame outside aloader, however deep the call came
    (``for`` goes through more of aloader's frames than ``async for``)."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    return level


class Closing:
    """``async with`` that closes an async generator, shielded so that cancellation cannot
    interrupt the release of its files and connections."""

    __slots__ = ("_iterator",)

    def __init__(self, iterator: AsyncGenerator[Any, None]) -> None:
        self._iterator = iterator

    async def __aenter__(self) -> AsyncGenerator[Any, None]:
        return self._iterator

    async def __aexit__(self, *exc_info: object) -> None:
        await close_iterator(self._iterator)


def check_int(
    name: str,
    value: object,
    *,
    minimum: int = 1,
    maximum: int | None = None,
    noun: str = "integer",
) -> int:
    """``value`` if it is an int (not a bool) from ``minimum`` (1 or 0) to ``maximum``.

    Raises:
        ValueError: naming ``name``: "``name`` should be a positive ``noun``, but got
            ``name=value``" ("non-negative" for ``minimum=0``), or "should be at most ...".
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = {1: "a positive", 0: "a non-negative"}.get(minimum, f"at least {minimum}, as")
        raise ValueError(f"{name} should be {kind} {noun}, but got {name}={value!r}")
    if maximum is not None and value > maximum:
        bound = f"sys.maxsize={maximum}" if maximum == sys.maxsize else str(maximum)
        raise ValueError(f"{name} should be at most {bound}, but got {name}={value!r}")
    return value


def check_seconds(
    name: str, value: object, *, allow_zero: bool = True, allow_inf: bool = True
) -> float:
    """``value`` as a number of seconds (a float); where None is allowed (meaning "no
    limit"), the caller checks ``None if value is None else check_seconds(...)``.

    An int too large for a float counts as infinitely far (``inf``, or ``-inf``).

    Raises:
        ValueError: naming ``name``: not a number (NaN and None included), negative (or zero
            where not ``allow_zero``), or infinite where not ``allow_inf``.
    """
    if value is None:
        raise ValueError(f"{name} should be a number of seconds, but got {name}=None")
    seconds = math.nan
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf if value > 0 else -math.inf
    if math.isnan(seconds):
        raise ValueError(f"{name} should be a number of seconds, but got {name}={value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        bound = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name} should be {bound}, but got {name}={value!r}")
    if seconds == math.inf and not allow_inf:
        raise ValueError(f"{name} should be finite, but got {name}={value!r}")
    return seconds
