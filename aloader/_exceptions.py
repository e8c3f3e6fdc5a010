"""One exception tree: catch :class:`AloaderError` to catch everything aloader raises itself.

Errors that torch.utils.data raises as a builtin type keep that type (the subclasses below also
derive from it), so code written against torch catches them unchanged.
"""

from __future__ import annotations

__all__ = ("AloaderError", "LoaderTimeoutError")


class AloaderError(Exception):
    """Base class of the exceptions aloader defines."""


class LoaderTimeoutError(AloaderError, RuntimeError):
    """No batch arrived within the loader's ``timeout`` (torch raises a RuntimeError)."""
