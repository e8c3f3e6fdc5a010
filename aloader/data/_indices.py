"""A sampler's epoch as int64 arrays: the private protocol the DataLoader reads samplers by
(:func:`epoch_indices`, :func:`epoch_chunks`; batches in :mod:`aloader.data._batchsampler`),
and the array helpers the samplers draw their epochs with.

Every sampler whose epoch is a finite sequence of int indices draws that epoch as int64 arrays;
``__iter__`` only converts them to Python ints chunk by chunk. The DataLoader reads the arrays
directly through :func:`epoch_indices` and :func:`~aloader.data._batchsampler.epoch_batches`,
so a shuffled epoch of millions of indices, cut into batches, never becomes a per-index Python
loop.

Invariant: an epoch is the concatenation of its chunks, whichever path reads it. An epoch of at
most ``_EPOCH_MAX`` indices is one chunk, drawn at once; a longer one
(``RandomSampler(num_samples=10**12)``) is drawn chunk by chunk as it is consumed, so the first
index comes at once and memory stays bounded by a chunk, not by the epoch.

Private protocol (relied on by the DataLoader):

* ``sampler._epoch_indices() -> IndexArray | None``: one epoch's order as a 1-D int64 array.
  Calling it draws the next epoch exactly as one ``__iter__`` would (the RNG advances
  identically). It returns ``None`` without drawing when there is no array form
  (:class:`~aloader.SubsetRandomSampler` over indices that are not ints) or when the epoch is
  longer than ``_EPOCH_MAX``.
* ``sampler._epoch_chunks() -> Iterator[IndexArray] | None``: the epoch as consecutive int64
  arrays (long epochs drawn lazily), or ``None`` without drawing when there is no array form.
* ``batch_sampler._epoch_batches() -> Iterator[IndexArray] | None``: one epoch's batches as int64
  arrays (views of the chunks where a batch lies in one), or ``None`` when the inner sampler has
  no array form.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import cast

import numpy as np

from ._random import IndexArray

__all__ = ("epoch_chunks", "epoch_indices")

# Python ints are made from the arrays this many at a time: big enough that tolist() dominates,
# small enough that a 10M epoch never holds 10M Python ints at once.
_CHUNK = 1 << 16

# The longest epoch drawn as one array (128 MiB of int64); longer ones are drawn _BLOCK indices
# at a time as they are consumed.
_EPOCH_MAX = 1 << 24
_BLOCK = 1 << 20

_EMPTY: IndexArray = np.empty(0, dtype=np.int64)
_INT64_MAX = int(np.iinfo(np.int64).max)


def _iter_ints(indices: IndexArray) -> Iterator[int]:
    """Yield the entries of ``indices`` as Python ints, converted chunk-wise."""
    for start in range(0, len(indices), _CHUNK):
        yield from indices[start : start + _CHUNK].tolist()


def _iter_chunks(chunks: Iterable[IndexArray]) -> Iterator[int]:
    """Yield the entries of consecutive index arrays as Python ints."""
    for chunk in chunks:
        yield from _iter_ints(chunk)


def _blocks(total: int) -> Iterator[tuple[int, int]]:
    """``(start, size)`` of the draws an epoch of ``total`` indices is made of: one when it is
    at most ``_EPOCH_MAX``, else consecutive ``_BLOCK``-sized ones."""
    if total <= _EPOCH_MAX:
        if total:
            yield 0, total
        return
    for start in range(0, total, _BLOCK):
        yield start, min(_BLOCK, total - start)


def _concat(chunks: Iterable[IndexArray]) -> IndexArray:
    """The concatenation of ``chunks`` (the chunk itself when there is one)."""
    parts = [chunk for chunk in chunks if len(chunk)]
    if not parts:
        return _EMPTY
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _range_chunks(r: range) -> Iterator[IndexArray] | None:
    """``r`` as consecutive int64 arrays, or None when its values do not fit in int64."""
    if len(r) and (min(r[0], r[-1]) < -_INT64_MAX - 1 or max(r[0], r[-1]) > _INT64_MAX):
        return None
    return (
        np.arange(r[start], r[start] + size * r.step, r.step, dtype=np.int64)
        for start, size in _blocks(len(r))
    )


def _as_index_array(obj: object) -> IndexArray | None:
    """``obj`` (a range, list, tuple or array of ints) as a 1-D int64 array, else ``None``."""
    if isinstance(obj, range):
        return np.arange(obj.start, obj.stop, obj.step, dtype=np.int64)
    try:
        arr = np.asarray(obj)
    except (TypeError, ValueError, OverflowError):
        return None
    if arr.ndim != 1:
        return None
    if arr.size == 0:
        return _EMPTY
    if arr.dtype.kind not in "iu":
        return None
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.max() > np.iinfo(np.int64).max:
        return None
    return arr.astype(np.int64, copy=False)


def _owner(cls: type, name: str) -> type | None:
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return None


def _fast_path_matches_iter(obj: object, name: str) -> bool:
    """Whether ``obj``'s ``name`` method describes what its ``__iter__`` yields.

    A subclass that overrides ``__iter__`` but not the array method must keep its own order, so
    the array method only counts when it is defined at least as far down the MRO as ``__iter__``.
    """
    cls = type(obj)
    fast = _owner(cls, name)
    if fast is None or not callable(getattr(obj, name, None)):
        return False
    it = _owner(cls, "__iter__")
    return it is None or issubclass(fast, it)


def epoch_indices(sampler: object) -> IndexArray | None:
    """Draw one epoch of ``sampler`` as a 1-D int64 array, or ``None`` if it has no array form.

    Samplers with ``_epoch_indices`` draw their next epoch (advancing their RNG exactly as one
    ``iter(sampler)`` would). Ranges, lists, tuples and 1-D numpy arrays of ints are converted
    without consuming randomness. Anything else (a generator, an async iterable, a custom
    sampler) gives ``None``: iterate it instead.

    Args:
        sampler: any sampler or iterable of indices.

    Returns:
        The epoch's indices, or ``None``.
    """
    if _fast_path_matches_iter(sampler, "_epoch_indices"):
        result = sampler._epoch_indices()  # type: ignore[attr-defined]
        return cast("IndexArray | None", result)
    if isinstance(sampler, range):
        chunks = _range_chunks(sampler) if len(sampler) <= _EPOCH_MAX else None
        return None if chunks is None else _concat(chunks)
    if isinstance(sampler, (list, tuple, np.ndarray)):
        return _as_index_array(sampler)
    return None


def epoch_chunks(sampler: object) -> Iterator[IndexArray] | None:
    """Draw one epoch of ``sampler`` as consecutive int64 arrays, or ``None`` without array form.

    Like :func:`epoch_indices`, but an epoch longer than ``_EPOCH_MAX`` (and a long ``range``)
    comes as a lazy iterator of bounded arrays instead of ``None``.

    Args:
        sampler: any sampler or iterable of indices.

    Returns:
        An iterator over the epoch's chunks, or ``None``.
    """
    if _fast_path_matches_iter(sampler, "_epoch_chunks"):
        result = sampler._epoch_chunks()  # type: ignore[attr-defined]
        return cast("Iterator[IndexArray] | None", result)
    if isinstance(sampler, range):
        return _range_chunks(sampler)
    indices = epoch_indices(sampler)
    return None if indices is None else iter((indices,))


def _skip_chunks(chunks: Iterable[IndexArray], count: int) -> Iterator[IndexArray]:
    """``chunks`` without their first ``count`` indices (whole chunks dropped, one sliced)."""
    for chunk in chunks:
        if count >= len(chunk):
            count -= len(chunk)
            continue
        yield chunk[count:]
        count = 0


def _slices(
    chunks: Iterable[IndexArray], batch_size: int, drop_last: bool
) -> Iterator[IndexArray]:
    """Cut consecutive index chunks into batches: views of a chunk, or joined across two."""
    carry = _EMPTY
    for chunk in chunks:
        if len(carry):
            need = batch_size - len(carry)
            if len(chunk) < need:
                carry = np.concatenate([carry, chunk])
                continue
            yield np.concatenate([carry, chunk[:need]])
            chunk = chunk[need:]
        stop = len(chunk) - len(chunk) % batch_size
        for start in range(0, stop, batch_size):
            yield chunk[start : start + batch_size]
        carry = chunk[stop:]
    if len(carry) and not drop_last:
        yield carry
