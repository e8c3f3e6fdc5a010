"""The Batcher's dispatcher against hostile batch functions and absurd arguments.

Every place where the dispatcher runs user code (the batch function and its collate, ``len``
and indexing of what it returned, the per-item error check) is attacked here. One bad batch
must fail its own callers with a clear error, and the dispatcher must go on serving: the
callers that queued meanwhile and the later ones get their results.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from aloader import Batcher, BatcherClosedError, BatchResultError

# -- result shapes -------------------------------------------------------------------------------


class LenOnly:
    """Sized but not indexable (the shape that used to leave its callers waiting forever)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class BadIndex(LenOnly):
    """Sized; indexing raises for ``bad`` (or every index when ``bad`` is None)."""

    def __init__(self, n: int, bad: int | None = None) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, index: int) -> int:
        if self.bad is None or index == self.bad:
            raise KeyError(index)
        return index


class LenRaises:
    def __len__(self) -> int:
        raise RuntimeError("len exploded")

    def __getitem__(self, index: int) -> int:
        return index


class LenNotInt:
    def __len__(self) -> Any:
        return "3"


class FakeError:
    """Claims to be a ValueError through ``__class__`` but cannot be raised."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return ValueError


async def _inner(items: list[int]) -> list[int]:
    return items


# name -> (make the bad result from the items, expected message pattern)
SHAPES: dict[str, tuple[Callable[[list[int]], Any], str]] = {
    "len-not-indexable": (
        lambda items: LenOnly(len(items)),
        r"returned a LenOnly of length 3 that cannot be indexed",
    ),
    "getitem-raises": (
        lambda items: BadIndex(len(items)),
        r"returned a BadIndex of length 3 whose results\[0\] raised KeyError",
    ),
    "getitem-raises-for-one-index": (
        lambda items: BadIndex(len(items), bad=1),
        r"returned a BadIndex of length 3 whose results\[1\] raised KeyError",
    ),
    "too-long": (lambda items: [*items, 0], r"returned 4 results for a batch of 3 items"),
    "too-short": (lambda items: items[:1], r"returned 1 results for a batch of 3 items"),
    "generator": (lambda items: (x for x in items), r"returned a generator, which has no len"),
    "none": (lambda items: None, r"returned None"),
    "len-raises": (lambda items: LenRaises(), r"whose len\(\) raised RuntimeError: len exploded"),
    "len-not-int": (lambda items: LenNotInt(), r"whose len\(\) raised TypeError"),
    "str": (lambda items: "abc", r"returned a str"),
    "bytes": (lambda items: b"abc", r"returned a bytes"),
    "forgotten-await": (lambda items: _inner(items), r"returned a coroutine.*await"),
}


@pytest.mark.anyio
@pytest.mark.parametrize("max_concurrent", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
async def test_a_bad_result_fails_its_batch_and_the_dispatcher_keeps_serving(
    anyio_backend: str, shape: str, max_concurrent: int
) -> None:
    make, message = SHAPES[shape]
    gate = anyio.Event()
    started = anyio.Event()
    calls = 0

    async def model(items: list[int]) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            started.set()
            await gate.wait()
            return make(items)
        return [x * 10 for x in items]

    outcomes: dict[int, Any] = {}

    async def call(i: int) -> None:
        try:
            outcomes[i] = await b(i)
        except Exception as exc:
            outcomes[i] = exc

    b = Batcher(model, max_batch_size=3, max_wait=60.0, max_concurrent_batches=max_concurrent)
    async with b, anyio.create_task_group() as tg:
        for i in range(3):  # the third request fills the batch: no waiting on max_wait
            tg.start_soon(call, i)
        await started.wait()
        for i in range(3, 6):  # queued while the bad batch runs
            tg.start_soon(call, i)
        await _until(lambda: b.metrics()["submitted"] == 6)
        gate.set()
    for i in range(3):
        error = outcomes[i]
        assert isinstance(error, BatchResultError), (i, error)
        assert "'model'" in str(error)
        assert _search(message, str(error)), str(error)
    # No caller of the bad batch got a part of it: all of them failed, none hangs.
    assert [outcomes[i] for i in range(3, 6)] == [30, 40, 50]
    metrics = b.metrics()
    assert (metrics["failed"], metrics["completed"], metrics["running_batches"]) == (3, 3, 0)


@pytest.mark.anyio
async def test_later_calls_are_served_after_a_bad_result(anyio_backend: str) -> None:
    calls = 0

    def model(items: list[int]) -> Any:
        nonlocal calls
        calls += 1
        return LenOnly(len(items)) if calls == 1 else items

    async with Batcher(model) as b:
        with pytest.raises(BatchResultError, match="cannot be indexed"):
            await b(1)
        assert await b(2) == 2
        assert await b(3) == 3


@pytest.mark.anyio
async def test_an_object_faking_an_exception_class_is_a_result(anyio_backend: str) -> None:
    fake = FakeError()
    async with Batcher(lambda items: [fake for _ in items], to_thread=False) as b:
        assert await b(1) is fake


@pytest.mark.anyio
async def test_a_real_exception_in_a_slot_is_still_raised(anyio_backend: str) -> None:
    async with Batcher(lambda items: [KeyError(x) for x in items], to_thread=False) as b:
        with pytest.raises(KeyError):
            await b(1)


@pytest.mark.anyio
async def test_an_async_looking_callable_returning_a_plain_result_is_served(
    anyio_backend: str,
) -> None:
    class Model:
        def __call__(self, items: list[int]) -> list[int]:
            return [x + 1 for x in items]

    async def fake_call(items: list[int]) -> list[int]:
        raise AssertionError("never called: calls go to type(model).__call__")

    model = Model()
    model.__call__ = fake_call  # type: ignore[method-assign]  # looks async to inspect
    async with Batcher(model) as b:
        assert await b(1) == 2


# -- BaseException from the batch function -------------------------------------------------------


class Stop(BaseException):
    """A BaseException that is neither KeyboardInterrupt nor SystemExit."""


def _raiser(exc_type: type[BaseException], how: str) -> tuple[Any, dict[str, Any]]:
    """A batch function (and its options) raising ``exc_type`` on its first call, then serving."""
    calls = 0

    def plain(items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise exc_type("from the batch function")
        return items

    async def coroutine(items: list[int]) -> list[int]:
        await anyio.sleep(0)
        return plain(items)

    if how == "async":
        return coroutine, {}
    return plain, {"to_thread": how == "thread"}


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["async", "thread", "on-loop"])
@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit, Stop])
async def test_a_base_exception_reaches_the_callers_of_its_batch_as_itself(
    anyio_backend: str, exc_type: type[BaseException], how: str
) -> None:
    fn, options = _raiser(exc_type, how)
    outcomes: dict[int, Any] = {}

    async def call(i: int) -> None:
        try:
            outcomes[i] = await b(i)
        except BaseException as exc:
            outcomes[i] = exc

    b = Batcher(fn, max_batch_size=2, max_wait=60.0, **options)
    async with b, anyio.create_task_group() as tg:
        tg.start_soon(call, 0)
        tg.start_soon(call, 1)
        await _until(lambda: len(outcomes) == 2)
        tg.start_soon(call, 2)
        tg.start_soon(call, 3)
    assert type(outcomes[0]) is exc_type and type(outcomes[1]) is exc_type
    assert [outcomes[2], outcomes[3]] == [2, 3]  # the dispatcher survived


@pytest.mark.anyio
@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
async def test_a_lazily_started_dispatcher_survives_a_base_exception(
    anyio_backend: str, exc_type: type[BaseException]
) -> None:
    fn, options = _raiser(exc_type, "async")
    b = Batcher(fn, **options)  # no `async with`: the first call starts the dispatcher
    with pytest.raises(exc_type):
        await b(1)
    assert await b(2) == 2  # not BatcherClosedError: nothing closed the batcher
    await b.aclose()


@pytest.mark.anyio
async def test_a_base_exception_with_no_caller_left_is_not_swallowed(anyio_backend: str) -> None:
    gate = anyio.Event()
    started = anyio.Event()

    async def model(items: list[int]) -> list[int]:
        started.set()
        await gate.wait()
        raise Stop("nobody waits for this batch")

    queued_error: list[BaseException] = []

    async def queued() -> None:
        try:
            await b(2)
        except BatcherClosedError as exc:
            queued_error.append(exc)

    b = Batcher(model)
    with pytest.raises(BaseException) as info:
        async with b, anyio.create_task_group() as tg:
            await _start_and_leave(b, started)
            tg.start_soon(queued)
            await _until(lambda: b.metrics()["queued"] == 1)
            gate.set()
    assert _contains(info.value, Stop)
    assert queued_error and isinstance(queued_error[0].__cause__, Stop)
    assert "Stop" in str(queued_error[0])


async def _start_and_leave(b: Batcher[Any, Any], started: anyio.Event) -> None:
    """Submit one request, then cancel it once its batch is running."""
    async with anyio.create_task_group() as tg:

        async def caller() -> None:
            await b(1)

        tg.start_soon(caller)
        await started.wait()
        tg.cancel_scope.cancel()


# -- arguments -----------------------------------------------------------------------------------


HUGE = 10**20


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"metrics_window": HUGE}, ValueError, r"metrics_window must be .*at most sys.maxsize"),
        ({"metrics_window": -1}, ValueError, r"metrics_window must be an integer >= 1"),
        ({"metrics_window": 2.5}, TypeError, r"metrics_window must be an integer .*got 2.5"),
        ({"metrics_window": True}, TypeError, r"metrics_window .*got True"),
        ({"metrics_window": float("inf")}, TypeError, r"metrics_window .*got inf"),
        ({"max_batch_size": HUGE}, ValueError, r"max_batch_size must be .*at most sys.maxsize"),
        ({"max_batch_size": -3}, ValueError, r"max_batch_size must be an integer >= 1.*got -3"),
        ({"max_batch_size": float("nan")}, TypeError, r"max_batch_size .*got nan"),
        ({"max_queue": HUGE}, ValueError, r"max_queue must be .*at most sys.maxsize"),
        ({"max_queue": 1.0}, TypeError, r"max_queue .*got 1.0"),
        ({"max_concurrent_batches": HUGE}, ValueError, r"max_concurrent_batches .*at most"),
        ({"max_concurrent_batches": False}, TypeError, r"max_concurrent_batches .*got False"),
        ({"max_wait": float("inf")}, ValueError, r"max_wait must be finite"),
        ({"max_wait": 10**400}, ValueError, r"max_wait must be finite"),
        ({"max_wait": -(10**400)}, ValueError, r"max_wait must be a float >= 0"),
        ({"max_wait": "0.1"}, TypeError, r"max_wait must be a float >= 0, got '0.1'"),
        ({"batch_wait_timeout_s": -1}, ValueError, r"batch_wait_timeout_s must be a float >= 0"),
        ({"timeout": float("nan")}, ValueError, r"timeout=nan"),
        ({"timeout": -1}, ValueError, r"timeout should be positive"),
        ({"close_timeout": float("nan")}, ValueError, r"close_timeout=nan"),
        ({"close_timeout": True}, TypeError, r"close_timeout .*got True"),
        ({"preferred_batch_sizes": [HUGE]}, ValueError, r"preferred_batch_sizes"),
        ({"preferred_batch_sizes": 4}, TypeError, r"preferred_batch_sizes should be a sequence"),
        ({"preferred_batch_sizes": [2.0]}, TypeError, r"preferred_batch_sizes item"),
        ({"max_batch_cost": 10}, TypeError, r"cost and max_batch_cost go together"),
        ({"cost": len}, TypeError, r"cost and max_batch_cost go together"),
        ({"cost": len, "max_batch_cost": 0}, ValueError, r"max_batch_cost must be > 0"),
        ({"cost": len, "max_batch_cost": float("nan")}, ValueError, r"max_batch_cost"),
        ({"cost": 3, "max_batch_cost": 10}, TypeError, r"cost must be a callable"),
        ({"batch_size_fn": "len"}, TypeError, r"batch_size_fn must be a callable"),
        ({"batch_size_fn": len, "preferred_batch_sizes": [2]}, ValueError, r"batch_size_fn"),
        ({"promote_after": -1}, ValueError, r"promote_after should be non-negative"),
        ({"max_wait": 0.1, "batch_wait_timeout_s": 0.1}, TypeError, r"not both"),
    ],
)
def test_absurd_arguments_are_refused_at_construction(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Ray Serve's rule, for every argument: a wrong type is a TypeError, a value out of
    range a ValueError, and the message names the argument as it was spelled."""
    with pytest.raises(error) as info:
        Batcher(lambda items: items, **kwargs)
    assert _search(message, str(info.value)), str(info.value)


