"""Attack the samplers against torch's own: the same generator (or seed) must give torch's
indices epoch after epoch, through the DataLoader too, whatever draws from the generator in
between (the loader's base seed, a second loader, an epoch cut short).

tests/compat/test_torch_generator.py already compares each sampler's full epochs with torch's; these
are the situations around them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest

import aloader

pytestmark = pytest.mark.hostile

torch = pytest.importorskip("torch")
tud = torch.utils.data

EPOCHS = 3


def _same_state(a: Any, b: Any) -> bool:
    return bool(torch.equal(a.get_state(), b.get_state()))


def _plain(batches: Any) -> list[Any]:
    return [b.tolist() if hasattr(b, "tolist") else b for b in batches]


# Sampler constructors: (module, generator) -> sampler over a dataset of 23.
N = 23
SAMPLERS: dict[str, Any] = {
    "random": lambda m, g: m.RandomSampler(range(N), generator=g),
    "random num_samples < n": lambda m, g: m.RandomSampler(range(N), num_samples=9, generator=g),
    "random num_samples > n": lambda m, g: m.RandomSampler(range(N), num_samples=50,
                                                           generator=g),
    "replacement": lambda m, g: m.RandomSampler(range(N), replacement=True, generator=g),
    "replacement 70": lambda m, g: m.RandomSampler(range(N), replacement=True, num_samples=70,
                                                   generator=g),
    "subset": lambda m, g: m.SubsetRandomSampler([3, 1, 4, 15, 9, 2, 6], generator=g),
    "weighted": lambda m, g: m.WeightedRandomSampler([1.0 + i % 4 for i in range(N)], 30,
                                                     generator=g),
    "weighted without replacement": lambda m, g: m.WeightedRandomSampler(
        [1.0 + i % 4 for i in range(N)], 12, replacement=False, generator=g),
}


@pytest.mark.parametrize("name", list(SAMPLERS))
@pytest.mark.parametrize("shared", [False, True], ids=["own generator", "loader's generator"])
def test_loader_over_each_sampler_matches_torch(name: str, shared: bool) -> None:
    """``sampler=`` with a torch generator, given to the loader too when ``shared``: the
    loader's base seed and the sampler's epochs then interleave on one generator."""
    make = SAMPLERS[name]
    ours_g, theirs_g = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    kw_ours = {"generator": ours_g} if shared else {}
    kw_theirs = {"generator": theirs_g} if shared else {}
    torch.manual_seed(0)  # the base seed without a loader generator
    ours = aloader.DataLoader(range(N), batch_size=4, sampler=make(aloader, ours_g), **kw_ours)
    torch.manual_seed(0)
    theirs = tud.DataLoader(range(N), batch_size=4, sampler=make(tud, theirs_g), **kw_theirs)
    assert len(ours) == len(theirs)
    for _ in range(EPOCHS):
        assert _plain(ours) == _plain(theirs)
        assert _same_state(ours_g, theirs_g)


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_argument_matches_torch(drop_last: bool) -> None:
    ours_g, theirs_g = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    ours = aloader.DataLoader(range(N), batch_sampler=aloader.BatchSampler(
        aloader.RandomSampler(range(N), generator=ours_g), 5, drop_last))
    theirs = tud.DataLoader(range(N), batch_sampler=tud.BatchSampler(
        tud.RandomSampler(range(N), generator=theirs_g), 5, drop_last))
    assert len(ours) == len(theirs)
    for _ in range(EPOCHS):
        assert _plain(ours) == _plain(theirs)


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_a_partly_iterated_epoch_draws_what_torchs_does(name: str) -> None:
    """torch's samplers are generators that draw as they are consumed (RandomSampler: each
    permutation when reached, the tail's one too; with replacement 32 indices at a time):
    an epoch left after a few indices leaves the generator where torch's leaves it, and the
    next epoch is torch's."""
    make = SAMPLERS[name]
    ours_g, theirs_g = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    ours, theirs = make(aloader, ours_g), make(tud, theirs_g)
    for taken in (3, 40, 1):
        ours_it, theirs_it = iter(ours), iter(theirs)
        head = [next(theirs_it) for _ in range(min(taken, len(theirs)))]
        assert [next(ours_it) for _ in head] == head
        assert _same_state(ours_g, theirs_g)
        assert list(ours) == list(theirs)  # the next full epoch


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"num_samples": 50}, {"replacement": True,
                                                            "num_samples": 70}])
