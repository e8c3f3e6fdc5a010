"""Reading local files in chunks without blocking the event loop.

Invariant: the event loop thread never waits on a disk. A chunk whose bytes are in the page
cache is read on the loop's thread with ``preadv(..., RWF_NOWAIT)`` (Linux), which copies what
is cached and refuses (``EAGAIN``) rather than wait for the disk; only then, and where the flag
does not exist or the file system does not support it, the read goes to a worker thread. A
thread hop per chunk costs more than reading and splitting the chunk (it hands the GIL back
and forth), so a file that is in the cache is read at memory speed. The open, which may wait
on the file system's metadata, always runs in a thread. Each read fetches ``chunk_size``
bytes (lines are split from the chunks later, not read one await at a time). The file is
closed when the generator ends, fails or is closed, even under cancellation.

With ``blocking=True`` the same generator awaits nothing at all: the open and every read run
on the calling thread, as a plain ``open(f)`` loop's do. That is for a caller with no event
loop (a sync ``for`` driving the stream on its own thread, see ``Stream.__iter__``), which has
no loop to keep responsive and gains nothing from a thread hop.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import threading
from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio
import anyio.lowlevel

__all__ = ("RandomAccessFile", "file_chunks")

# Bytes asked for beyond the file's size at open, for a file that grows while it is read.
_MARGIN = 1 << 16
# Bytes read from the page cache between two turns given to the loop: about a millisecond of
# reading and splitting lines, the longest the loop's other tasks wait for a turn.
_TURN_BYTES = 1 << 19
# Linux's "read only what is cached" flag for preadv (None elsewhere: every read in a thread).
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
# Errors of a preadv that refuses the flag itself (an old kernel, a file system without it).
_NO_NOWAIT = frozenset({errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})
# Each thread reads into one buffer, kept for its next read (up to _KEEP bytes): a new one per
# chunk costs more than the read itself (its allocation, zeroing and first touch), and the
# bytes copied out of it are the chunk's only copy.
_buffers = threading.local()
_KEEP = 1 << 22


def _read_cached(fd: int, size: int, position: int) -> bytes | None:
    """Up to ``size`` bytes at ``position`` if they are in the page cache (fewer if only the
    first are; ``b""`` at the end of the file), else None: read them in a thread.

    Raises:
        _NoWait: the file does not support cached-only reads.
    """
    assert _NOWAIT is not None
    buffer: bytearray | None = getattr(_buffers, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = bytearray(size)
        if size <= _KEEP:
            _buffers.buffer = buffer
    with memoryview(buffer) as view:
        try:
            count = os.preadv(fd, [view[:size]], position, _NOWAIT)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno in _NO_NOWAIT:
                raise _NoWait from None
            raise
        return view[:count].tobytes()


class _NoWait(Exception):
    """preadv refused RWF_NOWAIT for this file."""


def _open(path: str) -> int:
    return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))


async def file_chunks(
    path: str, chunk_size: int, on_size: Callable[[int], None] | None = None, start: int = 0,
    *, blocking: bool = False, opener: Callable[[str], int] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The bytes of the file at ``path``, ``chunk_size`` bytes at a time (a chunk read from
    the page cache may be shorter, when only its first bytes are cached).

    Args:
        path: a local file.
        chunk_size: bytes per read (the last chunk may be shorter).
        on_size: called with the file's size once it is open, before the first chunk.
        start: the byte to start at (a positioned read: a resumed shard is not read again).
        blocking: open and read on this thread, never awaiting (no event loop is needed).
        opener: opens ``path`` (a descriptor open for reading), where plain ``open`` will
            not do (the shard cache's: relative to its directory, no symlinks followed).
    """
    open_ = _open if opener is None else opener
    if blocking:
        fd = open_(path)
    else:
        # Shielded: a cancelled open could leave the file open in its thread, unreachable.
        with anyio.CancelScope(shield=True):
            fd = await anyio.to_thread.run_sync(open_, path)
    try:
        info = os.fstat(fd)
        size = info.st_size
        if on_size is not None:
            on_size(size)
        position = start
        # A pipe or a device (``/dev/stdin``, ``<(zcat ...)``) cannot be read at a position:
        # it is read in order, in threads (seeking to ``start`` is an error there, as ever).
        regular = stat.S_ISREG(info.st_mode)
        if start and not regular:
            os.lseek(fd, start, os.SEEK_SET)
        cached = _NOWAIT is not None and regular and not blocking
        unturned = 0  # bytes read from the cache since the loop's last turn
        while True:
            # A read allocates its whole size up front: ask for no more than the file holds
            # (plus a margin, should it grow), whatever chunk_size says.
            want = min(chunk_size, max(size - position, 0) + _MARGIN)
            data: bytes | None = None
            if cached:
                try:
                    data = _read_cached(fd, want, position)
                except _NoWait:
                    cached = False
                if data == b"" and position < size:
                    # No proof of the end: a cached-only read may answer 0 bytes instead of
                    # EAGAIN (kernels, file systems differ); the thread's read tells.
                    data = None
            if blocking:
                data = os.pread(fd, want, position) if regular else os.read(fd, want)
            elif data is None:
                data = await (anyio.to_thread.run_sync(os.pread, fd, want, position) if regular
                              else anyio.to_thread.run_sync(os.read, fd, want))
            else:
                # Read without an await: let the loop's other tasks (and a cancellation) in
                # once per _TURN_BYTES read (a turn per 64 KiB read cost a sixth of a
                # TextLines epoch pulled in the consumer's task).
                unturned += len(data)
                if unturned >= _TURN_BYTES:
                    unturned = 0
                    await anyio.lowlevel.checkpoint()
            if not data:
                return
            position += len(data)
            yield data
    finally:
        # A read-only descriptor closes without waiting on the disk.
        os.close(fd)


class RandomAccessFile(io.RawIOBase):
    """A blocking random-access file (what pyarrow reads) made of ranged reads: a subclass
    gives its :meth:`size` and :meth:`_read` (the bytes from ``start`` to ``end``); seeking,
    ``read`` and ``readinto`` are here. The Parquet source's remote files and the shard
    cache's checked copies are such files."""

    def __init__(self) -> None:
        super().__init__()
        self._pos = 0

    def size(self) -> int:
        """The file's length."""
        raise NotImplementedError

    def _read(self, start: int, end: int) -> bytes:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos}.get(whence)
        target = (self.size() if base is None else base) + pos
        if target < 0:
            raise ValueError(f"negative seek position {target}")
        self._pos = target
        return target

    def read(self, size: int | None = -1) -> bytes:
        end = self.size() if size is None or size < 0 else min(self.size(), self._pos + size)
        if end <= self._pos:
            return b""
        data = self._read(self._pos, end)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer).cast("B")))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)
