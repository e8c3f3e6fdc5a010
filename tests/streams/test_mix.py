"""aloader.mix: proportions, reproducibility, stop rules, workers' exactly-once, errors."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aloader
import aloader.streams._mix
from aloader import DataLoader, JsonLines, Stream, as_stream, mix
from aloader.streams._sourcestats import source_stats

pytestmark = pytest.mark.anyio


async def collect(source: Any, limit: int | None = None) -> list[Any]:
    out: list[Any] = []
    iterator = aiter(source)
    try:
        async for item in iterator:
            out.append(item)
            if limit is not None and len(out) >= limit:
                break
    finally:
        await iterator.aclose()  # type: ignore[attr-defined]
    return out


class Tagged(Stream[tuple[int, int]]):
    """``(tag, i)`` for i in range(n), in blocks of ``block``; counts what it produced."""

    def __init__(self, tag: int, n: int, block: int = 10) -> None:
        self.tag = tag
        self.n = n
        self.block = block
        self.produced = 0
        self.passes = 0

    async def _blocks(self, ctx: Any) -> AsyncIterator[list[tuple[int, int]]]:  # type: ignore[override]
        self.passes += 1
        for start in range(0, self.n, self.block):
            block = [(self.tag, i) for i in range(start, min(start + self.block, self.n))]
            self.produced += len(block)
            yield block


class Failing(Stream[int]):
    def __init__(self, good: int) -> None:
        self.good = good

    async def _blocks(self, ctx: Any) -> AsyncIterator[list[int]]:  # type: ignore[override]
        yield list(range(self.good))
        raise OSError("disk on fire")


def shares(items: list[tuple[int, int]], count: int) -> list[float]:
    tags = Counter(tag for tag, _ in items)
    return [tags[t] / len(items) for t in range(count)]


def reference(seed: int, epoch: int, weights: list[float], lengths: list[int],
              stop: str) -> list[tuple[int, int]]:
    """The invariant of aloader.streams._mix, one uniform at a time, with no blocks at all."""
    rng = np.random.default_rng([seed, epoch, 0, 1])
    live = [w > 0 for w in weights]
    taken = [0] * len(weights)
    out = []
    while any(live):
        w = np.array([wt if ok else 0.0 for wt, ok in zip(weights, live, strict=True)])
        u = rng.random()
        index = int(np.searchsorted(np.cumsum(w), u * w.sum(), side="right"))
        if taken[index] < lengths[index]:
            out.append((index, taken[index]))
            taken[index] += 1
            continue
        if stop == "first_exhausted":
            break
        live[index] = False
    return out


# --------------------------------------------------------------------------- proportions


@pytest.mark.parametrize("weights", [[5, 3, 2], [0.7, 0.2, 0.1], [1, 1, 1]])
async def test_shares_within_one_percent_of_weights(anyio_backend: str,
                                                    weights: list[float]) -> None:
    sources = [Tagged(t, 10**6, block=256) for t in range(3)]
    out = await collect(mix(sources, weights, seed=11), limit=100_000)
    assert len(out) == 100_000
    total = sum(weights)
    for share, weight in zip(shares(out, 3), weights, strict=True):
        assert abs(share - weight / total) < 0.01


async def test_never_keeps_the_shares_over_short_sources(anyio_backend: str) -> None:
    """Sources of 10, 100 and 1000 items, restarted as they end: the shares are the weights."""
    sources = [Tagged(0, 10, 3), Tagged(1, 100, 7), Tagged(2, 1000, 64)]
    out = await collect(mix(sources, [0.2, 0.3, 0.5], seed=5, stop="never"), limit=100_000)
    assert len(out) == 100_000
    for share, weight in zip(shares(out, 3), [0.2, 0.3, 0.5], strict=True):
        assert abs(share - weight) < 0.01
    # Every pass is a whole pass, in order: the items of source 0 cycle 0..9.
    assert [i for tag, i in out if tag == 0][:25] == [*range(10), *range(10), *range(5)]
    assert sources[0].passes > 100


# --------------------------------------------------------------------------- sequence


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
async def test_sequence_is_the_reference_whatever_the_block_sizes(
    anyio_backend: str, stop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The picks depend on the seed, epoch and lengths only: not on the draws per block, nor
    on the sources' blocks; and each pick is a draw from the running sources' weights."""
    weights, lengths = [3.0, 0.0, 1.0, 2.0], [500, 40, 120, 2000]
    runs = []
    served: list[int] = []
    serve = aloader.streams._mix._serve

    def counting(*args: Any) -> int:
        served.append(serve(*args))
        return served[-1]

    monkeypatch.setattr(aloader.streams._mix, "_serve", counting)
    for draws, block in [(1024, 10), (7, 1), (1, 333), (4096, 64), (1024, 333)]:
        monkeypatch.setattr(aloader.streams._mix, "_DRAWS", draws)
        sources = [Tagged(t, n, block) for t, n in enumerate(lengths)]
        mixed = mix(sources, weights, seed=123, stop=stop)  # type: ignore[arg-type]
        runs.append(await collect(mixed))
        assert sources[1].produced == 0  # weight 0: never read
    assert all(run == runs[0] for run in runs)
    assert sum(served) >= len(runs[0]) // 2  # the vectorised path served many of them
    expected = reference(mixed.seed, 0, weights, lengths, stop)  # type: ignore[attr-defined]
    assert runs[0] == expected


