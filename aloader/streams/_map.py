"""``Stream.map``: ``fn`` applied to every item, one call at a time or up to ``concurrency``
at once (:class:`_ConcurrentMap`), results in order (through
:class:`~aloader.pipeline._results.Results`, the loader's own buffer) or as they finish.
With ``concurrency="auto"`` the calls in flight follow a
:class:`~aloader._tuning.Controller`, kept by the stage from epoch to epoch (and in its saved
state); a call that raises :class:`~aloader.Throttled` waits and is made again.

:class:`MapStage` is the stage's whole behaviour; its stream class
(:class:`aloader.streams._stream._Mapped`) is made where ``Stream.map`` is defined, so that
this module needs :class:`~aloader.Stream` only for its annotations (no import cycle).

Invariant: item ``k`` out is item ``k`` in (ordered), and the stage holds at most
``2 * concurrency`` items (``"auto"``: twice the limit in force when each was pulled); a
failing call raises once the results before it are delivered.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import anyio
import anyio.abc
import anyio.to_thread

from .._exceptions import Throttled
from .._tuning import DEFAULT_MAX_LIMIT, Controller, check_concurrency, on_throttled
from .._util import Closing, check_int, close_iterator, is_async_callable
from ..pipeline._plan import again_when_throttled
from ..pipeline._results import Results
from ._context import _Context
from ._positions import (
    _UNORDERED,
    _bad_state,
    _check_upstream,
    _discard,
    _Skip,
    _state_of,
    check_stage,
)

if TYPE_CHECKING:
    from ._stream import Stream

T = TypeVar("T")
U = TypeVar("U")


def _on_loop(fn: Callable[[Any], Any]) -> Callable[[Any], Awaitable[Any]]:
    """A plain function called as an async one (on the loop, as ``concurrency=1`` calls it)."""
    async def call(item: Any) -> Any:
        return fn(item)

    return call


class _ConcurrentMap(Generic[T, U]):
    """``map`` with concurrency: workers pull items, results go back in order (or not).

    Item ``k`` (numbered in input order) is a job of a :class:`~aloader.pipeline._results.Results`
    of capacity ``2 * concurrency``: a worker reserves its output slot before it pulls the
    item, so at most ``2 * concurrency`` items are held between their pull and their hand-over
    to the consumer, and in order the head of the line can always be handed over.

    Workers start as work arrives, not all at once: one runs from the start, and a worker
    that has pulled an item starts another when no worker is left free to pull the next, so
    at most ``min(concurrency, calls in flight + 1)`` exist whatever ``concurrency`` says.
    With a ``tuner`` the concurrency is its limit: workers above it leave after their call,
    and the output buffer follows it.
    """

    def __init__(
        self,
        upstream: AsyncGenerator[tuple[list[T], Any], None],
        call: Callable[[T], Awaitable[U]],
        concurrency: int,
        ordered: bool,
        tuner: Controller | None = None,
        throttled: Callable[[Throttled, int], float] | None = None,
    ) -> None:
        self.upstream = upstream
        self.call = call
        self.tuner = tuner
        self.throttled = throttled
        if tuner is not None:
            concurrency = tuner.limit
            tuner.on_change = self.resize
        self.concurrency = concurrency
        self.results = Results(2 * concurrency, ordered)
        self.lock = anyio.Lock()  # one worker at a time reserves, numbers and pulls an item
        self.block: list[T] = []
        self.pos = 0
        self.exhausted = False
        self.next_seq = 0
        # (number of the first item, token) of each input block not yet all handed on.
        self.spans: deque[tuple[int, Any]] = deque()
        self.scope = anyio.CancelScope()
        self.group: anyio.abc.TaskGroup | None = None
        self.workers = 0  # started and not returned
        self.running = 0  # of them, inside a call
        self.max_running = 0
        self.max_workers = 0

    async def pull(self) -> tuple[int, T] | None:
        async with self.lock:
            if self.exhausted:
                return None
            seq = self.next_seq
            await self.results.reserve(seq)
            while self.pos >= len(self.block):
                try:
                    self.block, token = await self.upstream.__anext__()
                except StopAsyncIteration:
                    self.exhausted = True
                    self.results.finish(seq)
                    return None
                except Exception as exc:
                    # The upstream's error takes its place in the order.
                    self.exhausted = True
                    self.results.publish(seq, None, exc)
                    self.results.finish(seq + 1)
                    return None
                self.pos = 0
                if self.block:
                    self.spans.append((seq, token))
            item = self.block[self.pos]
            self.pos += 1
            self.next_seq = seq + 1
            if self.pos == len(self.block):
                self.block = []
            return seq, item

    def resize(self, limit: int) -> None:
        """The controller's new limit: the output buffer follows; workers above it leave
        after their call, and one more starts if all are busy."""
        self.concurrency = limit
        self.results.resize(2 * limit)
        if self.group is not None and self.running == self.workers < limit:
            self.spawn()

    async def worker(self) -> None:
        tuner = self.tuner
        while (got := await self.pull()) is not None:
            seq, item = got
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            if self.running == self.workers and self.workers < self.concurrency:
                self.spawn()  # nobody is left to pull the next item
            started = time.perf_counter_ns()
            try:
                try:
                    value = await self.call(item)
                except Throttled as exc:
                    if self.throttled is None:
                        raise
                    tuner = None  # the attempt that answered is not timed alone
                    value = await again_when_throttled(self.call, item, exc, self.throttled)
            except Exception as exc:
                self.results.publish(seq, None, exc)
            else:
                self.results.publish(seq, value)
            finally:
                self.running -= 1
            if tuner is not None:
                now = time.perf_counter_ns()
                tuner.done(now - started, now)
            tuner = self.tuner
            if self.workers > self.concurrency:
                return  # above the limit: this worker leaves

    def spawn(self) -> None:
        assert self.group is not None
        self.workers += 1
        self.max_workers = max(self.max_workers, self.workers)
        self.group.start_soon(self._worker_task)

    async def _worker_task(self) -> None:
        try:
            await self.worker()
        finally:
            self.workers -= 1

    async def run(self) -> None:
        try:
            with self.scope:
                async with anyio.create_task_group() as group:
                    self.group = group
                    self.spawn()
        finally:
            await close_iterator(self.upstream)


class MapStage(Generic[U]):
    """The map stage: what ``_Mapped`` (a :class:`~aloader.Stream`) does."""

    def __init__(
        self,
        upstream: Stream[Any],
        fn: Callable[[Any], Any],
        concurrency: int | str,
        ordered: bool,
        concurrency_limit: int | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"map needs a callable, but got {fn!r}")
        self.upstream = upstream
        self.fn = fn
        self.concurrency: int | str = cast(Any, check_concurrency("concurrency", concurrency))
        if concurrency_limit is not None:
            check_int("concurrency_limit", concurrency_limit)
            if concurrency != "auto":
                raise ValueError("concurrency_limit bounds concurrency='auto', but got "
                                 f"concurrency={concurrency!r}")
        self.ordered = bool(ordered)
        self.is_async = is_async_callable(fn)
        #: The most calls that ran at once, and the most items the stage held.
        self.max_running = 0
        #: Calls that raised :class:`~aloader.Throttled`, waited for and made again.
        self.throttled = 0
        #: With ``concurrency="auto"``, the controller of the calls in flight.
        self.tuner = (Controller(concurrency_limit or DEFAULT_MAX_LIMIT)
                      if concurrency == "auto" else None)

    def _upstreams(self) -> Sequence[Stream[Any]]:
        return (self.upstream,)

    def _blocks_at(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[U], Any], None]:
        # Item k out is item k in: the upstream resumes where the consumer was, and items the
        # consumer had are never mapped again.
        upstream = self.upstream._blocks_at(ctx, None if at is None else at["upstream"])
        tuning = None if at is None else at.get("concurrency")
        if tuning is not None and self.tuner is not None:
            self.tuner.load_state_dict(tuning)
        return _discard(self._mapped(ctx, upstream), 0 if at is None else at["skip"])

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        if token is _UNORDERED:
            raise ValueError(
                "map(..., ordered=False) hands on results as they finish, in no reproducible "
                "order: a stream with such a stage cannot save its position (use ordered=True)"
            )
        state = {"stage": "map", "upstream": _state_of(self.upstream, token, skip), "skip": 0}
        if self.tuner is not None:  # a resumed stream starts at the limit it had
            state["concurrency"] = self.tuner.state_dict()
        return state

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        check_stage(at, "map", "map")
        if not self.ordered:
            raise _bad_state("map", "stage", "names a map stage, but this one has "
                                             "ordered=False, which cannot resume")
        tuning = at.get("concurrency")
        if tuning is not None and self.tuner is not None:
            try:
                Controller().load_state_dict(tuning)
            except ValueError as exc:
                raise _bad_state("map", "concurrency", str(exc)) from None
        _check_upstream(self.upstream, at, slot)

    @property
    def tuning(self) -> dict[str, Any] | None:
        """With ``concurrency="auto"``: the controller's limit, estimates and history (as
        in :attr:`LoaderStats.concurrency`), and ``throttled``; else None."""
        if self.tuner is None:
            return None
        return {**self.tuner.snapshot(), "throttled": self.throttled}

    def _throttled(self, error: Throttled, in_a_row: int) -> float:
        """A call was throttled (see :func:`~aloader._tuning.on_throttled`): counted."""
        delay = on_throttled(error, in_a_row, self.tuner, time.perf_counter_ns())
        self.throttled += 1
        return delay

    async def _mapped(
        self, ctx: _Context, upstream: AsyncGenerator[tuple[list[Any], Any], None]
    ) -> AsyncGenerator[tuple[list[U], Any], None]:
        fn = self.fn
        tuner = self.tuner
        if self.concurrency == 1:
            async with Closing(upstream) as blocks:
                async for block, token in blocks:
                    # The results before a failing item are delivered before its error, as
                    # with concurrency: a block is not all or nothing.
                    done: list[U] = []
                    append = done.append
                    error: Exception | None = None
                    try:
                        if self.is_async:
                            self.max_running = 1
                            for item in block:
                                try:
                                    append(await fn(item))
                                except Throttled as exc:
                                    append(await again_when_throttled(fn, item, exc,
                                                                      self._throttled))
                        else:
                            for item in block:
                                try:
                                    append(fn(item))
                                except Throttled as exc:
                                    append(await again_when_throttled(
                                        _on_loop(fn), item, exc, self._throttled))
                    except Exception as exc:
                        error = exc
                    if done:
                        yield done, token
                    if error is not None:
                        raise error
            return

        call: Callable[[Any], Awaitable[U]]
        concurrency = tuner.maximum if tuner is not None else cast(int, self.concurrency)
        if self.is_async:
            call = fn
        else:
            limiter = anyio.CapacityLimiter(concurrency)

            async def call(item: Any) -> U:
                return cast(U, await anyio.to_thread.run_sync(fn, item, limiter=limiter))

        if tuner is not None:
            tuner.resume(time.perf_counter_ns())
        mapping: _ConcurrentMap[Any, U] = _ConcurrentMap(upstream, call, concurrency,
                                                         self.ordered, tuner, self._throttled)
        ctx.spawn(mapping.run)
        results = mapping.results
        spans = mapping.spans
        emitted = 0  # results handed on: the input number of the next one, in order
        try:
            while True:
                # A block of every result ready now: the first one waited for, then the rest.
                try:
                    ready: tuple[Any, BaseException | None] | None = await results.take()
                except StopAsyncIteration:
                    return
                if self.ordered:
                    while len(spans) > 1 and spans[1][0] <= emitted:
                        spans.popleft()
                    first, token = spans[0]
                    token = _Skip(token, emitted - first) if emitted > first else token
                else:
                    token = _UNORDERED
                out: list[U] = []
                while ready is not None:
                    value, failure = ready
                    if failure is not None:
                        if out:
                            yield out, token
                        raise failure
                    out.append(value)
                    ready = results.poll()
                emitted += len(out)
                self.max_running = max(self.max_running, mapping.max_running)
                yield out, token
        finally:
            self.max_running = max(self.max_running, mapping.max_running)
            mapping.scope.cancel()
            if tuner is not None:
                tuner.on_change = None
