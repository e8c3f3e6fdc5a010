"""Inference micro-batcher. SKELETON: the batcher helper fills this module in."""

from __future__ import annotations

from ._exceptions import AloaderError

__all__ = ("Batcher", "BatcherClosedError", "QueueFullError", "batch")


class QueueFullError(AloaderError):
    """The batcher's queue is full: the request was rejected at once."""


class BatcherClosedError(AloaderError):
    """The batcher is closed or closing and admits no request."""


class Batcher:
    """SKELETON."""


def batch() -> None:
    """SKELETON."""
