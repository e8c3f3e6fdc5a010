"""Mixing several streams into one: :func:`mix` (by weight) and :func:`interleave` (round-robin,
or by weight through :func:`mix`).

Invariant: step ``k`` of an epoch's mix consumes uniform number ``k`` (and one more for every
pick that found its source finished, see below) of one stream of uniforms, seeded by
``(seed, epoch, worker)``, and maps it to a source through the cumulative weights of the
sources still running at that step. The sequence of picks is therefore a function of the seed,
the epoch, the worker and the sources' lengths only: the uniforms are drawn in blocks
(``Generator.random(n)`` fills its output one draw after another, so one call of ``2n`` equals
two of ``n``), and the block size changes the speed, never the sequence. Each pick is exactly
a draw from the renormalised weights of the running sources (numpy's ``choice(p=...)`` maps a
uniform the same way), so each source's share is its weight's share in expectation.

A pick that finds its source finished consumes its uniform and is drawn again (with a fresh
uniform, from the sources still running under ``"all_exhausted"``): that keeps every item's
draw independent of how the previous ones fell.

Resume needs only ``(draws, taken, passes)``, see :class:`MixPosition`: the uniforms
consumed (the generator is re-seeded from the seed and the epoch and advanced past them), and
per source the items taken in its current pass and the passes begun.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import anyio
import numpy as np

from .._util import Closing
from ..data._dataset import is_stream_class
from ..data._random import GeneratorLike, as_generator, draw_seed
from ._context import _Context
from ._interleave import _Interleaved
from ._iterated import as_stream
from ._stream import Stream

__all__ = ("MixPosition", "StopRule", "interleave", "mix")

StopRule: TypeAlias = Literal["first_exhausted", "all_exhausted", "never"]
_STOPS: tuple[str, ...] = ("first_exhausted", "all_exhausted", "never")
# Uniforms drawn per call of the generator (speed only: the sequence does not depend on it).
_DRAWS = 1024
# Items a source's refill gathers (from as many of its blocks as that takes).
_GATHER = 1024
# Picks served at once by :func:`_serve` when every running source has this many items ready,
_VECTOR_MIN = 32
# ... and at most this many sources run (it costs a pass over the picks per source).
_VECTOR_SOURCES = 8


@dataclass
class MixPosition:
    """Where an epoch of a mix stands: all that resuming it needs besides its inputs' own.

    Attributes:
        draws: uniforms consumed since the start of the epoch (one per pick, plus one per pick
            that found its source finished).
        taken: per source, the items taken from its current pass.
        passes: per source, the passes begun (1 once it is first read; more with
            ``stop="never"``).
        done: per source, whether it has finished for good.
    """

    draws: int
    taken: list[int]
    passes: list[int]
    done: list[bool]


async def _blocks_of(
    pairs: AsyncGenerator[tuple[list[Any], Any], None],
) -> AsyncGenerator[list[Any], None]:
    """An input's blocks without their resume tokens (a mix is resumed by counting)."""
    async with Closing(pairs) as blocks:
        async for block, _token in blocks:
            yield block


class _Input:
    """One source of a mix: its current pass, its block and the position in it.

    A refill gathers the source's blocks up to ``_GATHER`` items (or the end of the pass), so
    that :func:`_serve` serves long runs of picks whatever the source's block size; the
    stage holds at most that block per source. The end of the pass, or an error, found while
    gathering is reported at the refill after, once the items before it are taken.
    """

    __slots__ = ("block", "blocks", "ctx", "ended", "error", "passes", "pos", "stream",
                 "taken")

    def __init__(self, stream: Stream[Any], ctx: _Context) -> None:
        self.stream = stream
        self.ctx = ctx
        self.blocks: AsyncGenerator[list[Any], None] | None = None
        self.block: list[Any] = []
        self.pos = 0
        self.taken = 0  # items of the current pass in blocks before ``block``
        self.passes = 0
        self.ended = False  # the pass ended after ``block``
        self.error: Exception | None = None  # ... or failed after it

    def start_pass(self) -> None:
        # Pass p of epoch e reads the source as its own epoch e + p would: a new shard order
        # and new shuffles for every pass, reproducibly.
        ctx = self.ctx
        if self.passes:
            ctx = dataclasses.replace(ctx, epoch=ctx.epoch + self.passes)
        self.blocks = _blocks_of(self.stream._blocks_at(ctx, None))
        self.block = []
        self.pos = 0
        self.taken = 0
        self.passes += 1
        self.ended = False

    async def refill(self) -> bool:
        """Load the next items of the current pass; False at its end."""
        self.taken += len(self.block)
        self.block = []
        self.pos = 0
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        if self.ended:
            return False
        if self.blocks is None:
            self.start_pass()
        assert self.blocks is not None
        gathered: list[Any] = []
        while len(gathered) < _GATHER:
            try:
                block = await self.blocks.__anext__()
            except StopAsyncIteration:
                self.ended = True
                await self.close()
                break
            except Exception as exc:
                if not gathered:
                    raise
                self.error = exc
                break
            if block:
                if gathered:
                    gathered.extend(block)
                else:
                    gathered = block if len(block) >= _GATHER else list(block)
        self.block = gathered
        return bool(gathered)

    def in_pass(self) -> int:
        """Items taken from the current pass."""
        return self.taken + self.pos

    async def close(self) -> None:
        blocks, self.blocks = self.blocks, None
        if blocks is not None:
            with anyio.CancelScope(shield=True):
                await blocks.aclose()


