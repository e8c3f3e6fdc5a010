"""The epoch pipeline under faults: BaseExceptions, stuck threads, and huge concurrency limits.

No test asserts a duration. A close that must not hang runs in a helper thread joined with a
generous guard; what the test blocked is released at the end so that every thread ends.
"""

from __future__ import annotations

import gc
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from test_loader import _task_count  # the same count of live tasks

import aloader
from aloader import DataLoader

pytestmark = pytest.mark.anyio

GUARD = 60.0  # seconds: only a hang gets anywhere near this


class Boom(BaseException):
    """A BaseException that is neither KeyboardInterrupt nor SystemExit."""


def _fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aloader-fetch"]


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aloader-loop"]




def _returns(fn: Callable[[], object]) -> None:
    """Run ``fn`` in a thread; it must return (or raise) before the guard runs out."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GUARD)
    assert not thread.is_alive(), "it hung"
    if errors:
        raise errors[0]


# BaseExceptions from the dataset -------------------------------------------------------------
N = 40
BAD = 9


def _raiser(error: BaseException) -> Callable[[int], None]:
    def check(index: int) -> None:
        if index == BAD:
            raise error

    return check


def _dataset(where: str, check: Callable[[int], None], calls: list[int]) -> dict[str, Any]:
    """A dataset raising at item BAD in ``where``, and the loader arguments that reach it."""
    if where == "async getitem":
        class AsyncItems(aloader.Dataset[int]):
            def __len__(self) -> int:
                return N

            async def __getitem__(self, index: int) -> int:
                calls.append(index)
                await anyio.lowlevel.checkpoint()
                check(index)
                return index

        return {"dataset": AsyncItems(), "max_concurrency": 4}

    class SyncItems(aloader.Dataset[int]):
        def __len__(self) -> int:
            return N

        def __getitem__(self, index: int) -> int:
            calls.append(index)
            check(index)
            return index

    if where == "sync getitem":  # one thread call per batch
        return {"dataset": SyncItems()}
    if where == "fetch threads":
        return {"dataset": SyncItems(), "max_concurrency": 4}
    if where == "getitems":
        class Batches(SyncItems):
            def __getitems__(self, indices: list[int]) -> list[int]:
                for index in indices:
                    calls.append(index)
                    check(index)
                return indices

        return {"dataset": Batches()}
    if where == "async getitems":
        class AsyncBatches(SyncItems):
            _async_fetch = True

            async def __getitems__(self, indices: list[int]) -> list[int]:
                await anyio.lowlevel.checkpoint()
                for index in indices:
                    calls.append(index)
                    check(index)
                return indices

        return {"dataset": AsyncBatches()}
    if where == "iter":
        class Stream(aloader.IterableDataset[int]):
            def __iter__(self) -> Iterator[int]:
                for index in range(N):
                    calls.append(index)
                    check(index)
                    yield index

        return {"dataset": Stream()}
    if where == "aiter":
        class AsyncStream(aloader.IterableDataset[int]):
            async def __aiter__(self) -> AsyncIterator[int]:
                for index in range(N):
                    calls.append(index)
                    await anyio.lowlevel.checkpoint()
                    check(index)
                    yield index

        return {"dataset": AsyncStream()}
    assert where == "collate"

    def collate(samples: list[int]) -> Any:
        for index in samples:
            check(index)
        return np.array(samples)

    return {"dataset": SyncItems(), "collate_fn": collate}


WHERE = ["async getitem", "sync getitem", "fetch threads", "getitems", "async getitems",
         "iter", "aiter", "collate"]
ERRORS = [KeyboardInterrupt, SystemExit, Boom]


def _check_batches(batches: list[Any]) -> None:
    # Whatever came before the error is right and in order.
    seen = [int(i) for batch in batches for i in np.asarray(batch).tolist()]
    assert seen == list(range(len(seen)))
    assert len(seen) <= BAD


@pytest.mark.parametrize("error_type", ERRORS)
@pytest.mark.parametrize("where", WHERE)
async def test_a_base_exception_reaches_async_for_as_itself(
    anyio_backend: str, where: str, error_type: type[BaseException]
) -> None:
    error = error_type("from the dataset")
    calls: list[int] = []
    kwargs = _dataset(where, _raiser(error), calls)
    before = _task_count(anyio_backend)
    batches: list[Any] = []
    with pytest.raises(error_type) as info:
        async for batch in DataLoader(batch_size=2, **kwargs):
            batches.append(batch)
    assert info.value is error
    _check_batches(batches)
    assert len(calls) < N  # the rest of the epoch stopped
    gc.collect()
    await anyio.wait_all_tasks_blocked()
    assert _task_count(anyio_backend) == before
    assert _fetch_threads() == []


@pytest.mark.parametrize("error_type", ERRORS)
@pytest.mark.parametrize("where", WHERE)
def test_a_base_exception_reaches_for_as_itself(
    where: str, error_type: type[BaseException]
) -> None:
    error = error_type("from the dataset")
    calls: list[int] = []
    loader = DataLoader(batch_size=2, **_dataset(where, _raiser(error), calls))
    batches: list[Any] = []

    def consume() -> None:
        with pytest.raises(error_type) as info:
            for batch in loader:
                batches.append(batch)
        assert info.value is error

    _returns(consume)
    _check_batches(batches)
    assert len(calls) < N
    # The loader's loop survived: the next epoch runs on it, up to the same error (a sync
    # dataset's epochs run on the consumer's thread, with no loop).
    batches.clear()
    _returns(consume)
    assert len(_loop_threads()) >= (where not in ("sync getitem", "getitems", "collate", "iter"))
    loader.close()
    assert _fetch_threads() == []


async def test_a_base_exception_stops_the_fetches_in_flight(anyio_backend: str) -> None:
    release = anyio.Event()
    error = KeyboardInterrupt()

    class Slow(aloader.Dataset[int]):
        active = 0

        def __len__(self) -> int:
            return 1000

        async def __getitem__(self, index: int) -> int:
            if index == 5:
                await anyio.wait_all_tasks_blocked()  # the other fetches are in flight
                raise error
            self.active += 1
            try:
                await release.wait()
            finally:
                self.active -= 1
            return index

    dataset = Slow()
    with pytest.raises(KeyboardInterrupt) as info:
        async for _ in DataLoader(dataset, batch_size=2, max_concurrency=20):
            raise AssertionError("no batch is complete")
    assert info.value is error
    await anyio.wait_all_tasks_blocked()
    assert dataset.active == 0


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_ctrl_c_while_for_waits_still_interrupts() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    waiting = threading.Event()
    armed = threading.Event()

    class Never(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 4

        async def __getitem__(self, index: int) -> int:
            waiting.set()
            await anyio.sleep_forever()
            raise AssertionError

    loader = DataLoader(Never(), batch_size=2)
    iterator = iter(loader)

    def interrupt() -> None:
        waiting.wait(GUARD)
        armed.wait(GUARD)  # the main thread is inside pytest.raises
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    sender = threading.Thread(target=interrupt, daemon=True)
    sender.start()
    with pytest.raises(KeyboardInterrupt):
        armed.set()
        next(iterator)  # blocks: only the signal ends it
    sender.join(GUARD)
    _returns(iterator.close)
    _returns(loader.close)
    assert _loop_threads() == []


# Closing after a timeout, with a fetch stuck in a thread -------------------------------------
class Stuck(aloader.Dataset[int]):
    """Item 0 blocks its thread until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        if index == 0:
            self.release.wait()
        return index


