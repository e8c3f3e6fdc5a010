"""The start method of a loader's worker processes: ``multiprocessing_context`` checked as
torch checks it, the default context, and a head start for its server.

By default workers are forks of a template of the loader's process, forked when the first
loader with workers is built (see :mod:`aloader.workers._spawn`; ``spawn`` where there is no
fork server).

Invariant: preparing a context is only ever a head start (a fork, or a process launch, never a
wait): if no server can start, the first epoch says why.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
from typing import Any

from . import _spawn

__all__ = ("default_context", "prepare_context", "resolve_context")


def resolve_context(context: Any) -> multiprocessing.context.BaseContext:
    """Validate a ``multiprocessing_context`` argument (torch's checks and messages).

    Raises:
        ValueError: a string that names no start method of this platform.
        TypeError: neither a string nor a multiprocessing context.
    """
    if isinstance(context, str):
        methods = multiprocessing.get_all_start_methods()
        if context not in methods:
            raise ValueError(
                "multiprocessing_context option should specify a valid start method in "
                f"{methods!r}, but got multiprocessing_context={context!r}"
            )
        context = multiprocessing.get_context(context)
    if not isinstance(context, multiprocessing.context.BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string "
            f"specifying the start method, but got multiprocessing_context={context}"
        )
    return context


def default_context() -> multiprocessing.context.BaseContext:
    """Forks of the template (:mod:`aloader.workers._spawn`) where the platform has a fork server,
    else spawn: both safe with threads."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        return _spawn.CONTEXT
    return multiprocessing.get_context("spawn")


def prepare_context(context: multiprocessing.context.BaseContext, *, warm: bool) -> None:
    """Get the server of ``context`` ready for the first epoch.

    The default context forks its template now if this process may fork (only its main thread
    runs: a loader being built, an epoch starting); when ``warm`` and it may not, it starts the
    exec'd fork server instead. An explicit ``forkserver`` context gets numpy and aloader added
    to its preloaded modules (``numpy.random`` too, which every worker seeds: importing it
    costs a worker 20 ms), which only applies before the server starts, and is started when
    ``warm``. Starting is a head start (a fork, or a process launch, not a wait); it is never
    done while this process imports ``__main__`` for ``spawn``, and only warms in a program's
    main process.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    if isinstance(context, _spawn.Context):
        # Only a head start: if no server can start, the first epoch says why.
        with contextlib.suppress(Exception):
            _spawn.prepare(warm=warm and multiprocessing.parent_process() is None)
        return
    if context.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    server: Any = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is not None:
        return
    modules = list(getattr(server, "_preload_modules", None) or [])
    wanted = [name for name in ("numpy", "numpy.random", "aloader") if name not in modules]
    if wanted:
        forkserver.set_forkserver_preload(modules + wanted)
    if warm and multiprocessing.parent_process() is None:
        # Only a head start: if the server cannot start, the first epoch says why.
        with contextlib.suppress(Exception):
            forkserver.ensure_running()
