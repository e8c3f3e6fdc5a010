"""Ray Serve's ``@serve.batch`` contract, held by ``aloader.batch`` on asyncio and trio.

What code written against Ray Serve's decorator relies on: functions and methods that take
several arguments (each collected into its own list), async generator batch functions that
stream each caller its own results, ``batch_wait_timeout_s``, the runtime setters and getters
(the batch forming keeps its settings), ``batch_size_fn``, Ray's argument errors, and
cancellation. Ray's own unit tests run against aloader outside this repository; these pin the
same behaviours in aloader's suite. Time-dependent cases run on trio's ``MockClock``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import pytest
import trio
import trio.testing

import aloader
from aloader import BatchCostError, BatchMethod, BatchResultError, BatchStream, batch

pytestmark = pytest.mark.anyio


def mock_clock() -> pytest.MarkDecorator:
    """Run on trio with a fresh ``MockClock(autojump_threshold=0)``: time jumps to the next
    deadline as soon as every task is blocked."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    return pytest.mark.parametrize(
        "anyio_backend", [pytest.param(("trio", {"clock": clock}), id="trio-mockclock")]
    )


async def gather(*calls: Any, errors: bool = False) -> list[Any]:
    """Await the awaitables concurrently (submitted in order); results in order (with
    ``errors``, the type of what a call raised in its place)."""
    results: list[Any] = [None] * len(calls)

    async def one(i: int) -> None:
        try:
            results[i] = await calls[i]
        except Exception as exc:
            if not errors:
                raise
            results[i] = type(exc)

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
            await anyio.wait_all_tasks_blocked()  # each call queued before the next starts
    return results


# -- several arguments --------------------------------------------------------------------------


class Pairs:
    def __init__(self) -> None:
        self.batches: list[tuple[list[Any], list[Any]]] = []

    @batch(max_batch_size=2, batch_wait_timeout_s=1000)
    async def pair(self, key1: list[Any], key2: list[Any]) -> list[tuple[Any, Any]]:
        self.batches.append((list(key1), list(key2)))
        return list(zip(key1, key2, strict=True))


def pair_function() -> BatchMethod:
    @batch(max_batch_size=2, batch_wait_timeout_s=1000)
    async def pair(key1: list[Any], key2: list[Any]) -> list[tuple[Any, Any]]:
        return list(zip(key1, key2, strict=True))

    return pair


@pytest.mark.parametrize("use_class", [True, False])
@pytest.mark.parametrize(
    "calls",
    [
        [(("a", "b"), {}), (("c", "d"), {})],
        [((), {"key1": "a", "key2": "b"}), ((), {"key1": "c", "key2": "d"})],
        [(("a",), {"key2": "b"}), (("c",), {"key2": "d"})],
        [((), {"key2": "b", "key1": "a"}), ((), {"key2": "d", "key1": "c"})],
        [(("a", "b"), {}), ((), {"key2": "d", "key1": "c"})],  # mixed forms in one batch
    ],
    ids=["args", "kwargs", "mixed", "out-of-order", "both-forms"],
)
async def test_each_argument_is_collected_into_its_own_list(
    anyio_backend: str, use_class: bool, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
) -> None:
    fn: Any = Pairs().pair if use_class else pair_function()
    results = await gather(*(fn(*args, **kwargs) for args, kwargs in calls))
    assert results == [("a", "b"), ("c", "d")]
    await fn.aclose()


async def test_a_method_batch_gets_lists_and_its_instance(anyio_backend: str) -> None:
    model = Pairs()
    assert isinstance(model.pair, BatchMethod) and model.pair is model.pair
    assert await gather(Pairs.pair(model, 1, 2), model.pair(3, key2=4)) == [(1, 2), (3, 4)]
    assert model.batches == [([1, 3], [2, 4])]
    await model.pair.aclose()


