"""Batches of indices: :class:`BatchSampler` (torch's, over any sampler, sync or async), and
one epoch of a batch sampler as int64 array batches (:func:`epoch_batches`) or drawn as
torch's sampler draws it (:func:`torch_epoch`).

Invariant: the array batches are the batches ``__iter__`` yields (views of the inner sampler's
chunks, or joined across two), whichever path reads the epoch.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Sized
from typing import Any, cast

from .._util import ataken, close_iterator, taken
from ._indices import (
    _fast_path_matches_iter,
    _iter_chunks,
    _owner,
    _skip_chunks,
    _slices,
    epoch_chunks,
)
from ._random import IndexArray
from ._sampler import (
    RandomSampler,
    Sampler,
    _ArraySampler,
    _is_int,
    _Stateful,
    load_sampler_state,
    sampler_state,
)

__all__ = ("BatchSampler", "epoch_batches", "torch_epoch")


class BatchSampler(_Stateful, Sampler[list[int]]):
    """Wraps another sampler to yield mini-batches of indices.

    The inner sampler may be any iterable of ints (a range, a list, a sampler) or any async
    iterable of ints; iterate with ``async for`` in the latter case.

    Args:
        sampler: the base sampler.
        batch_size: size of a mini-batch.
        drop_last: drop the last batch if it is smaller than ``batch_size``.

    Raises:
        ValueError: if ``batch_size`` is not a positive integer or ``drop_last`` not a bool.

    Example::

        >>> list(BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False))
        [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
        >>> list(BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=True))
        [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    """

    sampler: Iterable[int] | AsyncIterable[int]
    batch_size: int
    drop_last: bool

    def __init__(
        self,
        sampler: Sampler[int] | Iterable[int] | AsyncIterable[int],
        batch_size: int,
        drop_last: bool,
    ) -> None:
        # No isinstance check on sampler: objects with only __getitem__ are iterable too.
        if not _is_int(batch_size) or batch_size <= 0:
            raise ValueError(
                f"batch_size should be a positive integer value, but got batch_size={batch_size}"
            )
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be a boolean value, but got drop_last={drop_last}")
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.drop_last = drop_last

    def _epoch_batches(self, skip: int = 0) -> Iterator[IndexArray] | None:
        chunks = epoch_chunks(self.sampler)
        if chunks is None:
            return None
        if skip:  # the skipped batches are all full ones
            chunks = _skip_chunks(chunks, skip * self.batch_size)
        return _slices(chunks, self.batch_size, self.drop_last)

    def state_dict(self) -> dict[str, Any]:
        """The inner sampler's state (None if it has none): see :func:`sampler_state`."""
        return {"sampler": sampler_state(self.sampler)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` into the inner sampler (checked first).

        Raises:
            ValueError: if the state does not fit.
        """
        self._load_state(state, apply=False)
        self._load_state(state, apply=True)

    def _load_state(self, state: Any, *, apply: bool) -> None:
        if not isinstance(state, dict) or "sampler" not in state:
            raise ValueError("BatchSampler state should be a dict with field 'sampler'")
        load_sampler_state(self.sampler, state["sampler"], apply=apply)

    def __iter__(self) -> Iterator[list[int]]:
        """Iterate over one epoch of batches, each a list of ints.

        Raises:
            TypeError: if the inner sampler is only async iterable.
        """
        batches = self._iterated_batches()
        if batches is not None:
            for batch in batches:
                yield batch.tolist()
            return
        yield from self._generic_batches()

    def _iterated_batches(self) -> Iterator[IndexArray] | None:
        """The array batches ``__iter__`` yields, or None to run torch's loops over the inner
        sampler: always for one that draws as torch's does, as it is consumed, so that an
        epoch left early leaves its generator where torch's would."""
        inner = self.sampler
        if isinstance(inner, _ArraySampler) and inner._draws_as_torch():
            return None
        return self._epoch_batches()

    def _batches_after(self, skip: int) -> Iterator[list[int]] | None:
        """The epoch's batches after the first ``skip``, the skipped indices drawn from the
        inner sampler and discarded without making batches of them (None when the inner
        sampler is only async iterable)."""
        batches = self._epoch_batches(skip)
        if batches is not None:
            return (batch.tolist() for batch in batches)
        if not isinstance(self.sampler, Iterable):
            return None
        return self._generic_batches(skip * self.batch_size)

    def _generic_batches(self, skip: int = 0) -> Iterator[list[int]]:
        try:
            sampler_iter = iter(cast("Iterable[int]", self.sampler))
            if skip:
                sampler_iter = itertools.islice(taken(sampler_iter), skip, None)
        except TypeError:
            if isinstance(self.sampler, AsyncIterable):
                raise TypeError(
                    f"BatchSampler's sampler ({type(self.sampler).__name__}) only supports "
                    "async iteration; iterate the BatchSampler with `async for`"
                ) from None
            raise
        # torch's loops: the drop_last one zips batch_size references to the same iterator
        # (zip takes iter() of each at once: a sampler whose __iter__ returns itself is asked
        # batch_size more times before the first index, as torch's is, then never again).
        # torch's other loop cuts each batch with islice, which asks such a sampler again per
        # batch: it would start over (a reset) forever. Its iterator is taken once here.
        if self.drop_last:
            for batch_droplast in zip(*([sampler_iter] * self.batch_size), strict=False):
                yield [*batch_droplast]
        else:
            indices = taken(sampler_iter)
            batch = [*itertools.islice(indices, self.batch_size)]
            while batch:
                yield batch
                batch = [*itertools.islice(indices, self.batch_size)]

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        """Asynchronously iterate over one epoch of batches (sync or async inner sampler)."""
        batches = self._iterated_batches()
        if batches is not None:
            for array_batch in batches:
                yield array_batch.tolist()
            return
        if not isinstance(self.sampler, AsyncIterable):
            for list_batch in self._generic_batches():
                yield list_batch
            return
        it = aiter(self.sampler)
        try:
            batch: list[int] = []
            async for index in ataken(it):
                batch.append(index)
                if len(batch) == self.batch_size:
                    yield batch
                    batch = []
            if batch and not self.drop_last:
                yield batch
        finally:
            await close_iterator(it)

    def __len__(self) -> int:
        """Number of batches; needs ``len()`` of the inner sampler."""
        n = len(cast("Sized", self.sampler))
        if self.drop_last:
            return n // self.batch_size
        return (n + self.batch_size - 1) // self.batch_size


def epoch_batches(batch_sampler: object, skip: int = 0) -> Iterator[IndexArray] | None:
    """One epoch of ``batch_sampler`` as int64 array batches, or ``None`` without an array form.

    Args:
        batch_sampler: any batch sampler; only a :class:`BatchSampler` (or anything else with
            ``_epoch_batches``) over an array-capable sampler has an array form.
        skip: leave out the epoch's first ``skip`` batches (a resume): a :class:`BatchSampler`
            drops their indices from its chunks without cutting them into batches.

    Returns:
        An iterator over the epoch's batches (array views), or ``None``.
    """
    if _fast_path_matches_iter(batch_sampler, "_epoch_batches"):
        if skip and _owner(type(batch_sampler), "_epoch_batches") is BatchSampler:
            return cast(BatchSampler, batch_sampler)._epoch_batches(skip)
        result = batch_sampler._epoch_batches()  # type: ignore[attr-defined]
        if result is not None and skip:
            return itertools.islice(cast("Iterator[IndexArray]", result), skip, None)
        return cast("Iterator[IndexArray] | None", result)
    return None


def torch_epoch(index_sampler: object, batched: bool
                ) -> tuple[Iterator[Any], Callable[[int], None]] | None:
    """An epoch of keys drawn as torch's sampler draws them, and how to say how many keys the
    consumer has asked for (torch's batches, or indices without ``batched``); None (nothing
    drawn) unless ``index_sampler`` is a :class:`RandomSampler` that draws as torch's does
    (:class:`TorchDraws`), in a :class:`BatchSampler` when ``batched``.

    The keys are those of :func:`epoch_batches` (arrays) or the indices as ints."""
    inner = index_sampler
    if batched:
        if not isinstance(index_sampler, BatchSampler) or not _fast_path_matches_iter(
                index_sampler, "_epoch_batches"):
            return None
        inner = index_sampler.sampler
    if not isinstance(inner, RandomSampler) or not _fast_path_matches_iter(
            inner, "_epoch_chunks"):
        return None
    draws = inner._torch_epoch()
    if draws is None:
        return None
    if not batched:
        return _iter_chunks(draws.chunks()), draws.reach
    assert isinstance(index_sampler, BatchSampler)
    size = index_sampler.batch_size
    batches = _slices(draws.chunks(), size, index_sampler.drop_last)
    return batches, lambda keys: draws.reach(keys * size)
