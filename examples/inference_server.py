"""A real HTTP inference server that batches concurrent requests with ``aloader.Batcher``.

The server speaks a tiny subset of HTTP/1.1 (keep-alive, ``Content-Length`` bodies) on
127.0.0.1 with nothing but asyncio streams, and serves a numpy "model" (a two-layer MLP)
through a :class:`aloader.Batcher`:

* ``POST /predict`` with ``{"x": [D floats]}`` -> ``{"y": [K floats]}``
* ``GET /metrics`` -> the batcher's metrics as JSON
* a full queue answers ``503`` with ``Retry-After``, a request past its deadline ``504``,
  bad input ``400``.

By default the script starts the server, runs a load-generating client (``--concurrency``
keep-alive connections sending ``--requests`` requests in total), prints throughput, latency
and the batch sizes the batcher formed, then shuts the server down and exits::

    python examples/inference_server.py --requests 2000 --concurrency 64
    python examples/inference_server.py --serve-only --port 8000   # then:
    curl -s -X POST localhost:8000/predict -d '{"x": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]}'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import aloader

IN_FEATURES = 8
HIDDEN = 64
OUT_FEATURES = 4


class NumpyModel:
    """A fixed two-layer MLP: the cost of a batch grows far slower than its size."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.w1 = rng.standard_normal((IN_FEATURES, HIDDEN)).astype(np.float32)
        self.w2 = rng.standard_normal((HIDDEN, OUT_FEATURES)).astype(np.float32)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Predict a batch: ``(n, IN_FEATURES)`` -> ``(n, OUT_FEATURES)``."""
        return np.tanh(x @ self.w1) @ self.w2


# -- server --------------------------------------------------------------------------------------

REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    413: "Payload Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
MAX_BODY = 1 << 16


def http_response(status: int, body: object, extra_headers: str = "") -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {REASONS[status]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        f"{extra_headers}\r\n"
    )
    return head.encode() + payload


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    """Read one HTTP/1.1 request; ``None`` when the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    if length > MAX_BODY:
        raise ValueError("body too large")
    body = await reader.readexactly(length) if length else b""
    return method, path, body


class InferenceServer:
    """Serves :class:`NumpyModel` through a :class:`aloader.Batcher` over HTTP."""

    def __init__(self, batcher: aloader.Batcher[np.ndarray, np.ndarray]) -> None:
        self.batcher = batcher

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request = await read_request(reader)
                except (ValueError, asyncio.LimitOverrunError):
                    writer.write(http_response(413, {"error": "request too large"}))
                    break
                if request is None:
                    break
                writer.write(await self.respond(*request))
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def respond(self, method: str, path: str, body: bytes) -> bytes:
        if method == "GET" and path == "/metrics":
            return http_response(200, self.batcher.metrics())
        if method != "POST" or path != "/predict":
            return http_response(404, {"error": f"no route {method} {path}"})
        try:
            x = np.asarray(json.loads(body)["x"], dtype=np.float32)
            if x.shape != (IN_FEATURES,):
                raise ValueError(f"x should hold {IN_FEATURES} numbers, got shape {x.shape}")
        except (ValueError, KeyError, TypeError) as exc:
            # Checked before batching: one bad request must not fail a batch of good ones.
            return http_response(400, {"error": str(exc)})
        try:
            y = await self.batcher(x)
        except aloader.QueueFullError:
            return http_response(503, {"error": "overloaded"}, "Retry-After: 1\r\n")
        except aloader.BatcherClosedError:
            return http_response(503, {"error": "shutting down"})
        except TimeoutError:
            return http_response(504, {"error": "deadline exceeded"})
        except Exception as exc:
            # The model failed this request's batch (or returned a bad result): answer 500 and
            # keep serving. KeyboardInterrupt and SystemExit are no Exception: they stop us.
            return http_response(500, {"error": f"{type(exc).__name__}: {exc}"})
        return http_response(200, {"y": y.tolist()})


# -- client --------------------------------------------------------------------------------------


@dataclass
class LoadReport:
    """What the load generator saw."""

    requests: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else float("nan")


