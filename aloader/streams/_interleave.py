"""Round-robin interleave (:class:`_Interleaved`, what :func:`aloader.interleave` makes without
weights; weighted mixing is :mod:`aloader.streams._mix`'s job): one item from each input in
turn, an input that ends dropping out (or ending the stage, ``stop_on_first``).

Invariant: the stage holds one block of each input, and a block it cuts starts after a whole
round, so its token (where each input then was, and which were running) resumes every input
exactly.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any, Generic, TypeVar

import anyio

from .._util import Closing
from ._context import _BLOCK, _Context
from ._positions import _bad_state, _discard, _Encoded, _state_of, check_field, check_stage
from ._stream import Stream

T = TypeVar("T")


class _Cursor(Generic[T]):
    """One input of an interleave: its blocks, the position in the current one, and that
    block's token (where the input is, for a state)."""

    __slots__ = ("block", "blocks", "pos", "token")

    def __init__(self, blocks: AsyncGenerator[tuple[list[T], Any], None], token: Any) -> None:
        self.blocks = blocks
        self.block: list[T] = []
        self.pos = 0
        self.token = token

    async def refill(self) -> bool:
        """Load the next non-empty block; False at the end of the input."""
        while True:
            try:
                self.block, self.token = await self.blocks.__anext__()
            except StopAsyncIteration:
                self.block = []
                return False
            self.pos = 0
            if self.block:
                return True


async def _no_blocks() -> AsyncGenerator[tuple[list[Any], Any], None]:
    """The blocks of an input that had ended when a state was saved."""
    none: tuple[tuple[list[Any], Any], ...] = ()
    for pair in none:
        yield pair


class _Interleaved(Stream[Any]):
    """Round-robin interleave (weighted interleave is :func:`aloader.mix`'s job)."""

    def __init__(self, streams: Sequence[Stream[Any]], stop_on_first: bool) -> None:
        if not streams:
            raise ValueError("interleave needs at least one stream")
        self.streams = list(streams)
        self.stop_on_first = bool(stop_on_first)

    def _upstreams(self) -> Sequence[Stream[Any]]:
        return self.streams

    # A block is cut after a whole round: its token is where each input then was and which
    # inputs were still running.

    def _blocks_at(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[Any], Any], None]:
        return _discard(self._mixed(ctx, at), 0 if at is None else at["skip"])

    async def _mixed(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[Any], Any], None]:
        count = len(self.streams)
        starts: list[dict[str, Any] | None] = [None] * count if at is None else at["inputs"]
        running = [True] * count if at is None else list(at["running"])
        # One cursor per input; those that had ended when the state was saved stay closed.
        cursors = [
            _Cursor(stream._blocks_at(ctx, start) if live else _no_blocks(), _Encoded(start))
            for stream, start, live in zip(self.streams, starts, running, strict=True)
        ]
        try:
            async with Closing(self._round_robin(cursors, running)) as blocks:
                async for block in blocks:
                    yield block
        finally:
            with anyio.CancelScope(shield=True):
                for cursor in cursors:
                    await cursor.blocks.aclose()

    @staticmethod
    def _mark(cursors: list[_Cursor[Any]], running: list[bool]) -> tuple[Any, ...]:
        """Where every input is now (the token of the next block cut)."""
        marks = tuple((c.token, c.pos) if live else None
                      for c, live in zip(cursors, running, strict=True))
        return (marks, tuple(running))

    async def _round_robin(
        self, cursors: list[_Cursor[Any]], running: list[bool]
    ) -> AsyncGenerator[tuple[list[Any], Any], None]:
        active = [i for i, live in enumerate(running) if live]
        token = self._mark(cursors, running)
        out: list[Any] = []
        while active:
            still: list[int] = []
            for i in active:
                cursor = cursors[i]
                if cursor.pos >= len(cursor.block) and not await cursor.refill():
                    if self.stop_on_first:
                        if out:
                            yield out, token
                        return
                    running[i] = False
                    continue
                out.append(cursor.block[cursor.pos])
                cursor.pos += 1
                still.append(i)
            active = still
            if len(out) >= _BLOCK:
                yield out, token
                out = []
                token = self._mark(cursors, running)
        if out:
            yield out, token

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        marks, running = token
        inputs = [
            None if mark is None else _state_of(stream, mark[0], mark[1])
            for stream, mark in zip(self.streams, marks, strict=True)
        ]
        return {"stage": "interleave", "inputs": inputs, "running": list(running), "skip": skip}

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        check_stage(at, "interleave", "interleave")
        inputs = check_field(at, "inputs", list, "interleave")
        running = check_field(at, "running", list, "interleave")
        if len(inputs) != len(self.streams) or len(running) != len(self.streams):
            raise _bad_state("interleave", "inputs", f"has {len(inputs)} inputs, but this "
                             f"interleave has {len(self.streams)}")
        if not all(isinstance(flag, bool) for flag in running):
            raise _bad_state("interleave", "running", f"should be booleans, not {running!r}")
        for stream, start in zip(self.streams, inputs, strict=True):
            if start is not None:
                if not isinstance(start, dict):
                    raise _bad_state("interleave", "inputs", f"holds {start!r}, not a state")
                stream._check(start, slot)
