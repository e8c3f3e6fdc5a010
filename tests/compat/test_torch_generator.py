"""generator=torch.Generator: accepted wherever torch accepts one, with torch's exact orders."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest

import aloader
from aloader import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    random_split,
)
from aloader.data._batchsampler import epoch_batches
from aloader.data._indices import epoch_indices
from aloader.data._random import TorchBacked, as_generator, draw_seed, permutation, torch_generator

torch = pytest.importorskip("torch")
tud = torch.utils.data

EPOCHS = 4


def _pair(seed: int = 0) -> tuple[Any, Any]:
    return torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)


def _same_state(a: Any, b: Any) -> bool:
    return bool(torch.equal(a.get_state(), b.get_state()))


def test_as_generator_wraps_a_torch_generator_without_drawing() -> None:
    g, ref = _pair(3)
    rng = as_generator(g)
    assert isinstance(rng, TorchBacked) and isinstance(rng, np.random.Generator)
    assert torch_generator(rng) is g
    assert as_generator(rng) is rng
    assert _same_state(g, ref)  # wrapping does not advance the user's generator
    # The numpy side is reproducible from the torch state.
    assert rng.integers(1 << 40) == as_generator(torch.Generator().manual_seed(3)).integers(1 << 40)
    assert torch_generator(np.random.default_rng(0)) is None


def test_draw_seed_and_permutation_are_torchs() -> None:
    g, ref = _pair(5)
    rng = as_generator(g)
    assert draw_seed(rng) == int(torch.empty((), dtype=torch.int64).random_(generator=ref).item())
    assert permutation(rng, 1000).tolist() == torch.randperm(1000, generator=ref).tolist()
    assert permutation(rng, 1 << 18).tolist() == torch.randperm(1 << 18, generator=ref).tolist()
    assert _same_state(g, ref)


def test_torch_backed_survives_pickle_and_copy() -> None:
    rng = as_generator(torch.Generator().manual_seed(1))
    rng.integers(10)
    for clone in (pickle.loads(pickle.dumps(rng)), copy.deepcopy(rng)):
        assert isinstance(clone, TorchBacked)
        assert _same_state(clone.torch_generator, rng.torch_generator)
        assert clone.bit_generator.state == rng.bit_generator.state


@pytest.mark.parametrize(
    ("n", "kwargs"),
    [
        (10, {}),
        (10, {"num_samples": 4}),
        (10, {"num_samples": 10}),
        (10, {"num_samples": 20}),
        (10, {"num_samples": 23}),
        (1, {}),
        (1000, {}),
        (10, {"replacement": True}),
        (10, {"replacement": True, "num_samples": 5}),
        (10, {"replacement": True, "num_samples": 32}),
        (1000, {"replacement": True, "num_samples": 100}),
        (3, {"replacement": True, "num_samples": 1000}),
    ],
)
def test_random_sampler_matches_torch_over_epochs(n: int, kwargs: dict[str, Any]) -> None:
    g, ref = _pair(7)
    ours = RandomSampler(range(n), generator=g, **kwargs)
    theirs = tud.RandomSampler(range(n), generator=ref, **kwargs)
    for _ in range(EPOCHS):
        assert list(ours) == list(theirs)
        assert _same_state(g, ref)
    # The array path the DataLoader takes draws the same epochs.
    for _ in range(EPOCHS):
        arr = epoch_indices(ours)
        assert arr is not None and arr.tolist() == list(theirs)


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_over_random_sampler_matches_torch(drop_last: bool) -> None:
    g, ref = _pair(2)
    ours = BatchSampler(RandomSampler(range(37), generator=g), 5, drop_last)
    theirs = tud.BatchSampler(tud.RandomSampler(range(37), generator=ref), 5, drop_last)
    for _ in range(EPOCHS):
        batches = epoch_batches(ours)
        assert batches is not None
        assert [b.tolist() for b in batches] == list(theirs)
    assert list(ours) == list(theirs)


@pytest.mark.parametrize("indices", [[5, 3, 9, 1, 7], list("abcdef"), range(4, 40, 3)])
def test_subset_random_sampler_matches_torch(indices: Any) -> None:
    g, ref = _pair(11)
    ours = SubsetRandomSampler(indices, generator=g)
    theirs = tud.SubsetRandomSampler(indices, generator=ref)
    for _ in range(EPOCHS):
        assert list(ours) == list(theirs)
    assert _same_state(g, ref)


@pytest.mark.parametrize("replacement", [True, False])
@pytest.mark.parametrize("num_samples", [1, 4, 6])
def test_weighted_random_sampler_matches_torch(replacement: bool, num_samples: int) -> None:
    weights = [0.1, 0.9, 0.4, 0.7, 3.0, 0.6]
    g, ref = _pair(4)
    ours = WeightedRandomSampler(weights, num_samples, replacement, generator=g)
    theirs = tud.WeightedRandomSampler(weights, num_samples, replacement, generator=ref)
    for _ in range(EPOCHS):
        assert list(ours) == list(theirs)
    assert _same_state(g, ref)


@pytest.mark.parametrize("lengths", [[3, 7], [0.3, 0.3, 0.4], [10], [0.5, 0.5]])
def test_random_split_matches_torch(lengths: list[Any]) -> None:
    g, ref = _pair(9)
    for _ in range(3):  # the same generator, split after split
        ours = random_split(range(10), lengths, generator=g)
        theirs = tud.random_split(range(10), lengths, generator=ref)
        assert [list(s.indices) for s in ours] == [list(s.indices) for s in theirs]
    assert _same_state(g, ref)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_dataloader_matches_torch_orders_and_base_seeds(shuffle: bool, drop_last: bool) -> None:
    g, ref = _pair(123)
    data = list(range(50))
    ours = DataLoader(data, batch_size=8, shuffle=shuffle, drop_last=drop_last, generator=g)
    theirs = tud.DataLoader(data, batch_size=8, shuffle=shuffle, drop_last=drop_last,
                            generator=ref)
    for _ in range(EPOCHS):
        assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]
        # Same draws: the base seed and the permutation, in torch's order.
        assert _same_state(g, ref)


class TorchDraws(aloader.Dataset[tuple[int, int]]):
    """Each sample draws from the worker's global torch RNG (module level: workers import it)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[int, int]:
        return index, int(torch.randint(0, 1 << 62, ()).item())