def test_preferred_batch_sizes_may_be_any_iterable() -> None:
    b = Batcher(lambda items: items, max_batch_size=8, preferred_batch_sizes=iter([4, 2]))
    assert b._preferred == (2, 4)


def test_infinite_timeouts_mean_no_timeout_and_a_large_window_allocates_nothing() -> None:
    b = Batcher(
        lambda items: items,
        timeout=float("inf"),
        close_timeout=float("inf"),
        max_wait=1e300,
        metrics_window=sys.maxsize,
        max_queue=sys.maxsize,
        max_batch_size=sys.maxsize,
    )
    assert b.metrics()["queue_wait"]["count"] == 0
    assert sys.getsizeof(b._metrics.queue_waits) < 10_000


@pytest.mark.anyio
async def test_absurd_per_call_and_aclose_timeouts_are_refused(anyio_backend: str) -> None:
    async with Batcher(lambda items: items) as b:
        with pytest.raises(ValueError, match="timeout=nan"):
            await b(1, timeout=float("nan"))
        assert await b(1, timeout=float("inf")) == 1
        assert await b(1, timeout=10**400) == 1  # beyond any float: as far away as inf
        with pytest.raises(ValueError, match="timeout=-1"):
            await b.aclose(timeout=-1)


# -- helpers -------------------------------------------------------------------------------------


