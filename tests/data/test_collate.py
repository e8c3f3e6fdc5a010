"""default_collate / default_convert / collate: numpy edition of torch's collate module."""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import aloader
from aloader.data._collate import (
    ColumnBatch,
    collate,
    collate_numpy_array_fn,
    default_collate,
    default_collate_err_msg_format,
    default_collate_fn_map,
    default_convert,
)

ERR = default_collate_err_msg_format

Point = collections.namedtuple("Point", ["x", "y"])


class Pair(NamedTuple):
    a: Any
    b: Any


class FrozenMap(Mapping[str, Any]):
    """An immutable mapping that can be built from a dict."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class OpaqueMap(FrozenMap):
    """An immutable mapping whose constructor does not take a mapping."""

    def __init__(self, key: str, value: Any) -> None:
        super().__init__({key: value})


class TaggedDict(dict[str, Any]):
    """A mutable mapping carrying extra state that copy.copy keeps."""

    tag = "none"


class TaggedList(list[Any]):
    tag = "none"


class FrozenSeq(Sequence[Any]):
    """An immutable sequence that can be built from a list."""

    def __init__(self, items: Sequence[Any]) -> None:
        self._items = list(items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)


class Custom:
    def __init__(self, value: int) -> None:
        self.value = value


class CustomChild(Custom):
    pass


def assert_same(ours: Any, expected: Any) -> None:
    """Same structure, same container types, arrays of the same dtype, shape and values."""
    assert type(ours) is type(expected), (type(ours), type(expected))
    if isinstance(expected, np.ndarray):
        assert ours.dtype == expected.dtype
        assert ours.shape == expected.shape
        np.testing.assert_array_equal(ours, expected)
    elif isinstance(expected, Mapping):
        assert list(ours) == list(expected)
        for key in expected:
            assert_same(ours[key], expected[key])
    elif isinstance(expected, (list, tuple)) and not isinstance(expected, (str, bytes)):
        assert len(ours) == len(expected)
        for a, b in zip(ours, expected, strict=True):
            assert_same(a, b)
    else:
        assert ours == expected


# ---------------------------------------------------------------------------------------------
# ndarrays

ALL_DTYPES = [
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.longdouble,
    np.complex64,
    np.complex128,
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (3,), (2, 3), (2, 1, 4)])
def test_arrays_stack_keeping_dtype(dtype: Any, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    batch = [(rng.random(shape) * 10).astype(dtype) for _ in range(5)]
    out = default_collate(batch)
    assert_same(out, np.stack(batch))
    assert out.shape == (5, *shape)
    assert not any(np.shares_memory(out, b) for b in batch)


def test_arrays_of_datetimes_and_structs_stack() -> None:
    dates = [np.array(["2020-01-01", "2021-06-30"], dtype="M8[D]")] * 3
    assert_same(default_collate(dates), np.stack(dates))
    records = [np.zeros(2, dtype=[("a", "f4"), ("b", "i2")])] * 3
    assert_same(default_collate(records), np.stack(records))


def test_array_subclasses_stack_into_arrays(tmp_path: Any) -> None:
    mm = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(4, 3))
    mm[:] = np.arange(12).reshape(4, 3)
    out = default_collate([mm[0], mm[2]])
    np.testing.assert_array_equal(out, [[0, 1, 2], [6, 7, 8]])
    assert out.dtype == np.float32


def test_single_element_batch() -> None:
    assert_same(default_collate([np.arange(3)]), np.arange(3)[None])
    assert_same(default_collate([7]), np.array([7], dtype=np.int64))


@pytest.mark.parametrize("dtype", ["U3", "S3", object], ids=["unicode", "bytes", "object"])
def test_string_and_object_arrays_are_refused(dtype: Any) -> None:
    batch = [np.array(["ab", "c"], dtype=dtype)] * 2
    with pytest.raises(TypeError) as info:
        default_collate(batch)
    assert str(info.value) == ERR.format(np.dtype(dtype))


def test_later_string_array_is_refused_with_its_dtype() -> None:
    with pytest.raises(TypeError) as info:
        default_collate([np.array([1.0]), np.array(["a"])])
    assert str(info.value) == ERR.format(np.dtype("<U1"))


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ([(3,), (3,), (4,)], "but got (3,) at entry 0 and (4,) at entry 2"),
        ([(1,), (2,), (1,)], "but got (1,) at entry 0 and (2,) at entry 1"),
        ([(2, 3), ()], "but got (2, 3) at entry 0 and () at entry 1"),
        ([(0, 3), (0, 4)], "but got (0, 3) at entry 0 and (0, 4) at entry 1"),
        ([(2, 2), (2, 2), (2, 2), (2, 3)], "but got (2, 2) at entry 0 and (2, 3) at entry 3"),
    ],
)
def test_unequal_shapes_name_both_shapes_and_positions(
    shapes: list[tuple[int, ...]], message: str
) -> None:
    with pytest.raises(RuntimeError) as info:
        default_collate([np.zeros(s, dtype=np.float32) for s in shapes])
    assert str(info.value) == "stack expects each array to be equal size, " + message


def test_unequal_shapes_in_a_subclass_batch(tmp_path: Any) -> None:
    mm = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(7,))
    with pytest.raises(RuntimeError, match=re.escape("(3,) at entry 0 and (4,) at entry 1")):
        default_collate([mm[:3], mm[:4]])


# ---------------------------------------------------------------------------------------------
# scalars, strings


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_scalars_keep_dtype(dtype: Any) -> None:
    batch = [dtype(1), dtype(0), dtype(1)]
    out = default_collate(batch)
    assert_same(out, np.array([1, 0, 1], dtype=dtype))


def test_mixed_numpy_scalars_promote() -> None:
    assert default_collate([np.float32(1), np.float64(2)]).dtype == np.float64
    assert default_collate([np.int8(1), np.float16(2)]).dtype == np.float16


def test_python_numbers() -> None:
    assert_same(default_collate([1, 2, 3]), np.array([1, 2, 3], dtype=np.int64))
    assert_same(default_collate([1.5, 2.0]), np.array([1.5, 2.0], dtype=np.float64))
    assert_same(default_collate([True, False]), np.array([True, False]))
    # Same inference as torch.tensor on mixed python numbers.
    assert_same(default_collate([1, True]), np.array([1, 1], dtype=np.int64))
    assert_same(default_collate([1, 2.5]), np.array([1, 2.5], dtype=np.float32))
    assert_same(default_collate([1.5, 2]), np.array([1.5, 2.0], dtype=np.float64))
    assert_same(default_collate([1, 2j]), np.array([1, 2j], dtype=np.complex64))
    assert_same(default_collate([1, np.float64(2.5)]), np.array([1, 2.5], dtype=np.float64))
    assert_same(default_collate([2**63 - 1]), np.array([2**63 - 1], dtype=np.int64))
    assert_same(default_collate([1.5, 2**70]), np.array([1.5, 2.0**70], dtype=np.float64))


@pytest.mark.parametrize("batch", [[2**63], [-(2**63) - 1], [1, 2**70]])
def test_int_overflow(batch: list[int]) -> None:
    with pytest.raises(ValueError, match="Overflow when unpacking long long"):
        default_collate(batch)


@pytest.mark.parametrize(
    ("batch", "found"),
    [
        ([1, b"x"], bytes),
        ([1, "a"], str),
        ([1.5, None], type(None)),
        ([1.5, 2j], complex),
        ([np.float32(1), "a"], str),
    ],
)
def test_mixed_numbers_with_non_numbers(batch: list[Any], found: type) -> None:
    with pytest.raises(TypeError) as info:
        default_collate(batch)
    assert str(info.value) == ERR.format(found)


@pytest.mark.parametrize(
    "batch", [["a", "bc"], [b"a", b"bc"], [np.str_("a"), np.str_("b")], [np.bytes_(b"x")]]
)
def test_strings_and_bytes_are_returned_unchanged(batch: list[Any]) -> None:
    assert default_collate(batch) is batch


# ---------------------------------------------------------------------------------------------
# containers


def test_dict_per_key_in_key_order() -> None:
    batch = [{"b": 1, "a": np.zeros(2)}, {"b": 2, "a": np.ones(2)}]
    out = default_collate(batch)
    assert type(out) is dict and list(out) == ["b", "a"]
    assert_same(out["b"], np.array([1, 2]))
    assert_same(out["a"], np.array([[0.0, 0.0], [1.0, 1.0]]))


def test_mapping_types_are_kept() -> None:
    ordered = default_collate([collections.OrderedDict(x=1, y=2.0)] * 2)
    assert type(ordered) is collections.OrderedDict and list(ordered) == ["x", "y"]

    dd: collections.defaultdict[str, Any] = collections.defaultdict(list, x=1)
    out = default_collate([dd, dd])
    assert type(out) is collections.defaultdict and out.default_factory is list
    assert_same(out["x"], np.array([1, 1]))
    assert dd["x"] == 1, "the sample must not be modified"

    tagged = TaggedDict(x=1.0)
    tagged.tag = "kept"
    out = default_collate([tagged, TaggedDict(x=2.0)])
    assert type(out) is TaggedDict and out.tag == "kept"
    assert_same(out["x"], np.array([1.0, 2.0]))

    frozen = default_collate([FrozenMap({"x": 1}), FrozenMap({"x": 2})])
    assert type(frozen) is FrozenMap
    assert_same(frozen["x"], np.array([1, 2]))

    opaque = default_collate([OpaqueMap("x", 1), OpaqueMap("x", 2)])
    assert type(opaque) is dict
    assert_same(opaque["x"], np.array([1, 2]))


def test_missing_key_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        default_collate([{"a": 1}, {"b": 2}])


def test_namedtuples_keep_their_type() -> None:
    out = default_collate([Point(1, np.zeros(2)), Point(2, np.ones(2))])
    assert type(out) is Point
    assert_same(out.x, np.array([1, 2]))
    assert_same(out.y, np.array([[0.0, 0.0], [1.0, 1.0]]))
    typed = default_collate([Pair("u", 1.5), Pair("v", 2.5)])
    assert type(typed) is Pair
    assert typed.a == ("u", "v")  # strings come as zip() hands them over, like torch
    assert_same(typed.b, np.array([1.5, 2.5]))


def test_tuples_and_lists_give_lists() -> None:
    assert_same(default_collate([(1, 2.0), (3, 4.0)]), [np.array([1, 3]), np.array([2.0, 4.0])])
    assert_same(default_collate([[1, 2], [3, 4]]), [np.array([1, 3]), np.array([2, 4])])


def test_other_sequences_follow_torch() -> None:
    tagged = TaggedList([1, 2])
    tagged.tag = "kept"
    out = default_collate([tagged, TaggedList([3, 4])])
    assert type(out) is TaggedList and out.tag == "kept"
    assert_same(list(out), [np.array([1, 3]), np.array([2, 4])])
    assert list(tagged) == [1, 2], "the sample must not be modified"

    deq = default_collate([collections.deque([1, 2]), collections.deque([3, 4])])
    assert type(deq) is collections.deque
    frozen = default_collate([FrozenSeq([1, 2]), FrozenSeq([3, 4])])
    assert type(frozen) is FrozenSeq
    assert_same(list(frozen), [np.array([1, 3]), np.array([2, 4])])
    # range(list) is a TypeError: falls back to a list.
    assert_same(default_collate([range(2), range(2)]), [np.array([0, 0]), np.array([1, 1])])


def test_unequal_sequence_lengths() -> None:
    for batch in ([[1, 2], [1]], [(1, 2), (1, 2), (1,)], [[1], [1, 2]]):
        with pytest.raises(
            RuntimeError, match=r"^each element in list of batch should be of equal size$"
        ):
            default_collate(batch)


def test_nested_structure() -> None:
    batch = [
        {"img": np.full((2, 2), i, np.uint8), "meta": (i, {"name": f"s{i}", "w": [i * 0.5]})}
        for i in range(3)
    ]
    out = default_collate(batch)
    expected = {
        "img": np.stack([np.full((2, 2), i, np.uint8) for i in range(3)]),
        "meta": [
            np.array([0, 1, 2]),
            # A mapping's values are gathered in a list, a sequence's positions by zip().
            {"name": ["s0", "s1", "s2"], "w": [np.array([0.0, 0.5, 1.0])]},
        ],
    }
    assert_same(out, expected)


@pytest.mark.parametrize(
    "batch",
    [[None, None], [object()], [1j, 2j], [np.datetime64("2020-01-01")], [{1, 2}], [Custom(1)]],
)
def test_unsupported_types(batch: list[Any]) -> None:
    with pytest.raises(TypeError) as info:
        default_collate(batch)
    assert str(info.value) == ERR.format(type(batch[0]))


def test_empty_batch_is_an_index_error() -> None:
    with pytest.raises(IndexError):
        default_collate([])


# ---------------------------------------------------------------------------------------------
# collate and collate_fn_map


@pytest.mark.parametrize(
    ("batch", "found"),
    [
        ([np.zeros(2)] * 2, np.ndarray),
        ([1, 2], int),
        ([(1, 2), (3, 4)], int),
        ([{"a": 1.5}], float),
    ],
)
def test_collate_without_map_only_knows_containers(batch: list[Any], found: type) -> None:
    with pytest.raises(TypeError) as info:
        collate(batch)
    assert str(info.value) == ERR.format(found)


def test_custom_map_entries() -> None:
    calls: list[Any] = []

    def collate_custom(batch: Sequence[Custom], *, collate_fn_map: Any = None) -> int:
        calls.append(collate_fn_map)
        return sum(c.value for c in batch)

    custom_map = {Custom: collate_custom}
    batch = [{"c": Custom(1)}, {"c": Custom(2)}]
    assert collate(batch, collate_fn_map=custom_map) == {"c": 3}
    assert calls == [custom_map]
    # isinstance lookup reaches subclasses.
    assert collate([CustomChild(4), Custom(5)], collate_fn_map=custom_map) == 9
    # Exact type first, then isinstance in insertion order.
    ordered = {Custom: lambda b, **_: "base", CustomChild: lambda b, **_: "child"}
    assert collate([CustomChild(1)], collate_fn_map=ordered) == "child"
    ordered = {object: lambda b, **_: "object", Custom: lambda b, **_: "custom"}
    assert collate([CustomChild(1)], collate_fn_map=ordered) == "object"
    # A tuple of types as key.
    assert collate([1.5], collate_fn_map={(int, float): lambda b, **_: "num"}) == "num"


def test_extending_a_copy_of_the_default_map() -> None:
    custom_map = {**default_collate_fn_map, Custom: lambda b, **_: [c.value for c in b]}
    out = collate([(Custom(1), np.zeros(2)), (Custom(2), np.ones(2))], collate_fn_map=custom_map)
    assert out[0] == [1, 2]
    assert_same(out[1], np.array([[0.0, 0.0], [1.0, 1.0]]))
    with pytest.raises(TypeError):
        default_collate([Custom(1)])


def test_overriding_an_entry_in_a_copy() -> None:
    custom_map = dict(default_collate_fn_map)
    custom_map[np.ndarray] = lambda b, **_: "mine"
    assert collate([np.zeros(1)], collate_fn_map=custom_map) == "mine"
    assert_same(default_collate([np.zeros(1)]), np.zeros((1, 1)))


def test_registering_in_the_default_map(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(default_collate_fn_map, Custom, lambda b, **_: len(b))
    assert default_collate([Custom(1), Custom(2)]) == 2
    assert aloader.default_collate_fn_map is default_collate_fn_map


def test_default_map_order_matches_torch() -> None:
    keys = list(default_collate_fn_map)
    assert keys[1:] == [np.ndarray, (np.bool_, np.number, np.object_), float, int, str, bytes]
    assert collate_numpy_array_fn is default_collate_fn_map[np.ndarray]


# ---------------------------------------------------------------------------------------------
# default_convert


def test_default_convert_leaves_numpy_alone() -> None:
    arr = np.arange(3)
    assert default_convert(arr) is arr
    strings = np.array(["a", "b"])
    assert default_convert(strings) is strings
    scalar = np.float32(2.5)
    assert default_convert(scalar) is scalar
    for value in (1, 2.5, "s", b"b", None):
        assert default_convert(value) is value


def test_default_convert_recursion() -> None:
    arr = np.zeros(2)
    out = default_convert({"a": (arr, [1, "x"]), "p": Point(arr, 2)})
    assert type(out) is dict
    assert type(out["a"]) is list and out["a"][0] is arr and out["a"][1] == [1, "x"]
    assert type(out["p"]) is Point and out["p"].x is arr
    dd: collections.defaultdict[str, Any] = collections.defaultdict(int, k=arr)
    converted = default_convert(dd)
    assert type(converted) is collections.defaultdict and converted.default_factory is int
    assert type(default_convert(collections.OrderedDict(a=1))) is collections.OrderedDict
    assert type(default_convert(OpaqueMap("a", 1))) is dict
    tagged = TaggedList([arr])
    tagged.tag = "kept"
    assert type(default_convert(tagged)) is TaggedList and default_convert(tagged).tag == "kept"
    assert default_convert(range(3)) == [0, 1, 2]
    assert type(default_convert(FrozenSeq([1]))) is FrozenSeq


# ---------------------------------------------------------------------------------------------
# ColumnBatch fast path


def _columns_cases() -> list[list[Any]]:
    rng = np.random.default_rng(1)
    n = 6
    cases: list[list[Any]] = [
        [rng.random((n, 4)).astype(np.float32), np.arange(n)],
        [rng.random(n) > 0.5, (rng.random(n) * 100).astype(np.uint8)],
        [rng.random((n, 2, 3)), np.arange(n, dtype=np.float16), np.arange(n) + 1j],
        [np.arange(n), [f"s{i}" for i in range(n)], [b"x"] * n],
        [np.arange(n), [i * 0.5 for i in range(n)], list(range(n))],
        [np.array([[f"s{i}"] for i in range(n)])],
        [np.zeros((n, 2), dtype="M8[s]")],
        [np.array([{"k": i} for i in range(n)], dtype=object)],
        [np.array([(i, 2 * i) for i in range(n)], dtype=object)],
        [[np.full(2, i) for i in range(n)], np.arange(n, dtype=np.int32)],
        [np.arange(n).reshape(n, 1, 1), np.zeros((n, 0))],
    ]
    return cases


def _run(fn: Any, batch: Any) -> Any:
    try:
        return ("ok", fn(batch))
    except Exception as exc:
        return ("error", type(exc), str(exc))


@pytest.mark.parametrize("columns", _columns_cases())
def test_column_batch_equals_row_wise_collate(columns: list[Any]) -> None:
    batch = ColumnBatch(columns)
    fast = _run(default_collate, batch)
    slow = _run(default_collate, list(batch))
    assert fast[0] == slow[0]
    if fast[0] == "ok":
        assert_same(fast[1], slow[1])
    else:
        assert fast[1:] == slow[1:]


def test_column_batch_returns_numeric_columns_as_they_are() -> None:
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    b = np.arange(4)
    out = default_collate(ColumnBatch([a, b, ["w", "x", "y", "z"]]))
    assert type(out) is list
    assert out[0] is a and out[1] is b
    assert out[2] == ("w", "x", "y", "z")


def test_column_batch_with_a_1d_datetime_column_fails_like_rows() -> None:
    dates = np.zeros(3, dtype="M8[s]")
    with pytest.raises(TypeError) as info:
        default_collate(ColumnBatch([np.arange(3), dates]))
    assert str(info.value) == ERR.format(np.datetime64)


def test_column_batch_uses_a_changed_map(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(default_collate_fn_map, np.ndarray, lambda b, **_: "custom")
    assert default_collate(ColumnBatch([np.zeros((3, 2))])) == ["custom"]
    custom_map = {**default_collate_fn_map, (np.bool_, np.number, np.object_): lambda b, **_: 0}
    assert collate(ColumnBatch([np.arange(3)]), collate_fn_map=custom_map) == [0]


def test_column_batch_without_map() -> None:
    with pytest.raises(TypeError):
        collate(ColumnBatch([np.arange(3)]))


def test_column_batch_of_unequal_columns_fails_like_rows() -> None:
    batch = ColumnBatch([np.arange(3), np.arange(4)])
    with pytest.raises(ValueError):
        default_collate(batch)


def test_empty_column_batch_is_an_index_error() -> None:
    with pytest.raises(IndexError):
        default_collate(ColumnBatch([np.zeros((0, 3))]))


NUMERIC_DTYPES = [np.dtype(d) for d in ALL_DTYPES if d is not np.longdouble]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_column_batch_property(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 5), label="n")
    columns = []
    for _ in range(data.draw(st.integers(1, 4), label="columns")):
        dtype = data.draw(st.sampled_from(NUMERIC_DTYPES))
        inner = data.draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3))
        columns.append(data.draw(hnp.arrays(dtype, (n, *inner))))
    batch = ColumnBatch(columns)
    assert_same(default_collate(batch), default_collate(list(batch)))


# ---------------------------------------------------------------------------------------------
# torch is optional


def test_numpy_collation_does_not_import_torch() -> None:
    code = (
        "import sys, numpy as np, aloader\n"
        "from aloader.data._collate import ColumnBatch\n"
        "aloader.default_collate([{'a': np.zeros(2), 'b': (1, 2.0, 'x')}] * 2)\n"
        "aloader.default_collate(ColumnBatch([np.zeros((2, 2)), ['a', 'b']]))\n"
        "aloader.default_convert([np.zeros(2)])\n"
        "try:\n"
        "    aloader.default_collate([object()])\n"
        "except TypeError:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# differential tests against torch


def assert_matches_torch(ours: Any, theirs: Any) -> None:
    """Our numpy output mirrors torch's tensor output: same structure, dtypes and values."""
    torch = sys.modules["torch"]
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, (np.ndarray, np.generic)), type(ours)
        expected = theirs.numpy()
        assert np.asarray(ours).dtype == expected.dtype
        assert np.shape(ours) == expected.shape
        np.testing.assert_array_equal(ours, expected)
        return
    assert type(ours) is type(theirs), (type(ours), type(theirs))
    if isinstance(theirs, Mapping):
        assert list(ours) == list(theirs)
        for key in theirs:
            assert_matches_torch(ours[key], theirs[key])
    elif isinstance(theirs, Sequence | collections.deque) and not isinstance(theirs, str | bytes):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            assert_matches_torch(a, b)
    elif isinstance(theirs, np.ndarray):  # arrays torch leaves alone (default_convert)
        assert ours is not None
        assert_same(ours, theirs)
    else:
        assert ours == theirs or (ours != ours and theirs != theirs)  # NaN


