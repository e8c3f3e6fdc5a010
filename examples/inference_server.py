"""An HTTP inference server on FastAPI and uvicorn whose model sees batches (``aloader.Batcher``).

The app's lifespan owns the batcher: it starts with the server and drains on shutdown (queued
and running requests are answered before the process exits). Each request awaits its own
result while the batcher groups concurrent requests into batches for a numpy "model" (a
two-layer MLP):

* ``POST /predict`` with ``{"x": [8 floats]}`` -> ``{"y": [4 floats]}``
* ``GET /metrics`` -> the batcher's metrics as JSON
* a full queue answers ``503`` with ``Retry-After``, a request past its deadline ``504``,
  an input of the wrong shape ``400`` (before batching: one bad request never fails a batch of
  good ones), a model that fails its batch ``500``;
* a request whose client disconnects before its answer leaves the queue (the model never sees
  it): see :func:`unless_disconnected`.

By default the script starts the server on 127.0.0.1, loads it with an HTTP client
(``--concurrency`` keep-alive connections sending ``--requests`` requests), prints throughput,
latency and the batch sizes the batcher formed, then shuts the server down::

    pip install "aloader[serve]"  # FastAPI and uvicorn
    python examples/inference_server.py --requests 2000 --concurrency 64
    python examples/inference_server.py --serve-only --port 8000   # then:
    curl -s -X POST localhost:8000/predict -H 'content-type: application/json' \\
        -d '{"x": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]}'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import numpy as np
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

import aloader

T = TypeVar("T")

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


class PredictRequest(BaseModel):
    x: list[float]


# -- the app -------------------------------------------------------------------------------------


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_disconnected(request: Request, call: Awaitable[T]) -> T:
    """``call``'s result, unless the client disconnects first: then ``call`` is cancelled
    (a request still queued leaves the batcher's queue, and no batch carries it) and
    :class:`ClientGone` is raised. Starlette does not cancel a handler whose client has gone,
    so without this an abandoned request would still take its place in a batch.

    Once the body has been read, the next ASGI message is ``http.disconnect``: awaiting it
    costs nothing while the client waits.
    """

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(call)
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (the server stopping)
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientGone
    return work.result()


def create_app(
    model: Callable[[Any], Any] | None = None,
    *,
    max_batch_size: int = 32,
    max_wait: float = 0.0,
    max_queue: int = 1024,
    timeout: float | None = 5.0,
) -> FastAPI:
    """The FastAPI app; its lifespan owns a :class:`aloader.Batcher` around ``model``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with aloader.Batcher(
            model if model is not None else NumpyModel(),
            collate_fn=aloader.default_collate,  # stacks the (D,) inputs into one (n, D) array
            max_batch_size=max_batch_size,
            max_wait=max_wait,
            max_queue=max_queue,
            timeout=timeout,
            to_thread=False,  # a small matmul: cheaper on the loop than a thread hop
        ) as batcher:
            app.state.batcher = batcher
            yield  # the server runs; on shutdown the batcher drains, then closes

    app = FastAPI(title="aloader inference server", lifespan=lifespan)

    @app.post("/predict")
    async def predict(body: PredictRequest, request: Request) -> Any:
        x = np.asarray(body.x, dtype=np.float32)
        if x.shape != (IN_FEATURES,):
            raise HTTPException(400, f"x should hold {IN_FEATURES} numbers, got {x.shape[0]}")
        batcher: aloader.Batcher[np.ndarray, np.ndarray] = request.app.state.batcher
        try:
            y = await unless_disconnected(request, batcher(x))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the client has gone
        except aloader.QueueFullError:
            return JSONResponse({"error": "overloaded"}, 503, headers={"Retry-After": "1"})
        except aloader.BatcherClosedError:
            return JSONResponse({"error": "shutting down"}, 503)
        except TimeoutError:
            return JSONResponse({"error": "deadline exceeded"}, 504)
        except Exception as exc:
            # The model failed this request's batch (or returned a bad result): answer 500 and
            # keep serving. KeyboardInterrupt and SystemExit are no Exception: they stop us.
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, 500)
        return {"y": np.asarray(y).tolist()}

    @app.get("/metrics")
    async def metrics(request: Request) -> Any:
        return request.app.state.batcher.metrics()

    return app


