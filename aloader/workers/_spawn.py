"""How the default context starts workers: forks of a template of the loader's process.

Invariant: a worker started through :data:`CONTEXT` never runs the user's main module (no
``__mp_main__``, no script re-run, no ``if __name__ == "__main__":`` needed); what it needs
that is not importable by name arrives by value (the pool pickles its setup with cloudpickle).

The template is a fork of the user's process, made when the first loader with workers is built
while no other thread can hold a lock (a fork copies only the forking thread, so a lock held by
another stays held in the child): only the main thread runs, or the others are aloader's own
private loops, held between two callbacks for the fork, and their idle worker threads
(:func:`aloader._facade.parked`). It is shared by every later loader of the process, and runs
the standard library's fork server loop (:func:`multiprocessing.forkserver.main`) without
preloading anything, and each worker is a fork of it: the modules the user's process had
imported by then (numpy, aloader, torch, the user's own) are already there, so a worker starts
without importing. Before serving, the template lets go of what the fork copied that belongs to
the user's process (see :func:`_become_template`): file descriptors, the running asyncio or
trio loop and context variables (a loader is often built inside ``async def main()``), signal
handlers. It exits once the user's process and all its workers have (the fork server's "alive"
pipe).

When the template cannot be forked (other threads run: the user's, a busy fetch's), the workers
come from the standard fork server instead, exec'd with numpy and aloader preloaded and not
``__main__``. Either way a worker is launched by :class:`_Popen`, the fork server's Popen minus
the instruction to import the main module (``init_main_from_path`` / ``init_main_from_name``)
that multiprocessing's own ``forkserver`` and ``spawn`` follow to re-run the script as
``__mp_main__``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import io
import multiprocessing.context
import os
import signal
import socket
import stat
import sys
import threading
import traceback
from collections.abc import Iterator
from multiprocessing import connection, forkserver, popen_forkserver, resource_tracker, spawn, util
from typing import Any, NoReturn

__all__ = ("CONTEXT", "Context", "prepare", "reruns_main")

# What spawn.prepare() would follow to import the user's main module in the child.
_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")


# Linux only: elsewhere (macOS) system frameworks are not safe to use after a fork.
_TEMPLATES = sys.platform.startswith("linux")


def may_fork(quiet: frozenset[threading.Thread] = frozenset()) -> bool:
    """Whether this process may fork its template now: only its main thread runs Python,
    apart from ``quiet`` threads, which hold no lock (:func:`aloader._facade.parked`), and
    obstore's runtime has not started: its threads are not Python's and do not survive a fork
    (:mod:`aloader.io._objstore`), and every later worker would come from that template."""
    main = threading.main_thread()
    objstore: Any = sys.modules.get("aloader.io._objstore")
    return (threading.current_thread() is main
            and all(thread is main or thread in quiet for thread in threading.enumerate())
            and _TEMPLATES and not (objstore is not None and objstore.runtime_started()))


def may_fork_workers() -> bool:
    """Whether a pool whose setup cannot be pickled may fork its workers from this process
    instead, as torch's default start method does whatever threads run (Linux only, as the
    template). Also once obstore's runtime has started: a forked worker that then reads an
    object store gets a :class:`~aloader.FetchError` saying why, never a hang, and one that
    does not (most such datasets) runs as under torch."""
    return _TEMPLATES


@contextlib.contextmanager
def _quiet() -> Iterator[frozenset[threading.Thread] | None]:
    """The threads that hold no lock for the block: aloader's own private loops, held, with
    their idle worker threads (a script that iterated a ``num_workers=0`` loader before
    building one with workers has them); none to hold when only this thread runs."""
    if threading.active_count() == 1 or threading.current_thread() is not threading.main_thread():
        yield frozenset()
        return
    from .. import _facade  # not at import: _facade imports anyio, workers need not

    with _facade.parked() as quiet:
        yield quiet


class _Server(forkserver.ForkServer):
    """The fork server of :data:`CONTEXT`: the template when it could be forked, else exec'd."""

    _forkserver_address: Any
    _forkserver_alive_fd: Any
    _forkserver_pid: Any

    def __init__(self) -> None:
        super().__init__()
        # Only for the exec'd server: never "__main__", which would run the user's script.
        self._preload_modules = ["numpy", "numpy.random", "cloudpickle", "aloader"]
        self.template = False  # whether the running server is the template
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """A forked child (a worker, the template, the user's own fork) runs no server; its
        copy of the alive pipe would keep the server up after the user's process exits."""
        fd = self._forkserver_alive_fd
        self._forkserver_address = self._forkserver_alive_fd = self._forkserver_pid = None
        self.template = False
        self._lock = threading.Lock()
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _running(self) -> bool:
        """Whether the server started here still runs (called with the lock held)."""
        pid = self._forkserver_pid
        if pid is None:
            return False
        try:
            done = os.waitpid(pid, os.WNOHANG)[0]
        except ChildProcessError:  # reaped by someone else's wait()
            done = pid
        if not done:
            return True
        os.close(self._forkserver_alive_fd)
        self._forkserver_address = self._forkserver_alive_fd = self._forkserver_pid = None
        self.template = False
        return False

    def start(self, *, fork: bool, exec_server: bool) -> None:
        """Have a server running: fork the template if ``fork`` and this process may fork now,
        else start the exec'd server if ``exec_server``."""
        with self._lock:
            if self._running():
                return
            if fork and _TEMPLATES:
                import cloudpickle  # noqa: F401  (every setup unpickles with it: once, here)

                # No collection while loops are held: a finalizer closing one would wait for it.
                collects = gc.isenabled()
                gc.disable()
                try:
                    with _quiet() as quiet:
                        if quiet is not None and may_fork(quiet):
                            self._fork_template(collects)
                            return
                finally:
                    if collects:
                        gc.enable()
        if exec_server:
            if "torch" in sys.modules and "torch" not in self._preload_modules:
                # Imported once by the server rather than by every worker (seconds each).
                self._preload_modules = [*self._preload_modules, "torch"]
            super().ensure_running()

    def ensure_running(self) -> None:
        """Called by each worker launch (from a thread): the exec'd server if none runs."""
        self.start(fork=False, exec_server=True)

    def connect_to_new_process(self, fds: Any) -> tuple[int, int]:
        """The standard request for a new worker, without starting a resource tracker for
        the template's workers: launching one is an interpreter start competing with the
        first batch, and aloader's segments need none. The worker gets a placeholder instead,
        and starts its own tracker if user code ever needs one (:func:`forget_placeholder`),
        as a worker forked by torch would."""
        self.ensure_running()
        if len(fds) + 4 >= forkserver.MAXFDS_TO_SEND:
            raise ValueError("too many fds")
        tracker: Any = resource_tracker._resource_tracker
        placeholder = None
        if self.template and tracker._fd is None:
            placeholder = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(self._forkserver_address)
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            allfds = [child_r, child_w, self._forkserver_alive_fd,
                      placeholder if placeholder is not None else resource_tracker.getfd()]
            allfds += fds
            try:
                multiprocessing.context.reduction.sendfds(client, allfds)  # type: ignore[attr-defined]
                return parent_r, parent_w
            except BaseException:
                os.close(parent_r)
                os.close(parent_w)
                raise
            finally:
                os.close(child_r)
                os.close(child_w)
                if placeholder is not None:
                    os.close(placeholder)

    def _fork_template(self, collects: bool) -> None:
        util._flush_std_streams()  # type: ignore[attr-defined]  # or the workers write it again
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            try:
                pid = os.fork()
            except BaseException:
                os.close(alive_r)
                os.close(alive_w)
                raise
            if pid == 0:
                if collects:
                    gc.enable()  # disabled by start() around the fork only
                _serve_as_template(listener.fileno(), alive_r, alive_w)
            os.close(alive_r)
        self._forkserver_address = address
        self._forkserver_alive_fd = alive_w
        self._forkserver_pid = pid
        self.template = True