def _torch_collate() -> Any:
    torch = pytest.importorskip("torch")
    return torch.utils.data.default_collate


TORCH_CASES: list[tuple[str, list[Any]]] = [
    ("float32 arrays", [np.ones((2, 3), np.float32) * i for i in range(4)]),
    ("0-d arrays", [np.array(i, dtype=np.int16) for i in range(3)]),
    ("bool arrays", [np.array([True, False])] * 2),
    ("uint arrays", [np.array([1, 2], dtype=d) for d in ("u2", "u2")]),
    ("uint64 arrays", [np.array([2**63, 1], dtype=np.uint64)] * 2),
    ("complex arrays", [np.array([1 + 2j], dtype=np.complex64)] * 2),
    ("ints", [1, 2, 3]),
    ("floats", [1.5, float("nan"), float("inf")]),
    ("bools", [True, False, True]),
    ("int and bool", [1, True]),
    ("int and float", [1, 2.5]),
    ("float and int", [1.5, 2]),
    ("int and complex", [1, 2j]),
    ("int and np.float64", [1, np.float64(2.5)]),
    ("float and big int", [1.5, 2**70]),
    ("strings", ["a", "b"]),
    ("bytes", [b"a", b"b"]),
    ("np.str_", [np.str_("a"), np.str_("b")]),
    ("dict", [{"x": np.zeros(2), "y": 1, "z": "s"}, {"x": np.ones(2), "y": 2, "z": "t"}]),
    ("OrderedDict", [collections.OrderedDict(b=1, a=2.0)] * 2),
    ("defaultdict", [collections.defaultdict(int, k=np.int8(3))] * 2),
    ("FrozenMap", [FrozenMap({"k": 1.0}), FrozenMap({"k": 2.0})]),
    ("OpaqueMap", [OpaqueMap("k", 1), OpaqueMap("k", 2)]),
    ("namedtuple", [Point(np.float16(1), "a"), Point(np.float16(2), "b")]),
    ("NamedTuple", [Pair(np.zeros(3), (1, 2)), Pair(np.ones(3), (3, 4))]),
    ("tuples", [(1, 2.0, "a"), (3, 4.0, "b")]),
    ("lists", [[np.int32(1), [2]], [np.int32(3), [4]]]),
    ("TaggedList", [TaggedList([1, 2]), TaggedList([3, 4])]),
    ("deque", [collections.deque([1, 2])] * 2),
    ("FrozenSeq", [FrozenSeq([1, 2]), FrozenSeq([3, 4])]),
    ("range", [range(3), range(3)]),
    (
        "nested",
        [
            {"img": np.full((2, 2), i, np.uint8), "meta": (i, {"n": f"s{i}", "w": [i * 0.5]})}
            for i in range(3)
        ],
    ),
]


