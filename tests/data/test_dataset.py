"""Datasets: torch.utils.data's dataset semantics, plus async datasets and the fetch protocol."""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aloader
from aloader import (
    ArrayDataset,
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
    TensorDataset,
    random_split,
)
from aloader.data._collate import ColumnBatch
from aloader.data._dataset import fetch_mode
from aloader.data._random import as_generator, permutation

# --------------------------------------------------------------------------- helpers


class Plain(Dataset[int]):
    """A synchronous dataset without __getitems__: sample i is base + i."""

    def __init__(self, n: int, base: int = 0) -> None:
        self.n, self.base = n, base

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not -self.n <= i < self.n:
            raise IndexError(f"Plain index {i} out of range")
        return self.base + (i % self.n)


class Batched(Plain):
    """Plain with a __getitems__ that records its calls."""

    def __init__(self, n: int, base: int = 0) -> None:
        super().__init__(n, base)
        self.calls: list[list[int]] = []

    def __getitems__(self, indices: Sequence[int]) -> list[int]:
        self.calls.append(list(indices))
        return [self[i] for i in indices]


class WrongSize(Plain):
    def __getitems__(self, indices: Sequence[int]) -> list[int]:
        return [self[i] for i in indices][:-1]


class AsyncItems(Dataset[int]):
    """An async dataset: async __getitem__ only."""

    def __init__(self, n: int, base: int = 0) -> None:
        self.n, self.base = n, base

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> int:
        await anyio.sleep(0)
        if not 0 <= i < self.n:
            raise KeyError(i)
        return self.base + i


class AsyncBatched(AsyncItems):
    """An async dataset with an async __getitems__ that records its calls."""

    def __init__(self, n: int, base: int = 0) -> None:
        super().__init__(n, base)
        self.calls: list[list[int]] = []

    async def __getitems__(self, indices: Sequence[int]) -> list[int]:
        self.calls.append(list(indices))
        await anyio.sleep(0)
        return [self.base + i for i in indices]


class Stream(IterableDataset[int]):
    def __init__(self, items: Sequence[int]) -> None:
        self.items = list(items)

    def __iter__(self) -> Iterator[int]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class AsyncStream(IterableDataset[int]):
    def __init__(self, items: Sequence[int]) -> None:
        self.items = list(items)
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[int]:
        try:
            for item in self.items:
                await anyio.sleep(0)
                yield item
        finally:
            self.closed = True

    def __len__(self) -> int:
        return len(self.items)


def rows(batch: Sequence[Any]) -> list[Any]:
    """Samples of a batch as plain python values, for comparisons."""
    out = []
    for sample in batch:
        if isinstance(sample, tuple):
            out.append(tuple(np.asarray(x).tolist() for x in sample))
        else:
            out.append(sample)
    return out


# --------------------------------------------------------------------------- Dataset basics


def test_base_dataset_getitem_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="Subclasses of Dataset should implement"):
        Dataset()[0]


def test_add_concatenates_map_datasets() -> None:
    a, b = Plain(3), Plain(2, base=100)
    both = a + b
    assert isinstance(both, ConcatDataset)
    assert both.datasets == [a, b]
    assert [both[i] for i in range(len(both))] == [0, 1, 2, 100, 101]


def test_add_chains_iterable_datasets() -> None:
    a, b, c = Stream([1, 2]), Stream([3]), Stream([4, 5])
    chained = a + b + c
    assert isinstance(chained, ChainDataset)
    assert list(chained) == [1, 2, 3, 4, 5]
    assert len(chained) == 5


# --------------------------------------------------------------------------- ArrayDataset


def test_array_dataset_len_and_getitem() -> None:
    x = np.arange(30.0).reshape(10, 3)
    y = np.arange(10) * 2
    ds = ArrayDataset(x, y)
    assert len(ds) == 10
    for i in range(10):
        sample = ds[i]
        assert isinstance(sample, tuple) and len(sample) == 2
        np.testing.assert_array_equal(sample[0], x[i])
        assert sample[1] == y[i]
    np.testing.assert_array_equal(ds[-1][0], x[-1])


def test_tensor_dataset_alias_and_tensors_attribute() -> None:
    assert TensorDataset is ArrayDataset
    x = np.zeros((4, 2))
    ds = TensorDataset(x)
    assert ds.tensors == (x,) and ds.arrays == (x,)


@pytest.mark.parametrize("as_array", [False, True])
def test_array_dataset_getitems_column_batch(as_array: bool) -> None:
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    y = np.arange(10, dtype=np.int16)
    ds = ArrayDataset(x, y)
    indices: Any = [7, 0, 3, 3, -1]
    if as_array:
        indices = np.asarray(indices, dtype=np.int64)
    batch = ds.__getitems__(indices)
    assert isinstance(batch, ColumnBatch)
    assert len(batch) == 5
    idx = np.asarray([7, 0, 3, 3, -1], dtype=np.intp)
    np.testing.assert_array_equal(batch.columns[0], x[idx])
    np.testing.assert_array_equal(batch.columns[1], y[idx])
    assert batch.columns[0].dtype == np.float32 and batch.columns[1].dtype == np.int16
    assert rows(batch) == rows([ds[int(i)] for i in idx])


def test_array_dataset_getitems_unsigned_and_empty() -> None:
    x = np.arange(5)
    ds = ArrayDataset(x)
    batch = ds.__getitems__(np.asarray([4, 1], dtype=np.uint32))
    np.testing.assert_array_equal(batch.columns[0], [4, 1])  # type: ignore[attr-defined]
    empty = ds.__getitems__([])
    assert isinstance(empty, ColumnBatch) and len(empty) == 0


