"""How long a batcher lives: one that nobody holds any more is garbage collected, and so is
the instance of a batched method with the instance's batcher; the dispatcher a first call
started ends with it (no task left behind), on asyncio and trio, timeouts and streams
included."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import anyio
import pytest

import aloader
from aloader import Batcher

pytestmark = [pytest.mark.anyio, pytest.mark.hostile]


def live_tasks() -> int:
    """The running loop's tasks (on trio: every task of the run, system tasks included)."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        pass
    import trio

    def count(task: Any) -> int:
        return 1 + sum(count(child) for nursery in task.child_nurseries
                       for child in nursery.child_tasks)

    return count(trio.lowlevel.current_root_task())


async def settle() -> None:
    """Collect cycles, then let what the collection woke run."""
    for _ in range(3):
        gc.collect()
        await anyio.wait_all_tasks_blocked()


class Model:
    def __init__(self) -> None:
        self.weights = [1.0] * 1000

    @aloader.batch(max_batch_size=4)
    async def predict(self, xs: list[int]) -> list[int]:
        return [2 * x for x in xs]

    @aloader.batch(max_batch_size=4)
    async def generate(self, prompts: list[int]) -> Any:
        for step in range(2):
            yield [p + step for p in prompts]


@pytest.mark.parametrize("kind", ["call", "timeout", "stream", "queue_timeout"])
async def test_an_instance_is_collected_with_its_batcher(anyio_backend: str, kind: str) -> None:
    before = live_tasks()
    model = Model()
    if kind == "stream":
        assert [x async for x in model.generate(1)] == [1, 2]
    elif kind == "timeout":
        assert await model.predict(1, timeout=30) == 2
    elif kind == "queue_timeout":
        assert await model.predict(1, queue_timeout=30) == 2
    else:
        assert await model.predict(1) == 2
    assert live_tasks() > before  # the first call started the instance's dispatcher
    instance = weakref.ref(model)
    del model
    with anyio.fail_after(10):
        await settle()
    assert instance() is None, "the instance outlives its last reference"
    assert live_tasks() == before, "its dispatcher is left running"


async def test_a_dropped_batcher_is_collected_and_its_dispatcher_ends(anyio_backend: str) -> None:
    before = live_tasks()

    async def double(xs: list[int]) -> list[int]:
        return [2 * x for x in xs]

    b = Batcher(double, max_wait=0.001)
    assert await b(1, timeout=30) == 2
    batcher = weakref.ref(b)
    del b
    with anyio.fail_after(10):
        await settle()
    assert batcher() is None
    assert live_tasks() == before


async def test_a_batcher_with_waiting_callers_is_never_collected(anyio_backend: str) -> None:
    """Only the caller holds the batcher (a temporary instance): it lives until answered."""
    gate = anyio.Event()

    class Slow:
        @aloader.batch(max_batch_size=4)
        async def predict(self, xs: list[int]) -> list[int]:
            await gate.wait()
            return [2 * x for x in xs]

    got: list[int] = []

    async def caller() -> None:
        got.append(await Slow().predict(3))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await settle()
            gate.set()
    assert got == [6]


class Scaled:
    def __init__(self, k: int) -> None:
        self.k = k

    @aloader.batch(max_batch_size=4)
    async def predict(self, xs: list[int]) -> list[int]:
        return [x * self.k for x in xs]


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
async def test_a_copy_of_an_instance_gets_a_batcher_of_its_own(
    anyio_backend: str, how: str
) -> None:
    """A copy made after the original's batcher started batches for the copy (its own
    ``self``), never into the original's batcher: a shallow copy shares the original's
    attributes, and would otherwise run the copy's calls with the original's state."""
    import copy
    import pickle

    original = Scaled(2)
    assert await original.predict(1) == 2
    if how == "copy":
        twin = copy.copy(original)
    elif how == "deepcopy":
        twin = copy.deepcopy(original)
    else:
        twin = pickle.loads(pickle.dumps(original))
    twin.k = 10
    assert await twin.predict(1) == 10
    assert twin.predict is not original.predict
    assert await original.predict(1) == 2
    assert original.predict.metrics()["completed"] == 2
    assert twin.predict.metrics()["completed"] == 1
    await original.predict.aclose()
    await twin.predict.aclose()


async def test_a_batched_method_can_still_be_replaced_on_an_instance(anyio_backend: str) -> None:
    model = Scaled(2)
    assert await model.predict(1) == 2

    async def fake(x: int) -> int:
        return -x

    model.predict = fake  # type: ignore[method-assign,assignment]
    assert await model.predict(5) == -5
    del model.predict
    assert await model.predict(5) == 10  # a batcher again
    await model.predict.aclose()


@pytest.mark.parametrize("how", ["break", "cancelled between two results"])
async def test_a_stream_dropped_unfinished_leaves_its_batch(anyio_backend: str, how: str) -> None:
    """A reader that stops reading without closing its stream (a ``break`` out of
    ``async for``, a task cancelled between two results) and drops it leaves its batch when
    the stream is collected, as an async generator is closed then: a batch that nobody reads
    any more stops generating (its slot goes to the next batch)."""
    steps_made: list[int] = []
    closed: list[bool] = []

    async def generate(prompts: list[int]) -> Any:
        try:
            for step in range(1_000_000):
                steps_made.append(step)
                await anyio.sleep(0.001)
                yield [(p, step) for p in prompts]
        finally:
            closed.append(True)

    async def reader(b: Batcher[int, Any]) -> None:
        async for token in b.stream(7):
            assert token[0] == 7
            if how == "break" and token[1] == 2:
                break
            if how != "break" and token[1] == 2:
                await anyio.sleep_forever()  # cancelled here, between two results

    with anyio.fail_after(10):
        async with Batcher(generate, close_timeout=0) as b:
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader, b)
                while len(steps_made) < 3:
                    await anyio.sleep(0.001)
                if how != "break":
                    await anyio.wait_all_tasks_blocked()
                    tg.cancel_scope.cancel()
            gc.collect()
            with anyio.move_on_after(5):
                while not closed:
                    await anyio.sleep(0.005)
            assert closed, "the batch kept generating for a stream nobody holds"
            assert b.metrics()["running_batches"] == 0
    assert b.metrics()["cancelled"] == 1


async def test_an_override_that_calls_the_batched_method_stays_in_force(
    anyio_backend: str,
) -> None:
    """A subclass wraps the batched method and calls it through ``super()``: every call goes
    through the override (the instance's batcher must not shadow it after the first call)."""
    class Wrapped(Scaled):
        async def predict(self, x: int) -> Any:  # type: ignore[override]
            return ("wrapped", await super().predict(x))

    model = Wrapped(3)
    assert await model.predict(1) == ("wrapped", 3)
    assert await model.predict(2) == ("wrapped", 6)
    assert await model.predict(3) == ("wrapped", 9)
    await Scaled.predict.__get__(model).aclose()
