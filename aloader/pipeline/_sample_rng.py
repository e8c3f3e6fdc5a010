"""Per-sample randomness that does not depend on who fetches the sample.

Invariant: inside a fetch, :func:`sample_rng` returns a generator whose stream is a function of
``(loader seed, epoch, sample index)`` only. The pipeline (:mod:`aloader.pipeline._epoch`) opens
a
:class:`Scope` around every fetch of a dataset's ``__getitem__`` (one sample: its index) or
``__getitems__`` (a batch: the index is passed to :func:`sample_rng`), in this process, in a
fetch thread or in a worker process alike, so augmentations drawn from it are the same for any
``num_workers``, ``max_concurrency``, ``in_order``, and across a resume.

The loader's seed (:attr:`DataLoader.sample_seed`) is the ``generator`` argument when it is an int,
else a digest of the generator's state when the loader was built (so a seeded numpy or torch
generator gives a reproducible one; ``generator=None`` without torch gives a random one per
process). :meth:`DataLoader.state_dict` records it, so a resume reproduces it.

The generator is a PCG64 seeded by an integer mix of the triple, through a minimal
``ISeedSequence`` (numpy's ``SeedSequence`` costs ten times as much): a few microseconds.
Within one sample's fetch, repeated calls return the same generator (the stream continues).
"""

from __future__ import annotations

import contextvars
import hashlib
from types import FrameType
from typing import Any, cast

import numpy as np
from numpy.random.bit_generator import ISeedSequence

from .._exceptions import SampleRngError

__all__ = ("BATCH", "IDLE", "FrameScope", "Scope", "fetch_var", "index_key", "sample_rng",
           "scope_var", "seed_of")

_M = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15

# The index of a batch fetch (``__getitems__``): sample_rng needs the index passed.
BATCH: Any = object()
# The index a fetch worker on the loop is fetching between two fetches (see FrameScope):
# sample_rng is as unavailable as with no scope.
IDLE: Any = object()


def _mix(x: int) -> int:
    """A 64-bit multiply-xorshift mix (two rounds): every input bit reaches every output bit."""
    x = (x * 0x9E3779B97F4A7C15) & _M
    x ^= x >> 32
    x = (x * 0xD6E8FEB86659FD93) & _M
    return x ^ (x >> 32)


