"""Record formats: turn a shard's bytes, chunk by chunk, into records.

A decoder sees the shard as a sequence of byte chunks (from a file or an HTTP response) and
keeps the state that crosses chunk boundaries: the unfinished line or record, the line number
and the byte offset, so that a malformed record is reported with its location. Decoders never
hold more than one unfinished record besides the chunk in hand.
"""

from __future__ import annotations

import codecs
import gc
import io
import json
import math
import struct
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from .._exceptions import RecordError, SourceError
from .._stats import SourceStats

__all__ = (
    "BadRecords",
    "BinaryDecoder",
    "Decoder",
    "JsonLinesDecoder",
    "NpyDecoder",
    "TextDecoder",
)

T = TypeVar("T")


class BadRecords:
    """What to do with a malformed record: raise its error, or count it and go on."""

    __slots__ = ("skip", "stats")

    def __init__(self, skip: bool, stats: SourceStats) -> None:
        self.skip = skip
        self.stats = stats

    def __call__(self, error: RecordError) -> bool:
        """Count ``error`` and return True when skipping, else return False."""
        if not self.skip:
            return False
        self.stats.skipped += 1
        self.stats.skipped_errors.append(error)
        return True


class Decoder(Generic[T]):
    """Bytes of one shard in, records out.

    Args:
        name: the path or URL, for error messages.
        bad: the policy for malformed records.
        max_record_bytes: the largest line or record accepted (bounds the memory).
    """

    def __init__(self, name: str, bad: BadRecords, max_record_bytes: int) -> None:
        self.name = name
        self.bad = bad
        self.max_record_bytes = max_record_bytes
        #: The error to raise once the records before it are delivered (errors not skipped).
        self.pending: RecordError | None = None
        #: The shard's length in bytes, when its file or response tells it (else None).
        self.size: int | None = None
        #: (byte offset, record counter) where the first record of the latest block starts.
        self.mark: tuple[int, int] = (0, 0)

    #: Whether the decoder can start at a record's byte offset (``start_at``), for a resume
    #: that reads a shard from there; others are read from the start, skipping records.
    seekable = False
    #: The most bytes of a chunk decoded into one block (None: the whole chunk), for formats
    #: whose records the cyclic GC tracks (see :class:`JsonLinesDecoder`).
    piece: int | None = None

    def start_at(self, offset: int, counter: int) -> None:
        """Decode from byte ``offset`` of the shard, a ``mark`` (only if ``seekable``)."""
        raise NotImplementedError

    def set_size(self, size: int) -> None:
        """The shard holds ``size`` bytes in all: formats whose headers promise a length check
        it against this, before reading on."""
        self.size = size

    def feed(self, data: bytes) -> list[T]:
        """The records completed by ``data``, the next chunk of the shard."""
        raise NotImplementedError

    def finish(self) -> list[T]:
        """The last records at the end of the shard, a block per call (call until it returns
        none); reports a truncated record."""
        return []

    def _error(self, where: str, what: str, *, offset: int, line: int | None = None) -> bool:
        """Report a bad record: True to go on (skipped), False to stop (``pending`` is set)."""
        error = RecordError(f"{self.name}: {where}: {what}", source=self.name, offset=offset,
                            line=line)
        if self.bad(error):
            return True
        self.pending = error
        return False


# --------------------------------------------------------------------------- lines


