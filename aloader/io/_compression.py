"""Compressed shards: ``.gz``, ``.zst`` and ``.bz2`` files decompressed as they stream.

A shard's codec comes from the source's ``compression=`` argument: ``"gzip"``, ``"zstd"``,
``"bz2"``, ``None`` (read as it is) or ``"auto"`` (the default: by the name's suffix, ``.gz``,
``.tgz``, ``.zst``, ``.zstd``, ``.bz2``, ``.tbz2``; a URL's query and fragment do not count).
Every record format reads the decompressed bytes, exactly as it reads a plain shard.

The codecs themselves are :mod:`aloader.io._codecs`'s (the ones HTTP bodies are decoded
with); this module finds a shard's codec, checks its magic number and words its errors.

Invariants:

- Bounded memory: one call hands on a bounded piece (see :mod:`aloader.io._codecs`): a
  decompression bomb is handed on a piece at a time, never held whole.
- Complete or an error: several gzip members, bz2 streams or zstd frames one after another
  are read as one stream, as ``gzip -d``, ``bzip2 -d`` and ``zstd -d`` do (zstd's skippable
  frames skipped); bytes after the last one that do not start another (trailing garbage, zero
  padding too, which ``gzip -d`` only warns about) fail the shard after its records. A stream
  that does not decompress, or that ends before its end marker, is a :class:`RecordError`
  naming the shard and the compressed bytes in which the codec noticed, raised before the
  format sees the (partial) bytes at the end: never a silently short shard. Streaming means a codec
  checks what it can when it can: gzip's CRC covers a whole member and is checked at its
  end, so the records of a member whose data was altered are delivered before the error
  that ends the shard (a structural error, the common case, is noticed at once).
- Decoded once: an HTTP body sent with ``Content-Encoding`` is decoded by
  :mod:`aloader.io._http` first. A ``.gz`` object served that way (an object store holding a
  gzip file with ``Content-Encoding: gzip`` in its metadata, or a server decompressing on the
  fly) then arrives plain: with ``compression="auto"``, a URL whose body does not start with
  its suffix's magic number is read as it is. A local file named for a codec must hold it.

Resumption. An HTTP retry resumes the compressed bytes by range where they stopped (the
decompressor keeps its state across the retry, so no line is lost or repeated).
:attr:`Decompressor.offset` counts the compressed bytes consumed, for a resume position; a
decompressor cannot restart in the middle of a stream, so resuming a compressed shard in a
later process means reading it again from its start.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from typing import Literal, TypeAlias

from .._exceptions import RecordError, SourceError
from .._util import Closing
from ._codecs import ZSTD_SKIPPABLE, CodingError, Decoder, MissingPackage, Truncated, decoder

__all__ = (
    "COMPRESSIONS",
    "Compression",
    "CorruptStream",
    "Decompressor",
    "check_compression",
    "decompressed",
    "decompressor_for",
    "shard_compression",
)

Compression: TypeAlias = Literal["auto", "gzip", "zstd", "bz2"] | None
COMPRESSIONS = ("auto", "gzip", "zstd", "bz2", None)

_SUFFIXES = {
    ".gz": "gzip", ".tgz": "gzip", ".gzip": "gzip",
    ".zst": "zstd", ".zstd": "zstd", ".tzst": "zstd",
    ".bz2": "bz2", ".tbz2": "bz2", ".tbz": "bz2",
}
_MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd", "bz2": b"BZh"}
_SNIFF = max(len(magic) for magic in _MAGIC.values())


def check_compression(value: object) -> Compression:
    """``value`` if it names a compression (see the module), else a ValueError."""
    if value not in COMPRESSIONS or isinstance(value, bool):
        raise ValueError(f"compression should be one of 'auto', 'gzip', 'zstd', 'bz2' or None, "
                         f"but got compression={value!r}")
    return value  # type: ignore[return-value]


def shard_compression(name: str, compression: Compression) -> str | None:
    """The codec of shard ``name``: ``compression`` itself, or by suffix when ``"auto"``."""
    if compression != "auto":
        return compression
    path = name.split("?", 1)[0].split("#", 1)[0] if "://" in name else name
    dot = path.rfind(".")
    if dot < 0 or "/" in path[dot:]:
        return None
    return _SUFFIXES.get(path[dot:].lower())


class CorruptStream(Exception):
    """A compressed shard that cannot be read on: ``error`` says where.

    The rest of the shard is lost; the source raises ``error`` or, skipping errors, counts it
    as one skipped record.
    """

    def __init__(self, error: RecordError) -> None:
        super().__init__(str(error))
        self.error = error


class Decompressor:
    """One shard's compressed bytes in, its decompressed bytes out, a bounded piece at a time.

    Args:
        name: the shard, for error messages.
        codec: ``"gzip"``, ``"zstd"`` or ``"bz2"``.
        limit: the most decompressed bytes a piece holds (gzip and bz2; see the module).
        sniff: read the bytes as they are when they do not start with the codec's magic
            number (a URL decoded by the server or the HTTP layer already).

    Attributes:
        offset: compressed bytes consumed so far (a resume position on the compressed
            stream).

    Raises:
        SourceError: ``zstd`` without the zstandard package.
    """

    def __init__(self, name: str, codec: str, limit: int, *, sniff: bool = False) -> None:
        self.name = name
        self.codec = codec
        self.offset = 0
        self._sniff = sniff
        self._head = b""  # first bytes, kept until the magic number can be checked
        self._started = False  # the magic number was checked
        self._plain = False
        try:
            self._inner: Decoder = decoder(codec, limit)
        except MissingPackage:
            raise SourceError(f"{name}: a zstd shard needs the zstandard package to "
                              "decompress (pip install zstandard, or aloader[zstd]); it is "
                              "not installed", source=name, offset=0) from None

    def _fail(self, what: str, offset: int, end: int | None = None) -> CorruptStream:
        where = f"compressed byte offset {offset}" if end is None else \
            f"compressed bytes {offset} to {end}"
        return CorruptStream(RecordError(f"{self.name}: {self.codec} stream, {where}: {what}",
                                         source=self.name, offset=offset))

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The decompressed pieces of ``data``, the shard's next compressed bytes.

        Raises:
            CorruptStream: the bytes do not decompress, or are not of the codec at all.
        """
        if self._plain:
            yield data
            return
        if not self._started:
            data = self._head + data
            if len(data) < _SNIFF:
                self._head = data
                return
            self._head = b""
            self._started = True
            if not self._check_magic(data):
                yield data
                return
        start = self.offset
        self.offset += len(data)
        try:
            yield from self._inner.decode(data)
        except CodingError as exc:
            # Where the codec noticed: data errors show at the next check (gzip's CRC at
            # the end of its member), so bytes before ``start`` may be the bad ones.
            raise self._fail(exc.detail, start, self.offset) from None

    def _check_magic(self, data: bytes) -> bool:
        """Whether ``data`` (the first bytes) is this codec's stream; False: read it plain."""
        magic = _MAGIC[self.codec]
        if data.startswith(magic) or (self.codec == "zstd" and data[1:4] == ZSTD_SKIPPABLE):
            return True
        if self._sniff:
            self._plain = True
            self.offset += len(data)
            return False
        what = f"starts with {data[:8]!r}" if data else "is empty"
        raise self._fail(f"not a {self.codec} stream: the shard {what}, not {magic!r}; "
                         "compression=None reads it as it is", 0)

    def end(self) -> bytes:
        """The shard's end: check that the compressed stream is complete.

        Returns:
            The last plain bytes of a shorter-than-a-magic-number shard read as it is.

        Raises:
            CorruptStream: the stream ends before its end marker.
        """
        if not self._started:  # fewer bytes than a magic number in all
            data, self._head = self._head, b""
            self._started = True
            if not self._check_magic(data):
                return data
            self.offset = len(data)
            try:
                for _ in self._inner.decode(data):
                    pass  # a stream of under 4 bytes cannot hold any output
            except CodingError:
                pass  # the stream is too short anyway: reported as truncated below
        if self._plain:
            return b""
        try:
            self._inner.end()
        except Truncated:
            raise self._fail(f"truncated: the shard ends before the end of the compressed "
                             f"stream ({self.offset} compressed bytes)", self.offset) from None
        return b""


def decompressor_for(name: str, compression: Compression, limit: int) -> Decompressor | None:
    """The decompressor of shard ``name`` (None: read it as it is).

    With ``"auto"``, a URL (any ``scheme://``) whose bytes do not start with its codec's
    magic number is read as it is: its server or the HTTP layer decoded it already.

    Raises:
        SourceError: ``zstd`` without the zstandard package.
    """
    codec = shard_compression(name, compression)
    if codec is None:
        return None
    return Decompressor(name, codec, limit, sniff=compression == "auto" and "://" in name)


async def decompressed(chunks: AsyncGenerator[bytes, None],
                       decompressor: Decompressor) -> AsyncGenerator[bytes, None]:
    """The decompressed pieces of ``chunks``, checked complete at the end.

    Raises:
        CorruptStream: the stream does not decompress, or ends early.
    """
    async with Closing(chunks) as pieces:
        async for chunk in pieces:
            for piece in decompressor.feed(chunk):
                yield piece
    if last := decompressor.end():
        yield last
