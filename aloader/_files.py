"""Reading local files in chunks without blocking the event loop.

On asyncio the reads go through aiofiles; where trio runs, through anyio's file API. Each read
fetches ``chunk_size`` bytes in one thread call (lines are split from the chunks later, not read
one await at a time). The file is closed when the generator ends, fails or is closed, even
under cancellation.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio

from ._backend import current_backend

__all__ = ("file_chunks",)

# aiofiles ships no type information; it is used through this Any-typed module object.
_aiofiles: Any = importlib.import_module("aiofiles")
# Bytes asked for beyond the file's size at open, for a file that grows while it is read.
_MARGIN = 1 << 16


async def _open(path: str) -> tuple[Any, bool]:
    """(file, is_anyio): an async binary file for the running event loop."""
    if current_backend() == "trio":
        return await anyio.open_file(path, "rb"), True
    return await _aiofiles.open(path, "rb"), False


async def file_chunks(
    path: str, chunk_size: int, on_size: Callable[[int], None] | None = None, start: int = 0
) -> AsyncGenerator[bytes, None]:
    """The bytes of the file at ``path``, ``chunk_size`` bytes at a time.

    Args:
        path: a local file.
        chunk_size: bytes per read (the last chunk may be shorter).
        on_size: called with the file's size once it is open, before the first chunk.
        start: the byte to start at (a seek: a resumed shard is not read again).
    """
    # Shielded: a cancelled open could leave the file open in its thread, unreachable.
    with anyio.CancelScope(shield=True):
        handle, is_anyio = await _open(path)
    try:
        size = os.fstat((handle.wrapped if is_anyio else handle).fileno()).st_size
        if on_size is not None:
            on_size(size)
        left = size - start
        if start:
            await handle.seek(start)
        while True:
            # A read allocates its whole size up front: ask for no more than the file holds
            # (plus a margin, should it grow), whatever chunk_size says.
            data: bytes = await handle.read(min(chunk_size, max(left, 0) + _MARGIN))
            if not data:
                return
            left -= len(data)
            yield data
    finally:
        with anyio.CancelScope(shield=True):
            if is_anyio:
                await handle.aclose()
            else:
                await handle.close()
