"""Stream transforms (shuffle, map, filter, interleave) and backpressure, counted."""

from __future__ import annotations

import gc
import threading
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from sourcetools import collect

from aloader import DataLoader, IterableDataset, Stream, TextLines, as_stream, interleave, mix

pytestmark = pytest.mark.anyio


class Counted(Stream[int]):
    """``range(n)`` in blocks of ``block``, counting what it has produced."""

    def __init__(self, n: int, block: int = 10) -> None:
        self.n = n
        self.block = block
        self.produced = 0

    async def _blocks(self, ctx: Any) -> AsyncIterator[list[int]]:  # type: ignore[override]
        for start in range(0, self.n, self.block):
            block = list(range(start, min(start + self.block, self.n)))
            self.produced += len(block)
            yield block


async def let_run(rounds: int = 30) -> None:
    """Give background tasks plenty of turns (the assertions that follow are bounds)."""
    for _ in range(rounds):
        await anyio.sleep(0.002)


# --------------------------------------------------------------------------- shuffle


async def test_shuffle_is_a_reproducible_permutation(anyio_backend: str) -> None:
    data = list(range(1000))
    first = await collect(as_stream(data).shuffle(100, seed=7))
    assert sorted(first) == data and first != data
    assert await collect(as_stream(data).shuffle(100, seed=7)) == first
    assert await collect(as_stream(data).shuffle(100, seed=8)) != first
    stream = as_stream(data).shuffle(100, seed=7)
    epochs = [await collect(stream) for _ in range(3)]
    assert epochs[0] == first and epochs[1] != epochs[0] and epochs[2] != epochs[1]
    stream.set_epoch(1)
    assert await collect(stream) == epochs[1]
    generator = np.random.default_rng(3)
    assert sorted(await collect(as_stream(data).shuffle(10, seed=generator))) == data
    assert await collect(as_stream(data).shuffle(1, seed=0)) == data


async def test_shuffle_buffer_bounded(anyio_backend: str) -> None:
    source = Counted(5000, block=37)
    shuffled = source.shuffle(256, seed=0)
    assert sorted(await collect(shuffled)) == list(range(5000))
    assert shuffled.max_buffered == 256  # type: ignore[attr-defined]
    # Items leave the buffer in a spread: the first output comes from the first 256+37 items.
    small = as_stream(range(10)).shuffle(1000, seed=0)
    assert sorted(await collect(small)) == list(range(10))


async def test_shuffle_buffer_allocated_as_it_fills(anyio_backend: str) -> None:
    """A buffer of 10**12 items over a short stream holds what the stream holds (its
    bookkeeping too: it was a 7.28 TiB array at the start), and resumes."""
    tracemalloc.start()
    try:
        huge = as_stream(range(3000)).shuffle(10**12, seed=0)
        out = await collect(huge)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sorted(out) == list(range(3000)) and peak < 8 << 20, peak
    loader = DataLoader(as_stream(range(3000)).shuffle(10**12, seed=0), batch_size=100,
                        collate_fn=list)
    epoch = loader.__aiter__()
    head = [await epoch.__anext__() for _ in range(3)]
    state = loader.state_dict()
    await epoch.aclose()
    resumed = DataLoader(as_stream(range(3000)).shuffle(10**12, seed=0), batch_size=100,
                         collate_fn=list)
    resumed.load_state_dict(state)
    rest = [batch async for batch in resumed]
    assert sorted(i for batch in head + rest for i in batch) == list(range(3000))


async def test_shuffle_mixes_within_window(anyio_backend: str) -> None:
    out = await collect(as_stream(range(2000)).shuffle(50, seed=1))
    # Displacement is bounded below by the buffer: an item can only leave after it entered.
    assert all(value <= position + 50 for position, value in enumerate(out))


