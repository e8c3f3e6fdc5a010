"""aloader.sample_rng(): per-sample randomness that does not depend on who fetches the sample."""

from __future__ import annotations

import json
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

import aloader
from aloader import DataLoader, SampleRngError, sample_rng

N = 20


class Aug(aloader.Dataset[Any]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> Any:
        rng = sample_rng()
        assert sample_rng() is rng  # the same stream for the whole fetch of the sample
        assert sample_rng(index) is not None
        return np.array([index, rng.integers(1 << 40), rng.integers(1 << 40)])


class AsyncAug(Aug):
    async def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        await anyio.sleep(0.001 * (index % 3))
        return Aug.__getitem__(self, index)


class BatchAug(Aug):
    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [np.array([i, sample_rng(i).integers(1 << 40), sample_rng(i).integers(1 << 40)])
                for i in indices]


def draws(loader: DataLoader[Any], epochs: int = 2) -> list[dict[int, list[int]]]:
    out = []
    for _ in range(epochs):
        rows = [row for batch in loader for row in np.atleast_2d(batch).tolist()]
        out.append({row[0]: row[1:] for row in rows})
        assert len(out[-1]) == len(rows)
    return out


def reference() -> list[dict[int, list[int]]]:
    return draws(DataLoader(Aug(), batch_size=3, shuffle=True, generator=5))


@pytest.mark.parametrize("options", [
    {"max_concurrency": 4},
    {"in_order": False, "max_concurrency": 3},
    {"batch_size": None},
    {"dataset": AsyncAug()},
    {"dataset": AsyncAug(), "in_order": False, "max_concurrency": 2},
    {"dataset": BatchAug()},
    {"shuffle": False},
])
def test_same_draws_whatever_runs_the_fetch(options: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {"batch_size": 3, "shuffle": True, "generator": 5}
    kwargs.update(options)
    dataset = kwargs.pop("dataset", Aug())
    ref = reference()
    got = draws(DataLoader(dataset, **kwargs))
    if isinstance(dataset, BatchAug):
        # sample_rng(i) in __getitems__ is sample_rng() in __getitem__ ... continued: the
        # first draw of each is the same stream's first draw.
        assert [{i: v[:1] for i, v in e.items()} for e in got] == [
            {i: v[:1] for i, v in e.items()} for e in ref]
    else:
        assert got == ref
    assert ref[0] != ref[1]  # every epoch its own streams
    assert len({tuple(v) for v in ref[0].values()}) == N  # every sample its own stream


@pytest.mark.parametrize("workers", [2])
def test_same_draws_with_worker_processes(workers: int) -> None:
    ref = reference()
    assert draws(DataLoader(Aug(), batch_size=3, shuffle=True, generator=5,
                            num_workers=workers)) == ref
    assert draws(DataLoader(AsyncAug(), batch_size=3, shuffle=True, generator=5,
                            num_workers=workers, persistent_workers=True,
                            in_order=False)) == ref


def test_same_draws_across_a_resume() -> None:
    ref = reference()
    loader = DataLoader(Aug(), batch_size=3, shuffle=True, generator=5)
    it = iter(loader)
    first = [row for _ in range(2) for row in next(it).tolist()]
    state = json.loads(json.dumps(loader.state_dict()))
    it.close()
    fresh = DataLoader(Aug(), batch_size=3, shuffle=True, generator=5)
    fresh.load_state_dict(state)
    rest = [row for batch in fresh for row in batch.tolist()]
    assert {row[0]: row[1:] for row in first + rest} == ref[0]
    assert draws(fresh, 1) == ref[1:]


def test_the_seed_is_the_loaders() -> None:
    assert DataLoader(Aug(), generator=7).sample_seed == 7
    a = DataLoader(Aug(), generator=np.random.default_rng(1)).sample_seed
    assert a == DataLoader(Aug(), generator=np.random.default_rng(1)).sample_seed
    assert draws(DataLoader(Aug(), batch_size=3, shuffle=True, generator=6), 1) != reference()[:1]


def test_outside_a_fetch_it_raises() -> None:
    with pytest.raises(SampleRngError, match="only available while a DataLoader fetches"):
        sample_rng()
    assert issubclass(SampleRngError, RuntimeError)
    assert issubclass(SampleRngError, aloader.AloaderError)

    class NoIndex(Aug):
        def __getitems__(self, indices: list[int]) -> list[Any]:
            sample_rng()
            return []

    with pytest.raises(SampleRngError, match="needs the sample's index"):
        list(DataLoader(NoIndex(), batch_size=2))


def test_non_int_indices_have_streams_too() -> None:
    class Keys(aloader.Dataset[Any]):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, key: str) -> Any:
            return int(sample_rng().integers(1 << 40))

    first = list(DataLoader(Keys(), batch_size=None, sampler=["a", "b"], generator=1))
    again = list(DataLoader(Keys(), batch_size=None, sampler=["b", "a"], generator=1))
    assert first == again[::-1] and first[0] != first[1]


class AsyncDraw(aloader.Dataset[Any]):
    """One draw per fetch, on the loop: its stream must be the sample's own, fresh per fetch."""

    def __len__(self) -> int:
        return N

    async def __getitem__(self, index: int) -> Any:
        await anyio.sleep(0)
        first = sample_rng()
        assert sample_rng() is first  # the same generator for the whole fetch
        return [index, int(first.integers(1 << 40))]


@pytest.mark.anyio
async def test_a_worker_fetching_an_index_again_draws_a_fresh_stream(anyio_backend: str) -> None:
    # One fetch worker (max_concurrency=1) fetches index 3 four times in a row: every fetch
    # starts the sample's stream afresh, as a fetch by another worker would.
    loader = DataLoader(AsyncDraw(), batch_size=2, sampler=[3, 3, 1, 3, 3], generator=9,
                        max_concurrency=1, collate_fn=list)
    rows = [row async for batch in loader for row in batch]
    draws_of_3 = {tuple(row) for row in rows if row[0] == 3}
    assert len(rows) == 5 and len(draws_of_3) == 1
    wide = DataLoader(AsyncDraw(), batch_size=2, sampler=[3, 1], generator=9,
                      max_concurrency=8, collate_fn=list)
    assert {tuple(row) for batch in [b async for b in wide] for row in batch} == (
        draws_of_3 | {tuple(row) for row in rows if row[0] == 1})


@pytest.mark.anyio
async def test_on_the_loop_sample_rng_is_a_fetchs_only(anyio_backend: str) -> None:
    # Between fetches (collate_fn runs in the fetch worker's task) sample_rng raises; a task
    # the fetch starts shares its sample's scope.
    class Spawning(AsyncDraw):
        async def __getitem__(self, index: int) -> Any:  # type: ignore[override]
            got: list[Any] = []

            async def child() -> None:
                got.append(int(sample_rng().integers(1 << 40)))

            async with anyio.create_task_group() as tg:
                tg.start_soon(child)
            # A thread the fetch runs shares it too (anyio runs it in a copy of the context).
            in_thread = await anyio.to_thread.run_sync(lambda: sample_rng().integers(1 << 40))
            assert in_thread != got[0]  # the same stream, continued
            return [index, got[0]]

    assert [row async for batch in DataLoader(Spawning(), batch_size=2, generator=9,
                                              collate_fn=list) for row in batch] == [
        row async for batch in DataLoader(AsyncDraw(), batch_size=2, generator=9,
                                          collate_fn=list) for row in batch]

    def collate(samples: list[Any]) -> Any:
        return sample_rng()

    with pytest.raises(SampleRngError, match="only available while"):
        async for _ in DataLoader(AsyncDraw(), batch_size=2, collate_fn=collate):
            pass


@pytest.mark.anyio
async def test_a_task_outliving_its_fetch_gets_no_stream(anyio_backend: str) -> None:
    # The fetch of index 0 leaves a task running (in a task group of the caller's); it draws
    # while the same worker fetches index 1. It must not get index 1's stream, nor take a
    # draw from it (index 1's sample would change): SampleRngError, as after its fetch.
    got: list[Any] = []
    moved_on, drawn = anyio.Event(), anyio.Event()

    async def orphan() -> None:
        await moved_on.wait()
        try:
            got.append(int(sample_rng().integers(1 << 40)))
        except SampleRngError as exc:
            got.append(exc)
        drawn.set()

    async with anyio.create_task_group() as outer:
        class Leaving(AsyncDraw):
            async def __getitem__(self, index: int) -> Any:  # type: ignore[override]
                if index == 0:
                    outer.start_soon(orphan)
                elif index == 1:
                    moved_on.set()
                    await drawn.wait()
                return await AsyncDraw.__getitem__(self, index)

        rows = [row async for batch in DataLoader(Leaving(), batch_size=2, generator=9,
                                                  max_concurrency=1, collate_fn=list)
                for row in batch]
    assert len(got) == 1 and isinstance(got[0], SampleRngError)
    assert rows == [row async for batch in DataLoader(AsyncDraw(), batch_size=2, generator=9,
                                                      collate_fn=list) for row in batch]


@pytest.mark.anyio
async def test_a_loader_inside_a_fetch_has_its_own_streams(anyio_backend: str) -> None:
    # The inner loader's fetch workers start in the outer fetch's context: their own scope
    # and fetch numbers replace the outer ones.
    def inner() -> DataLoader[Any]:
        return DataLoader(AsyncDraw(), batch_size=2, generator=3, collate_fn=list)

    class Outer(AsyncDraw):
        async def __getitem__(self, index: int) -> Any:  # type: ignore[override]
            own = int(sample_rng().integers(1 << 40))
            return [own, [row async for batch in inner() for row in batch]]

    expected = [row async for batch in inner() for row in batch]
    # One fetch worker: its second and third fetches are numbered (the first asked).
    rows = [row async for batch in DataLoader(Outer(), batch_size=2, sampler=[0, 1, 2],
                                              max_concurrency=1, generator=9, collate_fn=list)
            for row in batch]
    assert [row[1] for row in rows] == [expected] * 3
