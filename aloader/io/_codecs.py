"""Every codec aloader decodes, in one module: gzip and deflate (zlib), bz2, zstd (the
zstandard package, or Python 3.14's ``compression.zstd``) and brotli (brotli or brotlicffi).

Two callers share these decoders: shard files named for a codec (``.gz``, ``.bz2``, ``.zst``:
:mod:`aloader.io._compression`) and HTTP bodies sent with a ``Content-Encoding`` or a
``Transfer-Encoding`` (gzip, x-gzip, deflate, br, zstd: :mod:`aloader.io._http`). Each asks
:func:`decoder` for a codec's decoder by its name; a decoder takes the coded bytes as they
come (:meth:`Decoder.decode`) and is told when they end (:meth:`Decoder.end`).

Invariants:

- Bounded memory: one piece of output holds at most ``limit`` bytes (gzip, deflate, bz2, with
  ``max_length``) or what ``_ZSTD_SLICE`` coded bytes can expand to (zstd, whose zstandard
  binding has no ``max_length``: a zstd block holds at most 128 KiB and takes at least 4 coded
  bytes, so a slice expands to at most about 16 MiB). A decompression bomb is handed on a
  bounded piece at a time, never held whole. (brotli's bindings have no bound either: a br
  body is decoded one network piece at a time.)
- One stream: several gzip members, bz2 streams or zstd frames one after another decode as
  one stream, as ``gzip -d``, ``bzip2 -d`` and ``zstd -d`` do (zstd's skippable frames
  skipped); bytes after the last one that do not start another are a :class:`CodingError`.
- Two failures, worded by the caller (which knows whether it reads a shard or a body): bytes
  that do not decode (:class:`CodingError`: not worth retrying, the same bytes would come
  again) and a stream that stops before its end marker (:class:`Truncated`: a cut connection
  to retry, or a truncated shard). An empty stream is complete (as httpx has it for a body;
  a shard's caller checks for its codec's magic number first).
"""

from __future__ import annotations

import bz2
import importlib
import zlib
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, Protocol

from .._util import Closing

__all__ = ("CodingError", "Decoder", "MissingPackage", "Truncated", "decoded", "decoder")

# Compressed bytes per zstd call: the bound on one call's output (see the invariants).
_ZSTD_SLICE = 512
# zstd frames skipped by decoders (metadata): magic 0x184D2A50 to 0x184D2A5F.
ZSTD_SKIPPABLE = b"\x2a\x4d\x18"
# Packages that decode the optional codecs, tried in order: (module, the package to install).
_OPTIONAL = {
    "br": (("brotli", "brotli"), ("brotlicffi", "brotlicffi")),
    "zstd": (("compression.zstd", "zstandard"), ("zstandard", "zstandard")),
}


class CodingError(Exception):
    """Coded bytes that do not decode.

    Attributes:
        coding: the codec's name.
        detail: what went wrong, to follow "the <codec> stream" or "the <codec> body".
    """

    def __init__(self, coding: str, detail: str) -> None:
        super().__init__(f"{coding}: {detail}")
        self.coding = coding
        self.detail = detail


class Truncated(Exception):
    """The coded bytes ended before the end of their stream (``coding``: the codec's name)."""

    def __init__(self, coding: str) -> None:
        super().__init__(coding)
        self.coding = coding


class MissingPackage(Exception):
    """The codec needs a package that is not installed.

    Attributes:
        coding: the codec's name.
        packages: the packages that would decode it, the first one to suggest.
    """

    def __init__(self, coding: str, packages: tuple[str, ...]) -> None:
        super().__init__(f"{coding} needs {' or '.join(packages)}")
        self.coding = coding
        self.packages = packages