@pytest.mark.parametrize(("name", "batch"), TORCH_CASES, ids=[c[0] for c in TORCH_CASES])
def test_matches_torch(name: str, batch: list[Any]) -> None:
    torch_collate = _torch_collate()
    assert_matches_torch(default_collate(batch), torch_collate(batch))


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if d not in (np.uint64, np.longdouble)])
def test_numpy_scalars_match_torch(dtype: Any) -> None:
    torch_collate = _torch_collate()
    batch = [dtype(1), dtype(0)]
    assert_matches_torch(default_collate(batch), torch_collate(batch))


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if d is not np.longdouble])
def test_arrays_match_torch(dtype: Any) -> None:
    torch_collate = _torch_collate()
    batch = [np.arange(6).reshape(2, 3).astype(dtype)] * 3
    assert_matches_torch(default_collate(batch), torch_collate(batch))


def _torch_shape_to_ours(message: str) -> str:
    """Rewrite torch.stack's "[2, 3]" shapes and "tensor" wording into ours."""

    def shape(match: re.Match[str]) -> str:
        dims = tuple(int(d) for d in match.group(1).split(",") if d.strip())
        return str(dims)

    return re.sub(r"\[([\d, ]*)\]", shape, message).replace("each tensor", "each array")


ERROR_CASES: list[tuple[str, list[Any]]] = [
    ("unicode array", [np.array(["a"])] * 2),
    ("bytes array", [np.array([b"a"])] * 2),
    ("object array", [np.array([None])] * 2),
    ("shapes 3,3,4", [np.zeros(3), np.zeros(3), np.zeros(4)]),
    ("shapes 1,2", [np.zeros(1), np.zeros(2), np.zeros(1)]),
    ("shapes 2x3,0-d", [np.zeros((2, 3)), np.zeros(())]),
    ("shapes in dict", [{"a": np.zeros((2, 2))}, {"a": np.zeros((2, 1))}]),
    ("list lengths", [[1, 2], [1]]),
    ("tuple lengths", [(1,), (1, 2)]),
    ("None", [None, None]),
    ("object", [object()]),
    ("complex", [1j]),
    ("datetime scalar", [np.datetime64("2020-01-01")]),
    ("set", [{1}]),
    ("int overflow", [2**63]),
    ("negative int overflow", [-(2**63) - 1]),
    ("missing key", [{"a": 1}, {"b": 1}]),
    ("empty", []),
    ("float and complex", [1.5, 2j]),
    ("ints and str", [1, "a"]),
    ("array then str array", [np.array([1.0]), np.array(["a"])]),
]


