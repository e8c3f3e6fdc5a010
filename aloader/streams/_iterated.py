"""Any iterable or async iterable as a :class:`~aloader.Stream` (:func:`as_stream`), iterated
anew at every epoch."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import anyio.lowlevel

from .._util import ataken, close_iterator, taken
from ._context import _BLOCK, _Context
from ._stream import Stream


class _Iterated(Stream[Any]):
    """Any iterable or async iterable, as a stream (iterated anew at every epoch)."""

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        set_epoch = getattr(self.iterable, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    async def _blocks(self, ctx: _Context) -> AsyncGenerator[list[Any], None]:
        source = self.iterable
        aiter_ = getattr(type(source), "__aiter__", None)
        if aiter_ is not None:
            iterator = source.__aiter__()
            try:
                async for item in ataken(iterator):
                    yield [item]
            finally:
                await close_iterator(iterator)
            return
        sync_iterator = iter(source)
        items = taken(sync_iterator)  # a `for` per block: never the source's __iter__ again
        try:
            while True:
                block = []
                for item in items:
                    block.append(item)
                    if len(block) == _BLOCK:
                        break
                if not block:
                    return
                yield block
                await anyio.lowlevel.checkpoint()
        finally:
            await close_iterator(sync_iterator, blocking=False)


def as_stream(iterable: Any) -> Stream[Any]:
    """Wrap an iterable (a list, a generator function's iterable, an ``IterableDataset``) or
    an async iterable as a :class:`Stream`, to ``shuffle``, ``map`` or ``interleave`` it.

    Plain iterators are pulled on the event loop, so they should not block. The wrapped
    object is iterated anew at every epoch (a one-shot iterator yields its items once).

    Args:
        iterable: the object; a :class:`Stream` is returned unchanged.

    Raises:
        TypeError: ``iterable`` is neither iterable nor async iterable.
    """
    if isinstance(iterable, Stream):
        return iterable
    if not (hasattr(iterable, "__iter__") or hasattr(iterable, "__aiter__")):
        raise TypeError(f"as_stream needs an iterable or async iterable, but got {iterable!r}")
    return _Iterated(iterable)
