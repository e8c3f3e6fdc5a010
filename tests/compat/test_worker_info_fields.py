"""Change only the import: ``get_worker_info()`` has every field torch's has.

torch's ``WorkerInfo`` gained ``rng`` (None in process workers) and ``worker_method``
("multiprocessing"); a script that reads them must get torch's values from aloader's workers,
not an AttributeError.
"""

from __future__ import annotations

from typing import Any

import pytest

import aloader

torch = pytest.importorskip("torch")
tud = torch.utils.data

FIELDS = ("rng", "worker_method")


class Reads(tud.Dataset):  # type: ignore[misc]
    def __init__(self, which: str) -> None:
        self.which = which

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> Any:
        info = (aloader.get_worker_info() if self.which == "aloader" else tud.get_worker_info())
        return [repr(getattr(info, name, "absent")) for name in FIELDS]


def _fields(loader_type: Any, which: str) -> Any:
    loader = loader_type(Reads(which), batch_size=None, num_workers=1)
    return list(loader)


def test_worker_info_fields_are_torchs() -> None:
    theirs = _fields(tud.DataLoader, "torch")
    if "'absent'" in theirs[0]:
        pytest.skip("this torch's WorkerInfo has no rng / worker_method")
    assert _fields(aloader.DataLoader, "aloader") == theirs
    # torch's own get_worker_info() answers in aloader's workers with the same fields.
    assert _fields(aloader.DataLoader, "torch") == theirs


def test_worker_info_fields_are_read_only() -> None:
    info = aloader.WorkerInfo(id=0, num_workers=1, seed=3, dataset=None)
    assert (info.rng, info.worker_method) == (None, "multiprocessing")
    with pytest.raises(RuntimeError, match="Cannot assign attributes to WorkerInfo objects"):
        info.worker_method = "thread"  # type: ignore[misc]
