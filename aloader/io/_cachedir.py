"""The shard cache's directory and its files, handled safely (:mod:`aloader.io._cache` decides
what to keep; this module touches the disk).

A cache directory may be shared by several users or jobs, any of whom may put anything in it.
Invariants:

* Nothing outside the directory is ever created, written, stamped or read through it: each
  process opens the directory once (:class:`Directory`) and every name in it is opened,
  stamped, renamed or removed relative to that descriptor, with ``O_NOFOLLOW`` (a symlink in
  place of a lock, a copy or a note is refused, never followed) and ``O_EXCL`` for every new
  file (a temporary name that exists already is never written through). An entry that is not
  a regular file (a symlink, a FIFO, a directory, a device) is refused
  (:class:`NotRegular`), opened without blocking (a FIFO would block an open), and removed
  where aloader would otherwise create its own (a lock, a note: ``unlink`` removes the entry
  itself, never what a symlink names).
* No copy is read unchecked: a committed copy has beside it the CRC of each of its blocks
  (``<copy>.sum``, written before the copy is moved into place), and a reader checks every
  block before handing on its bytes (:class:`CopyReader`), so a copy is read once and a
  damaged one is noticed before any of its wrong bytes is used (:class:`Damaged`).
* A write error (a file size limit, a full disk, a refused permission) never fails a read:
  the :class:`Writer` stops, removes its temporary files, and the caller streams on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import time
from collections.abc import Iterator

from .._log import http_log
from ._checksums import BLOCK, BlockSums, StoreChecks, SumTable

__all__ = ("SUMS", "TEMP", "CopyReader", "Damaged", "Directory", "Lock", "NotRegular",
           "Writer", "held_locks", "warn_once", "write_failed")

#: What a copy's checksum file adds to its name.
SUMS = ".sum"
#: What a temporary file's name holds (followed by ``<pid>-<random>``).
TEMP = ".tmp-"
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
# Errors of an open that met an entry of the wrong kind: a symlink (O_NOFOLLOW), a directory,
# a FIFO or socket without a reader (O_NONBLOCK).
_WRONG_KIND = frozenset({errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EMLINK})
# The largest checksum file read (one of a 256 TiB copy): a bigger one is not ours.
_MAX_SUMS = 1 << 24


class NotRegular(OSError):
    """An entry of the cache directory that is not a regular file (a symlink, a FIFO, ...)."""


class Damaged(Exception):
    """A copy whose bytes are not the ones downloaded (or that cannot be checked).

    Attributes:
        offset: the byte from which nothing was handed on (the copy's bytes before it were
            checked and handed on); None: nothing was.
        why: what was wrong.
    """

    def __init__(self, offset: int | None, why: str) -> None:
        super().__init__(why)
        self.offset = offset
        self.why = why


_WARNED: set[tuple[str, ...]] = set()


def warn_once(key: tuple[str, ...], message: str, *args: object) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process, at debug
    level after that (a full disk would otherwise warn once per shard)."""
    if key in _WARNED:
        http_log.debug(message, *args)
    else:
        _WARNED.add(key)
        http_log.warning(message, *args)


def write_failed(directory: Directory, url: str, exc: OSError) -> None:
    """Say (once per kind of error) that ``url`` is not cached in ``directory``."""
    warn_once(("write", directory.path, str(exc.errno)),
              "not caching %s in %s: %s; it streams from its store (errors of this kind are "
              "logged at debug level from now on)", url, directory.path, exc)


# The cache directories this process opened, by path, with when each was last checked.
_OPENED: dict[str, tuple[Directory, float]] = {}
# How long an opened directory is trusted to be the one at its path (see Directory.of).
_RECHECK = 1.0


