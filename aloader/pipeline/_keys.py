"""The sampler's keys as a map epoch reads them: one ``__anext__`` for sync and async samplers,
and keys drawn only on the consumer's calls (:class:`PacedKeys`, torch's schedule).

Invariant: :class:`PacedKeys` draws from the sampler only on the consumer's calls, on its
thread, and keeps the sampler's end or error in its place: the reader gets it after the keys
drawn before it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from .._backend import threadsafe_caller
from .._util import Signal

__all__ = ("PacedKeys",)


class _Keys:
    """Sync or async iteration over the sampler's keys, one ``__anext__`` for both."""

    __slots__ = ("_async", "_iterator")

    def __init__(self, keys: Iterator[Any] | AsyncIterator[Any]) -> None:
        self._iterator = keys
        self._async = isinstance(keys, AsyncIterator)

    async def __anext__(self) -> Any:
        if self._async:
            return await self._iterator.__anext__()  # type: ignore[union-attr]
        try:
            return next(self._iterator)  # type: ignore[arg-type]
        except StopIteration:
            raise StopAsyncIteration from None


class PacedKeys:
    """A sampler's keys drawn only on the consumer's calls, on its thread, as torch's loader
    draws them: the reader (the epoch's producer, on the loop) takes keys already drawn, and
    waits for more when it has taken them all.

    A user's sampler may draw from the global ``random``, numpy or torch generators as it
    yields each key; the training loop draws from them too. torch's loader pulls its sampler
    on a fixed schedule (its prefetch at ``iter()``, then one key per batch handed out), so
    the two interleave in one order, run after run; drawn by a producer running ahead as
    timing lets it, they would interleave by chance. :meth:`reach`, the loader's call
    (:meth:`aloader.loader._dataloader.AsyncDataLoaderIter._advance`, where the consumer
    calls), draws up to the count torch's loader has drawn by then, plus ``lead`` (an epoch without
    workers prefetching: a fixed number, so deterministic still). Only what has no array
    form comes here (a user's sampler, a :class:`~aloader.BatchSampler` over one): aloader's
    own samplers draw their epochs whole, at the point torch's draw their first key.

    The sampler's end or error is kept in its place: the reader gets it after the keys drawn
    before it. :meth:`unpaced` gives up the pacing for an epoch that reads its keys on the
    consumer's call itself (inline: torch's schedule already).

    Args:
        keys: the sampler's iterator.
        lead: keys drawn ahead of the count :meth:`reach` is given.
    """

    def __init__(self, keys: Iterator[Any], lead: int = 0) -> None:
        self._keys = keys
        self._lead = lead
        self._ready: deque[Any] = deque()
        self._drawn = 0
        self._end: Exception | None = None  # StopIteration, or the sampler's error
        self._lock = threading.Lock()
        self._signal = Signal()
        self._call_soon: Callable[[Callable[[], None]], None] | None = None
        self._parked = False  # the reader waits for keys
        self._paced = True
        #: Called with each key the reader takes (a pool's record of the keys it drew).
        self.on_read: Callable[[Any], None] | None = None

    def reach(self, count: int) -> None:
        """Draw keys until ``count + lead`` have been drawn, or the sampler's end."""
        if not self._paced:
            return
        count += self._lead
        drawn: list[Any] = []
        end: Exception | None = None
        # Drawn outside the lock: the sampler's own code runs here (it may be slow).
        while self._drawn + len(drawn) < count and self._end is None:
            try:
                drawn.append(next(self._keys))
            except Exception as exc:  # StopIteration included
                end = exc
                break
        if not drawn and end is None:
            return
        with self._lock:
            self._ready.extend(drawn)
            self._drawn += len(drawn)
            self._end = end
            wake, self._parked = self._parked, False
        if wake:
            assert self._call_soon is not None
            self._call_soon(self._signal.notify)

    def buffered(self) -> Iterator[Any]:
        """The keys drawn and not yet read, taken as they are iterated (never drawing)."""
        while True:
            with self._lock:
                if not self._ready:
                    return
                key = self._ready.popleft()
            yield key

    def unpaced(self) -> Iterator[Any]:
        """The keys as a plain iterator, drawn as it is read (and :meth:`reach` a no-op)."""
        self._paced = False
        yield from self.buffered()
        end = self._end
        if end is None:
            yield from self._keys
        elif not isinstance(end, StopIteration):
            raise end

    def __aiter__(self) -> PacedKeys:
        return self

    async def __anext__(self) -> Any:
        while True:
            with self._lock:
                if self._ready:
                    key = self._ready.popleft()
                    break
                end = self._end
                if end is None:
                    if self._call_soon is None:
                        self._call_soon = threadsafe_caller()
                    self._parked = True
            if end is not None:
                if isinstance(end, StopIteration):
                    raise StopAsyncIteration
                raise end
            # reach() notifies through the loop's call-soon, run only once this task parks.
            await self._signal.wait()
        if self.on_read is not None:
            self.on_read(key)
        return key
