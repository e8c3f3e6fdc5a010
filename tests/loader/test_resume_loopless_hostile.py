"""Attacks on a DataLoader's resume over a loopless stream (its batches cut inline by
``_take``): a state taken after every batch of an epoch, and one taken when the epoch has
begun (``iter()``, ``__aiter__()``) but delivered nothing yet, resume exactly where the
uninterrupted run was."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from aloader import DataLoader, TextLines

pytestmark = pytest.mark.hostile


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("resume")
    for s in range(4):
        body = "".join(f"s{s}-{i}\n" for i in range(11 + 5 * s)).encode()
        (directory / f"t{s}.txt").write_bytes(body)
        (directory / f"g{s}.txt.gz").write_bytes(gzip.compress(body))
    return directory


def make(directory: Path, kind: str) -> DataLoader[Any]:
    pattern = "t*.txt" if kind == "text" else "g*.gz"
    source: Any = TextLines(str(directory / pattern), chunk_size=16, shuffle_shards=True,
                            seed=2)
    if kind == "shuffled":
        source = source.shuffle(5, seed=1)
    return DataLoader(source, batch_size=7, collate_fn=list)


def through_json(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["text", "gzip", "shuffled"])
def test_a_state_after_every_batch_resumes_exactly(shards: Path, kind: str) -> None:
    reference = make(shards, kind)
    epochs = [list(reference) for _ in range(3)]
    n = len(epochs[1])
    for k in sorted({1, 2, n // 2, n - 1, n}):
        loader = make(shards, kind)
        list(loader)
        iterator = iter(loader)
        head = [next(iterator) for _ in range(k)]
        state = through_json(loader.state_dict())
        del iterator
        fresh = make(shards, kind)
        fresh.load_state_dict(state)
        assert head + list(fresh) == epochs[1], k
        assert list(fresh) == epochs[2], k


async def test_a_state_after_every_batch_resumes_exactly_async(shards: Path,
                                                               anyio_backend: str) -> None:
    reference = make(shards, "gzip")
    epochs = [[b async for b in reference] for _ in range(3)]
    n = len(epochs[1])
    for k in sorted({1, 2, n // 2, n - 1, n}):
        loader = make(shards, "gzip")
        _ = [b async for b in loader]
        iterator = loader.__aiter__()
        head = [await iterator.__anext__() for _ in range(k)]
        state = through_json(loader.state_dict())
        await iterator.aclose()  # type: ignore[attr-defined]
        fresh = make(shards, "gzip")
        fresh.load_state_dict(state)
        assert head + [b async for b in fresh] == epochs[1], k
        assert [b async for b in fresh] == epochs[2], k


@pytest.mark.parametrize("kind", ["text", "gzip", "shuffled"])
def test_a_state_when_the_epoch_has_begun(shards: Path, kind: str) -> None:
    reference = make(shards, kind)
    epochs = [list(reference) for _ in range(3)]
    loader = make(shards, kind)
    list(loader)
    iterator = iter(loader)
    state = through_json(loader.state_dict())  # a checkpoint at the start of epoch 1
    assert next(iterator) == epochs[1][0]
    fresh = make(shards, kind)
    fresh.load_state_dict(state)
    assert list(fresh) == epochs[1]


def test_a_state_when_the_async_epoch_has_begun(shards: Path) -> None:
    async def main() -> tuple[list[Any], list[Any]]:
        reference = make(shards, "text")
        epochs = [[b async for b in reference] for _ in range(2)]
        loader = make(shards, "text")
        _ = [b async for b in loader]
        iterator = loader.__aiter__()
        state = through_json(loader.state_dict())
        await iterator.aclose()  # type: ignore[attr-defined]
        fresh = make(shards, "text")
        fresh.load_state_dict(state)
        return [b async for b in fresh], epochs[1]

    resumed, expected = anyio.run(main)
    assert resumed == expected