async def test_defaults_fill_the_places_of_calls_that_left_a_parameter_out(
    anyio_backend: str,
) -> None:
    seen: list[Any] = []

    @batch(max_batch_size=3, batch_wait_timeout_s=1000)
    async def scaled(x: list[int], scale: Any = 10, *, shift: Any = 0) -> list[int]:
        seen.append((list(x), scale, shift))
        if isinstance(scale, int):  # left out by every call: Ray's scalar default
            scale = [scale] * len(x)
        if isinstance(shift, int):
            shift = [shift] * len(x)
        return [a * b + c for a, b, c in zip(x, scale, shift, strict=True)]

    assert await gather(scaled(1), scaled(2, 3), scaled(3, shift=1)) == [10, 6, 31]
    assert seen == [([1, 2, 3], [10, 3, 10], [0, 0, 1])]
    assert await gather(scaled(1), scaled(2), scaled(3)) == [10, 20, 30]
    assert seen[1] == ([1, 2, 3], 10, 0)
    with pytest.raises(TypeError, match="unexpected keyword|got an unexpected"):
        await scaled(1, nope=2)
    await scaled.aclose()


async def test_star_args_batch_position_by_position(anyio_backend: str) -> None:
    @batch(max_batch_size=2, batch_wait_timeout_s=1000)
    async def total(*parts: list[int], **named: list[int]) -> list[int]:
        return [sum(column) for column in zip(*parts, *named.values(), strict=True)]

    assert await gather(total(1, 2, k=3), total(4, 5, k=6)) == [6, 15]
    # Different shapes in one batch cannot be batched: the batch fails, nobody hangs.
    assert await gather(total(1, 2), total(4, 5, 6), errors=True) == [TypeError, TypeError]
    await total.aclose()


async def test_per_call_options_unless_the_function_takes_them(anyio_backend: str) -> None:
    @batch(max_batch_size=4)
    async def echo(items: list[int]) -> list[int]:
        return items

    @batch(max_batch_size=4)
    async def timed(items: list[int], timeout: list[float]) -> list[float]:
        return timeout

    assert await echo(1, priority=2, timeout=10.0) == 1
    assert await timed(1, timeout=2.5) == 2.5  # the function's own parameter wins
    await echo.aclose()
    await timed.aclose()


# -- streaming ----------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 3])
async def test_a_generator_streams_each_caller_its_own_results(
    anyio_backend: str, length: int
) -> None:
    @batch(max_batch_size=2, batch_wait_timeout_s=1000)
    async def steps(prompts: list[str]) -> Any:
        for step in range(length):
            yield [f"{prompt}{step}" for prompt in prompts]

    first, second = steps("a"), steps("b")  # queued now: both in one batch
    assert isinstance(first, BatchStream)
    # Read one after the other: the second's results wait for it.
    assert [x async for x in first] == [f"a{i}" for i in range(length)]
    assert [x async for x in second] == [f"b{i}" for i in range(length)]
    assert steps.metrics()["batch_size_histogram"] == {2: 1}
    await steps.aclose()


@pytest.mark.parametrize("sentinel", [StopAsyncIteration, StopIteration, StopIteration()])
async def test_a_stop_element_ends_that_callers_stream_alone(
    anyio_backend: str, sentinel: Any
) -> None:
    @batch(max_batch_size=3, batch_wait_timeout_s=1000)
    async def countdown(ids: list[int]) -> Any:
        for finished in range(1, 4):
            yield [sentinel if i < finished else ids[i] for i in range(3)]

    streams = [countdown(i) for i in range(3)]
    assert [[x async for x in stream] for stream in streams] == [[], [1], [2, 2]]
    await countdown.aclose()


@pytest.mark.parametrize("failure", ["raise", "wrong-length", "in-slot"])
async def test_a_stream_error_comes_after_the_results_before_it(
    anyio_backend: str, failure: str
) -> None:
    @batch(max_batch_size=2, batch_wait_timeout_s=1000)
    async def steps(keys: list[str]) -> Any:
        for step in range(4):
            if step == 2:
                if failure == "raise":
                    raise RuntimeError("model failed")
                if failure == "wrong-length":
                    yield [step] * 3
                if failure == "in-slot":
                    yield [RuntimeError("model failed"), f"{keys[1]}{step}"]
                    continue
            yield [f"{key}{step}" for key in keys]

    streams = [steps("a"), steps("b")]
    expected = {"raise": RuntimeError, "wrong-length": BatchResultError, "in-slot": RuntimeError}
    got: list[list[Any]] = []
    for stream in streams:
        items: list[Any] = []
        try:
            async for x in stream:
                items.append(x)
        except Exception as exc:
            items.append(type(exc))
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        got.append(items)
    if failure == "in-slot":  # the error in one slot ends that stream; the other goes on
        assert got == [["a0", "a1", RuntimeError], ["b0", "b1", "b2", "b3"]]
    else:
        assert got == [["a0", "a1", expected[failure]], ["b0", "b1", expected[failure]]]
    await steps.aclose()


