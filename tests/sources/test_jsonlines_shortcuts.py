"""The HTTP JSON Lines path's decode and collate shortcuts give exactly what the plain ones do.

default_collate gathers a column of python ints with ``np.fromiter`` (no dtype discovery):
the same int64 array as ``np.array`` and torch's tensor, the same errors for ints beyond
int64, and the other paths (bools, mixed numbers) untouched.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from aloader import default_collate
from aloader._demo import make_jsonl_shards
from aloader._stats import SourceStats
from aloader.sources._formats import BadRecords, JsonLinesDecoder


def _records(shards: int = 2, per_shard: int = 300) -> list[Any]:
    out: list[Any] = []
    for body in make_jsonl_shards(shards, per_shard).values():
        decoder = JsonLinesDecoder("x", BadRecords(False, SourceStats()), 1 << 20)
        out += decoder.feed(body)
        out += decoder.finish()
    return out


def _assert_same(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    if isinstance(theirs, np.ndarray):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert ours.flags.c_contiguous and ours.flags.writeable and ours.flags.owndata
        np.testing.assert_array_equal(ours, theirs)
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs)
        for key in theirs:
            _assert_same(ours[key], theirs[key])
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            _assert_same(a, b)
    else:
        assert ours == theirs


def test_the_workloads_batches_are_numpys_arrays() -> None:
    records = _records()
    batch = default_collate(records[:256])
    expected = {
        "id": np.array([r["id"] for r in records[:256]], dtype=np.int64),
        "shard": np.array([r["shard"] for r in records[:256]], dtype=np.int64),
        "label": np.array([r["label"] for r in records[:256]], dtype=np.int64),
        "text": [r["text"] for r in records[:256]],
        "x": [np.array([r["x"][i] for r in records[:256]], dtype=np.float64) for i in range(4)],
    }
    _assert_same(batch, expected)


def test_the_workloads_batches_match_torch() -> None:
    torch = pytest.importorskip("torch")
    records = _records()
    ours = default_collate(records[:100])
    theirs = torch.utils.data.default_collate(records[:100])
    for key in ("id", "shard", "label"):
        assert ours[key].dtype == theirs[key].numpy().dtype
        np.testing.assert_array_equal(ours[key], theirs[key].numpy())
    assert ours["text"] == theirs["text"]
    for a, b in zip(ours["x"], theirs["x"], strict=True):
        np.testing.assert_array_equal(a, b.numpy())
        assert a.dtype == b.numpy().dtype


@pytest.mark.parametrize("batch", [
    [0], [1, -2, 3], [2**63 - 1, -(2**63)], tuple(range(300)),
])
def test_int_columns(batch: Any) -> None:
    out = default_collate(batch)
    expected = np.array(list(batch)).astype(np.int64)
    _assert_same(out, expected)


@pytest.mark.parametrize("batch", [[2**63], [1, -(2**63) - 1], [0, 2**64], [5, 2**70]])
def test_int_overflow_is_torchs_error(batch: list[int]) -> None:
    with pytest.raises(ValueError, match="^Overflow when unpacking long long$") as info:
        default_collate(batch)
    torch = pytest.importorskip("torch")
    with pytest.raises(Exception) as theirs:  # torch's own type and message
        torch.utils.data.default_collate(batch)
    assert type(info.value) is type(theirs.value)
    assert str(info.value) == str(theirs.value)


@pytest.mark.parametrize(("batch", "dtype"), [
    ([True, False], np.bool_), ([1, True], np.int64), ([True, 2], np.int64),
    ([1, 2.5], np.float32), ([1, np.int8(2)], np.int64),
])
def test_other_number_columns_keep_their_path(batch: list[Any], dtype: Any) -> None:
    assert default_collate(batch).dtype == np.dtype(dtype)


def test_records_of_json_lines_collate_like_json_loads() -> None:
    # The decoder's records and json.loads' give the same batches.
    records = _records(1, 50)
    body = next(iter(make_jsonl_shards(1, 50).values()))
    loaded = [json.loads(line) for line in body.splitlines()]
    _assert_same(default_collate(records), default_collate(loaded))
