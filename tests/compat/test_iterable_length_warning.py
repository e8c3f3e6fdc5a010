"""The warning of an iterable epoch that outruns the dataset's ``len()``, at torch's moment:
only after ``len(loader)`` was read before the epoch's ``iter()``, in the consumer's ``next()``
that receives batch ``len + 1`` and each after it (never ahead of the consumer, however far
workers run ahead), at the consumer's line (torch's ``test_iterable_style_dataset``)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import anyio
import pytest

import aloader

torch = pytest.importorskip("torch")
tud = torch.utils.data


class Counting(tud.IterableDataset):  # type: ignore[misc]
    """``len()`` says 20; each replica (one per worker) yields 30 samples."""

    def __len__(self) -> int:
        return 20

    def __iter__(self) -> Any:
        return iter(range(30))


def _warned(step: Any) -> tuple[bool, str, int] | None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    about = [w for w in caught if "samples have been fetched" in str(w.message)]
    assert len(about) <= 1
    if not about:
        return None
    w = about[0]
    return "For multiprocessing data-loading" in str(w.message), w.filename, w.lineno


def _run(module: Any, workers: int, batch_size: int | None) -> list[Any]:
    loader = module.DataLoader(Counting(), num_workers=workers, batch_size=batch_size)
    seen: list[Any] = []
    seen += _steps(iter(loader), 25)  # len() not read yet: silent
    early = iter(loader)
    seen.append(len(loader))
    seen += _steps(early, 22)  # made before len() was read: silent
    seen += _steps(iter(loader), 23)  # after: batches 21, 22, 23 warn
    return seen


def _steps(epoch: Any, count: int) -> list[Any]:
    return [_warned(functools.partial(next, epoch)) for _ in range(count)]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 1])
def test_length_warning_at_torchs_moment_and_the_users_line(workers: int,
                                                             batch_size: int | None) -> None:
    ours = _run(aloader, workers, batch_size)
    assert ours == _run(tud, workers, batch_size)
    warned = [w for w in ours if isinstance(w, tuple)]
    assert len(warned) == 3 and all(w[1] == __file__ for w in warned)
    assert all(w[0] == (workers > 0) for w in warned)


def test_length_warning_of_async_for_at_the_users_line() -> None:
    async def epoch(loader: aloader.DataLoader[Any]) -> list[Any]:
        return [batch async for batch in loader]

    loader = aloader.DataLoader(Counting(), batch_size=None, num_workers=2)
    assert len(loader) == 20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(anyio.run(epoch, loader)) == 60
    about = [w for w in caught if "samples have been fetched" in str(w.message)]
    assert [str(w.message).split(", but ")[1][:2] for w in about] == [str(n) for n in
                                                                      range(21, 61)]
    assert {(w.filename, w.lineno) for w in about} == {(__file__,
                                                        epoch.__code__.co_firstlineno + 1)}
