"""Attack default_collate / default_convert against torch's own, case by case.

Where a sample holds a tensor the whole batch must be torch's, exactly (types, dtypes, nesting);
where it holds none, aloader's documented numpy rule applies: the batch is what torch's would
be with each tensor an ndarray of the same dtype and values (``_diff`` in
test_torch_differential compares that way). Errors keep torch's type (and message where
README says they are torch's).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
from test_torch_differential import _diff

import aloader

pytestmark = pytest.mark.hostile

torch = pytest.importorskip("torch")
tud = torch.utils.data

Point = collections.namedtuple("Point", "x y")


def _torch_collate(batch: list[Any]) -> Any:
    return tud.default_collate(batch)


CASES: dict[str, list[Any]] = {
    "dict": [{"a": 1, "b": 2.5, "c": "s"}, {"a": 3, "b": 4.0, "c": "t"}],
    "nested dict": [{"a": {"b": [1, 2], "c": (3.0,)}}, {"a": {"b": [4, 5], "c": (6.0,)}}],
    "namedtuple": [Point(1, 2.0), Point(3, 4.0)],
    "namedtuple of arrays": [Point(np.zeros(2, np.float32), 1), Point(np.ones(2, np.float32), 2)],
    "nested lists and tuples": [[(1, 2), [3.0, (4,)]], [(5, 6), [7.0, (8,)]]],
    "numpy float32 scalars": [np.float32(1.5), np.float32(2.5)],
    "numpy uint8 scalars": [np.uint8(1), np.uint8(255)],
    "numpy bool scalars": [np.bool_(True), np.bool_(False)],
    "numpy int scalars of two widths": [np.int32(1), np.int64(2)],
    "0-d float arrays": [np.array(1.5), np.array(2.5)],
    "0-d int16 arrays": [np.array(1, np.int16), np.array(2, np.int16)],
    "bools": [True, False, True],
    "int64 max": [2**63 - 1, 0],
    "floats": [1.0, 2.5, -0.0],
    "ints and floats": [1, 2.5],
    "bool and int": [True, 2],
    "numpy and python ints": [np.int16(1), 7],
    "strings": ["a", "bc"],
    "bytes": [b"a", b"bc"],
    "float16 arrays": [np.arange(3, dtype=np.float16)] * 2,
    "tensor then array": [torch.tensor([1.0, 2.0]), np.array([3.0, 4.0])],  # torch refuses
    "array then tensor": [np.array([3.0, 4.0], np.float32), torch.tensor([1.0, 2.0])],
    "tensor with int label": [(torch.zeros(2), 1), (torch.ones(2), 2)],
    "tensor with numpy label": [(torch.zeros(1), np.int64(3)), (torch.zeros(1), np.int64(4))],
    "dict of tensor, array, float, str": [
        {"x": torch.zeros(2), "y": np.ones(2, np.float32), "z": 1.5, "s": "a"},
        {"x": torch.ones(2), "y": np.zeros(2, np.float32), "z": 2.5, "s": "b"},
    ],
    "namedtuple with a tensor": [Point(torch.tensor(1), 2), Point(torch.tensor(3), 4)],
    "ordered dict": [collections.OrderedDict(b=1, a=2)] * 2,
}


@pytest.mark.parametrize("name", list(CASES))
def test_default_collate_matches_torch(name: str) -> None:
    """The same batch, or (torch refusing it) the same error type and message."""
    batch = CASES[name]
    try:
        theirs = _torch_collate(batch)
    except Exception as exc:
        ours_error = _error(aloader.default_collate, batch)
        assert (type(ours_error), str(ours_error)) == (type(exc), str(exc))
        return
    ours = aloader.default_collate(batch)
    assert _diff(theirs, ours) is None, _diff(theirs, ours)


def _error(fn: Any, batch: Any) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(batch)
    return info.value


@pytest.mark.parametrize(
    "batch",
    [[None, None], [object(), object()], [{"a": None}, {"a": None}], [(None,), (None,)]],
    ids=["none", "object", "none in a dict", "none in a tuple"],
)
def test_unsupported_elements_raise_torchs_type_error(batch: list[Any]) -> None:
    theirs = _error(_torch_collate, batch)
    ours = _error(aloader.default_collate, batch)
    assert type(ours) is type(theirs) is TypeError
    assert str(ours) == str(theirs)


@pytest.mark.parametrize(
    ("batch", "found"),
    [([1, [2]], "list"), ([1.0, "a"], "str"), ([True, b"x"], "bytes"),
     ([np.int64(1), "a"], "str")],
)
def test_numbers_then_a_non_number_name_the_intruder(batch: list[Any], found: str) -> None:
    """torch fails these inside ``torch.tensor(batch)`` with a TypeError of its own ("new():
    invalid data type 'str'"); aloader raises collate's own TypeError naming the type, the
    message torch gives when the first element is the intruder (tests/data/test_collate.py). An
    intruder torch infers no dtype for (None) is torch's RuntimeError, message and all
    (tests/compat/test_collate_errors.py)."""
    with pytest.raises(TypeError, match=f"found <class '{found}'>"):
        aloader.default_collate(batch)
    with pytest.raises((TypeError, RuntimeError)):
        _torch_collate(batch)


@pytest.mark.parametrize(
    "batch",
    [[2**63, 0], [-(2**63) - 1, 0], [2**64, 1]],
    ids=["int64 max + 1", "int64 min - 1", "2**64"],
)
def test_ints_beyond_int64_fail_like_torch(batch: list[int]) -> None:
    theirs = _error(_torch_collate, batch)
    ours = _error(aloader.default_collate, batch)
    assert (type(ours), str(ours)) == (type(theirs), str(theirs))


@pytest.mark.parametrize(
    "batch",
    [
        [np.zeros(2), np.zeros(3)],
        [np.zeros((2, 2)), np.zeros((2, 2)), np.zeros((2, 3))],
        [torch.zeros(2), torch.zeros(3)],
    ],
    ids=["arrays", "third array", "tensors"],
)
def test_unequal_shapes_raise_torchs_runtime_error(batch: list[Any]) -> None:
    theirs = _error(_torch_collate, batch)
    ours = _error(aloader.default_collate, batch)
    assert type(ours) is type(theirs) is RuntimeError
    # torch's text names the shapes and the entry; aloader says "array" for numpy data
    # (tests/data/test_collate.py pins that wording).
    assert "stack expects each" in str(ours) and "at entry" in str(ours)


def test_unequal_lengths_and_missing_keys_fail_like_torch() -> None:
    for batch in ([[1, 2], [1]], [{"a": 1}, {"b": 2}], []):
        theirs = _error(_torch_collate, batch)
        ours = _error(aloader.default_collate, batch)
        assert type(ours) is type(theirs), batch


CONVERT: dict[str, Any] = {
    "tensor": torch.arange(3),
    "dict of tensors and ints": {"a": torch.zeros(2), "b": 3, "c": "s"},
    "namedtuple": Point(torch.tensor(1.0), 2),
    "list of tuples": [(torch.tensor(1), 2.0), (torch.tensor(3), 4.0)],
    "int": 5,
    "str": "text",
    "bytes": b"raw",
    "none": None,
}


@pytest.mark.parametrize("name", list(CONVERT))
def test_default_convert_matches_torch(name: str) -> None:
    data = CONVERT[name]
    theirs = tud.default_convert(data)
    ours = aloader.default_convert(data)
    assert _diff(theirs, ours) is None, _diff(theirs, ours)


@pytest.mark.parametrize(
    "data",
    [np.float32(1.5), np.bool_(True), np.arange(3, dtype=np.uint8), np.array(2.0),
     [np.int32(1), 2], {"a": np.ones(2)}],
    ids=["float32", "bool", "uint8 array", "0-d array", "list", "dict"],
)
def test_default_convert_of_numpy_is_numpy_with_torchs_values(data: Any) -> None:
    """README: numpy data stays numpy: where torch makes a tensor of an ndarray or a numpy
    scalar, aloader keeps it, with the same dtype and values."""
    theirs = tud.default_convert(data)
    ours = aloader.default_convert(data)

    def same(t: Any, o: Any) -> bool:
        if isinstance(t, torch.Tensor):
            return (isinstance(o, (np.ndarray, np.generic))
                    and str(t.dtype).removeprefix("torch.") == o.dtype.name
                    and np.asarray(o).tolist() == t.tolist())
        if isinstance(t, dict):
            return type(o) is type(t) and list(o) == list(t) and all(same(t[k], o[k]) for k in t)
        if isinstance(t, (list, tuple)):
            return type(o) is type(t) and len(o) == len(t) and all(map(same, t, o))
        return bool(type(o) is type(t) and o == t)

    assert same(theirs, ours), (theirs, ours)


class TensorSamples(tud.Dataset):  # type: ignore[misc]
    """Samples mixing a tensor with every other kind torch's collate turns into tensors."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> Any:
        return {
            "x": torch.full((2, 3), float(i)),
            "label": i,
            "weight": i / 4,
            "flag": i % 2 == 0,
            "arr": np.arange(3, dtype=np.int16) + i,
            "scalar": np.float32(i),
            "name": f"s{i}",
            "pair": Point(torch.tensor([i]), i * 2),
        }


@pytest.fixture(scope="module")
def tensor_batches() -> tuple[list[Any], list[Any]]:
    """The same epoch from torch and from aloader, with two workers each (collated there)."""
    data = TensorSamples()
    theirs = list(tud.DataLoader(data, batch_size=4, num_workers=2))
    ours = list(aloader.DataLoader(data, batch_size=4, num_workers=2))
    return theirs, ours


def test_tensor_batches_from_workers_are_torchs(tensor_batches: tuple[list[Any], list[Any]]
                                                ) -> None:
    theirs, ours = tensor_batches
    assert len(ours) == len(theirs) == 3
    for t, o in zip(theirs, ours, strict=True):
        assert _diff(t, o) is None, _diff(t, o)
        assert isinstance(o["x"], torch.Tensor) and isinstance(o["arr"], torch.Tensor)


def test_tensor_batches_from_workers_are_writable_and_independent(
        tensor_batches: tuple[list[Any], list[Any]]) -> None:
    """A batch that crossed from a worker (out of band / shared memory) is an ordinary tensor:
    writable, and not aliased to another batch."""
    _, ours = tensor_batches
    first, second = ours[0]["x"], ours[1]["x"]
    before = second.clone()
    first.add_(100)
    assert torch.equal(second, before)
    assert float(first[0, 0, 0]) == 100.0
