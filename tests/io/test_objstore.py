"""Object store sources (s3://) against moto's S3 server on 127.0.0.1, behind a fault proxy:
listing, exact counts, exactly-once over ranks and worker processes, errors, retries and
resumption, on asyncio and trio."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sourcetools import collect, free_port, read_as_consumers, reset_proxy

pytest.importorskip("obstore")
pytest.importorskip("moto.server")
pytest.importorskip("boto3")

import aloader
from aloader import (
    AccessDeniedError,
    BucketNotFoundError,
    DataLoader,
    EndpointUnreachableError,
    FetchError,
    JsonLines,
    NpyRows,
    ObjectNotFoundError,
    TextLines,
)
from aloader._demo import make_jsonl_shards
from aloader._demo._s3 import LocalS3
from aloader.io import _objstore

pytestmark = pytest.mark.anyio

BUCKET = "data-bucket"
SHARDS = make_jsonl_shards(5, 40)  # shard-0000i.jsonl, ids 0..199
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}
# Nested and hidden keys and other suffixes, to check listing against the local glob.
EXTRA = {
    "data/notes.txt": b"a\nb\n",
    "data/.hidden.jsonl": b'{"id": -1}\n',
    "data/sub/deep.jsonl": b'{"id": -2}\n',
    "data/sub/more/deeper.jsonl": b'{"id": -3}\n',
    "other/x.jsonl": b'{"id": -4}\n',
}


@pytest.fixture(scope="module")
def s3() -> Iterator[LocalS3]:
    with LocalS3() as server:
        server.put(BUCKET, {f"data/{name}": body for name, body in SHARDS.items()} | EXTRA)
        yield server


@pytest.fixture
def proxy(s3: LocalS3) -> Iterator[Any]:
    yield from reset_proxy(s3)


def url(key: str, bucket: str = BUCKET) -> str:
    return f"s3://{bucket}/{key}"


SHARD_URLS = [url(f"data/{name}") for name in sorted(SHARDS)]


# --------------------------------------------------------------------------- reading


async def test_single_object_matches_local_reading(s3: LocalS3, tmp_path: Path,
                                                   anyio_backend: str) -> None:
    name = "shard-00002.jsonl"
    (tmp_path / name).write_bytes(SHARDS[name])
    source = JsonLines(url(f"data/{name}"), store=s3.store(BUCKET), chunk_size=300)
    records = await collect(source)
    assert records == await collect(JsonLines(str(tmp_path / name), chunk_size=300))
    assert [r["id"] for r in records] == list(range(80, 120))
    assert (source.stats.records, source.stats.shards, source.stats.bytes,
            source.stats.retries) == (40, 1, len(SHARDS[name]), 0)
    lines = await collect(TextLines(url(f"data/{name}"), store=s3.store(BUCKET)))
    assert lines == SHARDS[name].decode().splitlines()


async def test_prefix_and_patterns_list_like_the_local_glob(s3: LocalS3, tmp_path: Path,
                                                            anyio_backend: str) -> None:
    local = tmp_path / "data"
    for key, body in {f"data/{n}": b for n, b in SHARDS.items()}.items() | EXTRA.items():
        path = tmp_path / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    store = s3.store(BUCKET)
    for tail in ("", "*.jsonl", "shard-0000[1-3].jsonl", "shard-?????.jsonl", "**/*.jsonl",
                 "*/*.jsonl", ".*", "sub/**"):
        remote = TextLines(url("data/" + tail), store=store).shards
        here = TextLines(str(local) + ("/" + tail if tail else "")).shards
        assert [u.removeprefix(f"s3://{BUCKET}/") for u in remote] == [
            os.path.relpath(p, tmp_path) for p in here], tail
    everything = TextLines(url("data/"), store=store)
    assert everything.shards == sorted([*SHARD_URLS, url("data/notes.txt")])
    records = await collect(JsonLines(url("data/*.jsonl"), store=store, concurrency=3))
    assert [r["id"] for r in records] == list(range(200))


async def test_environment_credentials(s3: LocalS3, monkeypatch: pytest.MonkeyPatch,
                                       anyio_backend: str) -> None:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(_objstore, "_STORES", {})
    source = JsonLines(url("data/*.jsonl"), concurrency=2, **FAST)
    assert [r["id"] for r in await collect(source)] == list(range(200))
    assert source.stats.records == 200 and source.stats.bytes == sum(map(len, SHARDS.values()))


async def test_a_changed_environment_gets_a_new_store(
        s3: LocalS3, monkeypatch: pytest.MonkeyPatch, anyio_backend: str) -> None:
    """A store made from the environment is kept per bucket, but not past a change of the
    environment it was made from: a source built after the endpoint (or the credentials)
    changed reads the new one, as workers started after the change do, never the old one."""
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(_objstore, "_STORES", {})
    assert len(await collect(JsonLines(SHARD_URLS[0], **FAST))) == 40
    port = free_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(EndpointUnreachableError, match=rf"127\.0\.0\.1:{port}"):
        await collect(JsonLines(SHARD_URLS[0], retries=0, **FAST))


async def test_npy_rows_from_s3(s3: LocalS3, anyio_backend: str) -> None:
    import io

    array = np.arange(600, dtype=np.int32).reshape(200, 3)
    buffer = io.BytesIO()
    np.save(buffer, array)
    s3.put(BUCKET, {"arrays/a.npy": buffer.getvalue()})
    rows = await collect(NpyRows(url("arrays/a.npy"), store=s3.store(BUCKET), chunk_size=64))
    assert np.array_equal(np.stack(rows), array)


async def test_ranks_and_workers_read_each_record_once(s3: LocalS3,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       anyio_backend: str) -> None:
    """Ranks from the environment, workers simulated: 3 ranks x 2 workers, 5 shards."""
    store = s3.store(BUCKET)
    monkeypatch.setenv("WORLD_SIZE", "3")
    for epoch in range(2):

        def make(rank: int, epoch: int = epoch) -> JsonLines:
            monkeypatch.setenv("RANK", str(rank))
            source = JsonLines(url("data/*.jsonl"), store=store, shuffle_shards=True,
                               seed=5, even_ranks=False)
            assert source.rank == rank and source.world_size == 3
            source.set_epoch(epoch)
            return source

        seen = [r["id"] for r in await read_as_consumers(make, 3, 2)]
        assert sorted(seen) == list(range(200))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_two_worker_processes_exactly_once(s3: LocalS3) -> None:
    """Real worker processes (after this process has used obstore for the listing), two
    ranks given explicitly: every record once, and the workers' counts reach the loader."""
    store = s3.store(BUCKET)
    ids: list[int] = []
    records = 0
    for rank in range(2):
        source = JsonLines(url("data/*.jsonl"), store=store, rank=rank, world_size=2,
                           even_ranks=False, **FAST)
        assert _objstore.runtime_started()  # the listing ran here
        loader = DataLoader(source, batch_size=16, num_workers=2)
        ids.extend(i for batch in loader for i in batch["id"].tolist())
        records += source.stats.records
    assert sorted(ids) == list(range(200))
    assert records == 200


