"""Streaming JSON Lines shards from S3 (a local moto server) against plain HTTP and PyTorch.

Run: ``python benchmarks/bench_objstore.py`` (needs ``obstore``, ``moto[server]``, ``boto3``;
torch for the PyTorch row). Everything below is measured in the same run.

64 shards of 1,000 JSON Lines records (~106 bytes each), the same bodies as
``bench_sources.py``. S3: moto's S3 server behind aloader's fault proxy
(``aloader._demo._s3.LocalS3``, in a separate process) that waits 20 ms before forwarding each
request. HTTP: ``aloader._demo.ShardServer`` (another process), also 20 ms per request.
One epoch, batches of 256, best of 3, the rows interleaved (PyTorch's after them):

* aloader s3: ``DataLoader(JsonLines(s3_urls, concurrency=16), batch_size=256)``, credentials
  and endpoint from the environment, on one event loop (asyncio).
* aloader s3, trio: the same on trio (obstore's blocking API in threads).
* aloader http: ``DataLoader(JsonLines(http_urls, concurrency=16), batch_size=256)``.
* bare obstore (the honest limit of the S3 rows): the same 64 objects read with obstore's
  async API alone, 16 GETs in flight (``get_async``, then the body's chunks), one event loop,
  no parsing: what the proxy and moto can serve, whatever reads them. If the aloader S3 row is
  near it, the store is the bottleneck, not aloader's S3 path.
* bare aiohttp: the same over plain HTTP (``aiohttp`` GETs, 16 in flight, bodies read, no
  parsing): the limit of the HTTP row.
* PyTorch: ``torch.utils.data.DataLoader`` over an ``IterableDataset`` whose 8 workers each
  read their share of the objects with a blocking boto3 client (``get_object`` and
  ``iter_lines``) and ``json.loads`` every line (workers started by each epoch, as by
  default).

Targets (issue 14): aloader s3 >= 0.8x aloader http, and >= 5x PyTorch with 8 workers. The
last lines put each aloader row against its bare limit, and the bare S3 limit against the bare
HTTP one: the part of the S3/HTTP gap that is the store's (moto behind the proxy), not
aloader's.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any

from common import (
    BATCH,
    CONCURRENCY,
    LATENCY,
    RECORDS,
    RUNS,
    SHARDS,
    TOTAL,
    best,
    count_torch,
    run_aloader,
    serve_shards,
)

from aloader import JsonLines
from aloader._demo import make_jsonl_shards
from aloader._objstore import ObjectAccess

BUCKET = "bench"


def _serve_s3(queue: Any, stop: Any) -> None:
    from aloader._demo._s3 import LocalS3

    with LocalS3(latency=LATENCY) as server:
        server.put(BUCKET, make_jsonl_shards(SHARDS, RECORDS))
        queue.put(server.env())
        stop.wait()


def run_bare_s3(urls: list[str]) -> int:
    """The 64 objects read with obstore's async API only, CONCURRENCY at once; bytes read."""
    import asyncio

    import obstore

    # aloader's own store for the bucket (made once per process, as aloader's S3 rows use
    # it): the same connection pool, so the bare program pays no connection setup either.
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
    processes = [context.Process(target=_serve_s3, args=(queue, stop), daemon=True),
                 context.Process(target=serve_shards,
                                 args=(queue, stop), daemon=True)]
    processes[0].start()
    env = queue.get(timeout=120)
    processes[1].start()
    port = queue.get(timeout=60)
    os.environ.update(env)
    names = sorted(make_jsonl_shards(SHARDS, RECORDS))
    http_urls = [f"http://127.0.0.1:{port}/{name}" for name in names]
    s3_urls = JsonLines(f"s3://{BUCKET}/*.jsonl").shards  # listed through obstore
    assert [url.rsplit("/", 1)[1] for url in s3_urls] == names
    rows: list[tuple[str, float]] = []
    size = sum(map(len, make_jsonl_shards(SHARDS, RECORDS).values()))
    bare: dict[str, float] = {}
    # (label, epoch, what it returns per epoch): aloader counts records, the bare programs bytes.
    contestants: list[tuple[str, Callable[[], int], int]] = [
        (f"aloader http JsonLines(concurrency={CONCURRENCY})",
         lambda: run_aloader(http_urls), TOTAL),
        (f"aloader s3 JsonLines(concurrency={CONCURRENCY}), asyncio",
         lambda: run_aloader(s3_urls), TOTAL),
        (f"aloader s3 JsonLines(concurrency={CONCURRENCY}), trio",
         lambda: run_aloader(s3_urls, "trio"), TOTAL),
        ("bare s3", lambda: run_bare_s3(s3_urls), size),
        ("bare http", lambda: run_bare_http(http_urls), size),
    ]
    times: dict[str, float] = {}
    try:
        for label, fn, expected in contestants:
            assert fn() == expected, label  # warm-up: imports, connections, thread pools
        for _ in range(RUNS):  # interleaved: a change of load hits every row alike
            for label, fn, expected in contestants:
                seconds, got = best(fn, 1)
                assert got == expected, (label, got, expected)
                times[label] = min(times.get(label, seconds), seconds)
        for label, _, _ in contestants:
            if label.startswith("bare "):
                # the records those bytes hold, per second
                bare[label.removeprefix("bare ")] = TOTAL / times[label]
            else:
                rows.append((label, TOTAL / times[label]))
        try:
            import torch  # noqa: F401 - only to know whether the anchor can run
        except ImportError:
            print("torch is not installed: the PyTorch row is skipped", file=sys.stderr)
        else:
            seconds, items = best(lambda: run_torch_boto3(names, env, 8))
            assert items == TOTAL
            rows.append(("PyTorch DataLoader, boto3, num_workers=8", items / seconds))
    finally:
        stop.set()
        for process in processes:
            process.join(timeout=10)

    rates = dict(rows)
    http = rows[0][1]
    torch_rate = rates.get("PyTorch DataLoader, boto3, num_workers=8")
    print(f"{SHARDS} shards x {RECORDS:,} JSON Lines records, {LATENCY * 1e3:.0f} ms per "
          f"request, batch {BATCH}, best of {RUNS}")
    print(f"{'':52} {'items/s':>11} {'vs http':>8} {'vs torch-8':>10}")
    for label, rate in rows:
        vs_torch = f"{rate / torch_rate:.2f}x" if torch_rate else "-"
        print(f"{label:52} {rate:>11,.0f} {rate / http:>7.2f}x {vs_torch:>10}")
    for store, label in (("http", rows[0][0]), ("s3", rows[1][0])):
        print(f"bare {store} ({'obstore' if store == 's3' else 'aiohttp'}, {CONCURRENCY} in "
              f"flight, no parsing): {bare[store]:,.0f} records/s; {label}: "
              f"{rates[label] / bare[store]:.2f}x of it")
    print(f"bare s3 / bare http: {bare['s3'] / bare['http']:.2f}x (the store's own share of the "
          f"S3/HTTP gap); aloader s3 / aloader http: {rows[1][1] / http:.2f}x")


if __name__ == "__main__":
    main()
