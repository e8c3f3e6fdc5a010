"""Pulling a batch's samples from an iterable dataset's iterator (sync or async), with or
without a failure budget.

Invariant: a pull never draws a sample more than the batch takes (the rest stays in the
source for the next batch, or a checkpoint), and an error of the source propagates as is
unless the failure budget absorbs it and the source can go on after raising.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any

from .._util import taken
from ._failures import resumable

if TYPE_CHECKING:
    from ._plan import FetchPlan

__all__ = ()

# What a pull returns when the source had no sample left.
_NOTHING: Any = object()



def _pull_sync(source: Any, size: int | None) -> tuple[Any, bool]:
    """Up to ``size`` samples (one sample when ``size`` is None) and whether the source ended."""
    if size is None:
        return next(source, _NOTHING), False
    # islice pulls at C speed (a Python loop's append and len per sample were ~40% of an
    # in-memory iterable's batch); it stops after exactly ``size`` samples, so it never
    # draws one sample more than the batch, and an error of the source propagates as is.
    # It takes iter() of what it is given: of the epoch's iterator as taken (a dataset whose
    # __iter__ resets and returns self would start over at every batch).
    samples = list(islice(taken(source), size))
    return (samples if samples else _NOTHING), len(samples) < size


def _pull_sync_tolerant(source: Iterator[Any], size: int | None, plan: FetchPlan
                        ) -> tuple[Any, bool]:
    """:func:`_pull_sync` with a failure budget: a sample whose ``__next__`` raises is
    counted (its index: its number in the epoch) and pulling goes on, unless the iterator
    cannot go on after raising (a generator), whose error is raised as is."""
    failures = plan.failures
    assert failures is not None
    want = 1 if size is None else size
    samples: list[Any] = []
    while len(samples) < want:
        number = failures.seen
        failures.attempted(1)
        try:
            samples.append(next(source))
        except StopIteration:
            failures.seen -= 1
            return (samples if samples else _NOTHING), True
        except Exception as exc:
            if not resumable(source):
                raise
            plan._absorbed(number, exc)
    return (samples[0] if size is None else samples), False


async def _pull_tolerant(source: AsyncIterator[Any], size: int | None, plan: FetchPlan
                         ) -> tuple[Any, bool]:
    """:func:`_pull` with a failure budget (see :func:`_pull_sync_tolerant`)."""
    failures = plan.failures
    assert failures is not None
    if not resumable(source):  # a stream: its errors end it, its sources' skips count
        samples, ended = await _pull(source, size)
        if samples is not _NOTHING:
            failures.attempted(1 if size is None else len(samples))
        failures.check_skipped()
        return samples, ended
    want = 1 if size is None else size
    out: list[Any] = []
    while len(out) < want:
        number = failures.seen
        failures.attempted(1)
        try:
            out.append(await source.__anext__())
        except StopAsyncIteration:
            failures.seen -= 1
            return (out if out else _NOTHING), True
        except Exception as exc:
            if not resumable(source):
                raise
            plan._absorbed(number, exc)
    return (out[0] if size is None else out), False


async def _pull(source: AsyncIterator[Any], size: int | None) -> tuple[Any, bool]:
    if size is None:
        try:
            return await source.__anext__(), False
        except StopAsyncIteration:
            return _NOTHING, True
    take = getattr(source, "_take", None)
    if take is not None:  # a stream hands over whole slices of its read-ahead blocks
        samples = await take(size)
        return (samples if samples else _NOTHING), len(samples) < size
    samples = []
    while len(samples) < size:
        try:
            samples.append(await source.__anext__())
        except StopAsyncIteration:
            return (samples if samples else _NOTHING), True
    return samples, False
