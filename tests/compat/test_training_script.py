"""An unchanged PyTorch training script, with only its import changed, run as a user runs it.

The script has what real scripts have and what broke aloader before: ``import torch`` at the
top, no ``if __name__ == "__main__":`` guard, a dataset class and lambdas defined in the main
module, a ``torch.Generator``, tensors beside Python ``int`` labels, per-worker randomness,
several epochs, workers off and on. Each variant runs in a fresh interpreter and prints what it
saw; the test compares aloader with torch (types, dtypes, shapes, coverage of every sample) and
aloader with itself (the same seed gives the same sequence of epochs, run after run).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

GUARD = 180  # seconds: a hang guard, never a timing assertion

SCRIPT = textwrap.dedent(
    """
    import json
    import os
    import sys

    import torch
    {import_line}

    torch.manual_seed(0)  # the main process's draws (num_workers=0) repeat run to run
    with open(os.environ["RUNS_FILE"], "a") as runs:  # counts executions of the main module
        runs.write("ran\\n")

    class Noisy(Dataset):
        def __init__(self, n):
            self.x = torch.arange(n, dtype=torch.float32).reshape(n, 1).repeat(1, 3)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, index):
            noise = torch.rand(1).item()  # per-worker RNG: seeded per worker, as torch does
            return self.x[index] + 0 * noise, index, {{"noise": noise, "w": index % 3 == 0}}

    to_pair = lambda batch: (torch.stack([s[0] for s in batch]),
                             torch.tensor([s[1] for s in batch]))
    seen_workers = []
    init = lambda worker_id: seen_workers.append(worker_id)

    out = {{"runs_file": os.environ["RUNS_FILE"], "epochs": {{}}}}
    for workers in (0, 2):
        g = torch.Generator()
        g.manual_seed(1234)
        main_loader = DataLoader(Noisy(50), batch_size=8, shuffle=True, generator=g,
                                 num_workers=workers, worker_init_fn=init if workers else None)
        epochs = []
        for epoch in range(3):
            batches = []
            for x, y, extra in main_loader:
                loss = torch.nn.functional.mse_loss(x[:, 0], y.to(torch.float32))
                batches.append({{
                    "x": [type(x).__name__, str(x.dtype), list(x.shape)],
                    "y": [type(y).__name__, str(y.dtype), y.tolist()],
                    "noise": [type(extra["noise"]).__name__, str(extra["noise"].dtype),
                              [round(v, 6) for v in extra["noise"].tolist()]],
                    "w": [type(extra["w"]).__name__, str(extra["w"].dtype)],
                    "loss": float(loss),
                }})
            epochs.append(batches)
        out["epochs"][str(workers)] = epochs
        pairs = DataLoader(Noisy(10), batch_size=4, collate_fn=to_pair, num_workers=workers)
        out.setdefault("pairs", {{}})[str(workers)] = [
            [type(a).__name__, b.tolist()] for a, b in pairs
        ]
    print(json.dumps(out))
    """
)


def _run(tmp_path: Path, import_line: str, tag: str, source: str = SCRIPT) -> Any:
    script = tmp_path / f"train_{tag}.py"
    script.write_text(source.format(import_line=import_line))
    runs = tmp_path / f"runs_{tag}.txt"
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=GUARD,
        env={**__import__("os").environ, "RUNS_FILE": str(runs)},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # The main module ran once: no worker re-ran it (no `__main__` guard in the script).
    assert runs.read_text().count("ran") == 1
    return json.loads(result.stdout.strip().splitlines()[-1])


def _shape_of(epochs: list[list[dict[str, Any]]]) -> list[list[Any]]:
    """What must equal torch's: the types, dtypes and shapes of every batch."""
    return [
        [[b["x"], b["y"][:2], b["noise"][:2], b["w"]] for b in batches] for batches in epochs
    ]


def _orders(epochs: list[list[dict[str, Any]]]) -> list[list[int]]:
    return [[i for b in batches for i in b["y"][2]] for batches in epochs]


