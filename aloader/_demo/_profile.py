"""``python -m aloader profile module:factory``: one epoch of your loader, where its time goes.

Owns the profile command: it imports ``module`` (a dotted name importable from the current
directory, or a ``path/to/file.py``), calls ``factory()`` (a function returning a
:class:`~aloader.DataLoader`), runs one epoch with a live progress line, and prints the
per-stage table and the bottleneck verdict of :meth:`DataLoader.stats`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import anyio

from .. import DataLoader
from ._progress import Progress

__all__ = ("TargetError", "load_factory", "main")


class TargetError(ValueError):
    """A ``module:factory`` that names no function: said in one line, without a traceback
    (an error raised by the module's own code keeps its traceback)."""


def _module(name: str) -> ModuleType:
    if name.endswith(".py") or "/" in name:
        path = Path(name).resolve()
        if not path.is_file():
            raise TargetError(f"no file {name}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise TargetError(f"cannot import {name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module  # by name, so workers can pickle its classes
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path:
        sys.path.insert(0, "")  # the current directory, as `python -m` has it
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
            raise  # a module that the target imports is missing: its traceback tells
        raise TargetError(f"no module named {name!r} (from the current directory "
                          f"{Path.cwd()}; a file is named path/to/file.py)") from None


def load_factory(target: str) -> Any:
    """The factory named ``module:function`` (or ``path/file.py:function``).

    Raises:
        TargetError: ``target`` has no ``:``, names no module, no function in it, or
            something that is not callable.
    """
    module_name, colon, attr = target.rpartition(":")
    if not colon or not module_name or not attr:
        raise TargetError(f"expected module:factory (a function returning a DataLoader), "
                          f"but got {target!r}")
    module = _module(module_name)
    factory = getattr(module, attr, None)
    if factory is None:
        names = [n for n in vars(module) if callable(vars(module)[n]) and not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TargetError(f"no function {attr!r} in {module_name}{hint}")
    if not callable(factory):
        raise TargetError(f"{target} is not callable")
    return factory


def main(target: str, out: TextIO | None = None, batches: int | None = None,
         trace: str | None = None) -> int:
    """Profile one epoch of the loader ``target`` builds; returns the exit status.

    Args:
        target: ``module:factory``.
        out: where to print (default: standard output).
        batches: stop after this many batches (default: the whole epoch).
        trace: also write the epoch's timings there as a Chrome trace
            (:meth:`DataLoader.trace`).
    """
    out = out or sys.stdout
    try:
        factory = load_factory(target)
    except TargetError as exc:
        print(f"aloader profile: {exc}", file=sys.stderr)
        return 2
    loader = factory()
    if not isinstance(loader, DataLoader):
        out.write(f"{target} returned {type(loader).__name__}, not an aloader.DataLoader\n")
        return 2
    try:
        total: int | None = len(loader)
    except TypeError:
        total = None
    if batches is not None:
        total = batches if total is None else min(total, batches)
    out.write(f"Profiling one epoch of {target}: {loader!r}\n")
    progress = Progress(out, None, total)

    async def epoch() -> int:
        # `async for`, not the `for` facade, which reads ahead of its consumer: the
        # statistics count exactly the batches asked for.
        count = 0
        iterator = loader.__aiter__()
        try:
            async for _ in iterator:
                count += 1
                stats = iterator._stats  # the live collector: no snapshot per batch
                progress.update(count, stats.items_so_far() if stats is not None else 0)
                if batches is not None and count >= batches:
                    break
        finally:
            await iterator.aclose()
            await loader.aclose()
        return count

    if trace is not None:
        with loader.trace(trace):
            count = anyio.run(epoch)
    else:
        count = anyio.run(epoch)
    snapshot = loader.stats()
    progress.finish(count, snapshot.items)
    out.write("\n" + snapshot.table() + "\n")
    if trace is not None:
        out.write(f"trace: {trace} (open it in https://ui.perfetto.dev or chrome://tracing)\n")
    return 0
