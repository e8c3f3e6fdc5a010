"""The async DataLoader: order, bounds, errors, cleanup, both backends and the sync facade.

No test here asserts a duration. Concurrency bounds are counted with instrumented datasets
whose fetches wait on gates the test opens, and quiescence is detected with
``anyio.wait_all_tasks_blocked``.
"""

from __future__ import annotations

import gc
import random
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from sourcetools import collect

import aloader
from aloader import DataLoader

pytestmark = pytest.mark.anyio


# Datasets ----------------------------------------------------------------------------------------
class AsyncRange(aloader.Dataset[int]):
    """``async def __getitem__`` returning the index after a random (seeded) delay."""

    def __init__(self, n: int, max_delay: float = 0.0, seed: int = 0) -> None:
        self.n = n
        self.max_delay = max_delay
        self.rng = random.Random(seed)
        self.calls: list[int] = []

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        self.calls.append(index)
        if self.max_delay:
            await anyio.sleep(self.rng.random() * self.max_delay)
        return index


class SyncRange(aloader.Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.threads: set[str] = set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.threads.add(threading.current_thread().name)
        return index


class Gated(aloader.Dataset[int]):
    """Every fetch waits for ``gate``; counts fetches running now and the most at once."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.gate = anyio.Event()
        self.active = 0
        self.peak = 0
        self.started = 0
        self.cancelled = 0

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        self.active += 1
        self.started += 1
        self.peak = max(self.peak, self.active)
        try:
            await self.gate.wait()
            return index
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        finally:
            self.active -= 1


class Failing(aloader.Dataset[int]):
    def __init__(self, n: int, bad: set[int], exc: type[Exception] = KeyError) -> None:
        self.n = n
        self.bad = bad
        self.exc = exc

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        await anyio.lowlevel.checkpoint()
        if index in self.bad:
            raise self.exc(f"bad index {index}")
        return index


def as_lists(batches: list[Any]) -> list[list[int]]:
    return [np.asarray(b).tolist() for b in batches]


# Argument checks (torch's types and messages) ----------------------------------------------------
ARG_ERRORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"num_workers": -1}, ValueError, "num_workers option should be non-negative; use "
     "num_workers=0 to disable multiprocessing."),
    ({"timeout": -1}, ValueError, "timeout option should be non-negative"),
    ({"prefetch_factor": -1}, ValueError, "prefetch_factor option should be non-negative"),
    ({"persistent_workers": True}, ValueError, "persistent_workers option needs num_workers > 0"),
    ({"sampler": [0, 1], "shuffle": True}, ValueError,
     "sampler option is mutually exclusive with shuffle"),
    ({"batch_sampler": [[0]], "batch_size": 2}, ValueError,
     "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and "
     "drop_last"),
    ({"batch_sampler": [[0]], "drop_last": True}, ValueError,
     "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and "
     "drop_last"),
    ({"batch_sampler": [[0]], "shuffle": True}, ValueError,
     "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and "
     "drop_last"),
    ({"batch_size": None, "drop_last": True}, ValueError,
     "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"),
    ({"multiprocessing_context": "spawn"}, ValueError,
     "multiprocessing_context can only be used with multi-process loading (num_workers > 0), "
     "but got num_workers=0"),
    ({"num_workers": "2"}, TypeError, "'<' not supported between instances of 'str' and 'int'"),
    ({"prefetch_factor": "2"}, TypeError,
     "'<' not supported between instances of 'str' and 'int'"),
    ({"timeout": "x"}, TypeError, "'<' not supported between instances of 'str' and 'int'"),
    ({"timeout": None}, TypeError,
     "'<' not supported between instances of 'NoneType' and 'int'"),
    ({"batch_size": 1.5}, ValueError,
     "batch_size should be a positive integer value, but got batch_size=1.5"),
    ({"max_concurrency": 0}, ValueError, "max_concurrency should be a positive integer"),
]


@pytest.mark.parametrize(("kwargs", "exc", "message"), ARG_ERRORS)
def test_argument_errors(kwargs: dict[str, Any], exc: type[Exception], message: str) -> None:
    with pytest.raises(exc) as info:
        DataLoader(list(range(10)), **kwargs)
    assert message in str(info.value)


def test_more_workers_than_the_process_limit_fail_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """num_workers=10**6 used to start a million reader tasks and then processes one by one
    (torch warns and does the same): past ``ulimit -u`` it is a clear error at once."""
    resource = pytest.importorskip("resource")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (3, 3))
    with pytest.raises(ValueError, match=r"num_workers=4 is more worker processes than this "
                                         r"user may run \(RLIMIT_NPROC, `ulimit -u`: 3\)"):
        DataLoader(list(range(10)), num_workers=4)
    DataLoader(list(range(10)), num_workers=3)  # within the limit: accepted (not started)


@pytest.mark.parametrize(("kwargs", "exc", "message"), ARG_ERRORS[:-1])
def test_argument_errors_match_torch(
    kwargs: dict[str, Any], exc: type[Exception], message: str
) -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    if "prefetch_factor" in kwargs:  # aloader accepts it without workers, torch does not
        kwargs = {**kwargs, "num_workers": 1}
    with pytest.raises(exc) as theirs:
        torch_data.DataLoader(list(range(10)), **kwargs)
    with pytest.raises(exc) as ours:
        DataLoader(list(range(10)), **kwargs)
    assert str(ours.value) == str(theirs.value)


# torch raises these at the first iteration (its range() calls); aloader at construction.
LATE_ARG_ERRORS: list[dict[str, Any]] = [
    {"num_workers": 1.5},
    {"num_workers": 2.0},
    {"num_workers": np.float64(1)},
]


@pytest.mark.parametrize("kwargs", LATE_ARG_ERRORS)
def test_non_integer_counts_fail_at_construction_as_in_torch(kwargs: dict[str, Any]) -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    with pytest.raises(TypeError) as theirs:
        next(iter(torch_data.DataLoader(list(range(10)), **kwargs)))
    with pytest.raises(TypeError) as ours:
        DataLoader(list(range(10)), **kwargs)
    assert str(ours.value) == str(theirs.value)
    assert "object cannot be interpreted as an integer" in str(ours.value)


def test_non_integer_prefetch_factor_fails_at_construction() -> None:
    # torch fails in range(prefetch_factor * num_workers), once its workers have started.
    with pytest.raises(TypeError) as theirs:
        range(1.5)  # type: ignore[call-overload]
    with pytest.raises(TypeError) as ours:
        DataLoader(list(range(10)), prefetch_factor=1.5)
    assert str(ours.value) == str(theirs.value)


def test_integer_like_counts_are_accepted_as_in_torch() -> None:
    # torch takes bools and numpy integers where it takes ints (range() does).
    assert DataLoader(list(range(4)), num_workers=False).num_workers == 0
    loader = DataLoader(list(range(4)), num_workers=np.int64(0), prefetch_factor=np.int64(3))
    assert [b.tolist() for b in loader] == [[0], [1], [2], [3]]
    assert DataLoader(list(range(4)), num_workers=True).num_workers == 1


class Stream(aloader.IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shuffle": True}, "DataLoader with IterableDataset: expected unspecified shuffle "
         "option, but got shuffle=True"),
        ({"sampler": [0]}, "DataLoader with IterableDataset: expected unspecified sampler "
         "option, but got sampler=[0]"),
        ({"batch_sampler": [[0]]}, "DataLoader with IterableDataset: expected unspecified "
         "batch_sampler option, but got batch_sampler=[[0]]"),
    ],
)
def test_iterable_dataset_argument_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=r"^" + message.replace("[", r"\[").replace("]", r"\]")):
        DataLoader(Stream(3), **kwargs)


@pytest.mark.parametrize("attr", ["batch_size", "batch_sampler", "sampler", "drop_last",
                                  "dataset", "persistent_workers"])
def test_attributes_frozen_after_init(attr: str) -> None:
    loader = DataLoader(list(range(4)))
    with pytest.raises(ValueError, match=f"{attr} attribute should not be set after DataLoader "
                                         "is initialized"):
        setattr(loader, attr, None)
    loader.timeout = 3  # other attributes stay writable, as in torch


def test_defaults_match_torch() -> None:
    loader = DataLoader(list(range(10)))
    assert loader.batch_size == 1
    assert loader.num_workers == 0
    assert loader.drop_last is False
    assert loader.timeout == 0
    assert loader.in_order is True
    assert loader.collate_fn is aloader.default_collate
    assert isinstance(loader.sampler, aloader.SequentialSampler)
    assert isinstance(loader.batch_sampler, aloader.BatchSampler)
    shuffled = DataLoader(list(range(10)), shuffle=True)
    assert isinstance(shuffled.sampler, aloader.RandomSampler)
    unbatched = DataLoader(list(range(10)), batch_size=None)
    assert unbatched.batch_sampler is None
    assert unbatched.collate_fn is aloader.default_convert


# Lengths (ports of torch's test_len) -------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 7, 100])
@pytest.mark.parametrize("batch_size", [1, 3, 10])
@pytest.mark.parametrize("drop_last", [False, True])
def test_len_map_style(n: int, batch_size: int, drop_last: bool) -> None:
    loader = DataLoader(list(range(n)), batch_size=batch_size, drop_last=drop_last)
    expected = n // batch_size if drop_last else -(-n // batch_size)
    assert len(loader) == expected
    assert len(list(loader)) == expected


def test_len_follows_a_growing_dataset() -> None:
    data = list(range(10))
    loader = DataLoader(data, batch_size=4)
    assert len(loader) == 3
    data.extend(range(10, 20))
    assert len(loader) == 5


def test_len_without_batching_and_custom_batch_sampler() -> None:
    assert len(DataLoader(list(range(9)), batch_size=None)) == 9
    assert len(DataLoader(list(range(9)), batch_sampler=[[0, 1], [2], [3, 4, 5]])) == 3


@pytest.mark.parametrize(("batch_size", "drop_last", "expected"),
                         [(None, False, 10), (3, False, 4), (3, True, 3)])
def test_len_iterable(batch_size: int | None, drop_last: bool, expected: int) -> None:
    assert len(DataLoader(Stream(10), batch_size=batch_size, drop_last=drop_last)) == expected


def test_an_epoch_has_the_loaders_len() -> None:
    # torch's iterators answer len() (progress bars size themselves by it).
    data = list(range(10))
    loader = DataLoader(data, batch_size=4)
    iterator = iter(loader)
    assert len(iterator) == 3
    next(iterator)
    data.extend(range(10, 20))
    assert len(iterator) == len(loader) == 5  # at each call, as torch's sampler length is
    iterator.close()
    assert len(iter(DataLoader(Stream(10), batch_size=3))) == 4

    class Endless(aloader.IterableDataset[int]):  # no __len__: no length
        def __iter__(self) -> Iterator[int]:
            return iter(range(10))

    with pytest.raises(TypeError):
        len(iter(DataLoader(Endless(), batch_size=3)))


async def test_an_async_epoch_has_the_loaders_len(anyio_backend: str) -> None:
    loader = DataLoader(list(range(10)), batch_size=4)
    epoch = loader.__aiter__()
    assert len(epoch) == 3
    assert [b.tolist() async for b in epoch][-1] == [8, 9]


# Order and determinism ---------------------------------------------------------------------------
async def test_in_order_whatever_the_completion_order(anyio_backend: str) -> None:
    loader = DataLoader(AsyncRange(300, max_delay=0.003), batch_size=7, max_concurrency=50)
    assert as_lists(await collect(loader)) == [
        list(range(s, min(s + 7, 300))) for s in range(0, 300, 7)
    ]


async def test_same_seed_same_batches_whatever_concurrency_and_delays(anyio_backend: str) -> None:
    runs = []
    for concurrency, delay_seed in ((1, 0), (8, 1), (64, 2), (None, 3)):
        loader = DataLoader(
            AsyncRange(200, max_delay=0.002, seed=delay_seed),
            batch_size=16,
            shuffle=True,
            generator=1234,
            max_concurrency=concurrency,
        )
        runs.append([as_lists(await collect(loader)) for _ in range(2)])
    assert all(run == runs[0] for run in runs)
    first_epoch, second_epoch = runs[0]
    assert first_epoch != second_epoch  # each epoch reshuffles
    flat = sorted(i for batch in first_epoch for i in batch)
    assert flat == list(range(200))


async def test_shuffled_order_is_the_sampler_order(anyio_backend: str) -> None:
    from aloader.data._random import draw_seed

    rng = np.random.default_rng(7)
    expected = []
    for _ in range(2):
        draw_seed(rng)  # each epoch draws its base_seed first, as torch does
        expected.append(aloader.RandomSampler(range(50), generator=rng)._epoch_indices().tolist())
    loader = DataLoader(AsyncRange(50), batch_size=50, shuffle=True, generator=7)
    assert [as_lists(await collect(loader))[0] for _ in range(2)] == expected
    assert expected[0] != expected[1]


async def test_out_of_order_delivers_everything_once(anyio_backend: str) -> None:
    loader = DataLoader(AsyncRange(200, max_delay=0.003), batch_size=10, max_concurrency=40,
                        in_order=False)
    batches = as_lists(await collect(loader))
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(b == list(range(b[0], b[0] + 10)) for b in batches)


async def test_out_of_order_does_not_wait_for_a_slow_batch(anyio_backend: str) -> None:
    release = anyio.Event()

    class SlowFirst(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 40

        async def __getitem__(self, index: int) -> int:
            if index == 0:
                await release.wait()
            return index

    loader = DataLoader(SlowFirst(), batch_size=10, max_concurrency=40, in_order=False,
                        prefetch_factor=4)
    iterator = aiter(loader)
    got = [np.asarray(await anext(iterator))[0] for _ in range(3)]
    assert 0 not in got
    release.set()
    assert np.asarray(await anext(iterator))[0] == 0
    await iterator.aclose()


# Concurrency and buffering bounds ----------------------------------------------------------------
@pytest.mark.parametrize(("batch_size", "max_concurrency"), [(4, 10), (32, 8), (1, 5)])
async def test_in_flight_never_exceeds_max_concurrency(
    anyio_backend: str, batch_size: int, max_concurrency: int
) -> None:
    dataset = Gated(200)
    loader = DataLoader(dataset, batch_size=batch_size, max_concurrency=max_concurrency)
    iterator = aiter(loader)
    async with anyio.create_task_group() as tg:
        first: list[Any] = []

        async def consume_one() -> None:
            first.append(await anext(iterator))

        tg.start_soon(consume_one)
        await anyio.wait_all_tasks_blocked()
        assert dataset.active == max_concurrency  # saturated, and no more
        dataset.gate.set()
    rest = [b async for b in iterator]
    assert dataset.peak == max_concurrency
    assert sum(len(b) for b in first + rest) == 200


async def test_default_max_concurrency_is_64(anyio_backend: str) -> None:
    dataset = Gated(500)
    iterator = aiter(DataLoader(dataset, batch_size=10))
    async with anyio.create_task_group() as tg:
        tg.start_soon(anext, iterator)
        await anyio.wait_all_tasks_blocked()
        assert dataset.active == 64
        dataset.gate.set()
    await iterator.aclose()


@pytest.mark.parametrize("prefetch_factor", [0, 1, 2, 5])
@pytest.mark.parametrize("in_order", [True, False])
async def test_slow_consumer_bounds_finished_batches(
    anyio_backend: str, prefetch_factor: int, in_order: bool
) -> None:
    collated = 0

    def counting_collate(samples: list[int]) -> list[int]:
        nonlocal collated
        collated += 1
        return samples

    loader = DataLoader(AsyncRange(1000), batch_size=5, max_concurrency=50,
                        collate_fn=counting_collate, prefetch_factor=prefetch_factor,
                        in_order=in_order)
    iterator = aiter(loader)
    for consumed in range(1, 4):
        await anext(iterator)
        await anyio.wait_all_tasks_blocked()  # the pipeline runs as far as it may
        assert collated - consumed == max(1, prefetch_factor)
    await iterator.aclose()


async def test_slow_consumer_bounds_fetched_items(anyio_backend: str) -> None:
    dataset = AsyncRange(10_000)
    loader = DataLoader(dataset, batch_size=10, max_concurrency=30, prefetch_factor=2)
    iterator = aiter(loader)
    await anext(iterator)
    await anyio.wait_all_tasks_blocked()
    # Items fetched: the batch taken, and the jobs that may start before the consumer takes
    # them: two windows (each max_concurrency items plus one batch; three on trio, whose
    # consumer runs once per turn of ready tasks) and the 2 batches that may wait for the
    # consumer (aloader.pipeline._schedule._WorkQueue's room).
    windows = 3 if anyio_backend == "trio" else 2
    assert len(dataset.calls) <= 10 + windows * (30 + 10) + 2 * 10
    await iterator.aclose()


# Synchronous datasets ----------------------------------------------------------------------------
async def test_sync_dataset_runs_in_a_worker_thread(anyio_backend: str) -> None:
    dataset = SyncRange(20)
    assert as_lists(await collect(DataLoader(dataset, batch_size=5))) == [
        list(range(s, s + 5)) for s in range(0, 20, 5)
    ]
    assert threading.current_thread().name not in dataset.threads


async def test_sync_dataset_does_not_block_the_loop(anyio_backend: str) -> None:
    started = threading.Event()
    proceed = threading.Event()

    class Blocking(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> int:
            started.set()
            if not proceed.wait(timeout=30):
                raise RuntimeError("the event loop was blocked")
            return index

    async def release() -> None:
        await anyio.to_thread.run_sync(started.wait)
        proceed.set()  # runs only if the loop is free while the fetch blocks

    async with anyio.create_task_group() as tg:
        tg.start_soon(release)
        batches = await collect(DataLoader(Blocking(), batch_size=2))
    assert as_lists(batches) == [[0, 1], [2, 3]]


async def test_sync_dataset_with_max_concurrency_overlaps_items(anyio_backend: str) -> None:
    barrier = threading.Barrier(8, timeout=30)

    class Rendezvous(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, index: int) -> int:
            barrier.wait()  # breaks (BrokenBarrierError) unless 8 fetches run at once
            return index

    batches = await collect(DataLoader(Rendezvous(), batch_size=4, max_concurrency=8))
    assert [i for b in as_lists(batches) for i in b] == list(range(32))


def _fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aloader-fetch"]


async def test_fetch_threads_end_with_the_epoch(anyio_backend: str) -> None:
    batches = await collect(DataLoader(SyncRange(50), batch_size=5, max_concurrency=8))
    assert len(batches) == 10
    assert _fetch_threads() == []
    async with DataLoader(SyncRange(1000), batch_size=5, max_concurrency=8) as loader:
        async for _ in loader:
            # Threads start as work arrives, never more than max_concurrency.
            assert 0 < len(_fetch_threads()) <= 8
            break
    assert _fetch_threads() == []


async def test_sync_dataset_error_with_fetch_threads(anyio_backend: str) -> None:
    class Bad(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 12

        def __getitem__(self, index: int) -> int:
            if index == 7:
                raise OSError("disk gone")
            return index

    iterator = aiter(DataLoader(Bad(), batch_size=4, max_concurrency=3))
    assert as_lists([await anext(iterator)]) == [[0, 1, 2, 3]]
    with pytest.raises(OSError, match="disk gone") as info:
        await anext(iterator)
    assert any("index 7" in note for note in info.value.__notes__)
    assert as_lists([await anext(iterator)]) == [[8, 9, 10, 11]]
    await iterator.aclose()
    assert _fetch_threads() == []


async def test_sync_dataset_default_fetches_one_batch_at_a_time(anyio_backend: str) -> None:
    lock = threading.Lock()
    active = 0
    peak = 0

    class Counting(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 40

        def __getitem__(self, index: int) -> int:
            nonlocal active, peak
            with lock:
                active += 1
                peak = max(peak, active)
            with lock:
                active -= 1
            return index

    await collect(DataLoader(Counting(), batch_size=4))
    assert peak == 1  # not thread-safe datasets stay safe by default


async def test_getitems_is_used_for_batches(anyio_backend: str) -> None:
    class Bulk(aloader.Dataset[int]):
        def __init__(self) -> None:
            self.requests: list[list[int]] = []

        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: int) -> int:
            raise AssertionError("__getitems__ should be used")

        def __getitems__(self, indices: list[int]) -> list[int]:
            assert isinstance(indices, list)
            self.requests.append(indices)
            return [i * 10 for i in indices]

    dataset = Bulk()
    batches = as_lists(await collect(DataLoader(dataset, batch_size=4)))
    assert batches == [[0, 10, 20, 30], [40, 50, 60, 70], [80, 90]]
    assert dataset.requests == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


async def test_async_getitems(anyio_backend: str) -> None:
    class AsyncBulk(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 9

        async def __getitem__(self, index: int) -> int:
            raise AssertionError("__getitems__ should be used")

        async def __getitems__(self, indices: list[int]) -> list[int]:
            await anyio.sleep(0)
            return [-i for i in indices]

    batches = as_lists(await collect(DataLoader(AsyncBulk(), batch_size=4, shuffle=True,
                                                generator=0)))
    assert sorted(i for b in batches for i in b) == [-i for i in range(8, -1, -1)]


async def test_array_dataset_batches(anyio_backend: str) -> None:
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    y = np.arange(20)
    loader = DataLoader(aloader.ArrayDataset(x, y), batch_size=8, shuffle=True, generator=3)
    batches = await collect(loader)
    assert [len(b[1]) for b in batches] == [8, 8, 4]
    ys = np.concatenate([b[1] for b in batches])
    assert sorted(ys.tolist()) == list(range(20))
    for bx, by in batches:
        np.testing.assert_array_equal(bx, x[by])
        assert bx.dtype == np.float32


# Iterable datasets -------------------------------------------------------------------------------
class AsyncStream(aloader.IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    async def __aiter__(self) -> AsyncIterator[int]:
        for i in range(self.n):
            await anyio.sleep(0)
            yield i


@pytest.mark.parametrize("source", [Stream, AsyncStream])
@pytest.mark.parametrize(("batch_size", "drop_last", "expected"), [
    (3, False, [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]),
    (3, True, [[0, 1, 2], [3, 4, 5], [6, 7, 8]]),
    (5, False, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),
])
async def test_iterable_batches(
    anyio_backend: str, source: Any, batch_size: int, drop_last: bool, expected: Any
) -> None:
    loader = DataLoader(source(10), batch_size=batch_size, drop_last=drop_last)
    assert as_lists(await collect(loader)) == expected
    assert as_lists(await collect(loader)) == expected  # a new epoch re-iterates


@pytest.mark.parametrize("source", [Stream, AsyncStream])
async def test_iterable_without_batching(anyio_backend: str, source: Any) -> None:
    batches = await collect(DataLoader(source(4), batch_size=None))
    assert batches == [0, 1, 2, 3]


async def test_async_generator_function_dataset(anyio_backend: str) -> None:
    class Lines(aloader.IterableDataset[str]):
        async def __aiter__(self) -> AsyncIterator[str]:
            for word in ["a", "b", "c"]:
                yield word

    assert await collect(DataLoader(Lines(), batch_size=2)) == [["a", "b"], ["c"]]


def test_iterable_length_warning() -> None:
    class Liar(aloader.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(6))

        def __len__(self) -> int:
            return 2

    loader = DataLoader(Liar(), batch_size=None)
    assert len(loader) == 2
    with pytest.warns(UserWarning, match=r"Length of IterableDataset .* was reported to be 2"
                                         r"\(when accessing len\(dataloader\)\), but \d samples "
                                         r"have been fetched") as record:
        list(loader)
    # Like torch: one warning for each sample past the reported length.
    assert [str(w.message).split("but ")[1][0] for w in record] == ["3", "4", "5", "6"]


def test_no_length_warning_without_len_call() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(DataLoader(Stream(5), batch_size=None)) == [0, 1, 2, 3, 4]


async def test_iterable_error_reaches_consumer(anyio_backend: str) -> None:
    class Broken(aloader.IterableDataset[int]):
        async def __aiter__(self) -> AsyncIterator[int]:
            yield 1
            raise ConnectionError("stream reset")

    with pytest.raises(ConnectionError, match="stream reset"):
        await collect(DataLoader(Broken(), batch_size=4))


# Bulk loading, custom samplers, collate ----------------------------------------------------------
async def test_bulk_loading_without_batching(anyio_backend: str) -> None:
    class BulkDataset(aloader.Dataset[list[int]]):
        def __len__(self) -> int:
            return 12

        def __getitem__(self, indices: list[int]) -> list[int]:
            return [i * 2 for i in indices]

    sampler = [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9, 10, 11]]
    batches = await collect(DataLoader(BulkDataset(), batch_size=None, sampler=sampler))
    assert batches == [[0, 2, 4], [6, 8, 10], [12, 14, 16, 18, 20, 22]]


async def test_custom_sampler_and_batch_sampler(anyio_backend: str) -> None:
    loader = DataLoader(AsyncRange(10), sampler=[9, 8, 7, 1], batch_size=3)
    assert as_lists(await collect(loader)) == [[9, 8, 7], [1]]
    loader = DataLoader(AsyncRange(10), batch_sampler=[[1, 2], [5], [0, 9, 3]])
    assert as_lists(await collect(loader)) == [[1, 2], [5], [0, 9, 3]]


async def test_async_samplers(anyio_backend: str) -> None:
    async def indices() -> AsyncIterator[int]:
        for i in (3, 1, 4, 1, 5):
            yield i

    loader = DataLoader(AsyncRange(10), sampler=aloader_async_iterable(indices), batch_size=2)
    assert as_lists(await collect(loader)) == [[3, 1], [4, 1], [5]]

    async def batches() -> AsyncIterator[list[int]]:
        yield [0, 1]
        yield [7]

    loader = DataLoader(AsyncRange(10), batch_sampler=aloader_async_iterable(batches))
    assert as_lists(await collect(loader)) == [[0, 1], [7]]


class aloader_async_iterable:
    """An async iterable (not an iterator): a new pass per epoch."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory

    def __aiter__(self) -> AsyncIterator[Any]:
        return self.factory()  # type: ignore[no-any-return]


async def test_async_collate_fn(anyio_backend: str) -> None:
    async def collate(samples: list[int]) -> int:
        await anyio.sleep(0)
        return sum(samples)

    assert await collect(DataLoader(AsyncRange(6), batch_size=3, collate_fn=collate)) == [3, 12]
    assert await collect(DataLoader(SyncRange(6), batch_size=3, collate_fn=collate)) == [3, 12]


async def test_default_collate_structures(anyio_backend: str) -> None:
    class Records(aloader.Dataset[dict[str, Any]]):
        def __len__(self) -> int:
            return 4

        async def __getitem__(self, index: int) -> dict[str, Any]:
            return {"x": np.full(3, index, dtype=np.float32), "label": index, "name": str(index)}

    (first, second) = await collect(DataLoader(Records(), batch_size=2))
    assert first["x"].shape == (2, 3) and first["x"].dtype == np.float32
    assert first["label"].tolist() == [0, 1] and first["label"].dtype == np.int64
    assert second["name"] == ["2", "3"]


# Errors ------------------------------------------------------------------------------------------
async def test_dataset_error_keeps_type_and_names_index(anyio_backend: str) -> None:
    loader = DataLoader(Failing(20, {13}), batch_size=4)
    with pytest.raises(KeyError) as info:
        await collect(loader)
    assert any("index 13" in note for note in info.value.__notes__)
    # The next epoch works (and fails again at the same place, nothing else).
    iterator = aiter(DataLoader(Failing(20, {13}), batch_size=4))
    assert as_lists([await anext(iterator) for _ in range(3)]) == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]
    ]
    with pytest.raises(KeyError):
        await anext(iterator)
    # Like torch, the iterator goes on after an error.
    assert as_lists([await anext(iterator)]) == [[16, 17, 18, 19]]
    with pytest.raises(StopAsyncIteration):
        await anext(iterator)


