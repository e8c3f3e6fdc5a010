"""aloader.io._http: ranged reading, content codings, retries, redirects, against hostile servers.

Coded or truncated HTTP bodies, redirects out of http(s), headers promising more than the body
holds: each must be decoded, resumed or refused with an error naming the URL, never a hang,
unbounded memory, or records silently lost; statuses that are not retried (404), transient ones
retried until the retries run out, refused connections, timeouts, resumption after a cut body
and a resource that changed meanwhile. Most tests read through the public sources; the last
ones call :func:`aloader.io._http.http_chunks` directly."""

from __future__ import annotations

import contextlib
import gzip
import json
import sys
import threading
import types
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from sourcetools import collect, free_port
from test_formats import npy_with_rows  # the same .npy bytes whose header lies

from aloader import (
    FetchError,
    HttpOptions,
    JsonLines,
    NpyRows,
    RecordError,
    SourceStats,
    TextLines,
)
from aloader.io._http import http_chunks, make_client

pytestmark = pytest.mark.anyio

FAST = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}

Route = Callable[["_Handler", int], None]


# --------------------------------------------------------------------------- a scripted server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        app = self.server.app
        path = self.path.lstrip("/")
        with app.lock:
            count = app.counts.get(path, 0)
            app.counts[path] = count + 1
            app.requests.append((path, self.headers.get("Range")))
        route = app.routes.get(path)
        if route is None:
            reply(self, 404)
        else:
            route(self, count)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    app: Scripted

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients hang up on purpose in these tests


