"""Fixtures every test module may use: the anyio backends, the tests' HTTP server, and the
closing of loaders that only reference cycles still hold; and the process as a terminal starts
it (every test folder importable, Ctrl-C raising KeyboardInterrupt)."""

from __future__ import annotations

import gc
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Tests live in one folder per wing, and a few share helpers across folders (test_failures'
# datasets, test_tar's builders): every folder is importable by its files' basenames, which
# stay unique, whatever order pytest collects them in.
_HERE = Path(__file__).resolve().parent
sys.path[1:1] = [str(d) for d in sorted(_HERE.iterdir()) if d.is_dir() and d.name.isidentifier()]

# A suite started as a background job of a non-interactive shell (`pytest &`) inherits SIGINT
# ignored, and Python then installs no KeyboardInterrupt handler: the tests of what Ctrl-C
# does need the handler that Python installs when it starts from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402
from faulty_server import FaultyServer  # noqa: E402

from aloader import DataLoader  # noqa: E402


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def serve() -> Iterator[Callable[..., FaultyServer]]:
    """Start a :class:`FaultyServer` per call (``serve(files, **kwargs)``); all close after."""
    servers: list[FaultyServer] = []

    def start(files: dict[str, bytes], **kwargs: Any) -> FaultyServer:
        server = FaultyServer(files, **kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def close_stray_loaders() -> Iterator[None]:
    """Close, after the test, every DataLoader that only reference cycles still hold.

    Errors caught by pytest.raises sit in reference cycles with the frames that hold the
    epochs' iterators (and so their loaders' private loops): collect them here, not in
    whichever test runs next and counts loop threads.
    """
    yield
    gc.collect()
    for obj in gc.get_objects():  # a loader still held (by an error's frames) stops now
        if isinstance(obj, DataLoader):
            obj.close()
