"""Helpers the source tests share: drain an async source, resume one after k items, pretend to
be a loader worker (or every consumer of ranks x workers in turn), write a file, and find a
port nothing listens on.

Sources shard by :func:`aloader.get_worker_info`; the tests simulate worker ``w`` of ``W`` in
this process instead of starting workers, so exactly-once reads can be checked directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import socket
from collections.abc import AsyncIterable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anyio

from aloader._workerinfo import WorkerInfo, _set_worker_info

__all__ = ("as_worker", "collect", "decoded_ahead", "free_port", "interrupted",
           "read_as_consumers", "roundtrip", "write")

T = TypeVar("T")


async def collect(source: AsyncIterable[T]) -> list[T]:
    """Every item of ``source``, in order."""
    return [item async for item in source]


async def decoded_ahead(source: Any, server: Any, shards: int) -> tuple[int, list[int]]:
    """Take one record of ``source``, let its readers of ``shards`` shards (served by
    ``server``) run on until every shard was asked for, then read the rest: (the records
    decoded when the readers had settled, the ids of every record in order)."""
    iterator: Any = source.__aiter__()
    first = await iterator.__anext__()
    for _ in range(100):  # until every shard was asked for, then let the readers run on
        if len(server.requests) == shards:
            break
        await anyio.sleep(0.01)
    for _ in range(10):
        await anyio.sleep(0.01)
    decoded = source.stats.records
    rest = [record async for record in iterator]
    return decoded, [r["id"] for r in [first, *rest]]


def through_interrupts(iterator: Iterator[T]) -> tuple[list[T], int]:
    """Every item of a sync iterator, going on after each KeyboardInterrupt it raises, and
    how many it raised (a consumer that catches Ctrl-C and carries on)."""
    out: list[T] = []
    interrupts = 0
    while True:
        try:
            out.append(next(iterator))
        except StopIteration:
            return out, interrupts
        except KeyboardInterrupt:
            interrupts += 1


def ids(records: list[Any]) -> list[int]:
    """The ``id`` field of each record (faulty_server.make_jsonl_shards' records)."""
    return [record["id"] for record in records]


def object_gets(server: Any, bucket: str) -> int:
    """GET requests for objects of ``bucket`` that the local S3 server's proxy received
    (without a query, or with a presigned URL's)."""
    return sum(1 for method, path, _ in server.proxy.requests
               if method == "GET" and ("?" not in path or "X-Amz-Signature=" in path)
               and path.startswith(f"/{bucket}/"))


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` through JSON (and pickle), as a checkpoint file would carry it."""
    out = json.loads(json.dumps(state))
    assert pickle.loads(pickle.dumps(out)) == out
    return out  # type: ignore[no-any-return]


async def interrupted(make: Callable[[], Any], k: int, epochs_before: int = 0
                      ) -> tuple[list[Any], Any]:
    """Items after the first ``k`` of epoch ``epochs_before``, read by a fresh stream resumed
    from the state taken after them; and that state."""
    stream = make()
    for _ in range(epochs_before):
        _ = [item async for item in stream]
    iterator = stream.__aiter__()
    for _ in range(k):
        await iterator.__anext__()
    state = roundtrip(stream.state_dict())
    await iterator.aclose()
    fresh = make()
    fresh.load_state_dict(state)
    return [item async for item in fresh], state


@contextlib.contextmanager
def as_worker(worker_id: int, num_workers: int, *, dataset: Any = None,
              seed: int | None = None) -> Iterator[None]:
    """Pretend to be loader worker ``worker_id`` of ``num_workers`` (workers are simulated).

    Args:
        worker_id: The worker's id.
        num_workers: How many workers there are.
        dataset: What ``get_worker_info().dataset`` holds.
        seed: The worker's seed; ``worker_id`` when not given.
    """
    _set_worker_info(WorkerInfo(id=worker_id, num_workers=num_workers,
                                seed=worker_id if seed is None else seed, dataset=dataset))
    try:
        yield
    finally:
        _set_worker_info(None)


def free_port() -> int:
    """A port with nothing listening on it (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def read_as_consumers(make: Callable[[int], Any], world_size: int,
                            num_workers: int) -> list[Any]:
    """What every consumer reads, each worker of each rank in turn (``make(rank)`` builds that
    rank's source; the worker is simulated with seed 0), all in one list."""
    seen: list[Any] = []
    for rank in range(world_size):
        for worker in range(num_workers):
            source = make(rank)
            with as_worker(worker, num_workers, dataset=source, seed=0):
                seen.extend(await collect(source))
    return seen


def write(tmp_path: Path, name: str, data: bytes) -> str:
    """Write ``data`` to ``tmp_path / name``; the file's path, as a string."""
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def open_handles(directory: Path) -> int:
    """File descriptors of this process open on files under ``directory`` (not on the
    directory itself: the shard cache keeps its directory open)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)) and target != str(directory):
            count += 1
    return count


@contextlib.contextmanager
def local_s3(bucket: str, objects: dict[str, bytes]) -> Iterator[Any]:
    """moto's S3 server behind aloader's fault proxy (``aloader._demo._s3.LocalS3``) holding
    ``objects`` (key -> body) in ``bucket``; the test is skipped without obstore, moto's
    server or boto3."""
    import pytest

    for module in ("obstore", "moto.server", "boto3"):
        pytest.importorskip(module)
    from aloader._demo._s3 import LocalS3

    with LocalS3() as server:
        server.put(bucket, objects)
        yield server


def reset_proxy(server: Any) -> Iterator[Any]:
    """The body of a ``proxy`` fixture: ``server``'s proxy with its request log cleared
    before and after the test."""
    server.proxy.reset()
    yield server.proxy
    server.proxy.reset()


class Items:
    """A plain map-style dataset (module level: workers unpickle it by name)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i
