"""Attack worker processes against torch's own DataLoader: the same dataset, sampler and
generator must give the same batches, worker by worker (``get_worker_info()``, the seeds torch
sets in ``random``, numpy and torch), epoch after epoch, with persistent workers or not; the
same errors (types and messages) for a failing dataset, ``worker_init_fn``, a killed worker or
a stuck one; and exactly-once delivery after a ``break`` and with ``in_order=False``.

torch seeds ``random`` and torch with ``base_seed + id`` and numpy's global RNG from
``_generate_state(base_seed, id)`` in each worker; aloader promises the same (README: "seeds
``base_seed + id``"; ``aloader.workers._worker.seed_worker``), so the draws are compared directly.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aloader

pytestmark = pytest.mark.hostile

torch = pytest.importorskip("torch")
tud = torch.utils.data

GUARD = 60  # a hang guard (seconds), never a timing assertion
N = 23


class Probe(tud.Dataset):  # type: ignore[misc]
    """Each sample says who made it and what the worker's global RNGs gave."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        info = tud.get_worker_info()  # torch's own function, as a torch script calls it
        ours = aloader.get_worker_info()
        mine = (-1, -1, -1, -1) if ours is None else (
            ours.id, ours.num_workers, ours.seed, int(ours.dataset is self))
        return (i, info.id, info.num_workers, info.seed, int(info.dataset is self),
                random.getrandbits(40), int(np.random.randint(1 << 40)),
                int(torch.randint(1 << 40, ()).item()), torch.initial_seed(), *mine)


def _epochs(module: Any, num_workers: int, persistent: bool, drop_last: bool,
            epochs: int = 3) -> tuple[int, list[Any]]:
    loader = module.DataLoader(Probe(), batch_size=4, shuffle=True, drop_last=drop_last,
                               generator=torch.Generator().manual_seed(17),
                               num_workers=num_workers, persistent_workers=persistent)
    out = []
    for _ in range(epochs):
        out.append([[field.tolist() for field in batch] for batch in loader])
    return len(loader), out


