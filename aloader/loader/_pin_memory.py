"""``pin_memory=True``: torch's transform of every finished batch, and the check that torch is
installed.

Invariant: torch is imported only here, only when a loader asks for pinned memory, never at
module load.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from ._dataloader import DataLoader

__all__ = ()


def _require_torch(what: str) -> Any:
    try:
        import torch
    except ImportError:
        raise RuntimeError(
            f"{what} needs torch, which is not installed; install it with "
            "`pip install 'aloader[torch]'`, or leave pin_memory=False"
        ) from None
    return torch


def _pin_memory_transform(loader: DataLoader[Any]) -> Callable[[Any], Any] | None:
    if not loader.pin_memory:
        return None
    torch = _require_torch("pin_memory=True")
    if loader.pin_memory_device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the "
            f"device,ignore pin_memory_device='{loader.pin_memory_device}'.",
            stacklevel=3,
        )
    if not torch.accelerator.is_available():
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, "
            "then device pinned memory won't be used.",
            stacklevel=3,
        )
        return None
    from torch.utils.data._utils.pin_memory import pin_memory

    return cast(Callable[[Any], Any], pin_memory)
