"""JsonLines' blocks when a chunk fits in one decode piece, spans several, or is empty."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aloader import JsonLines


def _write(path: Path, count: int) -> list[dict[str, object]]:
    records = [{"id": i, "text": "x" * (i % 50)} for i in range(count)]
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records))
    return records


@pytest.mark.parametrize("chunk_size", [7, 1 << 10, 1 << 14, (1 << 14) + 1, 1 << 16])
def test_records_the_same_whatever_the_chunks(tmp_path: Path, chunk_size: int) -> None:
    # Chunks below, at and above the decoder's 16 KiB piece: every record once, in order.
    records = _write(tmp_path / "a.jsonl", 2_000)
    assert list(JsonLines(str(tmp_path / "a.jsonl"), chunk_size=chunk_size)) == records


def test_resume_mid_shard_with_large_chunks(tmp_path: Path) -> None:
    records = _write(tmp_path / "a.jsonl", 2_000)
    source = JsonLines(str(tmp_path / "a.jsonl"), chunk_size=1 << 16)
    stream = iter(source)
    head = [next(stream) for _ in range(777)]
    state = source.state_dict()
    resumed = JsonLines(str(tmp_path / "a.jsonl"), chunk_size=1 << 16)
    resumed.load_state_dict(state)
    assert head + list(resumed) == records
