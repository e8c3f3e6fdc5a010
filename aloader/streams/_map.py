"""``Stream.map``: ``fn`` applied to every item, one call at a time or up to ``concurrency``
at once (:class:`_ConcurrentMap`), results in order (through
:class:`~aloader.pipeline._results.Results`, the loader's own buffer) or as they finish.

:class:`MapStage` is the stage's whole behaviour; its stream class
(:class:`aloader.streams._stream._Mapped`) is made where ``Stream.map`` is defined, so that
this module needs :class:`~aloader.Stream` only for its annotations (no import cycle).

Invariant: item ``k`` out is item ``k`` in (ordered), and the stage holds at most
``2 * concurrency`` items; a failing call raises once the results before it are delivered.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import anyio
import anyio.abc
import anyio.to_thread

from .._util import Closing, check_int, close_iterator, is_async_callable
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


class _ConcurrentMap(Generic[T, U]):
    """``map`` with concurrency: workers pull items, results go back in order (or not).

    Item ``k`` (numbered in input order) is a job of a :class:`~aloader.pipeline._results.Results`
    of capacity ``2 * concurrency``: a worker reserves its output slot before it pulls the
    item, so at most ``2 * concurrency`` items are held between their pull and their hand-over
    to the consumer, and in order the head of the line can always be handed over.

    Workers start as work arrives, not all at once: one runs from the start, and a worker
    that has pulled an item starts another when no worker is left free to pull the next, so
    at most ``min(concurrency, calls in flight + 1)`` exist whatever ``concurrency`` says.
    """

    def __init__(
        self,
        upstream: AsyncGenerator[tuple[list[T], Any], None],
        call: Callable[[T], Awaitable[U]],
        concurrency: int,
        ordered: bool,
    ) -> None:
        self.upstream = upstream
        self.call = call
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

    async def worker(self) -> None:
        while (got := await self.pull()) is not None:
            seq, item = got
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            if self.running == self.workers and self.workers < self.concurrency:
                self.spawn()  # nobody is left to pull the next item
            try:
                value = await self.call(item)
            except Exception as exc:
                self.results.publish(seq, None, exc)
            else:
                self.results.publish(seq, value)
            finally:
                self.running -= 1

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
        concurrency: int,
        ordered: bool,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"map needs a callable, but got {fn!r}")
        self.upstream = upstream
        self.fn = fn
        self.concurrency = check_int("concurrency", concurrency)
        self.ordered = bool(ordered)
        self.is_async = is_async_callable(fn)
        #: The most calls that ran at once, and the most items the stage held.
        self.max_running = 0

    def _upstreams(self) -> Sequence[Stream[Any]]:
        return (self.upstream,)

    def _blocks_at(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[U], Any], None]:
        # Item k out is item k in: the upstream resumes where the consumer was, and items the
        # consumer had are never mapped again.
        upstream = self.upstream._blocks_at(ctx, None if at is None else at["upstream"])
        return _discard(self._mapped(ctx, upstream), 0 if at is None else at["skip"])

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        if token is _UNORDERED:
            raise ValueError(
                "map(..., ordered=False) hands on results as they finish, in no reproducible "
                "order: a stream with such a stage cannot save its position (use ordered=True)"
            )
        return {"stage": "map", "upstream": _state_of(self.upstream, token, skip), "skip": 0}

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        check_stage(at, "map", "map")
        if not self.ordered:
            raise _bad_state("map", "stage", "names a map stage, but this one has "
                                             "ordered=False, which cannot resume")
        _check_upstream(self.upstream, at, slot)

    async def _mapped(
        self, ctx: _Context, upstream: AsyncGenerator[tuple[list[Any], Any], None]
    ) -> AsyncGenerator[tuple[list[U], Any], None]:
        fn = self.fn
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
                                append(await fn(item))
                        else:
                            for item in block:
                                append(fn(item))
                    except Exception as exc:
                        error = exc
                    if done:
                        yield done, token
                    if error is not None:
                        raise error
            return

        call: Callable[[Any], Awaitable[U]]
        if self.is_async:
            call = fn
        else:
            limiter = anyio.CapacityLimiter(self.concurrency)

            async def call(item: Any) -> U:
                return cast(U, await anyio.to_thread.run_sync(fn, item, limiter=limiter))

        mapping: _ConcurrentMap[Any, U] = _ConcurrentMap(upstream, call, self.concurrency,
                                                         self.ordered)
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
