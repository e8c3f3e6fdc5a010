"""Samplers: the order in which a map-style dataset is read, with torch.utils.data's semantics
(:class:`Sampler`, :class:`SequentialSampler`, :class:`RandomSampler`,
:class:`SubsetRandomSampler`, :class:`WeightedRandomSampler`), and their state (torchdata's
``state_dict`` / ``load_state_dict``).

Each draws its epochs as int64 arrays, the protocol :mod:`aloader.data._indices` describes;
:class:`~aloader.BatchSampler` is :mod:`aloader.data._batchsampler`'s.

Invariant: a sampler's state is what its next epoch is drawn from (its generator); no position
inside an epoch is kept (the DataLoader skips what was consumed, without drawing it twice).
"""

from __future__ import annotations

import numbers
import sys
import threading
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any, Generic, Protocol, TypeGuard, TypeVar, cast, runtime_checkable

import numpy as np
import numpy.typing as npt

from ._indices import (
    _BLOCK,
    _EPOCH_MAX,
    _as_index_array,
    _blocks,
    _concat,
    _iter_chunks,
    _iter_ints,
    _range_chunks,
)
from ._random import (
    GeneratorLike,
    IndexArray,
    as_generator,
    imported_torch,
    integers,
    permutation,
    reseeded,
    restore_rng,
    rng_state,
    torch_generator,
)

__all__ = (
    "RandomSampler", "Sampler", "SequentialSampler", "Stateful", "SubsetRandomSampler",
    "TorchDraws", "WeightedRandomSampler", "is_stateful", "load_sampler_state", "sampler_state",
)

T_co = TypeVar("T_co", covariant=True)