async def test_a_plain_batcher_streams_one_result(anyio_backend: str) -> None:
    async def double(items: list[int]) -> list[int]:
        return [2 * x for x in items]

    async with aloader.Batcher(double) as b:
        assert [x async for x in b.stream(4)] == [8]
        assert await b(5) == 10


async def test_a_streaming_batcher_is_read_with_stream(anyio_backend: str) -> None:
    async def steps(items: list[int]) -> Any:
        yield items

    async with aloader.Batcher(steps) as b:
        with pytest.raises(TypeError, match="stream"):
            await b(1)
        assert [x async for x in b.stream(1)] == [1]


async def test_when_every_reader_leaves_the_generator_is_cancelled_and_closed(
    anyio_backend: str,
) -> None:
    forever = anyio.Event()
    events: list[str] = []

    @batch(max_batch_size=2, batch_wait_timeout_s=1000)
    async def endless(items: list[int]) -> Any:
        try:
            yield items
            await forever.wait()  # never set
            yield items
        finally:
            events.append("closed")

    a, b = endless(1), endless(2)
    assert await a.__anext__() == 1
    await a.aclose()
    assert await b.__anext__() == 2
    with anyio.CancelScope() as scope:  # the last reader is cancelled while it waits
        scope.deadline = anyio.current_time() + 0.01
        await b.__anext__()
    assert scope.cancelled_caught
    with pytest.raises(StopAsyncIteration):
        await b.__anext__()
    # The slot is free: the next batch runs although the first never finished by itself.
    c, d = endless(3), endless(4)
    assert (await c.__anext__(), await d.__anext__()) == (3, 4)
    await c.aclose()
    await d.aclose()
    await endless.aclose()
    assert events == ["closed", "closed"]


# -- settings -----------------------------------------------------------------------------------


@mock_clock()
async def test_setters_change_the_next_batch_and_the_forming_one_keeps_its_own(
    anyio_backend: Any,
) -> None:
    sizes: list[int] = []

    @batch(max_batch_size=2, batch_wait_timeout_s=1000)
    async def f(items: list[int]) -> list[int]:
        sizes.append(len(items))
        return items

    assert (f._get_max_batch_size(), f._get_batch_wait_timeout_s()) == (2, 1000)
    f.set_max_batch_size(3)
    f.set_batch_wait_timeout_s(15000)
    assert (f.max_batch_size, f.batch_wait_timeout_s, f.max_wait) == (3, 15000, 15000)
    async with anyio.create_task_group() as tg:
        tg.start_soon(f, 1)
        tg.start_soon(f, 2)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        f.set_max_batch_size(1)  # the forming batch still waits for a third
        f.set_batch_wait_timeout_s(0)
        await trio.sleep(100)
        assert sizes == []
        tg.start_soon(f, 3)
    assert sizes == [3] and trio.current_time() == start + 100
    assert await f(4) == 4  # the next batch: size 1, no wait
    assert sizes == [3, 1] and trio.current_time() == start + 100
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        f.set_max_batch_size(0)
    with pytest.raises(TypeError, match="batch_wait_timeout_s must be a float >= 0"):
        f.set_batch_wait_timeout_s("1")  # type: ignore[arg-type]
    await f.aclose()


def test_decorator_arguments_are_checked_with_rays_types() -> None:
    @batch
    async def no_arguments() -> None: ...

    @batch(max_batch_size=1.0)  # an integral float, as Ray takes it
    async def one(items: list[int]) -> list[int]:
        return items

    assert one.max_batch_size == 1
    with pytest.raises(TypeError, match="async def"):

        @batch
        def plain(items: list[int]) -> list[int]:
            return items

    for bad, error in [
        ({"max_batch_size": 0}, ValueError),
        ({"max_batch_size": 1.1}, TypeError),
        ({"batch_wait_timeout_s": -0.1}, ValueError),
        ({"batch_wait_timeout_s": "a"}, TypeError),
        ({"max_concurrent_batches": 1.5}, TypeError),
        ({"batch_size_fn": 3}, TypeError),
        ({"max_batch_sise": 3}, TypeError),
    ]:
        with pytest.raises(error):
            batch(**bad)
    with pytest.raises(TypeError, match="functions or methods"):
        batch(3)  # type: ignore[call-overload]

    @batch(to_thread=True)  # a plain function runs in a worker thread when asked
    def in_thread(items: list[int]) -> list[int]:
        return items

    assert anyio.run(in_thread, 7) == 7