class _LineDecoder(Decoder[T]):
    """Splits chunks into lines (``\\n``-terminated, ``\\r\\n`` allowed) for a line format.

    An unfinished line is kept as the list of its pieces and joined once, when its newline
    arrives: each byte is copied a bounded number of times, so a line spanning many chunks
    costs time linear in its length.
    """

    def __init__(self, name: str, bad: BadRecords, max_record_bytes: int) -> None:
        super().__init__(name, bad, max_record_bytes)
        self._carry: list[bytes] = []  # pieces of the unfinished line, none with a newline
        self._carried = 0  # their total length
        self._offset = 0  # byte offset of the first unparsed byte
        self._line = 0  # lines parsed so far
        self._discarding = False  # skipping the rest of an oversized line

    seekable = True

    def start_at(self, offset: int, counter: int) -> None:
        self._offset, self._line = offset, counter

    @staticmethod
    def _where(line: int, offset: int) -> str:
        return f"line {line} (byte offset {offset})"

    def _parse(self, body: bytes, first_line: int, first_offset: int) -> tuple[list[T], int]:
        """Records of the complete lines in ``body`` (without its last newline), and how many
        lines it held."""
        raise NotImplementedError

    def _take(self, body: bytes) -> list[T]:
        # A chunk's records are thousands of new objects at once: let the cyclic GC look at
        # them once after the chunk rather than every 700 allocations during it (15% of a
        # JSON Lines epoch). Left alone when the application turned the GC off itself.
        enabled = gc.isenabled()
        if enabled:
            gc.disable()
        self.mark = (self._offset, self._line)
        try:
            records, lines = self._parse(body, self._line, self._offset)
        finally:
            if enabled:
                gc.enable()
        self._line += lines
        self._offset += len(body) + 1
        return records

    def _join(self, tail: bytes | memoryview) -> bytes:
        """The carried pieces followed by ``tail``, as one string; the carry is emptied. With
        no carry, ``tail`` is made bytes (a copy of a view)."""
        if self._carry:
            joined = b"".join([*self._carry, tail])
            self._carry = []
            self._carried = 0
            return joined
        return tail if isinstance(tail, bytes) else bytes(tail)

    def feed(self, data: bytes) -> list[T]:
        if self.pending is not None:
            return []
        if self._discarding:
            newline = data.find(b"\n")
            if newline < 0:
                self._offset += len(data)
                return []
            self._offset += newline + 1
            self._line += 1
            self._discarding = False
            data = data[newline + 1 :]
        # Only the new bytes are searched: the carried ones hold no newline.
        cut = data.rfind(b"\n")
        records: list[T] = []
        if cut >= 0:
            # A view of the complete lines: the one copy is the join with the carried line
            # (the bytes themselves when nothing is carried).
            records = self._take(self._join(memoryview(data)[:cut] if self._carry
                                            else data[:cut]))
            data = data[cut + 1 :]
        if data:
            self._carry.append(data)
            self._carried += len(data)
        if self._carried > self.max_record_bytes and self.pending is None:
            self._too_long()
        return records

    def _too_long(self) -> None:
        line, offset = self._line + 1, self._offset
        self._error(self._where(line, offset),
                    f"line longer than max_record_bytes ({self.max_record_bytes} bytes)",
                    offset=offset, line=line)
        # Skipping: drop the line up to its newline.
        self._offset += self._carried
        self._carry = []
        self._carried = 0
        self._discarding = True

    def finish(self) -> list[T]:
        if self._discarding or not self._carry or self.pending is not None:
            return []
        records = self._take(self._join(b""))
        self._offset -= 1  # the last line had no newline
        return records


class TextDecoder(_LineDecoder[str]):
    """Lines as strings, without their line ending.

    Args:
        encoding: an ASCII-compatible encoding (utf-8, latin-1, ...).
    """

    def __init__(self, name: str, bad: BadRecords, max_record_bytes: int,
                 encoding: str = "utf-8") -> None:
        super().__init__(name, bad, max_record_bytes)
        self.encoding = encoding

    def _parse(self, body: bytes, first_line: int, first_offset: int) -> tuple[list[str], int]:
        try:
            text = body.decode(self.encoding)
        except UnicodeDecodeError:
            return self._parse_slowly(body, first_line, first_offset)
        lines = text.split("\n")
        count = len(lines)
        if "\r" in text:
            lines = [line[:-1] if line.endswith("\r") else line for line in lines]
        return lines, count

    def _parse_slowly(self, body: bytes, first_line: int,
                      first_offset: int) -> tuple[list[str], int]:
        raws = body.split(b"\n")
        out: list[str] = []
        offset = first_offset
        for number, raw in enumerate(raws, first_line + 1):
            try:
                line = raw.decode(self.encoding)
            except UnicodeDecodeError as exc:
                if not self._error(self._where(number, offset),
                                   f"cannot decode the line as {self.encoding}: {exc.reason} "
                                   f"(byte {exc.start} of the line)", offset=offset,
                                   line=number):
                    break
            else:
                out.append(line[:-1] if line.endswith("\r") else line)
            offset += len(raw) + 1
        return out, len(raws)


