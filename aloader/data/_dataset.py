"""Datasets: torch.utils.data's dataset classes, and what a dataset says about how to call it.

This module owns the dataset classes and the questions asked of any dataset, whatever its class:
is it iterable (:func:`is_iterable_dataset`), how is it iterated (:func:`aiter_of`,
:func:`iterate`), and how are its ``__getitem__``/``__getitems__`` called (:func:`fetch_mode`).
A map-style dataset may define ``__getitem__`` (and optionally ``__getitems__``) as plain methods
or as ``async def``; an iterable dataset may define ``__iter__`` or ``__aiter__``. The wrappers
(:class:`Subset`, :class:`ConcatDataset`, :class:`StackDataset`, :class:`ChainDataset`) work over
either kind: they call each child as :func:`fetch_mode` says, the very answer a loader's
:meth:`~aloader.pipeline._plan.FetchPlan.for_dataset` builds its plan on, through the same fetch
calls as the plan (:mod:`aloader.data._fetch`), and tell the loader how to call them through
:func:`fetch_mode` too.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import numbers
import sys
import warnings
from collections.abc import (
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from typing import Any, Generic, TypeAlias, TypeVar, cast

import numpy as np
import numpy.typing as npt

from .._util import close_iterator, is_async_callable, taken
from ._collate import ColumnBatch
from ._fetch import (
    DatasetFetchMode,
    fetch_many,
    fetch_many_sync,
    fetch_one,
    gather,
    getitems_of,
    index_list,
)
from ._random import GeneratorLike, as_generator, permutation

__all__ = (
    "ArrayDataset",
    "ChainDataset",
    "ConcatDataset",
    "Dataset",
    "IterableDataset",
    "StackDataset",
    "Subset",
    "TensorDataset",
    "aiter_of",
    "fetch_mode",
    "is_iterable_dataset",
    "iterate",
    "random_split",
)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

IndicesLike: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]

# One child's share of a batch: (child, positions in the batch or None for all, child indices).
_Step: TypeAlias = "tuple[int, Any, Any]"

_NESTED_SIZE = "Nested dataset's output size mismatch. Expected {}, got {}"


class Dataset(Generic[T_co]):
    """A map-style dataset: a map from keys (usually ``0 <= i < len(ds)``) to samples.

    Subclasses define ``__getitem__`` and usually ``__len__``. Either may be a plain method or an
    ``async def`` (for samples fetched over the network, say); the loader awaits async ones on its
    event loop. A subclass may also define ``__getitems__(indices)`` returning the list of samples
    for a whole batch at once (plain or async, like ``__getitem__``).

    ``dataset + other`` is ``ConcatDataset([dataset, other])``.
    """

    def __getitem__(self, index: Any) -> Any:
        """Return the sample at ``index`` (or an awaitable of it, for an async dataset)."""
        raise NotImplementedError("Subclasses of Dataset should implement __getitem__.")

    # No __getitems__ here on purpose: its absence tells the loader to fetch item by item.

    def __add__(self, other: Dataset[T]) -> ConcatDataset[T_co | T]:
        """Concatenate: ``ConcatDataset([self, other])``."""
        return ConcatDataset[T_co | T]([self, other])


# Anything indexable with a length works as a dataset, as in torch (``random_split(range(10))``).
# A runtime value (after Dataset) so that typing.get_type_hints resolves the signatures using it.
DatasetLike: TypeAlias = Dataset[T] | Sequence[T]


class IterableDataset(Dataset[T_co]):
    """A dataset that is a stream of samples, for data that cannot be indexed.

    Subclasses define ``__iter__`` (a plain iterator) or ``__aiter__`` (an async iterator, e.g. an
    ``async def`` generator reading from a socket). With loader workers, each worker iterates its
    own copy; use ``get_worker_info()`` to shard the stream between them.

    ``stream + other`` is ``ChainDataset([stream, other])``.
    """

    def __add__(self, other: Dataset[T]) -> ChainDataset[T_co | T]:  # type: ignore[override]
        """Chain: ``ChainDataset([self, other])``."""
        return ChainDataset[T_co | T]([self, other])


# --------------------------------------------------------------------------- iteration


def is_stream_class(dataset: object) -> bool:
    """Whether ``dataset`` is an :class:`IterableDataset`: aloader's, or torch's when torch is
    loaded (a torch script's ``IterableDataset`` subclass inherits ``Dataset.__getitem__``, so
    duck typing alone would take it for a map)."""
    if isinstance(dataset, IterableDataset):
        return True
    torch_data = sys.modules.get("torch.utils.data")
    torch_stream = getattr(torch_data, "IterableDataset", None)
    return isinstance(torch_stream, type) and isinstance(dataset, torch_stream)


def is_iterable_dataset(dataset: object) -> bool:
    """Whether the loader treats ``dataset`` as a stream of samples rather than a map."""
    if is_stream_class(dataset):
        return True
    # Duck typing: something iterable without item access is a stream, not a map.
    has_iter = hasattr(dataset, "__iter__") or hasattr(dataset, "__aiter__")
    return has_iter and not hasattr(dataset, "__getitem__")


def aiter_of(dataset: object) -> Callable[[], Any] | None:
    """The dataset's ``__aiter__``, or None when its class defines none."""
    if getattr(type(dataset), "__aiter__", None) is None:
        return None
    return getattr(dataset, "__aiter__", None)