def test_array_dataset_getitems_errors() -> None:
    ds = ArrayDataset(np.arange(5))
    with pytest.raises(IndexError):
        ds.__getitems__([1, 5])
    with pytest.raises(IndexError, match="integers"):
        ds.__getitems__([1.5, 2.0])  # type: ignore[list-item]


def test_array_dataset_lists_and_mixed_inputs() -> None:
    labels = ["a", "b", "c", "d"]
    x = np.arange(8).reshape(4, 2)
    only_lists = ArrayDataset(labels, [10, 11, 12, 13])
    assert only_lists[2] == ("c", 12)
    out = only_lists.__getitems__([3, 0])
    assert not isinstance(out, ColumnBatch)
    assert out == [("d", 13), ("a", 10)]
    mixed = ArrayDataset(x, labels)
    got = mixed.__getitems__(np.asarray([2, 1]))
    assert isinstance(got, list)
    assert rows(got) == [([4, 5], "c"), ([2, 3], "b")]


def test_array_dataset_size_mismatch() -> None:
    with pytest.raises(AssertionError, match=r"^Size mismatch between tensors$"):
        ArrayDataset(np.zeros(3), np.zeros(4))
    with pytest.raises(AssertionError, match=r"^Size mismatch between tensors$"):
        ArrayDataset([1, 2], np.zeros((3, 2)))


def test_array_dataset_bad_inputs() -> None:
    with pytest.raises(ValueError, match="At least one array"):
        ArrayDataset()
    with pytest.raises(IndexError, match="0-dimensional"):
        ArrayDataset(np.zeros(3), np.float64(1.0))


def test_array_dataset_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(12).reshape(6, 2)
    x = np.arange(6)
    ds = ArrayDataset(t, x)
    got = ds.__getitems__(np.asarray([5, 0, 2]))
    # Column-wise, as over numpy arrays: the tensor column is indexed once.
    assert isinstance(got, ColumnBatch) and len(got) == 3
    assert torch.equal(got.columns[0], t[[5, 0, 2]])
    for sample, i in zip(got, [5, 0, 2], strict=True):
        assert isinstance(sample[0], torch.Tensor)
        assert torch.equal(sample[0], t[i])
        assert sample[1] == x[i]
    assert fetch_mode(ds) == "inline"


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    width=st.integers(1, 3),
    data=st.data(),
)
def test_array_dataset_getitems_matches_getitem(n: int, width: int, data: st.DataObject) -> None:
    x = np.arange(n * width).reshape(n, width)
    y = np.arange(n) * 3
    ds = ArrayDataset(x, y)
    indices = data.draw(st.lists(st.integers(-n, n - 1), max_size=20))
    assert rows(ds.__getitems__(indices)) == rows([ds[i] for i in indices])


def test_array_dataset_matches_torch_tensor_dataset() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(AssertionError) as ours:
        ArrayDataset(np.zeros(2), np.zeros(3))
    with pytest.raises(AssertionError) as theirs:
        torch.utils.data.TensorDataset(torch.zeros(2), torch.zeros(3))
    assert str(ours.value) == str(theirs.value)
    x = np.arange(12).reshape(4, 3)
    ours_ds = ArrayDataset(x)
    theirs_ds = torch.utils.data.TensorDataset(torch.from_numpy(x))
    assert len(ours_ds) == len(theirs_ds)
    for i in range(-4, 4):
        assert ours_ds[i][0].tolist() == theirs_ds[i][0].tolist()


# --------------------------------------------------------------------------- StackDataset


def test_stack_dataset_tuple_and_dict() -> None:
    a, b = Plain(4), Plain(4, base=10)
    stacked = StackDataset(a, b)
    assert len(stacked) == 4
    assert stacked[1] == (1, 11)
    named = StackDataset(x=a, y=b)
    assert named[3] == {"x": 3, "y": 13}
    assert stacked.__getitems__([2, 0]) == [(2, 12), (0, 10)]
    assert named.__getitems__([2, 0]) == [{"x": 2, "y": 12}, {"x": 0, "y": 10}]
    assert stacked.__getitems__([]) == []


def test_stack_dataset_forwards_getitems() -> None:
    a, b = Batched(5), Plain(5, base=100)
    stacked = StackDataset(a, b)
    assert stacked.__getitems__([4, 1, 1]) == [(4, 104), (1, 101), (1, 101)]
    assert a.calls == [[4, 1, 1]]
    named = StackDataset(a=Batched(5), b=Batched(5, base=1))
    assert named.__getitems__([0, 2]) == [{"a": 0, "b": 1}, {"a": 2, "b": 3}]
    assert named.datasets["a"].calls == [[0, 2]]  # type: ignore[call-overload]


def test_stack_dataset_over_array_datasets() -> None:
    x, y = np.arange(6), np.arange(6) * 10
    stacked = StackDataset(ArrayDataset(x), ArrayDataset(y))
    got = stacked.__getitems__([5, 2])
    assert rows([tuple(s[0] + s[1]) for s in got]) == [(5, 50), (2, 20)]


