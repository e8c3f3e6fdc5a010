"""Resume of iterable datasets and streams: Stream.state_dict/load_state_dict for
every source and transform, and the loader's per-batch positions."""

from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from sourcetools import interrupted, local_s3, roundtrip

from aloader import JsonLines, Stream, TextLines, as_stream, interleave

Make = Callable[[], Stream[Any]]


def write_shards(root: Path, shards: int = 3, records: int = 40, *, compress: bool = False
                 ) -> list[str]:
    paths = []
    for s in range(shards):
        lines = "".join(json.dumps({"s": s, "r": r, "pad": "x" * (r % 7)}) + "\n"
                        for r in range(records))
        path = root / f"part-{s}.jsonl{'.gz' if compress else ''}"
        if compress:
            path.write_bytes(gzip.compress(lines.encode()))
        else:
            path.write_text(lines)
        paths.append(str(path))
    return paths


async def check_resume(make: Make, ks: list[int] | None = None, epochs_before: int = 0
                       ) -> None:
    stream = make()
    for _ in range(epochs_before):
        _ = [item async for item in stream]
    full = [item async for item in stream]
    assert full
    for k in ks if ks is not None else [0, 1, len(full) // 3, len(full) // 2, len(full) - 1,
                                         len(full)]:
        rest, _ = await interrupted(make, k, epochs_before)
        assert rest == full[k:], f"k={k}"


# --------------------------------------------------------------------------- sources


async def test_jsonlines_resume_at_every_kind_of_point(tmp_path: Path, anyio_backend: str
                                                      ) -> None:
    paths = write_shards(tmp_path)

    def make() -> Stream[Any]:
        return JsonLines(paths, chunk_size=64, concurrency=2)

    # 40 records a shard: 40 is a shard boundary, 7 and 95 are inside shards.
    await check_resume(make, [0, 7, 39, 40, 41, 95, 119, 120])


async def test_state_names_the_record_and_its_byte_offset(tmp_path: Path, anyio_backend: str
                                                         ) -> None:
    paths = write_shards(tmp_path)
    rest, state = await interrupted(lambda: JsonLines(paths, chunk_size=64), 45)
    position = state["position"]
    assert position["stage"] == "shards" and position["shard"] == 1
    assert position["name"] == paths[1]
    # The block's first record starts at that offset of the shard; skip more records reach
    # record 5 of shard 1.
    lines = Path(paths[1]).read_bytes().split(b"\n")
    offset = sum(len(line) + 1 for line in lines[: position["counter"]])
    assert position["offset"] == offset and position["counter"] + position["skip"] == 5
    assert rest[0] == {"s": 1, "r": 5, "pad": "x" * 5}
    assert state["epoch"] == 0 and state["next_epoch"] == 1
    assert len(json.dumps(state)) < 500


async def test_compressed_shards_resume_by_skipping(tmp_path: Path, anyio_backend: str
                                                   ) -> None:
    paths = write_shards(tmp_path, compress=True)
    await check_resume(lambda: JsonLines(paths, chunk_size=64), [0, 13, 40, 77, 120])


async def test_text_lines_with_shuffled_shards_in_a_later_epoch(tmp_path: Path,
                                                               anyio_backend: str) -> None:
    paths = write_shards(tmp_path, shards=4, records=10)
    await check_resume(lambda: TextLines(paths, chunk_size=50, shuffle_shards=True, seed=3),
                       [0, 5, 10, 23, 40], epochs_before=2)


async def test_state_between_epochs_starts_the_next_one(tmp_path: Path, anyio_backend: str
                                                       ) -> None:
    paths = write_shards(tmp_path, shards=3, records=5)

    def make() -> Stream[Any]:
        return JsonLines(paths, shuffle_shards=True, seed=1)

    stream = make()
    first = [item async for item in stream]
    state = roundtrip(stream.state_dict())
    assert state["epoch"] is None and state["next_epoch"] == 1
    second = [item async for item in stream]
    fresh = make()
    fresh.load_state_dict(state)
    assert [item async for item in fresh] == second != first


# --------------------------------------------------------------------------- transforms


