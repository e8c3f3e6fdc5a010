"""Fetching from one map-style dataset: these indices, from this dataset, in this mode.

This module owns the calls that turn indices into samples, for the loader's
:class:`~aloader.pipeline._plan.FetchPlan` and the wrapper datasets of
:mod:`aloader.data._dataset`
(which fetch from their children) alike. The mode is the dataset's
:func:`~aloader.data._dataset.fetch_mode`: ``"async"`` fetches return awaitables and are awaited
on the loop, ``"inline"`` fetches run on the loop, ``"thread"`` fetches run through
``in_thread`` (the plan's cancellable thread call; :func:`anyio.to_thread.run_sync` for the
wrappers).

A batch goes through the dataset's ``__getitems__`` when the caller found one (the caller
decides what counts, see :func:`getitems_of`), else through ``__getitem__`` index by index;
items of an async dataset are then fetched concurrently. An error from the dataset reaches
the caller as itself, never wrapped in an exception group.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeAlias

import anyio
import anyio.to_thread
import numpy as np

from .._util import resolve, single_error

__all__ = (
    "DatasetFetchMode",
    "InThread",
    "fetch_many",
    "fetch_many_sync",
    "fetch_one",
    "gather",
    "getitems_of",
    "index_list",
)

# How a dataset's own fetches run (see aloader.data._dataset.fetch_mode): awaited on the event
# loop ("async"), called on it ("inline": fast, in memory) or in a worker thread ("thread":
# blocking). A plan may fetch otherwise (aloader.pipeline._plan.FetchMode: in worker processes).
DatasetFetchMode: TypeAlias = Literal["async", "inline", "thread"]
# Runs ``fn(*args)`` in a worker thread from async code: ``in_thread(fn, *args)``.
InThread: TypeAlias = Callable[..., Awaitable[Any]]
Getitems: TypeAlias = "Callable[[Any], Any] | None"


def getitems_of(dataset: object) -> Callable[[Any], Any] | None:
    """``dataset.__getitems__`` when it is callable, else None (torch's test for a child)."""
    getitems = getattr(dataset, "__getitems__", None)
    return getitems if callable(getitems) else None


def index_list(indices: Any) -> Any:
    """``indices`` as ``__getitem__`` is to see them: python ints where they are an index array.

    torch's fetcher hands ``dataset[i]`` the sampler's own ints; aloader's vectorised paths
    carry a batch as an int64 array, whose elements (``np.int64``) a user's ``__getitem__``
    could tell apart (``isinstance(i, int)``, ``json.dumps``). A ``__getitems__`` still gets
    what it was given.
    """
    return indices.tolist() if isinstance(indices, np.ndarray) else indices


def fetch_many_sync(dataset: Any, getitems: Getitems, indices: Any) -> Any:
    """The samples at ``indices``: one ``getitems`` call, or ``dataset[i]`` for each index.

    Whatever the dataset returns, awaitables included, comes back as it is.
    """
    if getitems is not None:
        return getitems(indices)
    return [dataset[index] for index in index_list(indices)]


async def fetch_many(
    dataset: Any,
    getitems: Getitems,
    indices: Any,
    mode: DatasetFetchMode,
    in_thread: InThread = anyio.to_thread.run_sync,
) -> Any:
    """The samples at ``indices``, fetched as ``mode`` says, from async code.

    ``getitems`` is the dataset's ``__getitems__`` or None (see :func:`getitems_of`); without
    it an async dataset's items are fetched concurrently.
    """
    if mode == "thread":
        samples = await in_thread(fetch_many_sync, dataset, getitems, indices)
    elif mode == "async" and getitems is None:
        getitem = dataset.__getitem__
        return await gather([functools.partial(getitem, index) for index in index_list(indices)])
    else:
        samples = fetch_many_sync(dataset, getitems, indices)
    return await resolve(samples)


async def fetch_one(
    dataset: Any, index: Any, mode: DatasetFetchMode, in_thread: InThread = anyio.to_thread.run_sync
) -> Any:
    """The sample at ``index``, fetched as ``mode`` says, from async code."""
    if mode == "thread":
        value = await in_thread(operator.getitem, dataset, index)
    else:
        value = dataset[index]
    return await resolve(value)


async def gather(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` (each returning a value or an awaitable) concurrently; results in order.

    A failing call re-raises its own exception (not an exception group), so the loader reports
    the dataset's error type unchanged.
    """
    if len(calls) <= 1:
        return [await resolve(call()) for call in calls]
    results: list[Any] = [None] * len(calls)

    async def run(position: int) -> None:
        results[position] = await resolve(calls[position]())

    error: BaseException | None = None
    try:
        async with anyio.create_task_group() as group:
            for position in range(len(calls)):
                group.start_soon(run, position)
    except BaseExceptionGroup as exc_group:
        error = single_error(exc_group)
        if error is None or isinstance(error, anyio.get_cancelled_exc_class()):
            raise
    if error is not None:
        # Raised outside the except block so the error keeps its own cause and context.
        raise error
    return results
