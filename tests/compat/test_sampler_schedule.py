"""A user's sampler is pulled on torch's schedule, and aloader's samplers keep torch's attributes.

A training script's own sampler may draw from torch's global generator for every index it
yields, and the training step draws from it too (dropout, augmentation decisions). torch's
loader pulls its sampler on a fixed schedule: without workers one batch inside each
``next()``; with workers ``prefetch_factor * num_workers`` batches at ``iter()`` (after its
``base_seed`` draw), then one more per batch handed out. So the two interleave in one order,
and the script sees the same numbers run after run, whatever the timing. aloader draws a
user's sampler on the consumer's calls by that same schedule (a pipeline running ahead used to
draw as timing let it). The second half: ``sampler.generator`` is the ``torch.Generator``
passed, and may be assigned; ``WeightedRandomSampler.weights`` is torch's double tensor.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import pytest

import aloader

torch = pytest.importorskip("torch")
tud = torch.utils.data

SIZE = 16  # 8 batches of 2: more than the 4 that 2 workers prefetch


class Items(tud.Dataset):  # type: ignore[misc]
    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> int:
        if self.delay:
            time.sleep(self.delay)
        return index


class GlobalDraws(tud.Sampler):  # type: ignore[misc]
    """A user's sampler drawing each index from torch's global generator as it yields it."""

    def __iter__(self) -> Any:
        for _ in range(SIZE):
            yield int(torch.randint(SIZE, ()).item())

    def __len__(self) -> int:
        return SIZE


class GlobalBatches(tud.Sampler):  # type: ignore[misc]
    """A user's batch sampler drawing each batch from the global generator."""

    def __iter__(self) -> Any:
        for _ in range(SIZE // 2):
            yield torch.randint(SIZE, (2,)).tolist()

    def __len__(self) -> int:
        return SIZE // 2


def _script(module: Any, workers: int, persistent: bool, timing: str, batched: bool,
            stop: int | None = None) -> list[Any]:
    """A training script: 2 epochs, the step drawing ``torch.rand(1)`` per batch (the first
    epoch left after ``stop`` batches, if given)."""
    torch.manual_seed(0)
    dataset = Items(0.002 if timing == "slow dataset" else 0.0)
    options: dict[str, Any] = {"num_workers": workers, "persistent_workers": persistent}
    if batched:
        loader = module.DataLoader(dataset, batch_sampler=GlobalBatches(), **options)
    else:
        loader = module.DataLoader(dataset, sampler=GlobalDraws(), batch_size=2, **options)
    out: list[Any] = []
    for epoch in range(2):
        for number, batch in enumerate(loader):
            if timing == "slow consumer":
                time.sleep(0.005)
            out.append(batch.tolist())
            out.append(round(torch.rand(1).item(), 7))  # the step's own draw
            if epoch == 0 and number + 1 == stop:
                break
    if module is aloader:
        loader.close()  # its loop and workers end here, not in a later test's count
    return out


@pytest.mark.parametrize("timing", ["fast", "slow dataset", "slow consumer"])
@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_samplers_global_draws_interleave_with_the_steps_as_torchs(
        workers: int, persistent: bool, timing: str) -> None:
    expected = _script(tud, workers, persistent, timing, batched=False)
    assert _script(aloader, workers, persistent, timing, batched=False) == expected


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_batch_samplers_global_draws_interleave_as_torchs(workers: int, persistent: bool
                                                            ) -> None:
    expected = _script(tud, workers, persistent, "slow consumer", batched=True)
    assert _script(aloader, workers, persistent, "slow consumer", batched=True) == expected


@pytest.mark.parametrize("persistent", [False, True])
def test_an_epoch_left_early_leaves_the_global_generator_where_torchs_does(persistent: bool
                                                                           ) -> None:
    expected = _script(tud, 2, persistent, "fast", batched=False, stop=3)
    assert _script(aloader, 2, persistent, "fast", batched=False, stop=3) == expected


def _prefetching(timing: str, asynchronous: bool) -> list[Any]:
    """Without workers, an epoch fetching ahead (threads here, or under ``async for``)."""
    torch.manual_seed(0)
    dataset = Items(0.002 if timing == "slow dataset" else 0.0)
    loader = aloader.DataLoader(dataset, sampler=GlobalDraws(), batch_size=2,
                                max_concurrency=None if asynchronous else 2)
    out: list[Any] = []

    def step(batch: Any) -> None:
        if timing == "slow consumer":
            time.sleep(0.005)
        out.append(batch.tolist())
        out.append(round(torch.rand(1).item(), 7))

    async def epochs() -> None:
        for _ in range(2):
            async for batch in loader:
                step(batch)

    if asynchronous:
        import anyio

        anyio.run(epochs)
    else:
        for _ in range(2):
            for batch in loader:
                step(batch)
    loader.close()
    return out


@pytest.mark.parametrize("asynchronous", [False, True])
def test_without_workers_fetching_ahead_draws_in_one_order_whatever_the_timing(
        asynchronous: bool) -> None:
    # Not torch's order (the epoch fetches ahead of the consumer: see README), but one order.
    first = _prefetching("fast", asynchronous)
    assert _prefetching("slow dataset", asynchronous) == first
    assert _prefetching("slow consumer", asynchronous) == first


class FailsAt13:
    def __iter__(self) -> Any:
        for index in range(SIZE):
            if index == 13:
                raise ValueError("no index 13")
            yield index

    def __len__(self) -> int:
        return SIZE


@pytest.mark.parametrize(("workers", "concurrency"), [(0, None), (0, 2), (2, None)])
def test_a_samplers_error_comes_after_the_batches_drawn_before_it(
        workers: int, concurrency: int | None) -> None:
    loader = aloader.DataLoader(Items(), sampler=FailsAt13(), batch_size=2,
                                num_workers=workers, max_concurrency=concurrency)
    got = []
    with pytest.raises(ValueError, match="no index 13") as raised:
        for batch in loader:
            got.append(batch.tolist())
    loader.close()
    assert got == [[i, i + 1] for i in range(0, 12, 2)]
    assert raised.value.__notes__ == ["raised by the sampler"]


def test_aloaders_own_samplers_keep_their_array_path() -> None:
    # Drawn whole where torch's draw their first index: nothing to pace, nothing slowed.
    g = torch.Generator().manual_seed(0)
    loader = aloader.DataLoader(Items(), batch_size=2, shuffle=True, generator=g,
                                num_workers=2)
    iterator = iter(loader)
    assert not isinstance(iterator._source._keys, aloader.pipeline._keys.PacedKeys)
    mine = aloader.DataLoader(Items(), sampler=GlobalDraws(), batch_size=2, num_workers=2)
    other = iter(mine)
    assert isinstance(other._source._keys, aloader.pipeline._keys.PacedKeys)
    iterator.close()
    other.close()
    loader.close()
    mine.close()


# The samplers' attributes ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["RandomSampler", "SubsetRandomSampler", "WeightedRandomSampler"])
def test_a_samplers_generator_is_the_torch_generator_passed_and_may_be_assigned(name: str
                                                                                ) -> None:
    def make(module: Any, generator: Any) -> Any:
        if name == "WeightedRandomSampler":
            return module.WeightedRandomSampler([0.5, 0.1, 2.0, 0.7, 1.0], 6, generator=generator)
        arg = range(6) if name == "RandomSampler" else [4, 8, 15, 16, 23, 42]
        return getattr(module, name)(arg, generator=generator)

    g = torch.Generator().manual_seed(1)
    ours, theirs = make(aloader, g), make(tud, torch.Generator().manual_seed(1))
    assert ours.generator is g
    assert make(aloader, None).generator is None is make(tud, None).generator
    assert list(ours) == list(theirs)
    # Assigned after construction (from no generator, too): the next epoch draws from it.
    for first in (torch.Generator().manual_seed(2), None):
        ours, theirs = make(aloader, first), make(tud, first)
        new_ours, new_theirs = (torch.Generator().manual_seed(9) for _ in range(2))
        ours.generator, theirs.generator = new_ours, new_theirs
        assert ours.generator is new_ours
        assert [list(ours) for _ in range(3)] == [list(theirs) for _ in range(3)]
        assert torch.equal(new_ours.get_state(), new_theirs.get_state())


def test_a_shuffling_loaders_sampler_has_the_loaders_torch_generator() -> None:
    g = torch.Generator().manual_seed(4)
    assert aloader.DataLoader(range(6), shuffle=True, generator=g).sampler.generator is g
    assert tud.DataLoader(range(6), shuffle=True, generator=g).sampler.generator is g


def test_a_samplers_assigned_torch_generator_is_in_its_state() -> None:
    sampler = aloader.RandomSampler(range(6), generator=torch.Generator().manual_seed(2))
    sampler.generator = torch.Generator().manual_seed(9)
    state = sampler.state_dict()
    first = list(sampler)
    sampler.load_state_dict(state)
    assert list(sampler) == first == list(
        tud.RandomSampler(range(6), generator=torch.Generator().manual_seed(9)))


def test_weighted_sampler_weights_are_torchs_double_tensor() -> None:
    for weights in ([0.1, 0.9, 0.4], torch.tensor([0.1, 0.9, 0.4]), (1, 2, 3)):
        ours = aloader.WeightedRandomSampler(weights, 4).weights
        theirs = tud.WeightedRandomSampler(weights, 4).weights
        assert type(ours) is type(theirs)
        assert repr(ours) == repr(theirs) and ours.dtype == theirs.dtype == torch.double
    # Changed in place, as a curriculum does: the next epoch reads it, as torch's does.
    g = torch.Generator().manual_seed(3)
    ours = aloader.WeightedRandomSampler([1.0, 1.0, 1.0, 1.0], 8, generator=g)
    theirs = tud.WeightedRandomSampler([1.0, 1.0, 1.0, 1.0], 8,
                                       generator=torch.Generator().manual_seed(3))
    ours.weights[1] = theirs.weights[1] = 0.0
    assert list(ours) == list(theirs)
    assert 1 not in list(ours)


def test_weighted_sampler_weights_are_numpy_without_torch(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.delitem(sys.modules, "torch")  # a program that never imported it
    weights = aloader.WeightedRandomSampler([1, 2], 3, generator=0).weights
    assert type(weights) is np.ndarray and weights.dtype == np.float64
