"""Change only the import: a tensor first met in a later sample of the batch.

A dataset that returns a 0-d tensor for some indices and a python int for others gives
batches whose first sample holds no tensor; torch's default_collate stacks them all the same,
and where it refuses them, raises its own error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aloader

torch = pytest.importorskip("torch")
tud = torch.utils.data


def _outcome(collate: Any, batch: list[Any]) -> tuple[Any, ...]:
    try:
        out = collate(batch)
    except Exception as exc:  # the type and message are what must match
        return ("raised", type(exc).__name__, str(exc))
    return ("ok", _describe(out))


def _describe(out: Any) -> Any:
    if isinstance(out, list):
        return [_describe(item) for item in out]
    if isinstance(out, tuple):  # strings come back as the batch's tuple
        return out
    return type(out).__name__, str(out.dtype), out.tolist()


BATCHES = [
    [1, torch.tensor(2)],
    [np.float32(1), torch.tensor(2)],
    [True, torch.tensor(2)],
    [(1, "a"), (torch.tensor(2), "b")],
    [1, torch.ones(2)],
]


@pytest.mark.parametrize("batch", BATCHES, ids=repr)
def test_a_batch_numpy_mode_refuses_gets_torchs_outcome(batch: list[Any]) -> None:
    assert _outcome(aloader.default_collate, batch) == _outcome(tud.default_collate, batch)


def test_a_dataset_mixing_ints_and_tensors_through_the_loader_like_torch() -> None:
    class Mixed(aloader.Dataset[Any]):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, index: int) -> Any:
            return (torch.tensor(index) if index % 3 else index), f"{index}"

    theirs = [(x.tolist(), s) for x, s in tud.DataLoader(Mixed(), batch_size=3)]
    ours = [(x.tolist(), s) for x, s in aloader.DataLoader(Mixed(), batch_size=3)]
    assert ours == theirs == [([0, 1, 2], ("0", "1", "2")), ([3, 4, 5], ("3", "4", "5"))]


def test_numpy_mode_errors_stand_without_a_tensor_or_under_a_users_map() -> None:
    with pytest.raises(TypeError, match="default_collate: batch must contain"):
        aloader.default_collate([1, "a"])
    with pytest.raises(TypeError, match="default_collate: batch must contain"):
        aloader.collate([1, torch.tensor(2)], collate_fn_map=aloader.default_collate_fn_map)
