"""Tar shards in webdataset's format: samples streamed from ``.tar`` files, never extracted.

A tar stream is a sequence of 512-byte headers, each followed by its member's data padded to
512 bytes, and ends with a zero block. :class:`TarDecoder` parses it from the shard's chunks
as they arrive (no seeking, nothing written to disk; a member's name is only a string, so
``..`` or absolute names are harmless). It reads ustar and GNU headers, GNU long names
(``L``), pax extended headers (``x`` and global ``g``: ``path`` and ``size``) and base-256
sizes, and skips directories, links and other non-regular members.

Members are grouped into samples as webdataset does: a member's key is its path up to the
first dot of its base name and its extension the rest (``a/b/000017.seg.png`` has key
``a/b/000017`` and extension ``seg.png``, lowercased); consecutive members with the same key
form one sample ``{"__key__": key, "__url__": shard, ext: bytes, ...}``. A key seen again
after another one starts a new sample, as in webdataset. Members named ``__...__`` (metadata)
are skipped, as webdataset skips them.

Invariants:

- A sample is delivered whole or not at all: a member that cannot be read (no extension, a
  repeated extension, beyond ``max_sample_bytes``, a decoder that fails) is a
  :class:`RecordError` naming the shard, the member and its byte offset in the tar stream,
  and its sample is dropped; with ``skip_errors=True`` that counts as one skipped record and
  the next sample is read.
- A header that cannot be framed (a bad checksum, a garbage or negative size, a malformed pax
  record) or a stream that ends before its end-of-archive block (inside a header or a
  member's data, or between members) is a located :class:`RecordError`; the rest of the
  shard cannot be read, the sample in progress is dropped.
- Bounded memory: the decoder holds at most one sample (``max_sample_bytes``: its members'
  data, plus a header's 512 bytes for each member), an unfinished header and the chunk in
  hand; a member's data is copied once.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Unpack

from .._util import check_int
from ._formats import BadRecords, Decoder
from ._sharded import ShardedSource, SourceOptions
from ._sharding import ShardsLike

__all__ = ("TarDecoder", "TarShards", "split_key")

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
# webdataset's base_plus_ext: the key ends at the first dot of the base name.
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$", re.DOTALL)
# webdataset's skip_meta: ``__name__`` members hold metadata, not sample data.
_META = re.compile(r"__[^/]*__($|/)")
_REGULAR = frozenset({b"0", b"\0", b"7"})
# Members whose header is followed by no data, whatever their size field says (as tarfile).
_NO_DATA = frozenset({b"1", b"2", b"3", b"4", b"5", b"6"})
# Headers about the next member: pax (local, global), GNU long name and long link name.
_META_TYPES = frozenset({b"x", b"g", b"L", b"K"})
# The largest pax header or GNU long name accepted (a guard on memory).
_MAX_META_BYTES = 1 << 20
_DEFAULT_MAX_SAMPLE_BYTES = 1 << 30
_DEFAULT_CHUNK_SIZE = 1 << 18


def split_key(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name, by webdataset's rule, or None (no extension)."""
    match = _KEY.match(name)
    return None if match is None else (match.group(1), match.group(2))


class _BadHeader(Exception):
    """A header field that cannot be read."""