def test_a_partly_iterated_batch_sampler_draws_what_torchs_does(kwargs: dict[str, Any],
                                                                drop_last: bool) -> None:
    ours_g, theirs_g = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    ours = aloader.BatchSampler(aloader.RandomSampler(range(N), generator=ours_g, **kwargs), 4,
                                drop_last)
    theirs = tud.BatchSampler(tud.RandomSampler(range(N), generator=theirs_g, **kwargs), 4,
                              drop_last)
    for taken in (1, 8, 2):
        ours_it, theirs_it = iter(ours), iter(theirs)
        head = [next(theirs_it) for _ in range(min(taken, len(theirs)))]
        assert [next(ours_it) for _ in head] == head
        assert _same_state(ours_g, theirs_g)
        assert list(ours) == list(theirs)


def test_random_sampler_without_generator_partly_iterated_follows_torch() -> None:
    """Without a generator both reseed from torch's global RNG at each epoch's first index."""
    def epochs(module: Any) -> list[Any]:
        torch.manual_seed(11)
        sampler = module.RandomSampler(range(N), num_samples=60)
        out = []
        for _ in range(EPOCHS):
            it = iter(sampler)
            out.append([next(it) for _ in range(5)])
        out.append(list(sampler))
        return out

    assert epochs(aloader) == epochs(tud)


def test_two_loaders_sharing_a_generator_one_after_the_other() -> None:
    ours_g, theirs_g = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    ours = [aloader.DataLoader(range(k, k + 10), batch_size=3, shuffle=True, generator=ours_g)
            for k in (0, 10)]
    theirs = [tud.DataLoader(range(k, k + 10), batch_size=3, shuffle=True, generator=theirs_g)
              for k in (0, 10)]
    for _ in range(EPOCHS):
        for o, t in zip(ours, theirs, strict=True):
            assert _plain(o) == _plain(t)
    assert _same_state(ours_g, theirs_g)


def test_two_loaders_sharing_a_generator_side_by_side() -> None:
    def run(module: Any) -> list[Any]:
        g = torch.Generator().manual_seed(1)
        a = module.DataLoader(range(10), batch_size=3, shuffle=True, generator=g)
        b = module.DataLoader(range(10, 20), batch_size=3, shuffle=True, generator=g)
        return [(x.tolist(), y.tolist()) for x, y in zip(a, b, strict=True)]

    assert run(aloader) == run(tud)


def test_break_then_next_epoch_matches_torch() -> None:
    def run(module: Any) -> list[Any]:
        g = torch.Generator().manual_seed(3)
        loader = module.DataLoader(range(100), batch_size=4, shuffle=True, generator=g)
        out = []
        for _ in range(EPOCHS):
            for step, batch in enumerate(loader):
                out.append(batch.tolist())
                if step == 2:
                    break
        out.append(_plain(loader))
        return out

    assert run(aloader) == run(tud)


def test_int_seed_and_numpy_generator_are_one_stream() -> None:
    """README: an int seed is a numpy stream (not torch's); a fresh loader with the same seed
    repeats the sequence of epochs, and a numpy Generator of that seed gives it too."""
    def epochs(generator: Any) -> list[Any]:
        loader = aloader.DataLoader(range(N), batch_size=4, shuffle=True, generator=generator)
        return [_plain(loader) for _ in range(EPOCHS)]

    first = epochs(5)
    assert first == epochs(5) == epochs(np.random.default_rng(5))
    assert first[0] != first[1]


