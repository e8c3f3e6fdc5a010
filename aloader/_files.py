"""Reading local files in chunks without blocking the event loop.

On asyncio the reads go through aiofiles; where trio runs, through anyio's file API. Each read
fetches ``chunk_size`` bytes in one thread call (lines are split from the chunks later, not read
one await at a time). The file is closed when the generator ends, fails or is closed, even
under cancellation.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncGenerator
from typing import Any

import anyio

from ._backend import current_backend

__all__ = ("file_chunks",)

# aiofiles ships no type information; it is used through this Any-typed module object.
_aiofiles: Any = importlib.import_module("aiofiles")


async def _open(path: str) -> tuple[Any, bool]:
    """(file, is_anyio): an async binary file for the running event loop."""
    if current_backend() == "trio":
        return await anyio.open_file(path, "rb"), True
    return await _aiofiles.open(path, "rb"), False


async def file_chunks(path: str, chunk_size: int) -> AsyncGenerator[bytes, None]:
    """The bytes of the file at ``path``, ``chunk_size`` bytes at a time.

    Args:
        path: a local file.
        chunk_size: bytes per read (the last chunk may be shorter).
    """
    # Shielded: a cancelled open could leave the file open in its thread, unreachable.
    with anyio.CancelScope(shield=True):
        handle, is_anyio = await _open(path)
    try:
        while True:
            data: bytes = await handle.read(chunk_size)
            if not data:
                return
            yield data
    finally:
        with anyio.CancelScope(shield=True):
            if is_anyio:
                await handle.aclose()
            else:
                await handle.close()
