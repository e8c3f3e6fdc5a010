"""Attacks on aloader.io._objstore with a hostile S3 server (the demo's, in its bucket mode): an
object replaced between an attempt cut short and its resumption, the store not keeping to
``If-Match`` (the demo checks it before the replacement lands: the race of a store whose
check and read are not one). The resumed bytes would come from another version: an error,
never records of two versions spliced."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from faulty_server import FaultyServer
from sourcetools import collect

pytest.importorskip("obstore")

from test_s3_server import store

from aloader import FetchError, JsonLines

pytestmark = [pytest.mark.hostile, pytest.mark.anyio]

FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}


def version(count: int, tag: str) -> bytes:
    return b"".join(json.dumps({"id": i, "v": tag}).encode() + b"\n" for i in range(count))


@pytest.mark.parametrize("longer", [True, False])
async def test_an_object_replaced_during_a_resumption_is_an_error(
        serve: Callable[..., FaultyServer], anyio_backend: str, longer: bool) -> None:
    old = version(200, "old")
    new = version(300 if longer else 150, "new")
    server = serve({"x.jsonl": old}, bucket=f"replaced-{anyio_backend}-{longer}")
    server.cut("x.jsonl", 3000)
    server.replace("x.jsonl", new)
    url = f"s3://{server.bucket}/x.jsonl"
    got: list[Any] = []
    with pytest.raises(FetchError, match=r"x\.jsonl: the object changed in the store while "
                                         r"it was being read") as info:
        async for record in JsonLines(url, store=store(server), chunk_size=256, **FAST):
            got.append(record)
    assert info.value.source == url
    assert {record["v"] for record in got} == {"old"}


async def test_an_object_replaced_by_one_of_the_same_length_is_an_error(
        serve: Callable[..., FaultyServer], anyio_backend: str) -> None:
    old = version(200, "old")
    new = version(200, "NEW")
    assert len(new) == len(old)
    server = serve({"y.jsonl": old}, bucket=f"same-{anyio_backend}")
    server.cut("y.jsonl", 3000)
    server.replace("y.jsonl", new)
    with pytest.raises(FetchError, match=r"the object changed .*ETag"):
        await collect(JsonLines(f"s3://{server.bucket}/y.jsonl", store=store(server),
                                chunk_size=256, **FAST))