def test_unchanged_torch_script_runs_and_matches_torch(tmp_path: Path) -> None:
    theirs = _run(tmp_path, "from torch.utils.data import DataLoader, Dataset", "torch")
    ours = _run(tmp_path, "from aloader import DataLoader, Dataset", "aloader")
    again = _run(tmp_path, "from aloader import DataLoader, Dataset", "aloader_again")

    for workers in ("0", "2"):
        epochs = ours["epochs"][workers]
        # Tensors stay tensors, with torch's dtypes (int labels int64, floats float64, bools).
        assert _shape_of(epochs) == _shape_of(theirs["epochs"][workers])
        orders = _orders(epochs)
        # Every sample once per epoch, a new order each epoch.
        assert all(sorted(order) == list(range(50)) for order in orders)
        assert len({tuple(order) for order in orders}) == 3
        # The same seed gives the same epochs, contents included (per-worker RNG too).
        assert epochs == again["epochs"][workers]
        assert ours["pairs"][workers] == theirs["pairs"][workers]
    # Workers or not, the sampler's sequence of orders is the same.
    assert _orders(ours["epochs"]["0"]) == _orders(ours["epochs"]["2"])


# torch.manual_seed and no generator: every batch equal to torch's, augmentations included ------
EXACT = textwrap.dedent(
    """
    import json
    import os

    import torch
    {import_line}

    with open(os.environ["RUNS_FILE"], "a") as runs:
        runs.write("ran\\n")
    torch.manual_seed(0)

    class Augmented(Dataset):
        def __init__(self):
            self.x = torch.randn(40, 3)

        def __len__(self):
            return 40

        def __getitem__(self, i):
            return self.x[i] + torch.rand(3), i, float(i) / 2, {{"even": i % 2 == 0}}

    out = []
    for workers in (0, 2):
        data = Augmented()
        for persistent in ((False, True) if workers else (False,)):
            loader = DataLoader(data, batch_size=6, shuffle=True, num_workers=workers,
                                persistent_workers=persistent)
            for epoch in range(3):
                for x, i, half, extra in loader:
                    out.append([workers, persistent, epoch,
                                [round(v, 5) for v in x.flatten().tolist()], i.tolist(),
                                [str(t.dtype) for t in (x, i, half, extra["even"])]])
        pairs = TensorDataset(torch.arange(20.0), torch.arange(20))
        for batch in DataLoader(pairs, batch_size=7, shuffle=True, num_workers=workers):
            out.append([workers, [t.tolist() for t in batch], [str(t.dtype) for t in batch]])
    print(json.dumps(out))
    """
)


def test_torch_manual_seed_script_gives_torchs_exact_batches(tmp_path: Path) -> None:
    theirs = _run(tmp_path, "from torch.utils.data import DataLoader, Dataset, TensorDataset",
                  "torch", EXACT)
    ours = _run(tmp_path, "from aloader import DataLoader, Dataset, TensorDataset",
                "aloader", EXACT)
    # The sampler's orders, the workers' seeds (so their torch.rand draws), round-robin
    # assignment, persistent workers' epochs, dtypes: all torch's.
    assert ours == theirs


# torch's own dataset classes and get_worker_info, with only the DataLoader swapped -------------
STREAM = textwrap.dedent(
    """
    import json
    import os

    import torch
    from torch.utils.data import ChainDataset, IterableDataset, get_worker_info
    {import_line}

    with open(os.environ["RUNS_FILE"], "a") as runs:
        runs.write("ran\\n")

    class Stream(IterableDataset):  # torch's class: it inherits Dataset.__getitem__
        def __init__(self, start, stop):
            self.start, self.stop = start, stop

        def __iter__(self):
            info = get_worker_info()  # torch's function, as in torch's own docs
            if info is None:
                return iter(range(self.start, self.stop))
            return iter(range(self.start + info.id, self.stop, info.num_workers))

    out = []
    for workers in (0, 2):
        for data in (Stream(0, 23), ChainDataset([Stream(0, 5), Stream(100, 111)])):
            loader = DataLoader(data, batch_size=4, num_workers=workers)
            for epoch in range(2):
                out.append([workers, epoch, [torch.as_tensor(b).tolist() for b in loader]])
    print(json.dumps(out))
    """
)


def test_torch_iterable_dataset_and_get_worker_info_with_aloader_loader(tmp_path: Path) -> None:
    """A torch ``IterableDataset`` subclass is a stream (not a map that has no ``len``), and
    torch's ``get_worker_info()`` answers inside aloader's workers, so each worker reads its
    own share: every sample exactly once, in torch's batches."""
    theirs = _run(tmp_path, "from torch.utils.data import DataLoader", "torch", STREAM)
    ours = _run(tmp_path, "from aloader import DataLoader", "aloader", STREAM)
    assert ours == theirs
    for _workers, _epoch, batches in ours:
        flat = sorted(i for batch in batches for i in batch)
        assert flat in (list(range(23)), [*range(5), *range(100, 111)])