class StuckStream(aloader.IterableDataset[int]):
    def __init__(self) -> None:
        self.release = threading.Event()

    def __iter__(self) -> Iterator[int]:
        self.release.wait()
        yield from range(8)


STUCK = {
    "one call per batch": lambda: (Stuck(), {}),
    "fetch threads": lambda: (Stuck(), {"max_concurrency": 4}),
    "iterable": lambda: (StuckStream(), {}),
}


@pytest.mark.parametrize("closer", ["iterator", "loader"])
@pytest.mark.parametrize("mode", list(STUCK))
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_aclose_after_a_timeout_abandons_a_stuck_thread(
    backend: str, mode: str, closer: str
) -> None:
    dataset, kwargs = STUCK[mode]()

    async def main() -> None:
        loader = DataLoader(dataset, batch_size=2, timeout=0.05, **kwargs)
        iterator = aiter(loader)
        with pytest.raises(aloader.LoaderTimeoutError):
            await anext(iterator)
        if closer == "iterator":
            await iterator.aclose()
        await loader.aclose()

    try:
        _returns(lambda: anyio.run(main, backend=backend))
    finally:
        dataset.release.set()
    for thread in _fetch_threads():
        thread.join(GUARD)  # the stuck thread ends once released
    assert _fetch_threads() == []


@pytest.mark.parametrize("closer", ["iterator", "loader"])
@pytest.mark.parametrize("mode", list(STUCK))
def test_close_after_a_timeout_abandons_a_stuck_thread(mode: str, closer: str) -> None:
    dataset, kwargs = STUCK[mode]()
    loader = DataLoader(dataset, batch_size=2, timeout=0.05, **kwargs)

    def run() -> None:
        iterator = iter(loader)
        with pytest.raises(aloader.LoaderTimeoutError):
            next(iterator)
        if closer == "iterator":
            iterator.close()  # type: ignore[attr-defined]
        loader.close()

    try:
        _returns(run)
    finally:
        dataset.release.set()
    assert _loop_threads() == []
    for thread in _fetch_threads():
        thread.join(GUARD)
    assert _fetch_threads() == []


