"""The checks of a batcher's arguments and of the numbers its callbacks return.

Ray Serve's ``@serve.batch`` is the peer for the arguments it has: a value of the wrong type is
a ``TypeError``, one out of range a ``ValueError``, with Ray's wording ("max_batch_size must be
an integer >= 1, got 0"), and an integral float is a batch size (``1.0``), as Ray takes it. The
batcher's own arguments follow the same rule. Every message names the argument as the caller
spelled it (``max_wait`` or ``batch_wait_timeout_s``).
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = (
    "check_batch_size",
    "check_count",
    "check_cost",
    "check_optional_seconds",
    "check_preferred",
    "check_priority",
    "check_wait",
    "is_async_gen_callable",
)


def check_count(name: str, value: object, *, integral_float: bool = False) -> int:
    """A count (``max_batch_size``, ``max_concurrent_batches``, ``max_queue``,
    ``metrics_window``): an int from 1 to ``sys.maxsize`` (nothing is allocated in proportion
    to it); with ``integral_float``, a float such as ``4.0`` too, as Ray takes a batch size."""
    if integral_float and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer >= 1, got {value!r}")
    if value < 1 or value > sys.maxsize:
        raise ValueError(f"{name} must be an integer >= 1 (and at most sys.maxsize), got {value!r}")
    return value


def check_batch_size(name: str, value: object) -> int:
    """``max_batch_size`` (or a budget in ``batch_size_fn``'s units): a count, or an integral
    float, as in Ray."""
    return check_count(name, value, integral_float=True)


def check_wait(name: str, value: object) -> float:
    """``max_wait`` / ``batch_wait_timeout_s``: finite seconds >= 0 (an infinite wait would
    keep a lone request waiting forever for its batch to fill)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float >= 0, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf if value > 0 else -math.inf
    if not seconds >= 0:  # NaN too
        raise ValueError(f"{name} must be a float >= 0, got {value!r}")
    if seconds == math.inf:
        raise ValueError(f"{name} must be finite, got {value!r}")
    return seconds


def check_optional_seconds(name: str, value: object, *, allow_zero: bool) -> float | None:
    """A timeout: ``None`` (or ``inf``) for none, else positive seconds (0 too where allowed)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or None, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf if value > 0 else -math.inf
    if math.isnan(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name} should be {bound}, but got {name}={value!r}")
    return None if seconds == math.inf else seconds


def check_preferred(
    preferred_batch_sizes: Sequence[int] | None, max_batch_size: int
) -> tuple[int, ...]:
    """``preferred_batch_sizes`` as sorted distinct sizes, each from 1 to ``max_batch_size``
    (``()`` for None)."""
    if preferred_batch_sizes is None:
        return ()
    if isinstance(preferred_batch_sizes, (str, bytes)) or not hasattr(
        preferred_batch_sizes, "__iter__"
    ):
        raise TypeError(
            "preferred_batch_sizes should be a sequence of batch sizes or None, but got "
            f"preferred_batch_sizes={preferred_batch_sizes!r}"
        )
    sizes = tuple(preferred_batch_sizes)  # once: an iterator gives its items only once
    for size in sizes:
        check_count("preferred_batch_sizes item", size)
        if size > max_batch_size:
            raise ValueError(
                f"preferred_batch_sizes item {size} is larger than max_batch_size={max_batch_size}"
            )
    preferred = tuple(sorted(set(sizes)))
    if not preferred:
        raise ValueError("preferred_batch_sizes should not be empty (use None instead)")
    return preferred


def check_cost(value: Any, what: str) -> float:
    """A cost (or a batch size) that user code returned: a real number, finite and >= 0.

    Raises:
        TypeError: not a real number (``what`` says which callback returned it).
        ValueError: negative, NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must return a number, but returned {value!r}")
    try:
        cost = float(value)
    except OverflowError:  # an int (or a Fraction) beyond a float's range
        sign = "-" if value < 0 else ""
        raise ValueError(
            f"{what} must return a finite number >= 0, but returned {sign}a number too large "
            "for a float"
        ) from None
    if not 0 <= cost < math.inf:
        raise ValueError(f"{what} must return a finite number >= 0, but returned {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)  # ints stay exact in sums
    return cost


def check_priority(value: object) -> int:
    """A request's priority: any int (higher is served first)."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"priority must be an integer, got {value!r}")
    return int(value)


def is_async_gen_callable(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` makes an async generator: an ``async def`` with ``yield``, an
    object whose ``__call__`` is one, or a ``functools.partial`` of either."""
    while hasattr(fn, "func") and hasattr(fn, "args") and hasattr(fn, "keywords"):
        fn = fn.func  # functools.partial
    if inspect.isasyncgenfunction(fn):
        return True
    if isinstance(fn, type) or inspect.isroutine(fn):
        return False
    call = getattr(fn, "__call__", None)  # noqa: B004 - a callable object
    return call is not None and inspect.isasyncgenfunction(call)