def _number(field: bytes, what: str) -> int:
    """A numeric header field: octal ASCII, or GNU base-256 (first byte 0x80)."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    if field[:1] == b"\xff":
        raise _BadHeader(f"negative {what} (base-256)")
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if text.strip(b"01234567"):
        raise _BadHeader(f"the {what} field is not an octal number: {field!r}")
    return int(text, 8)


def _signed_sum(block: bytes) -> int:
    """The header checksum as some old tars computed it, over signed chars (as tarfile
    accepts too)."""
    rest = block[:148] + block[156:]
    return sum(rest) - 256 * sum(1 for byte in rest if byte > 127) + 8 * 32


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes) -> dict[str, str]:
    """The records of a pax extended header: ``"%d %s=%s\\n"``, the length counting all."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos:].strip(b"\0"):
        space = data.find(b" ", pos)
        length_text = data[pos:space] if space > pos else b""
        if not length_text.isdigit():
            raise _BadHeader(f"malformed pax record at byte {pos} of the pax header")
        end = pos + int(length_text)
        record = data[space + 1 : end]
        if end > len(data) or not record.endswith(b"\n") or b"=" not in record:
            raise _BadHeader(f"malformed pax record at byte {pos} of the pax header")
        key, _, value = record[:-1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


class TarDecoder(Decoder[dict[str, Any]]):
    """Samples of a tar stream, as the module describes.

    Args:
        decoders: ``{extension: callable}`` applied to a member's bytes (matched on the whole
            lowercased extension, then on its last dotted part).
        max_sample_bytes: the most member data one sample holds.
    """

    def __init__(self, name: str, bad: BadRecords, max_sample_bytes: int,
                 decoders: Mapping[str, Callable[[bytes], Any]] | None = None) -> None:
        super().__init__(name, bad, max_sample_bytes)
        self.decoders = dict(decoders or {})
        self._head = b""  # an unfinished header
        self._offset = 0  # tar offset of the next byte not consumed
        self._left = 0  # data bytes of the current member still to come
        self._pad = 0  # padding bytes after them
        self._pieces: list[Any] = []  # the current member's data (memoryviews of chunks)
        self._collect = False  # keep the current member's data (else skip it)
        self._kind = b""  # the current member's type
        self._member = ""  # its name, and the offset of its header
        self._member_offset = 0
        self._ext = ""  # the current regular member's extension
        self._done = False  # the end-of-archive block was read
        self._dead = False  # the rest of the shard cannot be framed
        self._long_name: str | None = None
        self._local: dict[str, str] = {}
        self._global: dict[str, str] = {}
        # The sample in progress: its key, members (ext -> bytes), bytes, and whether it broke.
        self._key: str | None = None
        self._sample: dict[str, Any] = {}
        self._sample_bytes = 0
        self._broken = False

    # ------------------------------------------------------------------ errors

    def _where(self) -> str:
        return f"member {self._member!r} at tar byte offset {self._member_offset}"

    def _bad_member(self, what: str) -> None:
        """A member that spoils its sample (the framing goes on)."""
        self._broken = True
        self._error(self._where(), what, offset=self._member_offset)

    def _bad_stream(self, where: str, what: str, offset: int) -> None:
        """The rest of the shard cannot be framed: the sample in progress is lost with it."""
        self._dead = True
        self._pieces = []
        self._key, self._sample = None, {}
        self._error(where, what, offset=offset)

    # ------------------------------------------------------------------ parsing

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._dead or self._done or self.pending is not None:
            return out
        if self._head:
            need = _BLOCK - len(self._head)
            self._head += data[:need]
            data = data[need:]
            if len(self._head) < _BLOCK:
                return out
            block, self._head = self._head, b""
            self._header(block, out)
        view = memoryview(data)
        pos, size = 0, len(data)
        while pos < size and not (self._dead or self._done or self.pending is not None):
            if self._left:
                take = min(self._left, size - pos)
                if self._collect:
                    self._pieces.append(view[pos : pos + take])
                pos += take
                self._offset += take
                self._left -= take
                if not self._left:
                    self._member_done(out)
            elif self._pad:
                take = min(self._pad, size - pos)
                pos += take
                self._offset += take
                self._pad -= take
            elif size - pos >= _BLOCK:
                self._header(bytes(view[pos : pos + _BLOCK]), out)
                pos += _BLOCK
            else:
                self._head = bytes(view[pos:])
                pos = size
        return out

    def _header(self, block: bytes, out: list[dict[str, Any]]) -> None:
        """Read the header ``block``; a member with no data is finished at once."""
        start = self._offset
        self._offset += _BLOCK
        if block == _ZERO_BLOCK:
            self._done = True
            self._emit(out)
            return
        self._member, self._member_offset = _text(block[:100]), start
        try:
            stored = _number(block[148:156], "checksum")
            unsigned = sum(block) - sum(block[148:156]) + 8 * 32
            if stored != unsigned and stored != _signed_sum(block):
                raise _BadHeader(f"bad header checksum (stored {stored}, computed {unsigned}); "
                                 "not a tar header, or a corrupt one")
            size = _number(block[124:136], "size")
        except _BadHeader as exc:
            self._bad_stream(f"header at tar byte offset {start}", str(exc), start)
            return
        kind = block[156:157]
        name = self._member
        if block[257:263] == b"ustar\0" and block[345]:
            name = _text(block[345:500]) + "/" + name
        pax = {**self._global, **self._local} if kind not in _META_TYPES else {}
        if kind not in _META_TYPES:
            if self._long_name is not None:
                name = self._long_name
            name = pax.get("path", name)
            if "size" in pax:
                if not pax["size"].isdigit():
                    self._bad_stream(self._where(), f"bad pax size {pax['size']!r}", start)
                    return
                size = int(pax["size"])
            self._long_name, self._local = None, {}
        self._member = name
        if kind in _META_TYPES and size > _MAX_META_BYTES:
            self._bad_stream(self._where(), f"a {kind.decode()!r} header of {size} bytes "
                             f"(more than {_MAX_META_BYTES})", start)
            return
        if kind in _NO_DATA or (kind == b"\0" and name.endswith("/")):
            size = 0
        elif self.size is not None and self._offset + size > self.size:
            self._bad_stream(self._where(), f"truncated: the header promises {size} bytes, "
                             f"but the shard ends {self.size - self._offset} bytes after it",
                             start)
            return
        self._kind, self._left, self._pad = kind, size, -size % _BLOCK
        self._collect = False
        if kind in _META_TYPES:
            self._collect = True
        elif kind == b"S":
            self._bad_member("GNU sparse members are not supported")
        elif kind in _REGULAR and not (kind == b"\0" and name.endswith("/")) \
                and not _META.match(name):
            self._collect = self._start_member(name, size, out)
        if not self._left:
            self._member_done(out)

    def _start_member(self, name: str, size: int, out: list[dict[str, Any]]) -> bool:
        """Place a regular member in its sample; True to keep its data."""
        parts = split_key(name)
        if parts is None:
            self._emit(out)  # an orphan: it belongs to no sample, and ends the one before
            self._bad_member("a member without an extension belongs to no sample (its name "
                             "should be KEY.EXTENSION)")
            self._broken = False
            return False
        key, ext = parts[0], parts[1].lower()
        if key != self._key:
            self._emit(out)
            self._key = key
        if ext in self._sample:
            self._bad_member(f"a second member with the extension {ext!r} in the sample "
                             f"{key!r}")
            return False
        # A member's header counts too: members of no data still cost memory (a name and a
        # place in the sample), and a key with a million of them must not go unbounded.
        self._sample_bytes += size + _BLOCK
        if self._sample_bytes > self.max_record_bytes:
            self._bad_member(f"the sample {key!r} holds more than max_sample_bytes "
                             f"({self.max_record_bytes} bytes) with this member of {size}")
            return False
        if self._broken:
            return False
        self._sample[ext] = None  # its place, so that a repeat is noticed
        self._ext = ext
        return True

    def _member_done(self, out: list[dict[str, Any]]) -> None:
        """The current member's data is complete."""
        pieces, self._pieces = self._pieces, []
        if not self._collect:
            return
        data = bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)
        if self._kind == b"L":
            self._long_name = _text(data)
        elif self._kind in (b"x", b"g"):
            try:
                records = _pax(data)
            except _BadHeader as exc:
                self._bad_stream(self._where(), str(exc), self._member_offset)
                return
            (self._local if self._kind == b"x" else self._global).update(records)
        elif self._kind != b"K":
            self._sample[self._ext] = (self._member, self._member_offset, data)

    def _emit(self, out: list[dict[str, Any]]) -> None:
        """Finish the sample in progress: decoded into ``out``, or dropped if broken."""
        key, members, broken = self._key, self._sample, self._broken
        self._key, self._sample, self._sample_bytes, self._broken = None, {}, 0, False
        if key is None or broken or not members:
            return
        sample: dict[str, Any] = {"__key__": key, "__url__": self.name}
        for ext, (member, offset, data) in members.items():
            decode = self.decoders.get(ext) or self.decoders.get(ext.rsplit(".", 1)[-1])
            if decode is None:
                sample[ext] = data
                continue
            try:
                sample[ext] = decode(data)
            except Exception as exc:
                self._member, self._member_offset = member, offset
                self._error(self._where(), f"the decoder for {ext!r} failed: "
                            f"{type(exc).__name__}: {exc}", offset=offset)
                return
        out.append(sample)

    def finish(self) -> list[dict[str, Any]]:
        if self._dead or self.pending is not None:
            return []
        if self._done:
            return []
        if self._left or self._head or self._pad:
            inside = "a header" if self._head else f"the data of {self._where()}"
            self._bad_stream(f"tar byte offset {self._offset + len(self._head)}",
                             f"truncated: the shard ends inside {inside}", self._offset)
        else:
            self._bad_stream(f"tar byte offset {self._offset}",
                             "truncated: the shard ends without the tar end-of-archive block "
                             "(a tar cut between two members?)", self._offset)
        return []


