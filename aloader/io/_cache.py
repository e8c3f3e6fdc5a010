"""A local disk cache of remote shards (``cache_dir=``, ``cache_limit=`` of the sources).

A remote shard (``http(s)://``, ``s3://``, ``gs://``, ``az://``) read with a cache is kept on
local disk, so a later epoch reads it at local-file speed; the least recently used shards are
evicted to keep the cache's total size under ``cache_limit`` bytes. Several processes of one
machine (ranks, loader workers, other jobs, other users) may share one directory. Its files
are handled by :mod:`aloader.io._cachedir`: relative to the directory's descriptor, never
through a symlink, new files with ``O_EXCL``; a directory that every user may write into is
worth one warning (they cannot make aloader write elsewhere, but may change what it reads:
the checksums find an accident, not a forger).

Invariants:

* A file under its final name is a complete copy of one version of one object: it is written
  under a temporary name in the same directory and moved into place (``os.replace``) only
  when the download ended without error, its length is the object's size and its bytes match
  the checksums the store gave (GCS's crc32c, S3's ``x-amz-checksum-*`` or single-part ETag:
  see :mod:`aloader.io._checksums`). A truncated or failed download, or one whose reader
  stopped early, is deleted, never committed; a crashed downloader's temporary file is never
  read (readers only open final names) and is removed by the next process that downloads that
  URL or makes room in the cache.
* No copy is served unchecked: the CRC of every 64 KiB block of a copy is recorded as it is
  downloaded (``<copy>.sum``, in place before the copy) and each block is checked before its
  bytes are handed on (one read of the copy, no bytes used before their check). A copy of the
  wrong length, without its checksums, not a regular file, or with a block that does not
  match (a disk's or a hand's change, a crash before the bytes reached the disk) is dropped,
  counted in ``stats.cache_corrupt`` and logged once; the read goes on from the store at the
  byte where the copy failed (nothing handed on twice, nothing skipped), and the object is
  downloaded again (at once when the first block failed, else by the next read).
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
* A write error (a file size limit, a full disk, a lock or note that cannot be made) stops
  keeping that shard, never reading it: its temporary files are removed, it streams from the
  store, and one warning says why. A directory that cannot be written at all is an error when
  the source is made.

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
is not cached yet (it is read from the store from that offset, as without a cache).

Files in the directory: ``<url hash>-<version hash>.shard`` (committed copies) and
``....shard.sum`` (their checksums), ``....tmp-<pid>-<random>`` (downloads in progress),
``<url hash>.json`` (the version last found for the URL and when), ``<url hash>.lock`` and
``.lru.lock`` (locks, left in place).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import stat
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._exceptions import FetchError
from .._facade import PrivateLoop, SyncIterator
from .._util import Closing
from ._cachedir import (
    SUMS,
    TEMP,
    CopyReader,
    Damaged,
    Directory,
    Lock,
    Writer,
    warn_once,
    write_failed,
)
from ._checksums import BLOCK, StoreChecks
from ._files import RandomAccessFile, file_chunks
from ._resumable import FirstAnswer, split_chunks

if TYPE_CHECKING:
    from .._stats import SourceStats

__all__ = ("CopyFile", "ShardCache", "Version", "make_version")

# (size in bytes, the ETag or ``lm:<Last-Modified>`` or None): what identifies an object's
# version. Only comparable values: a listing's Last-Modified is finer than a GET's.
Version = tuple[int, str | None]
# (on_size, on_version, start) -> the object's bytes from ``start``.
OnVersion = Callable[[int | None, str | None, str | None], None]
Fetch = Callable[[Callable[[int], None], OnVersion, int], AsyncGenerator[bytes, None]]

_SUFFIX = ".shard"
_LRU_LOCK = ".lru.lock"
# A waiter gives up waiting for a download that shows no progress for this many seconds (a
# holder stalled by its own consumer, which may wait for the waiter: ranks in a collective),
# and reads from the store itself.
_PATIENCE = 10.0
# The longest note read (a note is ~200 bytes: a longer file is not one).
_NOTE_LIMIT = 1 << 16


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
def _copy_name(url: str, version: Version) -> str:
    # Remembered: a cached epoch looks its copies up twice per shard (ShardedSource._loopless,
    # then the read), two hashes and a JSON encoding each time otherwise.
    return f"{_hash(url, 32)}-{_hash(json.dumps(version), 16)}{_SUFFIX}"


class _Gone(Exception):
    """The cached file was evicted between its lookup and its opening: look it up again."""


@dataclass(frozen=True)
class ShardCache:
    """A cache directory and its size limit (see the module's description); it pickles.

    Attributes:
        directory: the cache directory (created if missing).
        limit: the most bytes kept, or None for no limit.

    Raises:
        OSError: the directory cannot be made, or written into (``EACCES``).
    """

    directory: str
    limit: int | None = None

    def __post_init__(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        if not os.access(self.directory, os.W_OK | os.X_OK):  # a permission, a read-only disk
            raise PermissionError(errno.EACCES, "cannot create files in it", self.directory)
        if self._dir().others_may_write():
            warn_once(("others", self.directory),
                      "cache_dir %s is writable by every user: they cannot make aloader write "
                      "outside it (it follows no symlink there), but they can change what it "
                      "reads (the checksums catch accidents, not forgeries); give each user "
                      "or group a directory of its own", self.directory)

    def _dir(self) -> Directory:
        return Directory.of(self.directory)

    # Names -----------------------------------------------------------------------------
    def _base(self, url: str) -> str:
        """The name every file of ``url`` starts with (in the directory)."""
        return _hash(url, 32)

    def path(self, url: str, version: Version) -> str:
        """Where the copy of ``url`` at ``version`` is kept."""
        return os.path.join(self.directory, _copy_name(url, version))

    def kept(self, url: str, version: Version) -> str | None:
        """The committed copy's path, stamped as just used, or None if there is none.

        A copy whose length is not its version's (cut by a crash of the machine before its
        bytes reached the disk, or by a hand), or that is not a regular file, is never
        served: it is removed, and the object downloaded again. Its bytes are checked as it
        is read (:meth:`chunks`, :class:`CopyFile`). A stamp refused (a directory gone
        read-only) is a write error: said once, the copy served all the same.
        """
        directory = self._dir()
        name = _copy_name(url, version)
        try:
            info = directory.lstat(name)
            if not stat.S_ISREG(info.st_mode) or info.st_size != version[0]:
                _drop(directory, name)  # a new download commits another file in its place
                return None
            directory.stamp(name, time.time_ns())
        except FileNotFoundError:
            return None
        except OSError as exc:  # the stamp refused: eviction sees an older last use
            write_failed(directory, url, exc)
        return directory.full(name)

    def holds(self, url: str, version: Version | None) -> bool:
        """Whether a copy of ``url`` at ``version`` is committed now. Not stamped as used: a
        look ahead of the reads (which stamp it), that another process's eviction may still
        overtake."""
        return version is not None and self._dir().is_file(_copy_name(url, version))

    def _note(self, url: str, version: Version) -> None:
        """Record ``version`` as the one of ``url`` just committed or found committed (the
        store named it), for the processes waiting for the URL's lock."""
        note = json.dumps({"url": url, "version": list(version), "at": time.time()})
        directory = self._dir()
        try:
            directory.write_atomically(f"{self._base(url)}.json", note.encode())
        except OSError as exc:  # a full disk: the waiters ask the store themselves
            write_failed(directory, url, exc)

    def _recent(self, url: str, since: float) -> Version | None:
        """The version another process committed or found committed for ``url`` at or after
        ``since`` (when this one started waiting for the URL's lock), if any."""
        try:
            note = json.loads(self._dir().read(f"{self._base(url)}.json", _NOTE_LIMIT))
        except (OSError, ValueError):  # none, not a file, or cut (a crash) or zeroed
            return None
        # A note of another shape (another release's, a hand's) is no note.
        match note:
            case {"url": str(noted), "version": [int(size), str() | None as tag],
                  "at": int() | float() as at} if noted == url and at >= since:
                return size, tag
        return None

    # Room --------------------------------------------------------------------------------
    async def _writer(self, url: str, version: Version, stats: SourceStats,
                      checks: StoreChecks) -> Writer | None:
        """A temporary file for ``url`` at ``version``, after evicting what must go to keep
        the total under the limit; None if the shard cannot fit, or the directory cannot
        take it (a write error: said once)."""
        directory = self._dir()
        try:
            return await self._make_room(directory, url, version, stats, checks)
        except OSError as exc:
            write_failed(directory, url, exc)
            return None

    async def _make_room(self, directory: Directory, url: str, version: Version,
                         stats: SourceStats, checks: StoreChecks) -> Writer | None:
        size = version[0]
        final = _copy_name(url, version)
        # This process holds the URL's lock: any temporary file of the URL is a leftover.
        prefix = self._base(url) + "-"
        for entry in directory.entries():
            if entry.name.startswith(prefix) and TEMP in entry.name:
                directory.remove(entry.name)
        if self.limit is None:
            return Writer(directory, url, final, size, checks)
        if size > self.limit:
            return None
        lock = await Lock.acquire(directory, _LRU_LOCK)
        assert lock is not None  # no patience: waits for as long as it takes
        try:
            # (last use, size with its checksums, name) of committed copies
            kept: dict[str, list[int]] = {}
            sums: dict[str, int] = {}  # checksum files by their copy's name
            total = 0
            for entry in directory.entries():
                name = entry.name
                try:
                    if not entry.is_file(follow_symlinks=False) or name.startswith("."):
                        continue
                    if name.endswith(_SUFFIX):
                        info = entry.stat(follow_symlinks=False)
                        kept[name] = [info.st_mtime_ns, info.st_size]
                        total += info.st_size
                    elif name.endswith(_SUFFIX + SUMS):
                        sums[name.removesuffix(SUMS)] = entry.stat(follow_symlinks=False).st_size
                    elif TEMP in name:
                        owner = name.partition("-")[0].partition(".")[0]
                        if Lock.free(directory, owner + ".lock"):
                            directory.remove(name)  # a crashed downloader's leftover
                        else:
                            total += entry.stat(follow_symlinks=False).st_size  # reserved
                except FileNotFoundError:
                    continue  # evicted or committed meanwhile by another process
            for copy, length in sums.items():
                if copy in kept:
                    kept[copy][1] += length
                    total += length
                elif Lock.free(directory, copy.partition("-")[0] + ".lock"):
                    directory.remove(copy + SUMS)  # a copy's dropped or evicted: orphaned
                else:
                    total += length  # a download's, about to commit its copy
            order = sorted((used, length, name) for name, (used, length) in kept.items())
            while total + size > self.limit and order:
                _, old_size, old = order.pop(0)
                try:
                    os.unlink(old, dir_fd=directory.fd)
                    stats.cache_evicted += 1
                except FileNotFoundError:
                    pass
                directory.remove(old + SUMS)
                total -= old_size
            if total + size > self.limit:
                return None  # the downloads in progress take the room
            return Writer(directory, url, final, size, checks)
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
        :func:`~aloader.io._files.file_chunks`, each block's check and the counting of its
        bytes): a cached epoch costs what an epoch over local files does, plus a stamp of
        each copy's last use (on its descriptor) and the CRC of its bytes (its checksums are
        read once per process). Only without one does the read go through the locks and the
        store.

        With ``blocking`` the reader awaits nothing (a chain with no event loop, a sync
        ``for``'s: see ``_streams._LocalPairs``): the copy is read on this thread, and a read
        that needs the store after all (no copy, or one evicted or damaged) runs on an event
        loop of its own (:func:`_on_own_loop`), so ``fetch`` must need no client of the
        caller's loop.

        Args:
            url: the shard's URL (its name in the cache).
            fetch: ``fetch(on_size, on_version, start)`` reads the object from the store.
            versions: the versions this source pinned, by URL (updated here).
            stats: counts hits, misses, cached bytes read, evictions and damaged copies.
            chunk_size: bytes per read of a cached file (in whole 64 KiB blocks at least).
            on_size: called with the shard's size before its first chunk.
            start: the byte to start at.
            blocking: read with no event loop (see above).

        Raises:
            FetchError: the store's errors, as ``fetch`` raises them.
            OSError: the cache directory cannot be used (with a note naming the URL and the
                directory).
        """

        def read(begin: int) -> AsyncGenerator[bytes, None]:
            inner = functools.partial(self._chunks, url, fetch, versions, stats, chunk_size,
                                      on_size, begin)
            return _on_own_loop(inner) if blocking else inner()

        version = versions.get(url)
        if version is None:
            return read(start)
        # The copy itself, looked up by opening it (no stat first): one that is not there
        # (never kept, evicted) is read(start) instead, one damaged read(offset).
        return self._copy(url, version, stats, chunk_size, on_size, start, blocking, read)

    async def _copy(
        self, url: str, version: Version, stats: SourceStats, chunk_size: int,
        on_size: Callable[[int], None] | None, start: int, blocking: bool = False,
        instead: Callable[[int], AsyncGenerator[bytes, None]] | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """A copy's bytes from ``start``, each block checked before it is handed on (with
        ``blocking``, opened and read on this thread).

        With ``instead`` (a read outside :meth:`_chunks`, which notes the errors), a copy
        evicted before it was opened, or damaged, is followed by ``instead(offset)``'s bytes
        from where it stopped, and the errors of the copy are noted as :meth:`_chunks` notes
        them.

        Raises:
            _Gone: (without ``instead``) it vanished before it was opened (evicted).
            Damaged: (without ``instead``) it is damaged (dropped, counted and logged once):
                nothing from ``offset`` on was handed on.
        """
        directory = self._dir()
        name = _copy_name(url, version)
        reader = CopyReader(directory, url, name, version[0], start)
        opened = False

        def sized(size: int) -> None:
            nonlocal opened
            opened = True
            stats.cache_hits += 1
            if on_size is not None:
                on_size(size)

        # Whole blocks at a time (the source's chunk_size rounded up): each checked at once.
        reads = -(-chunk_size // BLOCK) * BLOCK
        try:
            async with Closing(file_chunks(name, reads, sized, reader.read_from,
                                           blocking=blocking, opener=reader.open)) as chunks:
                async for chunk in chunks:
                    for piece in split_chunks(reader.checked(chunk), chunk_size):
                        stats.cache_bytes += len(piece)
                        yield piece
            reader.end()
            return
        except FileNotFoundError as exc:
            if opened or instead is None:
                if instead is not None:
                    self._noted(exc, url)
                    raise
                if opened:
                    raise
                raise _Gone from None
            begin = start
        except Damaged as exc:
            _drop(directory, name)
            stats.cache_corrupt += 1
            warn_once(("damaged", directory.full(name)),
                      "the cached copy of %s (%s) is damaged: %s; it was dropped and the shard "
                      "is read from its store%s", url, directory.full(name), exc.why,
                      "" if not exc.offset else f" from byte {exc.offset}")
            if instead is None:
                raise
            begin = start if exc.offset is None else exc.offset
        except OSError as exc:
            if instead is not None:
                self._noted(exc, url)
            raise
        async with Closing(instead(begin)) as pieces:
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
                except Damaged as exc:  # dropped: the rest from the store
                    start = start if exc.offset is None else exc.offset
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
        if version is not None and self.kept(url, version) is not None:
            async with Closing(self._copy(url, version, stats, chunk_size, on_size,
                                          start)) as pieces:
                async for piece in pieces:
                    yield piece
            return
        asked = time.time()
        directory = self._dir()
        try:
            lock = await Lock.acquire(directory, f"{self._base(url)}.lock", _PATIENCE)
        except OSError as exc:  # the lock cannot be made (a full disk, ...): no caching
            write_failed(directory, url, exc)
            lock = None
        if lock is None:
            # Another reader's download does not progress (or is this process's own), or
            # the lock cannot be made: do not wait on it, read the store.
            async with Closing(_uncached(fetch, stats, on_size, start)) as pieces:
                async for piece in pieces:
                    yield piece
            return
        writer: Writer | None = None
        try:
            found = self._recent(url, asked)
            if found is not None:
                versions[url] = version = found
            if version is not None and self.kept(url, version) is not None:
                lock.release()
                async with Closing(self._copy(url, version, stats, chunk_size, on_size,
                                              start)) as pieces:
                    async for piece in pieces:
                        yield piece
                return
            sizes: list[int] = []
            answer = FirstAnswer()
            cached: Version | None = None
            async with Closing(fetch(sizes.append, answer, start)) as pieces:
                first = await anext(pieces, None)
                new = make_version(answer.size, answer.etag, answer.modified) \
                    if answer.answered else None
                if new is not None:
                    versions[url] = new
                    if self.kept(url, new) is not None:
                        cached = new
                        self._note(url, new)
                if cached is None:
                    if on_size is not None and sizes:
                        on_size(sizes[0])
                    stats.cache_misses += 1
                    if new is not None and start == 0:
                        writer = await self._writer(url, new, stats,
                                                    StoreChecks(answer.digests))
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
                    if writer is not None:
                        refused = writer.commit()
                        if refused is None:
                            assert new is not None  # a writer is made for a version only
                            self._note(url, new)
                        elif refused:  # its bytes are not the store's: never kept
                            stats.cache_corrupt += 1
                            warn_once(("mismatch", url),
                                      "not caching %s: the bytes received do not match the "
                                      "store's checksum (%s)", url, refused)
                    writer = None
            if cached is not None:
                # The store's answer named a version already cached: read the copy instead.
                lock.release()
                async with Closing(self._copy(url, cached, stats, chunk_size, on_size,
                                              start)) as local:
                    async for piece in local:
                        yield piece
        finally:
            if writer is not None:
                writer.discard()
            lock.release()

    # Random access -----------------------------------------------------------------------
    def open_copy(self, url: str, version: Version, stats: SourceStats,
                  fallback: Callable[[], Any]) -> CopyFile | None:
        """The committed copy of ``url`` at ``version`` as a blocking random-access file
        whose reads are checked (see :class:`CopyFile`), or None if there is none."""
        try:
            return CopyFile(self._dir(), url, _copy_name(url, version), version[0], stats,
                            fallback)
        except FileNotFoundError:  # not kept, or evicted since
            return None


class CopyFile(RandomAccessFile):
    """A committed copy as a blocking random-access file (for pyarrow): each read covers whole
    64 KiB blocks, each checked before any of its bytes is returned. A damaged copy is
    dropped (counted, logged once) and this read and every later one go to ``fallback()``,
    the remote file itself (a random-access file too).

    Raises:
        FileNotFoundError: (opening) the copy is gone.
    """

    def __init__(self, directory: Directory, url: str, name: str, size: int,
                 stats: SourceStats, fallback: Callable[[], Any]) -> None:
        super().__init__()
        self._directory = directory
        self._url = url
        self._name = name
        self._size = size
        self._stats = stats
        self._fallback = fallback
        self._remote: Any = None
        reader = CopyReader(directory, url, name, size, 0)
        self._fd: int | None = None
        try:
            self._fd = reader.open(name)
            self._table = reader._table
        except Damaged as exc:
            self._damaged(exc)

    def _damaged(self, exc: Damaged) -> None:
        _drop(self._directory, self._name)
        self._stats.cache_corrupt += 1
        warn_once(("damaged", self._directory.full(self._name)),
                  "the cached copy of %s (%s) is damaged: %s; it was dropped and the file is "
                  "read from its store", self._url, self._directory.full(self._name), exc.why)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._remote = self._fallback()

    def size(self) -> int:
        return self._size

    def _read(self, start: int, end: int) -> bytes:
        if self._remote is None:
            assert self._fd is not None and self._table is not None
            first = start - start % BLOCK
            data = os.pread(self._fd, min(self._size, -(-end // BLOCK) * BLOCK) - first,
                            first)
            try:
                for at in range(0, len(data), BLOCK):
                    index = (first + at) // BLOCK
                    if not self._table.check(index, data[at : at + BLOCK]):
                        raise Damaged(None, f"block {index} does not match its checksum")
                if first + len(data) < end:
                    raise Damaged(None, "shorter than its version")
            except Damaged as exc:
                self._damaged(exc)
            else:
                return data[start - first : end - first]
        self._remote.seek(start)
        return bytes(self._remote.read(end - start))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._remote is not None:
            self._remote.close()
        super().close()


def _drop(directory: Directory, name: str) -> None:
    """Remove a copy and its checksums (if they are there)."""
    directory.remove(name)
    directory.remove(name + SUMS)


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
        if exc.errno in (errno.EACCES, errno.EROFS, errno.ENOTDIR, errno.EEXIST,
                         errno.EPERM):
            raise ValueError(f"cache_dir={os.fspath(cache_dir)!r} cannot be used as a cache "
                             f"directory: {exc}") from None
        raise