def _check_encoding(encoding: str) -> str:
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise ValueError(f"unknown encoding {encoding!r}") from None
    if "\n".encode(encoding) != b"\n":
        raise ValueError(
            f"encoding {encoding!r} is not ASCII-compatible; lines are split on the byte b'\\n'"
        )
    return encoding


# msgspec's JSON decoder: bytes in, the Python objects json.loads gives out (see
# JsonLinesDecoder). One instance serves every decoder: it keeps no state between calls.
_decode_json: Callable[[bytes], Any] = msgspec.json.Decoder().decode


def _json_loads(raw: bytes) -> Any:
    """One line's value, exactly as ``json.loads`` gives it.

    msgspec accepts a subset of what json.loads accepts and gives the same values for it
    (tested against json.loads in tests/sources/test_formats.py); what it refuses (``NaN``,
    ``Infinity``, numbers beyond a float's range, lone surrogate escapes, malformed lines)
    goes to json.loads, whose error names a malformed line.
    """
    try:
        return _decode_json(raw)
    except Exception:
        return json.loads(raw.decode("utf-8"))


class JsonLinesDecoder(_LineDecoder[Any]):
    """JSON Lines: one JSON value per line; blank lines are allowed and ignored.

    Each line is parsed on its own, so a value never spans lines and a line never holds two
    (decoding a chunk as one document, e.g. ``msgspec``'s ``decode_lines``, would accept
    ``"[1"``, ``"2]"`` as one record). The values are those of ``json.loads(line)``: dicts,
    lists, strings, ints of any size, floats (``NaN`` and ``Infinity`` accepted, numbers beyond
    a float's range are infinities), booleans and None. The parser is msgspec (a C decoder
    reading the bytes, without decoding them to text first); lines it refuses are parsed again
    by json.loads (see :func:`_json_loads`), which names the error of a malformed line.

    Args:
        loads: a custom parser (e.g. ``orjson.loads``) called with each line's text, or None
            for the default.
    """

    # Records are dicts and lists, objects the cyclic GC tracks. Decoded a 64 KiB chunk at a
    # time (~600 records of 100 bytes, 1,200 containers), they outnumber the youngest
    # generation's threshold (700), so every collection found a block or two of them still
    # waiting for the consumer and promoted them, and the older generations' collections then
    # walked them again: 20-30% of an epoch. Decoded 16 KiB at a time (and read ahead one
    # block deep, see JsonLines), a block is collated and freed before a collection finds it.
    piece = 1 << 14

    def __init__(self, name: str, bad: BadRecords, max_record_bytes: int,
                 loads: Callable[[str], Any] | None = None) -> None:
        super().__init__(name, bad, max_record_bytes)
        self.loads = loads

    def _parse(self, body: bytes, first_line: int, first_offset: int) -> tuple[list[Any], int]:
        raws = body.split(b"\n")
        try:
            if self.loads is not None:
                loads = self.loads
                records = [loads(raw.decode("utf-8")) for raw in raws]
            else:
                records = self._parse_fast(raws)
        except Exception:
            # A malformed line, or a value msgspec leaves to json.loads.
            return self._parse_slowly(raws, first_line, first_offset), len(raws)
        return records, len(raws)

    @staticmethod
    def _parse_fast(raws: list[bytes]) -> list[Any]:
        try:
            return list(map(_decode_json, raws))
        except Exception:
            # Blank lines hold no value: parse the others (a file with blank lines between
            # its records would otherwise take the careful path at every chunk).
            return list(map(_decode_json, [raw for raw in raws if raw.strip()]))

    def _parse_slowly(self, raws: list[bytes], first_line: int, first_offset: int) -> list[Any]:
        out: list[Any] = []
        offset = first_offset
        custom = self.loads
        for number, raw in enumerate(raws, first_line + 1):
            if raw.strip():
                try:
                    out.append(_json_loads(raw) if custom is None else custom(raw.decode("utf-8")))
                except UnicodeDecodeError as exc:
                    if not self._error(self._where(number, offset),
                                       f"invalid UTF-8: {exc.reason} (byte {exc.start} of the "
                                       "line)", offset=offset, line=number):
                        break
                except Exception as exc:
                    if not self._error(self._where(number, offset),
                                       f"invalid JSON: {type(exc).__name__}: {exc}; the line "
                                       f"starts {_preview(raw)}", offset=offset, line=number):
                        break
            offset += len(raw) + 1
        return out