def test_a_fork_after_obstore_fails_clearly(s3: LocalS3) -> None:
    """A process forked after obstore started gets an error, not a hang."""
    TextLines(url("data/"), store=s3.store(BUCKET))
    assert _objstore.runtime_started()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _objstore._obstore("s3://x/y")
            message = b"no error"
        except FetchError as exc:
            message = str(exc).encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    assert "forked from one that had already used obstore" in message


# --------------------------------------------------------------------------- errors


async def test_missing_object(s3: LocalS3, proxy: Any, anyio_backend: str) -> None:
    missing = url("data/nope.jsonl")
    source = JsonLines(missing, store=s3.store(BUCKET), **FAST)
    with pytest.raises(ObjectNotFoundError, match=r"s3://data-bucket/data/nope\.jsonl.*"
                       r"no object 'data/nope\.jsonl'") as info:
        await collect(source)
    assert not isinstance(info.value, BucketNotFoundError)
    assert isinstance(info.value, FileNotFoundError) and info.value.source == missing
    assert info.value.status_code == 404 and source.stats.retries == 0
    with pytest.raises(ValueError, match="no objects match the pattern"):
        JsonLines(url("data/*.parquet"), store=s3.store(BUCKET))
    with pytest.raises(ValueError, match="no objects match the prefix"):
        JsonLines(url("empty/"), store=s3.store(BUCKET))


async def test_missing_bucket(s3: LocalS3, anyio_backend: str) -> None:
    with pytest.raises(BucketNotFoundError, match=r"s3://no-such-bucket/data/.*the bucket "
                       "'no-such-bucket' does not exist"):
        JsonLines(url("data/", "no-such-bucket"), store=s3.store("no-such-bucket"))
    source = JsonLines(url("k.jsonl", "no-such-bucket"), store=s3.store("no-such-bucket"))
    with pytest.raises(BucketNotFoundError, match=r"s3://no-such-bucket/k\.jsonl"):
        await collect(source)


