"""aloader._util: the shared helpers' contracts, and the callers that rely on them agreeing.

The bug this module fixed: ``FetchPlan`` asked ``inspect.iscoroutinefunction`` whether
``collate_fn`` was async, so an object with ``async def __call__`` collated on the loop without
workers but was called synchronously (returning a coroutine) in threads and worker processes.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import anyio
import pytest

import aloader
from aloader import DataLoader, _util

pytestmark = pytest.mark.anyio

GUARD = 60  # seconds: a hang guard, never a timing assertion


# Module level: worker processes unpickle these ---------------------------------------------------
class Listed(list[int]):
    """A list by another type: the loader fetches it in threads rather than on the loop."""


SQUARES = [i * i for i in range(10)]
BATCHES = [(0, 1, 4, 9), (16, 25, 36, 49), (64, 81)]


class AsyncCollate:
    """A collate_fn object whose ``__call__`` is ``async def``."""

    async def __call__(self, samples: list[int]) -> tuple[int, ...]:
        await anyio.lowlevel.checkpoint()
        return tuple(samples)


class AsyncDouble:
    async def __call__(self, value: Any) -> Any:
        await anyio.lowlevel.checkpoint()
        if isinstance(value, list):
            return [2 * v for v in value]
        return 2 * value


async def _double(value: int) -> int:
    return 2 * value


class _Methods:
    async def coro(self) -> None:
        pass

    def plain(self) -> None:
        pass


# is_async_callable ---------------------------------------------------------------------------
def test_is_async_callable_kinds() -> None:
    async def coro(x: int) -> int:
        return x

    def plain(x: int) -> int:
        return x

    methods = _Methods()
    assert _util.is_async_callable(coro)
    assert _util.is_async_callable(functools.partial(coro))
    assert _util.is_async_callable(functools.partial(functools.partial(coro), 1))
    assert _util.is_async_callable(AsyncDouble())
    assert _util.is_async_callable(functools.partial(AsyncDouble()))
    assert _util.is_async_callable(methods.coro)
    assert not _util.is_async_callable(plain)
    assert not _util.is_async_callable(functools.partial(plain, 1))
    assert not _util.is_async_callable(methods.plain)
    assert not _util.is_async_callable(AsyncDouble)  # the class: calling it makes an instance
    assert not _util.is_async_callable(None)
    assert not _util.is_async_callable(len)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_async_call_object_as_collate_fn(num_workers: int) -> None:
    # Failed before the fix with workers: their collate returned an un-awaited coroutine.
    loader = DataLoader(SQUARES, batch_size=4, num_workers=num_workers,
                        collate_fn=AsyncCollate(), timeout=GUARD if num_workers else 0)
    assert list(loader) == BATCHES


@pytest.mark.parametrize("max_concurrency", [None, 8])
def test_async_call_object_as_collate_fn_in_threads(max_concurrency: int | None) -> None:
    # Fetches in threads, whole batches or single items: the collate is awaited on the loop.
    loader = DataLoader(Listed(SQUARES), batch_size=4, collate_fn=AsyncCollate(),
                        max_concurrency=max_concurrency)
    assert list(loader) == BATCHES


async def test_async_call_object_in_stream_map(anyio_backend: str) -> None:
    for concurrency in (1, 4):
        stream = aloader.as_stream(range(10)).map(AsyncDouble(), concurrency=concurrency)
        assert [x async for x in stream] == [2 * i for i in range(10)]
        partial = aloader.as_stream(range(10)).map(functools.partial(_double),
                                                   concurrency=concurrency)
        assert [x async for x in partial] == [2 * i for i in range(10)]


async def test_async_call_object_in_batcher(anyio_backend: str) -> None:
    async with aloader.Batcher(AsyncDouble(), max_batch_size=4) as batcher:
        assert await batcher(3) == 6


# Signal --------------------------------------------------------------------------------------
async def test_signal_wakes_every_waiter_once(anyio_backend: str) -> None:
    signal = _util.Signal()
    woken: list[int] = []
    signal.notify()  # nobody waits: nothing is remembered

    async def waiter(n: int) -> None:
        await signal.wait()
        woken.append(n)

    async with anyio.create_task_group() as tg:
        for n in range(3):
            tg.start_soon(waiter, n)
        await anyio.wait_all_tasks_blocked()
        assert woken == []
        signal.notify()
    assert sorted(woken) == [0, 1, 2]
    with anyio.move_on_after(0.01) as scope:  # a notify before a wait does not end the wait
        await signal.wait()
    assert scope.cancelled_caught


# single_error --------------------------------------------------------------------------------
def test_single_error() -> None:
    a, b = ValueError("a"), KeyError("b")
    assert _util.single_error(a) is a
    assert _util.single_error(ExceptionGroup("g", [a])) is a
    assert _util.single_error(ExceptionGroup("g", [ExceptionGroup("h", [a])])) is a
    assert _util.single_error(ExceptionGroup("g", [a, b])) is None
    assert _util.single_error(ExceptionGroup("g", [ExceptionGroup("h", [a, b])])) is None


# resolve and close_iterator ------------------------------------------------------------------
async def test_resolve(anyio_backend: str) -> None:
    async def seven() -> int:
        return 7

    assert await _util.resolve(7) == 7
    assert await _util.resolve(seven()) == 7


async def test_close_iterator_sync_and_async(anyio_backend: str) -> None:
    closed: list[str] = []

    def sync_gen() -> Any:
        try:
            yield 1
        finally:
            closed.append("sync")

    async def async_gen() -> Any:
        try:
            yield 1
        finally:
            await anyio.lowlevel.checkpoint()  # runs even under cancellation: shielded
            closed.append("async")

    for blocking in (False, True):
        it = sync_gen()
        next(it)
        await _util.close_iterator(it, blocking=blocking)
    agen = async_gen()
    await agen.__anext__()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await _util.close_iterator(agen)
    await _util.close_iterator(iter([1, 2]))  # nothing to close
    assert closed == ["sync", "sync", "async"]


# Argument checks -----------------------------------------------------------------------------
def test_check_seconds() -> None:
    assert _util.check_seconds("t", 0) == 0.0
    assert _util.check_seconds("t", 10**400) == float("inf")
    with pytest.raises(ValueError, match=r"^t should be a number of seconds, but got t=None$"):
        _util.check_seconds("t", None)
    with pytest.raises(ValueError, match=r"^t should be a number of seconds, but got t=nan$"):
        _util.check_seconds("t", float("nan"))
    with pytest.raises(ValueError, match=r"^t should be positive, but got t=0$"):
        _util.check_seconds("t", 0, allow_zero=False)
    with pytest.raises(ValueError, match=r"^t should be non-negative, but got t=-1$"):
        _util.check_seconds("t", -1)
    with pytest.raises(ValueError, match=r"^t should be finite, but got t=inf$"):
        _util.check_seconds("t", float("inf"), allow_inf=False)


def test_check_int() -> None:
    assert _util.check_int("n", 3, minimum=1) == 3
    assert _util.check_int("n", 0, minimum=0) == 0
    for bad in (0, -1, True, 1.0, "1", None):
        with pytest.raises(ValueError, match=r"^n should be a positive integer, but got n="):
            _util.check_int("n", bad, minimum=1)
    with pytest.raises(ValueError, match=r"^n should be a non-negative integer, but got n=-1$"):
        _util.check_int("n", -1, minimum=0)
    with pytest.raises(ValueError, match="at most sys.maxsize"):
        _util.check_int("n", sys.maxsize + 1, minimum=1, maximum=sys.maxsize)


async def test_finished_generators_close_with_no_scope_or_thread(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def agen() -> Any:
        yield 1

    def gen() -> Any:
        yield 1

    a, g = agen(), gen()
    assert [x async for x in a] == [1] and list(g) == [1]

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no cancel scope and no thread for a finished generator")

    monkeypatch.setattr(anyio, "CancelScope", refuse)
    monkeypatch.setattr(anyio.to_thread, "run_sync", refuse)
    await _util.close_iterator(a)
    await _util.close_iterator(g)


async def test_close_iterator_runs_a_suspended_generators_cleanup(anyio_backend: str) -> None:
    closed = []

    async def agen() -> Any:
        try:
            yield 1
        finally:
            closed.append("a")

    def gen() -> Any:
        try:
            yield 1
        finally:
            closed.append("g")

    a, g = agen(), gen()
    assert await a.__anext__() == 1 and next(g) == 1
    await _util.close_iterator(a)
    await _util.close_iterator(g)
    assert closed == ["a", "g"]


def test_is_awaitable_agrees_with_inspect() -> None:
    import inspect

    import numpy as np

    class AwaitableList(list[int]):  # a subclass of a type ruled out by its exact type
        def __await__(self) -> Any:
            return iter(())

    async def coro() -> None:
        return None

    c = coro()
    values: list[Any] = [[1], (1,), {1: 2}, "s", b"b", 1, 1.5, True, None, np.zeros(2),
                         AwaitableList(), c, object()]
    for value in values:
        assert _util.is_awaitable(value) == inspect.isawaitable(value), value
    c.close()


def test_pull_sync_takes_exactly_a_batch() -> None:
    from aloader.pipeline._pull import _NOTHING, _pull_sync

    source = iter(range(5))
    assert _pull_sync(source, 2) == ([0, 1], False)
    assert _pull_sync(source, 2) == ([2, 3], False)
    assert next(source) == 4  # nothing drawn beyond the batches
    assert _pull_sync(source, 2) == (_NOTHING, True)
    assert _pull_sync(iter(range(3)), 2) == ([0, 1], False)
    short = iter(range(1))
    assert _pull_sync(short, 2) == ([0], True)


def test_taken_iterators_are_iterated_again_without_their_objects_iter() -> None:
    import collections.abc
    import itertools

    from aloader._util import taken

    class Resetting:
        def __init__(self) -> None:
            self.i, self.calls = 0, 0

        def __iter__(self) -> Resetting:
            self.calls += 1
            self.i = 0
            return self

        def __next__(self) -> int:
            self.i += 1
            if self.i == 3:
                raise ValueError("a bad sample")  # it may be pulled on after it
            if self.i > 5:
                raise StopIteration
            return self.i

    class Plain(collections.abc.Iterator[int]):
        def __next__(self) -> int:
            raise StopIteration

    for kept in (iter([1]), (x for x in [1]), map(int, "1"), Plain()):
        assert taken(kept) is kept  # their __iter__ returns themselves, with no side effect
    data = Resetting()
    items = taken(iter(data))
    got = list(itertools.islice(items, 2))
    with pytest.raises(ValueError, match="a bad sample"):
        next(items)
    got += list(items)
    assert got == [1, 2, 4, 5] and data.calls == 1


def test_ataken_iterators_keep_their_attributes() -> None:
    import asyncio

    from aloader._util import ataken

    class Resetting:
        def __init__(self) -> None:
            self.i, self.calls, self.closed = 0, 0, False

        def __aiter__(self) -> Resetting:
            self.calls += 1
            self.i = 0
            return self

        async def __anext__(self) -> int:
            self.i += 1
            if self.i > 3:
                raise StopAsyncIteration
            return self.i

        async def aclose(self) -> None:
            self.closed = True

    async def run() -> list[int]:
        data = Resetting()
        items = ataken(data.__aiter__())
        got = [item async for item in items]
        got += [item async for item in items]  # ended: never started over
        await items.aclose()  # type: ignore[attr-defined]
        assert data.calls == 1 and data.closed
        return got

    assert asyncio.run(run()) == [1, 2, 3]

    async def agen() -> Any:
        yield 1

    generator = agen()
    assert ataken(generator) is generator
