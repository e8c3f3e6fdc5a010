"""``Stream.filter``: the items for which a predicate (plain or ``async def``) is true.

:class:`FilterStage` is the stage's whole behaviour; its stream class
(:class:`aloader.streams._stream._Filtered`) is made where ``Stream.filter`` is defined, so
that this module needs :class:`~aloader.Stream` only for its annotations (no import cycle).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._util import Closing, is_async_callable
from ._context import _Context
from ._positions import _check_upstream, _discard, _state_of, check_stage

if TYPE_CHECKING:
    from ._stream import Stream

T_co = TypeVar("T_co", covariant=True)


class FilterStage(Generic[T_co]):
    """The filter stage: what ``_Filtered`` (a :class:`~aloader.Stream`) does."""

    def __init__(self, upstream: Stream[T_co], predicate: Callable[[Any], Any]) -> None:
        if not callable(predicate):
            raise TypeError(f"filter needs a callable, but got {predicate!r}")
        self.upstream = upstream
        self.predicate = predicate
        self.is_async = is_async_callable(predicate)

    def _upstreams(self) -> Sequence[Stream[Any]]:
        return (self.upstream,)

    def _blocks_at(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        upstream = self.upstream._blocks_at(ctx, None if at is None else at["upstream"])
        return _discard(self._kept(upstream), 0 if at is None else at["skip"])

    async def _kept(
        self, upstream: AsyncGenerator[tuple[list[T_co], Any], None]
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        predicate = self.predicate
        async with Closing(upstream) as blocks:
            async for block, token in blocks:
                if self.is_async:
                    kept = [item for item in block if await predicate(item)]
                else:
                    kept = [item for item in block if predicate(item)]
                if kept:
                    yield kept, token

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        # The upstream at the start of the input block, and the kept items to discard.
        return {"stage": "filter", "upstream": _state_of(self.upstream, token, 0), "skip": skip}

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        check_stage(at, "filter", "filter")
        _check_upstream(self.upstream, at, slot)
