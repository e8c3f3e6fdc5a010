"""Positions in a stream's epoch: the tokens stages hand on, the states they encode to, and the
checks a state passes before it is loaded.

Every stage hands on (block, token) pairs (:meth:`Stream._blocks_at`). A token is small,
immutable data (no items) that, with a count ``skip``, names a position in the stage's
output: "resume at the start of this token's block, then discard ``skip`` items".
:meth:`Stream._state` turns (token, skip) into a JSON-able dict; ``_blocks_at(ctx, state)``
resumes there. Encoding happens only when a state is asked for, so following the consumer
costs a reference and a counter per batch.

Invariant (each stage keeps it): resuming its output from ``_state(token, skip)`` yields
exactly what the uninterrupted epoch yields after that position (the epoch, worker and seeds
being the same).

No stage (nor the consumer) keeps a block it handed on once it asks for the next: a stage
that forwards blocks drops its reference after the yield (``del block``), and the consumer
keeps the block's length, not the block. So a consumed block is freed before the next one
is made, into the memory it held, still in the CPU's caches: kept, each block of Parquet
rows (~2 MB of dicts) was made while the last one was alive (see ParquetRows._items).

A state is checked whole (:func:`check_field`, :func:`check_stage`, :func:`check_same`, each
stage's ``_check``) before anything of it is applied; a bad one is a ValueError naming the
field.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, TypeVar

from .._util import Closing

if TYPE_CHECKING:
    from ._stream import Stream

T = TypeVar("T")


_START: Any = None  # the token of an iterator that has received no block yet
_END: dict[str, Any] = {"stage": "end", "skip": 0}  # an epoch's position after its last item
_UNORDERED: Any = "unordered"  # the token of map(ordered=False)'s blocks: no position


class _Skip:
    """The token of a block whose first ``skip`` items were discarded (on resume)."""

    __slots__ = ("skip", "token")

    def __init__(self, token: Any, skip: int) -> None:
        self.token = token
        self.skip = skip

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Skip, (self.token, self.skip))


class _Encoded:
    """A token that is already a state (where a resumed stage started; None: its start)."""

    __slots__ = ("state",)

    def __init__(self, state: dict[str, Any] | None) -> None:
        self.state = state

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Encoded, (self.state,))


def _state_of(stage: Stream[Any], token: Any, skip: int) -> dict[str, Any] | None:
    """The state of ``stage`` at item ``skip`` of the block ``token`` names."""
    while type(token) is _Skip:
        token, skip = token.token, token.skip + skip
    if type(token) is _Encoded:
        state = token.state
        if state is None:
            if skip:
                raise AssertionError("a stage's start has no items before its first block")
            return None
        return {**state, "skip": state["skip"] + skip} if skip else state
    return stage._state(token, skip)


def _discard(
    pairs: AsyncGenerator[tuple[list[T], Any], None], count: int, where: str = "its input"
) -> AsyncGenerator[tuple[list[T], Any], None]:
    """``pairs`` without their first ``count`` items (what the resumed consumer had); ``pairs``
    itself when there are none (one generator less for every block to pass through).

    ``pairs`` that end before ``count`` items raise ``ValueError`` (naming ``where``): the
    state's position is past the end of the data, which changed since the state was saved
    (or the state is not this stream's); a resumed epoch is never silently shorter."""
    return _discarding(pairs, count, where) if count else pairs


async def _discarding(
    pairs: AsyncGenerator[tuple[list[T], Any], None], count: int, where: str
) -> AsyncGenerator[tuple[list[T], Any], None]:
    async with Closing(pairs) as blocks:
        async for block, token in blocks:
            if count:
                if len(block) <= count:
                    count -= len(block)
                    continue
                block, token = block[count:], _Skip(token, count)
                count = 0
            yield block, token
            del block  # not kept while the next is made (see the resume notes above)
    if count:
        raise _bad_state("position", "skip", f"is {count} items past the end of {where}: "
                         "the data changed since the state was saved, or the state is not "
                         "this stream's")


def _check_upstream(upstream: Stream[Any], at: dict[str, Any], slot: tuple[int, int, int],
                    field: str = "upstream") -> None:
    inner = check_field(at, field, (dict, type(None)), at.get("stage", "?"))
    if inner is not None:
        upstream._check(inner, slot)


def _bad_state(where: str, field: str, message: str) -> ValueError:
    return ValueError(f"cannot load this stream state: {where}: field {field!r} {message}")


def check_field(state: Any, field: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``state[field]``, checked to be of ``kind`` (an int is never a bool, nor negative)."""
    if not isinstance(state, dict):
        raise _bad_state(where, field, f"is missing: the state is not a dict but {state!r}")
    if field not in state:
        raise _bad_state(where, field, "is missing")
    value = state[field]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _bad_state(where, field, f"should be {_kind_name(kind)}, but is {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise _bad_state(where, field, f"should be non-negative, but is {value!r}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def check_stage(state: Any, stage: str, where: str) -> None:
    """``state`` is a position of a stage of kind ``stage`` (with its ``skip``)."""
    found = check_field(state, "stage", str, where)
    if found != stage:
        raise _bad_state(where, "stage", f"is {found!r}, but this stage is {stage!r}: the "
                                         "state comes from another stream")
    check_field(state, "skip", int, where)


def check_same(state: dict[str, Any], field: str, expected: Any, where: str) -> None:
    """``state[field] == expected``, else a ValueError naming the field and both values."""
    found = state.get(field)
    if found != expected:
        raise _bad_state(where, field, f"is {found!r}, but this stream has {expected!r}")
