"""A ``collate_fn`` of the user's receives what torch's loader gives it: a ``list`` of samples
(tuples for a ``TensorDataset``), whatever aloader fetched the batch as. A column-wise batch
(:class:`aloader.ColumnBatch`, what a vectorised ``__getitems__`` makes) is for aloader's own
``default_collate``; a script's collate that sorts its batch in place (for packed sequences)
or checks ``isinstance(batch, list)`` must find a list.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aloader

torch = pytest.importorskip("torch")
tud = torch.utils.data


def _by_length_desc(batch: Any) -> Any:
    assert isinstance(batch, list)
    batch.sort(key=lambda sample: int(sample[1]), reverse=True)  # as for pack_padded_sequence
    return [tuple(int(v) for v in sample[0]) for sample in batch], type(batch[0]).__name__


def _identity(batch: Any) -> Any:
    return type(batch).__name__, [tuple(np.asarray(v).tolist() for v in s) for s in batch]


@pytest.mark.parametrize("collate_fn", [_by_length_desc, _identity])
@pytest.mark.parametrize("wrap", ["plain", "subset", "concat"])
def test_a_users_collate_fn_gets_a_list_of_samples_like_torchs(collate_fn: Any,
                                                               wrap: str) -> None:
    def batches(module: Any) -> list[Any]:
        ds = module.TensorDataset(torch.arange(14).reshape(7, 2), torch.tensor([3, 1, 4, 1, 5,
                                                                               9, 2]))
        if wrap == "subset":
            ds = module.Subset(ds, [6, 0, 5, 1, 4])
        elif wrap == "concat":
            ds = module.ConcatDataset([ds, ds])
        return list(module.DataLoader(ds, batch_size=3, collate_fn=collate_fn))

    assert batches(aloader) == batches(tud)


def test_default_collate_still_takes_the_columns_whole() -> None:
    x = np.arange(12).reshape(6, 2)
    batch = next(iter(aloader.DataLoader(aloader.ArrayDataset(x, np.arange(6)), batch_size=4)))
    assert [b.tolist() for b in batch] == [x[:4].tolist(), [0, 1, 2, 3]]
    assert isinstance(aloader.ArrayDataset(x).__getitems__([0, 1]), aloader.ColumnBatch)
