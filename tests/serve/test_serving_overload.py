"""The serving examples under overload and client disconnects, for real: uvicorn on 127.0.0.1,
clients that give up while their request is queued or running, streams that hang up after a
few tokens. The server must stay healthy (later requests answered right), never log an error,
answer each caller at most once, drain its batcher to empty, and shut down cleanly; a
streaming batch whose clients all hung up stops generating."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import numpy as np
import pytest
from test_serving_examples import Gate, load_example

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.anyio, pytest.mark.hostile]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn serves on asyncio


@pytest.fixture(scope="module")
def inference() -> Any:
    return load_example("inference_server")


@pytest.fixture(scope="module")
def llm(inference: Any) -> Any:
    return load_example("llm_server")


def accounted(metrics: dict[str, Any]) -> int:
    return sum(metrics[k] for k in ("completed", "failed", "timed_out", "cancelled", "dropped"))


async def until(predicate: Any, what: str) -> None:
    async with asyncio.timeout(10):
        while not predicate():
            await asyncio.sleep(0.002)


async def test_clients_that_give_up_under_overload_leave_a_healthy_server(
    anyio_backend: str, inference: Any, caplog: pytest.LogCaptureFixture
) -> None:
    model = inference.NumpyModel()
    gate = Gate(model)
    app = inference.create_app(gate, max_batch_size=4, max_queue=16, timeout=None)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((60, inference.IN_FEATURES)).astype(np.float32)
    caplog.set_level(logging.ERROR)
    async with asyncio.timeout(60), inference.serving(app) as port:
        url = f"http://127.0.0.1:{port}/predict"
        batcher = app.state.batcher

        async def impatient(x: np.ndarray) -> int | str:
            async with httpx.AsyncClient(timeout=0.05) as client:  # hangs up, its own socket
                try:
                    return (await client.post(url, json={"x": x.tolist()})).status_code
                except httpx.TimeoutException:
                    return "gave up"

        statuses = await asyncio.gather(*(impatient(x) for x in xs))
        assert set(statuses) == {503, "gave up"}  # the model is held: none is answered
        admitted = batcher.metrics()["submitted"]
        assert admitted == statuses.count("gave up") <= 4 + 16  # a batch running, 16 queued
        gate.opened.set()
        await until(lambda: not batcher.metrics()["queued"], "the queue to drain")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            answers = await asyncio.gather(
                *(client.post("/predict", json={"x": x.tolist()}) for x in xs[:16])
            )
        for x, answer in zip(xs[:16], answers, strict=True):
            assert answer.status_code == 200
            np.testing.assert_allclose(answer.json()["y"], model(x[None])[0], rtol=1e-5,
                                       atol=1e-6)
    metrics = batcher.metrics()
    assert batcher.closed and metrics["queued"] == metrics["running_batches"] == 0
    assert metrics["submitted"] == accounted(dict(metrics)) == admitted + 16
    assert metrics["rejected"] == statuses.count(503)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_streams_that_hang_up_stop_their_batch(
    anyio_backend: str, llm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Clients read two tokens of a long completion and hang up: once all of a batch's
    clients are gone its generation stops (the slot goes to the next batch), and the server
    goes on streaming whole completions to the clients that stay."""
    class Counting(llm.FakeLLM):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.steps = 0
            self.closed = 0

        async def generate(self, batch: list[Any]) -> Any:
            try:
                async for step in super().generate(batch):
                    self.steps += 1
                    yield step
            finally:
                self.closed += 1

    model = Counting()
    app = llm.create_app(model, token_budget=100_000)
    caplog.set_level(logging.ERROR)
    long = {"prompt": "a b c", "max_tokens": 2_000}  # 2,000 decode steps: seconds of work
    async with asyncio.timeout(60), llm.serving(app) as port:
        batcher = app.state.batcher

        async def hang_up_after(lines: int) -> list[str]:
            got: list[str] = []
            async with (
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
                client.stream("POST", "/generate", json=long) as response,
            ):
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    got.append(line)
                    if len(got) == lines:
                        break
            return got  # leaving the block closes the connection mid-stream

        heard = await asyncio.gather(*(hang_up_after(2) for _ in range(8)))
        assert all(len(lines) == 2 for lines in heard)
        await until(lambda: batcher.metrics()["running_batches"] == 0, "the batch to stop")
        assert model.steps < 2_000  # stopped early, not generated for nobody
        assert model.closed == len(model.batches)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            short = {"prompt": "x y", "max_tokens": 5}
            answer = await client.post("/generate", json=short)
        assert answer.status_code == 200
        assert answer.text.splitlines() == llm.expected_completion(llm.Completion(("x", "y"), 5))
    metrics = batcher.metrics()
    assert metrics["queued"] == metrics["running_batches"] == 0
    assert metrics["submitted"] == accounted(dict(metrics)) == 9
    assert metrics["cancelled"] == 8 and metrics["completed"] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
