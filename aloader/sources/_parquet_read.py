"""How :class:`~aloader.sources._parquet.ParquetRows` reads: its blocking reads in threads,
remote files as bounded ranged reads.

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
import functools
import importlib
import os
import queue
import threading
import weakref
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
)
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread

from .._backend import Waiter, threadsafe_caller, waiters
from .._exceptions import FetchError, RecordError, SourceError
from .._util import Closing
from ..io._cache import Version
from ..io._files import RandomAccessFile
from ..io._http import http_chunks, make_client
from ..io._objstore import is_object_url
from ._sharding import is_url

if TYPE_CHECKING:
    from ._parquet import ParquetRows

T = TypeVar("T")

__all__ = ("open_parquet_shard",)

_INSTALL = "pip install aloader[parquet]"

# What one blocking read of a unit gives (see _UnitReader.next).
_Step = tuple["list[Any] | None", int, int]


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
