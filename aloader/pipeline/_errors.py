"""How the pipeline's errors say where they were raised: a note naming the batch, the index or
the stage (sampler, fetch, collate) that raised.

Invariant: an error is never replaced, only annotated (the consumer gets the dataset's own
exception, its type and traceback kept); the failure budget's error, one object shared by
every job after it, is never annotated.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._exceptions import FailureBudgetExceeded

__all__ = ()


def _note(error: BaseException, text: str) -> BaseException:
    if not isinstance(error, FailureBudgetExceeded):  # one object for every job after it
        error.add_note(text)
    return error


def _describe(key: Any) -> str:
    if isinstance(key, np.ndarray):
        key = key.tolist()
    text = repr(key)
    return text if len(text) <= 200 else text[:197] + "..."


def _batch_error(error: Exception, seq: int) -> BaseException:
    """``error``, raised loading batch ``seq`` of an iterable dataset, with a note saying so."""
    return _note(error, f"raised while loading batch {seq} of the iterable dataset")