async def test_shuffle_continues_exactly(tmp_path: Path, anyio_backend: str) -> None:
    paths = write_shards(tmp_path, shards=3, records=60)

    def make() -> Stream[Any]:
        return JsonLines(paths, chunk_size=100).shuffle(16, seed=5)

    await check_resume(make, [0, 1, 15, 16, 17, 50, 100, 163, 164, 170, 179, 180])
    await check_resume(make, [3, 90], epochs_before=1)


async def test_shuffle_state_is_small_and_replays_little(anyio_backend: str) -> None:
    data = list(range(20_000))
    consumed: list[int] = []

    class Counting(Stream[int]):
        async def _blocks(self, ctx: Any) -> Any:
            for start in range(0, len(data), 100):
                block = data[start : start + 100]
                consumed.extend(block)
                yield block

    def make() -> Stream[Any]:
        return as_stream(list(range(20_000))).shuffle(1000, seed=0)

    full = [x async for x in make()]
    rest, state = await interrupted(make, 15_000)
    assert rest == full[15_000:]
    assert len(json.dumps(state)) < 1000  # no item, whatever the buffer holds
    # The replay starts at a checkpoint, not at the epoch's start.
    assert state["position"]["ingested"] > 5000


async def test_shuffle_over_a_sync_iterable_counts(anyio_backend: str) -> None:
    await check_resume(lambda: as_stream(range(500)).shuffle(50, seed=2))


async def test_map_and_filter(tmp_path: Path, anyio_backend: str) -> None:
    paths = write_shards(tmp_path)
    calls: list[Any] = []

    def double(record: dict[str, Any]) -> int:
        calls.append(record)
        return int(record["r"]) * 2 + int(record["s"]) * 1000

    def make() -> Stream[Any]:
        return (JsonLines(paths, chunk_size=64).map(double)
                .filter(lambda x: x % 3 != 0).shuffle(8, seed=1))

    await check_resume(make, [0, 5, 40, 79, 80])
    (tmp_path / "many").mkdir()
    many = write_shards(tmp_path / "many", shards=2, records=1500)

    def make_many() -> Stream[Any]:
        return JsonLines(many, chunk_size=64).map(double).filter(lambda x: x % 3 != 0).shuffle(
            8, seed=1)

    items = [x async for x in make_many()]
    stream = make_many()
    iterator = stream.__aiter__()
    _ = [await iterator.__anext__() for _ in range(1500)]
    state = roundtrip(stream.state_dict())
    await iterator.aclose()  # type: ignore[attr-defined]
    calls.clear()
    fresh = make_many()
    fresh.load_state_dict(state)
    rest = [x async for x in fresh]
    assert rest == items[1500:] and len(rest) > 0
    # The resumed map starts at the shuffle's checkpoint, not at the shards' start.
    assert state["position"]["ingested"] > 0 and len(calls) < 3000


async def test_map_with_concurrency(tmp_path: Path, anyio_backend: str) -> None:
    paths = write_shards(tmp_path)

    async def slow(record: dict[str, Any]) -> tuple[int, int]:
        return (record["s"], record["r"])

    await check_resume(lambda: JsonLines(paths, chunk_size=64).map(slow, concurrency=4),
                       [0, 3, 40, 61, 119])
    await check_resume(lambda: JsonLines(paths, chunk_size=64).map(
        lambda r: r["r"], concurrency=3), [17, 64])


async def test_map_unordered_cannot_save_a_position(anyio_backend: str) -> None:
    stream = as_stream(range(100)).map(lambda x: x, concurrency=4, ordered=False)
    iterator = stream.__aiter__()
    await iterator.__anext__()
    with pytest.raises(ValueError, match="ordered=False"):
        stream.state_dict()
    await iterator.aclose()  # type: ignore[attr-defined]


async def test_interleave_round_robin_and_weighted(tmp_path: Path, anyio_backend: str
                                                  ) -> None:
    paths = write_shards(tmp_path, shards=2, records=150)

    def make() -> Stream[Any]:
        return interleave(JsonLines(paths[0], chunk_size=64), as_stream(range(40)),
                          JsonLines(paths[1]).map(lambda r: r["r"]))

    await check_resume(make, [0, 2, 100, 130, 256, 257, 300, 339])

    def weighted() -> Stream[Any]:
        return interleave(as_stream(range(300)), JsonLines(paths[1], chunk_size=64),
                          weights=[1, 2], seed=4).shuffle(10, seed=0)

    await check_resume(weighted, [0, 1, 256, 270, 449])


