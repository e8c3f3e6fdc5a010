"""Streaming JSON Lines shards from S3 against plain HTTP and PyTorch, all against one server.

Run: ``python benchmarks/bench_objstore.py`` (needs ``obstore``; ``moto[server]`` and ``boto3``
for the moto and PyTorch rows; torch for the PyTorch row). Everything below is measured in the
same run.

64 shards of 1,000 JSON Lines records (~106 bytes each), the same bodies as
``bench_sources.py``. Servers, each in a process of its own, each waiting 20 ms before every
answer:

* HTTP: ``aloader._demo.ShardServer`` (threaded ``http.server``).
* S3: the same ``ShardServer`` in its S3 mode (``bucket=``: path-style GET/HEAD with ranges,
  ListObjectsV2, no signature check; tested in ``tests/io/test_s3_server.py``). The S3 and HTTP rows
  run the same server code with the same latency, so their ratio measures the client paths
  (obstore's and aloader's S3 path against aiohttp and aloader's HTTP path).
* S3, moto: moto's S3 server behind aloader's fault proxy (``aloader._demo._s3.LocalS3``, the
  tests' server), which waits 20 ms before forwarding each request: a realistic S3
  implementation, but one whose Python request handling (moto, then the proxy) is several
  times slower than ``ShardServer``'s, so its row measures moto as much as aloader.

One epoch, batches of 256, best of 5 (``BENCH_RUNS``), the rows interleaved (PyTorch's after them):
Each row also gives the CPU time of this process per epoch (best of the rounds): the client's
work, which the wall clock of a loaded machine shows less faithfully.

* aloader http: ``DataLoader(JsonLines(http_urls, concurrency=16), batch_size=256)``.
* aloader s3: ``DataLoader(JsonLines(s3_urls, concurrency=16), batch_size=256)`` against the
  S3 ``ShardServer``, credentials and endpoint from the environment: on asyncio the objects
  are read through signed URLs by aloader's HTTP path (aiohttp), on trio by obstore's blocking
  API in threads (see :mod:`aloader.io._objstore` for which path reads when).
* aloader s3, obstore's reads: the same with an ``S3Store`` passed as ``store=``, which
  obstore reads itself (its async API's body stream on asyncio).
* aloader s3, moto: the same on asyncio against moto (its store passed with ``store=``).
* bare http / bare s3 / bare s3 moto (the honest limits of those rows): the 64 objects read
  with aiohttp (HTTP) or obstore's async API (``get_async``, then the body's chunks), 16
  requests in flight, one event loop, no parsing: what each server can serve, whatever reads
  it. An aloader row near its bare row is bound by the server, not by aloader.
* PyTorch: ``torch.utils.data.DataLoader`` over an ``IterableDataset`` whose 8 workers each
  read their share of the objects from the S3 ``ShardServer`` with a blocking boto3 client
  (``get_object`` and ``iter_lines``) and ``json.loads`` every line (workers started by each
  epoch, as by default).

Targets: aloader s3 >= 0.8x aloader http, and >= 5x PyTorch with 8 workers. The
last lines put each aloader row against its bare limit, and each bare S3 limit against the bare
HTTP one, and give the s3/http ratio of every round (the two epochs run back to back) with
their median: a figure that a burst of load in one round moves less than the best-of rates.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import anyio
from common import (
    BATCH,
    CONCURRENCY,
    LATENCY,
    RECORDS,
    SHARDS,
    TOTAL,
    best,
    count_torch,
    run_aloader,
    serve_shards,
)

from aloader import DataLoader, JsonLines
from aloader._demo import ShardServer, make_jsonl_shards
from aloader.io._objstore import ObjectAccess

BUCKET = "bench"
# Rounds of the interleaved rows (each figure the best of them): more than common.RUNS, since
# an epoch here is a few hundred ms, whose wall clock varies by 20% on a loaded machine.
RUNS = int(os.environ.get("BENCH_RUNS", "5"))
# The credentials both S3 servers are given (neither checks them).
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_ALLOW_HTTP": "true"}


def _serve_s3(queue: Any, stop: Any) -> None:
    """Server process: the workload's shards as the S3 bucket BUCKET of a ShardServer."""
    server = ShardServer(make_jsonl_shards(SHARDS, RECORDS), latency=LATENCY,
                         bucket=BUCKET).start()
    queue.put(server.endpoint)
    stop.wait()
    server.close()


def _serve_moto(queue: Any, stop: Any) -> None:
    """Server process: the workload's shards in moto's S3 server, behind the fault proxy."""
    from aloader._demo._s3 import LocalS3

    with LocalS3(latency=LATENCY) as server:
        server.put(BUCKET, make_jsonl_shards(SHARDS, RECORDS))
        queue.put(server.endpoint)
        stop.wait()


