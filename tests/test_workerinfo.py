"""What a worker knows about itself (aloader._workerinfo): read-only, None outside workers."""

from __future__ import annotations

import pytest

import aloader
from aloader import _workerinfo
from aloader._workerinfo import WorkerInfo, get_worker_info, served_epoch


def test_outside_workers_there_is_no_worker_info() -> None:
    assert get_worker_info() is None
    assert served_epoch() is None
    assert aloader.get_worker_info is get_worker_info


def test_worker_info_is_read_only_and_reports_the_served_epoch() -> None:
    info = WorkerInfo(id=1, num_workers=2, seed=7, dataset=None)
    with pytest.raises(RuntimeError, match="Cannot assign attributes to WorkerInfo objects"):
        info.id = 3
    assert repr(info) == "WorkerInfo(id=1, num_workers=2, seed=7, dataset=None)"
    assert info.epoch == 0
    _workerinfo._set_served_epoch(4)
    try:
        assert info.epoch == 4
        assert served_epoch() == 4
    finally:
        _workerinfo._set_served_epoch(None)


def test_sources_do_not_import_the_worker_server() -> None:
    import ast
    from pathlib import Path

    package = Path(aloader.__file__).parent
    for path in sorted([*(package / "streams").glob("*.py"), *(package / "sources").glob("*.py")]):
        name = str(path.relative_to(package))
        tree = ast.parse(path.read_text())
        modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "_worker" not in modules, name


def test_torch_get_worker_info_follows_aloaders_and_is_cleared_with_it() -> None:
    """torch's own get_worker_info() answers what aloader's does in a worker (a torch
    script's stream shards itself with it), and is None again once aloader's is: a worker
    simulated in this process (as the source tests do) must not leave torch believing it
    runs in a worker (webdataset, for one, would then split its shards)."""
    tud = pytest.importorskip("torch.utils.data")
    dataset = object()
    assert tud.get_worker_info() is None
    _workerinfo._set_worker_info(WorkerInfo(id=1, num_workers=3, seed=9, dataset=dataset))
    try:
        theirs = tud.get_worker_info()
        assert (theirs.id, theirs.num_workers, theirs.seed) == (1, 3, 9)
        assert theirs.dataset is dataset
    finally:
        _workerinfo._set_worker_info(None)
    assert tud.get_worker_info() is None