async def test_stream_resume_on_trio_too(tmp_path: Path, anyio_backend: str) -> None:
    paths = write_shards(tmp_path, shards=2, records=30)
    await check_resume(lambda: JsonLines(paths, chunk_size=64).shuffle(5, seed=1), [0, 31, 59])


# --------------------------------------------------------------------------- bad states


async def test_bad_states_name_the_field_and_apply_nothing(tmp_path: Path, anyio_backend: str
                                                          ) -> None:
    paths = write_shards(tmp_path)
    _, state = await interrupted(lambda: JsonLines(paths, chunk_size=64).shuffle(4, seed=1),
                                 50)
    cases: list[tuple[Any, str]] = [
        ({**state, "version": 2}, "version"),
        ({**state, "format": "x"}, "format"),
        ({**state, "stream": "Other"}, "stream"),
        ({**state, "worker": [1, 2]}, "worker"),
        ({**state, "epoch": "0"}, "epoch"),
        ({**state, "position": {**state["position"], "seed": 2}}, "seed"),
        ({**state, "position": {**state["position"], "buffer_size": 5}}, "buffer_size"),
        ({**state, "position": {**state["position"], "stage": "map"}}, "stage"),
        ({**state, "position": {**state["position"], "rng": {"x": 1}}}, "rng"),
        ({**state, "position": {**state["position"], "skip": -1}}, "skip"),
        ({**state, "position": {**state["position"], "upstream": {
            **state["position"]["upstream"], "name": "/elsewhere.jsonl"}}}, "name"),
        ({**state, "position": {**state["position"], "upstream": {
            **state["position"]["upstream"], "shard": 9}}}, "shard"),
        ({**state, "position": {**state["position"], "upstream": {
            **state["position"]["upstream"], "offset": True}}}, "offset"),
    ]
    for bad, field in cases:
        fresh = JsonLines(paths, chunk_size=64).shuffle(4, seed=1)
        with pytest.raises(ValueError, match=repr(field)):
            fresh.load_state_dict(bad)
        # Nothing applied: the stream starts at epoch 0 from the start.
        assert fresh.epoch == 0
        assert [x async for x in fresh] == [x async for x in
                                            JsonLines(paths, chunk_size=64).shuffle(4, seed=1)]
    with pytest.raises(ValueError, match="'stream'"):
        JsonLines(paths).load_state_dict(state)  # a shuffle's state for a bare source
    with pytest.raises(TypeError):
        JsonLines(paths).load_state_dict([])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- HTTP


async def test_http_resume_asks_for_a_byte_range(anyio_backend: str) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from faulty_server import FaultyServer, make_jsonl_shards

    server = FaultyServer(make_jsonl_shards(3, 200)).start()
    try:
        def make() -> Stream[Any]:
            return JsonLines(server.urls, chunk_size=256, concurrency=1)

        full = [r async for r in make()]
        rest, state = await interrupted(make, 250)  # record 50 of shard 1
        assert rest == full[250:]
        position = state["position"]
        assert position["shard"] == 1 and position["offset"] > 0
        name = server.urls[1].rsplit("/", 1)[1]
        last = [r for n, r in server.requests if n == name][-1]
        # The resumed read of shard 1 asked for its rest only, not for byte 0 on.
        assert last == f"bytes={position['offset']}-"
        later = [n for n, r in server.requests[-3:]]
        assert later[-1] == server.urls[2].rsplit("/", 1)[1]
    finally:
        server.close()


# --------------------------------------------------------------------------- the loader
#
# Through DataLoader.state_dict / load_state_dict; the assertions read the "iterable" entry.


from aloader import DataLoader, IterableDataset  # noqa: E402


def as_list(samples: list[Any]) -> list[Any]:
    return list(samples)


def loader_state(loader: DataLoader[Any]) -> dict[str, Any]:
    """The loader's state after a JSON round trip."""
    return roundtrip(loader.state_dict())