class Decoder(Protocol):
    """One coded stream in, its decoded bytes out (see the module's invariants)."""

    coding: str

    def decode(self, data: bytes) -> Iterator[bytes]:
        """The decoded pieces of ``data``, the stream's next coded bytes.

        Raises:
            CodingError: the bytes do not decode.
        """
        ...

    def end(self) -> None:
        """The stream's end: check that it is complete.

        Raises:
            Truncated: it stopped before its end marker.
        """
        ...


class _Inflate:
    """gzip (a member or several, as ``gzip`` writes them) or deflate, with zlib.

    HTTP's deflate is zlib-wrapped, but some servers send a raw deflate stream: the first two
    bytes tell which.
    """

    def __init__(self, coding: str, limit: int) -> None:
        self.coding = coding
        self.gzip = coding != "deflate"
        self.limit = limit
        self._inflate: Any = zlib.decompressobj(zlib.MAX_WBITS | 16) if self.gzip else None
        self._head = b""  # deflate: bytes kept until the wrapper can be recognised
        self._fed = False

    def decode(self, data: bytes) -> Iterator[bytes]:
        self._fed = self._fed or bool(data)
        if self._inflate is None:
            data = self._head + data
            if len(data) < 2:
                self._head = data
                return
            wrapped = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            self._inflate = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
        while True:
            try:
                out = self._inflate.decompress(data, self.limit)
            except zlib.error as exc:
                raise CodingError(self.coding, f"does not decode: {exc}") from None
            if out:
                yield out
            if self._inflate.eof:
                data = self._inflate.unused_data
                if not data:
                    return
                if not self.gzip:
                    raise CodingError(self.coding, f"does not decode: {len(data)} bytes "
                                                   "follow the end of the deflate stream")
                self._inflate = zlib.decompressobj(zlib.MAX_WBITS | 16)  # the next member
                continue
            data = self._inflate.unconsumed_tail
            # A full output piece may leave more output inside zlib, even with no input left.
            if not data and len(out) < self.limit:
                return

    def end(self) -> None:
        if self._fed and (self._inflate is None or not self._inflate.eof):
            raise Truncated(self.coding)


class _Bz2:
    """bz2 streams one after another (as pbzip2 writes them), ``limit`` bytes a call."""

    coding = "bz2"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._inner = bz2.BZ2Decompressor()
        self._fed = False

    def decode(self, data: bytes) -> Iterator[bytes]:
        self._fed = self._fed or bool(data)
        if data and self._inner.eof:
            # The last stream ended with the last chunk: these bytes start the next one (an
            # ended decompressor raises EOFError for them).
            self._inner = bz2.BZ2Decompressor()
        while True:
            try:
                out = self._inner.decompress(data, self.limit)
            except OSError as exc:
                raise CodingError("bz2", f"does not decompress: {exc}") from None
            data = b""
            if out:
                yield out
            if self._inner.eof:
                data = self._inner.unused_data
                if not data:
                    return
                self._inner = bz2.BZ2Decompressor()  # the next stream
                continue
            if self._inner.needs_input:
                return

    def end(self) -> None:
        if self._fed and not self._inner.eof:
            raise Truncated("bz2")