def test_dataloader_workers_get_torchs_seeds_from_a_torch_generator() -> None:
    g, ref = _pair(8)
    ours = DataLoader(TorchDraws(), batch_size=3, shuffle=True, generator=g, num_workers=1)
    theirs = tud.DataLoader(TorchDraws(), batch_size=3, shuffle=True, generator=ref,
                            num_workers=1)
    for _ in range(2):
        assert [[t.tolist() for t in b] for b in ours] == [[t.tolist() for t in b] for b in theirs]


def test_same_torch_seed_gives_the_same_aloader_sequence() -> None:
    def epochs() -> list[list[int]]:
        sampler = RandomSampler(range(30), generator=torch.Generator().manual_seed(42))
        return [list(sampler) for _ in range(3)]

    first = epochs()
    assert first == epochs()
    assert first[0] != first[1]


def test_public_names_accept_a_torch_generator() -> None:
    g = torch.Generator().manual_seed(0)
    sampler = aloader.RandomSampler(range(3), generator=g)
    assert sampler.generator is g  # the object itself, as torch's sampler keeps it
    assert isinstance(sampler._rng, TorchBacked)


# generator=None with torch imported: torch's global RNG, as torch's own components use it ----
def _global(make: Any, epochs: int = EPOCHS) -> list[Any]:
    torch.manual_seed(123)
    thing = make()
    return [_plain(thing) for _ in range(epochs)]


def _plain(thing: Any) -> Any:
    if isinstance(thing, (list, tuple)):  # random_split's subsets
        return [list(s.indices) for s in thing]
    return [b.tolist() if hasattr(b, "tolist") else b for b in thing]


@pytest.mark.parametrize("replacement", [False, True])
def test_random_sampler_without_generator_follows_torch_manual_seed(replacement: bool) -> None:
    ours = _global(lambda: RandomSampler(range(20), replacement=replacement))
    theirs = _global(lambda: tud.RandomSampler(range(20), replacement=replacement))
    assert ours == theirs
    assert ours == _global(lambda: RandomSampler(range(20), replacement=replacement))


def test_other_components_without_generator_follow_torch_manual_seed() -> None:
    assert _global(lambda: SubsetRandomSampler([3, 5, 7, 9, 11])) == _global(
        lambda: tud.SubsetRandomSampler([3, 5, 7, 9, 11]))
    weights = [0.1, 0.5, 0.2, 0.9, 0.3]
    assert _global(lambda: WeightedRandomSampler(weights, 8)) == _global(
        lambda: tud.WeightedRandomSampler(weights, 8))
    assert _global(lambda: random_split(range(10), [0.3, 0.7]), 1) == _global(
        lambda: tud.random_split(range(10), [0.3, 0.7]), 1)


@pytest.mark.parametrize("workers", [0, 1])
def test_dataloader_without_generator_follows_torch_manual_seed(workers: int) -> None:
    def make(module: Any) -> Any:
        return lambda: module.DataLoader(TorchDraws(), batch_size=5, shuffle=True,
                                         num_workers=workers)

    ours = [[[t.tolist() for t in b] for b in e] for e in _global(make(aloader), 2)]
    theirs = [[[t.tolist() for t in b] for b in e] for e in _global(make(tud), 2)]
    assert ours == theirs


def test_a_samplers_torch_generator_answers_torchs_methods() -> None:
    """A script reseeding its sampler's generator (``sampler.generator.manual_seed(s)``, as
    with torch's sampler, whose attribute is the ``torch.Generator`` itself) gets torch's
    orders: the wrapper answers the generator's own methods."""
    ds = list(range(10))
    ours = aloader.RandomSampler(ds, generator=torch.Generator().manual_seed(2))
    theirs = tud.RandomSampler(ds, generator=torch.Generator().manual_seed(2))
    assert list(ours) == list(theirs)
    for sampler in (ours, theirs):
        assert sampler.generator.manual_seed(5) is not None  # torch's returns the generator
    assert list(ours) == list(theirs)
    assert ours.generator.initial_seed() == theirs.generator.initial_seed() == 5
    assert torch.equal(ours.generator.get_state(), theirs.generator.get_state())
    with pytest.raises(AttributeError):
        ours.generator._no_such_private_name  # noqa: B018


def test_a_generator_set_after_construction_draws_the_base_seeds_as_torchs() -> None:
    # torch lets a script assign loader.generator later: its epochs then draw from it.
    g, ref = _pair(31)
    data = list(range(20))
    ours = DataLoader(data, batch_size=8)
    theirs = tud.DataLoader(data, batch_size=8)
    ours.generator = g
    theirs.generator = ref
    for _ in range(EPOCHS):
        assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]
        assert _same_state(g, ref)
    with pytest.raises(TypeError, match="generator should be"):
        ours.generator = 1.5  # type: ignore[assignment]
