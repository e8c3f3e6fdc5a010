"""Attacks on mix and interleave: local-file inputs (loopless streams inside a stage that is
not), an empty input, resume at every item, and ``interleave`` given a list of streams (the
way ``mix`` takes them), which must not hand on the streams themselves as items."""

from __future__ import annotations

import collections
import itertools
import json
from pathlib import Path

import pytest

from aloader import Stream, TextLines, interleave, mix

pytestmark = pytest.mark.hostile


@pytest.fixture
def inputs(tmp_path: Path) -> list[str]:
    paths = []
    for name, n in (("a", 30), ("b", 7), ("c", 0)):
        path = tmp_path / f"{name}.txt"
        path.write_text("".join(f"{name}{i}\n" for i in range(n)))
        paths.append(str(path))
    return paths


def sources(paths: list[str]) -> list[TextLines]:
    return [TextLines(path, chunk_size=8) for path in paths]


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_mix_of_local_files_resumes_at_every_item(inputs: list[str], stop: str) -> None:
    def make() -> Stream[str]:
        return mix(sources(inputs), weights=[0.5, 0.3, 0.2], seed=4, stop=stop)  # type: ignore[arg-type]

    reference = make()
    epochs = [list(reference) for _ in range(2)]
    if stop == "all_exhausted":
        assert sorted(epochs[1]) == sorted([f"a{i}" for i in range(30)]
                                           + [f"b{i}" for i in range(7)])
    else:
        assert epochs[1] == []  # the empty input is exhausted at once
    n = len(epochs[1])
    for k in sorted(k for k in {0, 1, 5, n // 2, n - 1, n} if 0 <= k <= n):
        source = make()
        list(source)
        iterator = iter(source)
        head = [next(iterator) for _ in range(k)]
        state = json.loads(json.dumps(source.state_dict()))
        iterator.close()  # type: ignore[attr-defined]
        fresh = make()
        fresh.load_state_dict(state)
        assert head + list(fresh) == epochs[1], k


def test_interleave_round_robin_of_local_files(inputs: list[str]) -> None:
    got = list(interleave(*sources(inputs)))
    assert got[:6] == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert sorted(got) == sorted([f"a{i}" for i in range(30)] + [f"b{i}" for i in range(7)])


@pytest.mark.parametrize("weights", [None, [1.0, 1.0, 1.0]])
def test_interleave_of_a_list_of_streams_is_refused(inputs: list[str],
                                                    weights: list[float] | None) -> None:
    # interleave takes the streams as arguments; a list of them would be one input whose
    # items are the streams themselves.
    with pytest.raises(TypeError, match="separate arguments"):
        interleave(sources(inputs), weights=weights)
    with pytest.raises(TypeError, match="separate arguments"):
        interleave(tuple(sources(inputs)))
    assert list(interleave([1, 2], [3, 4])) == [1, 3, 2, 4]  # lists of items stay inputs


@pytest.mark.parametrize("weights", [[1e308, 1e308], [5e-324, 5e-324], [1e308, 0.0, 1e308],
                                     [1.7e308, 1.7e308, 1.7e308]], ids=repr)
def test_weights_at_the_ends_of_the_floats_keep_their_shares(weights: list[float]) -> None:
    """Equal weights whose sum overflows (every pick went to the last source) or is
    subnormal (a 1:3 split) give every source of positive weight its equal share."""
    sources = [[index] * 4000 for index in range(len(weights))]
    picks = collections.Counter(itertools.islice(mix(sources, weights, seed=0), 4000))
    live = [index for index, weight in enumerate(weights) if weight > 0]
    assert sorted(picks) == live
    share = 4000 / len(live)
    assert all(abs(picks[index] - share) < 0.1 * share for index in live), picks