def iterate(dataset: Any) -> Iterator[Any] | AsyncIterator[Any]:
    """A new iterator over an iterable dataset: its ``__aiter__`` when it has one."""
    aiter_ = aiter_of(dataset)
    if aiter_ is not None:
        return cast(AsyncIterator[Any], aiter_())
    return cast(Iterator[Any], iter(dataset))


# --------------------------------------------------------------------------- fetch protocol


def _inspect_async(dataset: object) -> bool:
    getitems = getattr(dataset, "__getitems__", None)
    getitem = getattr(dataset, "__getitem__", None)
    getitem_async = is_async_callable(getitem)
    if getitems is None:
        return getitem_async
    getitems_async = is_async_callable(getitems)
    # The base class's NotImplementedError stub says nothing about the subclass's intent.
    own_getitem = getattr(type(dataset), "__getitem__", None) is not Dataset.__getitem__
    if own_getitem and getitem is not None and getitems_async != getitem_async:
        kinds = {True: "async def", False: "a plain method"}
        raise TypeError(
            f"{type(dataset).__name__} defines __getitem__ as {kinds[getitem_async]} but "
            f"__getitems__ as {kinds[getitems_async]}; make both async or both plain, or set "
            "the class attribute _async_fetch to say which one the loader should expect"
        )
    return getitems_async


def fetch_mode(dataset: object) -> DatasetFetchMode:
    """How the loader should call ``dataset``'s ``__getitem__``/``__getitems__``.

    Reads the optional ``_async_fetch`` and ``_inline_fetch`` attributes first; without
    ``_async_fetch`` it inspects ``__getitems__`` (when present and not None), else
    ``__getitem__``, for ``async def``.

    Args:
        dataset: any map-style dataset (a :class:`Dataset`, a list, a numpy array...).

    Returns:
        ``"async"`` when the fetch methods return awaitables; ``"inline"`` when they are
        synchronous and fast enough (in memory) to run on the event loop; ``"thread"`` for other
        synchronous datasets, whose fetches may block and belong in a thread.

    Raises:
        TypeError: when ``__getitem__`` and ``__getitems__`` disagree on being async and the
            dataset does not say which to expect through ``_async_fetch``.
    """
    is_async = getattr(dataset, "_async_fetch", None)
    if is_async is None:
        is_async = _inspect_async(dataset)
    if is_async:
        return "async"
    inline = getattr(dataset, "_inline_fetch", None)
    if inline is None:
        inline = type(dataset) in (list, tuple, range) or type(dataset) is np.ndarray
    return "inline" if inline else "thread"


def _overridden(obj: object, base: type, names: tuple[str, ...]) -> list[Any]:
    """Methods among ``names`` that ``type(obj)`` redefines relative to ``base``."""
    cls = type(obj)
    out = []
    for name in names:
        method = getattr(cls, name, None)
        if method is not getattr(base, name, None):
            out.append(method)
    return out


def _wrapper_modes(obj: object, base: type, child_modes: Iterable[DatasetFetchMode]
                   ) -> tuple[bool, bool]:
    """(async, inline) for a wrapper dataset, unless a subclass took over fetching itself."""
    own = _overridden(obj, base, ("__getitem__", "__getitems__"))
    if own:
        return any(is_async_callable(method) for method in own), False
    modes = list(child_modes)
    return "async" in modes, all(mode == "inline" for mode in modes)


async def _resolved(value: Any) -> Any:
    return value


def _check_size(items: Sequence[Any], expected: int) -> None:
    if len(items) != expected:
        raise ValueError(_NESTED_SIZE.format(expected, len(items)))


# --------------------------------------------------------------------------- ArrayDataset


def _is_torch_tensor(obj: object) -> bool:
    # Never imports torch: a tensor can only exist if the user's code already imported it.
    return type(obj).__module__.startswith("torch") and hasattr(obj, "size")