@contextlib.asynccontextmanager
async def serving(app: Any, port: int = 0) -> AsyncIterator[int]:
    """Run ``app`` under uvicorn on 127.0.0.1 in this event loop; yield its port, then shut
    it down gracefully (in-flight requests finish, then the lifespan's batcher drains)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():  # the lifespan or the bind failed: say why
            await task
            raise RuntimeError("uvicorn stopped before it started")
        await asyncio.sleep(0.005)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


# -- the load generator ---------------------------------------------------------------------------


@dataclass
class LoadReport:
    """What the load generator saw."""

    requests: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    wrong: int = 0
    wall: float = 0.0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else float("nan")


async def load(port: int, requests: int, concurrency: int) -> LoadReport:
    """``concurrency`` keep-alive connections send ``requests`` requests in total; every
    answer is checked against the model run on its own."""
    report = LoadReport()
    reference = NumpyModel()
    left = [requests]

    async def worker(client: aiohttp.ClientSession, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while left[0] > 0:
            left[0] -= 1
            x = rng.standard_normal(IN_FEATURES).astype(np.float32)
            start = time.perf_counter()
            async with client.post("/predict", json={"x": x.tolist()}) as response:
                answer = await response.json()
            report.latencies.append(time.perf_counter() - start)
            report.statuses[response.status] = report.statuses.get(response.status, 0) + 1
            report.requests += 1
            if response.status == 200:
                expected = reference(x[None])[0]
                if not np.allclose(answer["y"], expected, rtol=1e-5, atol=1e-5):
                    report.wrong += 1

    # aiohttp's client: httpx's connection pool serializes under many concurrent requests.
    async with aiohttp.ClientSession(
        f"http://127.0.0.1:{port}", connector=aiohttp.TCPConnector(limit=concurrency)
    ) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client, seed) for seed in range(concurrency)))
        report.wall = time.perf_counter() - start
    return report


async def run_demo(args: argparse.Namespace) -> LoadReport:
    """Start the server, load it with the client, print the figures, shut down."""
    app = create_app(
        max_batch_size=args.max_batch_size, max_wait=args.max_wait, max_queue=args.max_queue,
        timeout=args.timeout,
    )  # fmt: skip
    async with serving(app, args.port) as port:
        report = await load(port, args.requests, args.concurrency)
        async with (
            aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client,
            client.get("/metrics") as response,
        ):
            metrics = await response.json()
    hist = {int(k): v for k, v in metrics["batch_size_histogram"].items()}
    mean_batch = sum(k * v for k, v in hist.items()) / max(1, sum(hist.values()))
    ok = report.statuses.get(200, 0)
    rejected = report.statuses.get(503, 0)
    print(
        f"served on 127.0.0.1:{port}: requests={report.requests} ok={ok} "
        f"rejected={rejected} other={report.requests - ok - rejected} wrong={report.wrong}"
    )
    print(
        f"throughput {report.requests / report.wall:,.0f} requests/s with "
        f"{args.concurrency} connections; latency p50 {report.percentile(0.5) * 1e3:.2f} ms, "
        f"p99 {report.percentile(0.99) * 1e3:.2f} ms"
    )
    print(f"batches: {metrics['batches']}, mean size {mean_batch:.1f}, histogram {hist}")
    return report


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
        app = create_app(
            max_batch_size=args.max_batch_size, max_wait=args.max_wait,
            max_queue=args.max_queue, timeout=args.timeout,
        )  # fmt: skip
        uvicorn.run(app, host="127.0.0.1", port=args.port)
        return 0
    report = asyncio.run(run_demo(args))
    return 0 if report.statuses.get(200, 0) == args.requests and not report.wrong else 1


if __name__ == "__main__":
    raise SystemExit(main())
