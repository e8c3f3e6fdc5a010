"""Checksums: the block checksums of the shard cache's copies, and the stores' own.

The cache's copies (:mod:`aloader.io._cache`) are checked a block at a time: every
:data:`BLOCK` bytes of a copy have a CRC, computed as the copy is downloaded and kept beside
it (:class:`BlockSums`, :class:`SumTable`), and each block is checked before its bytes are
handed on, so a copy is read once and none of its bytes is used unchecked. The CRC is crc32c
(Castagnoli) from google-crc32c, whose C implementation uses the CPU's CRC instructions
(about 11 GB/s on the benchmark machine: a cached epoch's checks cost a small fraction of
what parsing its records does); where only its pure-Python fallback is installed, zlib's
crc32 (the table says which one made it: a copy made by the other is checked by it, or
downloaded again where it is not available).

The stores' checksums (:class:`StoreChecks`), where an answer gives them: GCS's
``x-goog-hash`` (crc32c, md5), S3's ``x-amz-checksum-crc32c``, ``-crc32``, ``-sha1`` and
``-sha256``, ``Content-MD5`` of a whole body, and S3's ETag where it is the object's MD5 (a
single-part upload without SSE-KMS or SSE-C: see :mod:`aloader.io._objstore`). The cache
computes them as it downloads and keeps no copy whose bytes differ.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
import zlib
from array import array
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ("BLOCK", "BlockSums", "StoreChecks", "SumTable", "store_digests")

#: Bytes per checked block of a cached copy.
BLOCK = 1 << 16
_MAGIC = b"ALSUMS\x00\x01"
_HEADER = struct.Struct("<8sB3xIQ")  # magic, algorithm, block size, the copy's size
_CRC32C, _CRC32 = 1, 2


def _crc32c() -> tuple[Callable[[bytes], int], Callable[[int, bytes], int]] | None:
    """(value, extend) of google-crc32c, or None if it is not installed."""
    try:
        import google_crc32c
    except ImportError:
        return None
    module: Any = google_crc32c
    return module.value, module.extend


def _choose() -> tuple[int, Callable[[bytes], int], Callable[[int, bytes], int]]:
    """The algorithm new copies are checked with: crc32c where its C implementation is
    installed, else zlib's crc32 (as fast as crc32c's pure-Python fallback is slow)."""
    found = _crc32c()
    if found is not None:
        import google_crc32c

        if getattr(google_crc32c, "implementation", "c") == "c":
            return _CRC32C, found[0], found[1]
    return _CRC32, zlib.crc32, lambda value, data: zlib.crc32(data, value)


_ALGORITHM, _value, _extend = _choose()


class BlockSums:
    """The CRC of every :data:`BLOCK` bytes of a stream, fed in pieces of any length."""

    __slots__ = ("_crc", "_filled", "sums")

    def __init__(self) -> None:
        self.sums = array("I")
        self._crc = 0
        self._filled = 0

    def update(self, data: bytes) -> None:
        crc, filled, size, at = self._crc, self._filled, len(data), 0
        while at < size:
            take = min(BLOCK - filled, size - at)
            crc = _extend(crc, data if take == size else data[at : at + take])
            filled += take
            at += take
            if filled == BLOCK:
                self.sums.append(crc)
                crc = filled = 0
        self._crc, self._filled = crc, filled

    def table(self, size: int) -> bytes:
        """The checksum file of a copy of ``size`` bytes (all of them fed)."""
        sums = array("I", self.sums)
        if self._filled:
            sums.append(self._crc)
        if sums.itemsize != 4:  # pragma: no cover - every platform aloader runs on
            raise RuntimeError("array('I') is not 32 bits wide")
        if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian
            sums.byteswap()
        return _HEADER.pack(_MAGIC, _ALGORITHM, BLOCK, size) + sums.tobytes()


class SumTable:
    """A copy's checksum file, read: :meth:`check` tells whether a block is intact.

    Attributes:
        block: bytes per block.
    """

    __slots__ = ("_sums", "_value", "block")

    def __init__(self, sums: array[int], block: int, value: Callable[[bytes], int]) -> None:
        self._sums = sums
        self.block = block
        self._value = value

    @classmethod
    def parse(cls, data: bytes, size: int) -> SumTable | None:
        """The table of a copy of ``size`` bytes, or None if ``data`` is not one (damaged,
        another copy's, another release's, or of an algorithm not installed here)."""
        if len(data) < _HEADER.size:
            return None
        magic, algorithm, block, told = _HEADER.unpack_from(data)
        if magic != _MAGIC or told != size or block <= 0 or block % 4096:
            return None
        body = data[_HEADER.size :]
        if len(body) != 4 * (-(-size // block)):
            return None
        if algorithm == _CRC32C:
            found = _crc32c()
            if found is None:
                return None
            value = found[0]
        elif algorithm == _CRC32:
            value = zlib.crc32
        else:
            return None
        sums = array("I")
        sums.frombytes(body)
        if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian
            sums.byteswap()
        return cls(sums, block, value)

    @property
    def nbytes(self) -> int:
        """The memory its checksums take."""
        return len(self._sums) * 4

    def check(self, index: int, data: bytes) -> bool:
        """Whether ``data`` is block ``index`` as it was downloaded."""
        return index < len(self._sums) and self._value(data) == self._sums[index]


# ------------------------------------------------------------------------- the stores' own

_MD5_ETAG = re.compile(r'^(?:W/)?"?([0-9a-fA-F]{32})"?$')


def _b64(value: str) -> bytes | None:
    try:
        return base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None


def store_digests(headers: Mapping[str, str], whole: bool) -> dict[str, str]:
    """The checksums an answer gives of its object, ``{algorithm: base64 digest}`` (md5,
    crc32c, crc32, sha1, sha256), from its headers; ``whole``: the answer is the whole body
    (its ``Content-MD5`` is the object's). An object GCS decompresses as it sends it
    (``x-goog-stored-content-encoding``) has hashes of its stored bytes: left out."""
    found: dict[str, str] = {}
    stored = headers.get("x-goog-stored-content-encoding", "identity").strip().lower()
    goog = headers.get("x-goog-hash")
    if goog and stored == "identity":
        for item in goog.split(","):
            algorithm, _, value = item.strip().partition("=")
            if algorithm.lower() in ("crc32c", "md5") and value:
                found[algorithm.lower()] = value.strip()
    for algorithm in ("crc32c", "crc32", "sha1", "sha256"):
        amz = headers.get(f"x-amz-checksum-{algorithm}")
        if amz:
            found[algorithm] = amz.strip()
    md5 = headers.get("Content-MD5")
    if md5 and whole:
        found.setdefault("md5", md5.strip())
    return found


def etag_md5(etag: str | None) -> str | None:
    """The base64 MD5 an S3 ETag stands for (a single-part upload's), or None (a multipart
    upload's ``<md5>-<parts>``, or no ETag)."""
    match = _MD5_ETAG.match(etag or "")
    if match is None:
        return None
    return base64.b64encode(bytes.fromhex(match.group(1))).decode()


class _Crc:
    """crc32c or crc32 as a hashlib-like object (4 big-endian bytes, as the stores give)."""

    def __init__(self, extend: Callable[[int, bytes], int]) -> None:
        self._extend = extend
        self._value = 0

    def update(self, data: bytes) -> None:
        self._value = self._extend(self._value, data)

    def digest(self) -> bytes:
        return self._value.to_bytes(4, "big")


class StoreChecks:
    """The stores' checksums of an object, computed over its bytes as they stream.

    Args:
        digests: ``{algorithm: base64 digest}`` (see :func:`store_digests`); those this
            process cannot compute (crc32c without google-crc32c) are left out.
    """

    def __init__(self, digests: Mapping[str, str]) -> None:
        self._expected: dict[str, bytes] = {}
        self._hashers: dict[str, Any] = {}
        for algorithm, value in digests.items():
            expected = _b64(value)
            if expected is None:
                continue
            if algorithm == "crc32c":
                found = _crc32c()
                if found is None:
                    continue
                hasher: Any = _Crc(found[1])
            elif algorithm == "crc32":
                hasher = _Crc(lambda value, data: zlib.crc32(data, value))
            else:
                hasher = hashlib.new(algorithm, usedforsecurity=False)
            self._expected[algorithm] = expected
            self._hashers[algorithm] = hasher

    def __bool__(self) -> bool:
        return bool(self._hashers)

    def update(self, data: bytes) -> None:
        for hasher in self._hashers.values():
            hasher.update(data)

    def mismatch(self) -> str | None:
        """None if every checksum matches, else which one does not."""
        for algorithm, hasher in self._hashers.items():
            got, expected = hasher.digest(), self._expected[algorithm]
            if got != expected:
                return (f"its {algorithm} is {base64.b64encode(got).decode()}, the store's "
                        f"{base64.b64encode(expected).decode()}")
        return None
