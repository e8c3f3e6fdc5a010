"""Persistent workers' global random generators in a checkpoint.

torch's persistent workers keep drawing from their global generators (``random``, numpy's,
torch's) across epochs: an epoch's augmentations depend on what the worker drew before. So a
state taken between epochs of persistent workers holds each worker's generators as its last
answer left them (a persistent worker sends them with an answer after which it is idle, which
the last of each epoch always is), and a resume with as many persistent workers puts them
back in each worker once it is seeded and ``worker_init_fn`` ran: the epochs after the resume
draw what the uninterrupted run's did. With another number of workers (or none persistent),
the workers are seeded as any new ones.

The states are JSON builtins: ``[random's, numpy's, torch's or None]``, each as lists.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np

__all__ = ("check_rngs", "rngs_from_json", "rngs_to_json")


def rngs_to_json(state: tuple[Any, Any, Any]) -> list[Any]:
    """:func:`aloader.workers._worker.rng_state`'s answer as JSON builtins."""
    version, internal, gauss = state[0]
    name, keys, pos, has_gauss, cached = state[1]
    torch_state = state[2]
    return [[version, list(internal), gauss],
            [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
            None if torch_state is None else torch_state.tolist()]


def rngs_from_json(obj: list[Any]) -> tuple[Any, Any, Any]:
    """What :func:`rngs_to_json` made, as :func:`aloader.workers._worker.set_rng_state`
    takes it (torch's only where torch is imported)."""
    version, internal, gauss = obj[0]
    name, keys, pos, has_gauss, cached = obj[1]
    torch = sys.modules.get("torch")
    torch_state = None
    if obj[2] is not None and torch is not None:
        torch_state = torch.tensor(obj[2], dtype=torch.uint8)
    return ((version, tuple(internal), gauss),
            (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached), torch_state)


def check_rngs(obj: Any, where: str) -> None:
    """Validate one worker's states (``where`` names the field in errors).

    Raises:
        ValueError: they are not states the generators take.
    """
    try:
        if not isinstance(obj, list) or len(obj) != 3:
            raise ValueError("should be [random's, numpy's, torch's or None]")
        state = rngs_from_json(obj)
        random.Random().setstate(state[0])
        np.random.RandomState().set_state(state[1])
        if obj[2] is not None and (not isinstance(obj[2], list) or not all(
                type(b) is int and 0 <= b < 256 for b in obj[2])):
            raise ValueError("torch's should be a list of bytes")
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"cannot load this state: field {where!r} is not a worker's "
                         f"generators' states: {exc}") from None
