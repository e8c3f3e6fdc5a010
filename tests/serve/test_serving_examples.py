"""The serving examples, run for real: FastAPI apps under uvicorn on 127.0.0.1, a real HTTP
client, the batcher owned by the app's lifespan.

``examples/inference_server.py`` batches a numpy model's requests (every answer checked against
the model run alone; 503 on a full queue, 504 past a deadline, 400 on a bad input, 500 when the
model fails a batch); ``examples/llm_server.py`` streams a fake language model's tokens under a
token budget (no batch above it, 413 for a prompt that alone exceeds it, 504 for a request
dropped by its queue deadline, priorities). Both demos (server plus load generator) run too.
The examples are asyncio programs (uvicorn), so these tests run on asyncio only.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn serves on asyncio


def load_example(name: str) -> Any:
    """Import ``examples/<name>.py`` (the llm example imports its sibling, so the folder goes
    on the path while it loads)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pydantic look their module up there
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


@pytest.fixture(scope="module")
def inference() -> Iterator[Any]:
    yield load_example("inference_server")


@pytest.fixture(scope="module")
def llm(inference: Any) -> Iterator[Any]:
    yield load_example("llm_server")


class Gate:
    """An async model held until opened; counts its batches."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.opened = asyncio.Event()
        self.batches = 0

    async def __call__(self, x: Any) -> Any:
        self.batches += 1
        await self.opened.wait()
        return self.fn(x)


# -- the inference server -----------------------------------------------------------------------


async def test_concurrent_http_requests_are_batched_and_each_answered_right(
    anyio_backend: str, inference: Any
) -> None:
    model = inference.NumpyModel()
    app = inference.create_app(model, max_batch_size=10, max_wait=60.0)
    xs = np.random.default_rng(0).standard_normal((50, inference.IN_FEATURES)).astype(np.float32)
    async with (
        inference.serving(app) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        responses = await asyncio.gather(
            *(client.post("/predict", json={"x": x.tolist()}) for x in xs)
        )
        metrics = (await client.get("/metrics")).json()
        batcher = app.state.batcher
    assert [r.status_code for r in responses] == [200] * 50
    for x, response in zip(xs, responses, strict=True):
        np.testing.assert_allclose(response.json()["y"], model(x[None])[0], rtol=1e-5, atol=1e-6)
    # max_wait is long: a batch went out each time ten requests were queued, never earlier.
    assert metrics["batch_size_histogram"] == {"10": 5}
    assert metrics["completed"] == 50
    assert batcher.closed  # the lifespan closed it when the server stopped


async def test_overload_deadlines_and_bad_input_get_their_statuses(
    anyio_backend: str, inference: Any
) -> None:
    gate = Gate(inference.NumpyModel())
    app = inference.create_app(gate, max_batch_size=1, max_queue=1, timeout=None)
    body = {"x": [0.5] * inference.IN_FEATURES}
    async with (
        inference.serving(app) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        batcher = app.state.batcher
        running = asyncio.ensure_future(client.post("/predict", json=body))
        while batcher.metrics()["running_batches"] < 1:
            await asyncio.sleep(0.001)
        queued = asyncio.ensure_future(client.post("/predict", json=body))
        while batcher.metrics()["queued"] < 1:
            await asyncio.sleep(0.001)
        refused = await client.post("/predict", json=body)
        short = await client.post("/predict", json={"x": [1.0, 2.0]})
        malformed = await client.post("/predict", json={"y": 1})
        gate.opened.set()
        assert (await running).status_code == 200 and (await queued).status_code == 200
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert short.status_code == 400 and "should hold 8 numbers" in short.text
    assert malformed.status_code == 422  # FastAPI's validation, before the batcher

    late = inference.create_app(Gate(inference.NumpyModel()), timeout=0.01)
    async with (
        inference.serving(late) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        timed_out = await client.post("/predict", json=body)
        late.state.batcher._fn.opened.set()
    assert timed_out.status_code == 504


async def test_a_model_that_fails_a_batch_gets_500_and_the_server_goes_on(
    anyio_backend: str, inference: Any
) -> None:
    class LenOnly:
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

    calls = 0

    def model(xs: Any) -> Any:
        nonlocal calls
        calls += 1
        return LenOnly(len(xs)) if calls == 1 else xs[:, :4] * 2

    app = inference.create_app(model)
    body = {"x": [0.5] * inference.IN_FEATURES}
    async with (
        inference.serving(app) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        failed = await client.post("/predict", json=body)
        served = await client.post("/predict", json=body)
    assert failed.status_code == 500
    assert "BatchResultError" in failed.text and "cannot be indexed" in failed.text
    assert served.status_code == 200 and served.json() == {"y": [1.0] * 4}


async def test_shutdown_answers_the_request_in_flight(anyio_backend: str, inference: Any) -> None:
    gate = Gate(inference.NumpyModel())
    app = inference.create_app(gate)
    async with httpx.AsyncClient() as client:
        async with inference.serving(app) as port:
            pending = asyncio.ensure_future(
                client.post(
                    f"http://127.0.0.1:{port}/predict", json={"x": [0.5] * inference.IN_FEATURES}
                )
            )
            while not gate.batches:
                await asyncio.sleep(0.001)
            asyncio.get_running_loop().call_later(0.05, gate.opened.set)
        # uvicorn let the request finish, then the lifespan drained and closed the batcher.
        assert (await pending).status_code == 200
    assert app.state.batcher.closed and app.state.batcher.metrics()["completed"] == 1


async def test_a_client_that_disconnects_takes_its_request_out_of_the_queue(
    anyio_backend: str, inference: Any
) -> None:
    """Starlette does not cancel a handler whose client has gone: the example does, so an
    abandoned request leaves the batcher's queue and the model never runs it."""
    gate = Gate(inference.NumpyModel())
    app = inference.create_app(gate, max_batch_size=1, timeout=None)
    body = {"x": [0.5] * inference.IN_FEATURES}
    async with (
        inference.serving(app) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as leaving,
    ):
        batcher = app.state.batcher
        running = asyncio.ensure_future(client.post("/predict", json=body))
        while batcher.metrics()["running_batches"] < 1:
            await asyncio.sleep(0.001)
        abandoned = asyncio.ensure_future(leaving.post("/predict", json=body))
        while batcher.metrics()["queued"] < 1:
            await asyncio.sleep(0.001)
        abandoned.cancel()  # the client gives up: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await abandoned
        while batcher.metrics()["queued"]:
            await asyncio.sleep(0.001)
        gate.opened.set()
        assert (await running).status_code == 200
        served = await client.post("/predict", json=body)
        assert served.status_code == 200
        metrics = batcher.metrics()
    assert gate.batches == 2  # the first request's batch and the last one's, never the other
    assert metrics["cancelled"] == 1 and metrics["completed"] == 2