class TarShards(ShardedSource[dict[str, Any]]):
    """Samples of tar shards in webdataset's format (``.tar``, ``.tar.gz``, ``.tgz``,
    ``.tar.zst``, ``.tar.bz2``), streamed without extracting them.

    Each sample is a dict ``{"__key__": key, "__url__": shard, ext: value, ...}`` of the
    consecutive members sharing a key (see :mod:`aloader.sources._tar`); values are the members'
    bytes unless ``decoders`` has a function for their extension (none by default; e.g.
    ``{"json": json.loads, "cls": int, "txt": bytes.decode}``). Sharding across ranks and
    workers, shuffling, retries and statistics are :class:`ShardedSource`'s; a malformed
    member or a truncated tar is a :class:`RecordError` naming the shard, the member and its
    offset, which ``skip_errors=True`` counts and skips (a whole sample at a time).

    Args:
        shards: tar paths, directories, glob patterns or URLs.
        decoders: ``{extension: callable(bytes)}``, matched on the whole lowercased extension
            (``"seg.png"``), then on its last part (``"png"``). A decoder that raises makes
            its sample a malformed record.
        max_sample_bytes: the most bytes one sample may hold (a guard on memory): its
            members' data, and 512 bytes for each member (its header).
        **options: see :class:`ShardedSource` (``max_record_bytes`` does not apply;
            ``chunk_size`` defaults to 256 KiB here).

    Example::

        source = TarShards("shards/train-*.tar", decoders={"cls": int},
                           shuffle_shards=True, seed=0).shuffle(1_000, seed=0)
    """

    decoders: dict[str, Callable[[bytes], Any]]
    max_sample_bytes: int

    def __init__(self, shards: ShardsLike, *,
                 decoders: Mapping[str, Callable[[bytes], Any]] | None = None,
                 max_sample_bytes: int = _DEFAULT_MAX_SAMPLE_BYTES,
                 **options: Unpack[SourceOptions]) -> None:
        # Members are larger than lines: fewer, larger reads (a thread call each) go faster.
        options.setdefault("chunk_size", _DEFAULT_CHUNK_SIZE)
        super().__init__(shards, **options)
        if decoders is not None:
            if not isinstance(decoders, Mapping):
                raise TypeError(f"decoders should be a mapping of extensions to callables, "
                                f"but got {decoders!r}")
            for ext, fn in decoders.items():
                if not isinstance(ext, str) or not callable(fn):
                    raise TypeError(f"decoders should map extensions (str) to callables, "
                                    f"but got {ext!r}: {fn!r}")
        self.decoders = {ext.lower(): fn for ext, fn in (decoders or {}).items()}
        self.max_sample_bytes = check_int("max_sample_bytes", max_sample_bytes)

    def _decoder(self, name: str, bad: BadRecords) -> Decoder[dict[str, Any]]:
        return TarDecoder(name, bad, self.max_sample_bytes, self.decoders)