def _first_dim(array: Any, position: int) -> int:
    shape = getattr(array, "shape", None)
    if shape is not None and len(shape) == 0:
        raise IndexError(
            f"ArrayDataset: the array at position {position} is 0-dimensional; every array "
            "needs a first dimension to index samples along"
        )
    return int(shape[0]) if shape is not None else len(array)


def _as_index_array(indices: Any) -> npt.NDArray[np.intp]:
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu":
        if idx.size == 0:
            return np.empty(idx.shape, dtype=np.intp)
        raise IndexError(f"indices should be integers, but got an array of dtype {idx.dtype}")
    return idx.astype(np.intp, copy=False)


class ArrayDataset(Dataset[tuple[Any, ...]]):
    """Dataset wrapping arrays: torch's ``TensorDataset`` for numpy (also named ``TensorDataset``).

    Sample ``i`` is ``tuple(array[i] for array in arrays)``. Any object with a first dimension
    works: numpy arrays, lists, torch tensors, memory-mapped arrays.

    Batches are fetched vectorised by ``__getitems__``: over numpy arrays it indexes each array
    once with the whole batch and returns a :class:`~aloader.data._collate.ColumnBatch`, which
    :func:`~aloader.default_collate` passes through without unstacking and restacking.

    Args:
        *arrays: arrays with the same size of the first dimension.

    Raises:
        AssertionError: "Size mismatch between tensors" when first dimensions differ (as torch).
        ValueError: when no array is given.
    """

    arrays: tuple[Any, ...]

    def __init__(self, *arrays: Any) -> None:
        if not arrays:
            raise ValueError("At least one array should be passed")
        sizes = [_first_dim(array, position) for position, array in enumerate(arrays)]
        if any(size != sizes[0] for size in sizes):
            raise AssertionError("Size mismatch between tensors")
        self.arrays = arrays
        self._length = sizes[0]
        self._all_numpy = all(isinstance(array, np.ndarray) for array in arrays)
        self._arrays_only = all(
            isinstance(array, np.ndarray) or _is_torch_tensor(array) for array in arrays
        )
        # Memory maps, HDF5 or zarr arrays read from disk: keep those off the event loop.
        self._in_memory = all(
            (type(array) is np.ndarray)
            or isinstance(array, (list, tuple))
            or _is_torch_tensor(array)
            for array in arrays
        )

    @property
    def _array_indices(self) -> bool:
        # Tells the loader our __getitems__ takes numpy index arrays straight from samplers.
        return not _overridden(self, ArrayDataset, ("__getitems__",))

    @property
    def tensors(self) -> tuple[Any, ...]:
        """The wrapped arrays (torch's attribute name)."""
        return self.arrays

    @property
    def _inline_fetch(self) -> bool:
        own = _overridden(self, ArrayDataset, ("__getitem__", "__getitems__"))
        return self._in_memory and not own

    def __getitem__(self, index: Any) -> tuple[Any, ...]:
        """Return ``tuple(array[index] for array in arrays)``."""
        return tuple(array[index] for array in self.arrays)

    def __getitems__(self, indices: IndicesLike) -> Sequence[tuple[Any, ...]]:
        """Return the samples at ``indices`` (a list of ints or a 1-D integer array).

        Over numpy arrays and torch tensors: a :class:`~aloader.data._collate.ColumnBatch` of
        ``array[indices]`` columns (default_collate returns a tensor column as the batch, as
        torch's stack of its rows would be). Otherwise a list of per-sample tuples (arrays and
        tensors are still indexed once per batch).
        """
        if self._all_numpy:
            idx = _as_index_array(indices)
            # take() gathers rows about twice as fast as fancy indexing.
            return ColumnBatch([array.take(idx, axis=0) for array in self.arrays])
        columns: list[Any] = []
        idx_array: npt.NDArray[np.intp] | None = None
        for array in self.arrays:
            if isinstance(array, np.ndarray) or _is_torch_tensor(array):
                if idx_array is None:
                    idx_array = _as_index_array(indices)
                if isinstance(array, np.ndarray):
                    columns.append(array[idx_array])
                else:
                    torch = sys.modules["torch"]  # present: the data holds its tensors
                    columns.append(array[torch.from_numpy(idx_array)])
            else:
                columns.append([array[index] for index in indices])
        if self._arrays_only:
            return ColumnBatch(columns)
        return list(zip(*columns, strict=True))

    def __len__(self) -> int:
        """The size of the first dimension."""
        return self._length


TensorDataset = ArrayDataset


# --------------------------------------------------------------------------- StackDataset


