"""Change only the import: default_collate on numpy data against torch's.

A batch of numpy arrays of several dtypes (a dataset whose augmentation returns float32 for
some samples and the raw int32 for others) must get the dtype torch's ``torch.stack`` gives:
the higher kind keeps its own precision (int32 with float32 is float32), where numpy's own
promotion widens (float64). Torch's mixes that it refuses (uint16/32/64 with another integer
or a complex type) raise its RuntimeError.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

import aloader

torch = pytest.importorskip("torch")
tud = torch.utils.data

DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32,
          np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128]


def _outcome(collate: Any, batch: list[Any]) -> tuple[str, Any]:
    try:
        out = collate(batch)
    except Exception as exc:  # the type is what must match
        return "raised", type(exc).__name__
    return str(out.dtype).removeprefix("torch."), out.tolist()


@pytest.mark.parametrize("first", DTYPES, ids=lambda d: d.__name__)
def test_arrays_of_two_dtypes_get_torch_stacks_dtype(first: Any) -> None:
    for second in DTYPES:
        batch = [np.arange(3).astype(first), (np.arange(3) + 1).astype(second)]
        ours = _outcome(aloader.default_collate, batch)
        theirs = _outcome(tud.default_collate, batch)
        if theirs[0] == "raised" and np.promote_types(first, second) == first:
            # Documented: a batch numpy stacks in its first array's dtype is not checked
            # further (uint16/32/64 mixes torch refuses), so no per-array pass on every batch.
            assert ours == (np.dtype(first).name, batch_list(batch, first)), (first, second)
            continue
        assert ours == theirs, (first.__name__, second.__name__)


def batch_list(batch: list[Any], dtype: Any) -> Any:
    return np.stack(batch).astype(dtype).tolist()


def test_three_dtypes_fold_like_torch() -> None:
    for dtypes in itertools.permutations([np.int64, np.float16, np.uint8]):
        batch = [np.ones(2, dtype=d) for d in dtypes]
        assert _outcome(aloader.default_collate, batch) == _outcome(tud.default_collate, batch)


def test_large_int64_cast_once_to_float32_like_torch() -> None:
    # Cast element-wise to float32, not through float64 (2**60 + 1 rounds the same; 2**53 + 1
    # and friends would not survive a double rounding).
    big = np.array([2**60 + 2**36 + 1, -(2**55) - 3], dtype=np.int64)
    batch = [big, np.zeros(2, dtype=np.float32)]
    ours = aloader.default_collate(batch)
    assert ours.dtype == np.float32
    assert ours.tolist() == tud.default_collate(batch).tolist()


def test_dataset_with_mixed_array_dtypes_through_the_loader() -> None:
    class Augmented(aloader.Dataset[np.ndarray]):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> np.ndarray:
            raw = np.full(4, i, dtype=np.int32)
            return raw.astype(np.float32) / 2 if i % 2 else raw

    theirs = [b.numpy() for b in tud.DataLoader(Augmented(), batch_size=3)]
    ours = list(aloader.DataLoader(Augmented(), batch_size=3))
    assert [b.dtype for b in ours] == [b.dtype for b in theirs] == [np.float32] * 2
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_one_dtype_batches_are_unchanged() -> None:
    for dtype in (np.uint64, np.longdouble, np.uint16):
        batch = [np.ones(2, dtype=dtype)] * 3
        assert aloader.default_collate(batch).dtype == dtype


ZERO_D_MIXES = {
    "int16 scalar, float64 0-d": [np.int16(-4), np.array(3.0)],
    "float32 scalar, float64 0-d": [np.float32(1), np.array(2.0)],
    "float32 scalar, int64 0-d": [np.float32(1), np.array(2)],
    "int8 scalar, int64 0-d": [np.int8(1), np.array(2)],
    "float16 scalar, int32 0-d": [np.float16(1), np.array(3, dtype=np.int32)],
    "float64 scalar, float32 0-d, int": [np.float64(1), np.array(2, np.float32), 3],
    "int, float64 0-d": [1, np.array(2.5)],
    "int, int32 0-d": [7, np.array(2, dtype=np.int32)],
}


@pytest.mark.filterwarnings("ignore:Creating a tensor from a list of numpy")  # torch's own
@pytest.mark.parametrize("batch", ZERO_D_MIXES.values(), ids=ZERO_D_MIXES.keys())
def test_numbers_mixed_with_zero_d_arrays_like_torch(batch: list[Any]) -> None:
    # A sample that is sometimes np.float32(x), sometimes np.mean(...) (a 0-d array): torch
    # gathers both as numbers.
    theirs = _outcome(tud.default_collate, batch)
    assert theirs[0] != "raised"
    assert _outcome(aloader.default_collate, batch) == theirs


@pytest.mark.parametrize("batch", [
    [np.array(1, np.int32), 5e16],
    [np.array(1, np.int32), 5.5],
    [np.array(1, np.int32), 3],
    [np.array(1.5, np.float32), 5e16],
    [np.array(1, np.int8), 300],
    [np.array(1, np.int32), 2**40],
    [np.array(1, np.int32), True],
    [np.array(1, np.int64), 1 + 2j],
    [np.array(1, np.uint16), 3],
    [np.array(1, np.int32), 2**70],
    [np.array([1, 2], np.int32), 5.0],
    [np.array(1, np.int32), np.float64(2.5)],
    [np.array(2**40 + 1), 1.0],
], ids=repr)
def test_an_array_then_python_numbers_like_torch(batch: list[Any]) -> None:
    """After a first (0-d) array, torch's ``as_tensor`` makes each python number a tensor of
    its default dtype (float32 for a float), then stacks them with its promotion."""
    assert _outcome(aloader.default_collate, batch) == _outcome(tud.default_collate, batch)
