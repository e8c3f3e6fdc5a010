"""``python -m aloader demo``'s streaming part: a real HTTP server and the sharded source.

The demo starts :class:`ShardServer` (a threaded HTTP/1.1 server on 127.0.0.1, in this process)
serving generated JSON Lines shards with a simulated latency per request, then streams them
through ``JsonLines(urls, shuffle_shards=True)``, a shuffle buffer and the DataLoader, with a
live progress line. The server also serves the tests and the benchmark: it supports byte ranges
and injected faults (error statuses, bodies cut short, stalls).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, TextIO

import anyio

__all__ = ("ShardServer", "main", "make_jsonl_shards")


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


class _Fault:
    __slots__ = ("kind", "times", "value")

    def __init__(self, kind: str, value: Any, times: int) -> None:
        self.kind = kind
        self.value = value
        self.times = times


class _Handler(BaseHTTPRequestHandler):
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

    def _send_empty(self, status: int, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        owner = self.server.owner
        name = self.path.lstrip("/")
        range_header = self.headers.get("Range")
        owner._log(name, range_header)
        if owner.latency:
            time.sleep(owner.latency)
        fault = owner._take_fault(name)
        if fault is not None and fault.kind == "replace":
            owner.files[name] = fault.value
        elif fault is not None and fault.kind == "stall":
            time.sleep(fault.value)
        elif fault is not None and fault.kind == "status":
            self._send_empty(int(fault.value), {"Retry-After": "0"})
            return
        body = owner.files.get(name)
        if body is None:
            self._send_empty(404)
            return
        start = 0
        status = 200
        headers = {"ETag": f'"{zlib.crc32(body):08x}"', "Content-Type": "application/jsonl"}
        if owner.ranges:
            headers["Accept-Ranges"] = "bytes"
            if range_header and range_header.startswith("bytes="):
                first, _, last = range_header[6:].partition("-")
                start = int(first)
                stop = int(last) + 1 if last else len(body)
                if start >= len(body):
                    self._send_empty(416, {"Content-Range": f"bytes */{len(body)}"})
                    return
                body = body[start:stop]
                status = 206
                headers["Content-Range"] = f"bytes {start}-{start + len(body) - 1}/" \
                                           f"{len(owner.files[name])}"
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if fault is not None and fault.kind == "cut":
            # Send part of the promised body, then hang up: the client sees a short read.
            self.wfile.write(body[: int(fault.value)])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


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
    honours ``Range: bytes=N-`` with 206 unless ``ranges=False``, waits ``latency`` seconds
    before each answer, and can be told to misbehave on the next requests for a file.

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
        self._faults: dict[str, deque[_Fault]] = {}
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", port), _Handler)
        self._server.owner = self
        self._thread: threading.Thread | None = None

    # Faults ------------------------------------------------------------------------------
    def _add(self, name: str, fault: _Fault) -> None:
        with self._lock:
            self._faults.setdefault(name, deque()).append(fault)

    def fail(self, name: str, status: int, times: int = 1) -> None:
        """Answer the next ``times`` requests for ``name`` with ``status`` (e.g. 503)."""
        self._add(name, _Fault("status", status, times))

    def cut(self, name: str, after: int, times: int = 1) -> None:
        """Send only ``after`` bytes of the next ``times`` bodies, then close the connection."""
        self._add(name, _Fault("cut", after, times))

    def stall(self, name: str, seconds: float, times: int = 1) -> None:
        """Wait ``seconds`` before answering the next ``times`` requests (for timeouts)."""
        self._add(name, _Fault("stall", seconds, times))

    def replace(self, name: str, body: bytes) -> None:
        """Replace the file ``name`` with ``body`` when its next request arrives (after the
        faults queued before this one)."""
        self._add(name, _Fault("replace", body, 1))

    def _take_fault(self, name: str) -> _Fault | None:
        with self._lock:
            queue = self._faults.get(name)
            if not queue:
                return None
            fault = queue[0]
            fault.times -= 1
            if fault.times <= 0:
                queue.popleft()
            return fault

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


# --------------------------------------------------------------------------- the demo


async def _stream(args: argparse.Namespace, urls: Sequence[str], out: TextIO) -> int:
    from ._loader import DataLoader
    from ._progress import Progress
    from ._sources import JsonLines

    source = JsonLines(urls, shuffle_shards=True, seed=args.seed,
                       concurrency=args.concurrency).shuffle(args.buffer, seed=args.seed)
    loader: DataLoader[Any] = DataLoader(source, batch_size=args.batch_size)
    total = args.shards * args.records
    first_ids: list[int] = []
    for epoch in range(args.epochs):
        progress = Progress(out, total, label=f"epoch {epoch + 1}/{args.epochs}")
        seen = bytearray(total)
        items = batches = 0
        async for batch in loader:
            ids = batch["id"]
            for ident in ids.tolist():
                seen[ident] += 1
            if epoch == 0 and len(first_ids) < 8:
                first_ids.extend(ids[: 8 - len(first_ids)].tolist())
            items += len(ids)
            batches += 1
            progress.update(batches, items)
        elapsed = progress.finish(batches, items)
        if items != total or seen.count(1) != total:
            out.write(f"  ERROR: expected each of {total:,} records exactly once, got {items:,} "
                      f"items, {seen.count(0):,} missing\n")
            return 1
        out.write(f"  every record exactly once; {elapsed:.2f} s\n")
    out.write(f"  first ids of epoch 1 (shuffled): {first_ids}\n")
    return 0


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """Run the HTTP streaming demo; returns the exit status.

    Args:
        argv: command-line arguments (``--help`` lists them); None reads ``sys.argv``.
        out: where to print (default: standard output).
    """
    parser = argparse.ArgumentParser(
        prog="python -m aloader demo-http",
        description="Stream generated JSON Lines shards from a local HTTP server through a "
                    "sharded, shuffled source and the DataLoader.",
    )
    parser.add_argument("--shards", type=int, default=128, help="number of shards")
    parser.add_argument("--records", type=int, default=2000, help="records per shard")
    parser.add_argument("--latency", type=float, default=0.02,
                        help="seconds the server waits before each response")
    parser.add_argument("--concurrency", type=int, default=8, help="shards read at once")
    parser.add_argument("--buffer", type=int, default=8192, help="shuffle buffer size")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = out or sys.stdout

    files = make_jsonl_shards(args.shards, args.records)
    with ShardServer(files, latency=args.latency) as server:
        size = sum(len(body) for body in files.values())
        out.write(f"aloader HTTP streaming demo: {args.shards} JSON Lines shards x "
                  f"{args.records:,} records ({size / 1e6:.1f} MB) served by "
                  f"http://127.0.0.1:{server.port}/ with {args.latency * 1e3:.0f} ms latency "
                  "per request\n")
        out.write(f"  JsonLines(urls, shuffle_shards=True, concurrency={args.concurrency})"
                  f".shuffle({args.buffer}) -> DataLoader(batch_size={args.batch_size})\n")
        status = anyio.run(_stream, args, server.urls, out)
        out.write(f"  {len(server.requests)} requests served, "
                  f"{server.max_open_connections} connections at most\n")
    return status
