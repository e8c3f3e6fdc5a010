"""A local disk cache of remote shards (``cache_dir=``, ``cache_limit=`` of the sources).

A remote shard (``http(s)://``, ``s3://``, ``gs://``, ``az://``) read with a cache is kept on
local disk, so a later epoch reads it at local-file speed; the least recently used shards are
evicted to keep the cache's total size under ``cache_limit`` bytes. Several processes of one
machine (ranks, loader workers, other jobs) may share one directory.

Invariants:

* A file under its final name is a complete copy of one version of one object: it is written
  under a temporary name in the same directory and moved into place (``os.replace``) only
  when the download ended without error and its length is the object's size. A truncated or
  failed download, or one whose reader stopped early, is deleted, never committed; a crashed
  downloader's temporary file is never read (readers only open final names) and is removed by
  the next process that downloads that URL or makes room in the cache. A final file whose
  length is not its version's (a machine's crash before the bytes reached the disk, a hand)
  is removed when it is looked up, never read; one of the right length whose bytes changed
  cannot be told (no checksum is kept).
* One download per object version at a time, machine-wide: a downloader holds the URL's lock
  (``flock`` on ``<key>.lock``, released by the kernel if the process dies) from its request
  to its commit. Another process wanting that URL meanwhile waits for the lock (polling, so
  that it can be cancelled), then reads the file just committed: the shard is downloaded once.
  The waiter's records start only when the download ends (it does not read a growing file).
  Never a hang: a download's holder may itself wait for the waiter (two sources of one
  process over the same shard, interleaved; ranks meeting in a collective), so a reader does
  not wait for a download of its own process, nor for one that showed no progress for 10 s
  (the holder stamps its lock as it writes): it then reads the store without the cache.
* The cache key is the URL and the object's version: its size and its ETag (or, without one,
  its Last-Modified), from the store's answer. A changed object gets another key, so it is
  downloaded again, never served stale from an older copy.
* Eviction (under the directory's ``.lru.lock``) removes committed files only, the least
  recently used first (a hit stamps the file's modification time); a file being downloaded
  reserves its whole size (its temporary file is sized up front) and is never evicted. A
  reader that has a file open keeps reading it after its eviction (POSIX unlink semantics). A
  shard larger than what the limit leaves free is streamed without being kept.

Which version a source reads: a source pins an object's version when it first sees it: at
construction, from the listing of an object store prefix or pattern, else from the first
answer of the store in this process. While pinned, a cached copy is read without any request
(a later epoch makes none; one whose shards are all kept at their pinned versions is read
inline, as an epoch over local files: see ``ShardedSource._loopless``). A new source (or a
new worker process of a source that did not list its objects) asks the store again, at its
first read, and reads the new version if the object changed. A process that waited for
another's download takes the version that download found (it was asked of the store after
the waiting began).

What is kept: the bytes as the store sends them (a compressed shard stays compressed, and is
decompressed as it is read). Not kept: a body without a known length (an HTTP response with a
``Content-Encoding`` or without ``Content-Length``), and a shard resumed from the middle that
is not cached yet (it is read from the store from that offset, as without a cache). A write
error (a full disk) stops keeping that shard, not reading it.

Files in the directory: ``<url hash>-<version hash>.shard`` (committed copies),
``....tmp-<pid>-<random>`` (downloads in progress), ``<url hash>.json`` (the version last
found for the URL and when), ``<url hash>.lock`` and ``.lru.lock`` (locks, left in place).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import secrets
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from .._exceptions import FetchError
from .._facade import PrivateLoop, SyncIterator
from .._log import http_log
from .._util import Closing
from ._files import file_chunks

if TYPE_CHECKING:
    from .._stats import SourceStats

__all__ = ("ShardCache", "Version", "make_version")

# (size in bytes, the ETag or ``lm:<Last-Modified>`` or None): what identifies an object's
# version. Only comparable values: a listing's Last-Modified is finer than a GET's.
Version = tuple[int, str | None]
# (on_size, on_version, start) -> the object's bytes from ``start``.
OnVersion = Callable[[int | None, str | None, str | None], None]
Fetch = Callable[[Callable[[int], None], OnVersion, int], AsyncGenerator[bytes, None]]

_SUFFIX = ".shard"
_TEMP = ".tmp-"
_LRU_LOCK = ".lru.lock"
# Waiting for a lock: the first poll after 2 ms, then doubling up to 50 ms.
_FIRST_POLL = 0.002
_LAST_POLL = 0.05
# A waiter gives up waiting for a download that shows no progress for this many seconds (a
# holder stalled by its own consumer, which may wait for the waiter: ranks in a collective),
# and reads from the store itself. The holder stamps its lock every _BEAT seconds at most.
_PATIENCE = 10.0
_BEAT = 0.5


def make_version(size: int | None, etag: str | None, last_modified: str | None
                 ) -> Version | None:
    """The version of an object from its size and its store's ETag or Last-Modified, or None
    when its size is unknown (such a body is not cached)."""
    if size is None:
        return None
    if etag:
        # A weak validator and the quotes are the same ETag to a list and to a GET.
        tag = etag.removeprefix("W/").strip('"')
        return size, tag
    return size, f"lm:{last_modified}" if last_modified else None


def _hash(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@functools.lru_cache(maxsize=1 << 16)
def _copy_path(directory: str, url: str, version: Version) -> str:
    # Remembered: a cached epoch looks its copies up twice per shard (ShardedSource._loopless,
    # then the read), two hashes and a JSON encoding each time otherwise.
    base = os.path.join(directory, _hash(url, 32))
    return f"{base}-{_hash(json.dumps(version), 16)}{_SUFFIX}"


class _Gone(Exception):
    """The cached file was evicted between its lookup and its opening: look it up again."""


# The URL locks this process holds, by path: another reader of the URL in this process does
# not wait for one (the holder may be waiting for that very reader's consumer: two sources
# over the same shards interleaved), it reads from the store without the cache.
_HELD: dict[str, int] = {}


def _forget_held() -> None:
    # A forked child shares its parent's locks (the same open files): close its copies, so
    # that the parent's release frees them.
    for fd in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_held)


class _Lock:
    """An exclusive ``flock`` on a file, acquired by polling (cancellable), released once.

    A URL lock's holder stamps the file's modification time as its download goes on
    (:meth:`beat`); a waiter that sees no stamp for ``patience`` seconds gives up waiting.
    """

    def __init__(self, fd: int, path: str | None) -> None:
        self._fd: int | None = fd
        self._path = path
        self._beat = time.monotonic()
        if path is not None:
            _HELD[path] = fd
            os.utime(fd)

    @classmethod
    async def acquire(cls, path: str, patience: float | None = None) -> _Lock | None:
        """The lock, or None when ``patience`` (seconds) is given and the holder went that
        long without progress, or when this process holds it (URL locks, which are the ones
        with a patience)."""
        url_lock = patience is not None
        if url_lock and path in _HELD:
            return None
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            delay = _FIRST_POLL
            seen = os.fstat(fd).st_mtime_ns
            changed = time.monotonic()
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return cls(fd, path if url_lock else None)
                except BlockingIOError:
                    pass
                if patience is not None:
                    now = time.monotonic()
                    stamp = os.fstat(fd).st_mtime_ns
                    if stamp != seen:
                        seen, changed = stamp, now
                    elif now - changed > patience or path in _HELD:
                        os.close(fd)
                        return None
                await anyio.sleep(delay)
                delay = min(delay * 2, _LAST_POLL)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def free(path: str) -> bool:
        """Whether nobody holds the lock at ``path`` now (another descriptor of this process
        holding it counts as somebody)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # releases the lock, if taken
        return True

    def beat(self) -> None:
        """Show the processes waiting that the download goes on (a stamp every ``_BEAT``
        seconds at most)."""
        now = time.monotonic()
        if self._fd is not None and now - self._beat >= _BEAT:
            self._beat = now
            os.utime(self._fd)

    def release(self) -> None:
        if self._fd is not None:
            if self._path is not None:
                _HELD.pop(self._path, None)
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None