def _serve(picks: Any, inputs: list[_Input], out: list[Any]) -> int:
    """Serve the longest prefix of ``picks`` that the sources' current blocks can, at once.

    The result is the item-by-item loop's: the ``j``-th pick of source ``s`` in the prefix
    takes the ``j``-th item left in ``s``'s block. Returns the picks served. One pass over
    ``picks`` per source picked: meant for a few sources.
    """
    count = len(picks)
    where: list[Any] = []  # per source picked: (index, positions in picks)
    for index in np.flatnonzero(np.bincount(picks)).tolist():
        positions = np.flatnonzero(picks == index)
        left = len(inputs[index].block) - inputs[index].pos
        if len(positions) > left:
            count = min(count, int(positions[left]))  # the first pick it cannot serve
        where.append((index, positions))
    if count == 0:
        return 0
    flat: list[Any] = []
    slots = np.empty(count, dtype=np.intp)  # output position -> its item in ``flat``
    for index, positions in where:
        positions = positions[: np.searchsorted(positions, count)]
        if not len(positions):
            continue
        source = inputs[index]
        taken = len(positions)
        slots[positions] = np.arange(len(flat), len(flat) + taken)
        flat.extend(source.block[source.pos : source.pos + taken])
        source.pos += taken
    if count == 1:
        out.append(flat[0])
    else:
        out.extend(operator.itemgetter(*slots.tolist())(flat))
    return count


def _check_weights(weights: object, count: int) -> list[float]:
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (Sequence, np.ndarray)):
        raise TypeError(
            f"weights should be a sequence of numbers, one per stream, but got {weights!r}"
        )
    values: list[float] = []
    for weight in weights:
        if isinstance(weight, bool) or not isinstance(weight, (int, float, np.number)):
            raise TypeError(f"weights should be numbers, but got weights={list(weights)!r}")
        values.append(float(weight))
    if len(values) != count:
        raise ValueError(f"mix got {count} streams but {len(values)} weights")
    if any(not math.isfinite(w) or w < 0 for w in values):
        raise ValueError(f"weights should be finite and non-negative, but got weights={values}")
    if not any(w > 0 for w in values):
        raise ValueError(f"weights should not all be zero (they need a positive sum), but "
                         f"got weights={values}")
    return values


def _scaled(weights: Sequence[float]) -> np.ndarray[Any, np.dtype[np.float64]]:
    """The weights as an array whose sums neither overflow nor lose the uniforms' precision.

    ``[1e308, 1e308]`` sum to infinity (every pick would map to the last source) and
    ``[5e-324, 5e-324]`` to a subnormal (``u * total`` rounds most uniforms to one end): such
    weights are divided by the largest (the shares are the same). Others are kept as they are,
    so that a seed gives the same sequence as it always has."""
    array = np.array(weights, dtype=np.float64)
    total = sum(weights)  # left to right, as the cumulative sums: inf where they overflow
    if _TINY < total < _HUGE:
        return array
    return array / float(array.max())


# Sums of weights kept as they are (see _scaled): far from overflow and from the subnormals.
_TINY, _HUGE = 2.0 ** -900, 2.0 ** 900


