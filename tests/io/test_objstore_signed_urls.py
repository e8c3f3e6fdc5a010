"""S3 objects read through signed URLs by aloader's HTTP path (the store made from the
environment's static credentials, on asyncio with aiohttp), against moto's S3 server behind
the fault proxy: the same records, errors, retries, resumption, version pinning and cache as
obstore's own reads (which trio keeps: each test runs on both), and never a signature in an
error."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sourcetools import collect, free_port, reset_proxy

pytest.importorskip("obstore")
pytest.importorskip("moto.server")
pytest.importorskip("boto3")

from aloader import (
    AccessDeniedError,
    BucketNotFoundError,
    EndpointUnreachableError,
    FetchError,
    JsonLines,
    ObjectNotFoundError,
    TextLines,
)
from aloader._demo import make_jsonl_shards
from aloader._demo._s3 import LocalS3
from aloader.io import _objstore

pytestmark = pytest.mark.anyio

BUCKET = "signed-bucket"
SHARDS = make_jsonl_shards(4, 30)  # shard-0000i.jsonl, ids 0..119
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}
URLS = [f"s3://{BUCKET}/data/{name}" for name in sorted(SHARDS)]


@pytest.fixture(scope="module")
def s3() -> Iterator[LocalS3]:
    with LocalS3() as server:
        server.put(BUCKET, {f"data/{name}": body for name, body in SHARDS.items()})
        yield server


@pytest.fixture
def env(s3: LocalS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The environment of a store with static credentials (no other AWS_ setting), its
    stores made afresh."""
    import os

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(_objstore, "_STORES", {})
    monkeypatch.setattr(_objstore, "_SIGNED", {}, raising=False)
    yield monkeypatch


@pytest.fixture
def proxy(s3: LocalS3) -> Iterator[Any]:
    yield from reset_proxy(s3)


def object_gets(proxy: Any, key: str = "") -> list[tuple[str, str | None]]:
    """(query, Range) of the object GETs the proxy saw (of keys ending with ``key``)."""
    return [(path.partition("?")[2], rng) for method, path, rng in proxy.requests
            if method == "GET" and path.partition("?")[0].endswith(key)
            and path.partition("?")[0].count("/") >= 2]


def signed(anyio_backend: str) -> bool:
    """Whether the objects are read through signed URLs on this backend (trio: obstore)."""
    return anyio_backend == "asyncio"


def no_signature(exc: BaseException) -> None:
    assert "X-Amz-" not in str(exc) and "Signature=" not in str(exc), str(exc)


async def test_objects_are_read_through_signed_urls(env: Any, proxy: Any,
                                                    anyio_backend: str) -> None:
    source = JsonLines(f"s3://{BUCKET}/data/*.jsonl", concurrency=2, **FAST)
    assert [r["id"] for r in await collect(source)] == list(range(120))
    assert source.stats.bytes == sum(map(len, SHARDS.values()))
    gets = object_gets(proxy, ".jsonl")
    assert len(gets) == 4
    if signed(anyio_backend):
        assert all("X-Amz-Signature=" in query and "X-Amz-Credential=testing" in query
                   for query, _ in gets)
    else:
        assert [query for query, _ in gets] == [""] * 4


async def test_other_settings_keep_obstores_reads(env: Any, proxy: Any, s3: LocalS3,
                                                  anyio_backend: str) -> None:
    """A store passed in, the source's own headers, or another AWS_ setting: obstore reads."""
    cases: list[tuple[str, dict[str, Any]]] = [
        ("store", {"store": s3.store(BUCKET)}),
        ("headers", {"headers": {"X-Trace": "1"}}),
        ("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", {}),
    ]
    for case, kwargs in cases:
        if case.startswith("AWS_"):
            env.setenv(case, "false")
            env.setattr(_objstore, "_STORES", {})
            env.setattr(_objstore, "_SIGNED", {}, raising=False)
        proxy.reset()
        source = JsonLines(URLS[0], **kwargs, **FAST)
        assert [r["id"] for r in await collect(source)] == list(range(30)), case
        assert [query for query, _ in object_gets(proxy, ".jsonl")] == [""], case