def test_stack_dataset_errors() -> None:
    with pytest.raises(ValueError, match=r"^At least one dataset should be passed$"):
        StackDataset()
    with pytest.raises(ValueError, match="but both types are given"):
        StackDataset(Plain(2), a=Plain(2))
    with pytest.raises(ValueError, match=r"^Size mismatch between datasets$"):
        StackDataset(Plain(2), Plain(3))
    with pytest.raises(ValueError, match=r"^Size mismatch between datasets$"):
        StackDataset(a=Plain(2), b=Plain(3))
    with pytest.raises(ValueError, match=r"output size mismatch\. Expected 3, got 2"):
        StackDataset(WrongSize(4), Plain(4)).__getitems__([0, 1, 2])
    with pytest.raises(ValueError, match=r"output size mismatch\. Expected 2, got 1"):
        StackDataset(a=WrongSize(4)).__getitems__([0, 1])


def test_stack_dataset_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    TorchStack = torch.utils.data.StackDataset
    for args, kwargs in [((), {}), ((Plain(2),), {"a": Plain(2)}), ((Plain(2), Plain(3)), {})]:
        with pytest.raises(Exception) as ours:
            StackDataset(*args, **kwargs)
        with pytest.raises(Exception) as theirs:
            TorchStack(*args, **kwargs)
        assert type(ours.value) is type(theirs.value)
        assert str(ours.value) == str(theirs.value)
    for make in (lambda: (Batched(5), Plain(5, 9)), lambda: (Plain(5), Batched(5, 3))):
        assert StackDataset(*make())[3] == TorchStack(*make())[3]
        assert StackDataset(*make()).__getitems__([4, 0, 2]) == TorchStack(*make()).__getitems__(
            [4, 0, 2]
        )
        a, b = make()
        assert StackDataset(p=a, q=b).__getitems__([1, 1]) == TorchStack(p=a, q=b).__getitems__(
            [1, 1]
        )
    with pytest.raises(ValueError) as ours_err:
        StackDataset(WrongSize(3)).__getitems__([0, 1])
    with pytest.raises(ValueError) as theirs_err:
        TorchStack(WrongSize(3)).__getitems__([0, 1])
    assert str(ours_err.value) == str(theirs_err.value)


# --------------------------------------------------------------------------- ConcatDataset


def test_concat_indexing_and_cumulative_sizes() -> None:
    ds = ConcatDataset([Plain(3), Plain(0), Plain(2, base=10), Plain(1, base=20)])
    assert ds.cumulative_sizes == [3, 3, 5, 6]
    assert len(ds) == 6
    assert [ds[i] for i in range(6)] == [0, 1, 2, 10, 11, 20]
    assert [ds[i] for i in range(-6, 0)] == [0, 1, 2, 10, 11, 20]
    assert ConcatDataset.cumsum([[1, 2], [], [3]]) == [2, 2, 3]


def test_concat_index_errors() -> None:
    ds = ConcatDataset([Plain(3), Plain(2)])
    with pytest.raises(ValueError, match=r"^absolute value of index should not exceed dataset"):
        ds[-6]
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(IndexError):
        ds.__getitems__([0, 5])
    with pytest.raises(ValueError, match="absolute value of index"):
        ds.__getitems__([0, -6])
    # The first offending index decides the error, as in an item-by-item fetch.
    with pytest.raises(IndexError):
        ds.__getitems__([7, -6])


def test_concat_rejects_empty_and_iterables() -> None:
    with pytest.raises(AssertionError, match=r"^datasets should not be an empty iterable$"):
        ConcatDataset([])
    with pytest.raises(AssertionError, match=r"^ConcatDataset does not support IterableDataset$"):
        ConcatDataset([Plain(2), Stream([1])])


def test_concat_cummulative_sizes_is_deprecated() -> None:
    ds = ConcatDataset([Plain(2)])
    with pytest.warns(FutureWarning, match="renamed to `cumulative_sizes`"):
        assert ds.cummulative_sizes == [2]


def test_concat_getitems_over_user_children_fetches_item_by_item_like_torch() -> None:
    # torch's ConcatDataset has no __getitems__: each index goes through __getitem__, in the
    # batch's order, and a child's own __getitems__ is never called (tests/
    # compat/test_concat_getitems.py compares with torch). Grouping per child is for
    # children that run no user code (column batches below) and async ones.
    a, b, c = Batched(3), Plain(2, base=10), Batched(4, base=20)
    ds = ConcatDataset([a, b, c])
    indices = [8, 0, 3, 5, 2, -1, 4, 1]
    assert ds.__getitems__(indices) == [ds[i] for i in indices] == [
        23, 0, 10, 20, 2, 23, 11, 1]
    assert a.calls == [] and c.calls == []
    assert ds.__getitems__([]) == []
    assert ds.__getitems__(np.asarray([6, 6])) == [21, 21]
    with pytest.raises(IndexError):
        ds.__getitems__([0, 9])


@pytest.mark.anyio
async def test_concat_getitems_rejects_wrong_child_output() -> None:
    assert ConcatDataset([WrongSize(3), Plain(3)]).__getitems__([0, 4, 1]) == [0, 1, 1]
    grouped = ConcatDataset([WrongSize(3), AsyncItems(3)])  # async: grouped per child
    with pytest.raises(ValueError, match=r"Expected 2, got 1"):
        await grouped.__getitems__([0, 4, 1])  # type: ignore[misc]