def test_the_inference_demo_runs(inference: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert inference.main(["--requests", "60", "--concurrency", "6", "--max-batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "requests/s" in out and "ok=60" in out and "wrong=0" in out


# -- the LLM-style server -----------------------------------------------------------------------


async def test_streams_every_completion_whole_and_no_batch_exceeds_the_budget(
    anyio_backend: str, llm: Any
) -> None:
    model = llm.FakeLLM()
    app = llm.create_app(model, token_budget=1000)
    requests = llm.workload(40, seed=3)
    for body in requests:  # keep every prompt under the budget here
        body["prompt"] = " ".join(body["prompt"].split()[:300])
    async with (
        llm.serving(app) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
    ):
        responses = await asyncio.gather(*(client.post("/generate", json=b) for b in requests))
    for body, response in zip(requests, responses, strict=True):
        assert response.status_code == 200
        completion = llm.Completion(tuple(body["prompt"].split()), body["max_tokens"])
        assert response.text.splitlines() == llm.expected_completion(completion)
    assert max(model.batches) <= 1000 and len(model.batches) < 40


async def test_the_llm_server_answers_413_504_and_serves_priorities_first(
    anyio_backend: str, llm: Any
) -> None:
    class Held(llm.FakeLLM):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.opened = asyncio.Event()
            self.order: list[str] = []

        async def generate(self, batch: list[Any]) -> Any:
            self.order.extend(" ".join(c.prompt) for c in batch)
            await self.opened.wait()
            async for step in super().generate(batch):
                yield step

    model = Held()
    app = llm.create_app(model, token_budget=20, promote_after=60.0)
    async with (
        llm.serving(app) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
    ):
        batcher = app.state.batcher
        too_long = await client.post("/generate", json={"prompt": "x " * 30, "max_tokens": 1})
        first = asyncio.ensure_future(
            client.post("/generate", json={"prompt": "first", "max_tokens": 15})
        )
        while batcher.metrics()["running_batches"] < 1:
            await asyncio.sleep(0.001)
        bodies = [
            {"prompt": "low", "max_tokens": 15, "priority": 0},
            {"prompt": "dropped", "max_tokens": 15, "queue_timeout": 0.01},
            {"prompt": "high", "max_tokens": 15, "priority": 5},
        ]
        pending = []
        for body in bodies:
            pending.append(asyncio.ensure_future(client.post("/generate", json=body)))
            while batcher.metrics()["submitted"] < len(pending) + 1:
                await asyncio.sleep(0.001)
        dropped = await pending[1]
        model.opened.set()
        answers = [await first, await pending[0], await pending[2]]
    assert too_long.status_code == 413 and "max_batch_cost=20" in too_long.text
    assert dropped.status_code == 504
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert model.order == ["first", "high", "low"]  # one per batch: 16 tokens of 20 each


def test_the_llm_demo_runs(llm: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert llm.main(["--requests", "40", "--concurrency", "8", "--token-budget", "2048"]) == 0
    out = capsys.readouterr().out
    assert "new tokens/s" in out and "wrong=0" in out and "(budget 2048)" in out