class StackDataset(Dataset[Any]):
    """Dataset as a stacking of datasets: sample ``i`` holds sample ``i`` of each one.

    ``StackDataset(images, texts)[0] == (images[0], texts[0])`` and
    ``StackDataset(image=images, text=texts)[0] == {"image": images[0], "text": texts[0]}``.
    Batches use each child's ``__getitems__`` when it has one. When a child is async, so is the
    stack: its methods return awaitables, and the children are fetched concurrently.

    Args:
        *args: datasets stacked into tuple samples.
        **kwargs: datasets stacked into dict samples.

    Raises:
        ValueError: when no dataset, both ``args`` and ``kwargs``, or datasets of different
            lengths are given (torch's messages).
    """

    datasets: tuple[Any, ...] | dict[str, Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args:
            if kwargs:
                raise ValueError(
                    "Supported either ``tuple``- (via ``args``) or"
                    "``dict``- (via ``kwargs``) like input/output, but both types are given."
                )
            self._length = len(args[0])
            if any(self._length != len(dataset) for dataset in args):
                raise ValueError("Size mismatch between datasets")
            self.datasets = args
        elif kwargs:
            children = list(kwargs.values())
            self._length = len(children[0])
            if any(self._length != len(dataset) for dataset in children):
                raise ValueError("Size mismatch between datasets")
            self.datasets = kwargs
        else:
            raise ValueError("At least one dataset should be passed")

    def _children(self) -> list[Any]:
        if isinstance(self.datasets, dict):
            return list(self.datasets.values())
        return list(self.datasets)

    def _modes(self) -> tuple[bool, bool]:
        return _wrapper_modes(self, StackDataset, (fetch_mode(d) for d in self._children()))

    @property
    def _async_fetch(self) -> bool:
        return self._modes()[0]

    @property
    def _inline_fetch(self) -> bool:
        return self._modes()[1]

    @property
    def _array_indices(self) -> bool:
        if _overridden(self, StackDataset, ("__getitems__",)):
            return False
        return all(
            getattr(d, "_array_indices", False) or not callable(getattr(d, "__getitems__", None))
            for d in self._children()
        )

    def _assemble(self, columns: list[Any]) -> Any:
        if isinstance(self.datasets, dict):
            return dict(zip(self.datasets, columns, strict=True))
        return tuple(columns)

    def __getitem__(self, index: Any) -> Any:
        """Sample ``index`` of every child, as a tuple or dict (an awaitable if async)."""
        children = self._children()
        modes = [fetch_mode(d) for d in children]
        if "async" in modes:
            return self._agetitem(children, modes, index)
        return self._assemble([dataset[index] for dataset in children])

    async def _agetitem(self, children: list[Any], modes: list[DatasetFetchMode],
                        index: Any) -> Any:
        calls = [
            functools.partial(fetch_one, d, index, m) for d, m in zip(children, modes, strict=True)
        ]
        return self._assemble(await gather(calls))

    def __getitems__(self, indices: IndicesLike) -> Any:
        """The samples at ``indices``, forwarding to each child's ``__getitems__`` if it has one.

        Raises:
            ValueError: when a child's ``__getitems__`` returns the wrong number of samples.
        """
        children = self._children()
        modes = [fetch_mode(d) for d in children]
        if "async" in modes:
            return self._agetitems(children, modes, indices)
        columns = []
        for dataset in children:
            items = fetch_many_sync(dataset, getitems_of(dataset), indices)
            _check_size(items, len(indices))
            columns.append(items)
        return self._transpose(columns, len(indices))

    async def _agetitems(
        self, children: list[Any], modes: list[DatasetFetchMode], indices: IndicesLike
    ) -> Any:
        index_list = indices.tolist() if isinstance(indices, np.ndarray) else list(indices)
        calls = [
            functools.partial(fetch_many, d, getitems_of(d), index_list, m)
            for d, m in zip(children, modes, strict=True)
        ]
        columns = await gather(calls)
        for items in columns:
            _check_size(items, len(index_list))
        return self._transpose(columns, len(index_list))

    def _transpose(self, columns: list[Any], size: int) -> Any:
        if isinstance(self.datasets, dict):
            keys = list(self.datasets)
            return [dict(zip(keys, sample, strict=True)) for sample in zip(*columns, strict=True)]
        if size == 0:
            return []
        return [tuple(sample) for sample in zip(*columns, strict=True)]

    def __len__(self) -> int:
        """The common length of the children."""
        return self._length


# --------------------------------------------------------------------------- ConcatDataset


class ConcatDataset(Dataset[T_co]):
    """Dataset as a concatenation of datasets.

    Supports negative indices; ``cumulative_sizes[k]`` is the total length of the first ``k + 1``
    datasets. torch's has no ``__getitems__``: its loader fetches a batch index by index, in
    order, through ``__getitem__``; so does this one's ``__getitems__`` over children that run
    the user's code (a child's own ``__getitems__`` is not called, and what its
    ``__getitem__`` draws from the global RNGs is drawn in torch's order). Over children that
    run none (arrays, lists, :class:`ArrayDataset` and aloader's wrappers of such) or async
    ones, it groups a batch's indices per child, forwards each group to the child's
    ``__getitems__`` when it has one, and returns the samples in the requested order
    (still column-wise when every child answers with a
    :class:`~aloader.data._collate.ColumnBatch` of matching columns). When a child is async, so is
    the concatenation: its methods return awaitables.

    Args:
        datasets: the map-style datasets to concatenate.

    Raises:
        AssertionError: for an empty list or an :class:`IterableDataset` (torch's messages).
    """

    datasets: list[DatasetLike[T_co]]
    cumulative_sizes: list[int]

    @staticmethod
    def cumsum(sequence: Iterable[Any]) -> list[int]:
        """Running totals of the lengths of ``sequence``'s elements."""
        totals, total = [], 0
        for element in sequence:
            total += len(element)
            totals.append(total)
        return totals

    def __init__(self, datasets: Iterable[DatasetLike[T_co]]) -> None:
        self.datasets = list(datasets)
        if len(self.datasets) == 0:
            raise AssertionError("datasets should not be an empty iterable")
        for dataset in self.datasets:
            if is_stream_class(dataset):
                raise AssertionError("ConcatDataset does not support IterableDataset")
        self.cumulative_sizes = self.cumsum(self.datasets)
        # Computed once, like cumulative_sizes: per-item fetches must not scan every child.
        self._child_modes: list[DatasetFetchMode] = [fetch_mode(d) for d in self.datasets]
        # torch's ConcatDataset has no __getitems__: its loader fetches a batch index by index,
        # in the batch's order, through __getitem__, never a child's __getitems__. A batch is
        # fetched per child at once only where that cannot tell: children that run no code of
        # the user's (see _runs_no_user_code), or async ones (torch has none).
        self._grouped = all(map(_runs_no_user_code, self.datasets))
        self._any_async = "async" in self._child_modes
        self._starts = np.asarray([0, *self.cumulative_sizes[:-1]], dtype=np.int64)
        self._ends = np.asarray(self.cumulative_sizes, dtype=np.int64)

    @property
    def _array_indices(self) -> bool:
        return not _overridden(self, ConcatDataset, ("__getitem__", "__getitems__"))

    @property
    def cummulative_sizes(self) -> list[int]:
        """Deprecated misspelling of ``cumulative_sizes``."""
        warnings.warn(
            "`cummulative_sizes` attribute is renamed to `cumulative_sizes`",
            FutureWarning,
            stacklevel=2,
        )
        return self.cumulative_sizes

    @property
    def _async_fetch(self) -> bool:
        return _wrapper_modes(self, ConcatDataset, self._child_modes)[0]

    @property
    def _inline_fetch(self) -> bool:
        return _wrapper_modes(self, ConcatDataset, self._child_modes)[1]

    def __len__(self) -> int:
        """The total length."""
        return self.cumulative_sizes[-1]

    def _out_of_range(self, idx: Any) -> IndexError:
        return IndexError(f"index {idx} is out of range for a ConcatDataset of length {len(self)}")

    def _locate(self, idx: Any) -> tuple[int, Any]:
        if idx < 0:
            if -idx > len(self):
                raise ValueError("absolute value of index should not exceed dataset length")
            idx = len(self) + idx
        dataset_idx = bisect.bisect_right(self.cumulative_sizes, idx)
        if dataset_idx >= len(self.datasets):
            raise self._out_of_range(idx)
        if dataset_idx == 0:
            return 0, idx
        return dataset_idx, idx - self.cumulative_sizes[dataset_idx - 1]

    def __getitem__(self, idx: Any) -> T_co:
        """The sample at ``idx`` (negative counts from the end); an awaitable if async.

        Raises:
            ValueError: when ``-idx > len(self)`` (torch's message).
            IndexError: when ``idx >= len(self)``.
        """
        dataset_idx, sample_idx = self._locate(idx)
        child = self.datasets[dataset_idx]
        mode = self._child_modes[dataset_idx]
        if mode != "async" and self._any_async:
            # Every fetch of an async dataset must be awaitable, whichever child answers it.
            return cast(T_co, fetch_one(child, sample_idx, mode))
        return cast(T_co, child[sample_idx])

    def _plan(self, indices: IndicesLike) -> tuple[int, list[_Step]]:
        """Group ``indices`` by child: (batch size, [(child, batch positions, child indices)])."""
        idx = _as_index_array(indices).astype(np.int64, copy=False).reshape(-1)
        n = len(self)
        bad = (idx < -n) | (idx >= n)
        if bad.any():
            first = int(idx[int(np.argmax(bad))])
            if first < 0:
                raise ValueError("absolute value of index should not exceed dataset length")
            raise self._out_of_range(first)
        idx = np.where(idx < 0, idx + n, idx)
        child = np.searchsorted(self._ends, idx, side="right")
        local = idx - self._starts[child]
        if len(idx) == 0:
            return 0, []
        if len(self.datasets) == 1 or (child == child[0]).all():
            return len(idx), [self._step(int(child[0]), None, local)]
        order = np.argsort(child, kind="stable")
        sorted_child = child[order]
        sorted_local = local[order]
        cuts = np.flatnonzero(sorted_child[1:] != sorted_child[:-1]) + 1
        bounds = [0, *cuts.tolist(), len(idx)]
        plan = [
            self._step(int(sorted_child[start]), order[start:end], sorted_local[start:end])
            for start, end in itertools.pairwise(bounds)
        ]
        return len(idx), plan

    def _step(self, child: int, positions: Any, local: npt.NDArray[np.int64]) -> _Step:
        # Children that take index arrays skip the round trip through a list of ints.
        takes_arrays = getattr(self.datasets[child], "_array_indices", False)
        return child, positions, local if takes_arrays else local.tolist()

    def __getitems__(self, indices: IndicesLike) -> Sequence[T_co]:
        """The samples at ``indices``, in order, fetched per child with one call each.

        Raises:
            ValueError: for an index below ``-len(self)`` or a child returning the wrong number
                of samples.
            IndexError: for an index at or past ``len(self)``.
        """
        if _overridden(self, ConcatDataset, ("__getitem__",)):
            # A subclass that redefines __getitem__ (torch has no ConcatDataset.__getitems__)
            # must keep seeing every fetch, with torch's python-int indices.
            if self._async_fetch:
                calls = [functools.partial(self.__getitem__, i) for i in index_list(indices)]
                return cast(Sequence[T_co], gather(calls))
            return [self[i] for i in index_list(indices)]
        if not (self._grouped or self._any_async):  # torch's order, through __getitem__
            return [self[i] for i in index_list(indices)]
        size, plan = self._plan(indices)
        if size == 0:
            return cast(Sequence[T_co], _resolved([])) if self._any_async else []
        if self._any_async:
            return cast(Sequence[T_co], self._agetitems(size, plan))
        results = []
        for child, _positions, local in plan:
            dataset = self.datasets[child]
            results.append(fetch_many_sync(dataset, getitems_of(dataset), local))
        return cast(Sequence[T_co], _merge(size, plan, results))

    async def _agetitems(self, size: int, plan: list[_Step]) -> Sequence[T_co]:
        calls = []
        for child, _positions, local in plan:
            dataset = self.datasets[child]
            mode = self._child_modes[child]
            calls.append(functools.partial(fetch_many, dataset, getitems_of(dataset), local, mode))
        return cast(Sequence[T_co], _merge(size, plan, await gather(calls)))


def _runs_no_user_code(dataset: object) -> bool:
    """Whether fetching from ``dataset`` runs none of the user's code: a list, tuple, range or
    numpy array, or aloader's own datasets (not redefining ``__getitem__``/``__getitems__``)
    over such children. How a batch of those is fetched (per child, vectorised) changes
    nothing; a user's ``__getitem__`` may draw from the global RNGs, in the order it is
    called, and a user's ``__getitems__`` may do what ``__getitem__`` does not.
    """
    if type(dataset) in (list, tuple, range, np.ndarray):
        return True
    methods = ("__getitem__", "__getitems__")
    if isinstance(dataset, ArrayDataset):
        return not _overridden(dataset, ArrayDataset, methods)
    if isinstance(dataset, ConcatDataset):
        return not _overridden(dataset, ConcatDataset, methods) and dataset._grouped
    if isinstance(dataset, Subset):
        return not _overridden(dataset, Subset, methods) and _runs_no_user_code(dataset.dataset)
    if isinstance(dataset, StackDataset):
        return (not _overridden(dataset, StackDataset, methods)
                and all(map(_runs_no_user_code, dataset._children())))
    return False


def _same_columns(batches: list[ColumnBatch]) -> bool:
    width = len(batches[0].columns)
    if any(len(batch.columns) != width for batch in batches):
        return False
    for k in range(width):
        column = batches[0].columns[k]
        if not isinstance(column, np.ndarray):
            return False
        for batch in batches[1:]:
            other = batch.columns[k]
            if (
                not isinstance(other, np.ndarray)
                or other.dtype != column.dtype
                or other.shape[1:] != column.shape[1:]
            ):
                return False
    return True


def _merge(size: int, plan: list[_Step], results: list[Any]) -> Any:
    """Put per-child results back in batch order."""
    for (_child, _positions, local), items in zip(plan, results, strict=True):
        _check_size(items, len(local))
    if len(plan) == 1:
        return results[0]
    positions = [p for _child, p, _local in plan]
    if all(isinstance(items, ColumnBatch) for items in results) and _same_columns(results):
        columns = []
        for k in range(len(results[0].columns)):
            first = results[0].columns[k]
            # One scatter per child: a single copy into the batch-ordered column.
            column = np.empty((size, *first.shape[1:]), dtype=first.dtype)
            for where, items in zip(positions, results, strict=True):
                column[where] = items.columns[k]
            columns.append(column)
        return ColumnBatch(columns)
    out: list[Any] = [None] * size
    for where, items in zip(positions, results, strict=True):
        for position, item in zip(where.tolist(), items, strict=True):
            out[position] = item
    return out


# --------------------------------------------------------------------------- ChainDataset


def _async_only(dataset: object) -> bool:
    has_aiter = getattr(dataset, "__aiter__", None) is not None
    return has_aiter and getattr(dataset, "__iter__", None) is None


class ChainDataset(IterableDataset[T_co]):
    """Dataset chaining iterable datasets, one after the other, on the fly.

    Children may be plain iterables (``__iter__``) or async ones (``__aiter__``). ``async for``
    works over any mix; plain ``for`` works when every child is a plain iterable.

    Args:
        datasets: the :class:`IterableDataset` objects to chain.
    """

    def __init__(self, datasets: Iterable[Dataset[T_co]]) -> None:
        self.datasets = datasets

    def __iter__(self) -> Iterator[T_co]:
        """Iterate the children in turn.

        Raises:
            AssertionError: for a child that is not an :class:`IterableDataset` (as torch).
            TypeError: for a child that can only be iterated with ``async for``.
        """
        for position, dataset in enumerate(self.datasets):
            if not is_stream_class(dataset):
                raise AssertionError("ChainDataset only supports IterableDataset")
            if _async_only(dataset):
                raise TypeError(
                    f"ChainDataset: the dataset at index {position} ({type(dataset).__name__}) "
                    "is async (it defines __aiter__ but not __iter__); iterate the chain with "
                    "'async for' instead"
                )
            yield from cast(Iterable[T_co], dataset)

    async def __aiter__(self) -> AsyncIterator[T_co]:
        """Iterate the children in turn: async ones with ``async for``, others with ``for``.

        Raises:
            AssertionError: for a child that is not an :class:`IterableDataset` (as torch).
        """
        for dataset in self.datasets:
            if not is_stream_class(dataset):
                raise AssertionError("ChainDataset only supports IterableDataset")
            if getattr(dataset, "__aiter__", None) is not None:
                iterator: Any = dataset.__aiter__()  # type: ignore[attr-defined]
                try:
                    while True:
                        try:
                            item = await iterator.__anext__()
                        except StopAsyncIteration:
                            break
                        yield item
                finally:
                    await close_iterator(iterator)
            else:
                sync_iterator: Any = iter(cast(Iterable[T_co], dataset))
                try:
                    for item in taken(sync_iterator):
                        yield item
                finally:
                    await close_iterator(sync_iterator, blocking=False)

    def __len__(self) -> int:
        """The sum of the children's lengths.

        Raises:
            AssertionError: for a child that is not an :class:`IterableDataset` (as torch).
        """
        total = 0
        for dataset in self.datasets:
            if not is_stream_class(dataset):
                raise AssertionError("ChainDataset only supports IterableDataset")
            total += len(dataset)  # type: ignore[arg-type]
        return total


# --------------------------------------------------------------------------- Subset


class Subset(Dataset[T_co]):
    """The samples of ``dataset`` at ``indices``, in that order.

    ``__getitems__`` forwards to the parent's ``__getitems__`` when it has one. When the parent
    is async, so is the subset.

    Note:
        As in torch, a subclass that overrides ``__getitem__`` must also override
        ``__getitems__`` (the loader fetches batches through it).

    Args:
        dataset: the whole dataset.
        indices: the indices in ``dataset`` that make up the subset (a list, a range or a 1-D
            integer array).
    """

    dataset: DatasetLike[T_co]
    indices: IndicesLike

    def __init__(self, dataset: DatasetLike[T_co], indices: IndicesLike) -> None:
        self.dataset = dataset
        self.indices = indices
        if (
            type(self).__getitem__ is not Subset.__getitem__
            and type(self).__getitems__ is Subset.__getitems__
        ):
            raise NotImplementedError(
                f"{type(self).__name__} overrides __getitem__ but not __getitems__. "
                "When subclassing Subset and overriding __getitem__, you must also override "
                "__getitems__ to ensure DataLoader works correctly with your custom logic. "
                "A simple implementation:\n\n"
                "def __getitems__(self, indices):\n"
                "    return [self.__getitem__(idx) for idx in indices]"
            )

    @property
    def _array_indices(self) -> bool:
        return not _overridden(self, Subset, ("__getitems__",))

    @property
    def _async_fetch(self) -> bool:
        return _wrapper_modes(self, Subset, [fetch_mode(self.dataset)])[0]

    @property
    def _inline_fetch(self) -> bool:
        return _wrapper_modes(self, Subset, [fetch_mode(self.dataset)])[1]

    def __getitem__(self, idx: Any) -> T_co:
        """``dataset[indices[idx]]``; a list ``idx`` maps each element (as torch)."""
        if isinstance(idx, list):
            parent: Any = self.dataset
            return cast(T_co, parent[[self.indices[i] for i in idx]])
        return cast(T_co, self.dataset[self.indices[idx]])

    def _parent_indices(self, indices: IndicesLike) -> list[int]:
        if isinstance(self.indices, np.ndarray):
            return cast(list[int], self.indices[_as_index_array(indices)].tolist())
        return [self.indices[i] for i in indices]

    def __getitems__(self, indices: IndicesLike) -> Sequence[T_co]:
        """The samples at ``indices``, through the parent's ``__getitems__`` when it has one."""
        parent = self._parent_indices(indices)
        getitems = getattr(self.dataset, "__getitems__", None)
        if callable(getitems):
            return cast(Sequence[T_co], getitems(parent))
        mode = fetch_mode(self.dataset)
        if mode == "async":
            return cast(Sequence[T_co], fetch_many(self.dataset, None, parent, mode))
        return [self.dataset[i] for i in parent]

    def __len__(self) -> int:
        """The number of indices."""
        return len(self.indices)


# --------------------------------------------------------------------------- random_split


def random_split(
    dataset: DatasetLike[T],
    lengths: Sequence[int | float],
    generator: GeneratorLike = None,
) -> list[Subset[T]]:
    """Randomly split a dataset into non-overlapping subsets of the given lengths.

    Fractions that sum to 1 give ``floor(len(dataset) * fraction)`` samples each, and the
    remainder is handed out one by one, round-robin from the first split. The splits are
    consecutive slices of one random permutation of ``range(len(dataset))``; with a
    ``torch.Generator`` that permutation is ``torch.randperm(len(dataset), generator=g)``, so the
    splits equal torch's.

    Args:
        dataset: the dataset to split (async datasets work too).
        lengths: lengths of the splits, or fractions of ``len(dataset)`` summing to 1.
        generator: ``None``, an int seed, a ``numpy.random.Generator`` or a ``torch.Generator``.

    Returns:
        One :class:`Subset` per length, its ``indices`` a list of ints.

    Raises:
        ValueError: for a fraction outside [0, 1], lengths that do not sum to the dataset's
            length (torch's messages), or a negative length.
        TypeError: for a length that is neither an integer nor part of fractions summing to 1.
    """
    n = len(dataset)  # type: ignore[arg-type]  # Dataset has no __len__, as in torch
    sizes: list[Any] = list(lengths)
    total = sum(sizes)
    if math.isclose(total, 1) and total <= 1:
        fractions = sizes
        sizes = []
        for i, fraction in enumerate(fractions):
            if fraction < 0 or fraction > 1:
                raise ValueError(f"Fraction at index {i} is not between 0 and 1")
            sizes.append(math.floor(n * fraction))
        for i in range(n - sum(sizes)):
            sizes[i % len(sizes)] += 1
        for i, size in enumerate(sizes):
            if size == 0:
                warnings.warn(
                    f"Length of split at index {i} is 0. This might result in an empty dataset.",
                    stacklevel=2,
                )
    if sum(sizes) != n:
        raise ValueError("Sum of input lengths does not equal the length of the input dataset!")
    for i, size in enumerate(sizes):
        if type(size) is bool or not isinstance(size, numbers.Integral):
            raise TypeError(
                f"Length at index {i} should be an integer (or all lengths fractions summing to "
                f"1), but got {size!r}"
            )
        if size < 0:
            raise ValueError(f"Length at index {i} should be non-negative, but got {size}")
    order = permutation(as_generator(generator), n)
    return [
        Subset(dataset, order[end - size : end].tolist())
        for end, size in zip(itertools.accumulate(int(s) for s in sizes), sizes, strict=True)
    ]