def test_concat_getitems_keeps_column_batches() -> None:
    x1, x2 = np.arange(10).reshape(5, 2), np.arange(100, 106).reshape(3, 2)
    y1, y2 = np.arange(5), np.arange(50, 53)
    ds = ConcatDataset([ArrayDataset(x1, y1), ArrayDataset(x2, y2)])
    indices = [6, 0, 7, 4, 5]
    got = ds.__getitems__(indices)
    assert isinstance(got, ColumnBatch)
    assert rows(got) == rows([ds[i] for i in indices])
    single = ds.__getitems__([6, 5])
    assert isinstance(single, ColumnBatch) and rows(single) == rows([ds[6], ds[5]])
    # Columns of different dtypes are not merged into one array: samples stay as they are.
    other = ConcatDataset([ArrayDataset(y1), ArrayDataset(y2.astype(np.float32))])
    mixed = other.__getitems__([0, 5])
    assert not isinstance(mixed, ColumnBatch)
    assert mixed[1][0].dtype == np.float32


def test_concat_subclass_overriding_getitem_sees_batches() -> None:
    class Doubled(ConcatDataset[int]):
        def __getitem__(self, idx: Any) -> int:
            return 2 * super().__getitem__(idx)

    ds = Doubled([Plain(2), Plain(2, base=10)])
    assert ds.__getitems__([3, 0]) == [22, 0]
    assert fetch_mode(ds) == "thread"


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=5), data=st.data())
def test_concat_getitems_matches_getitem(sizes: list[int], data: st.DataObject) -> None:
    children: list[Dataset[int]] = []
    for k, size in enumerate(sizes):
        kind = data.draw(st.sampled_from(["plain", "batched", "array"]))
        if kind == "plain":
            children.append(Plain(size, base=100 * k))
        elif kind == "batched":
            children.append(Batched(size, base=100 * k))
        else:
            children.append(ArrayDataset(np.arange(size) + 100 * k))  # type: ignore[arg-type]
    ds = ConcatDataset(children)
    n = len(ds)
    if n == 0:
        assert ds.__getitems__([]) == []
        return
    indices = data.draw(st.lists(st.integers(-n, n - 1), max_size=16))
    assert rows(ds.__getitems__(indices)) == rows([ds[i] for i in indices])


def test_concat_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    TorchConcat = torch.utils.data.ConcatDataset
    parts = [Plain(3), Plain(0), Plain(4, base=10), Plain(2, base=20)]
    ours, theirs = ConcatDataset(parts), TorchConcat(parts)
    assert ours.cumulative_sizes == theirs.cumulative_sizes
    assert len(ours) == len(theirs)
    for i in range(-len(ours), len(ours)):
        assert ours[i] == theirs[i]
    for bad in (len(ours), len(ours) + 3, -len(ours) - 1):
        with pytest.raises(Exception) as mine:
            ours[bad]
        with pytest.raises(Exception) as torchs:
            theirs[bad]
        assert type(mine.value) is type(torchs.value)

    class TorchStream(torch.utils.data.IterableDataset):  # type: ignore[misc,name-defined]
        def __iter__(self) -> Iterator[int]:
            return iter([1])

    for ours_args, torch_args in [([], []), ([Plain(1), Stream([1])], [Plain(1), TorchStream()])]:
        with pytest.raises(Exception) as mine:
            ConcatDataset(ours_args)
        with pytest.raises(Exception) as torchs:
            TorchConcat(torch_args)
        assert type(mine.value) is type(torchs.value)
        assert str(mine.value) == str(torchs.value)


# --------------------------------------------------------------------------- ChainDataset


def test_chain_sync() -> None:
    chain = ChainDataset([Stream([1, 2]), Stream([]), Stream([3])])
    assert list(chain) == [1, 2, 3]
    assert list(chain) == [1, 2, 3]
    assert len(chain) == 3


def test_chain_rejects_map_style_children() -> None:
    chain = ChainDataset([Stream([1]), Plain(2)])
    with pytest.raises(AssertionError, match=r"^ChainDataset only supports IterableDataset$"):
        list(chain)
    with pytest.raises(AssertionError, match=r"^ChainDataset only supports IterableDataset$"):
        len(chain)


def test_chain_sync_iteration_over_async_child_is_a_type_error() -> None:
    chain = ChainDataset([Stream([1]), AsyncStream([2])])
    with pytest.raises(TypeError, match=r"index 1 \(AsyncStream\).*async for"):
        list(chain)


@pytest.mark.anyio
async def test_chain_async_over_sync_async_and_mixed() -> None:
    async def collect(chain: ChainDataset[int]) -> list[int]:
        return [item async for item in chain]

    assert await collect(ChainDataset([Stream([1, 2]), Stream([3])])) == [1, 2, 3]
    assert await collect(ChainDataset([AsyncStream([1]), AsyncStream([2, 3])])) == [1, 2, 3]
    mixed = ChainDataset([AsyncStream([1]), Stream([2, 3]), AsyncStream([]), AsyncStream([4])])
    assert await collect(mixed) == [1, 2, 3, 4]
    nested = ChainDataset([Stream([0]), mixed])
    assert await collect(nested) == [0, 1, 2, 3, 4]
    assert await collect(AsyncStream([5]) + Stream([6])) == [5, 6]
    assert len(mixed) == 4


@pytest.mark.anyio
async def test_chain_async_closes_children_early() -> None:
    first, second = AsyncStream([1, 2, 3]), AsyncStream([4])
    iterator = ChainDataset([first, second]).__aiter__()
    assert await iterator.__anext__() == 1
    await iterator.aclose()  # type: ignore[attr-defined]
    assert first.closed
    assert not second.closed


@pytest.mark.anyio
async def test_chain_async_rejects_map_style_children() -> None:
    chain = ChainDataset([Plain(2)])
    with pytest.raises(AssertionError, match="only supports IterableDataset"):
        async for _ in chain:
            pass