async def loader_rest(make: Callable[[], DataLoader[Any]], k: int, *,
                      epochs_before: int = 0) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """(the uninterrupted epoch, the rest after k batches read by a resumed loader, the
    iterable state)."""
    whole = make()
    for _ in range(epochs_before):
        _ = [b async for b in whole]
    full = [b async for b in whole]
    loader = make()
    for _ in range(epochs_before):
        _ = [b async for b in loader]
    iterator = loader.__aiter__()
    for _ in range(k):
        await iterator.__anext__()
    whole_state = loader_state(loader)
    await iterator.aclose()
    fresh = make()
    fresh.load_state_dict(whole_state)
    rest = [b async for b in fresh]
    state = whole_state["iterable"]
    await loader.aclose()
    await fresh.aclose()
    await whole.aclose()
    return full, rest, state


async def test_loader_over_a_stream_in_process(tmp_path: Path, anyio_backend: str) -> None:
    paths = write_shards(tmp_path, shards=3, records=40)

    def make() -> DataLoader[Any]:
        stream = JsonLines(paths, chunk_size=64, shuffle_shards=True, seed=2).shuffle(9, seed=3)
        return DataLoader(stream, batch_size=7, collate_fn=as_list, prefetch_factor=4)

    for k in (0, 1, 8, 17, 18):  # 120 samples: 18 batches, the last one of 1
        full, rest, state = await loader_rest(make, k)
        assert rest == full[k:], k
        # Before the first batch is asked for, no epoch has begun: the state is between epochs.
        assert state["mode"] == ("local" if k else "between") and len(json.dumps(state)) < 1500
    full, rest, _ = await loader_rest(make, 5, epochs_before=1)
    assert rest == full[5:]


def test_loader_plain_for(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, shards=2, records=30)

    def make() -> DataLoader[Any]:
        return DataLoader(JsonLines(paths, chunk_size=64).map(lambda r: r["r"]).shuffle(
            5, seed=0), batch_size=4)

    full = [b.tolist() for b in make()]
    for k in (3, 7, 12, 15):
        loader = make()
        iterator = iter(loader)
        for _ in range(k):
            next(iterator)
        pump = iterator._open()._pump
        for _ in range(300):  # until the pump is ahead of the consumer, as it gets
            if pump.out.qsize() >= pump.AHEAD:
                break
            time.sleep(0.001)
        state = loader_state(loader)
        iterator.close()
        fresh = make()
        fresh.load_state_dict(state)
        assert [b.tolist() for b in fresh] == full[k:], k
        loader.close()
        fresh.close()


async def test_loader_between_epochs(tmp_path: Path, anyio_backend: str) -> None:
    paths = write_shards(tmp_path, shards=3, records=10)

    def make() -> DataLoader[Any]:
        return DataLoader(JsonLines(paths, shuffle_shards=True, seed=1), batch_size=4,
                          collate_fn=as_list)

    loader = make()
    _ = [b async for b in loader]
    whole_state = loader_state(loader)
    state = whole_state["iterable"]
    assert state["mode"] == "between" and state["stream"]["next_epoch"] == 1
    second = [b async for b in loader]
    fresh = make()
    fresh.load_state_dict(whole_state)
    assert [b async for b in fresh] == second


class Counting(IterableDataset[int]):
    """No protocol: resumed by counting."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))


class Stateful(IterableDataset[int]):
    """torchdata's protocol on the dataset: asked after every batch."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.next = 0
        self.asked = 0

    def __iter__(self) -> Any:
        while self.next < self.n:
            self.next += 1
            yield self.next - 1
        self.next = 0

    def state_dict(self) -> dict[str, Any]:
        self.asked += 1
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state["next"]


async def test_iterable_datasets_with_and_without_the_protocol(anyio_backend: str) -> None:
    for make_dataset, kind in ((lambda: Counting(50), "count"), (lambda: Stateful(50),
                                                                   "protocol")):
        def make(make_dataset: Any = make_dataset) -> DataLoader[Any]:
            return DataLoader(make_dataset(), batch_size=6, collate_fn=as_list)

        for k in (0, 3, 8, 9):
            full, rest, state = await loader_rest(make, k)
            assert rest == full[k:], (kind, k)
            assert k == 0 or state["replicas"][0]["kind"] == kind


