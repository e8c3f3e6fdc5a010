"""aloader's DataLoader against torch's over the shapes of iterator users write: datasets and
samplers whose ``__iter__`` is a generator, returns ``self`` (reset or not), returns a separate
iterator object, a stored list iterator or a fresh ``iter(list)``; batch samplers written the
same ways. Each epoch takes its iterator exactly once (per worker's replica), as torch's does:
the batches are torch's, batch for batch, epoch after epoch, without and with workers
(persistent or not), with ``multiprocessing_context`` left at its default as a torch user
leaves it. Batches are compared as Python lists.

One shape differs on purpose: a sampler whose ``__iter__`` resets and returns ``self`` under
a ``batch_size`` without ``drop_last``. torch's ``BatchSampler`` cuts each batch with
``islice`` on the sampler's iterator, which calls ``__iter__`` again, so torch repeats the first
batch forever; aloader ends the epoch after the sampler's indices (README, "Differences").
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest

import aloader

torch = pytest.importorskip("torch")
tud = pytest.importorskip("torch.utils.data")

N = 10
EPOCHS = 2  # (a second epoch shows what the first left behind: a one-shot iterator, a reset)
# Far more batches than any finite epoch here has: an epoch reaching it repeats forever.
_ENDLESS = 4 * N


def _plain(value: Any) -> Any:
    """A batch as Python lists and numbers (tensors and arrays by ``tolist``)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _epochs(module: Any, make: Any, sampler: Any = None, batch_sampler: Any = None,
            **kwargs: Any) -> list[list[Any]]:
    """``EPOCHS`` epochs of ``module.DataLoader(make(), **kwargs)`` (``sampler`` and
    ``batch_sampler``: classes, made after the global ``random`` is seeded), each as a list of
    batches (an epoch that reaches ``_ENDLESS`` batches is cut there, and the run stops)."""
    random.seed(0)  # samplers that shuffle draw from the global generator, as users' do
    if sampler is not None:
        kwargs["sampler"] = sampler()
    if batch_sampler is not None:
        kwargs["batch_sampler"] = batch_sampler()
    loader = module.DataLoader(make(), **kwargs)
    out = []
    try:
        for _ in range(EPOCHS):
            epoch = [_plain(batch) for batch in itertools.islice(loader, _ENDLESS)]
            out.append(epoch)
            if len(epoch) == _ENDLESS:
                break
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    return out


# --------------------------------------------------------------------------- iterable datasets


class GeneratorData(tud.IterableDataset):  # type: ignore[misc]
    """``__iter__`` is a generator function (a new generator per epoch)."""

    def __iter__(self) -> Any:
        yield from range(N)


class ResetSelfData(tud.IterableDataset):  # type: ignore[misc]
    """``__iter__`` resets the position and returns ``self`` (torchdata's tests, many users)."""

    def __init__(self) -> None:
        self.i = 0

    def __iter__(self) -> Any:
        self.i = 0
        return self

    def __next__(self) -> int:
        if self.i >= N:
            raise StopIteration
        self.i += 1
        return self.i - 1


class OneShotData(ResetSelfData):
    """An iterator used as a dataset: ``__iter__`` returns ``self`` without a reset, so a
    second epoch (of the same object) is empty."""

    def __iter__(self) -> Any:
        return self


class _Cursor:
    def __init__(self, stop: int) -> None:
        self.i, self.stop = 0, stop

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> int:
        if self.i >= self.stop:
            raise StopIteration
        self.i += 1
        return self.i - 1


class SeparateIteratorData(tud.IterableDataset):  # type: ignore[misc]
    """``__iter__`` returns a new iterator object of another class."""

    def __iter__(self) -> Any:
        return _Cursor(N)


class StoredListIteratorData(tud.IterableDataset):  # type: ignore[misc]
    """``__iter__`` returns one list iterator made at construction (one-shot)."""

    def __init__(self) -> None:
        self.it = iter(list(range(N)))

    def __iter__(self) -> Any:
        return self.it