def test_chain_matches_torch() -> None:
    torch = pytest.importorskip("torch")

    class TorchStream(torch.utils.data.IterableDataset):  # type: ignore[misc,name-defined]
        def __init__(self, items: list[int]) -> None:
            self.items = items

        def __iter__(self) -> Iterator[int]:
            return iter(self.items)

        def __len__(self) -> int:
            return len(self.items)

    contents = [[1, 2], [], [3]]
    ours = ChainDataset([Stream(c) for c in contents])
    theirs = torch.utils.data.ChainDataset([TorchStream(c) for c in contents])
    assert list(ours) == list(theirs)
    assert len(ours) == len(theirs)
    with pytest.raises(AssertionError) as mine:
        list(ChainDataset([Plain(1)]))
    with pytest.raises(AssertionError) as torchs:
        list(torch.utils.data.ChainDataset([Plain(1)]))
    assert str(mine.value) == str(torchs.value)


# --------------------------------------------------------------------------- Subset


@pytest.mark.parametrize("kind", ["list", "array", "range"])
def test_subset_indices_kinds(kind: str) -> None:
    base = Plain(10)
    raw = [8, 2, 5]
    indices: Any = {"list": raw, "array": np.asarray(raw), "range": range(8, 1, -3)}[kind]
    sub = Subset(base, indices)
    assert len(sub) == 3
    assert [sub[i] for i in range(3)] == [8, 5, 2] if kind == "range" else [8, 2, 5]
    expected = [sub[i] for i in (2, 0)]
    assert sub.__getitems__([2, 0]) == expected
    assert sub.__getitems__(np.asarray([2, 0])) == expected


def test_subset_list_index_maps_each_element() -> None:
    sub = Subset(ArrayDataset(np.arange(10) * 2), [9, 1, 4])
    np.testing.assert_array_equal(sub[[0, 2]][0], [18, 8])


def test_subset_forwards_getitems_with_plain_ints() -> None:
    base = Batched(10)
    sub = Subset(base, np.asarray([9, 3, 7]))
    assert sub.__getitems__([2, 0, 2]) == [7, 9, 7]
    assert base.calls == [[7, 9, 7]]
    assert all(type(i) is int for i in base.calls[0])


def test_subset_over_array_dataset_is_column_batch() -> None:
    x = np.arange(12).reshape(6, 2)
    sub = Subset(ArrayDataset(x), [5, 1, 0])
    got = sub.__getitems__(np.asarray([0, 1]))
    assert isinstance(got, ColumnBatch)
    np.testing.assert_array_equal(got.columns[0], x[[5, 1]])


def test_subset_subclass_must_override_getitems() -> None:
    class Bad(Subset[int]):
        def __getitem__(self, idx: Any) -> int:
            return 0

    with pytest.raises(NotImplementedError, match="overrides __getitem__ but not __getitems__"):
        Bad(Plain(3), [0])

    class Good(Bad):
        def __getitems__(self, indices: Any) -> list[int]:
            return [self[i] for i in indices]

    assert Good(Plain(3), [0, 1]).__getitems__([1]) == [0]


def test_subset_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    base = Batched(10)
    ours = Subset(base, [4, 0, 8])
    theirs = torch.utils.data.Subset(base, [4, 0, 8])
    assert [ours[i] for i in range(3)] == [theirs[i] for i in range(3)]
    assert ours.__getitems__([2, 1]) == theirs.__getitems__([2, 1])
    assert len(ours) == len(theirs)


# --------------------------------------------------------------------------- random_split


def expected_sizes(n: int, fractions: Sequence[float]) -> list[int]:
    sizes = [math.floor(n * f) for f in fractions]
    for i in range(n - sum(sizes)):
        sizes[i % len(sizes)] += 1
    return sizes


def test_random_split_fractions_remainder_round_robin() -> None:
    splits = random_split(range(106), [0.1, 0.2, 0.3, 0.4], generator=0)
    assert [len(s) for s in splits] == [11, 22, 31, 42]


def test_random_split_integer_lengths() -> None:
    splits = random_split(range(10), [3, 7], generator=1)
    assert [len(s) for s in splits] == [3, 7]
    assert all(isinstance(s, Subset) for s in splits)
    assert all(isinstance(s.indices, list) for s in splits)
    assert all(type(i) is int for s in splits for i in s.indices)


def test_random_split_consecutive_slices_of_one_permutation() -> None:
    splits = random_split(range(20), [5, 0, 15], generator=7)
    order = permutation(as_generator(7), 20).tolist()
    assert [s.indices for s in splits] == [order[:5], [], order[5:]]


def test_random_split_disjoint_and_covering() -> None:
    splits = random_split(range(50), [0.5, 0.25, 0.25], generator=3)
    seen = [i for s in splits for i in s.indices]
    assert sorted(seen) == list(range(50))
    assert [[s[i] for i in range(len(s))] for s in splits] == [
        [s.dataset[i] for i in s.indices] for s in splits
    ]


def test_random_split_reproducible_from_seed() -> None:
    def indices(generator: Any) -> list[list[int]]:
        return [list(s.indices) for s in random_split(range(40), [0.3, 0.7], generator=generator)]

    assert indices(5) == indices(5)
    assert indices(np.random.default_rng(5)) == indices(5)
    assert indices(5) != indices(6)
    rng = np.random.default_rng(9)
    assert indices(rng) != indices(rng)  # a shared generator advances