# --------------------------------------------------------------------------- workers


def test_loader_with_two_workers(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, shards=4, records=25)

    def make(persistent: bool = False) -> DataLoader[Any]:
        stream = JsonLines(paths, chunk_size=64, shuffle_shards=True, seed=4).shuffle(6, seed=1)
        return DataLoader(stream, batch_size=5, num_workers=2, collate_fn=as_list,
                          persistent_workers=persistent)

    async def run() -> None:
        for k, persistent in ((0, False), (7, True), (19, False)):
            full, rest, state = await loader_rest(lambda p=persistent: make(p), k)
            assert rest == full[k:], k
            assert state["mode"] == ("workers" if k else "between")
        # Another number of workers during an epoch resumes too (test_resume_elastic.py).
        full, _, state = await loader_rest(make, 3)
        other = DataLoader(
            JsonLines(paths, chunk_size=64, shuffle_shards=True, seed=4).shuffle(6, seed=1),
            batch_size=5, num_workers=0, collate_fn=as_list)
        other._kind.load_state_dict(state)  # type: ignore[union-attr]
        assert [b async for b in other] == full[3:]

    anyio.run(run)


async def test_an_iterated_stream_still_pickles(tmp_path: Path, anyio_backend: str) -> None:
    paths = write_shards(tmp_path, shards=1, records=5)
    stream = JsonLines(paths).shuffle(2, seed=0)
    iterator = stream.__aiter__()
    await iterator.__anext__()
    copy = pickle.loads(pickle.dumps(stream))  # as the loader sends it to its workers
    again = JsonLines(paths).shuffle(2, seed=0)
    again.set_epoch(1)  # the copy's next epoch: epoch 0 was claimed
    assert [x async for x in copy] == [x async for x in again]
    await iterator.aclose()  # type: ignore[attr-defined]


async def test_bad_loader_states(tmp_path: Path, anyio_backend: str) -> None:
    paths = write_shards(tmp_path, shards=2, records=10)

    def make() -> DataLoader[Any]:
        return DataLoader(JsonLines(paths), batch_size=3, collate_fn=as_list)

    _, _, state = await loader_rest(make, 2)
    cases: list[tuple[Any, str]] = [
        ({**state, "mode": "other"}, "mode"),
        ({**state, "num_workers": 2}, "num_workers"),
        ({**state, "replicas": [{**state["replicas"][0], "kind": "count"}]}, "kind"),
        ({**state, "stream": None}, "stream"),
        ({**state, "replicas": [{**state["replicas"][0], "state": {
            **state["replicas"][0]["state"], "version": 7}}]}, "version"),
    ]
    for bad, field in cases:
        loader = make()
        with pytest.raises(ValueError, match=repr(field)):
            loader._kind.load_state_dict(bad)  # type: ignore[union-attr]
        assert [b async for b in loader] == [b async for b in make()]  # nothing applied
    counting = DataLoader(Counting(10), batch_size=3, collate_fn=as_list)
    with pytest.raises(ValueError, match="'stream'"):  # a stream's state for another dataset
        counting._kind.load_state_dict(state)  # type: ignore[union-attr]


async def test_binary_npy_and_tar_shards(tmp_path: Path, anyio_backend: str) -> None:
    import io
    import struct
    import tarfile

    import numpy as np

    from aloader import BinaryRecords, NpyRows, TarShards

    binaries, arrays, tars = [], [], []
    for s in range(2):
        path = tmp_path / f"b{s}.bin"
        path.write_bytes(b"".join(struct.pack("<I", r % 5) + bytes([s]) * (r % 5)
                                  for r in range(30)))
        binaries.append(str(path))
        npy = tmp_path / f"a{s}.npy"
        np.save(npy, np.arange(60, dtype=np.int32).reshape(30, 2) + 100 * s)
        arrays.append(str(npy))
        tar = tmp_path / f"t{s}.tar"
        with tarfile.open(tar, "w") as archive:
            for r in range(12):
                for ext, data in (("txt", f"{s}-{r}".encode()), ("bin", bytes([r]))):
                    info = tarfile.TarInfo(f"sample{r:03d}.{ext}")
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
        tars.append(str(tar))
    await check_resume(lambda: BinaryRecords(binaries, chunk_size=16), [0, 7, 30, 45, 60])
    _, state = await interrupted(lambda: BinaryRecords(binaries, chunk_size=16), 37)
    assert state["position"]["offset"] > 0  # read from the record, not from byte 0

    def rows() -> Stream[Any]:
        return NpyRows(arrays, chunk_size=40).map(lambda row: row.tolist())

    await check_resume(rows, [0, 11, 30, 59])

    def samples() -> Stream[Any]:
        return TarShards(tars, chunk_size=700).map(lambda x: (x["__key__"], x["txt"]))

    await check_resume(samples, [0, 5, 12, 19, 24])