async def test_without_a_timeout_closing_waits_for_the_thread(anyio_backend: str) -> None:
    # A fetch that holds the dataset is awaited: the next epoch's must not overlap it.
    started = threading.Event()
    release = threading.Event()
    finished: list[int] = []

    class Slow(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> int:
            started.set()
            release.wait()
            finished.append(index)
            return index

    iterator = aiter(DataLoader(Slow(), batch_size=2))
    async with anyio.create_task_group() as tg:
        tg.start_soon(anext, iterator)
        await anyio.to_thread.run_sync(started.wait)
        tg.cancel_scope.cancel()
    threading.Timer(0.01, release.set).start()
    await iterator.aclose()
    assert finished == [0, 1]


# Concurrency limits far above the work ------------------------------------------------------
HUGE = 10**6


class GatedItems(aloader.Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.gate = anyio.Event()
        self.active = 0

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        self.active += 1
        await self.gate.wait()
        return index


class GatedBatches(GatedItems):
    async def __getitems__(self, indices: list[int]) -> list[int]:
        self.active += len(indices)
        await self.gate.wait()
        return indices


class HeldOpen:
    """A sampler of 0..n-1 that then holds the epoch open until ``gate`` is set.

    Kept open, the epoch keeps every fetch task it started: none leaves for lack of work.
    """

    def __init__(self, n: int, gate: anyio.Event) -> None:
        self.n = n
        self.gate = gate

    def __len__(self) -> int:
        return self.n

    async def __aiter__(self) -> AsyncIterator[int]:
        for index in range(self.n):
            yield index
        await self.gate.wait()


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("cls", [GatedItems, GatedBatches])
async def test_huge_max_concurrency_starts_no_task_per_unit(
    anyio_backend: str, cls: type[GatedItems], batch_size: int
) -> None:
    dataset = cls(12)  # whole batches: the held sampler never ends a short one
    loader = DataLoader(dataset, batch_size=batch_size, max_concurrency=HUGE,
                        sampler=HeldOpen(12, dataset.gate))
    before = _task_count(anyio_backend)
    iterator = aiter(loader)
    batches = []
    async with anyio.create_task_group() as tg:
        async def first() -> None:
            batches.append(await anext(iterator))

        tg.start_soon(first)
        await anyio.wait_all_tasks_blocked()
        assert dataset.active == 12  # every item is in flight at once...
        assert _task_count(anyio_backend) - before <= 12 + 4  # ...with a task each at most
        dataset.gate.set()
    batches += [batch async for batch in iterator]
    assert [i for b in batches for i in np.asarray(b).tolist()] == list(range(12))


@pytest.mark.parametrize("batch_size", [1, 4])
async def test_huge_max_concurrency_starts_no_thread_per_unit(
    anyio_backend: str, batch_size: int
) -> None:
    lock = threading.Condition()
    release = threading.Event()
    active = [0]

    class Blocking(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: int) -> int:
            with lock:
                active[0] += 1
                lock.notify_all()
            release.wait()
            return index

    def all_in_flight() -> None:
        with lock:
            assert lock.wait_for(lambda: active[0] == 10, GUARD)

    loader = DataLoader(Blocking(), batch_size=batch_size, max_concurrency=HUGE)
    iterator = aiter(loader)
    batches = []
    try:
        async with anyio.create_task_group() as tg:
            async def first() -> None:
                batches.append(await anext(iterator))

            tg.start_soon(first)
            await anyio.to_thread.run_sync(all_in_flight)
            assert len(_fetch_threads()) <= 10
            release.set()
    finally:
        release.set()
    batches += [batch async for batch in iterator]
    assert [i for b in batches for i in np.asarray(b).tolist()] == list(range(10))
    assert _fetch_threads() == []


def test_huge_max_concurrency_through_for() -> None:
    loader = DataLoader(GatedItems(10), batch_size=4, max_concurrency=HUGE)
    loader.dataset.gate.set()
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    loader.close()



# The hot path ------------------------------------------------------------------------------
class _Items(aloader.Dataset[int]):
    def __len__(self) -> int:
        return 400

    async def __getitem__(self, index: int) -> int:
        await anyio.sleep(0.0001 * (index % 3))
        return index


async def test_item_fetches_make_no_anyio_event_per_item(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Workers park on the loop's own waiters, looked up once per epoch: an anyio Event (a
    # look-up of the running library each) per parked worker or per change of the results
    # cost more than the fetch itself at tens of thousands of items a second.
    made = [0]
    new = anyio.Event.__new__

    def counting(cls: type[anyio.Event]) -> anyio.Event:
        made[0] += 1
        return new(cls)

    monkeypatch.setattr(anyio.Event, "__new__", staticmethod(counting))
    loader = DataLoader(_Items(), batch_size=4, max_concurrency=32)
    batches = [batch async for batch in loader]
    assert [i for b in batches for i in np.asarray(b).tolist()] == list(range(400))
    # anyio's task group makes one per task (at most max_concurrency workers), the epoch one
    # for its end: none per item (400) nor per batch (100).
    assert made[0] <= 32 + 4