@pytest.mark.parametrize(("name", "batch"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors_match_torch(name: str, batch: list[Any]) -> None:
    torch_collate = _torch_collate()
    with pytest.raises(Exception) as theirs:
        torch_collate(batch)
    with pytest.raises(Exception) as ours:
        default_collate(batch)
    assert type(ours.value) is type(theirs.value)
    if name in ("float and complex", "ints and str", "array then str array"):
        return  # torch's own conversion messages ("must be real number, not complex", ...)
    assert str(ours.value) == _torch_shape_to_ours(str(theirs.value))


def test_collate_without_map_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    for batch in ([np.zeros(2)] * 2, [1, 2], [(1, 2), (3, 4)], [{"a": 1}]):
        with pytest.raises(TypeError) as theirs:
            torch.utils.data._utils.collate.collate(batch)
        with pytest.raises(TypeError) as ours:
            collate(batch)
        assert str(ours.value) == str(theirs.value)


DEFAULT_CONVERT_CASES: list[Any] = [
    np.arange(3),
    np.float32(1.5),
    np.array(["a", "b"]),
    5,
    "s",
    {"a": np.zeros(2), "b": (1, [np.int8(2)])},
    collections.OrderedDict(a=np.zeros(1)),
    collections.defaultdict(list, a=np.zeros(1)),
    Point(np.zeros(1), 1),
    (np.zeros(1), "x"),
    [np.zeros(1), b"x"],
    TaggedList([np.zeros(1)]),
    collections.deque([np.zeros(1)]),
    FrozenSeq([np.zeros(1)]),
    OpaqueMap("k", np.zeros(1)),
    range(3),
]


@pytest.mark.parametrize("data", DEFAULT_CONVERT_CASES, ids=lambda d: type(d).__name__)
def test_default_convert_matches_torch(data: Any) -> None:
    torch = pytest.importorskip("torch")
    assert_matches_torch(default_convert(data), torch.utils.data.default_convert(data))


def test_torch_tensors_are_stacked_as_tensors() -> None:
    torch = pytest.importorskip("torch")
    tensors = [torch.arange(3, dtype=torch.float32) + i for i in range(4)]
    out = default_collate(tensors)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, torch.stack(tensors))

    # A tensor anywhere in the sample: the whole batch is torch's, numpy arrays and ints too.
    batch = [{"t": torch.ones(2) * i, "a": np.full(2, i), "n": i} for i in range(3)]
    out = default_collate(batch)
    assert all(isinstance(out[key], torch.Tensor) for key in "tan")
    assert_equals_torch(out, torch.utils.data.default_collate(batch))

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]  # a Tensor subclass
    assert torch.equal(default_collate(params), torch.zeros(2, 2))
    # A user's copy of the default map keeps the tensor entry.
    copied = collate(tensors, collate_fn_map=dict(default_collate_fn_map))
    assert torch.equal(copied, torch.stack(tensors))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_torch_tensor_errors_match_torch() -> None:
    torch = pytest.importorskip("torch")
    cases = [
        [torch.zeros(2), torch.zeros(3)],
        [torch.zeros(2), np.zeros(2)],
        [torch.zeros(2).to_sparse()] * 2,
        [torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])] * 2,
    ]
    for batch in cases:
        with pytest.raises(Exception) as theirs:
            torch.utils.data.default_collate(batch)
        with pytest.raises(Exception) as ours:
            default_collate(batch)
        assert type(ours.value) is type(theirs.value)
        assert str(ours.value) == str(theirs.value)


