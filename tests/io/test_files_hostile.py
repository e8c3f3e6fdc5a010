"""Attacks on aloader.io._files' reads of local shards: a read from the page cache
(``preadv(RWF_NOWAIT)``) that answers 0 bytes before the file's end (some kernels and file
systems answer so for bytes not cached, instead of EAGAIN) must not be taken for the end of
the file: a short read is never a shorter shard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sourcetools import collect

from aloader import TextLines
from aloader.io import _files

pytestmark = [pytest.mark.hostile, pytest.mark.anyio]


@pytest.mark.skipif(_files._NOWAIT is None, reason="no RWF_NOWAIT here")
async def test_a_cached_read_of_nothing_before_the_end_is_not_the_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: str) -> None:
    path = tmp_path / "lines.txt"
    lines = [f"line {i}" for i in range(5000)]
    path.write_text("".join(f"{line}\n" for line in lines))
    real = _files._read_cached
    answered: list[int] = []

    def nothing_past_the_first_chunk(fd: int, size: int, position: int) -> Any:
        if position:  # as a kernel may answer for pages not cached
            answered.append(position)
            return b""
        return real(fd, size, position)

    monkeypatch.setattr(_files, "_read_cached", nothing_past_the_first_chunk)
    assert await collect(TextLines(str(path), chunk_size=4096)) == lines
    assert answered  # the cached reads did answer nothing