class Scripted:
    """A server on 127.0.0.1 whose answer to ``GET /path`` is a function of the request's
    number for that path."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.counts: dict[str, int] = {}
        self.requests: list[tuple[str, str | None]] = []
        self.lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.app = self
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()

    def route(self, path: str, fn: Route) -> str:
        self.routes[path] = fn
        return f"http://127.0.0.1:{self._server.server_address[1]}/{path}"

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join()
        self._server.server_close()


def reply(handler: _Handler, status: int, body: bytes = b"", *,
          headers: dict[str, str] | None = None, length: int | None = -1,
          send: int | None = None) -> None:
    """Answer with ``body``; ``length``: the Content-Length sent (-1: the body's, None: none,
    the body then ends when the connection closes); ``send``: bytes sent before hanging up."""
    handler.send_response(status)
    for key, value in (headers or {}).items():
        handler.send_header(key, value)
    if length is not None:
        handler.send_header("Content-Length", str(len(body) if length == -1 else length))
    else:
        handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(body if send is None else body[:send])
    handler.wfile.flush()
    if send is not None or length is None:
        handler.close_connection = True


@pytest.fixture
def server() -> Iterator[Scripted]:
    scripted = Scripted()
    yield scripted
    scripted.close()


def jsonl(count: int) -> bytes:
    return b"".join(json.dumps({"i": i, "pad": "x" * 20}).encode() + b"\n"
                    for i in range(count))


def ids(records: list[Any]) -> list[int]:
    return [record["i"] for record in records]


# --------------------------------------------------------------------------- content codings


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


CODED = {
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "deflate": zlib.compress,
    "raw-deflate": raw_deflate,
    "gzip-members": lambda data: gzip.compress(data[:1000]) + gzip.compress(data[1000:]),
    "gzip-twice": lambda data: gzip.compress(gzip.compress(data)),
}
HEADER = {"raw-deflate": "deflate", "gzip-members": "gzip", "gzip-twice": "gzip, gzip"}


@pytest.mark.parametrize("coding", sorted(CODED))
async def test_coded_bodies_decoded(server: Scripted, anyio_backend: str, coding: str) -> None:
    body = jsonl(2000)
    coded = CODED[coding](body)
    url = server.route("c.jsonl", lambda h, n: reply(
        h, 200, coded, headers={"Content-Encoding": HEADER.get(coding, coding)}))
    # skip_errors=True: raw coded bytes used to be parsed as lines and skipped, silently.
    source = JsonLines(url, skip_errors=True, chunk_size=1000, **FAST)
    assert ids(await collect(source)) == list(range(2000))
    assert source.stats.skipped == 0 and source.stats.bytes == len(body)


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_empty_coded_body(server: Scripted, anyio_backend: str, coding: str) -> None:
    url = server.route("e.txt", lambda h, n: reply(h, 200, b"",
                                                   headers={"Content-Encoding": coding}))
    assert await collect(TextLines(url, **FAST)) == []


async def test_gzip_bomb_piece_handed_on_in_chunks(server: Scripted, anyio_backend: str) -> None:
    body = b"\n".join([b"x" * 999] * 4000) + b"\n"  # 4 MB that gzip shrinks ~1000 times
    coded = gzip.compress(body)
    url = server.route("z.txt", lambda h, n: reply(h, 200, coded,
                                                   headers={"Content-Encoding": "gzip"}))
    source = TextLines(url, chunk_size=1 << 14, **FAST)
    iterator = source.__aiter__()
    assert await iterator.__anext__() == "x" * 999
    # One small coded read inflates to megabytes: only a few chunks of it are decoded ahead.
    assert source.stats.bytes <= 64 * (1 << 14)
    await iterator.aclose()  # type: ignore[attr-defined]


async def test_coded_body_cut_is_read_again_from_its_start(server: Scripted,
                                                           anyio_backend: str) -> None:
    body = jsonl(2000)
    coded = gzip.compress(body)

    def route(handler: _Handler, n: int) -> None:
        # The first answer stops halfway; a Range, if asked, would count coded bytes.
        reply(handler, 200, coded, headers={"Content-Encoding": "gzip"},
              send=len(coded) // 2 if n == 0 else None)

    url = server.route("cut.jsonl", route)
    source = JsonLines(url, chunk_size=1000, **FAST)
    assert ids(await collect(source)) == list(range(2000))
    assert server.requests == [("cut.jsonl", None), ("cut.jsonl", None)]
    assert source.stats.retries == 1 and source.stats.bytes == len(body)


async def test_plain_then_coded_resumption(server: Scripted, anyio_backend: str) -> None:
    body = jsonl(1000)
    coded = gzip.compress(body)

    def route(handler: _Handler, n: int) -> None:
        if n == 0:  # plain, cut
            reply(handler, 200, body, send=len(body) // 3)
        elif n == 1:  # a coded range: of no use for the plain offset
            reply(handler, 206, coded[100:], headers={
                "Content-Encoding": "gzip",
                "Content-Range": f"bytes 100-{len(coded) - 1}/{len(coded)}"})
        else:
            reply(handler, 200, coded, headers={"Content-Encoding": "gzip"})

    url = server.route("mix.jsonl", route)
    source = JsonLines(url, chunk_size=500, **FAST)
    assert ids(await collect(source)) == list(range(1000))
    assert server.requests[1][1] == f"bytes={len(body) // 3}-"
    assert server.requests[2][1] is None


async def test_coded_stream_that_never_ends_fails(server: Scripted, anyio_backend: str) -> None:
    coded = gzip.compress(jsonl(500))[:-30]  # complete over HTTP, incomplete as gzip
    url = server.route("t.jsonl", lambda h, n: reply(h, 200, coded,
                                                     headers={"Content-Encoding": "gzip"}))
    with pytest.raises(FetchError, match=r"t\.jsonl: giving up after 3 failed attempts.*"
                                         r"gzip body ended before the end of its stream"):
        await collect(JsonLines(url, retries=2, **FAST))
    assert len(server.requests) == 3


async def test_corrupt_coded_body_fails_at_once(server: Scripted, anyio_backend: str) -> None:
    coded = bytearray(gzip.compress(jsonl(500)))
    coded[30:40] = b"\xff" * 10
    url = server.route("bad.jsonl", lambda h, n: reply(h, 200, bytes(coded),
                                                       headers={"Content-Encoding": "gzip"}))
    with pytest.raises(FetchError, match=r"bad\.jsonl: the gzip body does not decode") as info:
        await collect(JsonLines(url, skip_errors=True, **FAST))
    assert info.value.source == url
    assert len(server.requests) == 1


@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "gzip, aes128gcm"])
async def test_undecodable_coding_refused(server: Scripted, anyio_backend: str,
                                          coding: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("brotli", "brotlicffi", "zstandard", "compression.zstd"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    url = server.route("u.jsonl", lambda h, n: reply(h, 200, b"\x00\x01garbage\n" * 100,
                                                     headers={"Content-Encoding": coding}))
    source = JsonLines(url, skip_errors=True, **FAST)
    name = coding.split(", ")[-1]
    with pytest.raises(FetchError, match=rf"u\.jsonl: the server sent the body with "
                                         rf"Content-Encoding '{name}'") as info:
        await collect(source)
    assert info.value.source == url and info.value.status_code == 200
    if coding == "br":
        assert "pip install brotli" in str(info.value)
    assert source.stats.records == 0 and source.stats.skipped == 0
    assert len(server.requests) == 1


async def test_br_decoded_when_a_decoder_is_installed(server: Scripted, anyio_backend: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    class Decompressor:  # brotli's interface, with deflate standing in for the codec
        def __init__(self) -> None:
            self._inflate = zlib.decompressobj()

        def process(self, data: bytes) -> bytes:
            return self._inflate.decompress(data)

        def is_finished(self) -> bool:
            return bool(self._inflate.eof)

    monkeypatch.setitem(sys.modules, "brotli",
                        types.SimpleNamespace(Decompressor=Decompressor))
    body = jsonl(300)
    url = server.route("b.jsonl", lambda h, n: reply(h, 200, zlib.compress(body),
                                                     headers={"Content-Encoding": "br"}))
    assert ids(await collect(JsonLines(url, **FAST))) == list(range(300))


# --------------------------------------------------------------------------- redirects


@pytest.mark.parametrize("target", ["data:text/plain,hello", "data:,{}",
                                    "file:///etc/passwd", "ftp://127.0.0.1/x.jsonl"])
async def test_redirect_out_of_http_is_a_located_fetch_error(
        server: Scripted, anyio_backend: str, target: str) -> None:
    url = server.route("r.jsonl", lambda h, n: reply(h, 302, headers={"Location": target}))
    with pytest.raises(FetchError) as info:
        await collect(JsonLines(url, **FAST))
    assert info.value.source == url
    assert str(info.value).startswith(f"{url}: ") and "redirected" in str(info.value)
    assert len(server.requests) == 1  # not retried


async def test_url_that_is_not_http(anyio_backend: str) -> None:
    with pytest.raises(FetchError, match="not a valid http"):
        await collect(JsonLines("http:///no-host", **FAST))


# --------------------------------------------------------------------------- truncated bodies


async def test_body_shorter_than_its_length_resumed(server: Scripted,
                                                    anyio_backend: str) -> None:
    body = jsonl(1000)

    def route(handler: _Handler, n: int) -> None:
        if n == 0:  # Content-Length of the whole body, then the connection closes
            reply(handler, 200, body, send=777)
        else:
            start = int(handler.headers["Range"][6:-1])
            reply(handler, 206, body[start:], headers={
                "Content-Range": f"bytes {start}-{len(body) - 1}/{len(body)}"})

    url = server.route("s.jsonl", route)
    assert ids(await collect(JsonLines(url, **FAST))) == list(range(1000))
    assert server.requests[1] == ("s.jsonl", "bytes=777-")


async def test_body_always_cut_fails(server: Scripted, anyio_backend: str) -> None:
    body = jsonl(100)
    url = server.route("a.jsonl", lambda h, n: reply(h, 200, body, send=50, length=len(body)))
    with pytest.raises(FetchError, match="giving up after 3 failed attempts"):
        await collect(JsonLines(url, retries=2, **FAST))


async def test_short_ranges_are_resumed(server: Scripted, anyio_backend: str) -> None:
    body = jsonl(400)
    piece = 1500

    def route(handler: _Handler, n: int) -> None:
        if n == 0:
            reply(handler, 200, body, send=piece)
            return
        # A server (or a proxy) that answers an open range with a part of it only.
        start = int(handler.headers["Range"][6:-1])
        end = min(start + piece, len(body))
        reply(handler, 206, body[start:end],
              headers={"Content-Range": f"bytes {start}-{end - 1}/{len(body)}"})

    url = server.route("p.jsonl", route)
    source = JsonLines(url, retries=1, **FAST)
    assert ids(await collect(source)) == list(range(400))  # not only the first ranges
    assert source.stats.bytes == len(body)


async def test_npy_header_checked_against_content_length(server: Scripted,
                                                         anyio_backend: str) -> None:
    data = npy_with_rows(10**12, np.zeros((1000, 3)))
    url = server.route("h.npy", lambda h, n: reply(h, 200, data))
    source = NpyRows(url, chunk_size=1024, **FAST)
    rows = []
    with pytest.raises(RecordError, match=r"h\.npy: .*truncated array: the shard ends after "
                                          r"1000 of 1000000000000 rows") as info:
        async for row in source:  # the rows the shard holds whole come first, as from a file
            rows.append(row)
    assert info.value.source == url
    assert len(rows) == source.stats.records == 1000


async def test_redirect_followed_and_resumed(server: Scripted, anyio_backend: str) -> None:
    body = jsonl(500)
    target = server.route("real.jsonl", lambda h, n: (
        reply(h, 200, body, send=900) if n == 0 else
        reply(h, 206, body[900:], headers={
            "Content-Range": f"bytes 900-{len(body) - 1}/{len(body)}"})))
    url = server.route("moved.jsonl", lambda h, n: reply(h, 302, headers={"Location": target}))
    assert ids(await collect(JsonLines(url, **FAST))) == list(range(500))
    assert server.requests == [("moved.jsonl", None), ("real.jsonl", None),
                               ("moved.jsonl", "bytes=900-"), ("real.jsonl", "bytes=900-")]


# ------------------------------------------------------------- statuses, retries, resumption
# Through the sources, against the tests' FaultyServer (the ``serve`` fixture).


async def test_404_fails_at_once(serve: Callable[..., FaultyServer], anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(1, 10))
    url = server.url("missing.jsonl")
    with pytest.raises(FetchError) as info:
        await collect(JsonLines([server.urls[0], url], retries=5, **FAST))
    assert info.value.status_code == 404
    assert info.value.source == url
    assert f"{url}: HTTP 404 Not Found (not retried)" in str(info.value)
    assert [name for name, _ in server.requests].count("missing.jsonl") == 1


async def test_transient_503_retried(serve: Callable[..., FaultyServer],
                                     anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(2, 50))
    name = sorted(server.files)[1]
    server.fail(name, 503, times=2)
    source = JsonLines(server.urls, retries=3, **FAST)
    assert [r["id"] for r in await collect(source)] == list(range(100))
    assert [n for n, _ in server.requests].count(name) == 3
    assert source.stats.retries == 2


async def test_503_until_retries_run_out(serve: Callable[..., FaultyServer],
                                         anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(1, 5))
    name = next(iter(server.files))
    server.fail(name, 503, times=10)
    with pytest.raises(FetchError, match=r"giving up after 3 failed attempts; last error: "
                                         r"HTTP 503 Service Unavailable") as info:
        await collect(JsonLines(server.urls, retries=2, **FAST))
    assert info.value.status_code == 503
    assert len(server.requests) == 3


async def test_connection_refused(anyio_backend: str) -> None:
    url = f"http://127.0.0.1:{free_port()}/shard.jsonl"
    with pytest.raises(FetchError, match="giving up after 3 failed attempts; last error: "
                                         "ConnectError") as info:
        await collect(JsonLines(url, retries=2, **FAST))
    assert info.value.source == url and info.value.status_code is None
    assert isinstance(info.value, OSError)


async def test_timeout(serve: Callable[..., FaultyServer], anyio_backend: str) -> None:
    server = serve(make_jsonl_shards(1, 5))
    name = next(iter(server.files))
    server.stall(name, 2.5, times=2)
    # Two stalled attempts time out; the third answers.
    source = JsonLines(server.urls, retries=2, backoff=0.01, timeout=0.5)
    assert len(await collect(source)) == 5
    assert source.stats.retries == 2
    server.stall(name, 2.5, times=2)
    with pytest.raises(FetchError, match="last error: ReadTimeout"):
        await collect(JsonLines(server.urls, retries=1, backoff=0.01, timeout=0.5))


@pytest.mark.parametrize("ranges", [True, False])
async def test_resume_after_cut(serve: Callable[..., FaultyServer], anyio_backend: str,
                                ranges: bool) -> None:
    files = make_jsonl_shards(1, 400)
    server = serve(files, ranges=ranges)
    name = next(iter(files))
    cut = len(files[name]) // 3 + 7  # in the middle of a line
    server.cut(name, cut, times=2)
    source = JsonLines(server.urls, chunk_size=1000, **FAST)
    records = await collect(source)
    assert [r["id"] for r in records] == list(range(400))
    # The second attempt asked for the rest only; the third for what was still missing.
    assert server.requests[0] == (name, None)
    assert server.requests[1] == (name, f"bytes={cut}-")
    assert server.requests[2][1] is not None and source.stats.retries == 2
    assert source.stats.bytes == len(files[name])


async def test_error_location_after_resume(serve: Callable[..., FaultyServer],
                                           anyio_backend: str) -> None:
    lines = [json.dumps({"i": i}).encode() for i in range(100)]
    lines[80] = b"{oops"
    body = b"\n".join(lines) + b"\n"
    server = serve({"x.jsonl": body})
    server.cut("x.jsonl", 300)
    with pytest.raises(RecordError) as info:
        await collect(JsonLines(server.url("x.jsonl"), chunk_size=64, **FAST))
    offset = sum(len(line) + 1 for line in lines[:80])
    assert info.value.line == 81 and info.value.offset == offset
    assert f"{server.url('x.jsonl')}: line 81 (byte offset {offset}): invalid JSON" in str(
        info.value)


async def test_changed_resource_detected(serve: Callable[..., FaultyServer],
                                         anyio_backend: str) -> None:
    server = serve({"c.txt": b"a\n" * 1000})
    server.cut("c.txt", 100)
    server.replace("c.txt", b"b\n" * 1000)  # a new version (new ETag) for the retry
    with pytest.raises(FetchError, match=r"c\.txt: the resource changed on the server while "
                                         r"it was being read .* at byte offset 100"):
        await collect(TextLines(server.url("c.txt"), **FAST))


# --------------------------------------------------------------------------- http_chunks, directly


async def _chunks(url: str, *, on_size: Callable[[int], None] | None = None,
                  **options: Any) -> tuple[bytes, SourceStats]:
    """The body ``http_chunks`` delivers for ``url``, and the stats it counted."""
    opts = HttpOptions(**{**FAST, **options})
    stats = SourceStats()
    async with make_client(opts, 1) as client, contextlib.aclosing(
        http_chunks(client, url, opts, stats, on_size)
    ) as body:
        data = b"".join([chunk async for chunk in body])
    return data, stats


async def test_http_chunks_resume_with_a_range_for_the_rest(server: Scripted,
                                                            anyio_backend: str) -> None:
    body = bytes(range(256)) * 40
    url = server.route("r.bin", lambda h, n: (
        reply(h, 200, body, send=1000) if n == 0 else
        reply(h, 206, body[1000:], headers={
            "Content-Range": f"bytes 1000-{len(body) - 1}/{len(body)}"})))
    sizes: list[int] = []
    data, stats = await _chunks(url, on_size=sizes.append, chunk_size=300)
    assert data == body
    assert server.requests == [("r.bin", None), ("r.bin", "bytes=1000-")]
    assert stats.retries == 1
    assert sizes == [len(body), len(body)]  # told before the chunks each response announces


async def test_http_chunks_skip_what_was_delivered_when_ranges_are_ignored(
    server: Scripted, anyio_backend: str
) -> None:
    body = bytes(range(256)) * 40
    url = server.route("r.bin", lambda h, n: reply(h, 200, body, send=1000 if n == 0 else None))
    data, _ = await _chunks(url)
    assert data == body  # the first 1000 bytes of the second answer are dropped, not repeated
    assert server.requests == [("r.bin", None), ("r.bin", "bytes=1000-")]


async def test_http_chunks_are_at_most_chunk_size(server: Scripted, anyio_backend: str) -> None:
    body = b"z" * 10_000
    url = server.route("z.bin", lambda h, n: reply(h, 200, body))
    opts = HttpOptions(**{**FAST, "chunk_size": 777})
    async with make_client(opts, 1) as client, contextlib.aclosing(
        http_chunks(client, url, opts, SourceStats())
    ) as chunks:
        sizes = [len(chunk) async for chunk in chunks]
    assert sum(sizes) == len(body) and max(sizes) <= 777


async def test_http_chunks_decode_a_coded_body(server: Scripted, anyio_backend: str) -> None:
    body = jsonl(300)
    url = server.route("g", lambda h, n: reply(h, 200, gzip.compress(body),
                                               headers={"Content-Encoding": "gzip"}))
    data, _ = await _chunks(url)
    assert data == body


async def test_http_chunks_client_error_fails_at_once(server: Scripted,
                                                      anyio_backend: str) -> None:
    url = server.route("gone", lambda h, n: reply(h, 410))
    with pytest.raises(FetchError, match=r"gone: HTTP 410 .*\(not retried\)") as info:
        await _chunks(url, retries=5)
    assert info.value.status_code == 410
    assert server.counts["gone"] == 1


async def test_http_chunks_transient_status_retried_until_retries_run_out(
    server: Scripted, anyio_backend: str
) -> None:
    url = server.route("busy", lambda h, n: reply(h, 503))
    with pytest.raises(FetchError):
        await _chunks(url, retries=2)
    assert server.counts["busy"] == 3  # the first attempt and two retries


# --------------------------------------------------------------------------- the clients


def test_the_default_client_is_aiohttp_on_asyncio_and_httpx_on_trio() -> None:
    """aiohttp costs several times less per request than httpx (bench_http_clients.py);
    trio has no aiohttp."""
    import anyio

    pytest.importorskip("aiohttp")

    async def kind() -> str:
        async with make_client(HttpOptions(), 1) as client:
            return type(client).__name__

    assert anyio.run(kind, backend="asyncio") == "_AiohttpClient"
    assert anyio.run(kind, backend="trio") == "_HttpxClient"


async def test_a_client_factorys_httpx_client_resumes_and_names_errors_alike(
        server: Scripted, anyio_backend: str) -> None:
    """The httpx path on either backend (a ``client_factory``): the same resumption, and the
    same names of failures in messages as aiohttp's path."""
    import httpx

    made: list[Any] = []

    def factory() -> Any:
        made.append(httpx.AsyncClient())
        return made[-1]

    body = bytes(range(256)) * 40
    url = server.route("r.bin", lambda h, n: (
        reply(h, 200, body, send=1000) if n == 0 else
        reply(h, 206, body[1000:], headers={
            "Content-Range": f"bytes 1000-{len(body) - 1}/{len(body)}"})))
    data, stats = await _chunks(url, client_factory=factory)
    assert data == body and stats.retries == 1 and len(made) == 1
    assert server.requests == [("r.bin", None), ("r.bin", "bytes=1000-")]
    with pytest.raises(FetchError, match="last error: ConnectError"):
        await _chunks(f"http://127.0.0.1:{free_port()}/x", retries=1, client_factory=factory)
