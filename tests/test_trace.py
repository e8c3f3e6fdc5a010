"""loader.trace(path): the per-stage timings of the epochs run while it records, written as a
Chrome trace (the Trace Event Format's JSON, which chrome://tracing and Perfetto open): one
event per fetch, collate, wait and sampling step, tracks that never overlap, bounded."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

from aloader import DataLoader, Trace


class Items:
    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        await anyio.sleep(0.001)
        return index


def load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms" and data["otherData"]["source"] == "aloader"
    for event in data["traceEvents"]:
        assert event["ph"] in ("X", "M")
        assert isinstance(event["pid"], int) and isinstance(event["name"], str)
        if event["ph"] == "X":
            assert isinstance(event["tid"], int) and event["cat"]
            assert event["ts"] >= 0 and event["dur"] >= 0
    return data


def counts(data: dict[str, Any]) -> Counter[str]:
    return Counter(e["name"] for e in data["traceEvents"] if e["ph"] == "X")


def tracks(data: dict[str, Any]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
            if e["name"] == "thread_name"}


def test_a_traced_epoch_is_a_chrome_trace(tmp_path: Path) -> None:
    path = tmp_path / "epoch.json"
    loader = DataLoader(Items(64), batch_size=8, max_concurrency=4)
    with loader.trace(path) as trace:
        assert isinstance(trace, Trace)
        assert sum(len(batch) for batch in loader) == 64
    data = load(path)
    assert counts(data) == Counter({"fetch": 64, "sampling": 8, "collate": 8, "wait": 8,
                                    "consumer": 7, "epoch 0": 1})
    names = tracks(data)
    assert {"epochs", "consumer", "sampling", "fetch", "collate"} <= set(names.values())
    # Events of one track never overlap: a viewer draws each as a slice of its own.
    by_tid: dict[int, list[tuple[float, float]]] = {}
    for event in data["traceEvents"]:
        if event["ph"] == "X":
            by_tid.setdefault(event["tid"], []).append((event["ts"], event["dur"]))
    for spans in by_tid.values():
        spans.sort()
        for (start, duration), (after, _) in itertools.pairwise(spans):
            assert start + duration <= after + 1e-3
    assert data["otherData"]["dropped"] == 0


def test_only_the_epochs_started_while_recording_are_recorded(tmp_path: Path) -> None:
    loader = DataLoader(Items(16), batch_size=4)
    list(loader)
    trace = loader.trace(tmp_path / "two.json")
    for _ in range(2):
        list(loader)
    trace.stop()
    trace.stop()  # once
    list(loader)  # not recorded
    data = load(tmp_path / "two.json")
    assert counts(data)["fetch"] == 32 and counts(data)["epoch 1"] == 1
    assert counts(data)["epoch 2"] == 1 and "epoch 3" not in counts(data)


@pytest.mark.anyio
async def test_async_for_is_traced(tmp_path: Path, anyio_backend: str) -> None:
    loader = DataLoader(Items(24), batch_size=6)
    async with anyio.create_task_group():
        with loader.trace(tmp_path / "async.json"):
            assert sum([len(batch) async for batch in loader]) == 24
    assert counts(load(tmp_path / "async.json"))["wait"] == 4


def test_worker_transfers_are_traced(tmp_path: Path) -> None:
    loader = DataLoader(list(range(40)), batch_size=5, num_workers=2)
    with loader.trace(tmp_path / "workers.json"):
        assert sum(len(batch) for batch in loader) == 40
    found = counts(load(tmp_path / "workers.json"))
    assert found["transfer"] == 8 and found["wait"] == 8


def test_a_trace_is_bounded(tmp_path: Path) -> None:
    loader = DataLoader(Items(64), batch_size=8)
    with loader.trace(tmp_path / "small.json", max_events=10) as trace:
        list(loader)
    data = load(tmp_path / "small.json")
    assert sum(counts(data).values()) == 11  # 10 events and the epoch
    assert data["otherData"]["dropped"] == trace.dropped == 95 - 10
