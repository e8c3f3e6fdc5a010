"""A streaming LLM-style server: token budgets per batch, priorities and queue deadlines.

A fake language model (:class:`FakeLLM`) generates text for a batch of prompts the way a real
one spends its time: a prefill step whose cost grows with the batch's prompt tokens, then one
decode step per new token whose cost grows with the sequences still running. Its memory holds
``--token-budget`` tokens (prompt plus new tokens of every sequence in the batch), so a batch is
bounded by tokens, not by a count: ``aloader.Batcher(cost=..., max_batch_cost=...)``, as vLLM's
``max_num_batched_tokens``. Short prompts share a batch by the dozen; a long one takes the
budget's worth of room it needs; no batch ever exceeds it.

* ``POST /generate`` with ``{"prompt": "...", "max_tokens": 16, "priority": 0,
  "queue_timeout": 2.0}`` streams the completion, one token per line, as the model makes it.
  Higher ``priority`` is served first (a request waiting more than ``--promote-after`` seconds
  goes first whatever its priority); a request still queued after its ``queue_timeout`` is
  dropped and answered ``504``; a prompt that alone exceeds the budget ``413``; a full queue
  ``503``.
* ``GET /metrics`` -> the batcher's metrics.

By default the script starts the server on 127.0.0.1, sends ``--requests`` requests of mixed
lengths from ``--concurrency`` clients, checks every completion, prints tokens/s, latency and
the batches the budget formed, and shuts down::

    pip install "aloader[serve]"  # FastAPI and uvicorn
    python examples/llm_server.py --requests 400 --concurrency 64
    python examples/llm_server.py --serve-only --port 8000   # then:
    curl -sN -X POST localhost:8000/generate -H 'content-type: application/json' \\
        -d '{"prompt": "tell me a story", "max_tokens": 8}'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from inference_server import (  # the example beside this one
    ClientGone,
    LoadReport,
    serving,
    unless_disconnected,
)
from pydantic import BaseModel, Field

import aloader

# The fake model's costs, in seconds: prefill per prompt token, a decode step's fixed cost and
# its cost per running sequence. Batching pays: one decode step serves every sequence.
PREFILL_PER_TOKEN = 20e-6
STEP = 2e-3
STEP_PER_SEQUENCE = 20e-6


@dataclass(frozen=True)
class Completion:
    """One request: its prompt's tokens and how many new tokens it may get."""

    prompt: tuple[str, ...]
    max_tokens: int


def tokens(completion: Completion) -> int:
    """What a request holds in the model's memory at most: prompt plus new tokens."""
    return len(completion.prompt) + completion.max_tokens


def expected_completion(completion: Completion) -> list[str]:
    """What :class:`FakeLLM` answers: the prompt's words back, numbered, cycling."""
    words = completion.prompt or ("",)
    return [f"{words[i % len(words)]}#{i}" for i in range(completion.max_tokens)]


class FakeLLM:
    """Generates for a batch of completions, one step per new token (an async generator, so
    the batcher streams each caller its own tokens as they come)."""

    def __init__(self) -> None:
        self.batches: list[int] = []  # tokens of each batch, as the model saw them

    async def generate(self, batch: list[Completion]) -> AsyncIterator[list[Any]]:
        self.batches.append(sum(tokens(c) for c in batch))
        await asyncio.sleep(PREFILL_PER_TOKEN * sum(len(c.prompt) for c in batch))
        answers = [expected_completion(c) for c in batch]
        for step in range(max(c.max_tokens for c in batch)):
            running = sum(step < c.max_tokens for c in batch)
            await asyncio.sleep(STEP + STEP_PER_SEQUENCE * running)
            # A finished sequence gets StopAsyncIteration: its caller's stream ends there.
            yield [a[step] if step < len(a) else StopAsyncIteration for a in answers]


class GenerateRequest(BaseModel):
    prompt: str
    max_tokens: int = Field(16, ge=1, le=4096)
    priority: int = 0
    queue_timeout: float | None = Field(None, gt=0)