# Structures for hypothesis: a schema, then samples that follow it.
TORCH_ARRAY_DTYPES = [np.dtype(d) for d in ALL_DTYPES if d is not np.longdouble]
TORCH_SCALAR_DTYPES = [np.dtype(d) for d in ALL_DTYPES if d not in (np.longdouble, np.uint64)]

leaf_schemas = st.one_of(
    st.tuples(
        st.just("array"),
        st.sampled_from(TORCH_ARRAY_DTYPES),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
    ),
    st.tuples(st.just("scalar"), st.sampled_from(TORCH_SCALAR_DTYPES)),
    st.tuples(st.sampled_from(["int", "float", "bool", "str", "bytes"])),
)
schemas = st.recursive(
    leaf_schemas,
    lambda children: st.one_of(
        st.tuples(
            st.just("dict"),
            st.dictionaries(
                st.text("abc", min_size=1, max_size=2), children, min_size=1, max_size=3
            ),
        ),
        st.tuples(st.sampled_from(["tuple", "list"]), st.lists(children, min_size=1, max_size=3)),
        st.tuples(st.just("point"), st.tuples(children, children)),
    ),
    max_leaves=6,
)


def draw_sample(data: st.DataObject, schema: Any) -> Any:
    kind = schema[0]
    if kind == "array":
        return data.draw(hnp.arrays(schema[1], schema[2]))
    if kind == "scalar":
        return data.draw(hnp.from_dtype(schema[1]))
    if kind == "int":
        return data.draw(st.integers(-(2**63), 2**63 - 1))
    if kind == "float":
        return data.draw(st.floats())
    if kind == "bool":
        return data.draw(st.booleans())
    if kind == "str":
        return data.draw(st.text(max_size=3))
    if kind == "bytes":
        return data.draw(st.binary(max_size=3))
    if kind == "dict":
        return {key: draw_sample(data, child) for key, child in schema[1].items()}
    if kind == "point":
        return Point(*(draw_sample(data, child) for child in schema[1]))
    items = [draw_sample(data, child) for child in schema[1]]
    return tuple(items) if kind == "tuple" else items


