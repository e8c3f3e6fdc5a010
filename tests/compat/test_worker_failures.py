"""Workers as torch's: a dataset that cannot be pickled, a failing worker_init_fn, StopIteration.

aloader's default workers receive their setup pickled; when it cannot be (a lock, an open file, a
database connection), the pool forks its workers instead on Linux, which inherit it, as torch's
do. A worker whose worker_init_fn failed raises at its first batch, after the batches before.
Compared with torch where it runs.
"""

from __future__ import annotations

import gc
import logging
import os
import sqlite3
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import aloader

torch = pytest.importorskip("torch")
tud = torch.utils.data

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the fork fallback is Linux's")


class Locked(tud.Dataset):  # type: ignore[misc]
    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> list[int]:
        with self.lock:
            return [index, os.getpid()]


class Rows(tud.Dataset):  # type: ignore[misc]
    """Rows of an sqlite database, read through the connection opened here (as user code
    written for torch's fork does), and a line of an open file."""

    def __init__(self, folder: Path, size: int) -> None:
        self.db = sqlite3.connect(folder / "rows.db", check_same_thread=False)
        self.db.execute("create table t (i integer, sq integer)")
        self.db.executemany("insert into t values (?, ?)", [(i, i * i) for i in range(size)])
        self.db.commit()
        (folder / "lines.txt").write_text("".join(f"line {i}\n" for i in range(size)))
        self.file = open(folder / "lines.txt")  # noqa: SIM115  (held, as the dataset's)
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, str]:
        (square,) = self.db.execute("select sq from t where i = ?", (index,)).fetchone()
        self.file.seek(0)
        return square, self.file.readlines()[index].strip()


def values(batches: list[Any]) -> list[Any]:
    return [[int(i) for i in b[0]] for b in batches]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_dataset_holding_a_lock_loads_each_sample_once_like_torch(workers: int) -> None:
    def run(loader_type: Any) -> list[list[int]]:
        loader = loader_type(Locked(23), batch_size=2, num_workers=workers)
        return sorted(int(s[0]) for batch in loader for s in zip(*batch, strict=True))

    ours = run(aloader.DataLoader)
    assert ours == run(tud.DataLoader) == list(range(23))


def test_the_fallback_forks_after_obstore_has_run_in_this_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A process that read an object store earlier (its tokio runtime started) still forks an
    # unpicklable dataset's workers: they only fail, with a FetchError, if they read a store.
    from aloader.io import _objstore
    monkeypatch.setattr(_objstore, "_RUNTIME_PID", os.getpid())
    assert _objstore.runtime_started()
    got = sorted(int(s[0]) for b in aloader.DataLoader(Locked(9), batch_size=2, num_workers=2)
                 for s in zip(*b, strict=True))
    assert got == list(range(9))


def test_the_workers_are_other_processes() -> None:
    pids = {int(s[1]) for b in aloader.DataLoader(Locked(8), batch_size=2, num_workers=2)
            for s in zip(*b, strict=True)}
    assert os.getpid() not in pids and len(pids) == 2


