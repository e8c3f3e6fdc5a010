"""The exception tree in aloader._exceptions: one root, the documented builtin bases, old homes."""

from __future__ import annotations

import ast
import inspect
import os
import signal
import time
from pathlib import Path

import anyio
import pytest

import aloader
from aloader import _exceptions
from aloader.pipeline._results import Results
from aloader.serve import _batcher
from aloader.streams import _stream

# The tree as _exceptions' docstring draws it: name -> (parent in the tree, builtin base or None).
TREE: dict[str, tuple[str, type[BaseException] | None]] = {
    "LoaderTimeoutError": ("AloaderError", RuntimeError),
    "LoaderClosedError": ("AloaderError", RuntimeError),
    "WorkerError": ("AloaderError", RuntimeError),
    "SampleRngError": ("AloaderError", RuntimeError),
    "FailureBudgetExceeded": ("AloaderError", None),
    "SourceError": ("AloaderError", None),
    "RecordError": ("SourceError", ValueError),
    "FetchError": ("SourceError", OSError),
    "ObjectNotFoundError": ("FetchError", FileNotFoundError),
    "BucketNotFoundError": ("ObjectNotFoundError", FileNotFoundError),
    "AccessDeniedError": ("FetchError", PermissionError),
    "EndpointUnreachableError": ("FetchError", ConnectionError),
    "QueueFullError": ("AloaderError", None),
    "BatcherClosedError": ("AloaderError", None),
    "BatcherTimeoutError": ("AloaderError", TimeoutError),
    "BatchResultError": ("AloaderError", ValueError),
    "BatchCostError": ("AloaderError", RuntimeError),
}

# The classes aloader/_exceptions.py defines, read from its source (their ``__module__`` says
# "aloader", where they are exported).
DEFINED = {node.name for node in ast.parse(Path(_exceptions.__file__).read_text()).body
           if isinstance(node, ast.ClassDef)}

CLOSED = r"^DataLoader iterator was closed$"  # torch's message


def public_exceptions() -> dict[str, type[BaseException]]:
    return {
        name: obj
        for name in aloader.__all__
        if inspect.isclass(obj := getattr(aloader, name)) and issubclass(obj, BaseException)
    }


def test_every_public_exception_is_an_aloader_error_defined_in_one_module() -> None:
    found = public_exceptions()
    assert set(found) == {"AloaderError", *TREE}
    for name, cls in found.items():
        assert issubclass(cls, aloader.AloaderError), name
        assert name in DEFINED, name  # a class statement of aloader/_exceptions.py
        assert cls.__module__ == "aloader", name  # it says it is aloader's (aloader._public)
        assert getattr(_exceptions, name) is cls


@pytest.mark.parametrize("name", sorted(TREE))
def test_documented_bases_hold(name: str) -> None:
    parent, builtin = TREE[name]
    cls = getattr(aloader, name)
    assert issubclass(cls, getattr(aloader, parent))
    if builtin is not None:
        assert issubclass(cls, builtin)  # code written against torch's builtin type still works
    assert f"+-- {name}" in (_exceptions.__doc__ or "")  # drawn in the tree


def test_old_homes_still_export_the_same_classes() -> None:
    for name in ("SourceError", "RecordError", "FetchError"):
        assert getattr(_stream, name) is getattr(aloader, name)
    for name in ("QueueFullError", "BatcherClosedError", "BatcherTimeoutError",
                 "BatchResultError"):
        assert getattr(_batcher, name) is getattr(aloader, name)


def test_source_error_attributes_survive_the_move() -> None:
    error = aloader.FetchError("boom", source="s3://x", offset=7, status_code=503)
    assert (error.source, error.offset, error.line, error.status_code) == ("s3://x", 7, None, 503)
    assert isinstance(error, OSError) and str(error) == "boom"


class Sleepy(aloader.Dataset[int]):
    """Returns the worker's pid, a little slowly (so a worker can be killed mid-epoch)."""

    def __len__(self) -> int:
        return 200

    def __getitem__(self, index: int) -> int:
        time.sleep(0.002)
        return os.getpid()


def test_killed_worker_raises_worker_error_then_loader_closed_error() -> None:
    loader = aloader.DataLoader(Sleepy(), batch_size=4, num_workers=2, timeout=60)
    try:
        iterator = iter(loader)
        victim = int(next(iterator)[0])
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(aloader.WorkerError) as dead:
            for _ in iterator:
                pass
        assert str(dead.value) == (
            f"DataLoader worker (pid {victim}) is killed by signal: Killed. "
        )
        assert isinstance(dead.value, RuntimeError)  # torch raises a RuntimeError
        with pytest.raises(aloader.LoaderClosedError, match=CLOSED):
            next(iterator)  # the failure is reported once; the epoch is over
    finally:
        loader.close()  # its `for` loop thread must not outlive the test
    assert issubclass(aloader.LoaderClosedError, RuntimeError)


async def test_results_report_a_failure_once_then_closed(anyio_backend: str) -> None:
    results = Results(capacity=2, in_order=True)
    results.close(KeyError("boom"))
    with anyio.fail_after(60):
        with pytest.raises(KeyError):
            await results.take()
        for _ in range(2):
            with pytest.raises(aloader.LoaderClosedError, match=CLOSED):
                await results.take()