class _Writer:
    """The temporary file of one download: written as the bytes stream, committed if whole."""

    def __init__(self, temp: str, final: str, version: Version) -> None:
        self.temp = temp
        self.final = final
        self.version = version
        self.size = size = version[0]
        self.written = 0
        self.fd: int | None = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                      0o644)
        # Sized up front: the reservation the other processes' accounting sees.
        os.ftruncate(self.fd, size)

    def write(self, data: bytes) -> None:
        """Append ``data``; on a write error (a full disk), stop keeping the shard."""
        if self.fd is None:
            return
        try:
            # Straight to the page cache in the event loop: cheaper than a thread hop per
            # chunk, and the bytes were just received, so the loop is not waiting on disk.
            view = memoryview(data)
            while view:
                done = os.write(self.fd, view)
                view = view[done:]
            self.written += len(data)
        except OSError as exc:
            http_log.warning("not caching %s: %s", self.final, exc)
            self.discard()

    def commit(self) -> bool:
        """Move the file into place if it holds the whole object; else delete it."""
        if self.fd is None:
            return False
        if self.written != self.size:
            self.discard()
            return False
        os.close(self.fd)
        self.fd = None
        os.replace(self.temp, self.final)
        now = time.time_ns()
        os.utime(self.final, ns=(now, now))
        return True

    def discard(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.temp)