def test_sqlite_and_an_open_file_like_torch(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ours = list(aloader.DataLoader(Rows(tmp_path / "a", 9), batch_size=4, num_workers=2))
    theirs = list(tud.DataLoader(Rows(tmp_path / "b", 9), batch_size=4, num_workers=2))
    assert [(b[0].tolist(), list(b[1])) for b in ours] == [
        (b[0].tolist(), list(b[1])) for b in theirs]


async def test_async_for_and_persistent_workers(anyio_backend: str) -> None:
    loader = aloader.DataLoader(Locked(10), batch_size=3, num_workers=2,
                                persistent_workers=True)
    try:
        with anyio.fail_after(60):
            for _ in range(2):
                got = [int(i) for b in [b async for b in loader] for i in b[0]]
                assert got == list(range(10))
    finally:
        await loader.aclose()


def test_the_fallback_is_logged_and_runs_beside_a_thread_of_the_users(
        caplog: pytest.LogCaptureFixture) -> None:
    dataset = Locked(12)
    stop = threading.Event()

    def busy() -> None:  # a thread of the user's at work while the workers fork
        held = threading.Lock()
        while not stop.is_set():
            with held:
                pass

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        with caplog.at_level(logging.INFO, logger="aloader.workers"):
            got = [int(i) for b in aloader.DataLoader(dataset, batch_size=3, num_workers=2,
                                                      timeout=60) for i in b[0]]
    finally:
        stop.set()
        thread.join()
    assert got == list(range(12))
    assert any("cannot be pickled" in r.getMessage() and "forking" in r.getMessage()
               for r in caplog.records)


class LockedAndFailing(Locked):
    def __getitem__(self, index: int) -> list[int]:
        if index == 5:
            raise KeyError("sample 5 is missing")
        return super().__getitem__(index)


def test_an_error_in_a_forked_worker_keeps_its_type_and_place() -> None:
    got: list[list[int]] = []
    with pytest.raises(KeyError, match="sample 5 is missing") as ours:
        for batch in aloader.DataLoader(LockedAndFailing(10), batch_size=2, num_workers=2):
            got.append([int(i) for i in batch[0]])
    assert "in DataLoader worker process 0" in str(ours.value)
    assert got == [[0, 1], [2, 3]]  # batch 2 (worker 0's second) failed, in its turn


class LockedStream(tud.IterableDataset):  # type: ignore[misc]
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        with self.lock:
            return iter(range(info.id, 12, info.num_workers))


def test_an_iterable_dataset_holding_a_lock_like_torch() -> None:
    def run(loader_type: Any) -> list[list[int]]:
        return [b.tolist() for b in loader_type(LockedStream(), batch_size=2, num_workers=2)]

    assert run(aloader.DataLoader) == run(tud.DataLoader)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_an_explicit_start_method_still_pickles_and_says_why(context: str) -> None:
    with pytest.raises(TypeError, match="cannot pickle") as info:
        list(aloader.DataLoader(Locked(4), batch_size=2, num_workers=1,
                                multiprocessing_context=context))
    assert any("multiprocessing_context='fork'" in note for note in info.value.__notes__)


# A worker_init_fn failing in one worker: torch raises at that worker's first batch ------------
@pytest.fixture
def quick_torch_shutdown(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch's loader, stopped by an error mid-epoch, waits for each worker that does not exit
    up to ``MP_STATUS_CHECK_INTERVAL`` (5 s), and its workers poll at that interval: shortened
    for the comparisons below (15 s a test otherwise), which change nothing of what torch
    answers. The test's loaders are collected before the interval is put back."""
    import torch.utils.data._utils as torch_utils
    import torch.utils.data._utils.worker as torch_worker

    monkeypatch.setattr(torch_utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    monkeypatch.setattr(torch_worker, "MP_STATUS_CHECK_INTERVAL", 0.2)
    yield
    gc.collect()


def fail_in_worker_1(worker_id: int) -> None:
    if worker_id == 1:
        raise ValueError("init of worker 1 failed")


class SlowFirst(tud.Dataset):  # type: ignore[misc]
    """Batch 0 is slow to make, so that worker 1's failure is known well before it."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        if index == 0:
            import time

            time.sleep(0.5)
        return index


def until_error(loader_type: Any, dataset: Any) -> tuple[list[list[int]], str]:
    got: list[list[int]] = []
    with pytest.raises(ValueError) as caught:
        for batch in loader_type(dataset, batch_size=2, num_workers=3,
                                 worker_init_fn=fail_in_worker_1):
            got.append(batch.tolist())
    return got, str(caught.value).splitlines()[0]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("run", range(12))
@pytest.mark.usefixtures("quick_torch_shutdown")
def test_a_failed_worker_init_raises_after_the_batches_before_it(run: int) -> None:
    expected = ([[0, 1]], "Caught ValueError in DataLoader worker process 1.")
    assert until_error(aloader.DataLoader, list(range(12))) == expected
    if run == 0:
        assert until_error(tud.DataLoader, list(range(12))) == expected
        assert until_error(aloader.DataLoader, SlowFirst()) == expected


class Replicas(tud.IterableDataset):  # type: ignore[misc]
    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        return iter(range(info.id, 12, info.num_workers))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.usefixtures("quick_torch_shutdown")
def test_a_failed_worker_init_of_an_iterable_dataset_like_torch() -> None:
    assert until_error(aloader.DataLoader, Replicas()) == until_error(tud.DataLoader, Replicas())


@pytest.mark.usefixtures("quick_torch_shutdown")
def test_a_failed_worker_that_gets_no_batch_fails_nothing_like_torch() -> None:
    def run(loader_type: Any) -> list[list[int]]:
        return [b.tolist() for b in loader_type(list(range(2)), batch_size=2, num_workers=2,
                                                worker_init_fn=fail_in_worker_1)]

    assert run(aloader.DataLoader) == run(tud.DataLoader) == [[0, 1]]


class StopsAtSix(tud.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> int:
        if index == 6:
            raise StopIteration
        return index


async def test_stop_iteration_in_a_worker_reads_as_without_workers(anyio_backend: str) -> None:
    async def run(workers: int) -> tuple[list[list[int]], str, Any]:
        got: list[list[int]] = []
        with pytest.raises(RuntimeError) as caught:
            async for batch in aloader.DataLoader(StopsAtSix(), batch_size=2,
                                                  num_workers=workers):
                got.append(batch.tolist())
        return got, str(caught.value), type(caught.value.__cause__)

    with anyio.fail_after(60):
        alone = await run(0)
        assert alone == ([[0, 1], [2, 3], [4, 5]],
                         "the dataset raised StopIteration while loading a batch", StopIteration)
        assert await run(2) == alone


_SCRIPT = '''\
import {module} as data


class Data(data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        if index == 2:
            raise ValueError("bad sample 2")
        return index


for batch in data.DataLoader(Data(), batch_size=2, num_workers=2):
    pass
'''


def test_a_worker_traceback_names_the_scripts_file_and_line_like_torch(tmp_path: Path) -> None:
    """A class of the user's script reaches aloader's workers by value (cloudpickle), which
    renames its code's file ``<dynamic-code>``: the traceback must still show the file, the
    line and its source, as torch's forked workers' does."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    frames = {}
    for module in ("aloader", "torch.utils.data"):
        script = tmp_path / "train.py"
        script.write_text(_SCRIPT.format(module=module))
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                                timeout=120, cwd=tmp_path,
                                env=dict(os.environ, PYTHONPATH=str(root)))
        assert result.returncode != 0
        assert "<dynamic-code>" not in result.stderr
        lines = result.stderr.splitlines()
        at = lines.index(f'  File "{script}", line 10, in __getitem__')
        frames[module] = lines[at:at + 2]
    assert frames["aloader"] == frames["torch.utils.data"]
    assert frames["aloader"][1].strip() == 'raise ValueError("bad sample 2")'