def moto_store(endpoint: str) -> Any:
    """An obstore store for BUCKET at ``endpoint`` (moto's proxy, or the S3 ShardServer),
    configured as aloader's own stores are."""
    from obstore.store import S3Store

    return S3Store(BUCKET, endpoint=endpoint, access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                   secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                   region=S3_ENV["AWS_REGION"],
                   client_options={"allow_http": True, "timeout": timedelta(days=365)},
                   retry_config={"max_retries": 0})


def run_aloader_store(urls: list[str], store: Any) -> int:
    """:func:`common.run_aloader` on asyncio with the source's ``store=``."""

    async def epoch() -> int:
        count = 0
        async for batch in DataLoader(JsonLines(urls, concurrency=CONCURRENCY, store=store),
                                      batch_size=BATCH):
            count += len(batch["id"])
        return count

    return anyio.run(epoch)


def run_bare_s3(urls: list[str], store: Any = None) -> int:
    """The 64 objects read with obstore's async API only, CONCURRENCY at once; bytes read."""
    import asyncio

    import obstore

    if store is None:
        # aloader's own store for the bucket (made once per process, as aloader's S3 rows
        # use it): the same connection pool, so the bare program pays no connection setup
        # either.
        store, _ = ObjectAccess()._store(urls[0], obstore)
    keys = [url.split("/", 3)[3] for url in urls]

    async def main() -> int:
        slots = asyncio.Semaphore(CONCURRENCY)

        async def one(key: str) -> int:
            async with slots:
                result = await obstore.get_async(store, key)
                return sum([len(chunk) async for chunk in result.stream(min_chunk_size=1 << 16)])

        return sum(await asyncio.gather(*(one(key) for key in keys)))

    return asyncio.run(main())


def run_bare_http(urls: list[str]) -> int:
    """The 64 shards read with aiohttp only, CONCURRENCY at once; bytes read."""
    import asyncio

    import aiohttp

    async def main() -> int:
        slots = asyncio.Semaphore(CONCURRENCY)
        connector = aiohttp.TCPConnector(limit=CONCURRENCY)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one(url: str) -> int:
                async with slots, session.get(url) as response:
                    return len(await response.read())

            return sum(await asyncio.gather(*(one(url) for url in urls)))

    return asyncio.run(main())


def run_torch_boto3(keys: list[str], env: dict[str, str], workers: int) -> int:
    import torch.utils.data as tud

    class S3JsonLines(tud.IterableDataset):  # type: ignore[type-arg,misc]
        def __iter__(self) -> Any:
            import boto3

            client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"],
                                  aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                                  aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                                  region_name=env["AWS_REGION"])
            info = tud.get_worker_info()
            mine = keys if info is None else keys[info.id :: info.num_workers]
            for key in mine:
                body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
                for line in body.iter_lines():
                    yield json.loads(line)

    return count_torch(tud.DataLoader(S3JsonLines(), batch_size=BATCH, num_workers=workers))