def _serve_as_template(listener: int, alive_r: int, alive_w: int) -> NoReturn:
    """The template's life: forget the user's process, then fork workers until told to stop."""
    code = 0
    try:
        os.close(alive_w)  # only the user's process and the workers hold it
        _become_template(keep={listener, alive_r})
        # A fresh context: no context variable of the task that built the loader (sniffio's
        # "current async library", anyio's, the user's) reaches the workers.
        contextvars.Context().run(forkserver.main, listener, alive_r, [])
    except SystemExit:  # the alive pipe closed: the user's process and its workers are gone
        pass
    except BaseException:
        code = 1
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        os._exit(code)  # never the user's atexit handlers, finalizers or buffered output


def _become_template(keep: set[int]) -> None:
    """Drop what the fork copied from the user's process that a worker must not inherit."""
    # Event loops: the loader may have been built in a coroutine; workers run their own loops.
    asyncio.events._set_running_loop(None)
    policy: Any = asyncio.events._event_loop_policy  # type: ignore[attr-defined]
    if policy is not None and hasattr(policy, "_Local"):
        policy._local = policy._Local()  # no "current event loop" either
    trio = sys.modules.get("trio")
    if trio is not None:
        with contextlib.suppress(AttributeError):
            vars(trio._core._run.GLOBAL_RUN_CONTEXT).clear()  # no current trio run or task
    sniffio = sys.modules.get("sniffio")
    if sniffio is not None:
        with contextlib.suppress(AttributeError):
            sniffio.thread_local.name = None
    # Python-level signal handlers belong to the user's program (a SIGTERM handler that saves
    # a checkpoint must not run in a worker); the fork server sets SIGINT and SIGCHLD itself.
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if callable(signal.getsignal(signum)) and signum != signal.SIGINT:
                signal.signal(signum, signal.SIG_DFL)
    # File descriptors: a pipe, socket or device held here would stay open as long as the
    # process lives (a subprocess's stdin would never see EOF). Each is replaced by /dev/null
    # rather than closed, so that a Python object still owning the number (a socket, a
    # selector) closes only that if it is ever collected, never a descriptor reusing the
    # number. The standard streams stay (workers print, as torch's do), and so do regular
    # files (log files, as under torch's fork).
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd < 3 or fd in keep or fd == devnull:
            continue
        try:
            mode = os.fstat(fd).st_mode
        except OSError:  # not open (the listing's own descriptor)
            continue
        if not stat.S_ISREG(mode):
            os.dup2(devnull, fd, inheritable=False)
    os.close(devnull)
    # What the user's process held is never collected here: freezing it keeps the workers'
    # collections from touching (and so copying) those pages.
    gc.freeze()