def test_random_split_zero_length_warns() -> None:
    with pytest.warns(UserWarning) as record:
        splits = random_split(range(2), [0.5, 0.0, 0.5], generator=0)
    messages = [str(w.message) for w in record]
    assert messages == ["Length of split at index 1 is 0. This might result in an empty dataset."]
    assert [len(s) for s in splits] == [1, 0, 1]


def test_random_split_errors() -> None:
    with pytest.raises(ValueError, match=r"^Fraction at index 0 is not between 0 and 1$"):
        random_split(range(10), [1.5, -0.5])
    with pytest.raises(ValueError, match=r"^Fraction at index 1 is not between 0 and 1$"):
        random_split(range(10), [0.5, -0.5, 1.0])
    msg = "^Sum of input lengths does not equal the length of the input dataset!$"
    with pytest.raises(ValueError, match=msg):
        random_split(range(10), [3, 3])
    with pytest.raises(ValueError, match=msg):
        random_split(range(10), [0.3, 0.3])
    with pytest.raises(TypeError, match="Length at index 0 should be an integer"):
        random_split(range(10), [2.5, 7.5])
    with pytest.raises(ValueError, match="Length at index 0 should be non-negative"):
        random_split(range(10), [-1, 11])


def test_random_split_empty_dataset() -> None:
    assert random_split(range(0), []) == []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        splits = random_split(range(0), [0.5, 0.5])
    assert [len(s) for s in splits] == [0, 0] and len(record) == 2


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(0, 500),
    weights=st.lists(st.integers(1, 100), min_size=1, max_size=6),
    seed=st.integers(0, 2**32),
)
def test_random_split_property(n: int, weights: list[int], seed: int) -> None:
    fractions = [w / sum(weights) for w in weights]
    if not (math.isclose(sum(fractions), 1) and sum(fractions) <= 1):
        fractions[-1] = 1 - sum(fractions[:-1])  # keep the case torch treats as fractions
        if fractions[-1] < 0 or sum(fractions) > 1:
            return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        splits = random_split(range(n), fractions, generator=seed)
    assert [len(s) for s in splits] == expected_sizes(n, fractions)
    flat = [i for s in splits for i in s.indices]
    assert sorted(flat) == list(range(n))


def test_random_split_sizes_match_torch() -> None:
    torch = pytest.importorskip("torch")
    cases: list[tuple[int, list[float]]] = [
        (106, [0.1, 0.2, 0.3, 0.4]),
        (10, [0.33, 0.33, 0.34]),
        (7, [0.5, 0.5]),
        (3, [0.0, 1.0]),
        (1, [0.25, 0.25, 0.25, 0.25]),
        (1000, [1 / 3, 1 / 3, 1 / 3]),
        (10, [3, 7]),
        (0, [0.5, 0.5]),
    ]
    for n, lengths in cases:
        with warnings.catch_warnings(record=True) as ours_warnings:
            warnings.simplefilter("always")
            ours = random_split(range(n), lengths, generator=0)
        with warnings.catch_warnings(record=True) as torch_warnings:
            warnings.simplefilter("always")
            theirs = torch.utils.data.random_split(
                range(n), lengths, generator=torch.Generator().manual_seed(0)
            )
        assert [len(s) for s in ours] == [len(s) for s in theirs], (n, lengths)
        assert [str(w.message) for w in ours_warnings] == [str(w.message) for w in torch_warnings]
    bad: list[tuple[int, list[float]]] = [(10, [1.5, -0.5]), (10, [3, 3]), (10, [0.3, 0.3])]
    for n, lengths in bad:
        with pytest.raises(ValueError) as mine:
            random_split(range(n), lengths)
        with pytest.raises(ValueError) as torchs:
            torch.utils.data.random_split(range(n), lengths)
        assert str(mine.value) == str(torchs.value)


# --------------------------------------------------------------------------- async wrappers


@pytest.mark.anyio
async def test_subset_over_async_dataset() -> None:
    base = AsyncItems(10)
    sub = Subset(base, [7, 2, 9])
    assert fetch_mode(sub) == "async"
    assert await sub[0] == 7  # type: ignore[misc]
    assert await sub.__getitems__([2, 1]) == [9, 2]  # type: ignore[misc]
    batched = AsyncBatched(10, base=100)
    sub2 = Subset(batched, np.asarray([1, 3]))
    assert await sub2.__getitems__([1, 0]) == [103, 101]  # type: ignore[misc]
    assert batched.calls == [[3, 1]]


@pytest.mark.anyio
async def test_random_split_of_async_dataset() -> None:
    splits = random_split(AsyncItems(12), [0.5, 0.5], generator=0)
    assert all(fetch_mode(s) == "async" for s in splits)
    values = [await s[i] for s in splits for i in range(len(s))]  # type: ignore[misc]
    assert sorted(values) == list(range(12))


@pytest.mark.anyio
async def test_concat_over_async_and_sync_children() -> None:
    a, b, c = AsyncItems(3), Batched(2, base=10), AsyncBatched(3, base=20)
    ds = ConcatDataset([a, b, c])
    assert fetch_mode(ds) == "async"
    values = [await ds[i] for i in range(-len(ds), len(ds))]  # type: ignore[misc]
    assert values == [0, 1, 2, 10, 11, 20, 21, 22] * 2
    indices = [7, 0, 3, 5, 2, 4, 6]
    assert await ds.__getitems__(indices) == [22, 0, 10, 20, 2, 11, 21]  # type: ignore[misc]
    assert c.calls == [[2, 0, 1]]
    assert b.calls == [[0, 1]]
    assert await ds.__getitems__([]) == []  # type: ignore[misc]
    with pytest.raises(IndexError):
        ds[8]