class _Zstd:
    """zstd frames one after another (skippable frames skipped). ``new()`` makes the
    decompressor of one frame: an object with ``decompress(data)``, ``eof`` and
    ``unused_data`` (zstandard's ``decompressobj()``, ``compression.zstd``'s
    ``ZstdDecompressor()``)."""

    coding = "zstd"

    def __init__(self, new: Callable[[], Any]) -> None:
        self._new = new
        self._inner: Any = None  # None between frames
        self._pending = b""  # bytes between frames, kept until a frame's start is recognised
        self._skip = 0  # bytes left of a skippable frame
        self._fed = False

    def decode(self, data: bytes) -> Iterator[bytes]:
        self._fed = self._fed or bool(data)
        while data or self._pending:
            if self._skip:
                taken = min(self._skip, len(data))
                self._skip -= taken
                data = data[taken:]
                continue
            if self._inner is None:
                data = self._pending + data
                self._pending = b""
                if len(data) < 8:
                    self._pending = data
                    return
                if data[1:4] == ZSTD_SKIPPABLE and data[0] & 0xF0 == 0x50:
                    self._skip = 8 + int.from_bytes(data[4:8], "little")
                    continue
                self._inner = self._new()
            for start in range(0, len(data), _ZSTD_SLICE):
                try:
                    out = self._inner.decompress(data[start : start + _ZSTD_SLICE])
                except Exception as exc:  # zstandard.ZstdError, compression.zstd.ZstdError
                    raise CodingError("zstd", f"does not decompress: {exc}") from None
                if out:
                    yield out
                if self._inner.eof:
                    rest = self._inner.unused_data + data[start + _ZSTD_SLICE :]
                    self._inner = None
                    data = rest
                    break
            else:
                return

    def end(self) -> None:
        if self._fed and (self._inner is not None or self._skip or self._pending):
            raise Truncated("zstd")


class _Brotli:
    """brotli, with whichever binding is installed (``process`` or ``decompress``, one call
    per coded piece)."""

    coding = "br"

    def __init__(self, module: Any) -> None:
        inner = module.Decompressor()
        self._step: Callable[[bytes], bytes] = getattr(inner, "process", None) or \
            inner.decompress
        self._finished: Callable[[], bool] | None = getattr(inner, "is_finished", None)
        self._fed = False

    def decode(self, data: bytes) -> Iterator[bytes]:
        self._fed = True
        try:
            out = self._step(data)
        except Exception as exc:
            raise CodingError("br", f"does not decode: {type(exc).__name__}: {exc}") from None
        if out:
            yield out

    def end(self) -> None:
        if self._fed and self._finished is not None and not self._finished():
            raise Truncated("br")


def _optional(coding: str) -> tuple[str, Any]:
    """(module name, module) of the first installed package decoding ``coding``.

    Raises:
        MissingPackage: none is installed.
    """
    for module_name, _ in _OPTIONAL[coding]:
        try:
            return module_name, importlib.import_module(module_name)
        except ImportError:
            continue
    raise MissingPackage(coding, tuple(dict.fromkeys(package for _, package in _OPTIONAL[coding])))


def decoder(coding: str, limit: int) -> Decoder:
    """A decoder of ``coding`` (``gzip``, ``x-gzip``, ``deflate``, ``bz2``, ``zstd``, ``br``)
    whose pieces hold at most ``limit`` bytes (see the module's invariants).

    Raises:
        MissingPackage: the codec's optional package is not installed (zstd, br).
        ValueError: a codec this module does not know.
    """
    if coding in ("gzip", "x-gzip", "deflate"):
        return _Inflate(coding, limit)
    if coding == "bz2":
        return _Bz2(limit)
    if coding == "zstd":
        name, module = _optional("zstd")
        if name == "zstandard":
            maker = module.ZstdDecompressor()
            return _Zstd(maker.decompressobj)
        return _Zstd(module.ZstdDecompressor)
    if coding == "br":
        return _Brotli(_optional("br")[1])
    raise ValueError(f"no decoder for {coding!r}")


async def decoded(raw: AsyncGenerator[bytes, None],
                  decoders: list[Decoder]) -> AsyncGenerator[bytes, None]:
    """The pieces of ``raw`` with each decoder applied in turn (the first undoes the coding
    applied last), each stream checked complete at the end.

    Raises:
        CodingError: the bytes do not decode.
        Truncated: they end before the end of a coded stream.
    """

    def through(level: int, piece: bytes) -> Iterator[bytes]:
        if level == len(decoders):
            yield piece
            return
        for out in decoders[level].decode(piece):
            yield from through(level + 1, out)

    async with Closing(raw) as pieces:
        async for piece in pieces:
            for out in through(0, piece):
                yield out
    for each in decoders:
        each.end()