@settings(max_examples=80, deadline=None)
@given(schemas, st.integers(1, 4), st.data())
def test_nested_structures_match_torch(schema: Any, n: int, data: st.DataObject) -> None:
    torch_collate = _torch_collate()
    batch = [draw_sample(data, schema) for _ in range(n)]
    assert_matches_torch(default_collate(batch), torch_collate(batch))


@settings(max_examples=40, deadline=None)
@given(schemas, st.data())
def test_default_convert_structures_match_torch(schema: Any, data: st.DataObject) -> None:
    torch = pytest.importorskip("torch")
    sample = draw_sample(data, schema)
    assert_matches_torch(default_convert(sample), torch.utils.data.default_convert(sample))


# ---------------------------------------------------------------------------------------------
# numpy mode: mixed number types promote as torch promotes them


MIXED_NUMBER_CASES: list[list[Any]] = [
    [np.int64(1), 2.5],
    [np.float32(1), 2.5],
    [np.int64(1), np.float32(2)],
    [True, np.uint8(200)],
    [np.uint8(200), True],
    [np.int8(1), 300],
    [np.int32(1), 2],
    [np.float16(1), 2.5],
    [2.5, np.float32(1)],
    [1, np.float32(2.5)],
    [1, np.int8(2)],
    [1, np.uint8(2)],
    [1.5, np.int64(2)],
    [True, 2.5],
    [1, np.complex64(1j)],
    [np.complex64(1j), 2.5],
    [np.uint8(1), np.int8(2)],
    [np.float32(1), np.float64(2)],
    [np.float16(1), np.int64(2)],
    [np.uint16(1), 2.5, 2],
    [np.uint16(1), np.float32(2)],
    [np.uint64(2**63), 1.5],
    [2.5, np.uint64(3)],
    [np.int8(1), 1j],
    [np.float64(1), 1j],
    [np.bool_(True), 1.5],
    [np.float32(1), True],
    [np.float32(1), 2**70],
    [1, 2**70, 1.5],
    [np.float16(1), 2.5, np.int64(1)],
    [np.int64(1), True],
    [np.uint8(1), 1000],
    [np.uint32(5), np.uint32(6)],
]


@pytest.mark.parametrize("batch", MIXED_NUMBER_CASES, ids=repr)
def test_mixed_numbers_match_torch(batch: list[Any]) -> None:
    torch_collate = _torch_collate()
    assert_matches_torch(default_collate(batch), torch_collate(batch))
    assert "torch" in sys.modules  # (the test imports it; numpy mode does not need it)