async def test_sync_dataset_error_in_thread(anyio_backend: str) -> None:
    class Bad(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> int:
            if index == 5:
                raise ValueError("corrupt record")
            return index

    with pytest.raises(ValueError, match="corrupt record") as info:
        await collect(DataLoader(Bad(), batch_size=2))
    assert any("batch 2" in note and "[4, 5]" in note for note in info.value.__notes__)


async def test_collate_error_reaches_consumer(anyio_backend: str) -> None:
    def bad_collate(samples: list[int]) -> None:
        raise TypeError("cannot collate")

    with pytest.raises(TypeError, match="cannot collate"):
        await collect(DataLoader(AsyncRange(4), batch_size=2, collate_fn=bad_collate))


async def test_sampler_error_reaches_consumer(anyio_backend: str) -> None:
    def sampler() -> Iterator[int]:
        yield 0
        raise LookupError("sampler broke")

    class Once:
        def __iter__(self) -> Iterator[int]:
            return sampler()

    with pytest.raises(LookupError, match="sampler broke"):
        await collect(DataLoader(AsyncRange(4), sampler=Once(), batch_size=1))


async def test_timeout(anyio_backend: str) -> None:
    dataset = Gated(4)
    loader = DataLoader(dataset, batch_size=2, timeout=0.05)
    with pytest.raises(aloader.LoaderTimeoutError,
                       match=r"^DataLoader timed out after 0.05 seconds$") as info:
        await collect(loader)
    assert isinstance(info.value, RuntimeError)  # torch raises a RuntimeError
    dataset.gate.set()


def test_timeout_sync_facade() -> None:
    class Never(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 2

        async def __getitem__(self, index: int) -> int:
            await anyio.sleep_forever()
            raise AssertionError

    with pytest.raises(RuntimeError, match="DataLoader timed out after 0.05 seconds"):
        list(DataLoader(Never(), timeout=0.05))


# Cleanup -----------------------------------------------------------------------------------------
async def test_break_stops_every_fetch(anyio_backend: str) -> None:
    dataset = Gated(1000)
    loader = DataLoader(dataset, batch_size=10, max_concurrency=20)
    dataset.gate.set()
    async for _ in loader:
        dataset.gate = anyio.Event()  # later fetches hang until cancelled
        break
    gc.collect()
    await anyio.wait_all_tasks_blocked()
    assert dataset.active == 0
    assert dataset.started < 1000


async def test_consumer_exception_stops_every_fetch(anyio_backend: str) -> None:
    dataset = Gated(1000)
    loader = DataLoader(dataset, batch_size=10, max_concurrency=20)
    dataset.gate.set()
    with pytest.raises(ZeroDivisionError):
        async for _ in loader:
            dataset.gate = anyio.Event()
            raise ZeroDivisionError
    gc.collect()
    await anyio.wait_all_tasks_blocked()
    assert dataset.active == 0


async def test_cancelling_the_consumer_stops_every_fetch(anyio_backend: str) -> None:
    dataset = Gated(1000)
    loader = DataLoader(dataset, batch_size=10, max_concurrency=20)
    with anyio.move_on_after(0.05):
        async for _ in loader:
            raise AssertionError("no batch can arrive")
    await anyio.wait_all_tasks_blocked()
    assert dataset.active == 0
    assert dataset.cancelled == 20


async def test_aclose_and_async_with_are_deterministic(anyio_backend: str) -> None:
    dataset = Gated(1000)
    async with DataLoader(dataset, batch_size=10, max_concurrency=20) as loader:
        iterator = aiter(loader)
        async with anyio.create_task_group() as tg:
            tg.start_soon(anext, iterator)
            await anyio.wait_all_tasks_blocked()
            dataset.gate.set()
        dataset.gate = anyio.Event()
        await anyio.wait_all_tasks_blocked()
        assert dataset.active > 0
    # __aexit__ returned: every fetch has ended, without waiting for the loop to run again.
    assert dataset.active == 0
    with pytest.raises(StopAsyncIteration):
        await anext(iterator)


async def test_no_task_left_after_an_epoch(anyio_backend: str) -> None:
    before = _task_count(anyio_backend)
    await collect(DataLoader(AsyncRange(100), batch_size=10, max_concurrency=30))
    await anyio.wait_all_tasks_blocked()
    assert _task_count(anyio_backend) == before


async def test_no_task_left_after_break(anyio_backend: str) -> None:
    before = _task_count(anyio_backend)
    async for _ in DataLoader(AsyncRange(1000, max_delay=0.001), batch_size=10,
                              max_concurrency=30):
        break
    gc.collect()
    for _ in range(5):
        await anyio.wait_all_tasks_blocked()
        await anyio.sleep(0.01)
    assert _task_count(anyio_backend) == before


def _task_count(backend: str) -> int:
    if backend == "asyncio":
        import asyncio

        return len(asyncio.all_tasks())
    import trio

    def count(task: Any) -> int:
        return 1 + sum(count(child) for nursery in task.child_nurseries
                       for child in nursery.child_tasks)

    root = trio.lowlevel.current_root_task()
    assert root is not None
    return count(root)


# The synchronous facade --------------------------------------------------------------------------
def test_sync_facade_same_batches_as_async() -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(AsyncRange(100, max_delay=0.001), batch_size=8, shuffle=True,
                          generator=5)

    sync_batches = as_lists(list(make()))
    async_batches = as_lists(anyio.run(collect, make()))
    assert sync_batches == async_batches
    loader = make()
    assert as_lists(list(loader)) != as_lists(list(loader))  # epochs differ


def test_sync_facade_raises_inside_a_running_loop() -> None:
    async def main() -> None:
        with pytest.raises(RuntimeError, match="async for batch in loader"):
            iter(DataLoader(list(range(3))))

    anyio.run(main)
    anyio.run(main, backend="trio")


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aloader-loop"]


def test_sync_facade_shuts_down_on_exhaustion_break_and_gc() -> None:
    assert list(DataLoader(list(range(3)))) != []
    assert _loop_threads() == []
    for _ in DataLoader(AsyncRange(100), batch_size=2):
        assert _loop_threads() != []
        break
    gc.collect()
    assert _loop_threads() == []
    iterator = iter(DataLoader(AsyncRange(100), batch_size=2))
    next(iterator)
    del iterator
    gc.collect()
    assert _loop_threads() == []


def test_sync_facade_propagates_errors_and_continues() -> None:
    iterator = iter(DataLoader(Failing(6, {2}), batch_size=2))
    assert as_lists([next(iterator)]) == [[0, 1]]
    with pytest.raises(KeyError):
        next(iterator)
    assert as_lists([next(iterator)]) == [[4, 5]]
    with pytest.raises(StopIteration):
        next(iterator)


def test_sync_facade_with_sync_and_iterable_datasets() -> None:
    assert as_lists(list(DataLoader(SyncRange(5), batch_size=2))) == [[0, 1], [2, 3], [4]]
    assert as_lists(list(DataLoader(Stream(5), batch_size=2))) == [[0, 1], [2, 3], [4]]
    assert as_lists(list(DataLoader(AsyncStream(5), batch_size=2))) == [[0, 1], [2, 3], [4]]


# pin_memory --------------------------------------------------------------------------------------
def test_pin_memory_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(RuntimeError, match="pin_memory=True needs torch"):
        DataLoader(list(range(3)), pin_memory=True)


def test_pin_memory_with_torch_and_no_accelerator() -> None:
    torch = pytest.importorskip("torch")
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    loader = DataLoader(aloader.ArrayDataset(np.arange(4)), batch_size=2, pin_memory=True)
    with pytest.warns(UserWarning, match="no accelerator is found"):
        batches = list(loader)
    assert [b[0].tolist() for b in batches] == [[0, 1], [2, 3]]


async def test_stop_iteration_from_the_dataset_is_not_a_silent_end(anyio_backend: str) -> None:
    class Leaky(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 6

        async def __getitem__(self, index: int) -> int:
            if index == 3:
                raise StopIteration
            return index

    with pytest.raises(RuntimeError, match="raised StopIteration"):
        await collect(DataLoader(Leaky(), batch_size=2))


async def test_break_closes_an_async_source_at_once(anyio_backend: str) -> None:
    closed = anyio.Event()

    class Source(aloader.IterableDataset[int]):
        async def __aiter__(self) -> AsyncIterator[int]:
            try:
                for i in range(10_000):
                    await anyio.sleep(0)
                    yield i
            finally:
                closed.set()

    async with DataLoader(Source(), batch_size=4) as loader:
        async for _ in loader:
            break
    assert closed.is_set()


def test_an_epoch_whose_making_raised_is_collected_quietly() -> None:
    class NoLength:
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

        def __len__(self) -> int:
            raise RuntimeError("no length today")

    loader = DataLoader(list(range(3)), sampler=NoLength())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unraisable error in __del__ would show here
        with pytest.raises(RuntimeError, match="no length today"):
            iter(loader)
        unraisable: list[Any] = []
        hook = sys.unraisablehook
        sys.unraisablehook = unraisable.append
        try:
            gc.collect()
        finally:
            sys.unraisablehook = hook
    assert unraisable == []
