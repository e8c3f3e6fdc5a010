"""Ready sources: records from sharded files and URLs, split across ranks and workers.

``TextLines``, ``JsonLines``, ``BinaryRecords`` and ``NpyRows`` are :class:`ShardedSource`\\ s
(:mod:`aloader.sources._sharded`), each with its record format (:mod:`aloader.sources._formats`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Unpack

from ._formats import (
    BadRecords,
    BinaryDecoder,
    Decoder,
    JsonLinesDecoder,
    NpyDecoder,
    TextDecoder,
    _check_encoding,
)
from ._sharded import ShardedSource, SourceOptions
from ._sharding import ShardsLike

__all__ = (
    "BinaryRecords",
    "JsonLines",
    "NpyRows",
    "TextLines",
)


class TextLines(ShardedSource[str]):
    """Lines of text files or URLs, as strings without their line endings.

    Lines end at ``\\n`` (a ``\\r`` before it is removed too); a last line without a newline
    counts. Every other option is :class:`ShardedSource`'s.

    Args:
        shards: paths, directories, glob patterns or URLs.
        encoding: an ASCII-compatible encoding; a line that does not decode is a malformed
            record (:class:`RecordError` naming the shard, the line and its byte offset).
        **options: see :class:`ShardedSource`.
    """

    encoding: str

    def __init__(self, shards: ShardsLike, *, encoding: str = "utf-8",
                 **options: Unpack[SourceOptions]) -> None:
        super().__init__(shards, **options)
        self.encoding = _check_encoding(encoding)

    def _decoder(self, name: str, bad: BadRecords) -> Decoder[str]:
        return TextDecoder(name, bad, self.max_record_bytes, self.encoding)


class JsonLines(ShardedSource[Any]):
    """JSON Lines records (one JSON value per line) from files or URLs.

    Blank lines are ignored. A line that is not valid JSON is a malformed record: a
    :class:`RecordError` names the shard, the line number and its byte offset (or, with
    ``skip_errors=True``, it is skipped and counted).

    Args:
        shards: paths, directories, glob patterns or URLs.
        loads: a parser called with each line's text (e.g. ``orjson.loads``); by default
            msgspec parses each line's bytes, giving the values ``json.loads`` gives (a line
            it refuses, such as ``NaN``, is parsed by ``json.loads``), several times faster
            than calling ``json.loads`` per line.
        **options: see :class:`ShardedSource`.

    Example::

        source = JsonLines("data/*.jsonl", shuffle_shards=True, seed=0).shuffle(10_000, seed=0)
        async for batch in DataLoader(source, batch_size=256):
            ...
    """

    # One decoded block waiting for the consumer, not two: its records are objects the GC
    # tracks (see JsonLinesDecoder.piece); the bytes are read ahead all the same.
    _prefetch_blocks = 1

    def __init__(self, shards: ShardsLike, *, loads: Callable[[str], Any] | None = None,
                 **options: Unpack[SourceOptions]) -> None:
        super().__init__(shards, **options)
        if loads is not None and not callable(loads):
            raise TypeError(f"loads should be callable, but got {loads!r}")
        self.loads = loads

    def _decoder(self, name: str, bad: BadRecords) -> Decoder[Any]:
        return JsonLinesDecoder(name, bad, self.max_record_bytes, self.loads)


class BinaryRecords(ShardedSource[bytes]):
    """Length-prefixed binary records: each a length (``header``) then that many bytes.

    A shard that ends inside a record, or a length above ``max_record_bytes``, is a malformed
    record reported with its byte offset (with ``skip_errors=True``, the rest of such a shard
    counts as one skipped record, since it cannot be framed any more).

    Args:
        shards: paths, directories, glob patterns or URLs.
        header: struct format of the length: ``"<I"`` (little-endian uint32, the default),
            ``">I"``, ``"<Q"``, ...
        **options: see :class:`ShardedSource`.
    """

    def __init__(self, shards: ShardsLike, *, header: str = "<I",
                 **options: Unpack[SourceOptions]) -> None:
        super().__init__(shards, **options)
        BinaryDecoder("", BadRecords(False, self.stats), 1, header)  # validates the header
        self.header = header

    def _decoder(self, name: str, bad: BadRecords) -> Decoder[bytes]:
        return BinaryDecoder(name, bad, self.max_record_bytes, self.header)


class NpyRows(ShardedSource[Any]):
    """Rows (along the first axis) of ``.npy`` arrays, streamed without loading whole arrays.

    Each row is a writable numpy array of shape ``array.shape[1:]`` (a numpy scalar for 1-D
    arrays). Arrays of Python objects and Fortran-ordered arrays cannot be streamed by rows
    (:class:`SourceError`); a truncated file, or a header whose shape does not match the
    shard's size (a file's, or a response's ``Content-Length``), is a malformed record,
    reported before any row is read.

    Args:
        shards: ``.npy`` paths, directories, glob patterns or URLs.
        **options: see :class:`ShardedSource`.
    """

    def __init__(self, shards: ShardsLike, **options: Unpack[SourceOptions]) -> None:
        super().__init__(shards, **options)

    def _decoder(self, name: str, bad: BadRecords) -> Decoder[Any]:
        return NpyDecoder(name, bad, self.max_record_bytes)
