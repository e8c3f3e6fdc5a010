"""A source's stats follow the epoch, not the reads: an epoch interrupted and continued counts
what the uninterrupted epoch counts (records, bytes, shards, skipped, repeated, dropped), on
every path that reopens or replays a chain: a KeyboardInterrupt in a decoder or a transform
of a sync ``for`` (loopless and on the driver), an ``async for`` cancelled mid-chain and
resumed from its state, a shuffle replaying its input, a DataLoader resumed from its own
state. A fresh source resumed from a state counts the rest of the epoch: the records from the
position on, the bytes and skipped records from the byte offset of the position's block.
"""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from sourcetools import through_interrupts

from aloader import DataLoader, JsonLines, TextLines


def threaded(source: Any) -> Any:
    """``source`` with its epochs forced onto the driver (a private loop for a sync for)."""
    source._loopless = lambda: False
    return source


def jsonl_lines(s: int) -> bytes:
    # A malformed line every 5 records: skip_errors counts them.
    return b"".join(b"{bad\n" if i % 5 == 3 else json.dumps({"s": s, "i": i}).encode() + b"\n"
                    for i in range(9 + 4 * s))


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("stats_shards")
    for s in range(4):
        data = jsonl_lines(s)
        (directory / f"j{s}.jsonl").write_bytes(data)
        (directory / f"z{s}.jsonl.gz").write_bytes(gzip.compress(data))
        (directory / f"t{s}.txt").write_bytes(
            "".join(f"s{s}-{i}\n" for i in range(11 + 3 * s)).encode())
    return directory


def paths(shards: Path, pattern: str) -> list[str]:
    return sorted(map(str, shards.glob(pattern)))


KINDS: dict[str, Callable[[Path, Any], Any]] = {
    "jsonl": lambda d, loads: JsonLines(paths(d, "j*.jsonl"), loads=loads, chunk_size=40,
                                        skip_errors=True),
    "gzip": lambda d, loads: JsonLines(paths(d, "z*.gz"), loads=loads, chunk_size=40,
                                       skip_errors=True),
    "big chunks": lambda d, loads: JsonLines(paths(d, "j*.jsonl"), loads=loads,
                                             skip_errors=True),
    "quota": lambda d, loads: JsonLines(paths(d, "j*.jsonl"), loads=loads, chunk_size=40,
                                        skip_errors=True, records_per_rank=90),
    "dropped": lambda d, loads: JsonLines(paths(d, "j*.jsonl")[:3], loads=loads,
                                          chunk_size=40, skip_errors=True, rank=0,
                                          world_size=2),
}


def raising_loads(at: set[int]) -> Callable[[str], Any]:
    """``json.loads`` raising KeyboardInterrupt at the calls numbered in ``at``."""
    calls = itertools.count(1)

    def loads(text: str) -> Any:
        if next(calls) in at:
            raise KeyboardInterrupt
        return json.loads(text)

    return loads


def full_counts(make: Callable[[Any], Any]) -> tuple[list[Any], tuple[int, ...]]:
    source = make(json.loads)
    items = list(source)
    return items, source.stats.counts()


# --------------------------------------------------------------------------- sync for


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("at", [{1}, {4}, {8}, {6, 7, 11}])
@pytest.mark.parametrize("path", ["loopless", "driver"])
def test_an_interrupt_in_a_decoder_counts_each_record_once(shards: Path, kind: str,
                                                           at: set[int], path: str) -> None:
    def make(loads: Any) -> Any:
        source = KINDS[kind](shards, loads)
        return threaded(source) if path == "driver" else source

    items, counts = full_counts(make)
    source = make(raising_loads(at))
    got, interrupts = through_interrupts(iter(source))
    assert interrupts == len(at)
    assert got == items
    assert source.stats.counts() == counts
    assert source.stats.skipped > 0


@pytest.mark.parametrize("at", [1, 9, 30])
@pytest.mark.parametrize("concurrency", [1, 3])
def test_an_interrupt_in_a_transform_counts_each_record_once(shards: Path, at: int,
                                                             concurrency: int) -> None:
    def make() -> Any:
        return TextLines(paths(shards, "t*.txt"), chunk_size=16, concurrency=concurrency)

    reference = make()
    full = list(reference)
    calls = itertools.count(1)

    def fn(line: str) -> str:
        if next(calls) == at:
            raise KeyboardInterrupt
        return line

    source = make()
    got, interrupts = through_interrupts(iter(source.map(fn)))
    assert interrupts == 1
    assert got == full
    assert source.stats.counts() == reference.stats.counts()