class _Mixed(Stream[Any]):
    def __init__(
        self,
        streams: Sequence[Any],
        weights: Sequence[float],
        seed: GeneratorLike,
        stop: str,
    ) -> None:
        if isinstance(streams, (str, bytes, Stream)) or not isinstance(streams, Sequence):
            raise TypeError(
                f"streams should be a sequence of streams (or iterables), but got {streams!r}"
            )
        if not streams:
            raise ValueError("mix needs at least one stream")
        if stop not in _STOPS:
            raise ValueError(f"stop should be one of {', '.join(map(repr, _STOPS))}, but got "
                             f"stop={stop!r}")
        self.streams = [as_stream(s) for s in streams]
        self.weights = _check_weights(weights, len(self.streams))
        self.stop = stop
        self.seed = draw_seed(as_generator(seed))
        #: The position of the latest epoch run in this process (for inspection and resume).
        self.position: MixPosition | None = None

    def _upstreams(self) -> Sequence[Stream[Any]]:
        return self.streams

    def __repr__(self) -> str:
        return f"mix({len(self.streams)} streams, weights={self.weights}, stop={self.stop!r})"

    async def _blocks(self, ctx: _Context) -> AsyncGenerator[list[Any], None]:
        rng = ctx.rng(self.seed)
        inputs = [_Input(stream, ctx) for stream in self.streams]
        weights = _scaled(self.weights)
        live = weights > 0  # a source of weight 0 is never picked, hence never read
        stop = self.stop
        position = MixPosition(0, [0] * len(inputs), [0] * len(inputs), [False] * len(inputs))
        self.position = position
        uniforms = rng.random(_DRAWS)
        used = 0  # uniforms of ``uniforms`` consumed
        before = 0  # uniforms consumed before ``uniforms`` was drawn

        def note() -> None:
            position.draws = before + used
            position.taken = [source.in_pass() for source in inputs]
            position.passes = [source.passes for source in inputs]

        out: list[Any] = []
        try:
            while live.any():
                if used == len(uniforms):
                    before += used
                    uniforms = rng.random(_DRAWS)
                    used = 0
                cdf = np.cumsum(np.where(live, weights, 0.0))
                last = int(np.flatnonzero(live)[-1])
                running = int(live.sum())
                # side="right": the first source whose cumulative weight exceeds u * total, so
                # a finished source (an empty interval) is never picked; the clip guards the
                # rounding of u * total up to total.
                picks = np.minimum(
                    np.searchsorted(cdf, uniforms[used:] * cdf[-1], side="right"), last)
                listed: list[int] | None = None  # ``picks`` as a list, once the loop needs it
                first = used  # ``used`` is ``first + step`` below
                step, count = 0, len(picks)
                changed = False
                while step < count:
                    if count - step >= _VECTOR_MIN and running <= _VECTOR_SOURCES and all(
                            len(s.block) - s.pos >= _VECTOR_MIN
                            for s, ok in zip(inputs, live, strict=True) if ok):
                        step += _serve(picks[step:], inputs, out)
                    if step == count:
                        break
                    # Item by item, up to the next pick whose source needs a new block.
                    if listed is None:
                        listed = picks.tolist()
                    while step < count:
                        source = inputs[listed[step]]
                        pos = source.pos
                        block = source.block
                        if pos >= len(block):
                            break
                        out.append(block[pos])
                        source.pos = pos + 1
                        step += 1
                    if step == count:
                        break
                    index = listed[step]
                    source = inputs[index]
                    used = first + step
                    try:
                        more = await source.refill()
                        if not more and stop == "never" and source.in_pass() > 0:
                            source.start_pass()  # a new pass over a source that had items
                            more = await source.refill()
                    except Exception:
                        # What was mixed before a failing source is delivered before its error
                        # (not on cancellation: a cancelled generator must not yield).
                        if out:
                            note()
                            yield out
                        raise
                    step += 1  # this pick's uniform is spent, whatever it found
                    if more:
                        out.append(source.block[0])
                        source.pos = 1
                        continue
                    used = first + step
                    position.done[index] = True
                    if stop == "first_exhausted":
                        note()
                        if out:
                            yield out
                        return
                    # "all_exhausted" (or an empty pass under "never"): redraw without it.
                    live[index] = False
                    changed = True
                    break
                used = first + step
                if out and (not changed or len(out) >= _DRAWS):
                    note()
                    yield out
                    out = []
            note()
            if out:
                yield out
        finally:
            note()
            with anyio.CancelScope(shield=True):
                for source in inputs:
                    await source.close()