# Sampler state (torchdata's protocol) -------------------------------------------------------------
@runtime_checkable
class Stateful(Protocol):
    """torchdata's protocol (``torchdata.stateful_dataloader.Stateful``): an object whose
    state a :class:`~aloader.DataLoader` checkpoint saves and restores. A dataset, the
    iterator an iterable dataset's ``__iter__`` returns, or a sampler with these two methods
    has them called (in the loader's process and in each worker): ``state_dict()`` after
    every batch, ``load_state_dict()`` when a checkpoint is resumed."""

    def state_dict(self) -> Any:
        """The object's state (a dict, as torchdata's)."""

    def load_state_dict(self, state_dict: Any) -> None:
        """Restore a :meth:`state_dict`."""


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` has torchdata's ``state_dict()`` / ``load_state_dict(state)``
    (:class:`Stateful`, methods that can be called)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def sampler_state(obj: object) -> Any:
    """``obj.state_dict()`` if ``obj`` is stateful, else None."""
    return cast(Any, obj).state_dict() if is_stateful(obj) else None


def load_sampler_state(obj: object, state: Any, *, apply: bool = True) -> None:
    """Load a :func:`sampler_state` into ``obj``; with ``apply=False`` only check what aloader's
    samplers can check (a user's sampler is trusted with its own state).

    Raises:
        ValueError: the state does not fit ``obj`` (aloader's samplers name the field).
    """
    if state is None:
        if isinstance(obj, _Stateful):
            raise ValueError(f"sampler state: missing for {type(obj).__name__}")
        return
    if not is_stateful(obj):
        raise ValueError(f"sampler state given for {type(obj).__name__}, which has no "
                         "load_state_dict")
    if isinstance(obj, _Stateful):
        obj._load_state(state, apply=apply)
    elif apply:
        cast(Any, obj).load_state_dict(state)


# The DataLoader's samplers by their argument: what a user changed between save and resume.
_SHUFFLE = {"SequentialSampler": " (shuffle=False)", "RandomSampler": " (shuffle=True)"}


def _kind(cls: type) -> str:
    """The aloader sampler a class is or extends (a subclass draws the same order)."""
    return next(c.__name__ for c in cls.__mro__ if c.__module__.split(".")[0] == "aloader"
                and not c.__name__.startswith("_"))


class _Stateful:
    """aloader's samplers: their state is what the next epoch is drawn from (their generator,
    a DistributedSampler's epoch); they keep no position inside an epoch (the DataLoader skips
    what was consumed, without drawing it twice)."""

    def state_dict(self) -> dict[str, Any]:
        """This sampler's state as JSON builtins: what its next epoch is drawn from, and which
        sampler draws it (a state is refused by another kind: its order would be another)."""
        generator = getattr(self, "_rng", None)
        kind = {"sampler": _kind(type(self))}
        return kind if generator is None else {**kind, "generator": rng_state(generator)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (checked first: never half-applied).

        Raises:
            ValueError: if the state does not fit this sampler.
        """
        self._load_state(state, apply=False)
        self._load_state(state, apply=True)

    def _load_state(self, state: Any, *, apply: bool) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"{type(self).__name__} state should be a dict, "
                             f"but got {type(state).__name__}")
        kind = _kind(type(self))
        saved = state.get("sampler")
        if saved is not None and saved != kind:
            raise ValueError(
                f"the sampler state was saved by {saved}"
                f"{_SHUFFLE.get(saved, '')}, but this sampler is {kind}"
                f"{_SHUFFLE.get(kind, '')}: resuming it would give another order")
        generator = getattr(self, "_rng", None)
        if generator is not None:
            if "generator" not in state:
                raise ValueError(f"{type(self).__name__} state: missing field 'generator'")
            restore_rng(generator, state["generator"], apply=apply)


class _Generated:
    """A sampler drawing from a ``generator=`` argument: ``generator`` is what was passed
    where it is a ``torch.Generator`` (the object itself, as torch's samplers keep it) or
    None, else the numpy Generator it became; assigning it (torch's samplers allow it) makes
    the next epoch draw from the new one. Every draw goes through :attr:`_rng`, the argument as a
    numpy Generator (:func:`~aloader.data._random.as_generator`)."""

    _rng: np.random.Generator
    _passed: Any  # the torch.Generator passed, None, else the numpy one
    _reseed: bool  # no generator: each epoch is seeded from the global RNG (torch's rule)

    @property
    def generator(self) -> Any:
        """The generator the epochs draw from (see the class docstring)."""
        return self._passed

    @generator.setter
    def generator(self, generator: GeneratorLike) -> None:
        rng = as_generator(generator)
        self._rng = rng
        torch_passed = None if generator is None else torch_generator(rng)
        # The DataLoader passes its own TorchBacked: its torch.Generator is the user's. With
        # none, None, as torch's (each epoch's seed comes from the global RNG).
        self._passed = None if generator is None else rng if torch_passed is None else (
            torch_passed)
        self._reseed = generator is None


class TorchDraws:
    """One epoch of a :class:`RandomSampler` over a ``torch.Generator``, drawn piece by piece
    as torch's sampler draws it: without replacement piece ``p`` is the ``p``-th permutation
    of ``n`` (the last one cut to the epoch's tail, possibly empty), with replacement the
    ``p``-th ``torch.randint`` of 32 (the last one of the remainder). A piece is drawn when its
    first index is first asked for, so that what the generator has drawn depends only on how
    far the epoch was asked, as in torch.

    Two callers ask, from any thread (a lock keeps the draws in order, each made once):
    :meth:`chunks`, the keys' reader, takes the pieces that hold indices; :meth:`reach`, the
    consumer's call (``DataLoader``: where torch's iterator asks its sampler, see
    :meth:`aloader.loader._dataloader.AsyncDataLoaderIter._advance`), draws every piece whose first
    index
    it has reached, an empty tail included, which no reader needs: so an epoch left early
    never draws it, and one read to the end draws it at the call torch's would.

    Args:
        draw: draws a piece of the given size from the sampler's generator.
        piece: the size of every piece but the last.
        num_samples: the epoch's indices.
    """

    def __init__(self, draw: Callable[[int], IndexArray], piece: int, num_samples: int
                 ) -> None:
        self._draw_one = draw
        self._piece = piece
        self._full, self._rest = divmod(num_samples, piece)
        self._drawn = 0  # pieces drawn so far
        self._ready: dict[int, IndexArray] = {}  # drawn, not yet taken by chunks()
        self._lock = threading.Lock()

    def _draw_upto(self, piece: int) -> None:
        with self._lock:
            while self._drawn <= piece:
                size = self._piece if self._drawn < self._full else self._rest
                self._ready[self._drawn] = self._draw_one(size)
                self._drawn += 1

    def reach(self, count: int) -> None:
        """Draw every piece whose first index is below ``count`` (the indices asked for)."""
        if count > 0:
            self._draw_upto(min(self._full, (count - 1) // self._piece))

    def take(self, piece: int) -> IndexArray:
        """Piece ``piece``, drawn now unless it was already."""
        self._draw_upto(piece)
        with self._lock:
            return self._ready.pop(piece)

    def pieces(self) -> int:
        """The epoch's pieces, an empty last one included."""
        return self._full + 1

    def chunks(self) -> Iterator[IndexArray]:
        """The epoch's pieces holding indices, in order (drawn as they are read, or before)."""
        for piece in range(self._full + (self._rest > 0)):
            yield self.take(piece)


def _is_int(value: object) -> TypeGuard[numbers.Integral]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class Sampler(Generic[T_co]):
    """Base class for all samplers.

    A sampler provides ``__iter__`` over dataset indices (or lists of indices for a batch
    sampler) and may provide ``__len__``. Any iterable or async iterable of ints is a valid
    sampler, and any iterable or async iterable of index lists a valid batch sampler; subclassing
    is optional.

    Args:
        data_source: ignored; accepted for code written against torch's old signature.
    """

    def __init__(self, data_source: Sized | None = None) -> None:
        # torch deprecated (and later dropped) this argument; subclasses still pass it.
        del data_source

    def __iter__(self) -> Iterator[T_co]:
        """Iterate over the indices; subclasses must override this."""
        raise NotImplementedError

    # No default __len__, as in torch: list() and friends fall back to iteration when it is
    # missing, and len() raises TypeError.


class _ArraySampler(_Stateful, Sampler[int]):
    """A sampler whose epochs subclasses draw as int64 chunks with ``_draw()``.

    Subclasses define ``_epoch_size()`` (the indices in the next epoch) and ``_draw()`` (a
    generator of the epoch's consecutive chunks, each at most ``_BLOCK`` long when the epoch is
    longer than ``_EPOCH_MAX``). This class turns that into the module's protocol; a subclass
    overriding ``_epoch_indices`` alone changes every path consistently.
    """

    def _epoch_size(self) -> int:
        raise NotImplementedError

    def _draw(self) -> Iterator[IndexArray]:
        raise NotImplementedError

    def _epoch_indices(self) -> IndexArray | None:
        if self._epoch_size() > _EPOCH_MAX:
            return None
        return _concat(self._draw())

    def _epoch_chunks(self) -> Iterator[IndexArray] | None:
        if self._epoch_size() > _EPOCH_MAX:
            return self._draw()
        indices = self._epoch_indices()
        return None if indices is None else iter((indices,))

    def _draws_as_torch(self) -> bool:
        """Whether ``__iter__`` draws as torch's own ``__iter__`` does, as the epoch is consumed
        (:meth:`_torch_draws`), rather than the whole epoch at its first index. Chosen here,
        not by a subclass's ``__iter__``, so that the array path still describes ``__iter__``
        (see :func:`_fast_path_matches_iter`)."""
        return False

    def _torch_draws(self) -> Iterator[int]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        """Iterate over one freshly drawn epoch."""
        # A generator: nothing is drawn before the first index is asked for, as in torch.
        if self._draws_as_torch():
            yield from self._torch_draws()
            return
        chunks = self._epoch_chunks()
        if chunks is not None:
            yield from _iter_chunks(chunks)


class SequentialSampler(_ArraySampler):
    """Samples elements sequentially, always in the same order.

    Args:
        data_source: the dataset to sample from; only its ``len()`` is used, at each epoch.
    """

    data_source: Sized

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source

    def _epoch_size(self) -> int:
        return len(self.data_source)

    def _draw(self) -> Iterator[IndexArray]:
        chunks = _range_chunks(range(len(self.data_source)))
        assert chunks is not None  # a len() fits in int64
        return chunks

    def __len__(self) -> int:
        """``len(data_source)``."""
        return len(self.data_source)


class RandomSampler(_Generated, _ArraySampler):
    """Samples elements randomly; without replacement it samples from a shuffled dataset.

    Without replacement and ``num_samples > len(data_source)``, an epoch is
    ``num_samples // n`` full permutations followed by a prefix of one more (torch's rule).
    An epoch longer than ``2**24`` indices is drawn lazily, a block at a time, so
    ``num_samples=10**12`` starts at once.

    With a ``torch.Generator`` the epochs are torch's own: ``torch.randperm`` and
    ``torch.randint`` with that generator, drawn as torch's RandomSampler draws them (including
    the permutation torch draws for an empty tail), so the same generator state gives the same
    orders as ``torch.utils.data.RandomSampler`` epoch after epoch. Other generators give numpy
    orders, which differ from torch's.

    Args:
        data_source: the dataset to sample from; its ``len()`` is read at each epoch.
        replacement: draw indices independently (with replacement) if True.
        num_samples: indices per epoch; defaults to ``len(data_source)``.
        generator: None, an int seed, a :class:`numpy.random.Generator` or a
            ``torch.Generator``; converted once, and every epoch draws from it.

    Raises:
        TypeError: if ``replacement`` is not a bool.
        ValueError: if ``num_samples`` is not a positive integer.
    """

    data_source: Sized
    replacement: bool

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: GeneratorLike = None,
    ) -> None:
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = int(num_samples) if _is_int(num_samples) else num_samples

        if not isinstance(self.replacement, bool):
            raise TypeError(
                f"replacement should be a boolean value, but got replacement={self.replacement}"
            )
        if not _is_int(self.num_samples) or self.num_samples <= 0:
            raise ValueError(
                "num_samples should be a positive integer value, "
                f"but got num_samples={self.num_samples}"
            )
        # Without a generator torch's RandomSampler reseeds from the global RNG every epoch.
        self.generator = generator

    @property
    def num_samples(self) -> int:
        """Indices per epoch: ``num_samples`` if given, else the current ``len(data_source)``."""
        # the dataset size may change at runtime
        if self._num_samples is None:
            return len(self.data_source)
        return self._num_samples

    def _epoch_size(self) -> int:
        return self.num_samples

    def _source_len(self) -> int:
        n = len(self.data_source)
        if n == 0:
            raise ValueError(
                f"RandomSampler cannot draw num_samples={self.num_samples} samples "
                "from an empty data_source"
            )
        return n

    def _draw(self) -> Iterator[IndexArray]:
        n = self._source_len()
        num_samples = self.num_samples
        rng = reseeded(self._rng) if self._reseed else self._rng
        if self.replacement:
            for _, size in _blocks(num_samples):
                yield integers(rng, n, size)
            return
        full, rest = divmod(num_samples, n)
        # Whole permutations, grouped so that a chunk of a long epoch holds about _BLOCK.
        group = max(1, full if num_samples <= _EPOCH_MAX else _BLOCK // n)
        for start in range(0, full, group):
            yield _concat([permutation(rng, n) for _ in range(min(group, full - start))])
        if rest or torch_generator(rng) is not None:
            # torch draws the tail's permutation even when the tail is empty.
            yield permutation(rng, n)[:rest]

    def _draws_as_torch(self) -> bool:
        """With a torch generator, ``__iter__`` draws when torch's own makes its draws, as the
        indices are consumed (each permutation when its first index is reached, the tail's
        included; with replacement, 32 indices at a time), so that an epoch left early leaves
        the generator where torch's would. The array path (:meth:`_epoch_indices`, the
        DataLoader's) draws the same epoch at once."""
        return torch_generator(self._rng) is not None

    def _torch_epoch(self) -> TorchDraws | None:
        """This epoch as torch draws it, piece by piece (:class:`TorchDraws`), or None
        (nothing drawn) unless this sampler draws as torch's does and only the epoch's first
        piece holds indices (at most ``len(data_source)`` of them without replacement, 32
        with): what a reader reads is then all drawn at the epoch's first ask, and only an
        empty tail is left for the consumer's calls."""
        if not self._draws_as_torch() or self.num_samples > (
                32 if self.replacement else self._source_len()):
            # Pieces after the first with indices in them: a reader running ahead of the
            # consumer would draw them when it gets to them, so the generator's state would
            # depend on timing. Such an epoch is drawn whole, before any key is read.
            return None
        return self._new_torch_epoch()

    def _new_torch_epoch(self) -> TorchDraws:
        n = self._source_len()
        rng = reseeded(self._rng) if self._reseed else self._rng
        if self.replacement:
            # torch's sampler draws 32 indices at a time.
            return TorchDraws(lambda size: integers(rng, n, size), 32, self.num_samples)
        return TorchDraws(lambda size: permutation(rng, n)[:size], n, self.num_samples)

    def _torch_draws(self) -> Iterator[int]:
        # Each piece when its first index is asked for; the last one (even an empty one) when
        # the epoch's end is.
        draws = self._new_torch_epoch()
        for piece in range(draws.pieces()):
            yield from draws.take(piece).tolist()

    def __len__(self) -> int:
        """``num_samples``."""
        return self.num_samples


class SubsetRandomSampler(_Generated, _Stateful, Sampler[int]):
    """Samples elements randomly from a given sequence of indices, without replacement.

    With a ``torch.Generator`` each epoch is ``torch.randperm(len(indices), generator=g)``,
    torch's order.

    Args:
        indices: the indices to sample from (read at each epoch).
        generator: None, an int seed, a :class:`numpy.random.Generator` or a
            ``torch.Generator``.
    """

    indices: Sequence[int]

    def __init__(self, indices: Sequence[int], generator: GeneratorLike = None) -> None:
        self.indices = indices
        self.generator = generator

    def _epoch_indices(self) -> IndexArray | None:
        # Non-int indices (keys of some mapping dataset) have no array form; checked before
        # drawing so that __iter__ still draws this epoch.
        indices = _as_index_array(self.indices)
        if indices is None:
            return None
        return indices[permutation(self._rng, len(indices))]

    def __iter__(self) -> Iterator[int]:
        """Iterate over a fresh random permutation of ``indices``."""
        order = self._epoch_indices()
        if order is not None:
            yield from _iter_ints(order)
            return
        indices = self.indices
        for i in _iter_ints(permutation(self._rng, len(indices))):
            yield indices[i]

    def __len__(self) -> int:
        """``len(indices)``."""
        return len(self.indices)


class WeightedRandomSampler(_Generated, _ArraySampler):
    """Samples ``[0, len(weights))`` with the given (unnormalised) probabilities.

    With replacement, draws are independent. Without replacement no index is drawn twice: the
    order is that of successive weighted draws from the remaining indices (indices of weight 0
    come last, in random order, as they only fill up when the positive weights run out).

    With a ``torch.Generator`` the draws are torch's, ``torch.multinomial(weights, num_samples,
    replacement, generator=g)``, so the orders equal torch's; except that an epoch longer than
    ``2**24`` is drawn lazily, one multinomial call per block (torch's single call would
    allocate the whole epoch).

    Args:
        weights: a 1-D sequence of non-negative weights, not necessarily summing to one.
        num_samples: indices per epoch.
        replacement: draw with replacement if True.
        generator: None, an int seed, a :class:`numpy.random.Generator` or a
            ``torch.Generator``.

    Raises:
        ValueError: if ``num_samples`` is not a positive integer, ``replacement`` not a bool or
            ``weights`` not 1-D. Invalid weight values raise RuntimeError when an epoch is drawn,
            with torch's messages.
    """

    num_samples: int
    replacement: bool

    def __init__(
        self,
        weights: npt.ArrayLike,
        num_samples: int,
        replacement: bool = True,
        generator: GeneratorLike = None,
    ) -> None:
        if not _is_int(num_samples) or num_samples <= 0:
            raise ValueError(
                f"num_samples should be a positive integer value, but got num_samples={num_samples}"
            )
        if not isinstance(replacement, bool):
            raise ValueError(
                f"replacement should be a boolean value, but got replacement={replacement}"
            )
        weights_array = np.asarray(weights, dtype=np.float64)
        if weights_array.ndim != 1:
            raise ValueError(
                "weights should be a 1d sequence but given "
                f"weights have shape {tuple(weights_array.shape)}"
            )
        self.weights = weights_array
        self.num_samples = int(num_samples)
        self.replacement = replacement
        self.generator = generator

    @property
    def weights(self) -> Any:
        """The weights as float64: a ``torch.double`` tensor (torch's attribute) where torch
        is imported (see :func:`~aloader.data._random.imported_torch`), else a numpy array. Both
        are the one buffer the epochs read, so an in-place change reaches the next epoch,
        as with torch's."""
        return self._weights_out

    @weights.setter
    def weights(self, weights: npt.ArrayLike) -> None:
        array = np.asarray(weights, dtype=np.float64)
        self._weights = array
        torch = imported_torch()
        self._weights_out = array if torch is None else torch.from_numpy(array)

    def _check_weights(self) -> npt.NDArray[np.float64]:
        # torch.multinomial's checks and messages, which depend on the sampling path it takes.
        w = self._weights
        k = self.num_samples
        if not self.replacement and k > len(w):
            raise RuntimeError(
                "cannot sample n_sample > prob_dist.size(-1) samples without replacement"
            )
        if not self.replacement or k == 1:
            if len(w) and not (np.all(w >= 0) and np.all(w < np.inf)):
                raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        else:
            if not np.all(w >= 0):
                raise RuntimeError(
                    "invalid multinomial distribution (encountering probability entry < 0)"
                )
            if np.any(np.isinf(w)):
                raise RuntimeError(
                    "invalid multinomial distribution (encountering probability entry = infinity "
                    "or NaN)"
                )
        if len(w) == 0 or not np.any(w > 0):
            raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        return w

    def _epoch_size(self) -> int:
        return self.num_samples

    def _draw(self) -> Iterator[IndexArray]:
        w = self._check_weights()
        rng = self._rng
        tg = torch_generator(rng)
        if tg is not None:
            torch = sys.modules["torch"]  # present: the generator is torch's
            weights = torch.from_numpy(w)
            k = self.num_samples
            sizes = [size for _, size in _blocks(k)] if self.replacement else [k]
            for size in sizes:
                drawn = torch.multinomial(weights, size, self.replacement, generator=tg)
                yield np.asarray(drawn.numpy(), dtype=np.int64)
            return
        if self.replacement:
            # Inverse-CDF sampling; scaling by the max first keeps huge weights from overflowing.
            cdf = np.cumsum(w / w.max())
            cdf /= cdf[-1]
            for _, size in _blocks(self.num_samples):
                # u < 1 == cdf[-1], and "right" never lands on a zero-weight index.
                u = rng.random(size)
                yield np.searchsorted(cdf, u, side="right").astype(np.int64, copy=False)
            return
        # Exponential race (as torch): the k largest w / E_i, in decreasing order, are k
        # successive weighted draws without replacement. Zero weights rank below every positive
        # one, in random order.
        e = rng.standard_exponential(len(w))
        with np.errstate(divide="ignore"):
            keys = np.where(w > 0, w / e, -e)
        k = self.num_samples
        neg = -keys
        if k < len(w):
            top = np.argpartition(neg, k - 1)[:k]
            order = top[np.argsort(neg[top], kind="stable")]
        else:
            order = np.argsort(neg, kind="stable")
        yield order.astype(np.int64, copy=False)

    def __len__(self) -> int:
        """``num_samples``."""
        return self.num_samples