def _preview(raw: bytes, limit: int = 60) -> str:
    text = raw[:limit].decode("utf-8", errors="replace")
    return repr(text) + ("..." if len(raw) > limit else "")


# --------------------------------------------------------------------------- binary


def _length_header(fmt: str) -> struct.Struct:
    try:
        header = struct.Struct(fmt)
        values = header.unpack(bytes(header.size))
    except struct.error as exc:
        raise ValueError(f"header should be a struct format, but got {fmt!r}: {exc}") from None
    if len(values) != 1 or not isinstance(values[0], int) or isinstance(values[0], bool):
        raise ValueError(
            f"header should be a struct format of one unsigned integer (e.g. '<I', '>Q'), "
            f"but got {fmt!r}"
        )
    return header


class BinaryDecoder(Decoder[bytes]):
    """Length-prefixed binary records: a ``header`` integer (struct format) then that many
    bytes.

    Args:
        header: struct format of the length, e.g. ``"<I"`` (little-endian uint32).
    """

    def __init__(self, name: str, bad: BadRecords, max_record_bytes: int,
                 header: str = "<I") -> None:
        super().__init__(name, bad, max_record_bytes)
        self._header = _length_header(header)
        self._buffer = bytearray()
        self._offset = 0  # byte offset of the buffer's start
        self._dead = False  # the rest of the shard cannot be framed
        self._count = 0

    seekable = True

    def start_at(self, offset: int, counter: int) -> None:
        self._offset, self._count = offset, counter

    def feed(self, data: bytes) -> list[bytes]:
        if self._dead:
            return []
        self.mark = (self._offset, self._count)
        buffer = self._buffer
        buffer += data
        size = self._header.size
        unpack = self._header.unpack_from
        limit = self.max_record_bytes
        records: list[bytes] = []
        pos = 0
        available = len(buffer)
        bad_length: int | None = None
        truncated: int | None = None  # offset of a record that cannot fit in the shard
        with memoryview(buffer) as view:
            while available - pos >= size:
                (length,) = unpack(buffer, pos)
                if length < 0 or length > limit:
                    bad_length = length
                    break
                end = pos + size + length
                if end > available:
                    if self.size is not None and self._offset + end > self.size:
                        truncated = self._offset + pos
                    break
                records.append(bytes(view[pos + size : end]))
                pos = end
        self._count += len(records)
        if bad_length is not None:
            offset = self._offset + pos
            self._dead = True
            buffer.clear()
            self._error(f"record {self._count} at byte offset {offset}",
                        f"its length header says {bad_length} bytes, more than "
                        f"max_record_bytes ({limit}); the rest of the shard cannot be read",
                        offset=offset)
            return records
        del buffer[:pos]
        self._offset += pos
        if truncated is not None:
            self._truncated()
        return records

    def _truncated(self) -> None:
        """The record at the buffer's start runs past the end of the shard."""
        offset = self._offset
        end = self.size if self.size is not None else offset + len(self._buffer)
        what = f"truncated record: the shard ends {end - offset} bytes into it"
        if len(self._buffer) >= self._header.size:
            (length,) = self._header.unpack_from(self._buffer)
            what += f" (its header promises {self._header.size} + {length} bytes)"
        self._dead = True
        self._buffer.clear()
        self._error(f"record {self._count} at byte offset {offset}", what, offset=offset)

    def finish(self) -> list[bytes]:
        if self._buffer and not self._dead:
            self._truncated()
        return []