@pytest.mark.anyio
async def test_stack_over_async_and_sync_children() -> None:
    a, b = AsyncItems(4), Batched(4, base=10)
    stacked = StackDataset(a, b)
    assert fetch_mode(stacked) == "async"
    assert await stacked[2] == (2, 12)
    assert await stacked.__getitems__([3, 0]) == [(3, 13), (0, 10)]
    named = StackDataset(x=AsyncBatched(4), y=Plain(4, base=5))
    assert await named[1] == {"x": 1, "y": 6}
    assert await named.__getitems__(np.asarray([2, 2])) == [{"x": 2, "y": 7}, {"x": 2, "y": 7}]
    assert named.datasets["x"].calls == [[2, 2]]  # type: ignore[call-overload]


@pytest.mark.anyio
async def test_stack_async_child_wrong_size() -> None:
    class Short(AsyncItems):
        async def __getitems__(self, indices: Sequence[int]) -> list[int]:
            return list(indices)[:-1]

    with pytest.raises(ValueError, match=r"Expected 2, got 1"):
        await StackDataset(Short(3), Plain(3)).__getitems__([0, 1])


@pytest.mark.anyio
async def test_async_errors_keep_their_type() -> None:
    class Failing(AsyncItems):
        async def __getitem__(self, i: int) -> int:
            await anyio.sleep(0)
            if i == 1:
                raise KeyError("boom")
            return i

    # Fetches run concurrently; the dataset's own error comes out, not an exception group.
    with pytest.raises(KeyError, match="boom"):
        await StackDataset(AsyncItems(3), Failing(3)).__getitems__([0, 1, 2])
    with pytest.raises(KeyError, match="boom"):
        await StackDataset(Failing(3), AsyncItems(3))[1]
    with pytest.raises(KeyError, match="boom"):
        await ConcatDataset([AsyncItems(2), Failing(2)]).__getitems__([0, 3, 1])  # type: ignore[misc]
    with pytest.raises(KeyError, match="boom"):
        await Subset(Failing(3), [2, 1, 0]).__getitems__([0, 1, 2])  # type: ignore[misc]


@pytest.mark.anyio
async def test_async_item_fetches_run_concurrently() -> None:
    class Rendezvous(Dataset[int]):
        """Each fetch waits until all of a batch's fetches have started."""

        def __init__(self, n: int) -> None:
            self.n, self.started, self.all_started = n, 0, anyio.Event()

        def __len__(self) -> int:
            return self.n

        async def __getitem__(self, i: int) -> int:
            self.started += 1
            if self.started == self.n:
                self.all_started.set()
            await self.all_started.wait()
            return i

    sub = Subset(Rendezvous(4), [3, 2, 1, 0])
    with anyio.fail_after(10):  # a sequential fetch would never get past the first item
        assert await sub.__getitems__([0, 1, 2, 3]) == [3, 2, 1, 0]  # type: ignore[misc]


@pytest.mark.anyio
async def test_blocking_child_of_async_wrapper_runs_in_a_thread() -> None:
    class Blocking(Plain):
        def __init__(self, n: int) -> None:
            super().__init__(n)
            self.threads: set[int] = set()

        def __getitem__(self, i: int) -> int:
            self.threads.add(threading.get_ident())
            return super().__getitem__(i)

    blocking = Blocking(3)
    ds = ConcatDataset([AsyncItems(2), blocking])
    assert await ds.__getitems__([4, 0, 2]) == [2, 0, 0]  # type: ignore[misc]
    assert await ds[3] == 1  # type: ignore[misc]
    assert threading.get_ident() not in blocking.threads
    assert blocking.threads


# --------------------------------------------------------------------------- fetch_mode


def test_fetch_mode_plain_objects() -> None:
    assert fetch_mode([1, 2]) == "inline"
    assert fetch_mode(range(3)) == "inline"
    assert fetch_mode(np.arange(3)) == "inline"
    assert fetch_mode(Plain(3)) == "thread"
    assert fetch_mode(Batched(3)) == "thread"
    assert fetch_mode(AsyncItems(3)) == "async"
    assert fetch_mode(AsyncBatched(3)) == "async"


def test_fetch_mode_async_getitems_only() -> None:
    class OnlyBatches(Dataset[int]):
        async def __getitems__(self, indices: Sequence[int]) -> list[int]:
            return list(indices)

    assert fetch_mode(OnlyBatches()) == "async"


def test_fetch_mode_getitems_none_uses_getitem() -> None:
    class NoBatches(AsyncItems):
        __getitems__ = None

    assert fetch_mode(NoBatches(2)) == "async"


def test_fetch_mode_mixed_methods_need_a_declaration() -> None:
    class Mixed(AsyncItems):
        def __getitems__(self, indices: Sequence[int]) -> list[Any]:
            return [self[i] for i in indices]

    with pytest.raises(TypeError, match="__getitem__ as async def but __getitems__ as a plain"):
        fetch_mode(Mixed(2))

    class Declared(Mixed):
        _async_fetch = False

    assert fetch_mode(Declared(2)) == "thread"


def test_fetch_mode_attributes_win() -> None:
    class FastSync(Plain):
        _inline_fetch = True

    class SaysAsync(Plain):
        _async_fetch = True

    assert fetch_mode(FastSync(2)) == "inline"
    assert fetch_mode(SaysAsync(2)) == "async"


