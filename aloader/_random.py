"""Random number plumbing shared by samplers, splits and the loader.

Every public ``generator=`` argument accepts ``None`` (fresh OS entropy), an ``int`` seed or a
:class:`numpy.random.Generator`. It is turned into one :class:`numpy.random.Generator` at
construction, and every epoch draws from that same stream: the same seed gives the same sequence
of epoch orders, and each epoch differs from the last.
"""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import numpy.typing as npt

try:
    from . import _cperm
except ImportError:  # built without a C compiler: the numpy path below does the same job
    _cperm = None  # type: ignore[assignment]

__all__ = ("GeneratorLike", "IndexArray", "as_generator", "draw_seed", "permutation")

GeneratorLike: TypeAlias = "int | np.random.Generator | None"
IndexArray: TypeAlias = "npt.NDArray[np.int64]"

# Below this size numpy's own permutation is in cache and hard to beat.
_BUCKET_MIN = 1 << 17
_BUCKETS = 256


def as_generator(generator: GeneratorLike) -> np.random.Generator:
    """Normalise a ``generator=`` argument into a :class:`numpy.random.Generator`.

    Args:
        generator: ``None`` for fresh entropy, an int seed, or a Generator used as is (shared,
            so it advances as the caller draws from it).

    Raises:
        TypeError: for anything else (a bool or a float is not a seed).
    """
    if generator is None:
        return np.random.default_rng()
    if isinstance(generator, np.random.Generator):
        return generator
    if isinstance(generator, (int, np.integer)) and not isinstance(generator, bool):
        if int(generator) < 0:
            raise ValueError(
                f"generator seed should be a non-negative integer, but got {generator}"
            )
        return np.random.default_rng(int(generator))
    raise TypeError(
        "generator should be None, an int seed or a numpy.random.Generator, "
        f"but got {type(generator).__name__}"
    )


def draw_seed(rng: np.random.Generator) -> int:
    """Draw a non-negative int64 seed from ``rng`` (torch's ``base_seed``)."""
    return int(rng.integers(0, np.iinfo(np.int64).max, dtype=np.int64))


def permutation(rng: np.random.Generator, n: int) -> IndexArray:
    """A uniformly random permutation of ``range(n)`` as an int64 array.

    Large permutations use the Rao-Sandelius scatter shuffle: every index draws one of a few
    hundred buckets, the buckets are grouped by a counting sort, and each bucket (small enough
    to stay in cache) is shuffled on its own. Given i.i.d. uniform buckets and uniform shuffles
    inside them, the result is exactly uniform, and the random swaps hit cache instead of main
    memory. The compiled fast path (``aloader._cperm``, built at install when a C compiler is
    there) does this in one pass with its own xoshiro256** stream seeded from ``rng``; the
    numpy fallback does the same with ``argsort`` and ``Generator.shuffle``. Both consume
    ``rng`` and are reproducible from its state, but they give different orders.
    """
    if _cperm is not None and n >= _BUCKET_MIN:
        out: IndexArray = np.empty(n, dtype=np.int64)
        _cperm.permutation(out, int(rng.integers(0, 1 << 64, dtype=np.uint64)))
        return out
    if n < _BUCKET_MIN:
        return rng.permutation(n).astype(np.int64, copy=False)
    buckets = rng.integers(0, _BUCKETS, n, dtype=np.uint8)
    order: IndexArray = np.argsort(buckets, kind="stable").astype(np.int64, copy=False)
    start = 0
    for end in np.cumsum(np.bincount(buckets, minlength=_BUCKETS)).tolist():
        rng.shuffle(order[start:end])
        start = end
    return order