def create_app(
    model: FakeLLM | None = None,
    *,
    token_budget: int = 4096,
    max_queue: int = 1024,
    promote_after: float = 1.0,
    max_concurrent_batches: int = 1,
) -> FastAPI:
    """The FastAPI app; its lifespan owns a token-budgeted, streaming :class:`aloader.Batcher`."""
    llm = model if model is not None else FakeLLM()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with aloader.Batcher(
            llm.generate,
            max_batch_size=1024,  # the token budget is the bound that matters
            cost=tokens,
            max_batch_cost=token_budget,
            max_queue=max_queue,
            promote_after=promote_after,
            max_concurrent_batches=max_concurrent_batches,
        ) as batcher:
            app.state.batcher = batcher
            yield

    app = FastAPI(title="aloader LLM-style server", lifespan=lifespan)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Any:
        batcher: aloader.Batcher[Completion, str] = request.app.state.batcher
        completion = Completion(tuple(body.prompt.split()), body.max_tokens)
        try:
            stream = batcher.stream(
                completion, priority=body.priority, queue_timeout=body.queue_timeout
            )
        except aloader.BatchCostError as exc:
            return JSONResponse({"error": str(exc)}, 413)
        except aloader.QueueFullError:
            return JSONResponse({"error": "overloaded"}, 503, headers={"Retry-After": "1"})
        except aloader.BatcherClosedError:
            return JSONResponse({"error": "shutting down"}, 503)
        # Wait for the first token before answering 200: a request dropped by its deadline
        # (or failed by the model) still gets a status of its own.
        try:
            first = await unless_disconnected(request, stream.__anext__())
        except StopAsyncIteration:
            first = None
        except ClientGone:  # gone while queued: its request left the queue
            await stream.aclose()
            return Response(status_code=499)
        except TimeoutError:
            return JSONResponse({"error": "not started within queue_timeout"}, 504)
        except Exception as exc:
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, 500)

        async def lines() -> AsyncIterator[str]:
            try:
                if first is not None:
                    yield first + "\n"
                async for token in stream:
                    yield token + "\n"
            finally:
                await stream.aclose()  # a client that hangs up stops its share of the work

        return StreamingResponse(lines(), media_type="text/plain")

    @app.get("/metrics")
    async def metrics(request: Request) -> Any:
        return request.app.state.batcher.metrics()

    return app


# -- the load generator ---------------------------------------------------------------------------


def workload(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Mixed lengths: mostly short chats, some long documents (prompt words), short answers."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        words = rng.randint(400, 900) if rng.random() < 0.1 else rng.randint(5, 60)
        requests.append({
            "prompt": " ".join(f"w{i}_{j}" for j in range(words)),
            "max_tokens": rng.randint(4, 32),
            "priority": 1 if rng.random() < 0.2 else 0,
        })  # fmt: skip
    return requests


@dataclass
class TokenReport(LoadReport):
    """What the load generator saw, and the new tokens it received."""

    new_tokens: int = 0


async def load(port: int, requests: list[dict[str, Any]], concurrency: int) -> TokenReport:
    """Send ``requests`` from ``concurrency`` clients; check each streamed completion."""
    report = TokenReport()
    todo = list(reversed(requests))

    async def worker(client: aiohttp.ClientSession) -> None:
        while todo:
            body = todo.pop()
            start = time.perf_counter()
            async with client.post("/generate", json=body) as response:
                text = await response.text()
            report.latencies.append(time.perf_counter() - start)
            report.statuses[response.status] = report.statuses.get(response.status, 0) + 1
            if response.status == 200:
                got = text.splitlines()
                expected = expected_completion(
                    Completion(tuple(body["prompt"].split()), body["max_tokens"])
                )
                report.new_tokens += len(got)
                report.wrong += got != expected

    async with aiohttp.ClientSession(
        f"http://127.0.0.1:{port}", connector=aiohttp.TCPConnector(limit=concurrency)
    ) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        report.wall = time.perf_counter() - start
    return report


async def run_demo(args: argparse.Namespace) -> TokenReport:
    model = FakeLLM()
    app = create_app(model, token_budget=args.token_budget, promote_after=args.promote_after)
    async with serving(app, args.port) as port:
        report = await load(port, workload(args.requests), args.concurrency)
        async with (
            aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client,
            client.get("/metrics") as response,
        ):
            metrics = await response.json()
    ok = report.statuses.get(200, 0)
    print(
        f"served on 127.0.0.1:{port}: requests={sum(report.statuses.values())} ok={ok} "
        f"statuses={dict(sorted(report.statuses.items()))} wrong={report.wrong}"
    )
    print(
        f"{report.new_tokens / report.wall:,.0f} new tokens/s with {args.concurrency} clients; "
        f"latency p50 {report.percentile(0.5) * 1e3:.0f} ms, "
        f"p99 {report.percentile(0.99) * 1e3:.0f} ms"
    )
    print(
        f"batches: {metrics['batches']}, tokens per batch max {max(model.batches)} "
        f"(budget {args.token_budget}), mean {sum(model.batches) / len(model.batches):,.0f}"
    )
    return report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--promote-after", type=float, default=1.0, help="seconds")
    parser.add_argument("--serve-only", action="store_true", help="serve until Ctrl-C")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns 0 when every completion came back whole."""
    args = parse_args(argv)
    if args.serve_only:
        app = create_app(token_budget=args.token_budget, promote_after=args.promote_after)
        uvicorn.run(app, host="127.0.0.1", port=args.port)
        return 0
    report = asyncio.run(run_demo(args))
    return 0 if report.statuses == {200: args.requests} and not report.wrong else 1


if __name__ == "__main__":
    raise SystemExit(main())
