"""Change only the import: an unchanged torch script, run with torch and aloader.

No ``__main__`` guard, ``import torch`` at the top, lambdas and closures in the main module;
``random_split`` with a generator and fractions, ``StackDataset``, ``drop_last``, a list as
``sampler``, an ``IterableDataset`` sharded with ``get_worker_info()`` in ``__iter__`` over 3
workers with uneven shares, a ``worker_init_fn`` seeding numpy from ``torch.initial_seed()``,
``generator=`` with workers, persistent workers, several epochs. Every batch (values, dtypes,
types, nesting), ``len(loader)`` and the final global RNG states must be torch's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

GUARD = 240  # seconds: a hang guard, never a timing assertion

SCRIPT = textwrap.dedent(
    """
    import json, math, random, sys
    import numpy as np
    import torch
    {import_line}

    torch.manual_seed(3)
    random.seed(0)
    np.random.seed(0)

    def show(x):
        if isinstance(x, (torch.Tensor, np.ndarray)):  # numpy data gives numpy (documented)
            return [str(x.dtype).replace("torch.", ""), list(x.shape), x.tolist()]
        if isinstance(x, dict):
            return {{k: show(v) for k, v in x.items()}}
        if isinstance(x, (list, tuple)):
            return [type(x).__name__, [show(v) for v in x]]
        return [type(x).__name__, x]

    class Squares(Dataset):
        def __len__(self):
            return 23

        def __getitem__(self, i):
            return torch.tensor([i, i * i]), i, float(np.random.rand())

    class Shards(IterableDataset):
        def __init__(self, lens):
            self.lens = lens

        def __iter__(self):
            info = get_worker_info()
            wid = 0 if info is None else info.id
            for k in range(sum(self.lens) if info is None else self.lens[wid]):
                yield {{"x": torch.tensor([wid * 100 + k]), "n": float(np.random.rand()),
                        "p": random.random(), "t": float(torch.rand(1))}}

    init = lambda wid: np.random.seed(torch.initial_seed() % 2**32)
    out = []
    train, val = random_split(Squares(), [0.8, 0.2], generator=torch.Generator().manual_seed(42))
    out.append([list(train.indices), list(val.indices)])
    stacked = StackDataset(a=train, b=list(range(len(train))))
    for workers in (0, 2, 3):
        g = torch.Generator().manual_seed(7)
        loader = DataLoader(stacked, batch_size=4, shuffle=True, drop_last=True, generator=g,
                            num_workers=workers, persistent_workers=workers > 0,
                            worker_init_fn=init if workers else None)
        out.append(len(loader))
        for epoch in range(2):
            out.append([show(b) for b in loader])
        listed = DataLoader(val, sampler=[3, 0, 2, 2], batch_size=3, num_workers=workers)
        out.append([show(b) for b in listed])
        shards = Shards([5, 1, 3] if workers == 3 else [4, 2] if workers == 2 else [7])
        for batch_size in (2, None):
            stream = DataLoader(shards, batch_size=batch_size, num_workers=workers,
                                worker_init_fn=init if workers else None)
            out.append([show(b) for b in stream])
    out.append([torch.rand(2).tolist(), random.random(), float(np.random.rand())])
    print(json.dumps(out))
    """
)


def _run(tmp_path: Path, import_line: str, tag: str) -> Any:
    script = tmp_path / f"train_{tag}.py"
    script.write_text(SCRIPT.format(import_line=import_line))
    result = subprocess.run(
        [sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True,
        timeout=GUARD, env=os.environ.copy(), cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_unchanged_torch_script_with_splits_stacks_and_shards_matches_torch(
        tmp_path: Path) -> None:
    names = ("DataLoader, Dataset, IterableDataset, StackDataset, get_worker_info, "
             "random_split")
    theirs = _run(tmp_path, f"from torch.utils.data import {names}", "torch")
    ours = _run(tmp_path, f"from aloader import {names}", "aloader")
    assert ours == theirs