async def client_worker(
    port: int, next_index: list[int], total: int, report: LoadReport, seed: int
) -> None:
    """One keep-alive connection sending requests until ``total`` have been sent."""
    rng = np.random.default_rng(seed)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while next_index[0] < total:
            next_index[0] += 1
            body = json.dumps({"x": rng.standard_normal(IN_FEATURES).tolist()}).encode()
            start = time.perf_counter()
            writer.write(
                b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            payload = json.loads(await reader.readexactly(length))
            report.latencies.append(time.perf_counter() - start)
            report.statuses[status] = report.statuses.get(status, 0) + 1
            report.requests += 1
            if status == 200 and len(payload["y"]) != OUT_FEATURES:
                raise AssertionError(f"bad answer {payload}")
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def get_json(port: int, path: str) -> Any:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        return json.loads(await reader.readexactly(length))
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


# -- main ----------------------------------------------------------------------------------------


def make_batcher(args: argparse.Namespace) -> aloader.Batcher[np.ndarray, np.ndarray]:
    return aloader.Batcher(
        NumpyModel(),
        collate_fn=aloader.default_collate,  # stacks the (D,) inputs into one (n, D) array
        max_batch_size=args.max_batch_size,
        max_wait=args.max_wait,
        max_queue=args.max_queue,
        timeout=args.timeout,
        to_thread=False,  # a small matmul: cheaper on the loop than a thread hop
    )


async def run_demo(args: argparse.Namespace) -> LoadReport:
    """Start the server, load it with the client, print the figures, shut down."""
    async with make_batcher(args) as batcher:
        server = InferenceServer(batcher)
        tcp = await asyncio.start_server(server.handle, "127.0.0.1", args.port)
        port = tcp.sockets[0].getsockname()[1]
        report = LoadReport()
        async with tcp:
            start = time.perf_counter()
            next_index = [0]
            await asyncio.gather(
                *(
                    client_worker(port, next_index, args.requests, report, seed)
                    for seed in range(args.concurrency)
                )
            )
            report.wall = time.perf_counter() - start
            metrics = await get_json(port, "/metrics")
        tcp.close()
        await tcp.wait_closed()
    hist = {int(k): v for k, v in metrics["batch_size_histogram"].items()}
    mean_batch = sum(k * v for k, v in hist.items()) / max(1, sum(hist.values()))
    ok = report.statuses.get(200, 0)
    rejected = report.statuses.get(503, 0)
    print(
        f"served on 127.0.0.1:{port}: requests={report.requests} ok={ok} "
        f"rejected={rejected} other={report.requests - ok - rejected}"
    )
    print(
        f"throughput {report.requests / report.wall:,.0f} requests/s with "
        f"{args.concurrency} connections; latency p50 {report.percentile(0.5) * 1e3:.2f} ms, "
        f"p99 {report.percentile(0.99) * 1e3:.2f} ms"
    )
    print(f"batches: {metrics['batches']}, mean size {mean_batch:.1f}, histogram {hist}")
    return report


async def serve_forever(args: argparse.Namespace) -> None:
    async with make_batcher(args) as batcher:
        tcp = await asyncio.start_server(InferenceServer(batcher).handle, "127.0.0.1", args.port)
        print(f"serving on http://127.0.0.1:{tcp.sockets[0].getsockname()[1]} (Ctrl-C stops)")
        async with tcp:
            await tcp.serve_forever()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000, help="requests the client sends")
    parser.add_argument("--concurrency", type=int, default=64, help="client connections")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-wait", type=float, default=0.0, help="seconds")
    parser.add_argument("--max-queue", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=5.0, help="per-request deadline, s")
    parser.add_argument("--serve-only", action="store_true", help="serve until Ctrl-C")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the process exit status (0 when every request succeeded)."""
    args = parse_args(argv)
    if args.serve_only:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_forever(args))
        return 0
    report = asyncio.run(run_demo(args))
    return 0 if report.statuses.get(200, 0) == args.requests else 1


if __name__ == "__main__":
    raise SystemExit(main())
