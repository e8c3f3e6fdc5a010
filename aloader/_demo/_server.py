"""The demo's local HTTP server: in-memory files on 127.0.0.1, with a latency per request.

Owns :class:`ShardServer` (a threaded HTTP/1.1 server in this process: keep-alive,
``Content-Length``, an ETag, byte ranges) and :func:`make_jsonl_shards`, the generated JSON
Lines shards it serves in ``python -m aloader demo`` and ``benchmarks/bench_sources.py``. It
behaves as an object store does, and nothing more: the tests' server with injected faults
(error statuses, bodies cut short, stalls) extends it in ``tests/faulty_server.py``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import zlib
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ("Answer", "ShardHandler", "ShardServer", "make_jsonl_shards")

# What one GET answers: status, headers (Content-Length aside) and body.
Answer = tuple[int, dict[str, str], bytes]

def make_jsonl_shards(
    num_shards: int, records_per_shard: int, prefix: str = "shard"
) -> dict[str, bytes]:
    """Generated JSON Lines shards: ``{name: body}``.

    Record ``i`` of shard ``s`` is ``{"id": s * records_per_shard + i, "shard": s, "label":
    id % 10, "text": "...", "x": [4 floats]}``, about 100 bytes per line.
    """
    shards = {}
    for shard in range(num_shards):
        lines = []
        for i in range(records_per_shard):
            ident = shard * records_per_shard + i
            lines.append(json.dumps({
                "id": ident, "shard": shard, "label": ident % 10,
                "text": f"record {i} of shard {shard}",
                "x": [i * 0.5, 1.25, -3.0, shard + 0.5],
            }))
        shards[f"{prefix}-{shard:05d}.jsonl"] = ("\n".join(lines) + "\n").encode()
    return shards


class ShardHandler(BaseHTTPRequestHandler):
    """One connection of a :class:`ShardServer`; :meth:`ShardServer.respond` answers its GETs."""

    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without TCP_NODELAY, Nagle's algorithm
    # holds the second one until the client's delayed ACK (tens of ms per request).
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.owner._connection(+1)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._connection(-1)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the tests and the demo print what matters

    def send_head(self, status: int, headers: Mapping[str, str], length: int) -> None:
        """Send the status line and headers of a body of ``length`` bytes."""
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def send(self, answer: Answer) -> None:
        """Send a whole answer."""
        status, headers, body = answer
        self.send_head(status, headers, len(body))
        if body:
            self.wfile.write(body)

    def do_GET(self) -> None:
        owner = self.server.owner
        name = self.path.lstrip("/")
        range_header = self.headers.get("Range")
        owner._log(name, range_header)
        if owner.latency:
            time.sleep(owner.latency)
        owner.respond(self, name, range_header)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    # The default listen backlog (5) drops connections opened together, which then wait a
    # second for the SYN to be resent.
    request_queue_size = 128
    owner: ShardServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hang up mid-response when they stop reading: not worth a traceback.
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


class ShardServer:
    """A threaded HTTP/1.1 server on 127.0.0.1 serving in-memory files, for demos and tests.

    It answers ``GET /name`` with the file's bytes (keep-alive, ``Content-Length``, an ETag),
    honours ``Range: bytes=N-`` with 206 unless ``ranges=False``, and waits ``latency``
    seconds before each answer. Subclasses change the answers by overriding :meth:`respond`.

    Args:
        files: ``{name: body}`` served at ``/name``.
        latency: seconds slept before answering each request.
        ranges: support byte ranges (False: always answer 200 with the whole body).
        port: the port (0: any free one).

    Attributes:
        requests: ``(name, Range header or None)`` of every request, in arrival order.
        open_connections: connections open now; ``max_open_connections``: the most at once.
    """

    def __init__(
        self,
        files: Mapping[str, bytes],
        *,
        latency: float = 0.0,
        ranges: bool = True,
        port: int = 0,
    ) -> None:
        self.files = dict(files)
        self.latency = latency
        self.ranges = ranges
        self.requests: list[tuple[str, str | None]] = []
        self.open_connections = 0
        self.max_open_connections = 0
        # Guards what the handler threads update together: requests and the connection counts.
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", port), ShardHandler)
        self._server.owner = self
        self._thread: threading.Thread | None = None

    # Answers -----------------------------------------------------------------------------
    def answer(self, name: str, range_header: str | None) -> Answer:
        """What ``GET /name`` with this ``Range`` header answers now: 200, 206, 404 or 416."""
        body = self.files.get(name)
        if body is None:
            return 404, {}, b""
        status = 200
        headers = {"ETag": f'"{zlib.crc32(body):08x}"', "Content-Type": "application/jsonl"}
        if self.ranges:
            headers["Accept-Ranges"] = "bytes"
            if range_header and range_header.startswith("bytes="):
                first, _, last = range_header[6:].partition("-")
                start = int(first)
                stop = int(last) + 1 if last else len(body)
                if start >= len(body):
                    return 416, {"Content-Range": f"bytes */{len(body)}"}, b""
                part = body[start:stop]
                status = 206
                headers["Content-Range"] = f"bytes {start}-{start + len(part) - 1}/{len(body)}"
                body = part
        return status, headers, body

    def respond(self, handler: ShardHandler, name: str, range_header: str | None) -> None:
        """Answer one request (after the latency), in the handler's thread."""
        handler.send(self.answer(name, range_header))

    def _log(self, name: str, range_header: str | None) -> None:
        with self._lock:
            self.requests.append((name, range_header))

    def _connection(self, delta: int) -> None:
        with self._lock:
            self.open_connections += delta
            self.max_open_connections = max(self.max_open_connections, self.open_connections)

    # Lifecycle ---------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The port the server listens on."""
        return int(self._server.server_address[1])

    def url(self, name: str) -> str:
        """The URL of the file ``name``."""
        return f"http://127.0.0.1:{self.port}/{name}"

    @property
    def urls(self) -> list[str]:
        """URLs of every file, sorted by name."""
        return [self.url(name) for name in sorted(self.files)]

    def start(self) -> ShardServer:
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name="aloader-shard-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