def test_an_epoch_read_again_counts_again(shards: Path) -> None:
    # Counts are cumulative over epochs: the same epoch read twice (set_epoch) counts twice.
    source = JsonLines(paths(shards, "j*.jsonl"), chunk_size=40, skip_errors=True)
    source.set_epoch(0)
    list(source)
    once = source.stats.counts()
    list(source)
    assert source.stats.counts() == tuple(2 * n for n in once)


# --------------------------------------------------------------------------- async for


async def cancelled_then_resumed(stream: Any, cancel_at: int, in_body: bool) -> list[Any]:
    """An ``async for`` over ``stream`` cancelled after item ``cancel_at`` (in the consumer's
    next wait for the chain, or with ``in_body`` at a checkpoint of the loop's body: a
    loopless chain over cached files never waits), then the same stream resumed from the
    state taken after the last item received: every item, in order."""
    got: list[Any] = []
    state: dict[str, Any] | None = None
    with anyio.CancelScope() as scope:
        async for item in stream:
            got.append(item)
            state = stream.state_dict()
            if len(got) == cancel_at:
                scope.cancel()
                if in_body:
                    await anyio.sleep(0)
    assert scope.cancelled_caught
    assert state is not None
    stream.load_state_dict(state)
    got.extend([item async for item in stream])
    return got


@pytest.mark.parametrize("kind", ["jsonl", "gzip", "quota"])
@pytest.mark.parametrize("path", ["loopless", "driver", "map"])
async def test_a_cancelled_async_for_resumed_counts_each_record_once(
        shards: Path, kind: str, path: str, anyio_backend: str) -> None:
    def make() -> tuple[Any, Any]:
        source = KINDS[kind](shards, None)
        if path == "driver":
            return source, threaded(source)
        if path == "map":
            async def same(item: Any) -> Any:
                await anyio.sleep(0)  # a wait in the chain, where the cancel lands
                return item

            return source, source.map(same)
        return source, source

    reference, stream = make()
    full = [item async for item in stream]
    source, stream = make()
    got = await cancelled_then_resumed(stream, 7, path == "loopless")
    assert got == full
    assert source.stats.counts() == reference.stats.counts()


async def test_a_shuffle_replaying_its_input_counts_it_once(shards: Path,
                                                            anyio_backend: str) -> None:
    def make() -> tuple[Any, Any]:
        source = JsonLines(paths(shards, "j*.jsonl"), chunk_size=40, skip_errors=True)
        return source, source.shuffle(10, seed=1)

    reference, stream = make()
    full = [item async for item in stream]
    source, stream = make()
    got: list[Any] = []
    async for item in stream:
        got.append(item)
        if len(got) == 23:
            break
    state = stream.state_dict()
    assert state["position"]["stage"] == "shuffle"
    stream.load_state_dict(state)
    got.extend([item async for item in stream])
    assert got == full
    assert source.stats.counts() == reference.stats.counts()


# --------------------------------------------------------------------------- the loader


@pytest.mark.parametrize("kind", ["jsonl", "gzip", "quota"])
def test_a_loader_resumed_from_its_own_state_counts_each_record_once(shards: Path,
                                                                    kind: str) -> None:
    reference = KINDS[kind](shards, None)
    full = [list(batch) for batch in DataLoader(reference, batch_size=4, collate_fn=list)]
    source = KINDS[kind](shards, None)
    loader = DataLoader(source, batch_size=4, collate_fn=list)
    got = []
    for batch in loader:
        got.append(list(batch))
        if len(got) == 5:
            break
    state = loader.state_dict()
    loader.load_state_dict(state)
    got.extend(list(batch) for batch in loader)
    assert got == full
    assert source.stats.counts() == reference.stats.counts()


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("kind", ["jsonl", "gzip", "quota"])
@pytest.mark.parametrize(("workers", "again"), [(2, 2), (2, 0), (3, 2)])
def test_a_loader_with_workers_resumed_from_its_own_state_counts_each_record_once(
        shards: Path, kind: str, workers: int, again: int) -> None:
    """The workers had read ahead of the consumer; the resumed epoch's new workers read that
    again and counted it again (290 to 480 records for an epoch of 240): the workers'
    readings come to the loader with their reports and go to the next workers."""
    def make() -> DataLoader[Any]:
        return DataLoader(KINDS[kind](shards, None).shuffle(8, seed=3), batch_size=4,
                          collate_fn=list, num_workers=workers)

    reference = make()
    full = [list(batch) for batch in reference]
    reference.close()
    loader = make()
    it = iter(loader)
    got = [list(next(it)) for _ in range(5)]
    state = loader.state_dict()
    it.close()
    loader.num_workers = again
    loader.load_state_dict(state)
    got.extend(list(batch) for batch in loader)
    loader.close()
    assert got == full
    assert loader.dataset.upstream.stats.counts() == reference.dataset.upstream.stats.counts()