def _search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


def _contains(exc: BaseException, exc_type: type[BaseException]) -> bool:
    if isinstance(exc, exc_type):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(_contains(e, exc_type) for e in exc.exceptions)
    return False


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if predicate():
            return
        await anyio.sleep(0)
    raise AssertionError("condition never became true")


class HostileError(Exception):
    """A real exception whose __traceback__ attribute raises when read."""

    @property
    def __traceback__(self) -> Any:  # type: ignore[override]
        raise RuntimeError("no traceback for you")


@pytest.mark.anyio
async def test_a_hostile_exception_in_a_slot_fails_only_its_caller(anyio_backend: str) -> None:
    def model(items: list[int]) -> list[Any]:
        return [HostileError(x) if x == 1 else x for x in items]

    outcomes: dict[int, Any] = {}

    async def call(i: int) -> None:
        try:
            outcomes[i] = await b(i)
        except Exception as exc:
            outcomes[i] = exc

    b = Batcher(model, max_batch_size=3, max_wait=60.0, to_thread=False)
    async with b:
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(call, i)
        assert outcomes[0] == 0 and outcomes[2] == 2
        assert isinstance(outcomes[1], HostileError)
        async with anyio.create_task_group() as tg:
            for i in range(4, 7):
                tg.start_soon(call, i)
        assert [outcomes[i] for i in range(4, 7)] == [4, 5, 6]  # the dispatcher survived


@pytest.mark.anyio
async def test_forced_close_fails_every_running_batch(anyio_backend: str) -> None:
    never = anyio.Event()
    running = 0

    async def stuck(items: list[int]) -> list[int]:
        nonlocal running
        running += 1
        await never.wait()
        return items

    errors: list[BaseException] = []

    async def call(i: int) -> None:
        try:
            await b(i)
        except BatcherClosedError as exc:
            errors.append(exc)

    b = Batcher(stuck, max_batch_size=1, max_concurrent_batches=2)
    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(call, i)
        await _until(lambda: running == 2)
        await b.aclose(timeout=0)
    assert len(errors) == 3
    assert sum("running" in str(e) for e in errors) == 2
