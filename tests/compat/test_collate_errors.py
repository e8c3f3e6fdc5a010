"""Change only the import: default_collate's error for a batch of numbers holding
something else (a label that is sometimes None) has torch's type, and torch's message where
torch's tensor constructor finds no dtype ("Could not infer dtype of NoneType").
"""

from __future__ import annotations

import decimal
import fractions
from typing import Any

import numpy as np
import pytest

import aloader

torch = pytest.importorskip("torch")
tud = torch.utils.data

FIRSTS = {"int": 1, "bool": True, "np.int64": np.int64(1), "np.float32": np.float32(1),
          "0-d array": np.array(1.0), "float": 1.5}
ODD = {"None": None, "dict": {"a": 1}, "object": object(), "Decimal": decimal.Decimal(1),
       "Fraction": fractions.Fraction(1, 3), "str": "a", "list": [2], "array": np.arange(2)}


def _error(collate: Any, batch: list[Any]) -> tuple[str, str]:
    try:
        collate(batch)
    except Exception as exc:  # the type is what must match
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.parametrize("first", FIRSTS, ids=str)
def test_a_non_number_among_numbers_raises_torchs_type(first: str) -> None:
    for name, odd in ODD.items():
        if first == "float" and name == "Decimal":
            continue  # torch's float64 tensor takes a Decimal through __float__ (not ours)
        batch = [FIRSTS[first], odd]
        theirs = _error(tud.default_collate, batch)
        ours = _error(aloader.default_collate, batch)
        assert ours[0] == theirs[0], (first, name, theirs, ours)
        if theirs[1].startswith("Could not infer dtype"):
            assert ours[1] == theirs[1], (first, name)


def test_a_missing_label_through_the_loader_is_torchs_runtime_error() -> None:
    class Labels(tud.Dataset):  # type: ignore[misc]
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> Any:
            return None if i == 3 else i

    def first_error(module: Any) -> tuple[str, str]:
        try:
            list(module.DataLoader(Labels(), batch_size=2))
        except Exception as exc:
            return type(exc).__name__, str(exc).splitlines()[0]
        return "no error", ""

    assert first_error(aloader) == first_error(tud) == (
        "RuntimeError", "Could not infer dtype of NoneType")