def test_shuffle_arguments() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="buffer_size should be a positive integer"):
            as_stream([1]).shuffle(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- map and filter


async def test_map_plain_and_async(anyio_backend: str) -> None:
    data = list(range(300))
    assert await collect(as_stream(data).map(lambda x: x * 2)) == [x * 2 for x in data]

    async def slow_square(x: int) -> int:
        await anyio.sleep(0.001 * (x % 3))
        return x * x

    assert await collect(as_stream(data).map(slow_square)) == [x * x for x in data]
    assert await collect(as_stream(data).map(slow_square, concurrency=8)) == [x * x for x in data]
    unordered = await collect(as_stream(data).map(slow_square, concurrency=8, ordered=False))
    assert sorted(unordered) == [x * x for x in data]


async def test_map_concurrency_bounded_and_reached(anyio_backend: str) -> None:
    running = 0
    peak = 0

    async def work(x: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await anyio.sleep(0.002)
        running -= 1
        return x

    mapped = as_stream(range(200)).map(work, concurrency=6)
    assert await collect(mapped) == list(range(200))
    assert peak == 6
    assert mapped.max_running == 6  # type: ignore[attr-defined]


async def test_map_plain_function_in_threads(anyio_backend: str) -> None:
    threads: set[int] = set()
    lock = threading.Lock()
    barrier = threading.Barrier(3, timeout=5)

    def blocking(x: int) -> int:
        with lock:
            threads.add(threading.get_ident())
        if x < 3:
            barrier.wait()  # three calls must run at once for this to return
        return -x

    out = await collect(as_stream(range(50)).map(blocking, concurrency=4))
    assert out == [-x for x in range(50)]
    assert threading.get_ident() not in threads and len(threads) >= 3


async def test_map_error_keeps_order(anyio_backend: str) -> None:
    async def fail_at_7(x: int) -> int:
        await anyio.sleep(0.001 * ((10 - x) % 4))
        if x == 7:
            raise KeyError("seven")
        return x

    seen = []
    with pytest.raises(KeyError, match="seven"):
        async for x in as_stream(range(20)).map(fail_at_7, concurrency=5):
            seen.append(x)
    assert seen == list(range(7))


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("is_async", [False, True])
async def test_map_delivers_every_item_before_a_failing_one(
        anyio_backend: str, concurrency: int, is_async: bool) -> None:
    def check(x: int) -> int:
        if x == 7:
            raise KeyError("seven")
        return x * 10

    async def check_async(x: int) -> int:
        await anyio.lowlevel.checkpoint()
        return check(x)

    fn: Any = check_async if is_async else check
    for stream in (as_stream(range(20)), Counted(20, block=20)):
        seen = []
        with pytest.raises(KeyError, match="seven"):
            async for x in stream.map(fn, concurrency=concurrency):
                seen.append(x)
        # The items before the failing one in its block are not lost with it.
        assert seen == [x * 10 for x in range(7)]


def tasks_alive(backend: str) -> int:
    if backend == "trio":
        import trio

        return int(trio.lowlevel.current_statistics().tasks_living)
    import asyncio

    return len(asyncio.all_tasks())


async def test_map_huge_concurrency_starts_tasks_as_work_arrives(anyio_backend: str) -> None:
    before = tasks_alive(anyio_backend)
    peak = 0

    async def work(x: int) -> int:
        nonlocal peak
        peak = max(peak, tasks_alive(anyio_backend))
        await anyio.sleep(0.001)
        return -x

    # A task per unit of concurrency would be a million of them before the first item.
    mapped = as_stream(range(10)).map(work, concurrency=10**6)
    assert await collect(mapped) == [-x for x in range(10)]
    assert peak - before <= 30

    threads = as_stream(range(10)).map(lambda x: -x, concurrency=10**6, ordered=False)
    assert sorted(await collect(threads)) == [-x for x in range(9, -1, -1)]


async def test_filter(anyio_backend: str) -> None:
    assert await collect(as_stream(range(30)).filter(lambda x: x % 3 == 0)) == list(
        range(0, 30, 3))

    async def odd(x: int) -> bool:
        await anyio.sleep(0)
        return x % 2 == 1

    assert await collect(as_stream(range(10)).filter(odd)) == [1, 3, 5, 7, 9]


# --------------------------------------------------------------------------- interleave


async def test_interleave_round_robin(anyio_backend: str) -> None:
    mixed = interleave(range(5), [10, 11, 12], as_stream([20]))
    assert await collect(mixed) == [0, 10, 20, 1, 11, 2, 12, 3, 4]
    early = interleave(range(5), [10, 11], stop_on_first=True)
    assert await collect(early) == [0, 10, 1, 11, 2]


async def test_interleave_weighted(anyio_backend: str) -> None:
    a, b = list(range(0, 3000)), list(range(10000, 11000))
    mixed = interleave(a, b, weights=[3, 1], seed=4)
    out = await collect(mixed)
    assert sorted(out) == a + b
    assert [x for x in out if x < 10000] == a and [x for x in out if x >= 10000] == b
    head = out[:2000]
    share = sum(x < 10000 for x in head) / len(head)
    assert 0.65 < share < 0.85  # about 3 to 1 while both run
    assert await collect(interleave(a, b, weights=[3, 1], seed=4)) == out
    with pytest.raises(ValueError, match="2 streams but 3 weights"):
        interleave(a, b, weights=[1, 2, 3])
    with pytest.raises(ValueError, match="positive sum"):
        interleave(a, b, weights=[0, 0])


async def test_interleave_weighted_is_mix_whatever_the_block_sizes(anyio_backend: str) -> None:
    # One mechanism for weighted mixing: interleave(weights=) draws what mix draws (the stop
    # rule matching stop_on_first), and so does not depend on how the inputs cut their blocks.
    # Three inputs, so that the draws after the shortest one ends matter too.
    lengths, tags = (700, 100, 400), (0, 10000, 20000)

    def inputs(blocks: tuple[int, ...]) -> list[Stream[int]]:
        return [Counted(n, block).map(lambda x, tag=tag: x + tag)
                for n, block, tag in zip(lengths, blocks, tags, strict=True)]

    stops: tuple[tuple[bool, Any], ...] = ((False, "all_exhausted"), (True, "first_exhausted"))
    for stop_on_first, stop in stops:
        expected = await collect(mix(inputs(lengths), [2, 1, 1], seed=5, stop=stop))
        for blocks in ((1, 7, 3), (64, 3, 100), lengths):
            mixed = interleave(*inputs(blocks), weights=[2, 1, 1], seed=5,
                               stop_on_first=stop_on_first)
            assert await collect(mixed) == expected, (stop_on_first, blocks)
        assert (len(expected) == sum(lengths)) is not stop_on_first


async def test_interleave_sources_and_loader(tmp_path: Path, anyio_backend: str) -> None:
    (tmp_path / "a.txt").write_text("".join(f"a{i}\n" for i in range(50)))
    (tmp_path / "b.txt").write_text("".join(f"b{i}\n" for i in range(30)))
    mixed = interleave(TextLines(tmp_path / "a.txt"), TextLines(tmp_path / "b.txt"))
    loader = DataLoader(mixed.map(str.upper), batch_size=8)
    batches = [batch async for batch in loader]
    flat = [x for batch in batches for x in batch]
    assert len(flat) == 80 and flat[:4] == ["A0", "B0", "A1", "B1"]


# --------------------------------------------------------------------------- adapters


async def test_as_stream_of_datasets(anyio_backend: str) -> None:
    class Sync(IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(600))

    class Async(IterableDataset[int]):
        async def __aiter__(self) -> AsyncIterator[int]:  # type: ignore[override]
            for i in range(5):
                await anyio.sleep(0)
                yield i

    assert await collect(as_stream(Sync())) == list(range(600))
    assert await collect(as_stream(Async()).map(lambda x: x + 1)) == [1, 2, 3, 4, 5]
    with pytest.raises(TypeError, match="as_stream needs an iterable"):
        as_stream(42)


async def test_epoch_counter(anyio_backend: str) -> None:
    stream = as_stream(range(3)).shuffle(3, seed=0)
    assert stream.epoch == 0
    await collect(stream)
    assert stream.epoch == 1
    stream.set_epoch(10)
    await collect(stream)
    assert stream.epoch == 10


# --------------------------------------------------------------------------- backpressure


async def test_backpressure_plain_stream(anyio_backend: str) -> None:
    source = Counted(100_000, block=10)
    iterator = source.__aiter__()
    assert await iterator.__anext__() == 0
    await let_run()
    # The consumer's block, two prefetched blocks and one waiting to be handed over.
    assert 10 < source.produced <= 40
    for expected in range(1, 500):
        assert await iterator.__anext__() == expected
    await let_run()
    assert source.produced <= 500 + 40
    await iterator.aclose()  # type: ignore[attr-defined]


async def test_backpressure_through_map_and_shuffle(anyio_backend: str) -> None:
    async def identity(x: int) -> int:
        await anyio.sleep(0)
        return x

    source = Counted(100_000, block=10)
    stream = source.map(identity, concurrency=8).shuffle(100, seed=0)
    iterator = stream.__aiter__()
    await iterator.__anext__()
    await let_run()
    # shuffle buffer 100 + map's 2 * 8 + the map's upstream block 10 + the driver's 40.
    assert source.produced <= 100 + 16 + 10 + 40
    taken = 1
    for _ in range(1000):
        await iterator.__anext__()
        taken += 1
    await let_run()
    assert source.produced <= taken + 100 + 16 + 10 + 40
    await iterator.aclose()  # type: ignore[attr-defined]


async def test_backpressure_files(tmp_path: Path, anyio_backend: str) -> None:
    # 8 shards of 5,000 fixed-size lines (9 bytes); 10 lines per 90-byte chunk.
    for shard in range(8):
        (tmp_path / f"s{shard}.txt").write_text("".join(f"{shard}{i:07d}\n" for i in range(5000)))
    for concurrency in (1, 3):
        source = TextLines(tmp_path, chunk_size=90, concurrency=concurrency)
        iterator = source.__aiter__()
        await iterator.__anext__()
        await let_run(60)
        # Per reading shard: 2 blocks queued + 1 in hand; then the stream's 2 + 1 + 1.
        bound = (3 * concurrency + 4) * 10 if concurrency > 1 else 4 * 10
        assert 10 <= source.stats.records <= bound
        assert source.stats.bytes <= bound * 9 + 90 * concurrency
        await iterator.aclose()  # type: ignore[attr-defined]


async def test_slow_loader_consumer_stops_reading(tmp_path: Path, anyio_backend: str) -> None:
    (tmp_path / "big.txt").write_text("".join(f"{i:08d}\n" for i in range(200_000)))
    source = TextLines(tmp_path, chunk_size=900)  # 100 lines per chunk
    loader = DataLoader(source, batch_size=50, prefetch_factor=2)
    async for _ in loader:
        await let_run(40)  # a consumer far slower than the source
        break
    # Loader: the batch in hand + 2 prefetched + 1 being built (200 lines); source: 4 blocks.
    assert source.stats.records <= 200 + 400 + 100
    await loader.aclose()
    gc.collect()