@dataclass(frozen=True)
class ShardCache:
    """A cache directory and its size limit (see the module's description); it pickles.

    Attributes:
        directory: the cache directory (created if missing).
        limit: the most bytes kept, or None for no limit.
    """

    directory: str
    limit: int | None = None

    def __post_init__(self) -> None:
        os.makedirs(self.directory, exist_ok=True)

    # Names -----------------------------------------------------------------------------
    def _base(self, url: str) -> str:
        return os.path.join(self.directory, _hash(url, 32))

    def path(self, url: str, version: Version) -> str:
        """Where the copy of ``url`` at ``version`` is kept."""
        return _copy_path(self.directory, url, version)

    def kept(self, url: str, version: Version) -> str | None:
        """The committed copy's path, stamped as just used, or None if there is none.

        A copy whose length is not its version's (cut by a crash of the machine before its
        bytes reached the disk, or by a hand) is never served: it is removed, and the object
        downloaded again. A copy of the right length whose bytes were altered cannot be told.
        """
        path = self.path(url, version)
        now = time.time_ns()
        try:
            if os.stat(path).st_size != version[0]:
                os.unlink(path)  # a new download commits another file in its place
                return None
            os.utime(path, ns=(now, now))
        except FileNotFoundError:
            return None
        return path

    def holds(self, url: str, version: Version | None) -> bool:
        """Whether a copy of ``url`` at ``version`` is committed now. Not stamped as used: a
        look ahead of the reads (which stamp it), that another process's eviction may still
        overtake."""
        return version is not None and os.path.exists(self.path(url, version))

    def _note(self, url: str, version: Version) -> None:
        """Record ``version`` as the one of ``url`` just committed or found committed (the
        store named it), for the processes waiting for the URL's lock."""
        base = self._base(url)
        temp = f"{base}.json{_TEMP}{os.getpid()}-{secrets.token_hex(4)}"
        with open(temp, "w") as out:
            json.dump({"url": url, "version": list(version), "at": time.time()}, out)
        os.replace(temp, f"{base}.json")

    def _recent(self, url: str, since: float) -> Version | None:
        """The version another process committed or found committed for ``url`` at or after
        ``since`` (when this one started waiting for the URL's lock), if any."""
        try:
            with open(f"{self._base(url)}.json") as source:
                note = json.load(source)
        except (FileNotFoundError, ValueError):  # none, or cut (a crash) or zeroed
            return None
        # A note of another shape (another release's, a hand's) is no note.
        match note:
            case {"url": str(noted), "version": [int(size), str() | None as tag],
                  "at": int() | float() as at} if noted == url and at >= since:
                return size, tag
        return None

    # Room --------------------------------------------------------------------------------
    async def _writer(self, url: str, version: Version, stats: SourceStats) -> _Writer | None:
        """A temporary file for ``url`` at ``version``, after evicting what must go to keep
        the total under the limit; None if the shard cannot fit."""
        size = version[0]
        base = self._base(url)
        temp = f"{self.path(url, version)}{_TEMP}{os.getpid()}-{secrets.token_hex(4)}"
        final = self.path(url, version)
        # This process holds the URL's lock: any temporary file of the URL is a leftover.
        prefix = os.path.basename(base) + "-"
        for entry in os.scandir(self.directory):
            if entry.name.startswith(prefix) and _TEMP in entry.name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        if self.limit is None:
            return _Writer(temp, final, version)
        if size > self.limit:
            return None
        lock = await _Lock.acquire(os.path.join(self.directory, _LRU_LOCK))
        assert lock is not None  # no patience: waits for as long as it takes
        try:
            kept: list[tuple[int, int, str]] = []  # (last use, size, path) of committed files
            total = 0
            for entry in os.scandir(self.directory):
                try:
                    if entry.name.endswith(_SUFFIX):
                        info = entry.stat()
                        kept.append((info.st_mtime_ns, info.st_size, entry.path))
                        total += info.st_size
                    elif _TEMP in entry.name and not entry.name.startswith("."):
                        owner = entry.name.partition("-")[0].partition(".")[0]
                        if _Lock.free(os.path.join(self.directory, owner + ".lock")):
                            os.unlink(entry.path)  # a crashed downloader's leftover
                        else:
                            total += entry.stat().st_size  # a reservation
                except FileNotFoundError:
                    continue  # evicted or committed meanwhile by another process
            kept.sort()
            while total + size > self.limit and kept:
                _, old_size, old = kept.pop(0)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(old)
                    stats.cache_evicted += 1
                total -= old_size
            if total + size > self.limit:
                return None  # the downloads in progress take the room
            return _Writer(temp, final, version)
        finally:
            lock.release()

    # Reading -----------------------------------------------------------------------------
    def chunks(
        self,
        url: str,
        fetch: Fetch,
        versions: dict[str, Version],
        stats: SourceStats,
        chunk_size: int,
        on_size: Callable[[int], None] | None = None,
        start: int = 0,
        blocking: bool = False,
    ) -> AsyncGenerator[bytes, None]:
        """The bytes of ``url`` from ``start``: from the cache, or from ``fetch`` (kept in the
        cache as they stream), as the module describes.

        A copy of the version this source pinned is read as a local file is (one
        :func:`~aloader.io._files.file_chunks` and the counting of its bytes, nothing else per
        chunk): a cached epoch costs what an epoch over local files does, plus a stamp of
        each copy's last use. Only without one does the read go through the locks and the
        store.

        With ``blocking`` the reader awaits nothing (a chain with no event loop, a sync
        ``for``'s: see ``_streams._LocalPairs``): the copy is read on this thread, and a read
        that needs the store after all (no copy, or one evicted before it was opened) runs on
        an event loop of its own (:func:`_on_own_loop`), so ``fetch`` must need no client of
        the caller's loop.

        Args:
            url: the shard's URL (its name in the cache).
            fetch: ``fetch(on_size, on_version, start)`` reads the object from the store.
            versions: the versions this source pinned, by URL (updated here).
            stats: counts hits, misses, cached bytes read and evictions.
            chunk_size: bytes per read of a cached file.
            on_size: called with the shard's size before its first chunk.
            start: the byte to start at.
            blocking: read with no event loop (see above).

        Raises:
            FetchError: the store's errors, as ``fetch`` raises them.
            OSError: the cache directory cannot be used (with a note naming the URL and the
                directory).
        """
        version = versions.get(url)
        read: Callable[[], AsyncGenerator[bytes, None]] = functools.partial(
            self._chunks, url, fetch, versions, stats, chunk_size, on_size, start)
        if blocking:
            read = functools.partial(_on_own_loop, read)
        if version is not None:
            try:
                path = self.kept(url, version)
            except OSError as exc:  # the directory cannot be used (a stamp refused, ...)
                self._noted(exc, url)
                raise
            if path is not None:
                return self._local(path, stats, chunk_size, on_size, start, (url, read),
                                   blocking)
        return read()

    async def _local(
        self, path: str, stats: SourceStats, chunk_size: int,
        on_size: Callable[[int], None] | None, start: int,
        instead: tuple[str, Callable[[], AsyncGenerator[bytes, None]]] | None = None,
        blocking: bool = False,
    ) -> AsyncGenerator[bytes, None]:
        """A cached file's bytes; :class:`_Gone` if it vanished before it was opened (evicted).

        With ``instead`` (``(url, read)``: a read outside :meth:`_chunks`, which notes the
        errors), a copy evicted before it was opened is ``read()`` instead, and the errors of
        the copy are noted as :meth:`_chunks` notes them. With ``blocking``, the file is
        opened and read on this thread (:func:`~aloader.io._files.file_chunks`'s).
        """
        opened = False

        def sized(size: int) -> None:
            nonlocal opened
            opened = True
            stats.cache_hits += 1
            if on_size is not None:
                on_size(size)

        try:
            async with Closing(file_chunks(path, chunk_size, sized, start,
                                           blocking=blocking)) as pieces:
                async for piece in pieces:
                    stats.cache_bytes += len(piece)
                    yield piece
            return
        except FileNotFoundError as exc:
            if instead is None:
                if opened:
                    raise
                raise _Gone from None
            if opened:
                self._noted(exc, instead[0])
                raise
        except OSError as exc:
            if instead is not None:
                self._noted(exc, instead[0])
            raise
        async with Closing(instead[1]()) as pieces:
            async for piece in pieces:
                yield piece

    async def _chunks(
        self, url: str, fetch: Fetch, versions: dict[str, Version], stats: SourceStats,
        chunk_size: int, on_size: Callable[[int], None] | None, start: int,
    ) -> AsyncGenerator[bytes, None]:
        try:
            for _ in range(3):
                try:
                    async with Closing(self._attempt(url, fetch, versions, stats, chunk_size,
                                                     on_size, start)) as pieces:
                        async for piece in pieces:
                            yield piece
                    return
                except _Gone:
                    continue  # evicted before it was opened: nothing was handed on
            async with Closing(_uncached(fetch, stats, on_size, start)) as pieces:
                async for piece in pieces:
                    yield piece
        except OSError as exc:
            self._noted(exc, url)
            raise

    def _noted(self, exc: OSError, url: str) -> None:
        if not isinstance(exc, FetchError):  # the store's errors name the URL already
            exc.add_note(f"while reading {url} through the shard cache {self.directory}")

    async def _attempt(
        self, url: str, fetch: Fetch, versions: dict[str, Version], stats: SourceStats,
        chunk_size: int, on_size: Callable[[int], None] | None, start: int,
    ) -> AsyncGenerator[bytes, None]:
        version = versions.get(url)
        if version is not None and (path := self.kept(url, version)) is not None:
            async with Closing(self._local(path, stats, chunk_size, on_size, start)) as pieces:
                async for piece in pieces:
                    yield piece
            return
        asked = time.time()
        lock = await _Lock.acquire(f"{self._base(url)}.lock", _PATIENCE)
        if lock is None:
            # Another reader's download does not progress (or is this process's own): do not
            # wait on it, read the store.
            async with Closing(_uncached(fetch, stats, on_size, start)) as pieces:
                async for piece in pieces:
                    yield piece
            return
        writer: _Writer | None = None
        try:
            found = self._recent(url, asked)
            if found is not None:
                versions[url] = version = found
            if version is not None and (path := self.kept(url, version)) is not None:
                lock.release()
                async with Closing(self._local(path, stats, chunk_size, on_size,
                                               start)) as pieces:
                    async for piece in pieces:
                        yield piece
                return
            sizes: list[int] = []
            answer: list[Version | None] = []

            def on_version(size: int | None, etag: str | None, modified: str | None) -> None:
                if not answer:
                    answer.append(make_version(size, etag, modified))

            cached: str | None = None
            async with Closing(fetch(sizes.append, on_version, start)) as pieces:
                first = await anext(pieces, None)
                new = answer[0] if answer else None
                if new is not None:
                    versions[url] = new
                    cached = self.kept(url, new)
                    if cached is not None:
                        self._note(url, new)
                if cached is None:
                    if on_size is not None and sizes:
                        on_size(sizes[0])
                    stats.cache_misses += 1
                    if new is not None and start == 0:
                        writer = await self._writer(url, new, stats)
                    if writer is None:
                        lock.release()
                    if first is not None:
                        if writer is not None:
                            writer.write(first)
                        yield first
                        async for piece in pieces:
                            if writer is not None:
                                writer.write(piece)
                                lock.beat()
                            yield piece
                    if writer is not None and writer.commit():
                        self._note(url, writer.version)
                    writer = None
            if cached is not None:
                # The store's answer named a version already cached: read the copy instead.
                lock.release()
                async with Closing(self._local(cached, stats, chunk_size, on_size,
                                               start)) as local:
                    async for piece in local:
                        yield piece
        finally:
            if writer is not None:
                writer.discard()
            lock.release()


