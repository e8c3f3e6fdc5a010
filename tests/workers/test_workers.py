"""Worker processes (``num_workers > 0``): torch's worker tests, written fresh, plus transport.

No test asserts a duration: timeouts here are hang guards. Datasets live at module level so the
workers (started by the fork server) can unpickle them; worker pids travel back in batches so
tests can check that processes and shared-memory segments are gone.
"""

from __future__ import annotations

import errno
import gc
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aloader
from aloader import DataLoader
from aloader.workers import _shm

pytestmark = pytest.mark.anyio

GUARD = 60  # seconds: a hang guard, never a timing assertion
# Three workers on a 2-core machine: torch's warning (test_worker_number_warning checks it).
MORE_WORKERS_THAN_CPUS = pytest.mark.filterwarnings("ignore:This DataLoader will create")


# Datasets (module level: workers import them) ---------------------------------------------------
class Squares(aloader.Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index * index


class AsyncSquares(aloader.Dataset[int]):
    """Async fetches that overlap inside a worker; each sample says how many were in flight."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.active = 0

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> tuple[int, int]:
        self.active += 1
        try:
            await anyio.sleep(0.002)
            return index * index, self.active
        finally:
            self.active -= 1


class Who(aloader.Dataset[dict[str, Any]]):
    """Each sample tells which process and worker made it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.calls += 1
        info = aloader.get_worker_info()
        assert info is not None
        return {"index": index, "pid": os.getpid(), "worker": info.id, "calls": self.calls,
                "same_dataset": info.dataset is self}


class SeedProbe(aloader.Dataset[tuple[int, int, float, int]]):
    """The worker's first random draws, taken before anything else draws."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.first: tuple[int, int, float, int] | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int, float, int]:
        if self.first is None:
            info = aloader.get_worker_info()
            assert info is not None
            self.first = (info.id, info.seed, random.random(), int(np.random.randint(2**31)))
        return self.first


class Failing(aloader.Dataset[int]):
    def __init__(self, n: int, bad: int, exc: type[Exception] = ValueError) -> None:
        self.n = n
        self.bad = bad
        self.exc = exc

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            raise self.exc(f"corrupt record {index}")
        return index


class Exiting(aloader.Dataset[int]):
    """Index ``at`` ends the worker: killed by ``sig``, or exiting with ``code``."""

    def __init__(self, n: int, at: int, *, sig: int | None = None, code: int = 0) -> None:
        self.n = n
        self.at = at
        self.sig = sig
        self.code = code

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.at:
            if self.sig is not None:
                os.kill(os.getpid(), self.sig)
            os._exit(self.code)
        return os.getpid()


class Sleepy(aloader.Dataset[int]):
    """Returns the worker's pid; index ``stall`` sleeps (long enough to trip a timeout)."""

    def __init__(self, n: int, stall: int = -1, delay: float = 0.0) -> None:
        self.n = n
        self.stall = stall
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        time.sleep(30 if index == self.stall else self.delay)
        return os.getpid()


class Big(aloader.Dataset[dict[str, Any]]):
    """Samples whose batches are far above the shared-memory threshold."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": np.full((128, 128), index, dtype=np.float32),
                "f": np.asfortranarray(np.full((64, 32), index, dtype=np.int64)),
                "pid": os.getpid()}


class Sharded(aloader.IterableDataset[int]):
    """range(n), split between the workers with get_worker_info()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = aloader.get_worker_info()
        items = range(self.n)
        if info is not None:
            items = items[info.id :: info.num_workers]
        return iter(items)


class Unsharded(aloader.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(5))


class AsyncSharded(aloader.IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    async def __aiter__(self) -> Any:
        info = aloader.get_worker_info()
        assert info is not None
        for item in range(info.id, self.n, info.num_workers):
            await anyio.sleep(0)
            yield item


class BadIter(aloader.IterableDataset[int]):
    """Worker 0's __iter__ raises; the other workers yield their shard."""

    def __iter__(self) -> Iterator[int]:
        info = aloader.get_worker_info()
        assert info is not None
        if info.id == 0:
            raise OSError("cannot open shard 0")
        return iter(range(info.id * 100, info.id * 100 + 3))


class CustomError(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


class Custom(aloader.Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        raise CustomError(7, "two-argument exception")


def identity(sample: Any) -> Any:
    return sample


def record_init(worker_id: int) -> None:
    info = aloader.get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.n_init = getattr(info.dataset, "n_init", 0) + 1  # type: ignore[attr-defined]


def failing_init(worker_id: int) -> None:
    raise LookupError(f"init of worker {worker_id} failed")


class InitCount(aloader.Dataset[int]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return getattr(self, "n_init", 0)


# Helpers -----------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _close_dropped_iterators() -> Iterator[None]:
    """A test that raised through ``for`` leaves its iterator in a traceback cycle: collect it,
    so that its event-loop thread and workers stop before the next test."""
    yield
    gc.collect()


async def collect(loader: DataLoader[Any]) -> list[Any]:
    with anyio.fail_after(GUARD):
        return [batch async for batch in loader]


def segments(owner: int | None = None) -> list[str]:
    prefix = _shm.prefix(_shm.owner()) if owner is None else _shm.process_prefix(owner)
    return [name for name in os.listdir(_shm.SHM_DIR) if name.startswith(prefix)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: set[int]) -> None:
    deadline = time.monotonic() + GUARD
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"processes still alive: {pids}"
        time.sleep(0.02)


def wait_no_segments(owner: int | None = None) -> None:
    deadline = time.monotonic() + GUARD
    while segments(owner):
        assert time.monotonic() < deadline, f"segments left: {segments(owner)}"
        time.sleep(0.02)


async def await_gone(pids: set[int]) -> None:
    """wait_gone and wait_no_segments, letting the event loop run meanwhile."""
    with anyio.fail_after(GUARD):
        while any(alive(pid) for pid in pids) or segments():
            await anyio.sleep(0.02)


def pids_of(batches: list[Any]) -> set[int]:
    return {int(pid) for batch in batches for pid in np.ravel(batch["pid"])}


# Arguments ---------------------------------------------------------------------------------------
def test_multiprocessing_context_validation() -> None:
    with pytest.raises(ValueError, match="should specify a valid start method in") as info:
        DataLoader(Squares(4), num_workers=1, multiprocessing_context="bogus")
    assert "but got multiprocessing_context='bogus'" in str(info.value)
    with pytest.raises(TypeError, match="should be a valid context object or a string"):
        DataLoader(Squares(4), num_workers=1, multiprocessing_context=3)
    loader = DataLoader(Squares(4), num_workers=1, multiprocessing_context="spawn")
    assert isinstance(loader.multiprocessing_context, multiprocessing.context.BaseContext)
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    context = multiprocessing.get_context("fork")
    assert DataLoader(Squares(4), num_workers=1,
                      multiprocessing_context=context).multiprocessing_context is context


@pytest.mark.parametrize("value", ["bogus", 3])
def test_multiprocessing_context_errors_match_torch(value: Any) -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    with pytest.raises((ValueError, TypeError)) as theirs:
        torch_data.DataLoader(list(range(4)), num_workers=1, multiprocessing_context=value)
    with pytest.raises(theirs.type) as ours:
        DataLoader(list(range(4)), num_workers=1, multiprocessing_context=value)
    assert str(ours.value) == str(theirs.value)


def test_worker_number_warning() -> None:
    cpus = len(os.sched_getaffinity(0))
    with pytest.warns(UserWarning, match=f"will create {cpus + 1} worker processes in total"):
        assert len(list(DataLoader(Squares(4), batch_size=2, num_workers=cpus + 1))) == 2


def test_worker_number_warning_once_at_the_users_lines() -> None:
    cpus = len(os.sched_getaffinity(0))

    async def epoch(loader: DataLoader[Any]) -> int:
        return len([batch async for batch in loader])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = DataLoader(Squares(4), batch_size=2, num_workers=cpus + 1)
        built = sys._getframe().f_lineno - 1
        for _ in range(2):
            assert len(list(loader)) == 2  # no warning at the epochs
            assert anyio.run(epoch, loader) == 2
        loader.num_workers = cpus + 2  # torch warns at the next epoch: so does aloader, once
        for _ in range(2):
            assert len(list(loader)) == 2
        again = sys._getframe().f_lineno - 1
        assert anyio.run(epoch, loader) == 2
        loader.num_workers = cpus + 3
        assert anyio.run(epoch, loader) == 2
        loader.close()
    where = [(w.filename, w.lineno) for w in caught if "worker processes" in str(w.message)]
    assert where == [(__file__, built), (__file__, again),
                     (__file__, epoch.__code__.co_firstlineno + 1)]


# Batches -----------------------------------------------------------------------------------------
async def test_same_batches_as_without_workers(anyio_backend: str) -> None:
    def make(workers: int) -> DataLoader[Any]:
        return DataLoader(Squares(103), batch_size=8, shuffle=True, generator=3,
                          num_workers=workers)

    expected = [b.tolist() for b in await collect(make(0))]
    assert [b.tolist() for b in await collect(make(2))] == expected


class SlowFirst(aloader.Dataset[int]):
    """Index 0 takes a while, so later batches finish first."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        if index == 0:
            time.sleep(0.2)
        return index


def test_sync_facade_with_workers_in_order() -> None:
    loader = DataLoader(SlowFirst(), batch_size=3, num_workers=2, timeout=GUARD,
                        prefetch_factor=3)
    assert [b.tolist() for b in loader] == [list(range(k, min(k + 3, 40)))
                                            for k in range(0, 40, 3)]
    loader = DataLoader(Squares(50), batch_size=None, num_workers=2, shuffle=True, generator=1)
    assert sorted(int(x) for x in loader) == sorted(i * i for i in range(50))


async def test_out_of_order_delivers_everything_once(anyio_backend: str) -> None:
    loader = DataLoader(Squares(64), batch_size=4, num_workers=2, in_order=False)
    values = sorted(x for batch in await collect(loader) for x in batch.tolist())
    assert values == [i * i for i in range(64)]


async def test_async_dataset_overlaps_fetches_inside_each_worker(anyio_backend: str) -> None:
    loader = DataLoader(AsyncSquares(64), batch_size=16, num_workers=2, max_concurrency=8)
    batches = await collect(loader)
    assert [x for b in batches for x in b[0].tolist()] == [i * i for i in range(64)]
    assert max(int(b[1].max()) for b in batches) > 1


async def test_custom_collate_and_no_batching(anyio_backend: str) -> None:
    loader = DataLoader(Squares(5), batch_size=2, num_workers=2, collate_fn=identity)
    assert await collect(loader) == [[0, 1], [4, 9], [16]]
    loader = DataLoader(Squares(5), batch_size=None, num_workers=2, collate_fn=identity)
    assert await collect(loader) == [0, 1, 4, 9, 16]


async def test_large_arrays_cross_in_shared_memory(anyio_backend: str) -> None:
    batches = await collect(DataLoader(Big(), batch_size=8, num_workers=2))
    for k, batch in enumerate(batches):
        expected = np.repeat(np.arange(8 * k, 8 * k + 8), 128 * 128).reshape(8, 128, 128)
        np.testing.assert_array_equal(batch["x"], expected)
        assert batch["x"].dtype == np.float32
        np.testing.assert_array_equal(batch["f"][:, 0, 0], np.arange(8 * k, 8 * k + 8))
        batch["x"][0, 0, 0] = -1  # the arrays are writable, like torch's
    assert len(pids_of(batches)) == 2
    await await_gone(set())


# Seeds and worker info ---------------------------------------------------------------------------
async def _first_draws(loader: DataLoader[Any]) -> tuple[int, dict[int, tuple[int, float, int]]]:
    iterator = aiter(loader)
    with anyio.fail_after(GUARD):
        draws = {int(b[0]): (int(b[1]), float(b[2]), int(b[3])) async for b in iterator}
    return iterator.base_seed, draws


@MORE_WORKERS_THAN_CPUS
async def test_worker_seeds_distinct_reproducible_and_torch_like(anyio_backend: str) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(SeedProbe(6), batch_size=None, num_workers=3, generator=11,
                          prefetch_factor=1)

    loader = make()
    base_seed, draws = await _first_draws(loader)
    assert sorted(draws) == [0, 1, 2]
    for worker_id, (seed, py_draw, np_draw) in draws.items():
        assert seed == base_seed + worker_id
        assert py_draw == random.Random(seed).random()
        state = np.random.SeedSequence([worker_id, base_seed]).generate_state(4)
        assert np_draw == np.random.RandomState(state).randint(2**31)
    assert len({d[1] for d in draws.values()}) == 3  # distinct streams
    again = await _first_draws(make())
    assert again == (base_seed, draws)  # the same generator seed, the same seeds
    other = await _first_draws(loader)  # the next epoch draws a new base seed
    assert other[0] != base_seed
    assert {d[0] for d in other[1].values()} == {other[0] + i for i in range(3)}


def test_numpy_worker_state_is_torchs() -> None:
    worker = pytest.importorskip("torch.utils.data._utils.worker")
    for base_seed in (0, 5, 2**32 + 7, 2**63 - 2):
        for worker_id in (0, 1, 7):
            expected = worker._generate_state(base_seed, worker_id)
            ours = np.random.SeedSequence([worker_id, base_seed]).generate_state(4)
            assert ours.tolist() == expected


async def test_worker_info_fields_and_read_only(anyio_backend: str) -> None:
    assert aloader.get_worker_info() is None
    dataset = Who(12)
    batches = await collect(DataLoader(dataset, batch_size=3, num_workers=2))
    assert {w for b in batches for w in b["worker"].tolist()} == {0, 1}
    assert all(b["same_dataset"].all() for b in batches)
    assert dataset.calls == 0  # the workers used their own copies
    info = aloader._workerinfo.WorkerInfo(id=0, num_workers=1, seed=3, dataset=dataset)
    with pytest.raises(RuntimeError, match="Cannot assign attributes to WorkerInfo objects"):
        info.id = 2
    assert "num_workers=1" in repr(info)


def test_worker_init_fn_runs_once_per_worker() -> None:
    batches = list(DataLoader(InitCount(), batch_size=2, num_workers=2,
                              worker_init_fn=record_init))
    assert [b.tolist() for b in batches] == [[1, 1]] * 4


# Iterable datasets -------------------------------------------------------------------------------
@MORE_WORKERS_THAN_CPUS
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_iterable_sharding_no_duplicate_no_loss(workers: int) -> None:
    values = [x for b in DataLoader(Sharded(23), batch_size=4, num_workers=workers)
              for x in b.tolist()]
    assert sorted(values) == list(range(23))


def test_iterable_batches_come_from_workers_in_turn() -> None:
    # torch's order: one batch per worker in turn, passing over exhausted workers.
    batches = [b.tolist() for b in DataLoader(Sharded(10), batch_size=2, num_workers=2)]
    assert batches == [[0, 2], [1, 3], [4, 6], [5, 7], [8], [9]]
    batches = [b.tolist() for b in DataLoader(Sharded(10), batch_size=2, num_workers=2,
                                              drop_last=True)]
    assert batches == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [int(x) for x in DataLoader(Sharded(5), batch_size=None, num_workers=2)] == [
        0, 1, 2, 3, 4]


async def test_iterable_async_replicas(anyio_backend: str) -> None:
    batches = await collect(DataLoader(AsyncSharded(9), batch_size=2, num_workers=2))
    assert sorted(x for b in batches for x in b.tolist()) == list(range(9))


def test_iterable_without_sharding_repeats_per_worker() -> None:
    values = [x for b in DataLoader(Unsharded(), batch_size=2, num_workers=2) for x in b.tolist()]
    assert sorted(values) == sorted(list(range(5)) * 2)


def test_iterable_iter_error_propagates_and_others_continue() -> None:
    iterator = iter(DataLoader(BadIter(), batch_size=2, num_workers=2, timeout=GUARD))
    with pytest.raises(OSError, match="cannot open shard 0") as info:
        next(iterator)
    assert "Caught OSError in DataLoader worker process 0" in str(info.value)
    assert [b.tolist() for b in iterator] == [[100, 101], [102]]


# Errors ------------------------------------------------------------------------------------------
async def test_worker_error_keeps_type_worker_and_traceback(anyio_backend: str) -> None:
    iterator = aiter(DataLoader(Failing(8, bad=5), batch_size=2, num_workers=2))
    with anyio.fail_after(GUARD):
        assert (await anext(iterator)).tolist() == [0, 1]
        assert (await anext(iterator)).tolist() == [2, 3]
        with pytest.raises(ValueError) as info:
            await anext(iterator)
        # The epoch goes on after the error, as in torch.
        assert [b.tolist() async for b in iterator] == [[6, 7]]
    message = str(info.value)
    assert message.startswith("Caught ValueError in DataLoader worker process ")
    assert "Original Traceback (most recent call last):" in message
    assert "in __getitem__" in message and "corrupt record 5" in message
    assert any("batch 2" in note and "[4, 5]" in note for note in info.value.__notes__)


def test_worker_error_types_that_need_care() -> None:
    with pytest.raises(KeyError) as key_error:
        list(DataLoader(Failing(4, bad=1, exc=KeyError), batch_size=2, num_workers=1))
    assert "\\n" not in str(key_error.value)  # readable, not a repr
    assert "Caught KeyError in DataLoader worker process 0" in str(key_error.value)
    # An exception that cannot be rebuilt from a message becomes a RuntimeError (as in torch).
    with pytest.raises(RuntimeError, match="Caught CustomError in DataLoader worker process 0"):
        list(DataLoader(Custom(), batch_size=2, num_workers=1))


def test_worker_init_fn_error_propagates() -> None:
    with pytest.raises(LookupError, match="init of worker [01] failed") as info:
        list(DataLoader(Squares(8), batch_size=2, num_workers=2, worker_init_fn=failing_init))
    assert "in DataLoader worker process" in str(info.value)


def test_lambdas_travel_by_value() -> None:
    dataset = Squares(4)
    dataset.transform = lambda x: x  # type: ignore[attr-defined]
    loader = DataLoader(dataset, batch_size=2, num_workers=1, collate_fn=lambda b: sum(b))
    assert list(loader) == [1, 13]


def test_unpicklable_dataset_names_the_cause() -> None:
    dataset = Squares(4)
    dataset.lock = threading.Lock()  # type: ignore[attr-defined]
    # The default context forks such a loader's workers on Linux (compat/test_worker_failures.py).
    with pytest.raises(TypeError, match="cannot pickle") as info:
        list(DataLoader(dataset, batch_size=2, num_workers=1, multiprocessing_context="spawn"))
    assert any("multiprocessing_context='fork'" in note for note in info.value.__notes__)


async def test_worker_killed_by_signal_mid_epoch(anyio_backend: str) -> None:
    iterator = aiter(DataLoader(Sleepy(400, delay=0.005), batch_size=4, num_workers=2))
    with anyio.fail_after(GUARD):
        victim = int((await anext(iterator))[0])
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RuntimeError) as info:
            async for _ in iterator:
                pass
    assert str(info.value) == f"DataLoader worker (pid {victim}) is killed by signal: Killed. "
    assert isinstance(info.value, aloader.WorkerError)


def test_persistent_loader_recovers_from_a_dead_worker() -> None:
    loader = DataLoader(Sleepy(200, delay=0.002), batch_size=4, num_workers=2,
                        persistent_workers=True, timeout=GUARD)
    iterator = iter(loader)
    victim = int(next(iterator)[0])
    os.kill(victim, signal.SIGKILL)
    killed = f"DataLoader worker \\(pid {victim}\\) is killed"
    with pytest.raises(RuntimeError, match=killed) as dead:
        for _ in iterator:
            pass
    assert isinstance(dead.value, aloader.WorkerError)
    with pytest.raises(RuntimeError, match="DataLoader iterator was closed") as closed:
        next(iterator)  # the failure is reported once; the epoch is over
    assert isinstance(closed.value, aloader.LoaderClosedError)
    del iterator
    batches = list(loader)  # the next epoch starts new workers
    assert len(batches) == 50 and victim not in {int(p) for b in batches for p in b}


def test_worker_exiting_on_its_own() -> None:
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) exited unexpectedly "
                                           r"with exit code 3\. Details are lost"):
        list(DataLoader(Exiting(40, at=9, code=3), batch_size=2, num_workers=2, timeout=GUARD))
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) \d+\) exited "
                                           r"unexpectedly$"):
        list(DataLoader(Exiting(40, at=9, code=0), batch_size=2, num_workers=2, timeout=GUARD))
    with pytest.raises(RuntimeError, match="is killed by signal: Segmentation fault"):
        list(DataLoader(Exiting(40, at=9, sig=signal.SIGSEGV), batch_size=2, num_workers=1,
                        timeout=GUARD))


def test_timeout() -> None:
    iterator = iter(DataLoader(Sleepy(8, stall=2), batch_size=2, num_workers=1, timeout=1.5))
    pid = int(next(iterator)[0])
    with pytest.raises(aloader.LoaderTimeoutError,
                       match=r"^DataLoader timed out after 1.5 seconds$"):
        next(iterator)
    iterator.close()  # type: ignore[attr-defined]
    wait_gone({pid})  # a worker stuck in a fetch is terminated, not left behind


# Persistent workers ------------------------------------------------------------------------------
async def test_persistent_workers_keep_processes_and_dataset_state(anyio_backend: str) -> None:
    loader = DataLoader(Who(8), batch_size=2, num_workers=2, persistent_workers=True)
    first = await collect(loader)
    second = await collect(loader)
    pids = pids_of(first)
    assert pids_of(second) == pids
    # Each worker's copy counts on from where the last epoch left it.
    calls = {w: max(int(c) for b in first for c, ww in zip(b["calls"], b["worker"], strict=True)
                    if ww == w) for w in (0, 1)}
    assert all(int(c) > calls[int(w)] for b in second
               for c, w in zip(b["calls"], b["worker"], strict=True))
    await loader.aclose()
    await await_gone(pids)


def test_persistent_workers_survive_break_and_sync_epochs() -> None:
    loader = DataLoader(Who(40), batch_size=2, num_workers=2, persistent_workers=True)
    for batch in loader:
        pids = {int(p) for p in batch["pid"]}
        break
    gc.collect()
    assert pids_of(list(loader)) >= pids
    assert len(pids_of(list(loader))) == 2
    all_pids = pids_of(list(loader))
    del loader, batch
    gc.collect()
    wait_gone(all_pids)  # the loader's garbage collection stops its workers
    wait_no_segments()


async def test_concurrent_epochs_of_a_persistent_loader(anyio_backend: str) -> None:
    loader = DataLoader(Squares(20), batch_size=5, num_workers=1, persistent_workers=True)
    first, second = aiter(loader), aiter(loader)
    with anyio.fail_after(GUARD):
        a = [(await anext(first)).tolist()]
        b = [x.tolist() async for x in second]
        a += [x.tolist() async for x in first]
    assert a == b == [[i * i for i in range(k, k + 5)] for k in range(0, 20, 5)]
    await loader.aclose()


def test_non_persistent_workers_are_new_each_epoch() -> None:
    loader = DataLoader(Who(4), batch_size=2, num_workers=1)
    first, second = pids_of(list(loader)), pids_of(list(loader))
    assert first.isdisjoint(second)
    wait_gone(first | second)


# Leaving nothing behind --------------------------------------------------------------------------
async def test_break_leaves_no_process_and_no_segment(anyio_backend: str) -> None:
    with anyio.fail_after(GUARD):
        async for batch in DataLoader(Big(), batch_size=4, num_workers=2, prefetch_factor=4):
            pids = pids_of([batch])
            break
    gc.collect()
    await await_gone(pids)


async def test_cancelling_the_consumer_leaves_no_process(anyio_backend: str) -> None:
    seen: set[int] = set()
    with anyio.move_on_after(GUARD) as scope:
        async for batch in DataLoader(Big(), batch_size=2, num_workers=2):
            seen |= pids_of([batch])
            if len(seen) == 2:
                scope.cancel()
    gc.collect()
    await await_gone(seen)


_SCRIPT = """
import os, signal, sys
import numpy as np
import aloader

class Big(aloader.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, index):
        return {{"x": np.full(100_000, index, np.float32), "pid": os.getpid()}}

if __name__ == "__main__":
    loader = aloader.DataLoader(Big(), batch_size=4, num_workers=2, prefetch_factor=4,
                                persistent_workers={persistent})
    pids = set()
    for batch in loader:
        pids.update(batch["pid"].tolist())
        if len(pids) == 2:
            break
    iterator = iter(loader)
    next(iterator)
    print(*sorted(pids), flush=True)
    {ending}
"""


@pytest.mark.parametrize(("persistent", "ending"), [
    (False, "sys.exit(0)"),  # interpreter exit with an epoch in progress
    (True, "sys.exit(0)"),
    (True, "os.kill(os.getpid(), signal.SIGKILL)"),  # the loader's process dies
])
def test_process_exit_leaves_no_worker_and_no_segment(
    tmp_path: Any, persistent: bool, ending: str
) -> None:
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(persistent=persistent, ending=ending)))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                               cwd=tmp_path)
    out, _ = process.communicate(timeout=GUARD)
    pids = {int(pid) for pid in out.split()}
    assert len(pids) == 2
    wait_gone(pids)
    wait_no_segments(process.pid)


# Start methods -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_other_start_methods(method: str) -> None:
    batches = list(DataLoader(Big(), batch_size=16, num_workers=2,
                              multiprocessing_context=method, timeout=GUARD))
    assert [int(b["x"][0, 0, 0]) for b in batches] == [0, 16, 32, 48]
    wait_gone(pids_of(batches))
    wait_no_segments()


def test_fork_accepts_unpicklable_datasets() -> None:
    dataset = Squares(4)
    dataset.transform = lambda x: x  # type: ignore[attr-defined]
    loader = DataLoader(dataset, batch_size=2, num_workers=1, multiprocessing_context="fork")
    assert [b.tolist() for b in loader] == [[0, 1], [4, 9]]


# The transport -----------------------------------------------------------------------------------
def own(codec: _shm.Codec) -> list[str]:
    return sorted(name for name in os.listdir(_shm.SHM_DIR) if name.startswith(codec.prefix))


def test_codec_round_trip_and_unlink() -> None:
    codec = _shm.Codec(_shm.owner(), "test")
    big = np.arange(50_000, dtype=np.float64).reshape(100, 500)
    value = {"big": big, "fortran": np.asfortranarray(big), "small": np.arange(3),
             "strided": big[:, ::2], "text": "x", "many": list(range(100_000))}
    message = codec.encode(value)
    assert len(message) < 1024  # the arrays and the long list went to shared memory
    assert len(own(codec)) == 1
    back = _shm.decode(message)
    assert own(codec) == []  # unlinked once opened
    for key in ("big", "fortran", "small", "strided"):
        np.testing.assert_array_equal(back[key], value[key])
    assert back["fortran"].flags.f_contiguous
    assert back["many"] == value["many"] and back["text"] == "x"
    small = codec.encode({"a": np.arange(10)})
    assert own(codec) == []
    np.testing.assert_array_equal(_shm.decode(small)["a"], np.arange(10))


def test_codec_recycles_released_segments() -> None:
    codec = _shm.Codec(_shm.owner(), "test", recycle=1)
    released: list[str] = []
    array = _shm.decode(codec.encode(np.arange(100_000.0)), on_release=released.append)
    name = codec.last_segment
    assert own(codec) == [name]  # kept while the array views it
    np.testing.assert_array_equal(array, np.arange(100_000.0))
    del array
    gc.collect()
    assert released == [name]
    codec.release(released)
    message = codec.encode(np.ones(50_000))
    assert codec.last_segment == name  # the same pages, written again
    np.testing.assert_array_equal(_shm.decode(message), np.ones(50_000))  # no on_release: unlink
    assert own(codec) == []
    names: list[str] = []
    for _ in range(3):
        _shm.decode(codec.encode(np.ones(50_000)), on_release=names.append)
    gc.collect()
    codec.release(names)
    assert len(own(codec)) == 1  # beyond ``recycle`` released segments, the oldest go
    _shm.sweep(codec.prefix)


def test_segments_of_killed_loaders_are_swept() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = os.path.join(_shm.SHM_DIR, _shm.process_prefix(gone.pid) + "0123-x-0")
    mine = os.path.join(_shm.SHM_DIR, _shm.prefix(_shm.owner(), "x") + "0")
    for path in (stale, mine):
        with open(path, "wb") as f:
            f.write(b"x")
    _shm.sweep_stale()
    assert not os.path.exists(stale)
    assert os.path.exists(mine)
    os.unlink(mine)


def test_kept_batches_hold_no_file_descriptor() -> None:
    codec = _shm.Codec(_shm.owner(), "test")
    before = len(os.listdir("/proc/self/fd"))
    kept = [_shm.decode(codec.encode(np.full(20_000, i))) for i in range(50)]
    assert len(os.listdir("/proc/self/fd")) <= before + 1
    assert [int(a[0]) for a in kept] == list(range(50))


def test_codec_falls_back_to_the_pipe_when_shared_memory_is_full(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_shm, "_warned_full", False)
    monkeypatch.setattr(os, "pwrite", full)
    codec = _shm.Codec(_shm.owner(), "test")
    big = np.ones(100_000)
    with pytest.warns(RuntimeWarning, match="shared memory .* is full"):
        message = codec.encode(big)
    assert own(codec) == []
    np.testing.assert_array_equal(_shm.decode(message), big)


def test_codec_sends_torch_tensors_out_of_band() -> None:
    torch = pytest.importorskip("torch")
    codec = _shm.Codec(_shm.owner(), "test", tensors=True)
    tensor = torch.arange(100_000, dtype=torch.float32)
    message = codec.encode({"t": tensor, "grad": torch.ones(3, requires_grad=True)})
    assert len(message) < 2048
    back = _shm.decode(message)
    assert isinstance(back["t"], torch.Tensor) and torch.equal(back["t"], tensor)
    assert back["grad"].requires_grad
