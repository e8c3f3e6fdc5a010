"""Change only the import: what a dataset's ``__getitem__`` is handed.

torch's fetcher passes each sampler index on unchanged, so a ``__getitem__`` under torch's
``StackDataset`` or ``ConcatDataset`` sees python ints from the default samplers. aloader
carries a batch of indices as an int64 array on its vectorised paths; its elements
(``np.int64``) must not reach user code, where ``isinstance(i, int)`` or ``json.dumps(i)``
tells them apart.
"""

from __future__ import annotations

from typing import Any

import pytest

import aloader

torch = pytest.importorskip("torch")
tud = torch.utils.data


class Tags(tud.Dataset):  # type: ignore[misc]
    """Each sample names the type of the index it was asked for."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: Any) -> str:
        return f"{type(i).__name__}:{i}"


class Shifted(tud.ConcatDataset):  # type: ignore[misc]
    """A ConcatDataset subclass with its own ``__getitem__`` (its fetches are the user's)."""

    def __getitem__(self, i: Any) -> str:
        return f"{type(i).__name__}:{super().__getitem__(i)}"


WRAPPERS = {
    "stack": lambda m: m.StackDataset(Tags(), Tags()),
    "stack_of_dicts": lambda m: m.StackDataset(a=Tags(), b=Tags()),
    "concat": lambda m: m.ConcatDataset([Tags(), Tags()]),
    "stack_of_concat": lambda m: m.StackDataset(m.ConcatDataset([Tags(), Tags()]),
                                                m.ConcatDataset([Tags(), Tags()])),
    "concat_of_stack": lambda m: m.ConcatDataset([m.StackDataset(Tags()), m.StackDataset(Tags())]),
    "concat_subclass": lambda m: (Shifted if m is tud else _AloaderShifted)([Tags(), Tags()]),
}


class _AloaderShifted(aloader.ConcatDataset[Any]):
    def __getitem__(self, i: Any) -> str:
        return f"{type(i).__name__}:{super().__getitem__(i)}"


def _batches(module: Any, shape: str, **kw: Any) -> list[Any]:
    loader = module.DataLoader(WRAPPERS[shape](module), batch_size=3, **kw)
    return list(loader)


@pytest.mark.parametrize("shape", WRAPPERS)
@pytest.mark.parametrize("shuffle", [False, True])
def test_wrapped_getitem_gets_torchs_python_int_indices(shape: str, shuffle: bool) -> None:
    kw: Any = {"shuffle": True, "generator": torch.Generator().manual_seed(3)} if shuffle else {}
    ours = _batches(aloader, shape, **kw)
    if shuffle:
        kw["generator"] = torch.Generator().manual_seed(3)
    theirs = _batches(tud, shape, **kw)
    assert ours == theirs
    assert "int64" not in repr(ours)