def stream_lengths(shards: Path, pattern: str) -> list[int]:
    """The bytes of each shard's content (decompressed)."""
    out = []
    for name in paths(shards, pattern):
        data = Path(name).read_bytes()
        out.append(len(gzip.decompress(data) if name.endswith(".gz") else data))
    return out


@pytest.mark.parametrize("kind", ["jsonl", "gzip"])
@pytest.mark.parametrize("taken", [3, 14, 30])
def test_a_fresh_source_resumed_counts_the_rest_of_the_epoch(shards: Path, kind: str,
                                                             taken: int) -> None:
    # A new loader (a fresh source) resumed from a state counts from the position: the
    # records it hands on, the bytes from the byte offset of the position's block, the
    # skipped records after that offset, the shards it finishes.
    pattern = "j*.jsonl" if kind == "jsonl" else "z*.gz"
    loader = DataLoader(KINDS[kind](shards, None), batch_size=1, collate_fn=list)
    for seen, _ in enumerate(loader, 1):
        if seen == taken:
            break
    state = loader.state_dict()
    position = state["iterable"]["replicas"][0]["state"]["position"]
    shard, offset = position["shard"], position["offset"]

    source = KINDS[kind](shards, None)
    resumed = DataLoader(source, batch_size=1, collate_fn=list)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    rest = [batch[0] for batch in resumed]
    sizes = stream_lengths(shards, pattern)
    stats = source.stats
    assert stats.records == len(rest)
    assert stats.bytes == sum(sizes[shard:]) - offset
    assert stats.shards == len(sizes) - shard
    # The malformed lines ("{bad") from the block's offset on.
    bad = 0
    for s, name in enumerate(paths(shards, "j*.jsonl")):
        data = Path(name).read_bytes()
        starts = [0, *itertools.accumulate(len(line) for line in data.splitlines(True))]
        bad += sum(1 for line, start in zip(data.splitlines(True), starts, strict=False)
                   if line.startswith(b"{bad") and (s > shard or (s == shard and start >= offset)))
    assert stats.skipped == bad


async def test_a_mix_replaying_its_inputs_counts_them_once(shards: Path,
                                                           anyio_backend: str) -> None:
    # mix resumes by counting: it replays its inputs from their start.
    from aloader import mix

    def make() -> tuple[list[Any], Any]:
        sources = [JsonLines(paths(shards, "j*.jsonl"), chunk_size=40, skip_errors=True),
                   TextLines(paths(shards, "t*.txt"), chunk_size=16)]
        return sources, mix(sources, [1, 2], seed=3, stop="all_exhausted")

    references, stream = make()
    full = [item async for item in stream]
    sources, stream = make()
    got: list[Any] = []
    async for item in stream:
        got.append(item)
        if len(got) == 60:
            break
    stream.load_state_dict(stream.state_dict())
    got.extend([item async for item in stream])
    assert got == full
    assert [s.stats.counts() for s in sources] == [s.stats.counts() for s in references]


def test_a_state_loaded_after_its_epoch_ended_counts_again(shards: Path) -> None:
    # The epoch read to its end, its reading is over: the rest read again is a new reading.
    source = JsonLines(paths(shards, "j*.jsonl"), chunk_size=40, skip_errors=True)
    iterator = iter(source)
    head = [next(iterator) for _ in range(20)]
    state = source.state_dict()
    rest = list(iterator)
    once = source.stats.counts()
    source.load_state_dict(state)
    assert list(source) == rest
    fresh = JsonLines(paths(shards, "j*.jsonl"), chunk_size=40, skip_errors=True)
    fresh.load_state_dict(state)
    assert list(fresh) == rest
    assert source.stats.counts() == tuple(a + b for a, b in zip(once, fresh.stats.counts(),
                                                                  strict=True))
    assert len(head) == 20


@pytest.mark.parametrize("kind", ["jsonl", "gzip"])
async def test_an_async_loader_resumed_from_its_own_state_counts_each_record_once(
        shards: Path, kind: str, anyio_backend: str) -> None:
    reference = KINDS[kind](shards, None)
    full = [list(batch) async for batch in DataLoader(reference, batch_size=4, collate_fn=list)]
    source = KINDS[kind](shards, None)
    loader = DataLoader(source, batch_size=4, collate_fn=list)
    got = []
    async for batch in loader:
        got.append(list(batch))
        if len(got) == 5:
            break
    state = loader.state_dict()
    loader.load_state_dict(state)
    got.extend([list(batch) async for batch in loader])
    assert got == full
    assert source.stats.counts() == reference.stats.counts()
