"""aloader.from_ray over a stand-in with Ray's DataIterator interface (``iter_rows()``), so that
these run without Ray; tests/compat/test_ray_train.py runs the same against a local Ray.

What is pinned: every row once per epoch in Ray's order, a new iteration per epoch, the rows
pulled off the event loop's thread, Ray's iteration closed when the epoch is left early,
resume by counting (exact where the order repeats), and the refusals (no loader workers, no
object without ``iter_rows``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aloader
from aloader import DataLoader, from_ray

pytestmark = pytest.mark.anyio


class FakeDataIterator:
    """Ray's DataIterator as from_ray uses it: ``iter_rows()`` gives a new generator of dict
    rows per call (an epoch), whose ``close()`` stops the iteration."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.iterations = 0
        self.closed = 0
        self.threads: set[int] = set()

    def iter_rows(self) -> Iterator[dict[str, Any]]:
        self.iterations += 1
        return self._rows()

    def _rows(self) -> Iterator[dict[str, Any]]:
        try:
            for i in range(self.n):
                self.threads.add(threading.get_ident())
                yield {"id": i, "x": float(i) / 2}
        finally:
            self.closed += 1


def ids(batches: list[Any]) -> list[int]:
    return [int(i) for batch in batches for i in batch["id"]]


async def test_every_row_once_per_epoch_in_order(anyio_backend: str) -> None:
    source = FakeDataIterator(1000)
    loader = DataLoader(from_ray(source), batch_size=64)
    for _ in range(2):
        batches = [b async for b in loader]
        assert ids(batches) == list(range(1000))
        assert [len(b["id"]) for b in batches] == [64] * 15 + [40]
        assert batches[0]["x"].tolist() == [i / 2 for i in range(64)]
    assert source.iterations == 2  # each epoch is a new iteration of Ray's
    assert threading.get_ident() not in source.threads  # Ray's blocking pulls, in a thread
    await loader.aclose()


def test_the_sync_for_and_the_stream_alone() -> None:
    source = FakeDataIterator(300)
    assert [row["id"] for row in from_ray(source)] == list(range(300))
    loader = DataLoader(from_ray(source).map(lambda row: row["id"] * 2), batch_size=100)
    assert [b.tolist() for b in loader] == [list(range(0, 200, 2)), list(range(200, 400, 2)),
                                           list(range(400, 600, 2))]


async def test_leaving_an_epoch_early_closes_rays_iteration(anyio_backend: str) -> None:
    source = FakeDataIterator(10_000)
    loader = DataLoader(from_ray(source), batch_size=10)
    async for _batch in loader:
        break
    await loader.aclose()
    with anyio.fail_after(10):
        while not source.closed:
            await anyio.sleep(0.01)
    assert source.closed == 1


class StuckDataIterator(FakeDataIterator):
    """Its second block never comes until ``go`` is set (a cluster that stopped answering)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.go = threading.Event()

    def _rows(self) -> Iterator[dict[str, Any]]:
        for row in super()._rows():
            if row["id"] == 300:
                self.go.wait(20)
                self.answered = True
            yield row

    answered = False


async def test_a_stuck_ray_does_not_hold_a_cancel(anyio_backend: str) -> None:
    source = StuckDataIterator(1000)
    loader = DataLoader(from_ray(source), batch_size=100)
    got = []
    with anyio.fail_after(30):  # a hang guard: the cancel below must not wait for Ray
        with anyio.move_on_after(1):
            async for batch in loader:
                got.append(batch)
        await loader.aclose()
    assert len(got) == 2  # the rows before the stuck block
    assert not source.answered  # the loader was closed while Ray had not answered
    source.go.set()


async def test_resume_by_counting(anyio_backend: str) -> None:
    source = FakeDataIterator(700)
    full = [b async for b in DataLoader(from_ray(source), batch_size=50)]
    saved = DataLoader(from_ray(source), batch_size=50)
    iterator = saved.__aiter__()
    for _ in range(5):
        await iterator.__anext__()
    state = json.loads(json.dumps(saved.state_dict()))
    await iterator.aclose()
    await saved.aclose()
    assert state["iterable"]["replicas"][0]["state"]["position"] == {"stage": "count",
                                                                      "skip": 250}
    resumed = DataLoader(from_ray(source), batch_size=50)
    resumed.load_state_dict(state)
    assert ids([b async for b in resumed]) == ids(full[5:])
    assert ids([b async for b in resumed]) == list(range(700))  # then whole epochs again
    await resumed.aclose()


def test_loader_workers_are_refused() -> None:
    loader = DataLoader(from_ray(FakeDataIterator(10)), batch_size=5, num_workers=1)
    with pytest.raises(ValueError, match="num_workers=0"):
        list(loader)


@pytest.mark.hostile
@pytest.mark.parametrize("obj", [[1, 2, 3], 42, aloader.as_stream([1, 2])])
def test_objects_without_rays_interface_are_refused(obj: Any) -> None:
    with pytest.raises(TypeError, match="from_ray needs a Ray Dataset or DataIterator"):
        from_ray(obj)