async def test_bad_credentials(s3: LocalS3, monkeypatch: pytest.MonkeyPatch,
                               anyio_backend: str) -> None:
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # check keys now
    bad = s3.store(BUCKET, access_key_id="nobody", secret_access_key="wrong")
    with pytest.raises(AccessDeniedError, match=r"s3://data-bucket/data/.*access denied.*"
                       "InvalidAccessKeyId"):
        JsonLines(url("data/"), store=bad)
    source = JsonLines(SHARD_URLS[0], store=bad, **FAST)
    with pytest.raises(AccessDeniedError, match="s3://data-bucket/data/shard-00000") as info:
        await collect(source)
    assert isinstance(info.value, PermissionError) and info.value.status_code == 403
    assert source.stats.retries == 0


async def test_unreachable_endpoint(s3: LocalS3, anyio_backend: str) -> None:
    port = free_port()
    store = s3.store(BUCKET, endpoint=f"http://127.0.0.1:{port}")
    source = JsonLines(SHARD_URLS[0], store=store, retries=2, **FAST)
    with pytest.raises(EndpointUnreachableError,
                       match=rf"s3://data-bucket/data/shard-00000\.jsonl: cannot connect to "
                       rf"http://127\.0\.0\.1:{port} after 3 attempts"):
        await collect(source)
    assert source.stats.retries == 2
    with pytest.raises(EndpointUnreachableError,
                       match=rf"s3://data-bucket/data/: cannot connect to "
                       rf"http://127\.0\.0\.1:{port} after 2 attempts"):  # a listing's too
        JsonLines(url("data/"), store=store, retries=1, **FAST)


async def test_a_prefix_without_its_slash_is_suggested(s3: LocalS3, anyio_backend: str
                                                        ) -> None:
    """``s3://bucket/data`` names no object, but objects exist under ``data/``: the error
    says so; a key with nothing under it gets no suggestion."""
    source = JsonLines(url("data"), store=s3.store(BUCKET), **FAST)
    with pytest.raises(ObjectNotFoundError) as info:
        await collect(source)
    assert str(info.value).endswith(f"; objects exist under {url('data')}/: for the objects "
                                    "under that prefix, end the URL with '/'")
    assert info.value.source == url("data") and info.value.status_code == 404
    with pytest.raises(ObjectNotFoundError) as info:
        await collect(JsonLines(url("nothing-here"), store=s3.store(BUCKET), **FAST))
    assert "objects exist under" not in str(info.value)


def test_store_must_fit_the_urls(s3: LocalS3) -> None:
    with pytest.raises(ValueError, match="names the bucket 'other-bucket'"):
        JsonLines(url("x.jsonl", "other-bucket"), store=s3.store(BUCKET))
    from obstore.store import GCSStore

    with pytest.raises(ValueError, match="not for the store given"):
        JsonLines(url("x.jsonl"), store=GCSStore(BUCKET))


def test_is_object_url() -> None:
    for name in ("s3://b/k", "S3://b/k", "gs://b/k", "az://c/k", "abfss://c/k"):
        assert _objstore.is_object_url(name)
    for name in ("http://b/k", "data/s3://x", "/tmp/x", "file:///x"):
        assert not _objstore.is_object_url(name)
    assert aloader.ObjectNotFoundError.__mro__.index(aloader.FetchError) > 0


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize("status,code", [(503, "SlowDown"), (429, "TooManyRequests"),
                                         (500, "InternalError")])
async def test_transient_answers_are_retried(s3: LocalS3, proxy: Any, status: int, code: str,
                                             anyio_backend: str) -> None:
    proxy.fail(2, status, code)
    source = JsonLines(SHARD_URLS[:2], store=s3.store(BUCKET), concurrency=1, **FAST)
    assert [r["id"] for r in await collect(source)] == list(range(80))
    assert source.stats.retries == 2


async def test_retries_run_out(s3: LocalS3, proxy: Any, anyio_backend: str) -> None:
    proxy.fail(10)
    source = JsonLines(SHARD_URLS[0], store=s3.store(BUCKET), retries=2, **FAST)
    with pytest.raises(FetchError, match=r"shard-00000\.jsonl: giving up after 3 failed "
                       r"attempts; last error: SlowDown") as info:
        await collect(source)
    assert info.value.status_code == 503 and source.stats.retries == 2