async def test_object_store_resume_asks_for_a_byte_range(anyio_backend: str) -> None:
    from aloader._demo import make_jsonl_shards

    shards = make_jsonl_shards(2, 100)
    with local_s3("resume", {f"d/{name}": body for name, body in shards.items()}) as server:
        urls = [f"s3://resume/d/{name}" for name in sorted(shards)]

        def make() -> Stream[Any]:
            return JsonLines(urls, store=server.store("resume"), chunk_size=300, concurrency=1)

        full = [r async for r in make()]
        stream = make()
        iterator = stream.__aiter__()
        for _ in range(130):
            await iterator.__anext__()
        state = roundtrip(stream.state_dict())
        await iterator.aclose()  # type: ignore[attr-defined]
        server.proxy.reset()
        fresh = make()
        fresh.load_state_dict(state)
        assert [r async for r in fresh] == full[130:]
        offset = state["position"]["offset"]
        gets = [(path, range_) for method, path, range_ in server.proxy.requests
                if method == "GET" and path.endswith(sorted(shards)[1])]
        assert offset > 0 and gets and all(r == f"bytes={offset}-" for _, r in gets)


_UNSEEDED_CHILD = r"""
import json, sys
from aloader import DataLoader, TextLines
paths, state, workers = json.loads(sys.stdin.read())
loader = DataLoader(TextLines(paths).shuffle(16), batch_size=5, collate_fn=list,
                    num_workers=workers, generator=0)
loader.load_state_dict(state)
print(json.dumps([list(loader), list(loader)]))
"""


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [7, None])
def test_an_unseeded_shuffle_resumes_in_a_new_process(tmp_path: Path, workers: int,
                                                      k: int | None) -> None:
    """``shuffle(n)`` without a seed draws one when built: its states record it (as a
    loader records its generator), and a new process, whose shuffle drew another, adopts it
    (it refused the state: field 'seed' differs). Mid-epoch and between epochs."""
    paths = []
    for s in range(3):
        path = tmp_path / f"p{s}.txt"
        path.write_text("".join(f"{s}-{i}\n" for i in range(50)))
        paths.append(str(path))
    # The loader seeded (its generator=None state is torch's once a test imported torch,
    # which the new process has not): the shuffle is the one without a seed.
    loader = DataLoader(TextLines(paths).shuffle(16), batch_size=5, collate_fn=list,
                        num_workers=workers, generator=0)
    it = iter(loader)
    head = [next(it) for _ in range(k)] if k is not None else list(it)
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [list(it) if k is not None else list(loader), list(loader)]
    loader.close()
    assert head and state["iterable"]["stream"]["seeds"]
    done = subprocess.run([sys.executable, "-c", _UNSEEDED_CHILD],
                          input=json.dumps([paths, state, workers]), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == expected


def test_a_tampered_list_of_seeds_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("".join(f"{i}\n" for i in range(30)))
    stream = TextLines([str(path)]).shuffle(8)
    state = stream.state_dict()
    for seeds in ([], [1, 2], ["1"], [-1], 3):
        with pytest.raises(ValueError, match="'seeds'"):
            TextLines([str(path)]).shuffle(8).load_state_dict({**state, "seeds": seeds})
    seeded = TextLines([str(path)]).shuffle(8, seed=1).state_dict()
    assert "seeds" not in seeded  # a seeded shuffle's state is as it was