def main() -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    stop = context.Event()
    processes = []
    endpoints = []
    servers = [_serve_s3, serve_shards]
    if all(importlib.util.find_spec(name) for name in ("boto3", "moto", "flask")):
        servers.append(_serve_moto)  # moto's server mode needs flask (moto[server])
    else:
        print("moto[server] or boto3 is not installed: the moto rows are skipped",
              file=sys.stderr)
    for target in servers:  # one at a time: each puts its address on the queue
        process = context.Process(target=target, args=(queue, stop), daemon=True)
        process.start()
        processes.append(process)
        endpoints.append(queue.get(timeout=120))
    s3_endpoint, port = endpoints[0], endpoints[1]
    env = {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    os.environ.update(env)
    names = sorted(make_jsonl_shards(SHARDS, RECORDS))
    http_urls = [f"http://127.0.0.1:{port}/{name}" for name in names]
    s3_urls = JsonLines(f"s3://{BUCKET}/*.jsonl").shards  # listed through obstore
    assert [url.rsplit("/", 1)[1] for url in s3_urls] == names
    size = sum(map(len, make_jsonl_shards(SHARDS, RECORDS).values()))
    http_label = f"aloader http JsonLines(concurrency={CONCURRENCY})"
    s3_label = f"aloader s3 JsonLines(concurrency={CONCURRENCY}), asyncio"
    own_store = moto_store(s3_endpoint)
    # (label, epoch, what it returns per epoch): aloader counts records, the bare programs bytes.
    contestants: list[tuple[str, Callable[[], int], int]] = [
        (http_label, lambda: run_aloader(http_urls), TOTAL),
        (s3_label, lambda: run_aloader(s3_urls), TOTAL),
        (f"aloader s3 JsonLines(concurrency={CONCURRENCY}), trio",
         lambda: run_aloader(s3_urls, "trio"), TOTAL),
        ("aloader s3 JsonLines(store=S3Store), asyncio (obstore reads)",
         lambda: run_aloader_store(s3_urls, own_store), TOTAL),
        ("bare http", lambda: run_bare_http(http_urls), size),
        ("bare s3", lambda: run_bare_s3(s3_urls), size),
    ]
    if len(endpoints) > 2:
        store = moto_store(endpoints[2])
        contestants[4:4] = [(f"aloader s3 JsonLines(concurrency={CONCURRENCY}), moto server",
                             lambda: run_aloader_store(s3_urls, store), TOTAL)]
        contestants.append(("bare s3 moto", lambda: run_bare_s3(s3_urls, store), size))
    rows: list[tuple[str, float]] = []
    bare: dict[str, float] = {}
    times: dict[str, float] = {}
    cpu: dict[str, float] = {}  # this process's CPU seconds per epoch (all its threads)
    rounds: list[dict[str, float]] = []  # each round's seconds per row
    try:
        for label, fn, expected in contestants:
            assert fn() == expected, label  # warm-up: imports, connections, thread pools
        for _ in range(RUNS):  # interleaved: a change of load hits every row alike
            rounds.append({})
            for label, fn, expected in contestants:
                start_cpu = time.process_time()
                seconds, got = best(fn, 1)
                used = time.process_time() - start_cpu
                assert got == expected, (label, got, expected)
                times[label] = min(times.get(label, seconds), seconds)
                rounds[-1][label] = seconds
                cpu[label] = min(cpu.get(label, used), used)
        for label, _, _ in contestants:
            if label.startswith("bare "):
                # the records those bytes hold, per second
                bare[label.removeprefix("bare ")] = TOTAL / times[label]
            else:
                rows.append((label, TOTAL / times[label]))
        try:
            import boto3  # noqa: F401
            import torch  # noqa: F401 - only to know whether the anchor can run
        except ImportError:
            print("torch or boto3 is not installed: the PyTorch row is skipped",
                  file=sys.stderr)
        else:
            seconds, items = best(lambda: run_torch_boto3(names, env, 8))
            assert items == TOTAL
            rows.append(("PyTorch DataLoader, boto3, num_workers=8", items / seconds))
    finally:
        stop.set()
        for process in processes:
            process.join(timeout=10)

    rates = dict(rows)
    http = rates[http_label]
    torch_rate = rates.get("PyTorch DataLoader, boto3, num_workers=8")
    print(f"{SHARDS} shards x {RECORDS:,} JSON Lines records, {LATENCY * 1e3:.0f} ms per "
          f"request, batch {BATCH}, best of {RUNS}; S3 rows against ShardServer's S3 mode "
          "unless marked moto")
    print(f"{'':60} {'items/s':>11} {'vs http':>8} {'vs torch-8':>10} {'CPU ms':>7}")
    for label, rate in rows:
        vs_torch = f"{rate / torch_rate:.2f}x" if torch_rate else "-"
        used = f"{cpu[label] * 1e3:.0f}" if label in cpu else "-"
        print(f"{label:60} {rate:>11,.0f} {rate / http:>7.2f}x {vs_torch:>10} {used:>7}")
    pairs = [("http", http_label, "aiohttp"), ("s3", s3_label, "obstore")]
    if "s3 moto" in bare:
        pairs.append(("s3 moto", s3_label.replace("asyncio", "moto server"), "obstore"))
    for store_name, label, client in pairs:
        print(f"bare {store_name} ({client}, {CONCURRENCY} in flight, no parsing): "
              f"{bare[store_name]:,.0f} records/s, {cpu['bare ' + store_name] * 1e3:.0f} ms "
              f"CPU; {label}: {rates[label] / bare[store_name]:.2f}x of it")
    for store_name in ("s3", "s3 moto"):
        if store_name in bare:
            print(f"bare {store_name} / bare http: {bare[store_name] / bare['http']:.2f}x")
    ratios = sorted(one[http_label] / one[s3_label] for one in rounds)
    print(f"aloader s3 / aloader http per round: "
          f"{', '.join(f'{ratio:.2f}x' for ratio in ratios)}; median "
          f"{ratios[len(ratios) // 2]:.2f}x")
    print(f"aloader s3 / aloader http (the issue's target, >= 0.8x): {rates[s3_label] / http:.2f}x")


if __name__ == "__main__":
    main()
