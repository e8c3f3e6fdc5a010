"""Random number plumbing shared by samplers, splits and the loader.

Every public ``generator=`` argument accepts ``None`` (fresh OS entropy; torch's global RNG when
the program has imported torch, as in torch), an ``int`` seed, a
:class:`numpy.random.Generator` or a ``torch.Generator``. It is turned into one
:class:`numpy.random.Generator` at construction, and every epoch draws from that same stream: the
same seed gives the same sequence of epoch orders, and each epoch differs from the last.

A ``torch.Generator`` becomes a :class:`TorchBacked` numpy Generator that keeps it: the draws that
torch's samplers, ``random_split`` and ``DataLoader`` make (:func:`permutation`,
:func:`integers`, :func:`draw_seed`) are made by torch with that generator, so a drop-in script
passing ``generator=torch.Generator().manual_seed(s)`` gets torch's exact orders and base seeds.
Its numpy side is seeded from the torch generator's state without advancing it (a draw would
shift every later torch draw off torch's sequence), for the rare numpy-only draw.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

try:
    from . import _cperm
except ImportError:  # built without a C compiler: the numpy path below does the same job
    _cperm = None  # type: ignore[assignment]

__all__ = (
    "GeneratorLike",
    "IndexArray",
    "TorchBacked",
    "as_generator",
    "draw_seed",
    "imported_torch",
    "integers",
    "permutation",
    "reseeded",
    "restore_rng",
    "rng_state",
    "torch_generator",
    "torch_randperm",
)

# Any: a torch.Generator, typed without importing torch.
# Runtime values, not strings, so that typing.get_type_hints resolves the public signatures.
GeneratorLike: TypeAlias = int | np.random.Generator | Any | None
IndexArray: TypeAlias = npt.NDArray[np.int64]

# Below this size numpy's own permutation is in cache and hard to beat.
_BUCKET_MIN = 1 << 17
_BUCKETS = 256


class TorchBacked(np.random.Generator):
    """A numpy Generator standing for a ``torch.Generator``, whose draws go through torch.

    Invariant: every draw aloader makes to order data (:func:`permutation`, :func:`integers`,
    :func:`draw_seed`, weighted sampling) goes to :attr:`torch_generator` with the torch call
    torch itself makes, so orders equal torch's for the same generator state. The numpy side
    (this object's own methods) is seeded from a hash of the torch state and never advances it.

    Args:
        torch_generator: the ``torch.Generator`` to draw from (shared, not copied).
    """

    torch_generator: Any

    def __init__(self, torch_generator: Any) -> None:
        # A digest of the whole state (5 KB for the CPU generator) seeds numpy in microseconds.
        digest = hashlib.blake2b(torch_generator.get_state().numpy().tobytes(), digest_size=32)
        seed = int.from_bytes(digest.digest(), "little")
        super().__init__(np.random.PCG64(np.random.SeedSequence(seed)))
        self.torch_generator = torch_generator

    def __getattr__(self, name: str) -> Any:
        # What numpy's Generator lacks is the torch.Generator's (manual_seed, initial_seed,
        # get_state...): a torch script reseeding ``sampler.generator`` reseeds the draws.
        # Never a private name: copy and pickle probe those, and must not find torch's.
        torch_generator = self.__dict__.get("torch_generator")
        if name.startswith("_") or torch_generator is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(torch_generator, name)

    def __reduce__(self) -> tuple[Any, ...]:
        # numpy's own reduce would rebuild a plain Generator, silently dropping torch.
        return (_rebuild_torch_backed, (self.torch_generator, self.bit_generator.state))

    def __repr__(self) -> str:
        return f"TorchBacked({self.torch_generator!r})"


def _rebuild_torch_backed(torch_generator: Any, state: dict[str, Any]) -> TorchBacked:
    rng = TorchBacked(torch_generator)
    rng.bit_generator.state = state
    return rng


def _torch() -> Any:
    return sys.modules["torch"]  # present: a torch.Generator exists


def imported_torch() -> Any | None:
    """The torch module if the program has imported it, else None (torch is never imported
    here): where aloader gives torch's objects rather than numpy's without being handed any
    (a ``generator=None``'s draws, a sampler's ``weights``)."""
    return sys.modules.get("torch")


def reseeded(rng: np.random.Generator) -> np.random.Generator:
    """A new generator seeded by one draw from ``rng``: torch's RandomSampler without a generator.

    torch's sampler draws a seed from the global RNG at each epoch and permutes with a fresh
    ``torch.Generator`` seeded with it; aloader does the same when torch is imported, so its
    orders are torch's. A numpy generator (no torch) is returned as is.
    """
    if torch_generator(rng) is None:
        return rng
    own = _torch().Generator()
    own.manual_seed(draw_seed(rng))
    return TorchBacked(own)


def torch_generator(rng: np.random.Generator) -> Any | None:
    """The ``torch.Generator`` behind ``rng``, or None for a plain numpy Generator."""
    return rng.torch_generator if isinstance(rng, TorchBacked) else None


def as_generator(generator: GeneratorLike) -> np.random.Generator:
    """Normalise a ``generator=`` argument into a :class:`numpy.random.Generator`.

    Args:
        generator: ``None`` for fresh entropy (torch's global RNG, as torch's own
            components use it, when the program has imported torch), an int seed, a
            Generator used as is (shared, so it advances as the caller draws from it), or a
            ``torch.Generator`` (shared too, wrapped in a :class:`TorchBacked`).

    Raises:
        TypeError: for anything else (a bool or a float is not a seed).
    """
    if generator is None:
        torch = imported_torch()
        if torch is not None:
            # torch's samplers and loader draw from its global RNG when given no generator:
            # a script that calls torch.manual_seed gets the same orders run after run.
            return TorchBacked(torch.default_generator)
        return np.random.default_rng()
    if isinstance(generator, np.random.Generator):
        return generator
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(generator, getattr(torch, "Generator", ())):
        return TorchBacked(generator)
    if isinstance(generator, (int, np.integer)) and not isinstance(generator, bool):
        if int(generator) < 0:
            raise ValueError(
                f"generator seed should be a non-negative integer, but got {generator}"
            )
        return np.random.default_rng(int(generator))
    raise TypeError(
        "generator should be None, an int seed, a numpy.random.Generator or a torch.Generator, "
        f"but got {type(generator).__name__}"
    )


def draw_seed(rng: np.random.Generator) -> int:
    """Draw a non-negative int64 seed from ``rng`` (torch's ``base_seed``).

    From a :class:`TorchBacked` generator the draw is torch's own,
    ``torch.empty((), dtype=torch.int64).random_(generator=g)``, so it equals torch's base seed.
    """
    tg = torch_generator(rng)
    if tg is not None:
        torch = _torch()
        return int(torch.empty((), dtype=torch.int64).random_(generator=tg).item())
    return int(rng.integers(0, np.iinfo(np.int64).max, dtype=np.int64))


def integers(rng: np.random.Generator, high: int, size: int) -> IndexArray:
    """``size`` independent uniform draws from ``range(high)`` as an int64 array.

    From a :class:`TorchBacked` generator: ``torch.randint(high=high, size=(size,))``, which
    fills its output serially, so consecutive calls give the same stream as one call of the
    total size (torch's RandomSampler draws 32 at a time).
    """
    tg = torch_generator(rng)
    if tg is not None:
        torch = _torch()
        out = torch.randint(high=high, size=(size,), dtype=torch.int64, generator=tg)
        return np.asarray(out.numpy(), dtype=np.int64)
    return rng.integers(0, high, size=size, dtype=np.int64)


def permutation(rng: np.random.Generator, n: int) -> IndexArray:
    """A uniformly random permutation of ``range(n)`` as an int64 array.

    Large permutations use the Rao-Sandelius scatter shuffle: every index draws one of a few
    hundred buckets, the buckets are grouped by a counting sort, and each bucket (small enough
    to stay in cache) is shuffled on its own. Given i.i.d. uniform buckets and uniform shuffles
    inside them, the result is exactly uniform, and the random swaps hit cache instead of main
    memory. The compiled fast path (``aloader.data._cperm``, built at install when a C compiler is
    there) does this in one pass with its own xoshiro256** stream seeded from ``rng``; the
    numpy fallback does the same with ``argsort`` and ``Generator.shuffle``. Both consume
    ``rng`` and are reproducible from its state, but they give different orders. From a
    :class:`TorchBacked` generator it is ``torch.randperm(n, generator=g)``, torch's order.
    """
    tg = torch_generator(rng)
    if tg is not None:
        return np.asarray(_torch().randperm(n, generator=tg).numpy(), dtype=np.int64)
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


# torch's randperm_cpu changes algorithm at this size (see torch_randperm).
_TORCH_SWAP_MAX = (1 << 32) // 20


def _torch_mt19937(seed: int) -> np.random.MT19937:
    """numpy's MT19937 in the state of ``torch.Generator().manual_seed(seed)``'s engine: torch
    (as std::mt19937) initialises it from the seed's low 32 bits with Knuth's recurrence."""
    key = np.empty(624, dtype=np.uint32)
    x = seed & 0xFFFFFFFF
    key[0] = x
    for j in range(1, 624):
        x = (1812433253 * (x ^ (x >> 30)) + j) & 0xFFFFFFFF
        key[j] = x
    bit_generator = np.random.MT19937()
    bit_generator.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624}}
    return bit_generator


def torch_randperm(n: int, seed: int) -> IndexArray:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed))``, without torch.

    torch's CPU algorithm: below ``2**32 // 20`` it swaps position ``i`` with
    ``i + random() % (n - i)`` for each ``i``, ``random()`` being the engine's next 32-bit
    output; from there on an inside-out Fisher-Yates with ``random64() % (i + 1)``, two
    outputs making one 64-bit number (the first the high half). The compiled path
    (``aloader.data._cperm``) runs it in C; the fallback replays the same draws with numpy's
    MT19937 (the same engine) and a Python loop.

    Args:
        n: the permutation's length.
        seed: the generator's seed; like ``manual_seed``, it wraps modulo ``2**64``, and the
            engine reads its low 32 bits.
    """
    seed %= 1 << 64
    out: IndexArray = np.empty(n, dtype=np.int64)
    compiled = getattr(_cperm, "torch_shuffle", None)  # None without the C extension
    if compiled is not None:
        compiled(out, seed)
        return out
    bit_generator = _torch_mt19937(seed)
    if n < _TORCH_SWAP_MAX:
        out[:] = np.arange(n, dtype=np.int64)
        draws = bit_generator.random_raw(max(n - 1, 0)).tolist()
        perm = out.tolist()
        for i, r in enumerate(draws):
            z = r % (n - i) + i
            perm[i], perm[z] = perm[z], perm[i]
        out[:] = perm
        return out
    raw = bit_generator.random_raw(2 * n)
    wide = ((raw[0::2] << np.uint64(32)) | raw[1::2]).tolist()
    perm = [0] * n
    for i, r in enumerate(wide):
        z = r % (i + 1)
        perm[i] = perm[z]
        perm[z] = i
    out[:] = perm
    return out


def _plain(value: Any) -> Any:
    """``value`` with numpy arrays and scalars as lists and ints (JSON builtins)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return {"dtype": value.dtype.str, "data": value.tolist()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    return value


def _numpy_state(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"dtype", "data"}:
            return np.asarray(value["data"], dtype=np.dtype(value["dtype"]))
        return {k: _numpy_state(v) for k, v in value.items()}
    return value


def rng_state(rng: np.random.Generator) -> dict[str, Any]:
    """``rng``'s state as JSON builtins: its bit generator's, and a torch generator's bytes as
    a hex string (immutable, so a checkpoint holding it is copied for free).

    Restored by :func:`restore_rng`; taking it never advances ``rng``.
    """
    state: dict[str, Any] = {"numpy": _plain(rng.bit_generator.state)}
    tg = torch_generator(rng)
    if tg is not None:
        state["torch"] = tg.get_state().numpy().tobytes().hex()
    return state


def restore_rng(rng: np.random.Generator, state: Any, *, apply: bool = True) -> None:
    """Set ``rng`` to a :func:`rng_state` (with ``apply=False``, only check that it fits).

    Raises:
        ValueError: the state is of another kind of generator (numpy's bit generator, or a
            torch generator where ``rng`` has none and the reverse), or malformed.
    """
    if not isinstance(state, dict) or not isinstance(state.get("numpy"), dict):
        raise ValueError(f"a generator state should be a dict with a 'numpy' entry, "
                         f"but got {type(state).__name__}")
    numpy_state = state["numpy"]
    mine = type(rng.bit_generator).__name__
    theirs = numpy_state.get("bit_generator")
    if theirs != mine:
        raise ValueError(f"generator state: bit_generator is {theirs!r}, this generator's is "
                         f"{mine!r}")
    tg = torch_generator(rng)
    torch_state = state.get("torch")
    if (tg is None) != (torch_state is None):
        raise ValueError("generator state: torch generator "
                         f"{'missing' if torch_state is None else 'unexpected'}")
    if tg is not None:
        size = 2 * int(tg.get_state().numel())
        if not isinstance(torch_state, str) or len(torch_state) != size:
            raise ValueError(f"generator state: 'torch' should be a hex string of {size} "
                             "digits")
        try:
            raw = bytes.fromhex(torch_state)
        except ValueError:
            raise ValueError("generator state: 'torch' should be a hex string") from None
    if not apply:
        # Applying to a scratch bit generator checks the rest without touching rng.
        scratch = type(rng.bit_generator)()
        try:
            scratch.state = _numpy_state(numpy_state)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"generator state: {exc}") from None
        return
    rng.bit_generator.state = _numpy_state(numpy_state)
    if tg is not None:
        torch = _torch()
        tg.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
