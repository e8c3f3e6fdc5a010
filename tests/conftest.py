"""Fixtures every test module may use: the anyio backends, and the tests' HTTP server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from faulty_server import FaultyServer


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
