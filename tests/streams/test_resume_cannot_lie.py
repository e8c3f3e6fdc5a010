"""Checkpoints that cannot lie: a stream's state names the shard it points into by identity
(a file's size and modification time, a remote object's size and ETag), and every number of a
state is checked against the data. A changed shard, a tampered or truncated state, or a state
of another stream is a ValueError naming the field (and the shard), never records read at the
wrong place, never a shorter epoch."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aloader import DataLoader, JsonLines, TextLines, as_stream

pytestmark = [pytest.mark.hostile,
              pytest.mark.filterwarnings("ignore:This DataLoader will create")]

RECORDS = 100


def write_shards(root: Path, shards: int = 3) -> list[str]:
    paths = []
    for s in range(shards):
        path = root / f"part-{s}.jsonl"
        path.write_text("".join(json.dumps({"s": s, "r": r}) + "\n" for r in range(RECORDS)))
        paths.append(str(path))
    return paths


def loader_of(paths: list[str], workers: int = 0) -> DataLoader[Any]:
    return DataLoader(JsonLines(paths), batch_size=10, collate_fn=list, num_workers=workers)


def state_after(make: Callable[[], DataLoader[Any]], batches: int) -> dict[str, Any]:
    loader = make()
    it = iter(loader)
    for _ in range(batches):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    it.close()
    loader.close()
    return state


def position_of(state: dict[str, Any]) -> dict[str, Any]:
    replicas = [r for r in state["iterable"]["replicas"] if r is not None]
    return dict(replicas[0]["state"]["position"])


def resumed(make: Callable[[], DataLoader[Any]], state: dict[str, Any]) -> list[Any]:
    loader = make()
    try:
        loader.load_state_dict(state)
        return [record for batch in loader for record in batch]
    finally:
        loader.close()


def test_the_position_names_its_shard_by_identity(tmp_path: Path) -> None:
    paths = write_shards(tmp_path)
    position = position_of(state_after(lambda: loader_of(paths), 15))
    info = os.stat(paths[1])
    assert position["shard"] == 1
    assert position["identity"] == {"size": info.st_size, "mtime_ns": info.st_mtime_ns}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_rewritten_shorter_is_an_error_naming_it(tmp_path: Path, workers: int) -> None:
    """The resumed epoch skipped 30 records of the next, untouched shard (the position's
    records to skip ran past the shortened shard's end), without an error."""
    paths = write_shards(tmp_path)
    state = state_after(lambda: loader_of(paths, workers), 15)
    Path(paths[1]).write_text("".join(json.dumps({"s": 1, "r": r}) + "\n" for r in range(20)))
    with pytest.raises(ValueError, match=r"'identity'.*part-1\.jsonl.*changed"):
        resumed(lambda: loader_of(paths, workers), state)


def test_a_shard_rewritten_with_the_same_size_is_an_error(tmp_path: Path) -> None:
    paths = write_shards(tmp_path)
    state = state_after(lambda: loader_of(paths), 15)
    data = Path(paths[1]).read_bytes()
    Path(paths[1]).write_bytes(data.replace(b'"r": 1', b'"r": 9'))  # same length
    info = os.stat(paths[1])
    os.utime(paths[1], ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match=r"'identity'.*part-1\.jsonl"):
        resumed(lambda: loader_of(paths), state)


def test_another_shard_changing_does_not_matter(tmp_path: Path) -> None:
    """Only the shard the position points into must be as it was: the shards after it are
    read from their start, as they are now."""
    paths = write_shards(tmp_path)
    full = resumed(lambda: loader_of(paths), state_after(lambda: loader_of(paths), 0))
    state = state_after(lambda: loader_of(paths), 15)
    rest = resumed(lambda: loader_of(paths), state)
    assert rest == full[150:]
    Path(paths[2]).write_text(json.dumps({"s": 2, "r": 0}) + "\n")
    assert resumed(lambda: loader_of(paths), state) == [*full[150:200], {"s": 2, "r": 0}]


def test_a_remote_shard_replaced_is_an_error_naming_it(
        serve: Callable[..., Any]) -> None:
    """Its ETag says it changed: the resumed read of a ranged GET would have spliced the new
    version's bytes at the old version's offset."""
    files = {f"part-{s}.jsonl": "".join(json.dumps({"s": s, "r": r}) + "\n"
                                        for r in range(RECORDS)).encode() for s in range(2)}
    server = serve(files)
    urls = server.urls

    def make() -> DataLoader[Any]:
        return DataLoader(JsonLines(urls, chunk_size=256), batch_size=10, collate_fn=list)

    full = resumed(make, state_after(make, 0))
    state = state_after(make, 5)
    identity = position_of(state)["identity"]
    assert identity["size"] == len(files["part-0.jsonl"]) and identity["version"]
    assert resumed(make, state) == full[50:]
    server.files["part-0.jsonl"] = files["part-0.jsonl"].replace(b'"r": 6', b'"r": 7')
    with pytest.raises(ValueError, match=r"'identity'.*part-0\.jsonl.*changed"):
        resumed(make, state)


# Tampered states -------------------------------------------------------------------------
def _set(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda position: position.update(fields)


def _drop(*names: str) -> Callable[[dict[str, Any]], None]:
    def drop(position: dict[str, Any]) -> None:
        for name in names:
            position.pop(name)
    return drop


TAMPERED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "skip past the shard": (_set(skip=10**7), "'skip'"),
    "skip past the shard, no identity": (lambda p: (p.update(skip=10**7),
                                                    p.pop("identity")), "'skip'"),
    "offset past the end": (_set(offset=10**6), "'offset'"),
    "offset past the end, no identity": (lambda p: (p.update(offset=10**6),
                                                    p.pop("identity")), "'skip'"),
    "negative skip": (_set(skip=-1), "'skip'"),
    "skip of the wrong type": (_set(skip="3"), "'skip'"),
    "records before the offset": (_set(offset=100, records=10**7), "'records'"),
    "line counter before the offset": (_set(offset=100, counter=10**7), "'counter'"),
    "shard number": (_set(shard=7), "'shard'"),
    "shard name": (_set(name="/elsewhere/part-1.jsonl"), "'name'"),
    "identity of another kind": (_set(identity={"size": 10, "version": "x"}), "'identity'"),
    "identity of the wrong type": (_set(identity={"size": "x"}), "'identity'"),
    "truncated position": (_drop("offset", "counter"), "'offset'"),
    "no stage": (_drop("stage"), "'stage'"),
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_tampered_position_is_a_value_error_naming_the_field(
        tmp_path: Path, case: str, workers: int) -> None:
    paths = write_shards(tmp_path)
    state = state_after(lambda: loader_of(paths, workers), 15)
    tamper, field = TAMPERED[case]
    bad = copy.deepcopy(state)
    replicas = [r for r in bad["iterable"]["replicas"] if r is not None]
    tamper(replicas[0]["state"]["position"])
    with pytest.raises(ValueError, match=field):
        resumed(lambda: loader_of(paths, workers), bad)


def test_a_state_of_another_stream_is_refused(tmp_path: Path) -> None:
    paths = write_shards(tmp_path)
    state = state_after(lambda: loader_of(paths), 15)

    def other() -> DataLoader[Any]:
        return DataLoader(TextLines(paths), batch_size=10, collate_fn=list)

    with pytest.raises(ValueError, match="cannot load this"):
        resumed(other, state)
    fewer = paths[:2][::-1]
    with pytest.raises(ValueError, match="'name'"):
        resumed(lambda: loader_of(fewer), state)


def test_a_counted_position_past_the_end_is_an_error() -> None:
    """A stage resumed by counting (its epoch replayed, the items delivered discarded): a
    count past its end gave an empty epoch."""
    def make() -> DataLoader[Any]:
        return DataLoader(as_stream(list(range(50))).map(lambda x: x * 2), batch_size=5,
                          collate_fn=list)

    state = state_after(make, 3)
    assert resumed(make, state) == [x * 2 for x in range(15, 50)]
    bad = copy.deepcopy(state)
    text = json.dumps(bad)
    assert '"skip": 15' in text
    bad = json.loads(text.replace('"skip": 15', '"skip": 15000'))
    with pytest.raises(ValueError, match="'skip'.*past the end"):
        resumed(make, bad)


MAP_TAMPERED: dict[str, Callable[[dict[str, Any]], None]] = {
    "yielded past the epoch": lambda s: (s.update(yielded=10**9),
                                         s["map"].update(prefix=10**9)),
    "one past the epoch": lambda s: (s.update(yielded=6), s["map"].update(prefix=6)),
    "a batch past the epoch": lambda s: (s.update(yielded=2), s["map"].update(delivered=[9])),
    "yielded disagrees": lambda s: s.update(yielded=3),
    "no loader part": lambda s: s.pop("loader"),
    "no epoch": lambda s: s.pop("epoch"),
    "epoch of the wrong type": lambda s: s.update(epoch="1"),
    "prefix of the wrong type": lambda s: s["map"].update(prefix=1.5),
    "map part of the wrong type": lambda s: s.update(map=[]),
    "a dataset state for a dataset without one": lambda s: s["map"].update(
        datasets={"num_workers": 0, "states": [{}], "drawn": True}),
    "datasets of the wrong shape": lambda s: s["map"].update(
        datasets={"num_workers": 2, "states": [None], "drawn": False}),
}


@pytest.mark.parametrize("case", sorted(MAP_TAMPERED))
def test_a_tampered_map_state_is_a_value_error(case: str) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(list(range(20)), batch_size=4, collate_fn=list)

    state = state_after(make, 1)
    bad = copy.deepcopy(state)
    MAP_TAMPERED[case](bad)
    loader = make()
    with pytest.raises(ValueError):
        loader.load_state_dict(bad)
    assert [len(b) for b in loader] == [4] * 5  # nothing of it was applied


def test_the_state_after_the_last_batch_is_no_tamper() -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(list(range(20)), batch_size=4, collate_fn=list)

    assert resumed(make, state_after(make, 5)) == []
