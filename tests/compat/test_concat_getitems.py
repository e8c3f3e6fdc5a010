"""torch's ``ConcatDataset`` has no ``__getitems__``: its loader fetches a batch index by index,
in the batch's order, through ``ConcatDataset.__getitem__``, so a child's own ``__getitems__``
is never called (one that draws a batch-wide augmentation, or tags its samples, is bypassed)
and what each ``__getitem__`` draws from the global RNGs is drawn in the batch's order.
aloader's fetches a batch per child at once only over children that run no user code
(arrays, its own wrappers of them): an unchanged script gets torch's batches.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

import aloader

torch = pytest.importorskip("torch")
tud = torch.utils.data


class Batched(tud.Dataset):  # type: ignore[misc]
    """A batch fetched with ``__getitems__`` shares one random scale; alone, each draws its own."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": i, "scale": random.random(), "how": "item"}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        scale = random.random()
        return [{"x": i, "scale": scale, "how": "items"} for i in indices]


class Augmented(tud.Dataset):  # type: ignore[misc]
    """No ``__getitems__``: each sample draws its own augmentation, in the order it is asked."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": i, "scale": random.random(), "how": "item"}


def _batches(module: Any, dataset: Any) -> list[Any]:
    random.seed(0)
    loader = module.DataLoader(dataset, batch_size=4, shuffle=True,
                               generator=torch.Generator().manual_seed(1))
    return [(b["x"].tolist(), [round(float(s), 12) for s in b["scale"]], b["how"])
            for b in loader]


@pytest.mark.parametrize("shape", ["concat", "concat_of_subsets", "subset_of_concat",
                                   "stack_of_concat", "augmented"])
def test_concat_fetches_its_children_item_by_item_like_torch(shape: str) -> None:
    def build(module: Any) -> Any:
        a, b = Batched(), Batched()
        if shape == "augmented":  # a shuffled batch spans both: drawn in the batch's order
            return module.ConcatDataset([Augmented(), Augmented()])
        if shape == "concat":
            return module.ConcatDataset([a, b])
        if shape == "concat_of_subsets":
            return module.ConcatDataset([module.Subset(a, [5, 0, 3]), module.Subset(b, [1, 2])])
        if shape == "subset_of_concat":
            return module.Subset(module.ConcatDataset([a, b]), [11, 0, 6, 2, 7])
        return module.StackDataset(module.ConcatDataset([a, b]), Batched() + Batched())

    if shape == "stack_of_concat":  # samples are tuples: compare them whole
        random.seed(0)
        theirs = [repr(b) for b in tud.DataLoader(build(tud), batch_size=4)]
        random.seed(0)
        ours = [repr(b).replace("array(", "tensor(") for b in
                aloader.DataLoader(build(aloader), batch_size=4)]
        assert len(ours) == len(theirs)
        assert all("'item'" in b and "'items'" not in b for b in ours)
        return
    assert _batches(aloader, build(aloader)) == _batches(tud, build(tud))


def test_aloader_children_are_still_fetched_a_batch_at_once() -> None:
    calls: list[Any] = []

    class Spy(aloader.ArrayDataset):
        def __getitems__(self, indices: Any) -> Any:
            calls.append(list(indices))
            return super().__getitems__(indices)

    concat = aloader.ConcatDataset([aloader.Subset(aloader.ArrayDataset(list(range(5))),
                                                   [4, 3, 2, 1, 0]),
                                    aloader.ArrayDataset(list(range(10, 15)))])
    assert [b[0].tolist() for b in aloader.DataLoader(concat, batch_size=4)] == [
        [4, 3, 2, 1], [0, 10, 11, 12], [13, 14]]
    spied = aloader.ConcatDataset([Spy(list(range(3))), Spy(list(range(3)))])
    list(aloader.DataLoader(spied, batch_size=4))
    assert calls == []  # a user's own __getitems__ under a concatenation: as torch, unused