async def test_missing_object_and_bucket(env: Any, proxy: Any, anyio_backend: str) -> None:
    missing = f"s3://{BUCKET}/data/nope.jsonl"
    source = JsonLines(missing, **FAST)
    with pytest.raises(ObjectNotFoundError, match=r"s3://signed-bucket/data/nope\.jsonl: no "
                       r"object 'data/nope\.jsonl' in the bucket 'signed-bucket' \(NoSuchKey"
                       ) as info:
        await collect(source)
    assert not isinstance(info.value, BucketNotFoundError)
    assert info.value.source == missing and info.value.status_code == 404
    assert source.stats.retries == 0
    no_signature(info.value)
    other = JsonLines("s3://no-such-bucket/k.jsonl", **FAST)
    with pytest.raises(BucketNotFoundError, match=r"s3://no-such-bucket/k\.jsonl: the bucket "
                       "'no-such-bucket' does not exist") as bucket_info:
        await collect(other)
    no_signature(bucket_info.value)
    assert ("X-Amz-Signature=" in object_gets(proxy, "k.jsonl")[0][0]) == signed(anyio_backend)


@pytest.mark.parametrize("code", ["InvalidAccessKeyId", "SignatureDoesNotMatch"])
async def test_refused_credentials(env: Any, proxy: Any, code: str,
                                   anyio_backend: str) -> None:
    """The store's 403 (moto's server checks no presigned URL: the proxy answers it)."""
    proxy.fail(1, 403, code)
    source = JsonLines(URLS[0], **FAST)
    with pytest.raises(AccessDeniedError, match=r"s3://signed-bucket/data/shard-00000\.jsonl: "
                       rf"access denied: .*\({code}: ") as info:
        await collect(source)
    assert isinstance(info.value, PermissionError)
    assert info.value.status_code == 403 and source.stats.retries == 0
    no_signature(info.value)


async def test_unreachable_endpoint(env: Any, anyio_backend: str) -> None:
    port = free_port()
    env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    source = JsonLines(URLS[0], retries=2, **FAST)
    with pytest.raises(EndpointUnreachableError,
                       match=rf"s3://signed-bucket/data/shard-00000\.jsonl: cannot connect to "
                       rf"http://127\.0\.0\.1:{port} after 3 attempts") as info:
        await collect(source)
    assert source.stats.retries == 2
    no_signature(info.value)


@pytest.mark.parametrize("status,code", [(503, "SlowDown"), (429, "TooManyRequests"),
                                         (500, "InternalError"), (400, "RequestTimeout")])
async def test_transient_answers_are_retried(env: Any, proxy: Any, status: int, code: str,
                                             anyio_backend: str) -> None:
    proxy.fail(2, status, code)
    source = JsonLines(URLS[:2], concurrency=1, **FAST)
    assert [r["id"] for r in await collect(source)] == list(range(60))
    # A store's throttling (503 SlowDown, 429) is waited for without using up retries.
    throttling = status in (429, 503)
    assert (source.stats.throttled, source.stats.retries) == ((2, 0) if throttling else (0, 2))
    assert all(("X-Amz-Signature=" in query) == signed(anyio_backend)
               for query, _ in object_gets(proxy, ".jsonl"))


async def test_retries_run_out(env: Any, proxy: Any, anyio_backend: str) -> None:
    proxy.fail(10, 500, "InternalError")
    source = JsonLines(URLS[0], retries=2, **FAST)
    with pytest.raises(FetchError, match=r"s3://signed-bucket/data/shard-00000\.jsonl: giving "
                       r"up after 3 failed attempts; last error: InternalError") as info:
        await collect(source)
    assert info.value.status_code == 500 and source.stats.retries == 2
    no_signature(info.value)


async def test_a_client_error_is_not_retried(env: Any, proxy: Any, anyio_backend: str) -> None:
    proxy.fail(1, 400, "InvalidRequest")
    source = JsonLines(URLS[0], **FAST)
    with pytest.raises(FetchError, match=r"shard-00000\.jsonl: InvalidRequest: .*not "
                       "retried") as info:
        await collect(source)
    assert info.value.status_code == 400 and source.stats.retries == 0


async def test_truncated_bodies_resume_where_they_stopped(env: Any, proxy: Any,
                                                          anyio_backend: str) -> None:
    body = SHARDS["shard-00001.jsonl"]
    proxy.cut(1, 1000)
    proxy.cut(1, 1500)  # of the rest
    source = JsonLines(URLS[1], chunk_size=256, **FAST)
    assert [r["id"] for r in await collect(source)] == list(range(30, 60))
    assert source.stats.retries == 2 and source.stats.bytes == len(body)
    ranges = [rng for _, rng in object_gets(proxy, "shard-00001.jsonl")]
    assert ranges[0] is None and len(ranges) == 3
    first = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    second = int(ranges[2].removeprefix("bytes=").rstrip("-"))
    assert 0 < first <= 1000 and first < second <= first + 1500