async def _uncached(fetch: Fetch, stats: SourceStats, on_size: Callable[[int], None] | None,
                    start: int) -> AsyncGenerator[bytes, None]:
    """The object's bytes from the store, not kept."""
    stats.cache_misses += 1
    async with Closing(fetch(on_size or _ignore, _ignore_version, start)) as pieces:
        async for piece in pieces:
            yield piece


async def _on_own_loop(read: Callable[[], AsyncGenerator[bytes, None]]
                       ) -> AsyncGenerator[bytes, None]:
    """``read()``'s pieces, read on an event loop of its own (in a thread) and handed on here
    without an await: a chain with no event loop (a blocking epoch's) reading a shard that
    needs the store after all.

    Closed (``break``, an error, an interrupt), it closes that loop, which cancels the read
    where it waits or closes its generator where it is suspended (``asyncio.Runner``'s
    shutdown), and waits for that: an ``aclose()`` sent to the loop could come while the
    pump's step of the generator still runs there (read ahead), which it refuses."""
    loop = PrivateLoop()
    pieces = SyncIterator(read, loop)
    try:
        for piece in pieces:
            yield piece
    finally:
        loop.close()
        pieces.close()  # its loop closed: nothing left to do but mark it closed


def _ignore(size: int) -> None:
    pass


def _ignore_version(size: int | None, etag: str | None, modified: str | None) -> None:
    pass


def check_cache(cache_dir: str | os.PathLike[str] | None, cache_limit: int | None
                ) -> ShardCache | None:
    """The cache of a source's ``cache_dir`` and ``cache_limit`` options, or None."""
    if cache_dir is None:
        if cache_limit is not None:
            raise ValueError("cache_limit limits the cache_dir cache: give cache_dir too")
        return None
    if cache_limit is not None and (isinstance(cache_limit, bool)
                                    or not isinstance(cache_limit, int) or cache_limit <= 0):
        raise ValueError(f"cache_limit should be a positive number of bytes or None, but got "
                         f"cache_limit={cache_limit!r}")
    try:
        return ShardCache(os.fspath(cache_dir), cache_limit)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EROFS, errno.ENOTDIR, errno.EEXIST):
            raise ValueError(f"cache_dir={os.fspath(cache_dir)!r} cannot be used as a cache "
                             f"directory: {exc}") from None
        raise
