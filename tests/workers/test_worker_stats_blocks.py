"""The worker path's per-batch costs: statistics reported in blocks, yet exact at epoch end.

A worker's reply carries its stage timings and source counts only every few replies, or when
no other answer is known to follow it (so the last answer of an epoch always does); each reply
still carries its send time, so the loader times every batch's transfer. The first test drives
a worker's serving loop in this process over a socket pair; the others check the totals of
whole epochs on real workers.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import pytest
from sourcetools import Items

import aloader
from aloader import DataLoader, _workerinfo
from aloader._stats import Collector
from aloader.loader._start import fetch_plan
from aloader.workers import _shm
from aloader.workers._worker import Kind, Reply, Request, Status, WorkerSetup, _WorkerServer


class AsyncItems(Items):
    async def __getitem__(self, i: int) -> int:  # type: ignore[override]
        return i


@pytest.fixture
def served_epoch() -> Iterator[None]:
    """A worker's loop run here sets the process's served epoch: put it back after."""
    try:
        yield
    finally:
        _workerinfo._set_served_epoch(None)


def _server(dataset: Any) -> tuple[_WorkerServer, Connection]:
    """A worker's serving loop in this process, and the loader's end of its socket."""
    loader = DataLoader(dataset, batch_size=2, collate_fn=list, num_workers=2)
    plan = fetch_plan(loader, None)
    plan.stats = Collector(plan.mode, auto_batch=plan.auto_batch)
    setup = WorkerSetup(plan=plan, serve=loader._kind.serve, base_seed=0, num_workers=2,
                        worker_init_fn=None, prefetch=2)
    mine, theirs = socket.socketpair()
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    return _WorkerServer(Connection(theirs.detach()), 0, setup), Connection(mine.detach())


@pytest.mark.parametrize("dataset", [Items(80), AsyncItems(80)], ids=["sync", "async"])
def test_a_busy_worker_reports_its_counts_in_blocks_and_all_of_them(
        dataset: Any, served_epoch: None) -> None:
    server, loader_end = _server(dataset)
    codec = _shm.Codec(_shm.owner(), "ptest")
    tasks = 40
    for job in range(tasks):  # every task queued at once: more answers always follow
        loader_end.send_bytes(codec.encode(Request(Kind.TASK, job, 0, [2 * job, 2 * job + 1],
                                                   [], 0).wire()))
    serving = threading.Thread(target=server.setup.serve.run, args=(server,))
    serving.start()
    replies = [Reply.of(_shm.decode(loader_end.recv_bytes())) for _ in range(tasks)]
    loader_end.close()  # the worker reads EOF: it stops
    serving.join(60)
    assert not serving.is_alive()
    server.conn.close()
    assert [r.job for r in replies] == list(range(tasks))
    assert all(r.status is Status.OK for r in replies)
    assert [r.value for r in replies] == [[2 * j, 2 * j + 1] for j in range(tasks)]
    timings = [r.extra[2] for r in replies]
    reported = [t for t in timings if t is not None]
    # Not one report per batch: a block of them, and the last answer carries the rest.
    assert 1 <= len(reported) <= tasks // 8
    assert timings[-1] is not None
    loader = Collector(num_workers=2)
    for report in reported:
        loader.merge(0, report)
    assert loader.collate.count == tasks and loader.items == 2 * tasks
    assert loader.workers[0][0] == tasks
    assert all(type(r.extra[4]) is int for r in replies)  # each its own send time


def _epoch_counts(dl: DataLoader[Any]) -> tuple[int, int]:
    batches = items = 0
    for batch in dl:
        batches += 1
        items += len(batch)
    return batches, items


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("dataset", [Items(403), AsyncItems(403)], ids=["sync", "async"])
def test_worker_statistics_are_exact_at_epoch_end(dataset: Any, in_order: bool) -> None:
    dl = DataLoader(dataset, batch_size=4, collate_fn=list, num_workers=2, in_order=in_order,
                    persistent_workers=True)
    for _ in range(2):  # and again on the same workers
        batches, items = _epoch_counts(dl)
        assert (batches, items) == (101, 403)
        stats = dl.stats()
        assert stats.batches == 101 and stats.items == 403
        assert stats.stages["collate"].count == 101
        assert stats.stages["transfer"].count == 101
        assert [w["batches"] for w in stats.workers] == [51, 50]


def test_stream_statistics_from_workers_are_exact_at_epoch_end(tmp_path: Path) -> None:
    shards = []
    for k in range(4):
        shard = tmp_path / f"{k}.jsonl"
        shard.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(150)))
        shards.append(shard)
    dl = DataLoader(aloader.JsonLines(shards), batch_size=4, collate_fn=list, num_workers=2,
                    in_order=False)
    batches, items = _epoch_counts(dl)
    assert items == 600
    stats = dl.stats()
    assert stats.sources == [{"shards": 4, "records": 600,
                              "bytes": sum(s.stat().st_size for s in shards),
                              "skipped": 0, "retries": 0}]
    assert stats.items == 600 and stats.batches == batches
    assert sum(w["batches"] for w in stats.workers) == batches
    assert stats.stages["transfer"].count == batches


@pytest.mark.anyio
async def test_worker_statistics_exact_under_async_for(anyio_backend: str) -> None:
    dl = DataLoader(Items(203), batch_size=2, collate_fn=list, num_workers=2)
    count = 0
    async for batch in dl:
        count += len(batch)
    assert count == 203
    stats = dl.stats()
    assert stats.batches == 102 and stats.stages["transfer"].count == 102
    assert [w["batches"] for w in stats.workers] == [51, 51]
    await anyio.sleep(0)


def test_frames_cut_from_reads_of_any_size() -> None:
    from aloader.workers._processes import _FRAME, _WorkerHandle

    messages = [bytes([k]) * size for k, size in enumerate([0, 1, 3, 4, 5, 100, 70_000, 2])]
    stream = b"".join(_FRAME.pack(len(m)) + m for m in messages)
    for step in (1, 3, 4, 7, 64, 4096, len(stream)):
        handle = _WorkerHandle(0, None, None, -1)  # type: ignore[arg-type]
        got = []
        for start in range(0, len(stream), step):
            got += [bytes(frame) for frame in handle.frames(stream[start : start + step])]
        assert got == messages, step
        assert not handle.inbox


def test_a_large_answer_is_one_write(served_epoch: None) -> None:
    # A record socket keeps each write apart: two writes (length, then message) would read as
    # two records, and a loader waiting on the answer would wake for each.
    server, _ = _server(Items(4))
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.conn.close()
    server.conn = Connection(theirs.detach())
    server._fd = server.conn.fileno()
    batch = list(range(10_000))  # well above 16 KiB pickled
    server.send(7, Status.OK, batch)
    record = mine.recv(1 << 22)
    (size,) = struct.unpack("!i", record[:4])
    assert size == len(record) - 4 > 16 * 1024
    reply = Reply.of(_shm.decode(record[4:]))
    assert reply.job == 7 and reply.value == batch
    mine.close()
    server.conn.close()