def mix(
    streams: Sequence[Stream[Any] | Any],
    weights: Sequence[float],
    *,
    seed: GeneratorLike = None,
    stop: StopRule = "first_exhausted",
) -> Stream[Any]:
    """Mix several streams by weight: each item comes from a source drawn at random.

    At every step a source is picked with probability proportional to its weight, among the
    sources still running, from a generator seeded by ``(seed, epoch, worker)`` as the other
    random stages are (:meth:`Stream.shuffle`): every epoch under a :class:`DataLoader` (or
    after :meth:`Stream.set_epoch`) draws a new sequence, and the same seed gives the same
    sequence of epochs, run after run. The sequence of picks is a function of the seed, the
    epoch, the worker and the sources' lengths only (not of how items arrive in blocks, nor of
    the block of draws), and each source's share of the items is its weight's share in
    expectation. A source is read only as it is picked; the stage holds, per source, its
    blocks gathered up to 1024 items (one block when its blocks are larger).

    With loader worker processes, every worker mixes its own share of each source (sharded
    sources split their shards across workers and ranks themselves), with its own draws. So
    with ``stop="all_exhausted"`` every item of every source is delivered exactly once per
    epoch over all workers and ranks.

    Args:
        streams: the sources: streams, or anything :func:`as_stream` accepts.
        weights: one non-negative, finite weight per stream, not all zero (relative: they need
            not sum to 1). A source of weight 0 is never read.
        seed: None (fresh entropy), an int or a numpy Generator; one base seed is drawn from it
            at construction.
        stop: when the mix ends:

            - ``"first_exhausted"`` (the default, as Hugging Face's ``interleave_datasets``):
              at the first pick of a source that has no item left. The other sources are not
              drained, so the shares stay those of the weights up to the end.
            - ``"all_exhausted"``: a finished source drops out and the others go on, with
              their weights renormalised, until every source of positive weight has ended:
              every item of every source once. Towards the end the shares drift from the
              weights (only the longest sources are left).
            - ``"never"``: a finished source starts a new pass (pass ``p`` of epoch ``e``
              reads it as its own epoch ``e + p`` would: new shard order and shuffles), so the
              shares match the weights forever and **the epoch never ends**: bound it yourself
              (e.g. a number of steps per epoch). Finite sources repeat their items; a source
              whose pass yields nothing drops out (rather than spin), and the mix ends when
              every source has.

    Returns:
        A stream; ``set_epoch`` on it reaches every input, and the inputs' source counters
        (:func:`~aloader.streams._sourcestats.source_stats`) keep counting.

    Raises:
        TypeError: ``streams`` is not a sequence, or ``weights`` is not a sequence of numbers.
        ValueError: no stream, ``weights`` of another length, negative, infinite, NaN or all
            zero, or an unknown ``stop``.
    """
    return _Mixed(streams, weights, seed, stop)


def interleave(
    *streams: Stream[Any] | Any,
    weights: Sequence[float] | None = None,
    seed: GeneratorLike = None,
    stop_on_first: bool = False,
) -> Stream[Any]:
    """Mix several streams into one.

    By default items alternate round-robin (one from each input in turn); an input that ends
    drops out and the others go on. With ``weights``, each item comes from an input drawn at
    random with those relative weights (renormalised over the inputs still running),
    reproducibly from ``seed``, the epoch and the worker: that is :func:`aloader.mix` with
    ``stop="all_exhausted"`` (``"first_exhausted"`` with ``stop_on_first``), whose sequence
    does not depend on the inputs' block sizes. Inputs are read as needed: the stage holds one
    block of each input (round-robin), or per input its blocks gathered up to 1024 items
    (weighted).

    Args:
        *streams: streams, or anything :func:`as_stream` accepts.
        weights: relative weights, one per stream, or None for round-robin.
        seed: None, an int or a numpy Generator (used with ``weights``).
        stop_on_first: end as soon as any input ends (the others are not drained).

    Returns:
        A stream; ``set_epoch`` on it reaches every input.

    Raises:
        ValueError: no stream, or bad weights.
        TypeError: weights that are not numbers, or a list (or tuple) of streams (or iterable
            datasets) given as one argument (``interleave([a, b])``, the way :func:`mix` takes
            them), which would be one input whose items are the streams themselves.
    """
    for given in streams:
        if isinstance(given, (list, tuple)) and any(is_stream_class(s) for s in given):
            raise TypeError("interleave takes the streams as separate arguments, "
                            "interleave(a, b) or interleave(*streams), but got a "
                            f"{type(given).__name__} of streams as one of them")
    if weights is not None:
        stop: StopRule = "first_exhausted" if stop_on_first else "all_exhausted"
        return mix(list(streams), weights, seed=seed, stop=stop)
    return _Interleaved([as_stream(s) for s in streams], stop_on_first)
