"""The demo's local HTTP server: in-memory files on 127.0.0.1, with a latency per request.

Owns :class:`ShardServer` (a threaded HTTP/1.1 server in this process: keep-alive,
``Content-Length``, an ETag, byte ranges) and :func:`make_jsonl_shards`, the generated JSON
Lines shards it serves in ``python -m aloader demo`` and ``benchmarks/bench_sources.py``. It
behaves as an object store does, and nothing more: the tests' server with injected faults
(error statuses, bodies cut short, stalls) extends it in ``tests/faulty_server.py``.

With ``bucket=``, the same server speaks the part of S3's REST API that object store clients
(obstore, boto3) need to list and read a bucket: path-style ``GET`` and ``HEAD`` of
``/<bucket>/<key>`` and ``GET /<bucket>?list-type=2`` (ListObjectsV2). The S3 benchmark rows
then run the same server code, with the same latency, as the HTTP rows, so that their ratio
measures the client paths rather than two servers.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import zlib
from collections.abc import Mapping
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, unquote
from xml.sax.saxutils import escape

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
        if owner.bucket is not None:
            self._s3(head=False)
            return
        name = self.path.lstrip("/")
        range_header = self.headers.get("Range")
        owner._log(name, range_header)
        if owner.latency:
            time.sleep(owner.latency)
        owner.respond(self, name, range_header)

    def do_HEAD(self) -> None:
        if self.server.owner.bucket is None:
            # What BaseHTTPRequestHandler answers a method it has no do_ for.
            self.send_error(501, f"Unsupported method ({self.command!r})")
            return
        self._s3(head=True)

    def _s3(self, head: bool) -> None:
        """Answer an S3 request (the server's ``bucket`` mode), after the latency."""
        owner = self.server.owner
        path, _, query = self.path.partition("?")
        bucket, _, key = path.lstrip("/").partition("/")
        key = unquote(key)
        range_header = None if head else self.headers.get("Range")
        owner._log(key, range_header)
        if owner.latency:
            time.sleep(owner.latency)
        if unquote(bucket) != owner.bucket:
            self.send(_s3_error(404, "NoSuchBucket", "The specified bucket does not exist"))
        elif not key:
            if head:
                self.send_head(200, {}, 0)
            else:
                self.send(owner.list_objects(parse_qs(query)))
        elif head:
            status, headers, body = owner.answer(key, None)
            self.send_head(status, headers, len(body))
        elif (want := self.headers.get("If-Match")) is not None and (
                key in owner.files and want != _etag(owner.files[key])):
            self.send(_s3_error(412, "PreconditionFailed",
                                "At least one of the pre-conditions you specified did not hold"))
        else:
            owner.respond(self, key, range_header)


def _etag(body: bytes) -> str:
    return f'"{zlib.crc32(body):08x}"'


def _s3_error(status: int, code: str, message: str) -> Answer:
    """An S3 error answer: ``status`` with the XML body naming ``code``."""
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>").encode()
    return status, {"Content-Type": "application/xml"}, body


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

    With ``bucket``, it is an S3-compatible server of that one bucket instead, whose keys are
    the files' names (for ``s3://bucket/name`` URLs, with ``AWS_ENDPOINT_URL`` set to
    :attr:`endpoint`): ``GET /bucket/key`` (``Range`` as above, ``If-Match`` answered 412 when
    it names another version), ``HEAD /bucket/key``, and ``GET /bucket?list-type=2`` with
    ``prefix``, ``delimiter``, ``start-after``, ``max-keys`` and ``continuation-token``
    (ListObjectsV2, :attr:`list_page` keys a page at most); objects carry an ETag, a
    ``Last-Modified`` and their ``Content-Length``, and errors are S3's XML (``NoSuchKey``,
    ``NoSuchBucket``). Requests are not authenticated: any signature, or none, is accepted.
    :attr:`requests` records object keys (``""`` for a listing); :meth:`respond` answers the
    object GETs, as in the HTTP mode.

    Args:
        files: ``{name: body}`` served at ``/name`` (``/bucket/name`` with ``bucket``).
        latency: seconds slept before answering each request.
        ranges: support byte ranges (False: always answer 200 with the whole body).
        port: the port (0: any free one).
        bucket: serve the files as this S3 bucket's objects (None: plain HTTP).

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
        bucket: str | None = None,
    ) -> None:
        self.files = dict(files)
        self.latency = latency
        self.ranges = ranges
        self.bucket = bucket
        self.list_page = 1000
        # Every object's Last-Modified: the server's start (S3 clients require the header).
        self._modified = time.time()
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
            if self.bucket is not None:
                return _s3_error(404, "NoSuchKey", "The specified key does not exist.")
            return 404, {}, b""
        status = 200
        headers = {"ETag": _etag(body), "Content-Type": "application/jsonl"}
        if self.bucket is not None:
            headers["Last-Modified"] = formatdate(self._modified, usegmt=True)
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

    def list_objects(self, query: Mapping[str, list[str]]) -> Answer:
        """The ListObjectsV2 answer to a listing's query (``parse_qs`` of it)."""
        def arg(name: str) -> str:
            return query.get(name, [""])[0]

        prefix, delimiter = arg("prefix"), arg("delimiter")
        after = max(arg("start-after"), arg("continuation-token"))
        limit = min(int(arg("max-keys") or self.list_page), self.list_page)
        modified = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(self._modified))
        entries: list[str] = []
        common: list[str] = []
        last = ""
        for key in sorted(self.files):
            if not key.startswith(prefix) or key <= after:
                continue
            if len(entries) + len(common) == limit:
                break
            cut = key.find(delimiter, len(prefix)) if delimiter else -1
            if cut >= 0:
                folder = key[: cut + len(delimiter)]
                if folder not in common:
                    common.append(folder)
                last = folder + "\U0010ffff"  # past every key under the folder
                continue
            last = key
            entries.append(f"<Contents><Key>{escape(key)}</Key><LastModified>{modified}"
                           f"</LastModified><ETag>{escape(_etag(self.files[key]))}</ETag>"
                           f"<Size>{len(self.files[key])}</Size>"
                           "<StorageClass>STANDARD</StorageClass></Contents>")
        else:
            last = ""
        more = (f"<NextContinuationToken>{escape(last)}</NextContinuationToken>" if last
                else "")
        body = ('<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns='
                '"http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<Name>{escape(self.bucket or '')}</Name><Prefix>{escape(prefix)}</Prefix>"
                f"<KeyCount>{len(entries) + len(common)}</KeyCount><MaxKeys>{limit}</MaxKeys>"
                f"<IsTruncated>{'true' if last else 'false'}</IsTruncated>{more}"
                + "".join(entries)
                + "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>"
                          for p in common)
                + "</ListBucketResult>").encode()
        return 200, {"Content-Type": "application/xml"}, body

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

    @property
    def endpoint(self) -> str:
        """The server's root URL (an S3 client's endpoint in the ``bucket`` mode)."""
        return f"http://127.0.0.1:{self.port}"

    def url(self, name: str) -> str:
        """The URL of the file ``name`` (``s3://bucket/name`` in the ``bucket`` mode)."""
        if self.bucket is not None:
            return f"s3://{self.bucket}/{name}"
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
