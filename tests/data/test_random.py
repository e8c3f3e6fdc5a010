"""generator= plumbing and the permutation behind every shuffled epoch."""

from __future__ import annotations

import numpy as np
import pytest

from aloader.data import _random
from aloader.data._random import as_generator, draw_seed, permutation


def test_as_generator_accepts_none_int_and_generator() -> None:
    g = np.random.default_rng(3)
    assert as_generator(g) is g
    assert isinstance(as_generator(None), np.random.Generator)
    assert as_generator(5).integers(1 << 30) == np.random.default_rng(5).integers(1 << 30)
    assert as_generator(np.int64(5)).integers(1 << 30) == as_generator(5).integers(1 << 30)


@pytest.mark.parametrize("bad", [1.5, "3", True, [1]])
def test_as_generator_rejects_other_types(bad: object) -> None:
    with pytest.raises(TypeError, match="generator should be None, an int seed, a "
                                        "numpy.random.Generator or a torch.Generator"):
        as_generator(bad)  # type: ignore[arg-type]


def test_as_generator_rejects_negative_seed() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        as_generator(-1)


def test_draw_seed_is_a_reproducible_int64() -> None:
    seeds = [draw_seed(np.random.default_rng(9)) for _ in range(2)]
    assert seeds[0] == seeds[1]
    assert 0 <= seeds[0] < 2**63
    assert isinstance(seeds[0], int)


@pytest.fixture(params=["compiled", "numpy"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "compiled":
        if _random._cperm is None:
            pytest.skip("aloader.data._cperm was not built (no C compiler at install)")
    else:
        monkeypatch.setattr(_random, "_cperm", None)
    return str(request.param)


@pytest.mark.parametrize("n", [0, 1, 2, 1000, _random._BUCKET_MIN, _random._BUCKET_MIN + 12345])
def test_permutation_is_a_permutation(path: str, n: int) -> None:
    p = permutation(np.random.default_rng(0), n)
    assert p.dtype == np.int64
    assert np.array_equal(np.sort(p), np.arange(n))


def test_permutation_reproducible_and_advancing(path: str) -> None:
    n = _random._BUCKET_MIN * 2
    a, b = np.random.default_rng(1), np.random.default_rng(1)
    first = permutation(a, n)
    assert np.array_equal(first, permutation(b, n))
    assert not np.array_equal(first, permutation(a, n))


def test_permutation_looks_uniform(path: str) -> None:
    # A shuffle that left buckets unshuffled inside would have ~n ascents instead of ~n/2,
    # and one that favoured low buckets would skew where index 0 lands.
    n = _random._BUCKET_MIN
    rng = np.random.default_rng(2)
    ascents = []
    first_bins = np.zeros(8, dtype=np.int64)
    for _ in range(200):
        p = permutation(rng, n)
        ascents.append(np.count_nonzero(np.diff(p) > 0) / (n - 1))
        first_bins[int(np.flatnonzero(p == 0)[0]) * 8 // n] += 1
    assert abs(float(np.mean(ascents)) - 0.5) < 0.01
    chi2 = float(((first_bins - 25) ** 2 / 25).sum())
    assert chi2 < 24.3  # p = 0.001 for 7 degrees of freedom


@pytest.mark.parametrize("n", [0, 1, 2, 3, 50, 1000, 70_000])
def test_torch_randperm_is_torchs(path: str, n: int) -> None:
    """torch_randperm(n, seed) is torch.randperm(n) of a generator seeded with seed, with the C
    extension and without it; seeds wrap as manual_seed wraps them (the engine reads 32 bits)."""
    torch = pytest.importorskip("torch")
    for seed in (0, 1, 12345, -3, 2**32 + 7, 2**64 - 1):
        expected = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        got = _random.torch_randperm(n, seed)
        assert got.dtype == np.int64 and got.tolist() == expected, seed