# DistributedSampler ------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "world", "drop_last"),
                         [(10, 3, False), (10, 3, True), (11, 4, False), (7, 2, True),
                          (2, 3, False)])
def test_distributed_loader_without_shuffle_matches_torch(n: int, world: int, drop_last: bool
                                                          ) -> None:
    for rank in range(world):
        ours_s = aloader.DistributedSampler(range(n), world, rank, shuffle=False,
                                            drop_last=drop_last)
        theirs_s = tud.DistributedSampler(range(n), world, rank, shuffle=False,
                                          drop_last=drop_last)
        ours = aloader.DataLoader(range(n), batch_size=2, sampler=ours_s)
        theirs = tud.DataLoader(range(n), batch_size=2, sampler=theirs_s)
        assert len(ours) == len(theirs) and len(ours_s) == len(theirs_s)
        for epoch in range(EPOCHS):
            ours_s.set_epoch(epoch)
            theirs_s.set_epoch(epoch)
            assert _plain(ours) == _plain(theirs)


@pytest.mark.parametrize(("n", "world", "drop_last"),
                         [(10, 3, False), (10, 3, True), (11, 4, False), (2, 3, False)])
def test_distributed_shuffled_epochs_follow_torchs_rules(n: int, world: int, drop_last: bool
                                                         ) -> None:
    """Per epoch: every rank's length is torch's, the ranks together cover the dataset as
    torch's do (padding repeats the order's start, drop_last truncates it), every rank draws
    the same order, and set_epoch changes it."""
    def shards(module: Any, epoch: int) -> list[list[int]]:
        out = []
        for rank in range(world):
            sampler = module.DistributedSampler(range(n), world, rank, seed=5,
                                                drop_last=drop_last)
            sampler.set_epoch(epoch)
            out.append(list(sampler))
        return out

    orders = []
    for epoch in range(EPOCHS):
        ours, theirs = shards(aloader, epoch), shards(tud, epoch)
        assert [len(s) for s in ours] == [len(s) for s in theirs]
        # The global order, position p at rank p % world.
        glob = [ours[p % world][p // world] for p in range(sum(map(len, ours)))]
        head = glob[:n]
        assert len(set(head)) == len(head)  # no repeat before the padding
        padding = max(0, len(glob) - n)
        assert glob[n:] == (head * (padding // len(head) + 1))[:padding]
        orders.append(glob)
    assert orders[0] != orders[1] or n <= 2


def test_distributed_shuffled_order_is_torchs() -> None:
    ours = aloader.DistributedSampler(range(20), 2, 0, seed=5)
    theirs = tud.DistributedSampler(range(20), 2, 0, seed=5)
    assert list(ours) == list(theirs)


# The consumer's calls decide the draws ----------------------------------------------------
# (dataset size, loader kwargs): an empty tail permutation at a full last batch, at a short
# one, with drop_last, without batching, a non-empty tail (num_samples < n); with replacement,
# torch's 32 draws at a time and an empty last draw.
DRAWN_AS_TORCH: dict[str, tuple[int, dict[str, Any]]] = {
    "full last batch": (24, {"batch_size": 4, "shuffle": True}),
    "short last batch": (20, {"batch_size": 3, "shuffle": True}),
    "drop_last": (20, {"batch_size": 3, "shuffle": True, "drop_last": True}),
    "no batching": (9, {"batch_size": None, "shuffle": True}),
    "num_samples < n": (20, {"batch_size": 3, "sampler_samples": 11}),
    "replacement": (20, {"batch_size": 8, "sampler_samples": 32, "replacement": True}),
}


def _loader(module: Any, name: str, g: Any, workers: int) -> Any:
    n, kwargs = DRAWN_AS_TORCH[name]
    kwargs = dict(kwargs)
    samples = kwargs.pop("sampler_samples", None)
    replacement = kwargs.pop("replacement", False)
    if samples is not None:
        kwargs["sampler"] = module.RandomSampler(range(n), replacement, samples, generator=g)
    return module.DataLoader(range(n), generator=g, num_workers=workers, **kwargs)


def _epochs_with_breaks(module: Any, name: str, workers: int) -> list[Any]:
    """Epochs left after 1, 2, 3 and 5 batches, then a whole one; then what the generator
    draws next (its state)."""
    g = torch.Generator().manual_seed(7)
    loader = _loader(module, name, g, workers)
    out: list[Any] = []
    for stop in (1, 2, 3, 5, None):
        for step, batch in enumerate(loader):
            out.append(batch.tolist() if hasattr(batch, "tolist") else batch)
            if step + 1 == stop:
                break
    out.append(torch.randint(1 << 30, (4,), generator=g).tolist())
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", list(DRAWN_AS_TORCH))
def test_epochs_left_early_leave_the_generator_where_torchs_does(name: str, workers: int
                                                                 ) -> None:
    """The empty tail permutation is drawn at the consumer's call where torch's sampler
    draws it (with workers, ``prefetch_factor * num_workers`` batches ahead), so every break
    point leaves the shared generator as torch's, epoch after epoch."""
    assert _epochs_with_breaks(aloader, name, workers) == _epochs_with_breaks(tud, name,
                                                                              workers)


async def test_async_for_with_breaks_draws_as_torchs_iterator(anyio_backend: str) -> None:
    """``async for`` is the consumer's call too: breaks leave the generator as torch's."""
    del anyio_backend
    name = "short last batch"
    g = torch.Generator().manual_seed(7)
    loader = _loader(aloader, name, g, 0)
    out: list[Any] = []
    for stop in (1, 2, 3, 5, None):
        step = 0
        async with contextlib.aclosing(loader.__aiter__()) as it:
            async for batch in it:
                out.append(batch.tolist())
                step += 1
                if step == stop:
                    break
    out.append(torch.randint(1 << 30, (4,), generator=g).tolist())
    assert out == _epochs_with_breaks(tud, name, 0)


@pytest.mark.parametrize("workers", [0, 2])
def test_two_loaders_side_by_side_over_several_epochs(workers: int) -> None:
    def run(module: Any) -> list[Any]:
        g = torch.Generator().manual_seed(2)
        a = module.DataLoader(range(10), batch_size=3, shuffle=True, generator=g,
                              num_workers=workers)
        b = module.DataLoader(range(10, 22), batch_size=4, shuffle=True, generator=g,
                              num_workers=workers)
        out = []
        for _ in range(EPOCHS):
            out.append([(x.tolist(), y.tolist()) for x, y in zip(a, b, strict=False)])
        return out

    assert run(aloader) == run(tud)


def _stages(module: Any, n: int, world: Any, rank: Any, drop_last: bool) -> tuple[Any, ...]:
    """Where torch's DistributedSampler fails (construction, len, iteration), and how."""
    try:
        sampler = module.DistributedSampler(range(n), world, rank, drop_last=drop_last)
    except Exception as exc:
        return "init", type(exc).__name__, str(exc)
    try:
        length = len(sampler)
    except Exception as exc:
        return "len", type(exc).__name__, str(exc)
    try:
        return "ok", length, list(sampler)
    except Exception as exc:
        return "iter", length, type(exc).__name__, str(exc)


@pytest.mark.hostile
@pytest.mark.parametrize(("world", "rank"), [(5e-324, 0), (1e-300, 0), (0.5, 0), (2.5, 0),
                                             (3.0, 1), (2, 0.5), (2, 1.0), (float("inf"), 0),
                                             (float("nan"), 0), (1e300, 0)], ids=repr)
@pytest.mark.parametrize("n", [0, 10])
@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_sampler_of_numbers_that_are_not_integers_fails_as_torchs(
        world: Any, rank: Any, n: int, drop_last: bool) -> None:
    ours = _stages(aloader, n, world, rank, drop_last)
    assert ours == _stages(tud, n, world, rank, drop_last)