async def test_object_replaced_while_read(env: Any, proxy: Any, s3: LocalS3,
                                          anyio_backend: str) -> None:
    key = "data/replaced.txt"
    s3.put(BUCKET, {key: b"old line\n" * 200})
    proxy.cut(1, 500, then=lambda: s3.put(BUCKET, {key: b"new line\n" * 200}))
    source = TextLines(f"s3://{BUCKET}/{key}", chunk_size=128, **FAST)
    with pytest.raises(FetchError, match=r"s3://signed-bucket/data/replaced\.txt: the object "
                       "changed in the store while it was being read") as info:
        await collect(source)
    assert info.value.status_code == 412
    no_signature(info.value)


async def test_a_coded_object_is_handed_on_as_stored(env: Any, s3: LocalS3,
                                                     anyio_backend: str) -> None:
    """An object uploaded with Content-Encoding: gzip is its gzip bytes, as obstore hands it
    on: here decompressed once, by its suffix (decoded by the transfer too, it would be
    decompressed twice and fail)."""
    records = b"".join(b'{"id": %d}\n' % i for i in range(50))
    s3.client().put_object(Bucket=BUCKET, Key="coded/a.jsonl.gz", Body=gzip.compress(records),
                           ContentEncoding="gzip")
    url = f"s3://{BUCKET}/coded/a.jsonl.gz"
    signed = await collect(JsonLines(url, **FAST))
    assert [r["id"] for r in signed] == list(range(50))
    assert signed == await collect(JsonLines(url, store=s3.store(BUCKET), **FAST))


async def test_cached_epoch_after_a_signed_download(env: Any, proxy: Any, tmp_path: Path,
                                                    anyio_backend: str) -> None:
    source = JsonLines(f"s3://{BUCKET}/data/*.jsonl", cache_dir=str(tmp_path), **FAST)
    for epoch in range(2):
        assert [r["id"] for r in await collect(source)] == list(range(120)), epoch
    # The listing's version of each object is the signed GET's: the copy is found at once.
    assert (source.stats.cache_misses, source.stats.cache_hits) == (4, 4)
    assert len(object_gets(proxy, ".jsonl")) == 4


def test_which_environments_sign(monkeypatch: pytest.MonkeyPatch) -> None:
    """Static credentials and an AWS or allowed-http endpoint sign; anything obstore would
    apply to the requests itself (another setting, an https endpoint of its own) does not."""
    import os

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    assert not _objstore._may_sign("s3", False)  # no static credentials
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")  # not obstore's
    assert _objstore._may_sign("s3", False) and _objstore._may_sign("s3a", False)
    assert not _objstore._may_sign("gs", False) and not _objstore._may_sign("az", False)
    for endpoint, allow_http, signs in [
            ("https://s3.eu-west-1.amazonaws.com", False, True),
            ("http://127.0.0.1:9000", True, True),
            ("http://127.0.0.1:9000", False, False),
            ("https://minio.internal:9000", False, False),
            ("https://amazonaws.com.evil.example", False, False)]:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        assert _objstore._may_sign("s3", allow_http) == signs, endpoint
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    for setting in ("AWS_SSE_CUSTOMER_KEY_BASE64", "AWS_REQUEST_PAYER", "AWS_SKIP_SIGNATURE",
                    "AWS_PROXY_URL"):
        monkeypatch.setenv(setting, "x")
        assert not _objstore._may_sign("s3", False), setting
        monkeypatch.delenv(setting)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_worker_processes_read_through_signed_urls(env: Any, proxy: Any) -> None:
    """Worker processes make their own stores from the environment they inherit: every
    record once, each object read once, through a signed URL. (Spawned: a forkserver
    started by an earlier test would hand its workers its own, older environment.)"""
    from aloader import DataLoader

    source = JsonLines(f"s3://{BUCKET}/data/*.jsonl", even_ranks=False, **FAST)
    loader = DataLoader(source, batch_size=16, num_workers=2, multiprocessing_context="spawn")
    ids = [i for batch in loader for i in batch["id"].tolist()]
    assert sorted(ids) == list(range(120))
    gets = object_gets(proxy, ".jsonl")
    assert len(gets) == 4 and all("X-Amz-Signature=" in query for query, _ in gets)
