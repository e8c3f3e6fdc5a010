"""Change only the import: differences from torch across the package.

Each is a strict xfail naming the file where the fix belongs; the lead flips them when fixed.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest

import aloader

torch = pytest.importorskip("torch")
tud = torch.utils.data


class StopsAtSix(tud.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> int:
        if index == 6:
            raise StopIteration
        return index


def _error(num_workers: int) -> tuple[list[list[int]], str, str]:
    got: list[list[int]] = []
    with pytest.raises(RuntimeError) as caught:
        for batch in aloader.DataLoader(StopsAtSix(), batch_size=2, num_workers=num_workers):
            got.append(batch.tolist())
    return got, type(caught.value).__name__, str(caught.value).splitlines()[0]


def test_stop_iteration_in_getitem_reads_the_same_with_workers() -> None:
    # torch ends the epoch silently (batches 3-4 lost); aloader raises. Workers or not, the
    # same error should say so.
    alone = _error(0)
    assert alone[2] == "the dataset raised StopIteration while loading a batch"
    assert _error(1) == alone


class Claims4(tud.IterableDataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 4

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        return iter(range(6) if info is None or info.id == 0 else ())


def _length_warnings(loader_type: Any) -> list[str]:
    loader = loader_type(Claims4(), batch_size=None, num_workers=1)
    len(loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(loader)
    return [str(w.message).replace(repr(loader.dataset), "DS") for w in caught
            if "Length of IterableDataset" in str(w.message)]


def test_iterable_length_warning_with_workers_is_torchs() -> None:
    theirs = _length_warnings(tud.DataLoader)
    assert theirs  # torch warns for the 5th and 6th samples
    assert _length_warnings(aloader.DataLoader) == theirs


def _worker_count_warnings(loader_type: Any, workers: int) -> list[int]:
    """The worker-count warnings a user sees (Python's default filter), at the construction
    and after two epochs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        loader = loader_type(list(range(4)), batch_size=2, num_workers=workers)
        built = len(caught)
        list(loader)
        list(loader)
    return [built, len([w for w in caught if "worker processes" in str(w.message)])]


def test_too_many_workers_warns_at_construction_like_torch() -> None:
    """Both warn when the loader is built. torch warns again at the first epoch, from another
    line of its own (the default filter shows both); aloader warns once per loader, at the
    user's line (tests/workers/test_workers.py pins where), again only once ``num_workers``
    changed."""
    import os

    workers = (os.cpu_count() or 1) + 1
    assert _worker_count_warnings(tud.DataLoader, workers) == [1, 2]
    assert _worker_count_warnings(aloader.DataLoader, workers) == [1, 1]


class HoldsALock(tud.Dataset):  # type: ignore[misc]
    def __init__(self) -> None:
        self.lock = threading.Lock()  # an open file, a DB connection: torch's fork copies them

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        with self.lock:
            return index


def test_dataset_holding_an_unpicklable_object_runs_with_workers_like_torch() -> None:
    theirs = [b.tolist() for b in tud.DataLoader(HoldsALock(), batch_size=2, num_workers=1)]
    ours = [b.tolist() for b in aloader.DataLoader(HoldsALock(), batch_size=2, num_workers=1)]
    assert ours == theirs