@pytest.mark.parametrize(
    ("num_workers", "persistent", "drop_last"),
    [(1, False, False), (1, True, True), (2, False, True), (2, True, False), (3, False, False),
     (3, True, True)],
)
def test_map_batches_and_worker_seeds_are_torchs(num_workers: int, persistent: bool,
                                                 drop_last: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 3 workers on a small machine
        length, ours = _epochs(aloader, num_workers, persistent, drop_last)
        their_length, theirs = _epochs(tud, num_workers, persistent, drop_last)
    assert length == their_length == (N // 4 if drop_last else -(-N // 4))
    # aloader's own get_worker_info() agrees with torch's in aloader's workers...
    for epoch in ours:
        for batch in epoch:
            assert batch[9:] == batch[1:5]
    # ...and everything torch's workers saw and drew, aloader's saw and drew.
    assert [[b[:9] for b in e] for e in ours] == [[b[:9] for b in e] for e in theirs]
    ids = {wid for e in ours for b in e for wid in b[1]}
    assert ids == set(range(num_workers))
    seeds = {b[3][0] - b[1][0] for e in ours for b in e}
    assert len(seeds) == (1 if persistent else 3)  # base_seed + id; one base seed per pool
    assert {b[8][0] for e in ours for b in e} == {b[3][0] for e in ours for b in e}


def record_init(worker_id: int) -> None:
    """torch's order: the worker is seeded and its info set before ``worker_init_fn`` runs."""
    info = tud.get_worker_info()
    info.dataset.init = (worker_id, info.id, torch.initial_seed() - info.seed,
                         random.getrandbits(30), int(np.random.randint(1 << 30)))


class Scaled(tud.Dataset):  # type: ignore[misc]
    scale = 1
    init = (-1,) * 5

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[int, ...]:
        return (i * self.scale, *self.init)


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_init_fn_and_dataset_copies_are_torchs(persistent: bool) -> None:
    """``worker_init_fn`` sees the seeded worker and its info and may set up the worker's
    copy of the dataset; a change to the loader's dataset between epochs reaches new workers
    and not persistent ones (their copies were taken at their start), as in torch."""
    def epochs(module: Any) -> list[Any]:
        dataset = Scaled()
        loader = module.DataLoader(dataset, batch_size=3, num_workers=2, worker_init_fn=record_init,
                                   persistent_workers=persistent,
                                   generator=torch.Generator().manual_seed(0))
        first = [[f.tolist() for f in b] for b in loader]
        dataset.scale = 10
        return [first, [[f.tolist() for f in b] for b in loader]]

    ours = epochs(aloader)
    assert ours == epochs(tud)
    assert ours[1][1][0] == ([30, 40, 50] if not persistent else [3, 4, 5])
    assert ours[0][1][1:4] == [[1] * 3, [1] * 3, [0] * 3]  # worker 1: its id twice, seed + 0


# Errors ------------------------------------------------------------------------------------------
class Failing(tud.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        if i == 7:
            raise KeyError(f"no record {i}")
        return i


def _caught(module: Any, dataset: Any, **kwargs: Any) -> tuple[BaseException, list[Any]]:
    """The first error an epoch raises, and the batches after it (the epoch goes on)."""
    loader = module.DataLoader(dataset, batch_size=2, num_workers=2, **kwargs)
    iterator = iter(loader)
    before: list[Any] = []
    with pytest.raises(Exception) as info:
        for batch in iterator:
            before.append(batch.tolist())
    rest = [b.tolist() for b in iterator]
    return info.value, before + rest


def test_dataset_error_in_a_worker_is_torchs_with_the_index_noted() -> None:
    ours, our_batches = _caught(aloader, Failing())
    theirs, their_batches = _caught(tud, Failing())
    assert type(ours) is type(theirs) is KeyError
    # "Caught KeyError in DataLoader worker process 1." then the original traceback: the same
    # worker as torch's (batch 3 goes to worker 3 % 2 in both).
    assert str(ours).splitlines()[0] == str(theirs).splitlines()[0]
    assert "no record 7" in str(ours) and "Original Traceback" in str(ours)
    assert any("[6, 7]" in note for note in getattr(ours, "__notes__", ()))
    assert our_batches == their_batches  # every other batch, once, in order


def _epoch_outcomes(module: Any, dataset: Any, epochs: int = 3, **kwargs: Any) -> list[Any]:
    """Each epoch's batches, with the type name of each error in its place."""
    loader = module.DataLoader(dataset, batch_size=2, num_workers=2, **kwargs)
    out = []
    for _ in range(epochs):
        got: list[Any] = []
        iterator = iter(loader)
        while len(got) < 20:
            try:
                got.append(next(iterator).tolist())
            except StopIteration:
                break
            except Exception as exc:
                got.append(type(exc).__name__)
        out.append(got)
        del iterator
    if module is tud and loader._iterator is not None:
        # Now: collected later, from a reference cycle, torch's iterator waits 5 s per worker.
        loader._iterator._shutdown_workers()
    return out


@pytest.mark.parametrize("persistent", [False, True])
def test_an_error_leaves_the_epoch_and_the_next_ones_as_torchs(persistent: bool) -> None:
    ours = _epoch_outcomes(aloader, Failing(), persistent_workers=persistent)
    assert ours == _epoch_outcomes(tud, Failing(), persistent_workers=persistent)
    assert ours[2] == [[0, 1], [2, 3], [4, 5], "KeyError", [8, 9], [10, 11]]


def failing_init(worker_id: int) -> None:
    raise ValueError(f"init of worker {worker_id} failed")


def test_worker_init_fn_error_is_torchs() -> None:
    """torch's wrapping: the error's type, "Caught ValueError in DataLoader worker process 0."
    and the original traceback. (torch is not run here: its iterator, dropped after the error,
    waits 5 s for the worker that failed, and killing that worker instead makes torch's
    SIGCHLD handler raise later, in whatever test runs then.)"""
    with pytest.raises(ValueError) as info:
        list(aloader.DataLoader(Failing(), batch_size=2, num_workers=1,
                                worker_init_fn=failing_init))
    message = str(info.value)
    assert message.splitlines()[0] == "Caught ValueError in DataLoader worker process 0."
    assert "Original Traceback" in message and "init of worker 0 failed" in message


class Killing(tud.Dataset):  # type: ignore[misc]
    """Index 9 kills its worker (SIGKILL), once: the pid goes to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        if i == 9:
            Path(self.path).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def test_a_worker_killed_mid_epoch_is_named_like_torch(tmp_path: Path) -> None:
    """torch's message for it (its SIGCHLD handler's, ``_error_if_any_worker_fails``), naming
    the worker that died. (torch itself is not run here: its handler raises again from
    whatever code runs when the signal lands, pytest's included.)"""
    path = tmp_path / "pid"
    loader = aloader.DataLoader(Killing(str(path)), batch_size=2, num_workers=2,
                                persistent_workers=True, timeout=GUARD)
    got: list[int] = []

    with pytest.raises(RuntimeError) as info:
        for batch in loader:
            got.extend(batch.tolist())
    pid = int(path.read_text())
    assert str(info.value) == f"DataLoader worker (pid {pid}) is killed by signal: Killed. "
    assert isinstance(info.value, aloader.WorkerError)
    assert 9 not in got and len(got) == len(set(got))


def lock_batch(batch: list[int]) -> Any:
    return threading.Lock() if 4 in batch else batch


def test_an_unpicklable_batch_is_an_error_not_a_hang() -> None:
    """torch's worker cannot send it either, and its loader waits (until its timeout); aloader
    raises pickle's TypeError naming the worker, and the epoch goes on."""
    loader = aloader.DataLoader(range(8), batch_size=2, num_workers=1, collate_fn=lock_batch,
                                timeout=GUARD)
    iterator = iter(loader)
    assert next(iterator) == [0, 1] and next(iterator) == [2, 3]
    with pytest.raises(TypeError, match="cannot pickle") as info:
        next(iterator)
    assert "Caught TypeError in DataLoader worker process 0" in str(info.value)
    assert list(iterator) == [[6, 7]]


class Stuck(tud.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 4:
            time.sleep(GUARD)
        return i


def test_a_stuck_worker_times_out_like_torch() -> None:
    """torch's error (``f"DataLoader timed out after {timeout} seconds"``, a RuntimeError) for
    the batch a stuck worker holds; the batches before it were delivered, and closing does not
    wait for the worker. (torch is not run: its iterator would join the stuck worker for 5 s,
    and the timeout must leave room for a loaded machine to start the worker.)"""
    loader = aloader.DataLoader(Stuck(), batch_size=2, num_workers=1, timeout=2)
    iterator = iter(loader)
    got = [next(iterator).tolist(), next(iterator).tolist()]
    with pytest.raises(RuntimeError) as info:
        next(iterator)
    assert got == [[0, 1], [2, 3]]
    assert str(info.value) == "DataLoader timed out after 2 seconds"
    assert isinstance(info.value, aloader.LoaderTimeoutError)
    iterator.close()  # type: ignore[attr-defined]


# break, in_order=False ---------------------------------------------------------------------------
class Uneven(tud.Dataset):  # type: ignore[misc]
    """Some samples take longer, so that batches finish out of order."""

    def __len__(self) -> int:
        return 41

    def __getitem__(self, i: int) -> int:
        if i % 7 == 0:
            time.sleep(0.005)
        return i


STOPS = (2, 5, None)


def _broken_epochs(num_workers: int, stops: tuple[int | None, ...] = STOPS, **kwargs: Any
                   ) -> list[list[list[int]]]:
    """Epochs of one loader, each left after batch ``stops[k]`` (None: run to its end)."""
    loader = aloader.DataLoader(Uneven(), batch_size=3, shuffle=True, generator=5,
                                num_workers=num_workers, **kwargs)
    out = []
    for stop in stops:
        got = []
        for step, batch in enumerate(loader):
            got.append(batch.tolist())
            if step == stop:
                break
        out.append(got)
    return out


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_break_then_new_epoch_has_no_stale_batch(num_workers: int, persistent: bool) -> None:
    """A break only ends its epoch early: every epoch is the beginning of the one an unbroken
    run of the same loader gives (a numpy generator draws whole epochs), whatever the workers
    had in flight; without workers and with new workers each epoch, the epochs are the same
    too. (Persistent workers keep their first base seed, as torch's do, so the loader's
    generator draws differently from a loader with new workers each epoch.)"""
    kwargs: dict[str, Any] = {"persistent_workers": persistent} if num_workers else {}
    full = _broken_epochs(num_workers, (None, None, None), **kwargs)
    broken = _broken_epochs(num_workers, **kwargs)
    assert broken == [epoch[: None if stop is None else stop + 1]
                      for epoch, stop in zip(full, STOPS, strict=True)]
    if not persistent:
        assert full == _broken_epochs(0, (None, None, None))
    assert all(sorted(i for b in epoch for i in b) == list(range(41)) for epoch in full)


@pytest.mark.parametrize(("num_workers", "persistent"), [(2, False), (3, True)])
def test_out_of_order_epochs_deliver_torchs_batches_exactly_once(num_workers: int,
                                                                 persistent: bool) -> None:
    def epochs(module: Any) -> list[list[list[int]]]:
        loader = module.DataLoader(Uneven(), batch_size=3, shuffle=True, in_order=False,
                                   generator=torch.Generator().manual_seed(2),
                                   num_workers=num_workers, persistent_workers=persistent)
        return [sorted(b.tolist() for b in loader) for _ in range(3)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ours, theirs = epochs(aloader), epochs(tud)
    assert ours == theirs
    for epoch in ours:
        assert sorted(i for b in epoch for i in b) == list(range(41))


class Draws(tud.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, random.getrandbits(30)


# A consumer that pauses after each batch lets aloader's workers run ahead of torch's window
# (their draws must be put back); one that breaks at once may leave tasks torch had sent
# unsent (they must still run). Each epoch breaks at another step, the last runs to the end.
@pytest.mark.parametrize("pause", [0.0, 0.02])
@pytest.mark.parametrize("stops", [(0, None), (3, 0, None), (16, None)])
def test_persistent_workers_after_a_break_draw_what_torchs_draw(
        pause: float, stops: tuple[int | None, ...]) -> None:
    def run(module: Any) -> list[Any]:
        loader = module.DataLoader(Draws(), batch_size=3, num_workers=2,
                                   generator=torch.Generator().manual_seed(3),
                                   persistent_workers=True)
        out = []
        for stop in stops:
            for step, batch in enumerate(loader):
                out.append([field.tolist() for field in batch])
                if step == stop:
                    break
                time.sleep(pause)  # lets the workers run ahead; asserts nothing on timing
        return out

    assert run(aloader) == run(tud)