MIXED_NUMBER_ERRORS: list[list[Any]] = [
    [np.uint16(1), np.int8(2)],
    [np.uint16(1), 2],
    [np.int64(1), np.uint64(2)],
    [np.uint32(1), np.uint16(2)],
    [np.uint16(1), True],
    [1, np.uint32(3)],
    [np.uint16(1), 2, 2.5],  # left to right: uint16 meets int64 before the float
    [np.uint16(1), np.complex64(1j)],
    [np.uint8(1), np.int8(1), np.uint16(3)],
    [np.int64(1), 2**63],
    [1, 2**70],
    [np.float32(1), "a"],
    [1, "a"],
]


@pytest.mark.parametrize("batch", MIXED_NUMBER_ERRORS, ids=repr)
def test_mixed_number_errors_match_torch(batch: list[Any]) -> None:
    torch_collate = _torch_collate()
    with pytest.raises(Exception) as theirs:
        torch_collate(batch)
    with pytest.raises(Exception) as ours:
        default_collate(batch)
    assert type(ours.value) is type(theirs.value)
    if not isinstance(theirs.value, TypeError):  # torch's conversion messages differ
        assert str(ours.value) == str(theirs.value)


def test_documented_differences_from_torch_in_numpy_mode() -> None:
    # np.bool_ with integers: the integers (torch raises TypeError).
    assert_same(default_collate([np.bool_(True), 1]), np.array([1, 1], dtype=np.int64))
    assert_same(default_collate([np.bool_(True), np.int8(3)]), np.array([1, 3], dtype=np.int8))
    # A numpy complex after a python float is refused (torch drops its imaginary part).
    with pytest.raises(TypeError):
        default_collate([1.5, np.complex64(1j)])
    # uint64 and longdouble scalars are collated (torch refuses them).
    assert_same(default_collate([np.uint64(2**63), np.uint64(1)]),
                np.array([2**63, 1], dtype=np.uint64))
    assert default_collate([np.longdouble(1), 1]).dtype == np.longdouble


def test_mixed_numbers_fail_before_this_fix() -> None:
    # Regression: numpy's promotion used to give float64 here, and an overflow error for the
    # bool/uint8 mix.
    assert_same(default_collate([np.int64(1), 2.5]), np.array([1, 2.5], dtype=np.float32))
    assert_same(default_collate([True, np.uint8(200)]), np.array([1, 200], dtype=np.uint8))
    assert_same(default_collate([1, np.complex64(1j)]), np.array([1, 1j], dtype=np.complex64))


_SCALAR_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16,
                  np.uint32, np.float16, np.float32, np.float64, np.complex64, np.complex128]
