"""Attacks on the map pipeline's work queue (``_WorkQueue``) and trio's third window: a
DataLoader over async map datasets, batch after batch against torch's DataLoader on the same
samplers and generators, with samplers of odd lengths, batch samplers with empty and duplicate
batches, ``max_concurrency`` 1 and 10,000, a dataset failing on one index (with and without
``max_failures``), and a KeyboardInterrupt in a fetch.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aloader

pytestmark = pytest.mark.hostile

torch = pytest.importorskip("torch")
tud = pytest.importorskip("torch.utils.data")


class TorchData(tud.Dataset):  # type: ignore[misc]
    def __init__(self, n: int, bad: int | None = None) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            raise ValueError(f"bad index {i}")
        return {"i": i, "x": np.float32(i) * 2}


class AsyncData(aloader.Dataset[Any]):
    """TorchData's samples from an ``async def __getitem__`` that finishes out of order."""

    def __init__(self, n: int, bad: int | None = None, interrupt: int | None = None) -> None:
        self.n, self.bad, self.interrupt = n, bad, interrupt

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> Any:
        await anyio.sleep(0.001 if i % 3 == 0 else 0)  # later indices finish first
        if i == self.bad:
            raise ValueError(f"bad index {i}")
        if i == self.interrupt:
            self.interrupt = None
            raise KeyboardInterrupt
        return {"i": i, "x": np.float32(i) * 2}