def index_key(index: Any) -> int:
    """A 64-bit key of a sample index: the int itself, else a digest of its repr (stable across
    processes, unlike ``hash``)."""
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        return int(index) & _M
    digest = hashlib.blake2b(repr(index).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def seed_of(generator: Any, rng: np.random.Generator) -> int:
    """The loader's sample seed: ``generator`` if an int, else a digest of ``rng``'s state."""
    if isinstance(generator, (int, np.integer)) and not isinstance(generator, bool):
        return int(generator) & _M
    text = repr(rng.bit_generator.state).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


class _Words(ISeedSequence):
    """Four ready-made 64-bit words: PCG64's seed and increment, without SeedSequence."""

    __slots__ = ("_words",)

    def __init__(self, words: np.ndarray[Any, np.dtype[np.uint64]]) -> None:
        self._words = words

    def generate_state(self, n_words: int, dtype: Any = np.uint32) -> Any:
        return self._words[:n_words]


class Scope:
    """What a fetch tells :func:`sample_rng`: the loader's seed, the epoch, and the index of the
    sample being fetched (:data:`BATCH` in ``__getitems__``). A fetch path that fetches several
    samples one after the other reuses one scope, setting :attr:`index` (and clearing the cached
    generator with :meth:`at`) for each; a fetch worker on the loop has a :class:`FrameScope`
    instead, which makes one of these per fetch that asks."""

    __slots__ = ("_base", "_buf", "_cache", "_last", "epoch", "index", "seed")

    def __init__(self, seed: int, epoch: int, index: Any = BATCH) -> None:
        self.seed = seed
        self.epoch = epoch
        self.index = index
        self._base: int | None = None  # the (seed, epoch) key, mixed when first needed
        self._buf: np.ndarray[Any, np.dtype[np.uint64]] | None = None
        self._last: np.random.Generator | None = None
        self._cache: dict[int, np.random.Generator] | None = None

    def at(self, index: Any) -> Scope:
        """This scope, now fetching ``index`` (a fresh stream for it)."""
        self.index = index
        self._last = None
        return self

    def current(self) -> Scope | None:
        """The scope of the fetch running now: this one."""
        return self

    def generator(self, index: Any) -> np.random.Generator:
        if index is None:
            if self.index is BATCH:
                raise SampleRngError(
                    "sample_rng() inside __getitems__ needs the sample's index: "
                    "sample_rng(index)"
                )
            last = self._last
            if last is None:
                last = self._last = self._make(index_key(self.index))
            return last
        key = index_key(index)
        cache = self._cache
        if cache is None:
            cache = self._cache = {}
        found = cache.get(key)
        if found is None:
            found = cache[key] = self._make(key)
        return found

    def _make(self, key: int) -> np.random.Generator:
        # PCG64's state is the mixed key (and the key), its increment (its stream) the
        # epoch's base and the key: distinct samples and epochs give distinct streams.
        base = self._base
        if base is None:
            base = self._base = _mix(_mix(self.seed ^ _GOLDEN) ^ (self.epoch & _M))
        words = self._buf
        if words is None:
            words = self._buf = np.empty(4, dtype=np.uint64)
        mixed = _mix(base ^ key)
        words[0] = mixed
        words[1] = key
        words[2] = base
        words[3] = key ^ mixed
        return np.random.Generator(np.random.PCG64(cast(Any, _Words(words))))


class FrameScope:
    """The scope of a fetch worker on the event loop (``MapEpoch._worker`` in
    :mod:`aloader.pipeline._epoch`), read from the worker's own frame when :func:`sample_rng` is
    called instead of written by the worker for every fetch.

    Contract: the frame's local ``fetching`` is the index being fetched, :data:`IDLE` between
    fetches, and ``job.epoch`` (its local ``job``) the epoch the fetch's job was admitted in.
    Once :attr:`asked` (set by the first :func:`sample_rng` call), the worker numbers each
    later fetch: its local ``fetch_no``, and :data:`fetch_var` in the context the fetch runs
    in, so in the tasks and threads it starts. One that outlives the fetch which started it
    sees another ``fetch_no`` (or IDLE): it gets no scope, never the stream of the sample
    fetched then (nor a draw from it, which would change that sample). Known hole: until
    the first call, fetches are not numbered, so such a task left by one of them and asking
    first, during the fetch of the first call, gets that fetch's stream. A worker fetches
    tens of thousands of items a second, hundreds of workers taking turns: a store into each
    worker's own scope object per fetch cost ~1.7% of an io epoch's CPU (a cache line per
    worker), a local's store nothing measurable. Reading the frame's locals costs ~1 us per
    call of :func:`sample_rng`, which makes a generator for several.
    """

    __slots__ = ("_frame", "_made", "_seed", "asked")

    def __init__(self, seed: int, frame: FrameType) -> None:
        self._seed = seed
        self._frame = frame
        # (fetch_no, its Scope) of the last fetch that asked: 0 names only the fetch during
        # which ``asked`` became true (no earlier fetch asked; later ones are numbered).
        self._made: tuple[int, Scope] | None = None
        self.asked = False  # whether sample_rng was called: the worker numbers its fetches

    def current(self) -> Scope | None:
        """The scope of the fetch running now (one per fetch) where the caller runs in its
        context, else None (between fetches, or a task or thread of an earlier fetch)."""
        local = self._frame.f_locals  # empty once the worker has returned
        fetching = local.get("fetching", IDLE)
        if fetching is IDLE:
            return None
        number = local["fetch_no"]
        if fetch_var.get() != number:
            return None  # a task or thread of an earlier fetch
        self.asked = True
        made = self._made
        if made is None or made[0] != number:
            made = self._made = (number, Scope(self._seed, local["job"].epoch, fetching))
        return made[1]


scope_var: contextvars.ContextVar[Scope | FrameScope | None] = contextvars.ContextVar(
    "aloader_sample_scope", default=None
)
# The number of the fetch (a FrameScope worker's local ``fetch_no``) in whose context the
# caller runs: set by the worker as each fetch starts once sample_rng was asked for, copied
# into the tasks and threads the fetch starts.
fetch_var: contextvars.ContextVar[int] = contextvars.ContextVar("aloader_fetch_no", default=0)


def sample_rng(index: Any = None) -> np.random.Generator:
    """A numpy Generator for the sample being fetched, the same whoever fetches it.

    Its stream depends only on the loader's seed (:attr:`DataLoader.sample_seed`), the epoch
    and the sample's index: not on ``num_workers``, ``max_concurrency``, ``in_order``, the
    worker or thread that fetches it, nor on a resume. Each epoch and each sample gets its own
    stream; calls during the same sample's fetch return the same generator.

    Args:
        index: the sample's index; needed inside ``__getitems__`` (which fetches several), and
            optional inside ``__getitem__`` (the index being fetched).

    Raises:
        SampleRngError: outside a DataLoader's fetch (a RuntimeError), or inside
            ``__getitems__`` without ``index``.
    """
    scope = scope_var.get()
    current = None if scope is None else scope.current()
    if current is None:
        raise SampleRngError(
            "sample_rng() is only available while a DataLoader fetches a sample (inside the "
            "dataset's __getitem__ or __getitems__)"
        )
    return current.generator(index)
