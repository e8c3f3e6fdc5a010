"""Parquet files as a stream of rows or column batches: :class:`ParquetRows`.

Invariant: every epoch, the *units* of the dataset (whole files when there are at least as
many files as consumers, else single row groups) are ordered as the epoch's shard order (see
:mod:`aloader.sources._sharding`) and split round-robin across the ``world_size * num_workers``
consumers with :func:`~aloader.sources._sharding.assign_shards`: each unit, hence each row, is read
by exactly one consumer. All consumers see the same list of files and, in row-group mode, read
the same footers, so they agree on the units without talking to each other. With the ranks
evened out (``even_ranks=True``), the units are what each rank reads the same number of, and
what a rank drops one of in turn (see :mod:`aloader.sources._sharding`).

pyarrow (the extra ``aloader[parquet]``) is imported when a :class:`ParquetRows` is made, not
with aloader. Its reads block, so each batch is read in a worker thread (and, as column
batches, converted there; rows as dicts are made on the event loop, in pieces of
:data:`ROW_BLOCK`, where they are consumed: see :meth:`ParquetRows._items`): for local files,
one thread per pass (:class:`_ReadThread`: a call costs a third of an anyio thread call, which
showed at narrow batches); for remote ones, anyio's, whose reads run on the event loop from
there. A pass's local files are read one after another by one reader in that thread
(:class:`_LocalReader`), which opens the next file in the call that asks for its first batch,
and the thread outlives its pass for the next one to take (starting one waited for it to be
scheduled: 2-5 ms per epoch on a loaded machine). The next call is queued as soon as one
returns (one batch read ahead), so the thread reads while the event loop hands the last batch
on. The epoch's plan runs in a thread only when it reads footers. A consumer whose files are
all local reads them one at a time, whatever ``concurrency`` says: a local read waits on the
CPU, not on a device, pyarrow already decodes a batch's columns on its own threads, and the
conversion to numpy or Python values holds the GIL, so reading two or four local files at once
only holds more batches and contends (measured: 1.3x and 1.8x the CPU time of one at a time,
0.3-0.8x its rate).

Remote files (``s3://``, ``gs://``, ``az://``, ``http(s)://``) are random-access files of
bounded ranged reads (:class:`_RangeFile`): a byte for the size, the footer (pyarrow reads the
last 64 KiB), then one GET per chosen column chunk of each row group, when pyarrow reaches it,
nothing else. Each read goes through the byte-stream sources' own fetching
(:meth:`aloader.io._objstore.ObjectAccess.chunks`, :func:`aloader.io._http.http_chunks`: their
retries, resumption within the range and located errors), run on the event loop whose worker
thread pyarrow reads in (or on a loop of its own when the footers are read outside one, at
construction). A file's GETs are made one after another, in the thread decoding it (no
pre-buffering: see :meth:`_UnitReader._open`); ``concurrency`` remote files are read at once,
since their reads wait on the network.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import hashlib
import importlib
import itertools
import os
import queue
import threading
import weakref
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, NoReturn, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread

from .._backend import Waiter, threadsafe_caller, waiters
from .._exceptions import FetchError, RecordError, SourceError
from .._util import Closing, check_int
from .._workerinfo import worker_slot
from ..io._cache import Version
from ..io._files import RandomAccessFile
from ..io._http import http_chunks, make_client
from ..io._objstore import is_object_url
from ..streams._context import _Context
from ..streams._positions import check_same
from ..streams._stream import Stream
from ._formats import BadRecords
from ._quota import _up_to
from ._readahead import read_in_order
from ._sharded import ShardedSource
from ._sharding import ShardsLike, assign_shards, check_ranks, is_url

T = TypeVar("T")

__all__ = ("ParquetRows", "open_parquet_shard")

# What one blocking read of a unit gives (see _UnitReader.next).
_Step = tuple["list[Any] | None", int, int]

DEFAULT_BATCH_ROWS = 65536  # pyarrow's own default for iter_batches
# Rows (dicts) are made and handed on at most this many at a time, in the consumer's thread
# (see ParquetRows._items): a block's dicts are then still in the CPU's caches when the
# consumer takes and frees them. A 65536-row batch converted at once, in the read thread, made
# ~40 MB of dicts per block, three or four blocks alive at once (consumed, read ahead, being
# made), and cost ~1.25x the CPU time of pieces of 4096-8192 rows (1M rows, to_pylist alone).
ROW_BLOCK = 4096
_INSTALL = "pip install aloader[parquet]"


# The rows of 1 to 8 columns, each made by a comprehension over ``zip`` of the columns that
# builds a dict display of the keys (bound to local names first): one BUILD_MAP per row, the
# same keys in the same order with the same values as RecordBatch.to_pylist(), which looks
# each value up by name in a dict of columns, then indexes the column by the row. Written
# out per width because a dict display's width is fixed in the code (dict(zip(keys, row))
# per row, the generic way, takes 2x the time; generating the code from the schema means
# exec, which no schema's names should reach).
def _rows1(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    (k0,) = keys
    return [{k0: a} for (a,) in zip(*columns, strict=True)]


def _rows2(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1 = keys
    return [{k0: a, k1: b} for a, b in zip(*columns, strict=True)]


def _rows3(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1, k2 = keys
    return [{k0: a, k1: b, k2: c} for a, b, c in zip(*columns, strict=True)]


def _rows4(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1, k2, k3 = keys
    return [{k0: a, k1: b, k2: c, k3: d} for a, b, c, d in zip(*columns, strict=True)]


def _rows5(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1, k2, k3, k4 = keys
    return [{k0: a, k1: b, k2: c, k3: d, k4: e}
            for a, b, c, d, e in zip(*columns, strict=True)]


def _rows6(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1, k2, k3, k4, k5 = keys
    return [{k0: a, k1: b, k2: c, k3: d, k4: e, k5: f}
            for a, b, c, d, e, f in zip(*columns, strict=True)]


def _rows7(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1, k2, k3, k4, k5, k6 = keys
    return [{k0: a, k1: b, k2: c, k3: d, k4: e, k5: f, k6: g}
            for a, b, c, d, e, f, g in zip(*columns, strict=True)]


def _rows8(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1, k2, k3, k4, k5, k6, k7 = keys
    return [{k0: a, k1: b, k2: c, k3: d, k4: e, k5: f, k6: g, k7: h}
            for a, b, c, d, e, f, g, h in zip(*columns, strict=True)]


_MAKERS = (_rows1, _rows2, _rows3, _rows4, _rows5, _rows6, _rows7, _rows8)


@functools.lru_cache(maxsize=64)
def _row_maker(names: tuple[str, ...]) -> Callable[[list[list[Any]]], list[Any]] | None:
    """A function making the rows of a batch whose columns are ``names`` from its columns'
    values (``[column.to_pylist() for column in batch.columns]``): exactly what
    ``RecordBatch.to_pylist()`` gives, in 0.8x its time (0.63 against 0.78 ms per 4096 rows
    of five columns, the benchmark's, the columns' to_pylist included), or None where
    pyarrow's own is used: no columns, a name twice, more than 8 columns (see ``_rows1``).
    The names are values the functions take, never code."""
    if not names or len(set(names)) != len(names) or len(names) > len(_MAKERS):
        return None
    return functools.partial(_MAKERS[len(names) - 1], names)


def _rows_of(piece: Any) -> list[Any]:
    """``piece.to_pylist()`` (as :func:`_row_maker` makes it), with Python's cyclic garbage
    collector paused meanwhile.

    Making a piece allocates a dict per row, and every 700 allocations start a young
    collection, which traverses the piece's column lists and the rows made so far: none of
    them garbage (values of Arrow columns hold no cycles), but a piece of 4096 rows started
    six of them. Paused, a piece took 0.87x the time (1.39 against 1.61 ms per 4096 rows of
    the benchmark's five columns); the collection owed runs once, at the next allocation
    after. Left alone when the collector is off (a program's choice); a program turning it
    off from another thread during a piece (1-3 ms) would find it on again.
    """
    make = _row_maker(tuple(piece.schema.names))
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        if make is None:
            return piece.to_pylist()  # type: ignore[no-any-return]
        return make([column.to_pylist() for column in piece.columns])
    finally:
        if paused:
            gc.enable()


def _pyarrow() -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet), or an ImportError that says how to install them."""
    try:
        return importlib.import_module("pyarrow"), importlib.import_module("pyarrow.parquet")
    except ImportError as exc:
        raise ImportError(f"ParquetRows needs pyarrow: {_INSTALL}") from exc


def open_parquet_shard(name: str, source: ParquetRows, reuse: bool = False) -> Any:
    """The shard ``name`` as ``pyarrow.parquet.ParquetFile`` takes it: a random-access file.

    The one place a shard's bytes come from: a local path is passed as it is (pyarrow then
    opens it itself, the fastest way: 10% faster than a ``LocalFileSystem`` input file); a
    remote one is a :class:`_RangeFile` (``reuse``: it keeps one HTTP client for all its reads,
    closed by :meth:`_RangeFile.aclose`), which the reader closes when it is done, or its copy
    in the shard cache, a :class:`~aloader.io._cache.CopyFile` whose every read is checked
    against the copy's checksums (a damaged copy is dropped, and read by ranges from there).
    """
    if not _is_remote(name):
        return name
    cache = source._shard_cache
    if cache is not None:
        version = _on_loop(functools.partial(_cached_copy, name, source))
        if version is not None:
            copy = cache.open_copy(name, version, source.stats,
                                   functools.partial(_RangeFile, name, source, False))
            if copy is not None:
                return copy
    return _RangeFile(name, source, reuse)


async def _cached_copy(name: str, source: ParquetRows, in_worker: bool) -> Version | None:
    """The version of the remote file ``name`` kept in the source's shard cache, downloaded
    whole into it first if needed (random access needs the whole file; every column is kept);
    None when the file is larger than what the cache may keep, read by ranges then."""
    cache = source._shard_cache
    assert cache is not None
    version = source._versions.get(name)
    if version is not None and cache.holds(name, version):
        source.stats.cache_hits += 1  # pinned and kept: no request, nothing read
        return version
    too_big = False

    def sized(size: int) -> None:
        # A file larger than the whole limit is never kept: stop at once and read it by
        # ranges rather than download it for nothing.
        nonlocal too_big
        too_big = cache.limit is not None and size > cache.limit

    client = make_client(source.http, 1) if is_url(name) else None
    try:
        fetch = functools.partial(source._fetch, name,
                                  None if client is None else (lambda: client), source.stats)
        async with Closing(cache.chunks(name, fetch, source._versions, source.stats,
                                        source.chunk_size, sized)) as pieces:
            async for _ in pieces:
                if too_big:
                    return None
                # the bytes land in the cache; pyarrow reads the copy
    finally:
        if client is not None:
            with anyio.CancelScope(shield=True):
                await client.aclose()
    return source._versions.get(name)


def _is_remote(name: str) -> bool:
    return is_url(name) or is_object_url(name)


def _on_loop(fn: Callable[[bool], Coroutine[Any, Any, T]]) -> T:
    """``fn(in_worker)`` run to its end from blocking code: on the event loop whose worker
    thread this is (``in_worker`` True), else on an asyncio loop of its own in a thread of its
    own (this thread may be running a loop, which cannot be re-entered)."""
    try:
        anyio.from_thread.check_cancelled()
    except RuntimeError:  # not a worker thread of an event loop (anyio's NoEventLoopError)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(anyio.run, fn, False).result()
    return anyio.from_thread.run(fn, True)


class _RangeFile(RandomAccessFile):
    """A remote Parquet file as a blocking random-access file: each read one bounded ranged
    GET (see the module's description); its size is asked for once, with a one-byte read.

    Invariant: every read asks for the version (ETag) the first one saw, so that a footer and
    column chunks of two versions of a file are never decoded together: an object replaced
    between two reads is a :class:`FetchError` (a store without ETags: checked by size only).

    Attributes:
        requested: ``(start, end)`` of every range read, in order (what the store was asked).
    """

    def __init__(self, url: str, source: ParquetRows, reuse: bool) -> None:
        super().__init__()
        self.url = url
        self._source = source
        self._reuse = reuse
        self._client: Any = None
        self._size: int | None = None
        self._etag: str | None = None
        self.requested: list[tuple[int, int]] = []

    def size(self) -> int:
        if self._size is None:
            self._read(0, 1)
        assert self._size is not None
        return self._size

    def _set_size(self, size: int) -> None:
        if self._size is not None and size != self._size:
            raise FetchError(f"{self.url}: the file changed while it was being read (its size "
                             f"was {self._size} bytes, now {size})", source=self.url)
        self._size = size

    def _set_etag(self, size: int | None, etag: str | None, modified: str | None) -> None:
        self._etag = self._etag or etag

    def _read(self, start: int, end: int) -> bytes:
        self.requested.append((start, end))
        return _on_loop(functools.partial(self._get, start, end))

    async def _get(self, start: int, end: int, in_worker: bool) -> bytes:
        source = self._source
        pieces: list[bytes] = []
        if is_object_url(self.url):
            chunks = source._objects.chunks(self.url, source.stats, self._set_size, start,
                                            on_version=self._set_etag, end=end,
                                            etag=self._etag)
            async with Closing(chunks) as stream:
                pieces.extend([piece async for piece in stream])
            return b"".join(pieces)
        # One client for all the reads of a unit (its connection kept alive), on the loop
        # that reads it; a read on a loop of its own (a footer at construction) has its own.
        client = self._client if in_worker and self._reuse else None
        if client is None:
            client = make_client(source.http, 1)
            if in_worker and self._reuse:
                self._client = client
        try:
            chunks = http_chunks(client, self.url, source.http, source.stats, self._set_size,
                                 start, on_version=self._set_etag, end=end, etag=self._etag)
            async with Closing(chunks) as stream:
                pieces.extend([piece async for piece in stream])
        finally:
            if client is not self._client:
                with anyio.CancelScope(shield=True):
                    await client.aclose()
        return b"".join(pieces)

    async def aclose(self) -> None:
        """Close the HTTP client the reads kept (on the loop they ran on)."""
        client, self._client = self._client, None
        if client is not None:
            with anyio.CancelScope(shield=True):
                await client.aclose()


def _located(name: str, exc: BaseException) -> BaseException:
    """A pyarrow error while reading ``name``, as aloader reports it.

    The operating system's errors (they carry an errno: a missing file, no permission, a
    failing disk) keep their type and gain a note. pyarrow's own errors about the content
    (``ArrowInvalid``; the ``OSError`` without errno it raises for undecodable pages or
    metadata) mean a corrupt or non-Parquet file: a :class:`RecordError` naming it.
    """
    pa, _ = _pyarrow()
    if isinstance(exc, SourceError):
        return exc  # a remote read's FetchError (it names the URL), a missing column
    if isinstance(exc, OSError) and exc.errno is not None:
        exc.add_note(f"while reading the Parquet file {name!r}")
        return exc
    if isinstance(exc, (pa.ArrowException, OSError)):
        return RecordError(f"{name}: not a readable Parquet file: {type(exc).__name__}: {exc}",
                           source=name)
    return exc


def _reraise(error: BaseException, cause: BaseException) -> NoReturn:
    if error is cause:
        raise error
    raise error from cause


class _Unit:
    """What one consumer reads of one file: all its row groups (None) or some of them."""

    __slots__ = ("groups", "index", "name", "owns_last")

    def __init__(self, index: int, name: str, groups: list[int] | None, owns_last: bool) -> None:
        self.index = index
        self.name = name
        self.groups = groups
        #: Whether this consumer reads the file's last row group (and so counts the shard).
        self.owns_last = owns_last


class ParquetRows(ShardedSource[Any]):
    """Rows of Parquet files, as dicts, or column batches; reading only the chosen columns.

    Each epoch a consumer (worker ``w`` of ``W`` of rank ``r`` of ``R``) reads its share of the
    data: whole files when there are at least ``R * W`` files, else row groups (every consumer
    then reads every file's footer to list them), so that more consumers than files still
    share the work. Either way each row is read exactly once per epoch across all ranks and
    workers, and, with ``shuffle_shards``, the files (or row groups) come in a new order every
    epoch, the same on every consumer. A consumer reads up to ``concurrency`` remote files at
    once (local files one at a time: their reads need the CPU, which pyarrow already uses on
    several threads) and hands their rows on in order, so the output is reproducible. It holds
    at most about ``3 * concurrency + 2`` batches of ``batch_rows`` rows (rows as dicts:
    a batch's Arrow data, and its dicts :data:`ROW_BLOCK` at a time).

    Rows (``as_batches=False``) are dicts ``{column: value}`` of Python values
    (``RecordBatch.to_pylist()``: nested structs are dicts, lists are lists, nulls None); the
    :class:`DataLoader` collates them into a dict of arrays. Batches (``as_batches=True``) are
    dicts ``{column: numpy array}`` of up to ``batch_rows`` rows each (shorter at the end of a
    file or row group), writable, strings and nested values as object arrays and integer
    columns with nulls as floats with NaN (pyarrow's ``to_numpy``); use
    ``DataLoader(..., batch_size=None)`` to take them as they are.

    Files may be local or remote: ``s3://``, ``gs://`` and ``az://`` URLs, prefixes and
    patterns (listed as the other sources list them) and ``http(s)://`` URLs, read with
    bounded ranged requests: the footer, then only the chosen columns' chunks of the row
    groups this consumer reads (see the module's description). The object store and HTTP
    options are :class:`ShardedSource`'s.

    Args:
        urls: Parquet paths, directories or glob patterns (a directory stands for all its
            non-hidden files: prefer a pattern such as ``"data/*.parquet"``).
        columns: the columns to read (top-level names, or dotted paths into structs), or None
            for all. A column that a file lacks is a :class:`SourceError` naming the file.
        batch_rows: rows per batch read (and per item with ``as_batches=True``).
        as_batches: yield column batches instead of rows.
        shuffle_shards: shuffle the files (or row groups) at every epoch, seeded by
            ``seed + epoch``; rows keep their order within a unit (add ``.shuffle(n)``).
        seed: the shuffling seed; the same on every rank.
        rank: this process's rank (default: torch.distributed's initialized process group's,
            else ``RANK``, else 0).
        world_size: number of ranks (default: the process group's, else ``WORLD_SIZE``,
            else 1).
        even_ranks: ``True``: every rank reads the same number of units (files, or row
            groups when there are fewer files than consumers) per epoch, leaving one out in
            turn where needed (off by default: every unit read once, a warning when the
            ranks' shares differ); see :class:`ShardedSource`. With it on, fewer row groups
            in all than ranks is a ``ValueError`` at construction (the footers are read to
            count them when there are fewer files than ranks).
        records_per_rank: exactly this many rows (or, with ``as_batches``, batches) per
            rank and epoch, as :class:`ShardedSource` does it.
        concurrency: remote files read at once (read-ahead); local ones are read one at a
            time.
        skip_errors: a corrupt file (or row group) is counted in ``stats.skipped`` and the rest
            of that file skipped, instead of raising its :class:`RecordError`.
        timeout: seconds for connecting and for each read of a remote file (None: no limit).
        retries: attempts of a remote read after its first one.
        backoff: delay before the first retry, in seconds; doubles at each retry.
        max_backoff: the longest delay between attempts.
        headers: extra HTTP request headers (authorization, ...).
        client_factory: makes the ``httpx.AsyncClient`` for a file's HTTP reads.
        store: an obstore store for every object store URL (custom credentials, endpoint).
        cache_dir: a local directory keeping the remote files read, as
            :class:`ShardedSource`'s (shared by processes, least recently used evicted). A
            file is downloaded whole into it at its first read (random access needs the whole
            file: every column is kept, whatever ``columns`` asks), then read locally; one
            larger than ``cache_limit`` allows is read by ranges, as without a cache.
        cache_limit: the most bytes ``cache_dir`` keeps (None: no limit).

    Attributes:
        stats: counters; ``bytes`` counts the compressed column chunks read and the footers
            (what the reads fetch), ``shards`` the files read to their end.

    Raises:
        ImportError: pyarrow is not installed.
        FileNotFoundError: a path does not exist.
        ValueError: a bad option.
        FetchError: listing an object store prefix failed.
        TypeError: ``columns`` is not a sequence of names.
    """

    def __init__(
        self,
        urls: ShardsLike,
        *,
        columns: Sequence[str] | None = None,
        batch_rows: int = DEFAULT_BATCH_ROWS,
        as_batches: bool = False,
        shuffle_shards: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        even_ranks: bool | None = None,
        records_per_rank: int | None = None,
        concurrency: int = 2,
        skip_errors: bool = False,
        timeout: float | None = 30.0,
        retries: int = 5,
        backoff: float = 0.1,
        max_backoff: float = 10.0,
        headers: Mapping[str, str] | None = None,
        client_factory: Callable[[], Any] | None = None,
        store: Any = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
    ) -> None:
        _pyarrow()
        super().__init__(urls, shuffle_shards=shuffle_shards, seed=seed, rank=rank,
                         world_size=world_size, even_ranks=even_ranks,
                         records_per_rank=records_per_rank, concurrency=concurrency,
                         skip_errors=skip_errors, timeout=timeout, retries=retries,
                         backoff=backoff, max_backoff=max_backoff, headers=headers,
                         client_factory=client_factory, store=store, cache_dir=cache_dir,
                         cache_limit=cache_limit)
        if columns is not None:
            if isinstance(columns, (str, bytes)) or not isinstance(columns, Sequence) \
                    or not all(isinstance(c, str) for c in columns):
                raise TypeError(f"columns should be a sequence of column names (or None for "
                                f"all), but got columns={columns!r}")
            if not columns:
                raise ValueError("columns should name at least one column (or be None for all)")
        self.columns: list[str] | None = None if columns is None else list(columns)
        self.batch_rows: int = check_int("batch_rows", batch_rows)
        self.as_batches: bool = bool(as_batches)
        self._row_groups: list[int] | None = None  # per file, once every footer was read
        if self.even_ranks is not None and len(self.shards) < self.world_size:
            check_ranks(sum(self._row_group_counts()[0]), rank=self.rank,
                        world_size=self.world_size, what="row group")

    def _check_ranks(self) -> None:
        pass  # at the end of __init__: row groups count too, and URLs are refused first

    # Resumed by counting, Stream's default (replay the epoch, drop what was delivered), not
    # by the shard offsets of the byte-stream sources: a row group is read whole anyway.
    _blocks_at = Stream._blocks_at

    # A count means nothing over another list of files (one landed in the directory since,
    # another split): the position names the list, as the byte-stream sources' name their
    # shard, so that such a resume is refused instead of skipping the wrong rows.
    def _files(self) -> str:
        digest = hashlib.sha256("\n".join(self.shards).encode()).hexdigest()[:16]
        return f"{len(self.shards)} files, sha256 {digest}"

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        return {**Stream._state(self, token, skip), "files": self._files()}

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        Stream._check(self, at, slot)
        check_same(at, "files", self._files(), type(self).__name__)

    def __repr__(self) -> str:
        return (f"ParquetRows({len(self.shards)} files, rank {self.rank} of {self.world_size}, "
                f"columns={self.columns}, as_batches={self.as_batches})")

    # Planning ----------------------------------------------------------------------------
    def _row_group_counts(self) -> tuple[list[int], dict[int, RecordError]]:
        """Row groups per file and the errors of unreadable footers (blocking: footers are
        read); cached once every footer was read."""
        if self._row_groups is not None:
            return self._row_groups, {}
        _, pq = _pyarrow()
        counts = []
        errors: dict[int, RecordError] = {}
        for index, name in enumerate(self.shards):
            try:
                handle = open_parquet_shard(name, self)
                try:
                    counts.append(pq.read_metadata(handle).num_row_groups)
                finally:
                    if not isinstance(handle, str):
                        handle.close()
            except Exception as exc:
                error = _located(name, exc)
                if not isinstance(error, RecordError):
                    _reraise(error, exc)
                errors[index] = error
                counts.append(0)
        if not errors:
            self._row_groups = counts
        return counts, errors

    def _plan(self, epoch: int, worker_id: int, num_workers: int,
              skipped: list[RecordError] | None = None) -> tuple[list[_Unit], int]:
        """What this consumer reads in an epoch (blocking in row-group mode), and the number
        of units of the epoch; the unreadable footers that it is the one to count as skipped
        are appended to ``skipped``."""
        consumers = self.world_size * num_workers
        split = functools.partial(assign_shards, rank=self.rank, world_size=self.world_size,
                                  worker_id=worker_id, num_workers=num_workers, epoch=epoch,
                                  seed=self.seed, shuffle=self.shuffle_shards,
                                  even=self.even_ranks)
        if len(self.shards) >= consumers:
            return ([_Unit(i, self.shards[i], None, True) for i in split(len(self.shards))],
                    len(self.shards))
        counts, errors = self._row_group_counts()
        for index, error in errors.items():
            # Every consumer read the bad footer; one of them counts it when skipping.
            skip = self.skip_errors and index % consumers == self.rank * num_workers + worker_id
            if not self.skip_errors:
                raise error
            if skip and skipped is not None:
                skipped.append(error)
        units = [(file, group) for file, count in enumerate(counts) for group in range(count)]
        mine = [units[i] for i in split(len(units))]
        # Consecutive row groups of one file are read with one open and one reader.
        plan = []
        for file, run in itertools.groupby(mine, key=lambda unit: unit[0]):
            groups = [group for _, group in run]
            plan.append(_Unit(file, self.shards[file], groups, counts[file] - 1 in groups))
        return plan, len(units)

    def _units(self, num_units: int) -> str:
        return "files" if num_units == len(self.shards) else "row groups"

    def _unit_name(self, unit: int, num_units: int) -> str:
        if num_units == len(self.shards):
            return f"file {unit} ({self.shards[unit]})"
        number = unit
        for file, count in enumerate(self._row_groups or ()):  # (None: a footer was bad)
            if number < count:
                return f"row group {number} of file {file} ({self.shards[file]})"
            number -= count
        return f"row group {unit} of the epoch"

    async def _planned(self, ctx: _Context, skipped: list[RecordError] | None = None
                       ) -> tuple[list[_Unit], int]:
        """:meth:`_plan` of the epoch: in a thread when it reads footers (row groups), else
        here (it only splits the list of files: a thread call would cost more)."""
        args = (ctx.epoch, ctx.worker_id, ctx.num_workers, skipped)
        # A blocking epoch (a sync for with no loop, see Stream._loopless) has no thread to
        # wait on: its reads all run on the consumer's thread.
        if ctx.blocking or len(self.shards) >= self.world_size * ctx.num_workers:
            return self._plan(*args)
        return await anyio.to_thread.run_sync(self._plan, *args)

    def units_for(
        self, epoch: int | None = None, worker_id: int | None = None,
        num_workers: int | None = None,
    ) -> list[tuple[str, list[int] | None]]:
        """What this rank's worker reads in an epoch: ``(file, row groups)`` in reading order,
        row groups None for the whole file.

        Args:
            epoch: the epoch (default: the one the next iteration uses).
            worker_id: the worker (default: this process's, 0 outside workers).
            num_workers: workers per rank (default: this process's, 1 outside workers).
        """
        own_id, own_count = worker_slot()
        plan, _ = self._plan(self.epoch if epoch is None else epoch,
                             own_id if worker_id is None else worker_id,
                             own_count if num_workers is None else num_workers)
        return [(unit.name, unit.groups) for unit in plan]

    def shards_for(
        self, epoch: int | None = None, worker_id: int | None = None,
        num_workers: int | None = None,
    ) -> list[str]:
        """The files this rank's worker reads from in an epoch (some only in part, in
        row-group mode: see :meth:`units_for`)."""
        return [name for name, _ in self.units_for(epoch, worker_id, num_workers)]

    # Reading -----------------------------------------------------------------------------
    async def _blocks(self, ctx: _Context) -> AsyncGenerator[list[Any], None]:
        if self.records_per_rank is None:
            async with Closing(self._pass(ctx, True)) as blocks:
                async for block in blocks:
                    yield block
                    del block  # not kept while the next is made (see _items)
            return
        _, num_units = await self._planned(ctx)
        quota, where = self._quota_of(ctx, num_units)
        first = [True]

        async def passes(_: object) -> AsyncGenerator[tuple[list[Any], Any], None]:
            async with Closing(self._pass(ctx, first[0])) as blocks:
                first[0] = False
                async for block in blocks:
                    yield block, None
                    del block

        async with Closing(_up_to(quota, passes, self.stats, where)) as pairs:
            async for block, _ in pairs:
                yield block

    async def _pass(self, ctx: _Context, first: bool) -> AsyncGenerator[list[Any], None]:
        """One pass over this consumer's units; the first of the epoch counts what it left
        (unreadable footers, a dropped unit)."""
        skipped: list[RecordError] = []
        plan, num_units = await self._planned(ctx, skipped)
        if first:
            bad = BadRecords(True, self.stats)
            for error in skipped:
                bad(error)
            self._note_shares(ctx, num_units)
        # Local files one at a time (see the module's description), in one thread of their
        # own; remote ones in anyio's threads (their reads run on the loop from there).
        if not plan:
            return
        if any(_is_remote(unit.name) for unit in plan):
            readers: list[Callable[[], AsyncGenerator[list[Any], None]]] = [
                functools.partial(self._read_unit, unit) for unit in plan
            ]
            async with Closing(read_in_order(ctx, readers, min(self.concurrency,
                                                               len(readers)))) as blocks:
                async for block in blocks:
                    yield block
                    del block  # not kept while the next is made (see _items)
            return
        async with Closing(self._read_local(plan, ctx.blocking)) as blocks:
            async for block in blocks:
                yield block
                del block

    def _leaves(self, name: str, schema: Any) -> list[int]:
        """Indices of the leaf columns read; an unknown column is an error (pyarrow would
        silently read none)."""
        paths = [schema.column(i).path for i in range(len(schema))]
        if self.columns is None:
            return list(range(len(paths)))
        chosen: set[int] = set()
        for column in self.columns:
            match = [i for i, path in enumerate(paths)
                     if path == column or path.startswith(column + ".")]
            if not match:
                names = sorted({path.split(".", 1)[0] for path in paths})
                raise SourceError(f"{name}: no column {column!r} in this Parquet file (its "
                                  f"columns: {', '.join(names)})", source=name)
            chosen.update(match)
        return sorted(chosen)

    def _convert(self, batch: Any) -> Any:
        """What a read thread hands on of a batch: with ``as_batches``, its one item (a dict
        of numpy arrays, made there); else the Arrow batch itself, whose rows
        :meth:`_items` makes where they are consumed."""
        if self.as_batches:
            return [{name: column.to_numpy(zero_copy_only=False, writable=True)
                     for name, column in zip(batch.schema.names, batch.columns, strict=True)}]
        return batch

    def _items(self, got: Any) -> Iterator[list[Any]]:
        """The blocks of items of what :meth:`_convert` gave: its one column batch, or its
        rows, :data:`ROW_BLOCK` at a time (``RecordBatch.to_pylist`` of a slice, as
        :func:`_rows_of` makes them). Rows are made here, on the event loop, not in the read
        thread: the conversion holds the GIL either way (so a thread did not free the loop,
        only cut its work into switch intervals, 5 ms), a piece blocks the loop for about as
        long (4096 rows of five columns: ~1.5 ms), and made in the thread that consumes them,
        the rows are still in its caches.

        No stage of the chain keeps a block it handed on once the next is asked for (``del
        block`` after each yield; the consumer keeps only its length: see the resume notes
        of :mod:`aloader.streams._positions`), so a block's ~2 MB of dicts are freed before the next
        block is made, which reuses that memory while it is in the caches."""
        if self.as_batches:
            yield got
            return
        for start in range(0, got.num_rows, ROW_BLOCK):
            yield _rows_of(got.slice(start, ROW_BLOCK))

    async def _read_unit(self, unit: _Unit) -> AsyncGenerator[list[Any], None]:
        """One remote file's (or its row groups') rows, a block per batch, each read by a
        call of anyio's threads (whose reads run on the event loop from there)."""
        stats = self.stats
        bad = BadRecords(self.skip_errors, stats)
        reader = _UnitReader(self, unit)
        try:
            while True:
                try:
                    items, rows, read = await anyio.to_thread.run_sync(reader.next)
                except Exception as exc:
                    stats.bytes += reader.footer  # what the failed call read, if anything
                    error = _located(unit.name, exc)
                    if isinstance(error, RecordError) and bad(error):
                        return
                    _reraise(error, exc)
                stats.bytes += read
                stats.records += rows
                if items is not None:
                    for block in self._items(items):
                        yield block
                        del block  # not kept while the next is made (see _items)
                if items is None or reader.rows >= reader.total:
                    break
            if unit.owns_last:
                stats.shards += 1
        finally:
            reader.close()
            if isinstance(reader.handle, _RangeFile):
                await reader.handle.aclose()

    async def _read_local(self, plan: list[_Unit], blocking: bool = False
                          ) -> AsyncGenerator[list[Any], None]:
        """A pass's local units' rows, a block per batch (or per :data:`ROW_BLOCK` rows), one
        unit after another, each batch read by a call of one :class:`_ReadThread` (see
        :class:`_LocalReader`). A call runs to its end (a cancellation, or the end of the
        pass, waits for it), so a file is never closed under a read. With ``blocking`` (an
        epoch with no event loop: a sync ``for``, see :meth:`Stream._loopless`) each batch is
        read on this thread when it is asked for, with no thread and no read ahead.

        The next batch's read is queued before this one is handed on (one batch read
        ahead): the thread decodes it while rows are made here (:meth:`_items`) or a column
        batch is handed on (measured at 1M rows: rows ~0.8x the CPU time of converting whole
        batches in the thread with no read ahead; column batches 0.9-0.95x the wall time).
        """
        stats = self.stats
        bad = BadRecords(self.skip_errors, stats)
        local = _LocalReader(self, plan)
        thread = None if blocking else _ReadThread(shared=True)
        submit = functools.partial(_called, local.next) if thread is None \
            else functools.partial(thread.submit, local.next)
        pending: Callable[[], Awaitable[_LocalStep | None]] | None = None
        try:
            while True:
                call, pending = pending or submit(), None
                try:
                    got = await call()
                except _UnitFailed as failed:
                    stats.bytes += failed.read  # what the failed call read, if anything
                    unit = plan[failed.index]
                    error = _located(unit.name, failed.error)
                    if isinstance(error, RecordError) and bad(error):
                        continue  # the thread went on with the next unit
                    _reraise(error, failed.error)
                if got is None:
                    break
                index, items, rows, read, done = got
                if thread is not None:
                    pending = thread.submit(local.next)
                stats.bytes += read
                stats.records += rows
                if items is not None:
                    for block in self._items(items):
                        yield block
                        del block  # not kept while the next is made (see _items)
                if done and plan[index].owns_last:
                    stats.shards += 1
        finally:
            if pending is not None:
                # The read ahead runs to its end before its file is closed; what it read or
                # raised is not this pass's any more.
                with contextlib.suppress(Exception):
                    await pending()
            local.close()
            if thread is not None:
                thread.close()


def _called(fn: Callable[[], T]) -> Callable[[], Awaitable[T]]:
    """What gives ``fn()`` when awaited, called on this thread then (:meth:`_ReadThread.submit`
    for an epoch with no thread to call it in)."""

    async def result() -> T:
        return fn()

    return result


class _ReadThread:
    """One OS thread making a pass's blocking reads of local files, one call at a time.

    A call costs a queue put and one wake-up of the event loop; ``anyio.to_thread.run_sync``
    costs two to three times that (its limiter, cancel scope and worker hand-off: measured
    70 against 200 us on a loaded 2-core machine), which, at a batch of two narrow columns
    every 2 ms, was 5-10% of an epoch. Like ``run_sync`` (not abandoning), a call runs to its
    end: a cancellation of the caller waits for it, so a file is never closed under a read.
    The thread exits when :meth:`close` is called, or this object is collected; with
    ``shared``, it is left idle instead, for the next pass (of any source) to take, and exits
    after ``_LINGER`` seconds without one: starting a thread waits for it to be scheduled,
    which on a loaded machine took 2-5 ms of every epoch (a pass per epoch).

    Args:
        shared: take an idle thread of an earlier pass, if any, and leave this one idle at
            the end (:meth:`close`, or collection), rather than start and end one's own.
    """

    def __init__(self, shared: bool = False) -> None:
        self._shared = shared
        self._work: _Queue | None = None
        self._end: weakref.finalize[Any, Any] | None = None
        self._waiter = waiters()
        self._call_soon = threadsafe_caller()

    def _queue(self) -> _Queue:
        """The work queue of this object's thread, taken or started at the first call."""
        work = self._work
        if work is None:
            with _IDLE_LOCK:
                work = _IDLE.pop() if self._shared and _IDLE else None
            if work is None:
                work = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(work, self._shared),
                                 name="aloader-parquet", daemon=True).start()
            self._work = work
            # Once only (close, or collection): a queue made idle twice would have two owners.
            self._end = (weakref.finalize(self, _make_idle, work) if self._shared
                         else weakref.finalize(self, work.put, None))
        return work

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in the thread; its exception, if it raises."""
        return await self.submit(fn)()

    def submit(self, fn: Callable[[], T]) -> Callable[[], Awaitable[T]]:
        """Queue ``fn()`` for the thread now (calls run in the order submitted); what is
        returned gives its result (or raises its exception) when awaited, once."""
        work = self._queue()
        waiter = self._waiter()
        box: list[Any] = []
        work.put((fn, box, waiter, self._call_soon))

        async def result() -> T:
            with anyio.CancelScope(shield=True):
                await waiter
            ok, value = box
            if not ok:
                raise value
            done: T = value
            return done

        return result

    def close(self) -> None:
        if self._end is not None:
            self._end()


# A read thread's work: (call, result box, waiter, the waiter's loop's call_soon), or None
# at the end of its (not shared) _ReadThread.
_Queue = queue.SimpleQueue[
    tuple[Callable[[], Any], list[Any], Waiter, Callable[[Callable[[], None]], None]] | None]
# The queues of the shared read threads now idle; guarded by _IDLE_LOCK.
_IDLE: list[_Queue] = []
_IDLE_LOCK = threading.Lock()
# Seconds an idle shared read thread waits for a pass before it exits.
_LINGER = 1.0


def _forget_idle() -> None:
    # A forked child has none of its parent's threads: their queues would never be served.
    global _IDLE_LOCK
    _IDLE.clear()
    _IDLE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_idle)


def _make_idle(work: _Queue) -> None:
    """Leave a shared read thread idle, for the next pass: at once, from the closing side, so
    that a pass starting right after the last one ended takes it (its thread serves what is
    queued in order: the last pass's calls, if any, then the next one's)."""
    with _IDLE_LOCK:
        _IDLE.append(work)


def _serve(work: _Queue, shared: bool) -> None:
    """A read thread's loop (it holds no reference to its :class:`_ReadThread`, which may
    go). A shared one, once its _ReadThread ended, is idle (its queue in ``_IDLE``) until a
    pass takes its queue; after ``_LINGER`` seconds without work it exits if it is still
    idle, once it took itself out of ``_IDLE`` (under the lock, so a queue taken is always
    served)."""
    while True:
        try:
            call = work.get(timeout=_LINGER) if shared else work.get()
        except queue.Empty:
            with _IDLE_LOCK:
                if any(idle is work for idle in _IDLE):
                    _IDLE[:] = [idle for idle in _IDLE if idle is not work]
                    return
            continue  # taken by a pass: its calls are coming
        if call is None:
            return
        fn, box, waiter, call_soon = call
        try:
            box[:] = (True, fn())
        except BaseException as exc:  # handed to the caller, whatever it is
            box[:] = (False, exc)
        call_soon(functools.partial(waiter.set_result, None))
        del call, fn, box, waiter, call_soon  # nothing kept while the thread waits


# What a call of _LocalReader.next gives: (unit index, items or None, rows, bytes, whether
# the unit ended).
_LocalStep = tuple[int, "list[Any] | None", int, int, bool]


class _UnitFailed(Exception):
    """A unit's read failed (in :class:`_LocalReader`): which unit, the error, and the bytes
    the failed call read (to count)."""

    def __init__(self, index: int, error: Exception, read: int) -> None:
        super().__init__(index, error, read)
        self.index = index
        self.error = error
        self.read = read


class _LocalReader:
    """Reads a pass's local units one after another, a batch per call of :meth:`next`
    (blocking: called in the pass's :class:`_ReadThread`, in order), going on to the next
    unit by itself: the thread opens the next file without waiting for the event loop.

    After an error the unit is given up (closed) and the next call goes on with the next
    unit when the source skips errors, else every later call returns None (the pass is
    over).
    """

    def __init__(self, source: ParquetRows, plan: list[_Unit]) -> None:
        self.readers = [_UnitReader(source, unit) for unit in plan]
        self.skip = source.skip_errors
        self.index = 0

    def next(self) -> _LocalStep | None:
        """The next batch of the pass (see :data:`_LocalStep`), or None at its end.

        Raises:
            _UnitFailed: the read of a unit failed.
        """
        if self.index < len(self.readers):
            index = self.index
            reader = self.readers[index]
            try:
                items, rows, read = reader.next()
            except Exception as exc:
                self.index = index + 1 if self.skip else len(self.readers)
                read = reader._take_footer()
                reader.close()
                raise _UnitFailed(index, exc, read) from None
            done = items is None or reader.rows >= reader.total
            if done:
                self.index += 1
                reader.close()
            return index, items, rows, read, done
        return None

    def close(self) -> None:
        """Close every reader still open (once no call is pending)."""
        for reader in self.readers:
            reader.close()


class _UnitReader:
    """Reads one unit, a batch per call of :meth:`next` (blocking: called in a thread).

    The first call also opens the file, and the end is known from the footer's row counts
    (:attr:`rows` reaching :attr:`total`, read by the caller between calls), so a unit of
    ``n`` batches costs ``n`` thread calls. It counts nothing itself (it runs in a thread):
    each call returns what to count, and after a failed call the caller reads :attr:`footer`
    (the bytes read and not yet returned). After a failed call, the later ones return
    ``(None, 0, 0)``.
    """

    def __init__(self, source: ParquetRows, unit: _Unit) -> None:
        self.source = source
        self.unit = unit
        self.handle: Any = None  # what open_parquet_shard gave
        self.parquet: Any = None
        self.batches: Any = None
        #: Rows read so far, and the rows of the unit.
        self.rows = 0
        self.total = 0
        #: Bytes of the footer, once read (until the caller counts them).
        self.footer = 0
        #: Per row group read: (rows up to its end, bytes of its column chunks read).
        self.ends: list[tuple[int, int]] = []
        self._counted = 0  # row groups whose bytes were returned
        self._failed = False

    def _open(self) -> None:
        _, pq = _pyarrow()
        source, unit = self.source, self.unit
        self.handle = open_parquet_shard(unit.name, source, reuse=True)
        # A remote file's reads stay in this thread (pre_buffer=False): pyarrow's pre-buffering
        # would make them in its own I/O threads, outside the event loop's reach (a read
        # there could not be cancelled, and would need a loop of its own), and would fetch
        # the gaps between chosen columns.
        parquet = self.parquet = pq.ParquetFile(self.handle,
                                                pre_buffer=isinstance(self.handle, str))
        metadata = parquet.metadata
        self.footer = metadata.serialized_size + 8  # the footer, its length and the magic
        leaves = source._leaves(unit.name, metadata.schema)
        groups = unit.groups if unit.groups is not None else range(metadata.num_row_groups)
        for group in groups:
            chunk = metadata.row_group(group)
            self.total += chunk.num_rows
            self.ends.append((self.total,
                              sum(chunk.column(i).total_compressed_size for i in leaves)))
        self.batches = parquet.iter_batches(batch_size=source.batch_rows,
                                            row_groups=list(groups), columns=source.columns)

    def next(self) -> _Step:
        """``(items, rows, bytes)``: the items of the next batch (None at the end of the
        unit), its rows, and the bytes read that were not returned yet (the footer at the
        first call, a row group's column chunks once its last row was read)."""
        if self._failed:
            return None, 0, 0
        try:
            if self.handle is None:
                self._open()
            if self.rows >= self.total:
                return None, 0, self._take_footer()
            batch = next(self.batches, None)
            if batch is None:
                return None, 0, self._take_footer()
            rows = batch.num_rows
            self.rows += rows
            items = self.source._convert(batch)
        except BaseException:
            self._failed = True  # the footer's bytes, if just read, stay for the caller
            raise
        read = self._take_footer()
        ends = self.ends
        while self._counted < len(ends) and ends[self._counted][0] <= self.rows:
            read += ends[self._counted][1]
            self._counted += 1
        return items, rows, read

    def _take_footer(self) -> int:
        footer, self.footer = self.footer, 0
        return footer

    def close(self) -> None:
        # The batch generator goes first: one left alive keeps pyarrow's reading of the
        # file going in its own threads (measured: twice the CPU time of an epoch of rows,
        # when a pass's finished readers were kept until its end).
        self.batches = None
        if self.parquet is not None:
            self.parquet.close()  # closes the file it opened itself (from a path)
            self.parquet = None
        if self.handle is not None and not isinstance(self.handle, str):
            self.handle.close()