class Directory:
    """A cache directory, opened once per process, and its entries by name (see the module's
    invariants)."""

    __slots__ = ("fd", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    @classmethod
    def of(cls, path: str) -> Directory:
        """The directory at ``path``, opened once per process (a forked child uses its
        parent's descriptor, which names the same directory). Checked again at most once a
        second: the directory at the path may have been removed and made again (a hand's
        ``rm -rf``), and the descriptor would name the removed one. (Not closed then: a
        read in another thread may still use it; one descriptor per such change.)"""
        now = time.monotonic()
        found = _OPENED.get(path)
        if found is None:
            directory = cls(path)
        else:
            directory, checked = found
            if now - checked < _RECHECK:
                return directory
            try:
                there, opened = os.stat(path), os.fstat(directory.fd)
                if (there.st_dev, there.st_ino) != (opened.st_dev, opened.st_ino):
                    directory = cls(path)
            except FileNotFoundError:  # removed: made again, as the source did
                try:
                    os.makedirs(path, exist_ok=True)
                    directory = cls(path)
                except OSError:
                    pass  # the old one's writes fail: the shards stream, uncached
        _OPENED[path] = (directory, now)
        return directory

    def full(self, name: str) -> str:
        """``name``'s path, for messages and callers that need one."""
        return os.path.join(self.path, name)

    def open(self, name: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
        """A descriptor of the regular file ``name`` (created with ``O_CREAT`` in ``flags``).

        Raises:
            NotRegular: ``name`` is a symlink, a directory, a FIFO, ...
            OSError: any other error (FileNotFoundError, ...).
        """
        return self.open_stat(name, flags, mode)[0]

    def open_stat(self, name: str, flags: int = os.O_RDONLY, mode: int = 0o644
                  ) -> tuple[int, os.stat_result]:
        """:meth:`open`, and the file's ``fstat``."""
        try:
            fd = os.open(name, flags | _NOFOLLOW, mode, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in _WRONG_KIND:
                raise NotRegular(exc.errno, "not a regular file", self.full(name)) from None
            raise
        try:
            info = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise NotRegular(errno.EINVAL, "not a regular file", self.full(name))
        return fd, info

    def create(self, name: str) -> int:
        """A new file ``name``, open for writing (never one that exists, of any kind)."""
        return self.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)

    def temp_name(self, name: str) -> str:
        """A temporary name for a file to be moved to ``name``."""
        return f"{name}{TEMP}{os.getpid()}-{secrets.token_hex(4)}"

    def open_or_replace(self, name: str, flags: int) -> int:
        """:meth:`open` ``name`` with ``O_CREAT``; an entry of another kind there (a symlink
        another user put) is removed first, with a warning."""
        try:
            return self.open(name, flags | os.O_CREAT)
        except NotRegular:
            warn_once(("replaced", self.path), "%s: removed %s, which was not a regular file "
                      "(a symlink or a device, of another user or job?)", self.path, name)
            self.remove(name)
            return self.open(name, flags | os.O_CREAT)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def is_file(self, name: str) -> bool:
        try:
            return stat.S_ISREG(self.lstat(name).st_mode)
        except FileNotFoundError:
            return False

    def stamp(self, name: str, ns: int) -> None:
        """Set ``name``'s times (never those of what a symlink names)."""
        os.utime(name, ns=(ns, ns), dir_fd=self.fd, follow_symlinks=False)

    def rename(self, old: str, new: str) -> None:
        os.replace(old, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def remove(self, name: str) -> None:
        """Remove the entry ``name`` if it is there (a symlink itself, not its target)."""
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
            os.unlink(name, dir_fd=self.fd)

    def read(self, name: str, limit: int) -> bytes:
        """The content of the regular file ``name`` (at most ``limit`` bytes)."""
        fd = self.open(name)
        try:
            parts: list[bytes] = []
            got = 0
            while got < limit and (part := os.read(fd, limit - got)):
                parts.append(part)
                got += len(part)
            return b"".join(parts)
        finally:
            os.close(fd)

    def write_atomically(self, name: str, data: bytes) -> None:
        """``name`` replaced by a file holding ``data`` (written under a temporary name)."""
        temp = self.temp_name(name)
        fd = self.create(temp)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            self.rename(temp, name)
        except BaseException:
            self.remove(temp)
            raise

    def entries(self) -> Iterator[os.DirEntry[str]]:
        """The directory's entries (a descriptor of its own: a scan shares no position with
        another process's)."""
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            with os.scandir(fd) as scan:
                yield from scan
        finally:
            os.close(fd)

    def others_may_write(self) -> bool:
        """Whether every user may write into the directory."""
        return bool(os.fstat(self.fd).st_mode & stat.S_IWOTH)


# --------------------------------------------------------------------------------- locks

# The URL locks this process holds, by path: another reader of the URL in this process does
# not wait for one (the holder may be waiting for that very reader's consumer: two sources
# over the same shards interleaved), it reads from the store without the cache.
_HELD: dict[str, int] = {}


def held_locks() -> dict[str, int]:
    """The URL locks this process holds, by path."""
    return _HELD


def _forget_held() -> None:
    # A forked child shares its parent's locks (the same open files): close its copies, so
    # that the parent's release frees them.
    for fd in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_held)

# Waiting for a lock: the first poll after 2 ms, then doubling up to 50 ms.
_FIRST_POLL = 0.002
_LAST_POLL = 0.05
# The holder of a URL lock stamps it every _BEAT seconds at most.
_BEAT = 0.5


class Lock:
    """An exclusive ``flock`` on a file of the directory, acquired by polling (cancellable),
    released once.

    A URL lock's holder stamps the file's modification time as its download goes on
    (:meth:`beat`); a waiter that sees no stamp for ``patience`` seconds gives up waiting.
    """

    def __init__(self, fd: int, path: str | None) -> None:
        self._fd: int | None = fd
        self._path = path
        self._beat = time.monotonic()
        if path is not None:
            os.utime(fd)
            _HELD[path] = fd

    @classmethod
    async def acquire(cls, directory: Directory, name: str, patience: float | None = None
                      ) -> Lock | None:
        """The lock ``name``, or None when ``patience`` (seconds) is given and the holder went
        that long without progress, or when this process holds it (URL locks, which are the
        ones with a patience).

        Raises:
            OSError: the lock file cannot be made (the caller reads without the cache).
        """
        import anyio

        path = directory.full(name)
        url_lock = patience is not None
        if url_lock and path in _HELD:
            return None
        fd = directory.open_or_replace(name, os.O_RDWR)
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
    def free(directory: Directory, name: str) -> bool:
        """Whether nobody holds the lock ``name`` now (another descriptor of this process
        holding it counts as somebody; a lock file that is not one is nobody's)."""
        try:
            fd = directory.open(name, os.O_RDWR)
        except OSError:  # missing, or not a regular file: no lock of ours
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


# --------------------------------------------------------------------------------- writing


class Writer:
    """The temporary file of one download: written as the bytes stream, with the CRC of each
    block and the store's checksums computed on the way, committed (with its checksum file)
    if whole and as the store says.

    Raises:
        OSError: (at construction) the temporary file cannot be made: no room for it (a file
            size limit, ``EFBIG``), a refused permission, ... (nothing is left behind).
    """

    def __init__(self, directory: Directory, url: str, final: str, size: int,
                 checks: StoreChecks) -> None:
        self.directory = directory
        self.url = url
        self.final = final
        self.size = size
        self.temp = directory.temp_name(final)
        self.written = 0
        self._sums = BlockSums()
        self._checks = checks
        self.fd: int | None = directory.create(self.temp)
        try:
            # Sized up front: the reservation the other processes' accounting sees.
            os.ftruncate(self.fd, size)
        except BaseException:
            self.discard()
            raise

    def write(self, data: bytes) -> None:
        """Append ``data``; on a write error (a full disk), stop keeping the shard."""
        if self.fd is None:
            return
        try:
            # Straight to the page cache in the event loop: cheaper than a thread hop per
            # chunk, and the bytes were just received, so the loop is not waiting on disk.
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            self.failed(exc)
            return
        self.written += len(data)
        self._sums.update(data)
        if self._checks:
            self._checks.update(data)

    def failed(self, exc: OSError) -> None:
        """Stop keeping the shard after ``exc``, saying so once."""
        write_failed(self.directory, self.url, exc)
        self.discard()

    def commit(self) -> str | None:
        """Move the file into place if it holds the whole object; else delete it.

        Returns:
            None when committed; else why not, when the bytes are not the store's (its
            checksum says otherwise: worth a warning), or "" (cut short, a write error).
        """
        if self.fd is None:
            return ""
        if self.written != self.size:
            self.discard()
            return ""
        mismatch = self._checks.mismatch() if self._checks else None
        if mismatch is not None:
            self.discard()
            return mismatch
        directory = self.directory
        try:
            # The checksums first: a copy in place always has its own.
            directory.write_atomically(self.final + SUMS, self._sums.table(self.size))
            now = time.time_ns()
            os.utime(self.fd, ns=(now, now))
            info = os.fstat(self.fd)
            os.close(self.fd)
            self.fd = None
            directory.rename(self.temp, self.final)
            # This copy's checksums are known: no reader of this process reads them again.
            table = SumTable.parse(self._sums.table(self.size), self.size)
            if table is not None:
                _remember((info.st_dev, info.st_ino, self.size, self.final), table)
        except OSError as exc:
            self.failed(exc)
            return ""
        return None

    def discard(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.directory.remove(self.temp)


# --------------------------------------------------------------------------------- reading


# The checksums of the copies read lately, by the copy's (device, inode, size, name): an LRU
# of at most _KEEP_SUMS bytes of checksums (4 bytes per 64 KiB of copy: those of 256 GiB of
# copies), in _TABLES' order of use.
_TABLES: dict[tuple[int, int, int, str], SumTable] = {}
_KEEP_SUMS = 16 << 20
_kept_sums = 0


def _remember(key: tuple[int, int, int, str], table: SumTable) -> None:
    global _kept_sums
    _TABLES[key] = table
    _kept_sums += table.nbytes
    while _kept_sums > _KEEP_SUMS and len(_TABLES) > 1:
        _kept_sums -= _TABLES.pop(next(iter(_TABLES))).nbytes


class CopyReader:
    """A committed copy of ``size`` bytes, opened with its checksum file (in one call: in a
    thread for an async read), stamped as just used (for the eviction's order) and checked a
    block at a time as it is read.

    Args:
        directory: the cache directory.
        url: the shard's URL (for messages).
        name: the copy's name.
        size: its length.
        start: the first byte wanted.

    Attributes:
        read_from: the byte the reads start at (``start``'s block's first).
    """

    def __init__(self, directory: Directory, url: str, name: str, size: int,
                 start: int) -> None:
        self.directory = directory
        self.url = url
        self.name = name
        self.size = size
        self.start = start
        self.read_from = start - start % BLOCK
        self._table: SumTable | None = None
        self._position = self.read_from
        self._pending = b""
        self._skip = start - self.read_from

    def open(self, name: str) -> int:
        """The copy's descriptor, its checksums read (``file_chunks``'s opener).

        Raises:
            FileNotFoundError: the copy is gone (evicted).
            Damaged: it is not a regular file, or its checksums are missing or not its own.
        """
        directory = self.directory
        try:
            fd, info = directory.open_stat(name)
        except NotRegular:
            raise Damaged(None, "not a regular file") from None
        try:
            if info.st_size != self.size:
                raise Damaged(None, f"{info.st_size} bytes, not {self.size}")
            now = time.time_ns()
            try:
                os.utime(fd, ns=(now, now))
            except OSError as exc:  # a directory gone read-only: eviction sees an older use
                write_failed(directory, self.url, exc)
            # A copy is never changed in place (a new one is a new file, moved there), so its
            # checksums are those read for the same file before: read once per process (not
            # read again for a copy changed in place, whose change they then find; its
            # modification time is no key: each use stamps it).
            key = (info.st_dev, info.st_ino, info.st_size, name)
            table = _TABLES.pop(key, None)
            if table is None:
                table = self._read_table(name + SUMS)
                _remember(key, table)
            else:
                _TABLES[key] = table  # the most recently used
            self._table = table
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _read_table(self, name: str) -> SumTable:
        try:
            data = self.directory.read(name, _MAX_SUMS)
        except FileNotFoundError:
            raise Damaged(None, "no checksums beside it") from None
        except NotRegular:
            raise Damaged(None, "its checksum file is not a regular file") from None
        table = SumTable.parse(data, self.size)
        if table is None or table.block != BLOCK:
            raise Damaged(None, "its checksum file is damaged, or of another copy")
        return table

    def checked(self, chunk: bytes) -> bytes:
        """The bytes of the copy's next ``chunk`` (as read) that can be handed on: whole
        blocks, each checked (the end of a block kept for the next chunk), less the bytes
        before ``start``.

        Raises:
            Damaged: a block is not what was downloaded.
        """
        table = self._table
        assert table is not None  # opened
        data = self._pending + chunk if self._pending else chunk
        position = self._position
        length = len(data)
        end = position + length
        if end > self.size:
            raise Damaged(max(self.start, position), "longer than its version")
        usable = length if end == self.size else length - length % BLOCK
        whole = usable == length
        for at in range(0, usable, BLOCK):
            block = data if whole and usable <= BLOCK else data[at : at + BLOCK]
            if not table.check((position + at) // BLOCK, block):
                raise Damaged(max(self.start, position + at),
                              f"block {(position + at) // BLOCK} (bytes {position + at} to "
                              f"{min(position + at + BLOCK, self.size)}) does not match its "
                              "checksum")
        self._position = position + usable
        self._pending = b"" if whole else data[usable:]
        out = data if whole else data[:usable]
        if self._skip:
            cut = min(self._skip, len(out))
            self._skip -= cut
            out = out[cut:]
        return out

    def end(self) -> None:
        """The copy's last bytes were read: check that they were all of them.

        Raises:
            Damaged: the copy got shorter while it was read.
        """
        if self._position != self.size:
            raise Damaged(max(self.start, self._position), "shorter than its version")