class _Popen(popen_forkserver.Popen):
    """The fork server's Popen, using :data:`SERVER` and never importing ``__main__``."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        for key in _MAIN_KEYS:
            prep_data.pop(key, None)
        buf = io.BytesIO()
        multiprocessing.context.set_spawning_popen(self)
        try:
            multiprocessing.context.reduction.dump(prep_data, buf)  # type: ignore[attr-defined]
            multiprocessing.context.reduction.dump(process_obj, buf)  # type: ignore[attr-defined]
        finally:
            multiprocessing.context.set_spawning_popen(None)
        self.sentinel, w = SERVER.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        # As the standard Popen: a duplicate of the data pipe's write end is the child's
        # sentinel of this process.
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds,  # type: ignore[attr-defined]
                                       (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _Process(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _Popen(process_obj)


class Context(multiprocessing.context.ForkServerContext):
    """The default context of workers: the fork server's, started as the module says."""

    Process = _Process


SERVER = _Server()
CONTEXT = Context()


def prepare(*, warm: bool) -> None:
    """Fork the template if this process may fork now and none runs; when ``warm`` and it may
    not, start the exec'd server instead (a head start for the first epoch)."""
    SERVER.start(fork=True, exec_server=warm)


def forget_placeholder() -> None:
    """In a worker: drop the placeholder given for a resource tracker (see
    :meth:`_Server.connect_to_new_process`), so that one starts if it is ever needed."""
    tracker: Any = resource_tracker._resource_tracker
    fd = tracker._fd
    if fd is None:
        return
    try:
        placeholder = os.path.samestat(os.fstat(fd), os.stat(os.devnull))
    except OSError:
        return
    if placeholder:
        os.close(fd)
        tracker._fd = None
        tracker._pid = None


def reruns_main(context: multiprocessing.context.BaseContext) -> bool:
    """Whether workers of ``context`` import the user's main module (``spawn`` and
    ``forkserver`` given explicitly keep the standard library's behaviour)."""
    return not isinstance(context, Context) and context.get_start_method() in ("spawn",
                                                                               "forkserver")
