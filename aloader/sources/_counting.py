"""What a source's stats count: an epoch's content, not its reads.

Each record, byte, skipped record and shard end of an epoch's reading is counted once, however
often a part of it is read again: by a chain reopened after a KeyboardInterrupt, a shuffle or
a mix replaying its input, a resume from a state this stream saved (one reading:
``_Context.reading``). Each pass over a consumer's shards keeps a :class:`_Tally` in its
reading: how far it counted. Shards are decoded in order, one at a time, so the tally holds
the shard being read (those before it were counted to their end) and, of it, where counting
got; a read counts only beyond that. Everything is numbered by position in the shard's
content, so a read again from anywhere (a block's offset, the start of a compressed shard)
meets the same numbers.
"""

from __future__ import annotations

import sys
from typing import Any

from .._exceptions import RecordError
from .._stats import SourceStats
from ..streams._context import _Context
from ._formats import BadRecords


def _fresh(counted: int, first: int, end: int) -> int:
    """How many of the positions ``first`` to ``end - 1`` lie at or after ``counted``."""
    return end - max(first, counted) if end > counted else 0


class _Tally:
    """How far a reading counted one pass over a consumer's shards (or one count of its own):
    the shards before ``shard`` to their end; of ``shard``, its content's bytes before offset
    ``bytes``, its records numbered below ``records``, its skipped records up to ``skipped``
    (a malformed record's (byte offset, number among those at that offset), see
    :class:`_Counting`), and its end if ``ended``.

    A pass resumed by a new reading (a state saved by another stream) starts its tally at the
    position: that shard's bytes and skipped records from the offset of the position's block,
    its records from the position's.
    """

    __slots__ = ("bytes", "ended", "records", "shard", "skipped")

    def __init__(self, shard: int = -1, records: int = 0, offset: int = 0) -> None:
        self.shard = shard
        self.records = records
        self.bytes = offset
        self.skipped = (offset, -1)
        self.ended = False

    def new_records(self, first: int, end: int) -> int:
        """Of the records numbered ``first`` to ``end - 1``, how many were not counted yet
        (they are now)."""
        fresh = _fresh(self.records, first, end)
        if fresh:
            self.records = end
        return fresh

    def new_bytes(self, first: int, end: int) -> int:
        """Of the content's bytes ``first`` to ``end - 1``, how many were not counted yet
        (they are now)."""
        fresh = _fresh(self.bytes, first, end)
        if fresh:
            self.bytes = end
        return fresh


#: The tally of a shard read again after its pass had moved on: all of it counted.
_COUNTED = _Tally(sys.maxsize, sys.maxsize, sys.maxsize)
_COUNTED.ended = True


def _tally(ctx: _Context, key: Any, records: int | None = None, shard: int = -1,
           offset: int = 0) -> tuple[_Tally, bool]:
    """The tally of ``key`` in ``ctx``'s reading, and whether it is new: from the start, or
    with ``records`` from a resumed position (the number of its first record, and its
    ``shard`` and block's ``offset``)."""
    counted: _Tally | None = ctx.reading.get(key)
    if counted is not None:
        return counted, False
    counted = ctx.reading[key] = _Tally() if records is None else _Tally(shard, records,
                                                                          offset)
    return counted, True


class _Counting(BadRecords):
    """One read of shard ``index`` of a pass, counting in its source's stats what the pass's
    reading had not counted (``pass_``, a :class:`_Tally`), and the policy for the shard's
    malformed records (which the decoder calls it with).

    A skipped record is numbered by its byte offset and, for several errors at one offset,
    its rank among them: errors come in the order of the content, so a read again from a
    record's start meets each with the same number.
    """

    __slots__ = ("_index", "_last", "_pass", "tally")

    def __init__(self, skip: bool, stats: SourceStats, pass_: _Tally, index: int) -> None:
        super().__init__(skip, stats)
        self._pass = pass_
        self._index = index
        self._last = (-2, 0)  # the number of the last error met
        self.tally = pass_

    def start(self) -> None:
        """The read begins (shards are decoded in order): its shard's tally."""
        pass_ = self._pass
        if self._index > pass_.shard:  # the pass's first read of this shard
            pass_.shard = self._index
            pass_.bytes = pass_.records = 0
            pass_.skipped = (0, -1)
            pass_.ended = False
        self.tally = pass_ if self._index == pass_.shard else _COUNTED

    def count_bytes(self, first: int, end: int) -> None:
        """Bytes ``first`` to ``end - 1`` of the content were fed to the decoder."""
        self.stats.bytes += self.tally.new_bytes(first, end)

    def count_records(self, first: int, end: int) -> None:
        """Records ``first`` to ``end - 1`` of the shard were decoded."""
        self.stats.records += self.tally.new_records(first, end)

    def __call__(self, error: RecordError) -> bool:
        if not self.skip:
            return False
        offset = error.offset or 0
        last = self._last
        number = self._last = (offset, last[1] + 1 if last[0] == offset else 0)
        counted = self.tally
        if number <= counted.skipped:
            return True  # counted by an earlier read of the reading
        counted.skipped = number
        return super().__call__(error)

    def end(self, error: RecordError | None = None) -> bool:
        """The shard's end, counted once in its reading; with ``error``, a corrupt stream
        that ends it, one skipped record (False: not skipped, to be raised)."""
        if error is not None and not self.skip:
            return False
        counted = self.tally
        if not counted.ended:
            counted.ended = True
            if error is not None:
                BadRecords.__call__(self, error)
            self.stats.shards += 1
        return True
