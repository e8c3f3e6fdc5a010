"""Counting the private loops' threads a test leaves, ignoring those earlier tests left alive.

A test module imports both names: the autouse fixture then runs around each of its tests.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

_EARLIER: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def ignore_earlier_loops() -> Iterator[None]:
    """Loop threads that other tests left alive are not this test's to count."""
    gc.collect()
    _EARLIER.clear()
    _EARLIER.update(threading.enumerate())
    yield


def loop_threads() -> list[threading.Thread]:
    """The private loops' threads started since this test began."""
    return [t for t in threading.enumerate() if t.name == "aloader-loop" and t not in _EARLIER]
