"""``Stream.shuffle``: a buffer of ``buffer_size`` items, each new item taking the place of a
uniformly chosen one, which is emitted.

:class:`ShuffleStage` is the stage's whole behaviour; its stream class
(:class:`aloader.streams._stream._Shuffled`) is made where ``Stream.shuffle`` is defined, so
that this module needs :class:`~aloader.Stream` only for its annotations (no import cycle).

Invariant: the stage never holds more than ``buffer_size`` items, and its order depends only
on the input order, the seed, the epoch and the worker; its state holds no item (see the
resume notes in :class:`ShuffleStage`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from .._util import Closing, check_int
from ..data._random import GeneratorLike, as_generator, draw_seed, permutation
from ._context import _BLOCK, _Context
from ._positions import (
    _bad_state,
    _check_upstream,
    _Encoded,
    _Skip,
    _state_of,
    check_field,
    check_same,
    check_stage,
)

if TYPE_CHECKING:
    from ._stream import Stream

T_co = TypeVar("T_co", covariant=True)


class ShuffleStage(Generic[T_co]):
    """The shuffle stage: what ``_Shuffled`` (a :class:`~aloader.Stream`) does."""

    def __init__(self, upstream: Stream[T_co], buffer_size: int, seed: GeneratorLike) -> None:
        self.upstream = upstream
        self.buffer_size = check_int("buffer_size", buffer_size)
        # Without a seed, one is drawn once, here, and recorded in every state of the stream
        # (its "seeds"), as a loader records its generator: a resume in another process,
        # whose shuffle drew another, adopts it (see Stream._unseeded).
        self.seed_given = seed is not None
        self.seed = draw_seed(as_generator(seed))
        #: The most items the buffer has held (a bound the tests check).
        self.max_buffered = 0

    def _upstreams(self) -> Sequence[Stream[Any]]:
        return (self.upstream,)

    # Resume. The buffer's items are not recorded: its output from any point is a function
    # of the input from some earlier point (a checkpoint: the input's position, the random
    # state, how full the buffer was) as long as every item buffered at that checkpoint has
    # been emitted since. So a state names the latest such checkpoint and how many outputs
    # to discard; resuming replays the input from there, buffered items standing in as
    # placeholders, all of them emitted among the discarded outputs. ``ids`` holds a lower
    # bound of the input number of each buffered item (exact but for slots picked twice in a
    # block), so its minimum bounds the oldest item still buffered: checkpoints older than
    # that are dropped. The replay reads back about ``buffer_size * ln(buffer_size)`` items,
    # what it takes for the buffer to turn over.

    def _blocks_at(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        return self._shuffled(ctx, at)

    async def _shuffled(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        rng = ctx.rng(self.seed)
        size = self.buffer_size
        buffer: list[Any] = []
        ingested = 0  # input items taken so far (numbered from the epoch's start)
        emitted = 0  # output items so far, in this run
        discard = 0  # outputs the resumed consumer already had
        dummies = 0  # placeholders still in the buffer
        checkpoints: deque[tuple[int, tuple[Any, ...]]] = deque()
        if at is not None:
            rng.bit_generator.state = at["rng"]
            dummies = at["fill"]
            buffer = [_PLACEHOLDER] * dummies
            ingested = at["ingested"]
            discard = at["skip"]
            checkpoints.append((ingested, (_Encoded(at["upstream"]), at["rng"], dummies, 0,
                                           ingested)))
        # Grown with the buffer (up to ``size``), never allocated for the size it may reach:
        # ``shuffle(10**12)`` over a short stream holds only what the stream holds.
        ids = np.full(max(len(buffer), min(size, _BLOCK)), ingested, dtype=np.int64)
        every = max(_BLOCK, size)  # input items between checkpoints
        oldest = ingested  # a lower bound of the oldest buffered item's number
        upstream = self.upstream._blocks_at(ctx, None if at is None else at["upstream"])

        def cut(out: list[Any]) -> tuple[list[Any], Any] | None:
            nonlocal emitted, discard, dummies
            token: Any = (checkpoints[0][1], emitted)
            emitted += len(out)
            if discard:
                if len(out) <= discard:
                    discard -= len(out)
                    dummies -= _count_placeholders(out) if dummies else 0
                    return None
                dropped, out = out[:discard], out[discard:]
                if dummies:
                    dummies -= _count_placeholders(dropped)
                token, discard = _Skip(token, discard), 0
            if dummies and _count_placeholders(out):
                raise ValueError("cannot resume this shuffle: its state does not fit its input "
                                 "(a buffered item would be emitted twice)")
            return out, token

        async with Closing(upstream) as blocks:
            async for block, up_token in blocks:
                if not checkpoints or ingested - checkpoints[-1][0] >= every:
                    if buffer:
                        oldest = max(oldest, int(ids[: len(buffer)].min()))
                    while len(checkpoints) > 1 and checkpoints[1][0] <= oldest:
                        checkpoints.popleft()
                    checkpoints.append((ingested, (up_token, rng.bit_generator.state,
                                                   len(buffer), emitted, ingested)))
                room = size - len(buffer)
                if room > 0:
                    taken = block[:room]
                    if len(buffer) + len(taken) > len(ids):
                        ids = _grown(ids, len(buffer) + len(taken), size)
                    ids[len(buffer) : len(buffer) + len(taken)] = np.arange(
                        ingested, ingested + len(taken))
                    buffer.extend(taken)
                    ingested += len(taken)
                    self.max_buffered = max(self.max_buffered, len(buffer))
                    if len(block) <= room:
                        continue
                    block = block[room:]
                drawn = rng.integers(0, size, size=len(block))
                ids[drawn] = np.arange(ingested, ingested + len(block))
                ingested += len(block)
                out: list[T_co] = []
                append = out.append
                for slot, item in zip(drawn.tolist(), block, strict=True):
                    append(buffer[slot])
                    buffer[slot] = item
                pair = cut(out)
                if pair is not None:
                    yield pair
        if buffer:
            order = permutation(rng, len(buffer)).tolist()
            pair = cut([buffer[i] for i in order])
            if pair is not None:
                yield pair

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        (up_token, rng_state, fill, cp_emitted, cp_ingested), emitted = token
        return {
            "stage": "shuffle", "buffer_size": self.buffer_size, "seed": self.seed,
            "upstream": _state_of(self.upstream, up_token, 0), "rng": rng_state,
            "fill": fill, "ingested": cp_ingested, "skip": emitted - cp_emitted + skip,
        }

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        check_stage(at, "shuffle", "shuffle")
        check_same(at, "buffer_size", self.buffer_size, "shuffle")
        if self.seed_given:
            check_same(at, "seed", self.seed, "shuffle")
        else:  # drawn: the state's (its stream's "seeds") is adopted
            check_field(at, "seed", int, "shuffle")
        fill = check_field(at, "fill", int, "shuffle")
        if fill > self.buffer_size:
            raise _bad_state("shuffle", "fill", f"is {fill}, more than the buffer_size")
        check_field(at, "ingested", int, "shuffle")
        rng_state = check_field(at, "rng", dict, "shuffle")
        try:
            np.random.default_rng().bit_generator.state = rng_state
        except (TypeError, ValueError, KeyError) as exc:
            raise _bad_state("shuffle", "rng", f"is not a PCG64 state: {exc}") from None
        _check_upstream(self.upstream, at, slot)


def _grown(ids: npt.NDArray[np.int64], need: int, size: int) -> npt.NDArray[np.int64]:
    """``ids`` with room for at least ``need`` (doubling, at most ``size``)."""
    grown = np.empty(min(size, max(need, 2 * len(ids))), dtype=np.int64)
    grown[: len(ids)] = ids
    return grown


_PLACEHOLDER: Any = object()  # a buffered item of a resumed shuffle, emitted before the resume


def _count_placeholders(items: list[Any]) -> int:
    return sum(1 for item in items if item is _PLACEHOLDER)