numbers_strategy = st.one_of(
    st.booleans(),
    st.integers(-100, 100),
    st.floats(-100, 100),
    st.complex_numbers(max_magnitude=100),
    st.tuples(st.sampled_from(_SCALAR_DTYPES), st.integers(0, 100)).map(lambda p: p[0](p[1])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(numbers_strategy, min_size=1, max_size=5))
def test_mixed_number_batches_match_torch(batch: list[Any]) -> None:
    torch_collate = _torch_collate()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            theirs = torch_collate(batch)
    except TypeError:
        # torch cannot turn np.bool_ into an integer, nor collate complex after a float; the
        # first is a documented difference, the second raises here too.
        if any(type(b) is np.bool_ for b in batch):
            return
        with pytest.raises(TypeError):
            default_collate(batch)
        return
    except RuntimeError as exc:
        with pytest.raises(RuntimeError) as ours:
            default_collate(batch)
        assert str(ours.value) == str(exc)
        return
    if any(issubclass(w.category, np.exceptions.ComplexWarning) for w in caught):
        # torch drops the imaginary part of a numpy complex after a python float; we refuse.
        with pytest.raises(TypeError):
            default_collate(batch)
        return
    assert_matches_torch(default_collate(batch), theirs)


# ---------------------------------------------------------------------------------------------
# torch mode: a tensor anywhere in the first sample makes the whole batch torch's


def assert_equals_torch(ours: Any, theirs: Any) -> None:
    """The same structure and container types, and tensors of the same dtype, shape, values."""
    torch = sys.modules["torch"]
    assert type(ours) is type(theirs), (type(ours), type(theirs))
    if isinstance(theirs, torch.Tensor):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
        assert ours.dtype == theirs.dtype
    elif isinstance(theirs, Mapping):
        assert list(ours) == list(theirs)
        for key in theirs:
            assert_equals_torch(ours[key], theirs[key])
    elif isinstance(theirs, Sequence | collections.deque) and not isinstance(theirs, str | bytes):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            assert_equals_torch(a, b)
    elif isinstance(theirs, np.ndarray):  # string arrays that default_convert leaves alone
        assert_same(ours, theirs)
    else:
        assert ours == theirs


def _torch_mode_cases() -> list[tuple[str, list[Any]]]:
    torch = pytest.importorskip("torch")
    t = [torch.arange(3, dtype=torch.float32) + i for i in range(3)]
    return [
        ("tensor, int", [(t[i], i) for i in range(3)]),
        ("tensor, float", [(t[i], i * 0.5) for i in range(3)]),
        ("tensor, bool", [(t[i], i % 2 == 0) for i in range(3)]),
        ("int, tensor", [(i, t[i]) for i in range(3)]),
        ("tensor, ndarray", [(t[i], np.full((2, 2), i, np.float32)) for i in range(3)]),
        ("tensor, 0-d ndarray", [(t[i], np.array(i, np.int16)) for i in range(3)]),
        ("tensor, uint8 ndarray", [(t[i], np.full(2, i, np.uint8)) for i in range(3)]),
        ("tensor, np.float32", [(t[i], np.float32(i)) for i in range(3)]),
        ("tensor, np.int16", [(t[i], np.int16(i)) for i in range(3)]),
        ("tensor, np.bool_", [(t[i], np.bool_(i)) for i in range(3)]),
        ("tensor, str", [(t[i], f"s{i}") for i in range(3)]),
        ("tensor, bytes", [(t[i], b"b") for i in range(3)]),
        ("tensor, int list", [[t[i], [i, i + 1]] for i in range(3)]),
        ("tensor, np.int64 then float", [(t[0], np.int64(1)), (t[1], 2.5), (t[2], 3)]),
        ("tensor, np.float32 then float", [(t[0], np.float32(1)), (t[1], 2.5)]),
        ("tensor, int64 + float32 scalars", [(t[0], np.int64(1)), (t[1], np.float32(2))]),
        ("tensor, True then np.uint8", [(t[0], True), (t[1], np.uint8(200))]),
        ("tensor, int then float", [(t[0], 1), (t[1], 2.5)]),
        ("tensor, float then int", [(t[0], 1.5), (t[1], 2)]),
        ("dict", [{"x": t[i], "y": i, "z": "s", "w": {"a": np.zeros(2), "b": i * 1.5}}
                  for i in range(3)]),
        ("OrderedDict", [collections.OrderedDict(t=t[i], n=i) for i in range(2)]),
        ("defaultdict", [collections.defaultdict(int, t=t[i], n=np.int8(i)) for i in range(2)]),
        ("namedtuple", [Point(t[i], i) for i in range(3)]),
        ("NamedTuple", [Pair(t[i], (i, np.float64(i))) for i in range(3)]),
        ("deep tensor", [({"a": [np.zeros(2), (i, t[i])]}, i) for i in range(3)]),
        ("TaggedList", [TaggedList([t[i], i]) for i in range(2)]),
        ("tensors only", t),
        ("int64 tensors", [torch.tensor(i) for i in range(3)]),
        ("Parameter", [(torch.nn.Parameter(torch.zeros(2)), 1)] * 2),
    ]


def _torch_mode_case_ids() -> list[str]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return ["no torch"]
    return [name for name, _ in _torch_mode_cases()]


@pytest.mark.parametrize("index", range(len(_torch_mode_case_ids())), ids=_torch_mode_case_ids())
def test_torch_mode_matches_torch_exactly(index: int) -> None:
    torch = pytest.importorskip("torch")
    _, batch = _torch_mode_cases()[index]
    theirs = torch.utils.data.default_collate(batch)
    ours = default_collate(batch)
    assert_equals_torch(ours, theirs)


def test_tensor_with_int_label_gives_an_int64_tensor() -> None:
    torch = pytest.importorskip("torch")
    batch = [(torch.randn(3), 1), (torch.randn(3), 0)]
    _, y = default_collate(batch)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.int64
    # What the drop-in user does next: torch's losses take it.
    torch.nn.functional.cross_entropy(torch.randn(2, 4), y)


def test_torch_mode_keeps_user_entries_of_the_map(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")

    def ints_as_lists(batch: Any, *, collate_fn_map: Any = None) -> Any:
        return list(batch)

    monkeypatch.setitem(default_collate_fn_map, int, ints_as_lists)
    _, y = default_collate([(torch.zeros(1), 1), (torch.zeros(1), 2)])
    assert y == [1, 2]  # the user's function, not torch's
    assert isinstance(default_collate([(torch.zeros(1), 1.5)] * 2)[1], torch.Tensor)


TORCH_MODE_ERRORS: list[tuple[str, Any]] = [
    ("string array", lambda t: [(t, np.array(["a"]))] * 2),
    ("list lengths", lambda t: [(t, [1, 2]), (t, [1])]),
    ("array shapes", lambda t: [(t, np.zeros(2)), (t, np.zeros(3))]),
    ("int overflow", lambda t: [(t, 2**63)] * 2),
    ("None", lambda t: [(t, None)] * 2),
    ("complex", lambda t: [(t, 1j)] * 2),
]


@pytest.mark.parametrize("make", [m for _, m in TORCH_MODE_ERRORS],
                         ids=[n for n, _ in TORCH_MODE_ERRORS])
def test_torch_mode_errors_match_torch(make: Any) -> None:
    torch = pytest.importorskip("torch")
    batch = make(torch.zeros(2))
    with pytest.raises(Exception) as theirs:
        torch.utils.data.default_collate(batch)
    with pytest.raises(Exception) as ours:
        default_collate(batch)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value) == str(theirs.value)


def test_column_batch_of_tensors_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    x = torch.randn(5, 3)
    y = torch.arange(5)
    columns = ColumnBatch([x, y, np.arange(5, dtype=np.int16), [0.5] * 5, ["a"] * 5])
    theirs = torch.utils.data.default_collate(list(columns))
    ours = default_collate(columns)
    assert_equals_torch(ours, theirs)
    assert ours[0] is x  # a dense tensor column is its stacked rows already


TORCH_CONVERT_CASES: list[Any] = [
    ("tensor, ndarray, int", lambda t: (t, np.zeros(2), 3)),
    ("dict", lambda t: {"t": t, "a": np.arange(3), "s": np.float32(1.5), "n": "x"}),
    ("namedtuple", lambda t: Point(t, np.int8(1))),
    ("string array", lambda t: [t, np.array(["a"])]),
    ("tensor", lambda t: t),
]


@pytest.mark.parametrize("make", [m for _, m in TORCH_CONVERT_CASES],
                         ids=[n for n, _ in TORCH_CONVERT_CASES])
def test_default_convert_with_tensors_matches_torch(make: Any) -> None:
    torch = pytest.importorskip("torch")
    sample = make(torch.ones(2))
    assert_equals_torch(default_convert(sample), torch.utils.data.default_convert(sample))


def test_numpy_data_stays_numpy_with_torch_imported() -> None:
    pytest.importorskip("torch")
    out = default_collate([(np.zeros(2), 1, {"a": 1.5})] * 2)
    assert isinstance(out[0], np.ndarray) and isinstance(out[1], np.ndarray)
    assert isinstance(out[2]["a"], np.ndarray)
    assert isinstance(default_convert((np.zeros(2), 1))[0], np.ndarray)


def test_int_batches_checked_whole_not_by_first_sample() -> None:
    # The all-int fast path must not take a batch whose later samples are other numbers.
    torch = pytest.importorskip("torch")
    for batch in ([1, 2, 3], [1, True, 3], [1, 2.5, 3], [1, np.int32(2)], [True, 1]):
        got = aloader.default_collate(list(batch))
        want = torch.utils.data.default_collate(list(batch))
        assert str(got.dtype) == str(want.dtype).removeprefix("torch."), batch
        assert got.tolist() == want.tolist(), batch
