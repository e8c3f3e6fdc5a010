"""The HTTP JSON Lines fast path: what its shortcuts must keep.

A shard's chunks are decoded where its blocks are consumed, not in the read-ahead (which holds
bytes); aiohttp's ``trust_env`` (a thread hop per request) is on only when the environment
sets a proxy or has a ``.netrc`` file, and proxies and ``.netrc`` credentials still apply
when it does.
"""

from __future__ import annotations

import base64
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import collect, decoded_ahead

from aloader import JsonLines
from aloader._demo import ShardServer
from aloader._demo._server import ShardHandler
from aloader.io._http import HttpOptions, make_client

pytestmark = pytest.mark.anyio

_PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "ws_proxy",
                    "wss_proxy", "ftp_proxy")


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """An environment with no proxy variable and no .netrc file."""
    for key in list(os.environ):
        if key.lower() in _PROXY_VARIABLES or key.lower().endswith("_proxy"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-such-netrc"))
    return monkeypatch


# --------------------------------------------------------------------------- decoding


async def test_read_ahead_holds_bytes_not_records(serve: Callable[..., FaultyServer],
                                                  anyio_backend: str) -> None:
    """With 4 shards read ahead, only the blocks the consumer's stream prefetches (a few
    chunks) are decoded, not every chunk waiting in the read-ahead."""
    files = make_jsonl_shards(4, 100)
    server = serve(files)
    chunk_size = 1000
    shortest = min(len(line) + 1 for body in files.values() for line in body.split(b"\n")
                   if line)
    per_chunk = chunk_size // shortest + 1
    source = JsonLines(server.urls, concurrency=4, chunk_size=chunk_size)
    decoded, ids = await decoded_ahead(source, server, 4)
    # The stream prefetches 2 blocks, holds 1 while it waits to hand it over, and the
    # consumer has 1: a block per chunk.
    assert decoded <= 5 * per_chunk
    assert ids == list(range(400))
    assert source.stats.records == 400 and source.stats.shards == 4


async def test_errors_keep_their_place_and_location(serve: Callable[..., FaultyServer],
                                                    anyio_backend: str) -> None:
    """A malformed line in a shard read ahead is raised after the records before it, with
    its shard, line and byte offset; skipped, it is counted and the rest is read."""
    files = make_jsonl_shards(3, 50)
    name = sorted(files)[1]
    lines = files[name].split(b"\n")
    offset = sum(len(line) + 1 for line in lines[:7])
    lines[7] = b'{"id": oops}'
    files[name] = b"\n".join(lines)
    server = serve(files)
    seen: list[int] = []
    with pytest.raises(Exception, match=rf"{name}: line 8 \(byte offset {offset}\)") as info:
        async for record in JsonLines(server.urls, concurrency=3, chunk_size=256):
            seen.append(record["id"])
    assert getattr(info.value, "line", None) == 8 and info.value.offset == offset  # type: ignore[attr-defined]
    assert seen == list(range(57))
    source = JsonLines(server.urls, concurrency=3, chunk_size=256, skip_errors=True)
    records = await collect(source)
    assert [r["id"] for r in records] == [i for i in range(150) if i != 57]
    assert source.stats.skipped == 1 and source.stats.skipped_errors[0].line == 8


# --------------------------------------------------------------------------- environment


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # aiohttp runs on asyncio only
async def test_no_trust_env_without_proxies_or_netrc(bare_env: pytest.MonkeyPatch,
                                                     anyio_backend: str) -> None:
    """aiohttp's trust_env looks proxies and .netrc up in a thread at every request: off
    when the environment has neither."""
    pytest.importorskip("aiohttp")
    client: Any = make_client(HttpOptions(), 1)
    try:
        assert client.session.trust_env is False
    finally:
        await client.aclose()
    bare_env.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    client = make_client(HttpOptions(), 1)
    try:
        assert client.session.trust_env is True
    finally:
        await client.aclose()


async def test_proxy_from_the_environment(bare_env: pytest.MonkeyPatch,
                                          anyio_backend: str) -> None:
    """HTTP_PROXY sends the requests to the proxy (here a server that answers for the
    absolute URLs), on both clients."""
    files = make_jsonl_shards(3, 40)
    urls = [f"http://shards.invalid/{name}" for name in sorted(files)]
    proxy = ShardServer({url: files[url.rsplit("/", 1)[1]] for url in urls}).start()
    try:
        bare_env.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        records = await collect(JsonLines(urls, concurrency=2))
    finally:
        proxy.close()
    assert [r["id"] for r in records] == list(range(120))
    assert sorted(name for name, _ in proxy.requests) == urls


class _AuthServer(FaultyServer):
    """Records the Authorization header of every request."""

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(files)
        self.authorizations: list[str | None] = []

    def respond(self, handler: ShardHandler, name: str, range_header: str | None) -> None:
        self.authorizations.append(handler.headers.get("Authorization"))
        super().respond(handler, name, range_header)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # httpx does not read .netrc itself
async def test_netrc_credentials_on_aiohttp(bare_env: pytest.MonkeyPatch, tmp_path: Path,
                                            anyio_backend: str) -> None:
    """A .netrc entry for the host still gives aiohttp's requests their credentials."""
    pytest.importorskip("aiohttp")
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login reader password secret\n")
    netrc.chmod(0o600)
    bare_env.setenv("NETRC", str(netrc))
    server = _AuthServer(make_jsonl_shards(2, 10)).start()
    try:
        records = await collect(JsonLines(server.urls, concurrency=2))
    finally:
        server.close()
    assert len(records) == 20
    expected = "Basic " + base64.b64encode(b"reader:secret").decode()
    assert server.authorizations == [expected, expected]


async def test_one_aiohttp_session_per_epoch(serve: Callable[..., FaultyServer],
                                             monkeypatch: pytest.MonkeyPatch,
                                             anyio_backend: str) -> None:
    """On aiohttp the shards read at once share one client of ``concurrency`` connections;
    httpx keeps one single-connection client per read-ahead slot. Either way no more
    connections are open than shards read at once, and every record arrives once."""
    import aloader.sources._clients as sources

    made: list[int] = []
    real = sources.make_client

    def counting(options: HttpOptions, connections: int, env: bool | None = None) -> Any:
        made.append(connections)
        return real(options, connections, env)

    monkeypatch.setattr(sources, "make_client", counting)
    server = serve(make_jsonl_shards(8, 30))
    records = await collect(JsonLines(server.urls, concurrency=4))
    assert [r["id"] for r in records] == list(range(240))
    aiohttp = anyio_backend == "asyncio" and importlib.util.find_spec("aiohttp") is not None
    assert made == ([4] if aiohttp else [1, 1, 1, 1])
    assert server.max_open_connections <= 4