def test_fetch_mode_array_dataset(tmp_path: Any) -> None:
    x = np.arange(6)
    assert fetch_mode(ArrayDataset(x, [1, 2, 3, 4, 5, 6])) == "inline"
    mapped = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.int64, shape=(6,))
    assert fetch_mode(ArrayDataset(mapped)) == "thread"

    class Slow(ArrayDataset):
        def __getitem__(self, index: Any) -> tuple[Any, ...]:
            return super().__getitem__(index)

    class Remote(ArrayDataset):
        async def __getitem__(self, index: Any) -> tuple[Any, ...]:  # type: ignore[override]
            return super().__getitem__(index)

        async def __getitems__(self, indices: Any) -> list[tuple[Any, ...]]:  # type: ignore[override]
            return [super().__getitem__(i) for i in indices]

    assert fetch_mode(Slow(x)) == "thread"
    assert fetch_mode(Remote(x)) == "async"


def test_fetch_mode_wrappers() -> None:
    inline = ArrayDataset(np.arange(4))
    assert fetch_mode(Subset(inline, [0, 1])) == "inline"
    assert fetch_mode(Subset(Plain(4), [0, 1])) == "thread"
    assert fetch_mode(ConcatDataset([inline, inline])) == "inline"
    assert fetch_mode(ConcatDataset([inline, Plain(2)])) == "thread"
    assert fetch_mode(ConcatDataset([inline, AsyncItems(2)])) == "async"
    assert fetch_mode(StackDataset(inline, inline)) == "inline"
    assert fetch_mode(StackDataset(a=inline, b=Plain(4))) == "thread"
    assert fetch_mode(StackDataset(inline, AsyncItems(4))) == "async"
    assert fetch_mode(Subset(ConcatDataset([Plain(1), AsyncItems(1)]), [1])) == "async"
    assert fetch_mode(Subset(StackDataset(inline), [0])) == "inline"


def test_wrappers_declare_array_indices() -> None:
    inline = ArrayDataset(np.arange(4))
    assert inline._array_indices
    assert Subset(inline, [0])._array_indices
    assert ConcatDataset([inline, Plain(2)])._array_indices
    assert StackDataset(inline, Plain(4))._array_indices
    assert not StackDataset(inline, Batched(4))._array_indices


# ------------------------------------------------------- TensorDataset over torch tensors


def _tensor_dataset_cases() -> list[Any]:
    return [
        lambda torch: (torch.randn(10, 3), torch.arange(10)),
        lambda torch: (torch.randn(10, 3), np.arange(10)),
        lambda torch: (torch.randn(10, 3), np.arange(10, dtype=np.int16)),
        lambda torch: (torch.randn(10, 3), list(range(10))),
        lambda torch: (torch.randn(10, 3), [i * 0.5 for i in range(10)]),
        lambda torch: (torch.randn(10, 3), [f"s{i}" for i in range(10)]),
        lambda torch: (np.zeros((10, 2), np.float32), torch.arange(10)),
        lambda torch: (torch.randn(10, 2, 2).double(), torch.arange(10) % 2 == 0),
    ]


@pytest.mark.parametrize("index", range(len(_tensor_dataset_cases())))
@pytest.mark.parametrize("batch_size", [1, 4])
def test_tensor_dataset_batches_are_torchs(index: int, batch_size: int) -> None:
    torch = pytest.importorskip("torch")
    arrays = _tensor_dataset_cases()[index](torch)
    ours = aloader.DataLoader(
        aloader.TensorDataset(*arrays), batch_size=batch_size, shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    # torch's reference: its DataLoader over the same samples.
    theirs = torch.utils.data.DataLoader(
        list(zip(*arrays, strict=True)), batch_size=batch_size, shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    for _ in range(2):
        got, expected = list(ours), list(theirs)
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert type(a) is type(b) is list and len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                assert type(x) is type(y)
                if isinstance(y, torch.Tensor):
                    assert x.dtype == y.dtype and torch.equal(x, y)
                else:
                    assert x == y


def test_tensor_dataset_of_tensors_matches_torchs_tensor_dataset() -> None:
    torch = pytest.importorskip("torch")
    x, y = torch.randn(10, 3), torch.arange(10)
    ours = next(iter(aloader.DataLoader(aloader.TensorDataset(x, y), batch_size=4)))
    theirs = next(iter(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                                   batch_size=4)))
    assert [t.dtype for t in ours] == [t.dtype for t in theirs] == [torch.float32, torch.int64]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_torch_iterable_dataset_subclass_is_a_stream() -> None:
    """torch's ``IterableDataset`` inherits ``Dataset.__getitem__``: still a stream here, in
    aloader's ``ChainDataset`` too, and not a map for ``ConcatDataset``."""
    tud = pytest.importorskip("torch.utils.data")

    class Stream(tud.IterableDataset):  # type: ignore[misc]
        def __init__(self, n: int) -> None:
            self.n = n

        def __iter__(self) -> Iterator[int]:
            return iter(range(self.n))

    batches = [b.tolist() for b in aloader.DataLoader(Stream(5), batch_size=2)]
    assert batches == [[0, 1], [2, 3], [4]]
    chained = [b.tolist() for b in aloader.DataLoader(aloader.ChainDataset([Stream(2), Stream(3)]),
                                              batch_size=4)]
    assert chained == [[0, 1, 0, 1], [2]]
    with pytest.raises(AssertionError, match="does not support IterableDataset"):
        aloader.ConcatDataset([Stream(2)])
    with pytest.raises(ValueError, match="expected unspecified shuffle option"):
        aloader.DataLoader(Stream(5), shuffle=True)