# --------------------------------------------------------------------------- npy

_NPY_MAGIC = b"\x93NUMPY"
# Rows per block for arrays whose rows hold no bytes (shape (n, 0, ...)).
_EMPTY_ROWS_BLOCK = 1 << 12


class NpyDecoder(Decoder[Any]):
    """Rows of a ``.npy`` array (along its first axis), without loading the whole array.

    The header is parsed with ``numpy.lib.format``; rows are then cut from the data in blocks,
    each row a view into a writable block of the rows completed by one chunk. A 1-D array
    yields numpy scalars.
    """

    def __init__(self, name: str, bad: BadRecords, max_record_bytes: int) -> None:
        super().__init__(name, bad, max_record_bytes)
        self._buffer = bytearray()
        self._offset = 0
        self._dead = False
        self._rows_total = -1  # -1 until the header is parsed
        self._rows_done = 0
        self._dtype: np.dtype[Any] = np.dtype(np.uint8)
        self._row_shape: tuple[int, ...] = ()
        self._row_bytes = 0
        # A shard shorter than its header says: the rows it holds whole, then the error.
        self._intact: int | None = None
        self._truncation: tuple[str, int] = ("", 0)

    def _fail(self, what: str, offset: int) -> None:
        self._dead = True
        self._buffer.clear()
        self._error(f"byte offset {offset}", what, offset=offset)

    def _parse_header(self) -> bool:
        buffer = self._buffer
        if len(buffer) < 10:
            return False
        if bytes(buffer[:6]) != _NPY_MAGIC:
            self._fail("not a .npy file (bad magic string)", 0)
            return False
        major = buffer[6]
        if major == 1:
            total = 10 + int.from_bytes(buffer[8:10], "little")
        elif major in (2, 3):
            if len(buffer) < 12:
                return False
            total = 12 + int.from_bytes(buffer[8:12], "little")
        else:
            self._fail(f"unsupported .npy format version {major}.{buffer[7]}", 6)
            return False
        if self.size is not None and total > self.size:
            self._fail(f"truncated .npy header: it says {total} bytes, but the shard holds "
                       f"{self.size}", 8)
            return False
        if len(buffer) < total:
            if total > self.max_record_bytes:
                self._fail(f"header of {total} bytes exceeds max_record_bytes", 8)
            return False
        handle = io.BytesIO(bytes(buffer[:total]))
        try:
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
        except Exception as exc:  # numpy raises ValueError, SyntaxError, TokenError, ...
            self._fail(f"bad .npy header: {type(exc).__name__}: {exc}", 8)
            return False
        if dtype.hasobject:
            raise SourceError(f"{self.name}: arrays of Python objects (pickled) cannot be "
                              "streamed; save them with a plain dtype", source=self.name)
        if any(d < 0 for d in shape):
            self._fail(f"bad .npy header: negative dimension in shape {shape}", 8)
            return False
        if len(shape) == 0:
            raise SourceError(f"{self.name}: a 0-dimensional array has no rows to stream",
                              source=self.name)
        if fortran and len(shape) > 1:
            raise SourceError(f"{self.name}: a Fortran-ordered array cannot be streamed by "
                              "rows; save it in C order", source=self.name)
        self._rows_total = int(shape[0])
        self._row_shape = tuple(int(d) for d in shape[1:])
        self._dtype = dtype
        self._row_bytes = dtype.itemsize * math.prod(self._row_shape)
        if self._row_bytes > self.max_record_bytes:
            raise SourceError(f"{self.name}: rows of {self._row_bytes} bytes exceed "
                              f"max_record_bytes ({self.max_record_bytes})", source=self.name)
        del buffer[:total]
        self._offset = total
        return self._check_size()

    def _check_size(self) -> bool:
        """Whether the header's promise fits the shard's known size (else the error is set).

        A header is untrusted input: a count of rows far beyond the data must never be read
        for (nor allocated for). A shard that holds fewer rows than promised delivers those
        it holds whole, then fails where the data ends (as a truncated file is read anywhere
        else: the records before the damage, then the error).
        """
        if self.size is None or self._rows_total < 0:
            return True
        # From the header's end, not from here: a size told again after some rows (an HTTP
        # retry's answer, resumed from the byte where a cut body stopped) counts them too.
        header = self._offset - self._rows_done * self._row_bytes
        data = self.size - header
        promised = self._rows_total * self._row_bytes
        if promised == data:
            return True
        rows = data // self._row_bytes if self._row_bytes else 0
        promise = (f"the header promises {self._rows_total} rows of {self._row_bytes} bytes, "
                   f"{promised} bytes after its {header}, but the shard holds {data}")
        if promised > data and self._row_bytes:
            self._intact = rows
            self._truncation = (f"truncated array: the shard ends after {rows} of "
                                f"{self._rows_total} rows ({promise})",
                                self._offset + (rows - self._rows_done) * self._row_bytes)
            return self._truncated() if rows <= self._rows_done else True
        if promised > data:
            self._fail(f"truncated array: the shard ends after {rows} of {self._rows_total} "
                       f"rows ({promise})", self._offset)
        else:
            self._fail(f"unexpected bytes after the last row ({promise})", header + promised)
        return False

    def _truncated(self) -> bool:
        """Fail with the truncation :meth:`_check_size` found, its whole rows delivered."""
        self._fail(*self._truncation)
        return False

    def set_size(self, size: int) -> None:
        super().set_size(size)
        if not self._dead:
            self._check_size()

    def _rows(self, count: int) -> list[Any]:
        size = count * self._row_bytes
        # A copy of just these rows: writable, and the shard's buffer can move on.
        block: npt.NDArray[Any] = np.frombuffer(bytearray(self._buffer[:size]), self._dtype)
        del self._buffer[:size]
        self._offset += size
        self._rows_done += count
        return list(block.reshape((count, *self._row_shape)))

    def feed(self, data: bytes) -> list[Any]:
        if self._dead:
            return []
        self._buffer += data
        if self._rows_total < 0 and not self._parse_header():
            return []
        if self._row_bytes == 0:
            if self._buffer:
                self._fail(f"unexpected bytes after the header of an array of empty rows "
                           f"({self._rows_total} rows of shape {self._row_shape})",
                           self._offset)
            return []  # the rows go out at the end, from finish()
        last = self._rows_total if self._intact is None else self._intact
        count = min(len(self._buffer) // self._row_bytes, last - self._rows_done)
        records = self._rows(count) if count else []
        if self._rows_done == self._intact:
            self._truncated()
        elif self._rows_done == self._rows_total and self._buffer:
            self._fail(f"unexpected bytes after the last row ({self._rows_total} rows)",
                       self._offset)
        return records

    def _empty_rows(self) -> list[Any]:
        """The next block of rows of an array whose rows hold no bytes: the header alone
        decides their number, so they go out a bounded block at a time."""
        count = min(self._rows_total - self._rows_done, _EMPTY_ROWS_BLOCK)
        self._rows_done += count
        return [np.empty(self._row_shape, self._dtype) for _ in range(count)]

    def finish(self) -> list[Any]:
        """The end of the shard; for arrays of empty rows, call until it returns no rows."""
        if self._dead:
            return []
        if self._rows_total >= 0 and self._row_bytes == 0 \
                and self._rows_done < self._rows_total:
            return self._empty_rows()
        if self._rows_total < 0:
            self._fail(f"truncated .npy header ({len(self._buffer)} bytes)", 0)
        elif self._rows_done < self._rows_total:
            offset = self._offset
            self._fail(f"truncated array: the shard ends after {self._rows_done} of "
                       f"{self._rows_total} rows", offset)
        elif self._buffer:
            self._fail(f"{len(self._buffer)} unexpected bytes after the last row", self._offset)
        return []
