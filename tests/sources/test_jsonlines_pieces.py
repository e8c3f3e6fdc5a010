"""JSON Lines decoded in pieces: what the cheaper decode must keep.

``JsonLinesDecoder.piece`` (16 KiB) cuts each chunk into smaller blocks and ``JsonLines`` keeps
one decoded block waiting for the consumer, so that its records (objects the cyclic GC tracks)
are collated and freed before a collection walks them. The records held decoded ahead of the
consumer are then a few pieces' worth, whatever the chunk size, and every way of reading
keeps its records, their order, their errors' locations and an exact resume inside a chunk.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faulty_server import FaultyServer
from sourcetools import decoded_ahead, interrupted, roundtrip

from aloader import DataLoader, JsonLines, RecordError
from aloader.sources._formats import JsonLinesDecoder

pytestmark = pytest.mark.anyio

# The piece size the decoder asks for (16 KiB when it was written).
PIECE = getattr(JsonLinesDecoder, "piece", None) or 1 << 14


def shards(count: int, records: int) -> dict[str, bytes]:
    """``count`` JSON Lines shards of ``records`` records of about 60 bytes."""
    files = {}
    for s in range(count):
        lines = [json.dumps({"id": s * records + i, "x": [i * 0.5, 1.0], "t": f"r{i}"})
                 for i in range(records)]
        files[f"shard-{s}.jsonl"] = ("\n".join(lines) + "\n").encode()
    return files


def per_piece(files: dict[str, bytes]) -> int:
    """The most records one piece can hold."""
    shortest = min(len(line) + 1 for body in files.values() for line in body.split(b"\n")
                   if line)
    return PIECE // shortest + 1


def test_the_piece_is_smaller_than_a_chunk() -> None:
    assert JsonLinesDecoder.piece is not None and 0 < JsonLinesDecoder.piece < 1 << 16


async def test_records_decoded_ahead_are_a_few_pieces(serve: Callable[..., FaultyServer],
                                                      anyio_backend: str) -> None:
    """Two shards of ~190 KB read ahead with the default 64 KiB chunks: once the consumer
    took one record, the stream holds decoded the consumer's block, the one waiting for it
    and the one its background task holds (three pieces), not three or four 64 KiB chunks'
    records (over 3,000)."""
    files = shards(2, 3000)
    server = serve(files)
    source = JsonLines(server.urls, concurrency=2)
    decoded, ids = await decoded_ahead(source, server, 2)
    assert decoded <= 3 * per_piece(files)
    assert ids == list(range(6000))
    assert source.stats.records == 6000 and source.stats.shards == 2


async def test_resume_inside_a_chunk_asks_for_the_piece(serve: Callable[..., FaultyServer],
                                                        anyio_backend: str) -> None:
    """A state taken inside the third piece of a shard's first chunk resumes exactly, and the
    resumed request asks for the bytes from that piece's first record on."""
    files = shards(2, 3000)
    server = serve(files)

    def make() -> JsonLines:
        return JsonLines(server.urls, concurrency=2)

    full = [r async for r in make()]
    assert [r["id"] for r in full] == list(range(6000))
    k = 2 * per_piece(files) + 10  # past two pieces: inside the third one, if not later
    rest, state = await interrupted(make, k)
    assert rest == full[k:]
    position = state["position"]
    assert position["shard"] == 0 and 0 < position["offset"] < 1 << 16
    body = files["shard-0.jsonl"]
    assert body[position["offset"] - 1 : position["offset"]] == b"\n"
    assert position["counter"] == body[: position["offset"]].count(b"\n")
    assert position["counter"] + position["skip"] == k
    assert f"bytes={position['offset']}-" in [r for _, r in server.requests]
    for k in (1, per_piece(files), 3000, 3001, 5999):
        rest, _ = await interrupted(make, k)
        assert rest == full[k:], k


async def test_local_files_resume_at_every_piece_boundary(tmp_path: Path,
                                                          anyio_backend: str) -> None:
    files = shards(1, 2500)
    path = tmp_path / "shard-0.jsonl"
    path.write_bytes(files["shard-0.jsonl"])

    def make() -> JsonLines:
        return JsonLines(str(path))

    full = [r async for r in make()]
    n = per_piece(files)
    for k in (n - 1, n, n + 1, 4 * n, 2499):
        rest, _ = await interrupted(make, k)
        assert rest == full[k:], k


async def test_a_bad_line_past_the_first_piece_keeps_its_location(tmp_path: Path,
                                                                  anyio_backend: str) -> None:
    """The records before a malformed line in a later piece are delivered, then its error
    names the line and its byte offset; skipped, the rest of the chunk follows."""
    lines = [json.dumps({"id": i, "pad": "x" * 40}) for i in range(1500)]
    lines[900] = '{"id": 900, "pad": '
    body = ("\n".join(lines) + "\n").encode()
    assert body.index(lines[900].encode()) > 2 * PIECE
    path = tmp_path / "bad.jsonl"
    path.write_bytes(body)
    got: list[Any] = []
    with pytest.raises(RecordError) as caught:
        async for record in JsonLines(str(path)):
            got.append(record)
    assert [r["id"] for r in got] == list(range(900))
    offset = body.index(lines[900].encode())
    assert caught.value.line == 901 and caught.value.offset == offset
    assert f"line 901 (byte offset {offset})" in str(caught.value)
    source = JsonLines(str(path), skip_errors=True)
    ids = [r["id"] async for r in source]
    assert ids == [i for i in range(1500) if i != 900]
    assert source.stats.skipped == 1


async def test_loader_resumes_batches_over_pieces(serve: Callable[..., FaultyServer],
                                                  anyio_backend: str) -> None:
    """The loader's own state, taken after batches that end inside pieces, resumes the rest
    of the epoch exactly (batches of 100 records cut pieces of ~270)."""
    files = shards(3, 1000)
    server = serve(files)

    def make() -> DataLoader[Any]:
        return DataLoader(JsonLines(server.urls, concurrency=3), batch_size=100,
                          collate_fn=list)

    whole = [batch async for batch in make()]
    assert [r["id"] for batch in whole for r in batch] == list(range(3000))
    for k in (1, 3, 17):
        loader = make()
        seen = 0
        async for _ in loader:
            seen += 1
            if seen == k:
                break
        state = roundtrip(loader.state_dict())
        fresh = make()
        fresh.load_state_dict(state)
        assert [batch async for batch in fresh] == whole[k:], k
