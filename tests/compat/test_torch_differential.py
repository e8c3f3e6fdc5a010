"""aloader's DataLoader against torch's on random argument combinations (drawn from a fixed
seed), with torch's own dataset and sampler classes, as a script that swapped only its
``DataLoader`` import would use them: the same batches (values, types, dtypes, nesting), the
same ``len()``, the same error types, epoch after epoch. Numpy arrays from aloader stand for
torch's tensors only where the samples hold no tensor (aloader's documented numpy-in, numpy-out
rule); everything else must be identical.
"""

from __future__ import annotations

import collections
import random
from typing import Any

import numpy as np
import pytest

import aloader

torch = pytest.importorskip("torch")
tud = pytest.importorskip("torch.utils.data")

Pair = collections.namedtuple("Pair", "a b")


class MapData(tud.Dataset):  # type: ignore[misc]
    def __init__(self, n: int, kind: str) -> None:
        self.n, self.kind = n, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        kind = self.kind
        if kind == "tensor":
            return torch.full((3,), float(i))
        if kind == "tuple":
            return torch.tensor(i), i, float(i) * 0.5, f"s{i}"
        if kind == "dict":
            return {"x": torch.tensor([i, i + 1]), "y": i % 3, "name": f"n{i}",
                    "arr": np.arange(2) + i}
        if kind == "int":
            return i
        if kind == "nested":
            return {"a": [torch.tensor(i), {"b": (i, i * 2.0)}], "c": True}
        return Pair(i, torch.tensor(float(i)))


class StreamData(tud.IterableDataset):  # type: ignore[misc]
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))


def _diff(theirs: Any, ours: Any, path: str = "") -> str | None:
    """Where ``ours`` differs from ``theirs`` (None: the same)."""
    if isinstance(theirs, torch.Tensor) and isinstance(ours, np.ndarray):
        ours = torch.from_numpy(ours.copy())  # numpy data gives numpy (see the module doc)
    if isinstance(theirs, torch.Tensor):
        if not isinstance(ours, torch.Tensor) or theirs.dtype != ours.dtype or (
            theirs.shape != ours.shape or not torch.equal(theirs, ours)
        ):
            return f"{path}: {theirs!r} != {ours!r}"
        return None
    if type(theirs) is not type(ours):
        return f"{path}: {type(theirs).__name__} != {type(ours).__name__}"
    if isinstance(theirs, np.ndarray):
        same = theirs.dtype == ours.dtype and np.array_equal(theirs, ours)
        return None if same else f"{path}: {theirs!r} != {ours!r}"
    if isinstance(theirs, dict):
        if list(theirs) != list(ours):
            return f"{path}: keys {list(theirs)} != {list(ours)}"
        return next((d for k in theirs if (d := _diff(theirs[k], ours[k], f"{path}[{k!r}]"))),
                    None)
    if isinstance(theirs, (list, tuple)):
        if len(theirs) != len(ours):
            return f"{path}: {len(theirs)} items != {len(ours)}"
        return next((d for i, (a, b) in enumerate(zip(theirs, ours, strict=True))
                     if (d := _diff(a, b, f"{path}[{i}]"))), None)
    return None if theirs == ours else f"{path}: {theirs!r} != {ours!r}"


def _config(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["tensor", "tuple", "dict", "int", "nested", "pair", "stream"])
    config: dict[str, Any] = {"kind": kind, "n": rng.choice([1, 5, 17, 64]), "kw": {},
                              "seed": rng.randrange(100)}
    kw = config["kw"]
    if kind != "stream" and rng.random() < 0.15:
        kw["batch_sampler"] = rng.choice([1, 3, 8])
        config["drop"] = rng.random() < 0.5
    else:
        kw["batch_size"] = rng.choice([None, 1, 3, 8, 100])
        if kw["batch_size"] is not None and rng.random() < 0.4:
            kw["drop_last"] = True
        if kind != "stream":
            draw = rng.random()
            if draw < 0.3:
                kw["shuffle"] = True
                if rng.random() < 0.5:
                    kw["generator"] = rng.randrange(1000)
            elif draw < 0.45:
                kw["sampler"] = rng.choice(["random", "replacement", "weighted", "subset"])
    if rng.random() < 0.2:
        kw["collate_fn"] = "identity"
    return config


def _epochs(module: Any, config: dict[str, Any], epochs: int = 3) -> list[Any]:
    n = config["n"]
    data = StreamData(n) if config["kind"] == "stream" else MapData(n, config["kind"])
    kw = dict(config["kw"])
    seeded = torch.Generator().manual_seed
    if "generator" in kw:
        kw["generator"] = seeded(kw["generator"])
    sampler = kw.get("sampler")
    if sampler == "random":
        kw["sampler"] = tud.RandomSampler(data, generator=seeded(5))
    elif sampler == "replacement":
        kw["sampler"] = tud.RandomSampler(data, replacement=True, num_samples=7,
                                          generator=seeded(5))
    elif sampler == "weighted":
        kw["sampler"] = tud.WeightedRandomSampler([1.0 + i % 3 for i in range(n)], 9,
                                                  generator=seeded(5))
    elif sampler == "subset":
        kw["sampler"] = tud.SubsetRandomSampler(list(range(0, n, 2)), generator=seeded(5))
    if "batch_sampler" in kw:
        kw["batch_sampler"] = tud.BatchSampler(tud.RandomSampler(data, generator=seeded(9)),
                                               kw["batch_sampler"], config["drop"])
    if kw.get("collate_fn") == "identity":
        kw["collate_fn"] = lambda batch: batch
    torch.manual_seed(config["seed"])  # shuffle=True without a generator draws from torch's
    loader = module.DataLoader(data, **kw)
    try:
        out: list[Any] = [len(loader)]
    except TypeError as exc:
        out = [type(exc).__name__]
    for _ in range(epochs):
        out.append(list(loader))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_configurations_give_torchs_batches(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(12):
        config = _config(rng)
        difference = _diff(_epochs(tud, config), _epochs(aloader, config))
        assert difference is None, f"{config}: {difference}"