def plain(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {key: plain(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [plain(value) for value in batch]
    return np.asarray(batch).tolist()


def outcomes(iterator: Iterator[Any], limit: int = 100) -> list[Any]:
    """Each ``next()``'s batch, or the type of its error, until StopIteration."""
    out: list[Any] = []
    for _ in range(limit):
        try:
            out.append(plain(next(iterator)))
        except StopIteration:
            return out
        except Exception as exc:
            out.append(type(exc).__name__)
    raise AssertionError(f"no end after {limit} steps: {out[-3:]}")


async def async_batches(loader: Any) -> list[Any]:
    with anyio.fail_after(30):
        return [plain(batch) async for batch in loader]


def same_epochs(theirs: Callable[[], Any], ours: Callable[[], Any], epochs: int = 2) -> None:
    torch_loader, our_loader = theirs(), ours()
    for _ in range(epochs):
        assert outcomes(iter(our_loader)) == outcomes(iter(torch_loader))


@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("batch_size", [1, 5])
@pytest.mark.parametrize("max_concurrency", [1, 3, 10_000])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_epochs_match_torch(n: int, batch_size: int, max_concurrency: int,
                                     drop_last: bool) -> None:
    same_epochs(
        lambda: tud.DataLoader(TorchData(n), batch_size=batch_size, shuffle=True,
                               drop_last=drop_last, generator=torch.Generator().manual_seed(11)),
        lambda: aloader.DataLoader(AsyncData(n), batch_size=batch_size, shuffle=True,
                                   drop_last=drop_last,
                                   generator=torch.Generator().manual_seed(11),
                                   max_concurrency=max_concurrency))


async def test_shuffled_epochs_on_both_loops(anyio_backend: str) -> None:
    for n, batch_size, max_concurrency in ((7, 1, 1), (33, 5, 3), (33, 4, 10_000)):
        theirs = tud.DataLoader(TorchData(n), batch_size=batch_size, shuffle=True,
                                generator=torch.Generator().manual_seed(3))
        ours = aloader.DataLoader(AsyncData(n), batch_size=batch_size, shuffle=True,
                                  generator=torch.Generator().manual_seed(3),
                                  max_concurrency=max_concurrency)
        for _ in range(2):
            assert await async_batches(ours) == outcomes(iter(theirs))


SAMPLERS: dict[str, Callable[[Any], Any]] = {
    "subset": lambda g: tud.SubsetRandomSampler([3, 1, 4, 1, 5], generator=g),
    "weighted": lambda g: tud.WeightedRandomSampler([0.1, 0.5, 2, 3, 0.2], 11, generator=g),
    "replacement": lambda g: tud.RandomSampler(range(9), replacement=True, num_samples=13,
                                               generator=g),
    "odd sequential": lambda g: range(8, -1, -2),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
@pytest.mark.parametrize("max_concurrency", [1, 10_000])
def test_samplers_of_odd_lengths_match_torch(name: str, max_concurrency: int) -> None:
    make = SAMPLERS[name]
    same_epochs(
        lambda: tud.DataLoader(TorchData(9), batch_size=4,
                               sampler=make(torch.Generator().manual_seed(5))),
        lambda: aloader.DataLoader(AsyncData(9), batch_size=4, max_concurrency=max_concurrency,
                                   sampler=make(torch.Generator().manual_seed(5))),
        epochs=3)


BATCHES = [[0, 1], [], [2, 2, 2], [], [5], [1, 0], [], [7] * 9]


def identity(batch: Any) -> Any:
    return batch


@pytest.mark.parametrize("max_concurrency", [1, 2, 10_000])
def test_batch_sampler_with_empty_and_duplicate_batches(max_concurrency: int) -> None:
    same_epochs(lambda: tud.DataLoader(TorchData(8), batch_sampler=BATCHES,
                                       collate_fn=identity),
                lambda: aloader.DataLoader(AsyncData(8), batch_sampler=BATCHES,
                                           collate_fn=identity,
                                           max_concurrency=max_concurrency))
    # The default collate of an empty batch fails as torch's does.
    same_epochs(lambda: tud.DataLoader(TorchData(8), batch_sampler=BATCHES),
                lambda: aloader.DataLoader(AsyncData(8), batch_sampler=BATCHES,
                                           max_concurrency=max_concurrency), epochs=1)


async def test_batch_sampler_on_both_loops(anyio_backend: str) -> None:
    expected = outcomes(iter(tud.DataLoader(TorchData(8), batch_sampler=BATCHES,
                                            collate_fn=identity)))
    for max_concurrency in (1, 2, 10_000):
        loader = aloader.DataLoader(AsyncData(8), batch_sampler=BATCHES, collate_fn=identity,
                                    max_concurrency=max_concurrency)
        assert await async_batches(loader) == expected
        assert await async_batches(loader) == expected


@pytest.mark.parametrize("max_concurrency", [1, 4, 10_000])
def test_a_failing_index_as_torch_reports_it(max_concurrency: int) -> None:
    # torch raises for the batch holding it and goes on with the next batch.
    same_epochs(lambda: tud.DataLoader(TorchData(20, bad=9), batch_size=4),
                lambda: aloader.DataLoader(AsyncData(20, bad=9), batch_size=4,
                                           max_concurrency=max_concurrency))
    iterator = iter(aloader.DataLoader(AsyncData(20, bad=9), batch_size=4,
                                       max_concurrency=max_concurrency))
    next(iterator), next(iterator)
    with pytest.raises(ValueError, match="bad index 9") as caught:
        next(iterator)
    assert "raised while fetching index 9 of batch 2" in caught.value.__notes__
    # Skipped within the budget: the batch without it, nothing else lost.
    skipping = aloader.DataLoader(AsyncData(20, bad=9), batch_size=4,
                                  max_concurrency=max_concurrency, max_failures=1)
    expected = [list(range(0, 4)), list(range(4, 8)), [8, 10, 11], list(range(12, 16)),
                list(range(16, 20))]
    for _ in range(2):
        assert [b["i"] for b in outcomes(iter(skipping))] == expected


@pytest.mark.parametrize("max_concurrency", [1, 4])
def test_an_interrupt_in_a_fetch_ends_the_epoch_after_the_batches_before(
        max_concurrency: int) -> None:
    full = outcomes(iter(aloader.DataLoader(AsyncData(20), batch_size=4)))
    loader = aloader.DataLoader(AsyncData(20, interrupt=9), batch_size=4,
                                max_concurrency=max_concurrency)
    iterator = iter(loader)
    assert [plain(next(iterator)) for _ in range(2)] == full[:2]
    with pytest.raises(KeyboardInterrupt):
        next(iterator)
    with pytest.raises(aloader.LoaderClosedError):  # never a silent end of the epoch
        next(iterator)
    assert outcomes(iter(loader)) == full  # the next epoch is whole
    loader.close()


async def test_an_interrupt_in_a_fetch_on_both_loops(anyio_backend: str) -> None:
    full = await async_batches(aloader.DataLoader(AsyncData(20), batch_size=4))
    for max_concurrency in (1, 4):
        loader = aloader.DataLoader(AsyncData(20, interrupt=9), batch_size=4,
                                    max_concurrency=max_concurrency)
        got: list[Any] = []
        with anyio.fail_after(30), pytest.raises(KeyboardInterrupt):
            async for batch in loader:
                got.append(plain(batch))
        assert got == full[:2]
        assert await async_batches(loader) == full


def test_an_interrupted_epoch_leaves_no_loop_thread() -> None:
    # In a child process: the leaked threads would be counted by other tests.
    script = textwrap.dedent("""
        import gc, threading, time
        import anyio, aloader

        class Data(aloader.Dataset):
            def __len__(self):
                return 20
            async def __getitem__(self, i):
                await anyio.sleep(0)
                if i == 9:
                    raise KeyboardInterrupt
                return i

        def loops():
            return sum(t.name.startswith("aloader-loop") for t in threading.enumerate())

        for _ in range(2):
            loader = aloader.DataLoader(Data(), batch_size=4)
            iterator = iter(loader)
            try:
                while True:
                    next(iterator)
            except KeyboardInterrupt:
                pass
            del iterator, loader
            gc.collect()
        for _ in range(50):
            if loops() == 0:
                break
            time.sleep(0.01)
        print(loops())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.split() == ["0"]


@pytest.mark.parametrize("max_concurrency", [1, 3])
def test_a_failed_batch_fetches_no_more_of_its_items(max_concurrency: int) -> None:
    # Items of a batch whose fetch already failed are passed over, not fetched; the batch
    # reports its first error, and the next batches are fetched whole.
    fetched: list[int] = []

    class Failing(aloader.Dataset[Any]):
        def __len__(self) -> int:
            return 16

        async def __getitem__(self, i: int) -> Any:
            fetched.append(i)
            await anyio.sleep(0)
            if i in (1, 2):
                raise ValueError(f"bad index {i}")
            return i

    iterator = iter(aloader.DataLoader(Failing(), batch_size=8, max_concurrency=max_concurrency,
                                       collate_fn=list))
    with pytest.raises(ValueError, match="bad index 1"):
        next(iterator)
    assert next(iterator) == list(range(8, 16))
    with pytest.raises(StopIteration):
        next(iterator)
    first = [i for i in fetched if i < 8]
    assert first == list(range(len(first))) and 2 <= len(first) <= 1 + max_concurrency
    assert sorted(i for i in fetched if i >= 8) == list(range(8, 16))
