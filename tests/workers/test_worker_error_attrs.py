"""An error raised in a worker keeps its own attributes (a ``FetchError``'s ``status_code``,
``source`` and ``offset``), as it has without workers: code that branches on them (retry on
503, skip on 404) works the same with ``num_workers``."""

from __future__ import annotations

import pytest

import aloader
from aloader import FetchError


class Failing:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if index == 2:
            raise FetchError("gone", source="http://127.0.0.1/x", offset=7, status_code=404)
        return index


class Tagged(Exception):
    pass


class RaisesTagged(Failing):
    def __getitem__(self, index: int) -> int:
        if index == 2:
            error = Tagged("tagged")
            error.code, error.pair = 3, (1, "a")  # type: ignore[attr-defined]
            error._private, error.unplain = 1, object()  # type: ignore[attr-defined]
            raise error
        return index


@pytest.mark.parametrize("workers", [0, 1])
def test_a_fetch_errors_attributes_cross_from_a_worker(workers: int) -> None:
    loader = aloader.DataLoader(Failing(), batch_size=2, num_workers=workers, timeout=60)
    with pytest.raises(FetchError) as info:
        list(loader)
    error = info.value
    assert (error.status_code, error.source, error.offset) == (404, "http://127.0.0.1/x", 7)


def test_plain_attributes_of_any_error_cross_and_others_do_not() -> None:
    loader = aloader.DataLoader(RaisesTagged(), batch_size=2, num_workers=1, timeout=60)
    with pytest.raises(Tagged) as info:
        list(loader)
    error = info.value
    assert (error.code, error.pair) == (3, (1, "a"))  # type: ignore[attr-defined]
    assert not hasattr(error, "_private") and not hasattr(error, "unplain")