# -- batch_size_fn ------------------------------------------------------------------------------


def size_of(items: list[dict[str, Any]]) -> int:
    return sum(item["size"] for item in items)


@mock_clock()
async def test_batch_size_fn_closes_a_batch_before_the_item_that_would_exceed(
    anyio_backend: Any,
) -> None:
    seen: list[list[str]] = []

    @batch(max_batch_size=10, batch_wait_timeout_s=0.05, batch_size_fn=size_of)
    async def handle(requests: list[dict[str, Any]]) -> list[str]:
        seen.append([r["value"] for r in requests])
        return [r["value"] for r in requests]

    sizes = {"a": 6, "b": 6, "c": 3, "d": 1, "e": 10}
    results = await gather(*(handle({"size": n, "value": v}) for v, n in sizes.items()))
    assert results == list(sizes)
    # "a" alone (b would exceed); b c d = 10 (full); e alone; never reordered.
    assert seen == [["a"], ["b", "c", "d"], ["e"]]
    await handle.aclose()


async def test_an_item_too_large_alone_is_refused_as_in_ray(anyio_backend: str) -> None:
    @batch(max_batch_size=10, batch_wait_timeout_s=0.05, batch_size_fn=size_of)
    async def handle(requests: list[dict[str, Any]]) -> list[int]:
        return [r["size"] for r in requests]

    with pytest.raises(BatchCostError, match="greater than max_batch_size") as info:
        await handle({"size": 12})
    assert isinstance(info.value, RuntimeError)  # Ray's type
    assert await handle({"size": 6}) == 6
    await handle.aclose()


async def test_a_batch_size_fn_that_raises_fails_only_the_caller_it_concerns(
    anyio_backend: str,
) -> None:
    """Ray's queue hangs when batch_size_fn raises; here the item's caller gets the error."""

    @batch(max_batch_size=10, batch_wait_timeout_s=0.05, batch_size_fn=size_of)
    async def handle(requests: list[dict[str, Any]]) -> list[int]:
        return [r["size"] for r in requests]

    calls = [handle({"size": 2}), handle({"nope": 1}), handle({"size": 3})]
    assert await gather(*calls, errors=True) == [2, KeyError, 3]
    await handle.aclose()


async def test_cancelled_waiting_callers_leave_the_batch(anyio_backend: str) -> None:
    seen: list[list[int]] = []

    @batch(max_batch_size=3, batch_wait_timeout_s=1000)
    async def f(items: list[int]) -> list[int]:
        seen.append(list(items))
        return items

    async with anyio.create_task_group() as tg:
        tg.start_soon(f, 1)
        with anyio.move_on_after(0.01):  # a caller that gives up while queued
            await f(2)
        tg.start_soon(f, 3)
        tg.start_soon(f, 4)
    assert [sorted(items) for items in seen] == [[1, 3, 4]]  # trio starts tasks in any order
    assert f.metrics()["cancelled"] == 1
    await f.aclose()


async def test_a_stream_closed_by_another_task_ends_its_readers_wait(anyio_backend: str) -> None:
    release = anyio.Event()

    @batch(max_batch_size=1)
    async def steps(items: list[int]) -> Any:
        yield items
        await release.wait()
        yield items

    stream = steps(1)
    assert await stream.__anext__() == 1
    got: list[Any] = []

    async def read() -> None:
        try:
            got.append(await stream.__anext__())
        except StopAsyncIteration:
            got.append("stopped")

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(RuntimeError, match="already being read"):
            await stream.__anext__()  # one reader at a time, as an async generator
        await stream.aclose()  # from this task, while the other waits: it stops, no hang
    assert got == ["stopped"]
    release.set()
    async with contextlib.aclosing(steps(2)) as other:
        async for x in other:
            assert x == 2
            break  # aclosing leaves at the break
    assert [x async for x in steps(3)] == [3, 3]
    await steps.aclose()