class FreshListIteratorData(tud.IterableDataset):  # type: ignore[misc]
    """``__iter__`` returns ``iter(list)``, new at every call."""

    def __init__(self) -> None:
        self.items = list(range(N))

    def __iter__(self) -> Any:
        return iter(self.items)


class EpochCountingData(ResetSelfData):
    """Self-returning, counting its ``__iter__`` calls in what it yields: a second call in one
    epoch shows in the samples."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __iter__(self) -> Any:
        self.calls += 1
        return super().__iter__()

    def __next__(self) -> int:
        return 100 * self.calls + super().__next__()


ITERABLES = [GeneratorData, ResetSelfData, OneShotData, SeparateIteratorData,
             StoredListIteratorData, FreshListIteratorData, EpochCountingData]

# (batch_size, drop_last): no batching, batches of one, a short last batch kept or dropped.
BATCHING = [(None, False), (1, False), (3, False), (3, True)]
# (num_workers, persistent_workers)
WORKERS = [(0, False), (2, False), (2, True)]


def _ids(params: list[Any]) -> list[str]:
    return [getattr(p, "__name__", None) or "-".join(map(str, p)) for p in params]


def _loader_kwargs(batching: tuple[Any, bool], workers: tuple[int, bool]) -> dict[str, Any]:
    (batch_size, drop_last), (num_workers, persistent) = batching, workers
    return {"batch_size": batch_size, "drop_last": drop_last, "num_workers": num_workers,
            "persistent_workers": persistent}


@pytest.mark.parametrize("workers", WORKERS, ids=_ids(WORKERS))
@pytest.mark.parametrize("batching", BATCHING, ids=_ids(BATCHING))
@pytest.mark.parametrize("shape", ITERABLES, ids=_ids(ITERABLES))
def test_iterable_dataset_epochs_are_torchs(shape: Any, batching: tuple[Any, bool],
                                            workers: tuple[int, bool]) -> None:
    kwargs = _loader_kwargs(batching, workers)
    theirs = _epochs(tud, shape, **kwargs)
    assert all(len(epoch) < _ENDLESS for epoch in theirs)
    assert _epochs(aloader, shape, **kwargs) == theirs


# --------------------------------------------------------------------------- samplers


class ListData(tud.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return int(index) * 10


def _order() -> list[int]:
    order = list(range(N))
    random.shuffle(order)
    return order


class GeneratorSampler(tud.Sampler):  # type: ignore[misc]
    """``__iter__`` is a generator shuffling with the global ``random``."""

    def __init__(self) -> None:
        pass

    def __iter__(self) -> Any:
        yield from _order()

    def __len__(self) -> int:
        return N


class OneShotSampler(tud.Sampler):  # type: ignore[misc]
    """``__iter__`` returns ``self`` without a reset: later epochs are empty."""

    def __init__(self) -> None:
        self.order = _order()

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> int:
        if not self.order:
            raise StopIteration
        return self.order.pop(0)

    def __len__(self) -> int:
        return N


class ReshuffleSelfSampler(OneShotSampler):
    """``__iter__`` draws a new order (global ``random``) and returns ``self``: each call to
    ``__iter__`` shows in the order (torch's iterator with new workers calls it twice)."""

    def __iter__(self) -> Any:
        self.order = _order()
        return self


class ListIteratorSampler(tud.Sampler):  # type: ignore[misc]
    """``__iter__`` returns ``iter(list)`` of a new order."""

    def __init__(self) -> None:
        pass

    def __iter__(self) -> Any:
        return iter(_order())

    def __len__(self) -> int:
        return N


class ArraySampler(tud.Sampler):  # type: ignore[misc]
    """``__iter__`` returns an iterator over a numpy array of a new order."""

    def __init__(self) -> None:
        pass

    def __iter__(self) -> Any:
        return iter(np.array(_order()))

    def __len__(self) -> int:
        return N


SAMPLERS = [GeneratorSampler, OneShotSampler, ReshuffleSelfSampler, ListIteratorSampler,
            ArraySampler]


def _repeats_in_torch(sampler: Any, batch_size: int | None, drop_last: bool) -> bool:
    """Whether torch's ``BatchSampler`` calls this sampler's ``__iter__`` once per batch (it
    ``islice``s the sampler's iterator: a self-returning sampler that resets starts over)."""
    return sampler is ReshuffleSelfSampler and batch_size is not None and not drop_last


@pytest.mark.parametrize("workers", WORKERS, ids=_ids(WORKERS))
@pytest.mark.parametrize("batching", BATCHING, ids=_ids(BATCHING))
@pytest.mark.parametrize("shape", SAMPLERS, ids=_ids(SAMPLERS))
def test_sampler_epochs_are_torchs(shape: Any, batching: tuple[Any, bool],
                                   workers: tuple[int, bool]) -> None:
    batch_size, drop_last = batching
    kwargs = _loader_kwargs(batching, workers)
    theirs = _epochs(tud, lambda: ListData(), sampler=shape, **kwargs)
    ours = _epochs(aloader, lambda: ListData(), sampler=shape, **kwargs)
    if not _repeats_in_torch(shape, batch_size, drop_last):
        assert ours == theirs
        return
    # torch starts the sampler over at every batch, forever; aloader's epochs are the
    # sampler's orders, cut into batches.
    assert len(theirs[0]) == _ENDLESS
    random.seed(0)
    sampler = ReshuffleSelfSampler()  # draws as _epochs' does: at construction, then per epoch
    expected = []
    for _ in range(EPOCHS):
        indices = iter(sampler)
        order = [10 * next(indices) for _ in range(N)]  # (a `for` would call iter() again)
        expected.append([order[i:i + batch_size] for i in range(0, N, batch_size)])
    assert ours == expected


# --------------------------------------------------------------------------- batch samplers


class GeneratorBatchSampler(tud.Sampler):  # type: ignore[misc]
    def __init__(self) -> None:
        pass

    def __iter__(self) -> Any:
        order = _order()
        for start in range(0, N, 4):
            yield order[start:start + 4]

    def __len__(self) -> int:
        return (N + 3) // 4


class ResetSelfBatchSampler(GeneratorBatchSampler):
    """``__iter__`` draws an order, resets and returns ``self``."""

    def __iter__(self) -> Any:
        self.order, self.at = _order(), 0
        return self

    def __next__(self) -> list[int]:
        if self.at >= N:
            raise StopIteration
        self.at += 4
        return self.order[self.at - 4:self.at]


class OneShotBatchSampler(ResetSelfBatchSampler):
    def __init__(self) -> None:
        self.order, self.at = _order(), 0

    def __iter__(self) -> Any:
        return self


class TorchBatchSamplerOverSelfSampler(tud.BatchSampler):  # type: ignore[misc]
    """torch's own ``BatchSampler`` (with ``drop_last``, the one way torch's ends) over a
    self-returning sampler."""

    def __init__(self) -> None:
        super().__init__(ReshuffleSelfSampler(), 3, True)


BATCH_SAMPLERS = [GeneratorBatchSampler, ResetSelfBatchSampler, OneShotBatchSampler,
                  TorchBatchSamplerOverSelfSampler]


@pytest.mark.parametrize("workers", WORKERS, ids=_ids(WORKERS))
@pytest.mark.parametrize("shape", BATCH_SAMPLERS, ids=_ids(BATCH_SAMPLERS))
def test_batch_sampler_epochs_are_torchs(shape: Any, workers: tuple[int, bool]) -> None:
    num_workers, persistent = workers
    kwargs = {"num_workers": num_workers, "persistent_workers": persistent}
    theirs = _epochs(tud, lambda: ListData(), batch_sampler=shape, **kwargs)
    assert _epochs(aloader, lambda: ListData(), batch_sampler=shape, **kwargs) == theirs
