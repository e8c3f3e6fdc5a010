"""The HTTP streaming demo runs end to end on small sizes and checks itself."""

from __future__ import annotations

import argparse
import io

import pytest
from faulty_server import FaultyServer, make_jsonl_shards

from aloader._demo import streaming_main as main


def test_demo_small() -> None:
    out = io.StringIO()
    status = main(["--shards", "6", "--records", "40", "--latency", "0.001", "--epochs", "2",
                   "--buffer", "32", "--batch-size", "16", "--concurrency", "3"], out=out)
    text = out.getvalue()
    assert status == 0, text
    assert text.count("every record exactly once") == 2
    assert "items/s" in text and "240/240" in text
    assert "6 JSON Lines shards" in text


def test_server_ranges_and_faults() -> None:
    import urllib.error
    import urllib.request

    files = make_jsonl_shards(1, 3)
    name, body = next(iter(files.items()))
    with FaultyServer(files) as server:
        request = urllib.request.Request(server.url(name), headers={"Range": "bytes=5-"})
        with urllib.request.urlopen(request) as response:
            assert response.status == 206 and response.read() == body[5:]
        server.fail(name, 503)
        try:
            urllib.request.urlopen(server.url(name))
        except urllib.error.HTTPError as exc:
            assert exc.code == 503
        else:
            raise AssertionError("expected a 503")
        with urllib.request.urlopen(server.url(name)) as response:
            assert response.read() == body
        assert [n for n, _ in server.requests] == [name] * 3


def test_s3_demo_small() -> None:
    pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    from aloader._demo import _s3stream

    out = io.StringIO()
    args = argparse.Namespace(shards=5, records=30, latency=0.001, concurrency=3, buffer=16,
                              batch_size=16, epochs=1, seed=0)
    status = _s3stream.main(out, args)
    text = out.getvalue()
    assert status == 0, text
    assert "skipped" not in text
    assert '"s3://demo/*.jsonl"' in text and "5 JSON Lines shards" in text
    assert text.count("every record exactly once") == 1
    assert "150/150" in text
    table = text[text.index("DataLoader.stats()"):]
    assert "fetch" in table and "150 items, 10 batches, 0 failed" in table
    assert "bottleneck: " in table