async def test_reproducible_and_new_every_epoch(anyio_backend: str) -> None:
    def make(seed: int) -> Stream[Any]:
        return mix([range(300), range(1000, 1500)], [1, 2], seed=seed, stop="all_exhausted")

    first = make(7)
    epochs = [await collect(first) for _ in range(3)]
    assert len({tuple(e) for e in epochs}) == 3  # each epoch its own order
    again = make(7)
    assert [await collect(again) for _ in range(3)] == epochs
    assert await collect(make(8)) != epochs[0]
    fixed = make(7)
    fixed.set_epoch(2)
    assert await collect(fixed) == epochs[2]
    assert await collect(fixed) == epochs[2]
    for epoch in epochs:
        assert sorted(epoch) == [*range(300), *range(1000, 1500)]


async def test_epochs_differ_under_the_loader(anyio_backend: str) -> None:
    loader = DataLoader(mix([range(64), range(100, 164)], [1, 1], seed=3,
                            stop="all_exhausted"), batch_size=8)
    one = [b.tolist() async for b in loader]
    two = [b.tolist() async for b in loader]
    assert one != two
    loader = DataLoader(mix([range(64), range(100, 164)], [1, 1], seed=3,
                            stop="all_exhausted"), batch_size=8)
    assert [b.tolist() async for b in loader] == one


# --------------------------------------------------------------------------- stop rules


async def test_all_exhausted_delivers_everything_once_in_source_order(
    anyio_backend: str,
) -> None:
    sources = [Tagged(0, 100, 9), Tagged(1, 5000, 128), Tagged(2, 700, 1)]
    mixed = mix(sources, [1, 1, 1], seed=2, stop="all_exhausted")
    out = await collect(mixed)
    for tag, n in enumerate([100, 5000, 700]):
        assert [i for t, i in out if t == tag] == list(range(n))
    assert len(out) == 5800
    position = mixed.position  # type: ignore[attr-defined]
    assert position.taken == [100, 5000, 700] and position.done == [True, True, True]
    # One uniform per item, plus one for each pick that found its source finished.
    assert position.draws >= 5803


async def test_first_exhausted_stops_at_the_first_finished_pick(anyio_backend: str) -> None:
    sources = [Tagged(0, 100, 9), Tagged(1, 10_000, 128)]
    mixed = mix(sources, [1, 1], seed=4)
    out = await collect(mixed)
    short = [i for t, i in out if t == 0]
    long = [i for t, i in out if t == 1]
    assert short == list(range(100))  # the one that ended, whole
    assert long == list(range(len(long))) and 50 < len(long) < 200
    assert mixed.position.done == [True, False]  # type: ignore[attr-defined]


async def test_never_drops_empty_sources_and_ends_if_all_are(anyio_backend: str) -> None:
    out = await collect(mix([[], range(5)], [1, 1], seed=0, stop="never"), limit=1000)
    assert len(out) == 1000 and sorted(set(out)) == list(range(5))
    assert await collect(mix([[], []], [1, 2], seed=0, stop="never")) == []
    assert await collect(mix([[], []], [1, 2], seed=0, stop="all_exhausted")) == []
    assert await collect(mix([[], range(3)], [1, 2], seed=0)) in ([], [0], [0, 1], [0, 1, 2])


async def test_a_failing_source_raises_after_what_was_mixed(anyio_backend: str) -> None:
    got: list[Any] = []
    with pytest.raises(OSError, match="disk on fire"):
        async for item in mix([Failing(50), range(1000, 11_000)], [1, 1], seed=1):
            got.append(item)
    assert sorted(x for x in got if x < 50) == list(range(50))


# --------------------------------------------------------------------------- arguments


def test_bad_arguments_are_named() -> None:
    a, b = range(3), range(3)
    with pytest.raises(ValueError, match="2 streams but 3 weights"):
        mix([a, b], [1, 2, 3])
    with pytest.raises(ValueError, match="not all be zero"):
        mix([a, b], [0, 0])
    for bad in ([1, -1], [1, float("nan")], [1, float("inf")]):
        with pytest.raises(ValueError, match="finite and non-negative"):
            mix([a, b], bad)
    with pytest.raises(TypeError, match="weights should be numbers"):
        mix([a, b], [1, "2"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="weights should be a sequence"):
        mix([a, b], 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="streams should be a sequence"):
        mix(as_stream(a), [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one stream"):
        mix([], [])
    with pytest.raises(ValueError, match="stop should be one of"):
        mix([a, b], [1, 1], stop="longest")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="as_stream needs an iterable"):
        mix([a, 5], [1, 1])
    assert "mix" in aloader.__all__


# --------------------------------------------------------------------------- workers


def write_jsonl(directory: Path, prefix: str, shards: int, per_shard: int,
                start: int) -> None:
    directory.mkdir()
    for shard in range(shards):
        with open(directory / f"{prefix}-{shard}.jsonl", "w") as f:
            for i in range(per_shard):
                f.write(json.dumps({"id": start + shard * per_shard + i}) + "\n")


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_all_exhausted_exactly_once_with_two_workers(tmp_path: Path) -> None:
    """Each worker mixes its share of each source: every record once, over 2 epochs."""
    write_jsonl(tmp_path / "a", "a", 4, 50, 0)
    write_jsonl(tmp_path / "b", "b", 3, 100, 1000)
    mixed = mix([JsonLines(tmp_path / "a", shuffle_shards=True, seed=1),
                 JsonLines(tmp_path / "b")], [3, 1], seed=9, stop="all_exhausted")
    loader = DataLoader(mixed, batch_size=16, num_workers=2)
    epochs = []
    for _ in range(2):
        ids = [i for batch in loader for i in batch["id"].tolist()]
        assert sorted(ids) == [*range(200), *range(1000, 1300)]
        epochs.append(ids)
    assert epochs[0] != epochs[1]
    stats = source_stats(mixed)
    assert [s.records for s in stats] == [400, 600]