async def test_truncated_bodies_resume_where_they_stopped(s3: LocalS3, proxy: Any,
                                                          anyio_backend: str) -> None:
    body = SHARDS["shard-00001.jsonl"]
    proxy.cut(1, 1000)
    proxy.cut(1, 1500)  # of the rest
    source = JsonLines(SHARD_URLS[1], store=s3.store(BUCKET), chunk_size=256, **FAST)
    records = await collect(source)
    assert [r["id"] for r in records] == list(range(40, 80))  # none lost, none twice
    assert source.stats.retries == 2 and source.stats.bytes == len(body)
    gets = [rng for method, path, rng in proxy.requests
            if method == "GET" and path.endswith("shard-00001.jsonl")]
    assert gets[0] is None and len(gets) == 3
    first = int(gets[1].removeprefix("bytes=").rstrip("-"))
    second = int(gets[2].removeprefix("bytes=").rstrip("-"))
    # Each resumption starts at the last byte handed on: not before (nothing read twice),
    # and at most one piece behind what the cut delivered.
    assert 0 < first <= 1000 and first < second <= first + 1500


async def test_every_response_cut_early_still_makes_progress(s3: LocalS3, proxy: Any,
                                                            anyio_backend: str) -> None:
    """Every GET cut after 16 KiB, the default chunk size (64 KiB) and 3 retries: the bytes
    received before each cut count as progress, and the next GET resumes after them."""
    key = "cuts/every-time.jsonl"  # not under data/, which other tests list
    body = b"".join(json.dumps({"id": i, "pad": "x" * 50}).encode() + b"\n"
                    for i in range(3000))
    s3.put(BUCKET, {key: body})
    proxy.cut(1000, 16 << 10, path=key)
    source = JsonLines(url(key), store=s3.store(BUCKET), backoff=0.01, max_backoff=0.02,
                       retries=3)
    records = await collect(source)
    assert [r["id"] for r in records] == list(range(3000))  # none lost, none twice
    assert source.stats.bytes == len(body)
    gets = [rng for method, path, rng in proxy.requests
            if method == "GET" and path.endswith(key)]
    starts = [0 if rng is None else int(rng.removeprefix("bytes=").rstrip("-"))
              for rng in gets]
    assert starts == sorted(starts) and len(gets) < 2 * len(body) / (16 << 10) + 2


async def test_object_replaced_while_read(s3: LocalS3, proxy: Any, anyio_backend: str) -> None:
    key = "data/replaced.txt"
    s3.put(BUCKET, {key: b"old line\n" * 200})
    proxy.cut(1, 500, then=lambda: s3.put(BUCKET, {key: b"new line\n" * 200}))
    source = TextLines(url(key), store=s3.store(BUCKET), chunk_size=128, **FAST)
    with pytest.raises(FetchError, match="replaced.txt: the object changed in the store"):
        await collect(source)


async def test_many_shards_with_faults_exact(s3: LocalS3, proxy: Any,
                                             anyio_backend: str) -> None:
    proxy.fail(3)
    proxy.cut(2, 700)
    proxy.fail(1, 429, "SlowDown")
    source = JsonLines(url("data/*.jsonl"), store=s3.store(BUCKET), concurrency=4,
                       chunk_size=512, **FAST)
    records = await collect(source)
    assert [r["id"] for r in records] == list(range(200))
    assert [json.loads(json.dumps(r))["shard"] for r in records[::40]] == [0, 1, 2, 3, 4]
    assert source.stats.retries == 6


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_workers_of_a_threadless_process_after_a_listing(s3: LocalS3, tmp_path: Path) -> None:
    """A plain script (no thread of its own) lists s3, then starts worker processes: the
    workers must not be forks of a process whose obstore runtime has started (they would
    hang at their first request)."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(
        "import aloader, threading\n"
        f"source = aloader.JsonLines({url('data/*.jsonl')!r}, backoff=0.01, timeout=10)\n"
        "assert threading.active_count() == 1\n"
        "loader = aloader.DataLoader(source, batch_size=16, num_workers=2)\n"
        "ids = sorted(i for batch in loader for i in batch['id'].tolist())\n"
        "assert ids == list(range(200)), ids\n"
        "print('ok', source.stats.records)\n"
    )
    env = {**os.environ, **s3.env(), "PYTHONPATH": str(Path(aloader.__file__).parent.parent)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", "200"]
