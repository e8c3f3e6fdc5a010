"""Samplers: lengths, orders, coverage, reproducibility, errors and the array fast path."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aloader import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from aloader import Dataset as aloader_Dataset
from aloader.data._batchsampler import epoch_batches
from aloader.data._indices import _CHUNK, epoch_indices
from aloader.data._random import permutation

SETTINGS = settings(max_examples=60, deadline=None)


def _raises_same(ours: Any, theirs: Any) -> str:
    """Call both, assert they raise the same exception type and message; return the message."""
    with pytest.raises(Exception) as ours_info:
        ours()
    with pytest.raises(Exception) as theirs_info:
        theirs()
    assert type(ours_info.value) is type(theirs_info.value)
    assert str(ours_info.value) == str(theirs_info.value)
    return str(ours_info.value)


def _torch_batches(sampler: Any, batch_size: int, drop_last: bool) -> list[list[int]]:
    """torch's BatchSampler algorithm, written out (to test without torch)."""
    it = iter(sampler)
    out = []
    while batch := list(itertools.islice(it, batch_size)):
        if len(batch) < batch_size and drop_last:
            break
        out.append(batch)
    return out


# ---------------------------------------------------------------------------------------- Sampler


class _Evens(Sampler[int]):
    def __init__(self, n: int) -> None:
        super().__init__(None)
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(0, self.n, 2))


def test_sampler_base_iter_is_abstract_and_has_no_len() -> None:
    sampler: Sampler[int] = Sampler()
    with pytest.raises(NotImplementedError):
        iter(sampler)
    with pytest.raises(TypeError):
        len(sampler)  # type: ignore[arg-type]


def test_sampler_base_accepts_and_ignores_data_source() -> None:
    sampler: Sampler[int] = Sampler([1, 2, 3])
    assert not hasattr(sampler, "data_source")


def test_custom_sampler_subclass_has_no_array_form() -> None:
    sampler = _Evens(7)
    assert list(sampler) == [0, 2, 4, 6]
    assert epoch_indices(sampler) is None
    assert list(BatchSampler(sampler, 3, False)) == [[0, 2, 4], [6]]


# ------------------------------------------------------------------------------ SequentialSampler


@pytest.mark.parametrize("n", [0, 1, 7, _CHUNK + 3])
def test_sequential_sampler(n: int) -> None:
    sampler = SequentialSampler(range(n))
    assert len(sampler) == n
    assert list(sampler) == list(range(n))
    assert sampler._epoch_indices().dtype == np.int64
    assert sampler._epoch_indices().tolist() == list(range(n))
    assert all(type(i) is int for i in itertools.islice(sampler, 5))


def test_sequential_sampler_follows_a_growing_dataset() -> None:
    data = [0, 0]
    sampler = SequentialSampler(data)
    assert list(sampler) == [0, 1]
    data.append(0)
    assert len(sampler) == 3
    assert list(sampler) == [0, 1, 2]


@pytest.mark.parametrize("n", [0, 1, 5, 100])
def test_sequential_sampler_matches_torch(n: int) -> None:
    torch = pytest.importorskip("torch")
    theirs = torch.utils.data.SequentialSampler(range(n))
    ours = SequentialSampler(range(n))
    assert list(ours) == list(theirs)
    assert len(ours) == len(theirs)


# ---------------------------------------------------------------------------------- RandomSampler


def test_random_sampler_without_replacement_is_a_permutation() -> None:
    sampler = RandomSampler(range(100), generator=0)
    assert len(sampler) == 100
    epoch = list(sampler)
    assert sorted(epoch) == list(range(100))
    assert all(type(i) is int for i in epoch)


@SETTINGS
@given(
    n=st.integers(1, 40),
    num_samples=st.none() | st.integers(1, 150),
    seed=st.integers(0, 2**32),
)
def test_random_sampler_without_replacement_follows_torchs_rule(
    n: int, num_samples: int | None, seed: int
) -> None:
    sampler = RandomSampler(range(n), num_samples=num_samples, generator=seed)
    k = n if num_samples is None else num_samples
    epoch = list(sampler)
    assert len(epoch) == len(sampler) == k
    full, rest = divmod(k, n)
    # num_samples // n whole permutations, then a prefix of one more.
    for block in range(full):
        assert sorted(epoch[block * n : (block + 1) * n]) == list(range(n))
    tail = epoch[full * n :]
    assert len(tail) == rest
    assert len(set(tail)) == rest
    assert set(tail) <= set(range(n))
    counts = Counter(epoch)
    assert sum(1 for c in counts.values() if c == full + 1) == rest
    assert all(counts[i] in (full, full + 1) for i in range(n) if full)


@SETTINGS
@given(n=st.integers(1, 40), num_samples=st.integers(1, 150), seed=st.integers(0, 2**32))
def test_random_sampler_with_replacement(n: int, num_samples: int, seed: int) -> None:
    sampler = RandomSampler(range(n), replacement=True, num_samples=num_samples, generator=seed)
    epoch = list(sampler)
    assert len(epoch) == len(sampler) == num_samples
    assert all(0 <= i < n for i in epoch)


def test_random_sampler_with_replacement_repeats() -> None:
    # torch's test: n + 1 draws from n items must repeat one.
    sampler = RandomSampler(range(10), replacement=True, num_samples=11, generator=0)
    counts = Counter(sampler)
    assert sum(counts.values()) == 11
    assert any(c > 1 for c in counts.values())


def test_random_sampler_same_seed_same_epochs_and_epochs_differ() -> None:
    a = RandomSampler(range(100), generator=7)
    b = RandomSampler(range(100), generator=7)
    epochs_a = [list(a) for _ in range(3)]
    epochs_b = [list(b) for _ in range(3)]
    assert epochs_a == epochs_b
    assert epochs_a[0] != epochs_a[1] != epochs_a[2]
    assert list(RandomSampler(range(100), generator=8)) != epochs_a[0]


def test_random_sampler_int_seed_equals_default_rng() -> None:
    a = RandomSampler(range(50), generator=3)
    b = RandomSampler(range(50), generator=np.random.default_rng(3))
    assert list(a) == list(b)
    assert isinstance(a.generator, np.random.Generator)


def test_random_sampler_shared_generator_advances() -> None:
    g = np.random.default_rng(0)
    a = RandomSampler(range(50), generator=g)
    assert a.generator is g
    b = RandomSampler(range(50), generator=g)
    first = list(a)
    second = list(b)  # draws after a's epoch, from the same stream
    assert first != second
    replay = np.random.default_rng(0)
    assert first == permutation(replay, 50).tolist()
    assert second == permutation(replay, 50).tolist()


def test_random_sampler_without_generator_draws_fresh_entropy() -> None:
    a = RandomSampler(range(1000))
    b = RandomSampler(range(1000))
    assert a.generator is None  # as torch's: each epoch is seeded from fresh entropy
    assert list(a) != list(b)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_samples": 3},
        {"num_samples": 25},
        {"num_samples": 100_000 + 3},
        {"replacement": True, "num_samples": 100_000 + 3},
        {"replacement": True},
    ],
)
def test_random_sampler_iter_equals_epoch_indices(kwargs: dict[str, Any]) -> None:
    n = 10 if kwargs.get("num_samples", 0) < 1000 else 70_000
    a = RandomSampler(range(n), generator=1, **kwargs)
    b = RandomSampler(range(n), generator=1, **kwargs)
    for _ in range(3):
        arr = b._epoch_indices()
        assert arr.dtype == np.int64 and arr.ndim == 1
        assert list(a) == arr.tolist()
    assert epoch_indices(a).tolist() == epoch_indices(b).tolist()  # type: ignore[union-attr]


def test_random_sampler_num_samples_follows_a_growing_dataset() -> None:
    data = [0] * 4
    sampler = RandomSampler(data, generator=0)
    data.extend([0] * 3)
    assert len(sampler) == sampler.num_samples == 7
    assert sorted(sampler) == list(range(7))


def test_random_sampler_argument_errors() -> None:
    with pytest.raises(
        TypeError, match=r"^replacement should be a boolean value, but got replacement=0$"
    ):
        RandomSampler(range(3), replacement=0)  # type: ignore[arg-type]
    for bad in (0, -1, 2.0, True, "3"):
        msg = f"num_samples should be a positive integer value, but got num_samples={bad}"
        with pytest.raises(ValueError) as info:
            RandomSampler(range(3), num_samples=bad)  # type: ignore[arg-type]
        assert str(info.value) == msg
    with pytest.raises(ValueError) as info:
        RandomSampler([])
    assert (
        str(info.value) == "num_samples should be a positive integer value, but got num_samples=0"
    )
    with pytest.raises(TypeError, match="generator"):
        RandomSampler(range(3), generator="x")  # type: ignore[arg-type]


def test_random_sampler_accepts_numpy_int_num_samples() -> None:
    sampler = RandomSampler(range(3), num_samples=np.int64(5), generator=0)
    assert len(sampler) == 5
    assert len(list(sampler)) == 5


@pytest.mark.parametrize("replacement", [False, True])
def test_random_sampler_empty_source_with_num_samples_errors_at_iteration(
    replacement: bool,
) -> None:
    sampler = RandomSampler([], replacement=replacement, num_samples=3, generator=0)
    assert len(sampler) == 3
    with pytest.raises(ValueError, match="empty data_source"):
        list(sampler)


def test_random_sampler_errors_match_torch() -> None:
    torch = pytest.importorskip("torch")
    theirs = torch.utils.data.RandomSampler
    for kwargs in (
        {"replacement": 0},
        {"replacement": None},
        {"num_samples": 0},
        {"num_samples": -1},
        {"num_samples": 2.0},
    ):
        _raises_same(
            lambda k=kwargs: RandomSampler(range(3), **k), lambda k=kwargs: theirs(range(3), **k)
        )
    _raises_same(lambda: RandomSampler([]), lambda: theirs([]))


@pytest.mark.parametrize("n", [1, 5, 20])
@pytest.mark.parametrize("num_samples", [None, 1, 7, 45])
@pytest.mark.parametrize("replacement", [False, True])
def test_random_sampler_lengths_match_torch(
    n: int, num_samples: int | None, replacement: bool
) -> None:
    torch = pytest.importorskip("torch")
    theirs = torch.utils.data.RandomSampler(range(n), replacement, num_samples)
    ours = RandomSampler(range(n), replacement, num_samples, generator=0)
    assert len(ours) == len(theirs) == len(list(theirs)) == len(list(ours))
    if not replacement:
        assert sorted(Counter(ours).values()) == sorted(Counter(theirs).values())


# ---------------------------------------------------------------------------- SubsetRandomSampler


@SETTINGS
@given(indices=st.lists(st.integers(-5, 1000), max_size=60), seed=st.integers(0, 2**32))
def test_subset_random_sampler_is_a_permutation_of_indices(indices: list[int], seed: int) -> None:
    sampler = SubsetRandomSampler(indices, generator=seed)
    epoch = list(sampler)
    assert len(sampler) == len(indices)
    assert Counter(epoch) == Counter(indices)
    assert all(type(i) is int for i in epoch)


def test_subset_random_sampler_iter_equals_epoch_indices_and_reproduces() -> None:
    indices = np.arange(0, 300, 3)
    a = SubsetRandomSampler(indices, generator=5)
    b = SubsetRandomSampler(indices, generator=5)
    epochs = [list(a) for _ in range(3)]
    for epoch in epochs:
        arr = b._epoch_indices()
        assert arr is not None and arr.dtype == np.int64
        assert epoch == arr.tolist()
    assert epochs[0] != epochs[1]
    assert list(SubsetRandomSampler(indices, generator=5)) == epochs[0]


def test_subset_random_sampler_over_range_and_non_int_indices() -> None:
    assert sorted(SubsetRandomSampler(range(2, 12), generator=0)) == list(range(2, 12))
    keys = ["a", "b", "c", "d"]
    sampler = SubsetRandomSampler(keys, generator=0)
    assert sampler._epoch_indices() is None
    assert epoch_indices(sampler) is None
    assert sorted(sampler) == keys
    # the same draws as for ints: only the values differ
    assert [keys.index(k) for k in SubsetRandomSampler(keys, generator=1)] == list(
        SubsetRandomSampler(range(4), generator=1)
    )


def test_subset_random_sampler_reads_indices_each_epoch() -> None:
    indices = [1, 2]
    sampler = SubsetRandomSampler(indices, generator=0)
    indices.append(3)
    assert sorted(sampler) == [1, 2, 3]


# -------------------------------------------------------------------------- WeightedRandomSampler

WEIGHTS = [0.1, 0.9, 0.4, 0.7, 3.0, 0.6]


@pytest.mark.parametrize("replacement", [True, False])
def test_weighted_sampler_basic(replacement: bool) -> None:
    sampler = WeightedRandomSampler(WEIGHTS, 5, replacement=replacement, generator=0)
    assert len(sampler) == 5
    epoch = list(sampler)
    assert len(epoch) == 5
    assert all(type(i) is int and 0 <= i < 6 for i in epoch)
    if not replacement:
        assert len(set(epoch)) == 5
    # float64 as a numpy array, or torch's double tensor where torch is imported
    assert str(sampler.weights.dtype) in ("float64", "torch.float64")
    assert sampler.num_samples == 5 and sampler.replacement is replacement


@SETTINGS
@given(
    weights=st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 10.0]), min_size=1, max_size=30),
    num_samples=st.integers(1, 40),
    seed=st.integers(0, 2**32),
)
def test_weighted_sampler_without_replacement_never_repeats(
    weights: list[float], num_samples: int, seed: int
) -> None:
    positive = sum(w > 0 for w in weights)
    if positive == 0 or num_samples > len(weights):
        return
    sampler = WeightedRandomSampler(weights, num_samples, replacement=False, generator=seed)
    epoch = list(sampler)
    assert len(epoch) == num_samples
    assert len(set(epoch)) == num_samples
    # Zero weights are only drawn once the positive ones have run out (as torch).
    drawn_weights = [weights[i] for i in epoch]
    assert all(w > 0 for w in drawn_weights[:positive])
    assert all(w == 0 for w in drawn_weights[positive:])


@SETTINGS
@given(
    weights=st.lists(st.sampled_from([0.0, 0.5, 1.0, 1e300]), min_size=1, max_size=30),
    num_samples=st.integers(1, 200),
    seed=st.integers(0, 2**32),
)
def test_weighted_sampler_with_replacement_never_draws_zero_weights(
    weights: list[float], num_samples: int, seed: int
) -> None:
    if not any(w > 0 for w in weights):
        return
    epoch = list(WeightedRandomSampler(weights, num_samples, generator=seed))
    assert len(epoch) == num_samples
    assert all(weights[i] > 0 for i in epoch)


def test_weighted_sampler_with_replacement_frequencies_follow_weights() -> None:
    epoch = list(WeightedRandomSampler([1.0, 3.0, 0.0, 4.0], 40_000, generator=0))
    counts = Counter(epoch)
    assert counts[2] == 0
    assert abs(counts[0] / 40_000 - 1 / 8) < 0.01
    assert abs(counts[1] / 40_000 - 3 / 8) < 0.01
    assert abs(counts[3] / 40_000 - 4 / 8) < 0.01


def test_weighted_sampler_without_replacement_is_successive_weighted_draws() -> None:
    # P(first = i) = w_i / sum(w); P(second = 0 | first = 2) = 1 / 2
    sampler = WeightedRandomSampler([1.0, 1.0, 2.0], 3, replacement=False, generator=0)
    epochs = [tuple(sampler) for _ in range(8000)]
    firsts = Counter(e[0] for e in epochs)
    assert abs(firsts[2] / 8000 - 0.5) < 0.03
    assert abs(firsts[0] / 8000 - 0.25) < 0.03
    after_2 = [e[1] for e in epochs if e[0] == 2]
    assert abs(after_2.count(0) / len(after_2) - 0.5) < 0.04


def test_weighted_sampler_huge_weights_do_not_overflow() -> None:
    assert set(WeightedRandomSampler([1e308, 1e308], 100, generator=0)) == {0, 1}


def test_weighted_sampler_reproducible_and_iter_equals_epoch_indices() -> None:
    for replacement in (True, False):
        a = WeightedRandomSampler(WEIGHTS, 5, replacement, generator=9)
        b = WeightedRandomSampler(WEIGHTS, 5, replacement, generator=9)
        epochs = [list(a) for _ in range(4)]
        assert epochs == [b._epoch_indices().tolist() for _ in range(4)]
        assert len({tuple(e) for e in epochs}) > 1


def test_weighted_sampler_construction_errors() -> None:
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError) as info:
            WeightedRandomSampler(WEIGHTS, bad)  # type: ignore[arg-type]
        assert str(info.value) == (
            f"num_samples should be a positive integer value, but got num_samples={bad}"
        )
    with pytest.raises(ValueError) as info:
        WeightedRandomSampler(WEIGHTS, 2, replacement=1)  # type: ignore[arg-type]
    assert str(info.value) == "replacement should be a boolean value, but got replacement=1"
    with pytest.raises(ValueError) as info:
        WeightedRandomSampler([[1.0, 2.0]], 2)
    assert str(info.value) == "weights should be a 1d sequence but given weights have shape (1, 2)"
    with pytest.raises(ValueError) as info:
        WeightedRandomSampler(5.0, 2)
    assert str(info.value) == "weights should be a 1d sequence but given weights have shape ()"


BAD_WEIGHTS: list[tuple[list[float], int, bool, str]] = [
    ([0.0, 0.0], 2, True, "invalid multinomial distribution (sum of probabilities <= 0)"),
    ([0.0, 0.0], 2, False, "invalid multinomial distribution (sum of probabilities <= 0)"),
    ([0.0, 0.0], 1, True, "invalid multinomial distribution (sum of probabilities <= 0)"),
    ([-1.0, 1.0], 2, True, "invalid multinomial distribution (encountering probability entry < 0)"),
    (
        [math.nan, 1.0],
        2,
        True,
        "invalid multinomial distribution (encountering probability entry < 0)",
    ),
    (
        [math.inf, 1.0],
        2,
        True,
        "invalid multinomial distribution (encountering probability entry = infinity or NaN)",
    ),
    ([-1.0, 1.0], 2, False, "probability tensor contains either `inf`, `nan` or element < 0"),
    ([-1.0, 1.0], 1, True, "probability tensor contains either `inf`, `nan` or element < 0"),
    ([math.nan, 1.0], 2, False, "probability tensor contains either `inf`, `nan` or element < 0"),
    ([math.inf, 1.0], 2, False, "probability tensor contains either `inf`, `nan` or element < 0"),
    ([math.inf, 1.0], 1, True, "probability tensor contains either `inf`, `nan` or element < 0"),
    (
        [1.0, 1.0],
        3,
        False,
        "cannot sample n_sample > prob_dist.size(-1) samples without replacement",
    ),
    ([], 1, False, "cannot sample n_sample > prob_dist.size(-1) samples without replacement"),
]


@pytest.mark.parametrize(("weights", "num_samples", "replacement", "message"), BAD_WEIGHTS)
def test_weighted_sampler_bad_weights_raise_at_iteration(
    weights: list[float], num_samples: int, replacement: bool, message: str
) -> None:
    sampler = WeightedRandomSampler(weights, num_samples, replacement, generator=0)
    with pytest.raises(RuntimeError) as info:
        list(sampler)
    assert str(info.value) == message


def test_weighted_sampler_empty_weights_with_replacement() -> None:
    with pytest.raises(RuntimeError, match="invalid multinomial distribution"):
        list(WeightedRandomSampler([], 1, generator=0))


@pytest.mark.parametrize(("weights", "num_samples", "replacement", "message"), BAD_WEIGHTS)
def test_weighted_sampler_bad_weights_match_torch(
    weights: list[float], num_samples: int, replacement: bool, message: str
) -> None:
    torch = pytest.importorskip("torch")
    theirs = torch.utils.data.WeightedRandomSampler
    got = _raises_same(
        lambda: list(WeightedRandomSampler(weights, num_samples, replacement, generator=0)),
        lambda: list(theirs(weights, num_samples, replacement)),
    )
    assert got == message


def test_weighted_sampler_construction_errors_match_torch() -> None:
    torch = pytest.importorskip("torch")
    theirs = torch.utils.data.WeightedRandomSampler
    for args in (
        (WEIGHTS, 0),
        (WEIGHTS, -2),
        (WEIGHTS, 2.0),
        (WEIGHTS, True),
        (WEIGHTS, 2, 1),
        ([[1.0, 2.0]], 2),
        (5.0, 2),
    ):
        _raises_same(
            lambda a=args: WeightedRandomSampler(*a),  # type: ignore[misc]
            lambda a=args: theirs(*a),
        )


@pytest.mark.parametrize("num_samples", [1, 3, 6])
@pytest.mark.parametrize("replacement", [True, False])
def test_weighted_sampler_lengths_match_torch(num_samples: int, replacement: bool) -> None:
    torch = pytest.importorskip("torch")
    theirs = torch.utils.data.WeightedRandomSampler(WEIGHTS, num_samples, replacement)
    ours = WeightedRandomSampler(WEIGHTS, num_samples, replacement, generator=0)
    assert len(ours) == len(theirs) == len(list(theirs)) == len(list(ours))
    if not replacement:
        assert len(set(ours)) == len(set(theirs)) == num_samples


def test_weighted_sampler_zero_weights_fill_up_like_torch() -> None:
    torch = pytest.importorskip("torch")
    weights = [1.0, 0.0, 0.0, 2.0]
    theirs = list(torch.utils.data.WeightedRandomSampler(weights, 4, replacement=False))
    ours = list(WeightedRandomSampler(weights, 4, replacement=False, generator=0))
    assert sorted(ours) == sorted(theirs) == [0, 1, 2, 3]
    assert set(ours[:2]) == set(theirs[:2]) == {0, 3}


# ----------------------------------------------------------------------------------- BatchSampler


def _gen(n: int) -> Iterator[int]:
    yield from range(n)


class _GetItemOnly:
    """Iterable through the old __getitem__ protocol only."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __getitem__(self, i: int) -> int:
        if i >= self.n:
            raise IndexError(i)
        return i


SOURCES = {
    "range": lambda n: range(n),
    "list": lambda n: list(range(n)),
    "tuple": lambda n: tuple(range(n)),
    "ndarray": lambda n: np.arange(n),
    "generator": _gen,
    "sequential": lambda n: SequentialSampler(range(n)),
    "custom": lambda n: _Evens(2 * n),
    "getitem_only": _GetItemOnly,
}


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("n", [0, 1, 9, 10, 11])
@pytest.mark.parametrize("batch_size", [1, 3, 10, 20])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_over_any_iterable(
    source: str, n: int, batch_size: int, drop_last: bool
) -> None:
    expected = _torch_batches(SOURCES[source](n), batch_size, drop_last)
    sampler = BatchSampler(SOURCES[source](n), batch_size, drop_last)
    got = list(sampler)
    assert got == expected
    assert all(type(i) is int for batch in got for i in batch)
    assert all(type(batch) is list for batch in got)
    if source not in ("generator", "getitem_only", "custom"):
        assert len(sampler) == len(expected)
        assert len(sampler) == (n // batch_size if drop_last else math.ceil(n / batch_size))


def test_batch_sampler_documented_example() -> None:
    assert list(BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False)) == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [9],
    ]
    assert list(BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=True)) == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
    ]


def test_batch_sampler_len_needs_inner_len() -> None:
    with pytest.raises(TypeError):
        len(BatchSampler(_gen(5), 2, False))


@pytest.mark.parametrize("n", [0, 1, 5, 6, 7, 64, 100])
@pytest.mark.parametrize("batch_size", [1, 2, 3, 6, 7, 1000])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("kind", ["range", "list", "sequential"])
def test_batch_sampler_matches_torch(n: int, batch_size: int, drop_last: bool, kind: str) -> None:
    torch = pytest.importorskip("torch")
    tdata = torch.utils.data

    def make(seq_cls: Any) -> Any:
        return {"range": range(n), "list": list(range(n)), "sequential": seq_cls(range(n))}[kind]

    theirs = tdata.BatchSampler(make(tdata.SequentialSampler), batch_size, drop_last)
    ours = BatchSampler(make(SequentialSampler), batch_size, drop_last)
    assert list(ours) == list(theirs)
    assert len(ours) == len(theirs)


def test_batch_sampler_argument_errors() -> None:
    for bad in (0, -1, True, 2.0, "2", None):
        with pytest.raises(ValueError) as info:
            BatchSampler(range(3), bad, False)  # type: ignore[arg-type]
        assert str(info.value) == (
            f"batch_size should be a positive integer value, but got batch_size={bad}"
        )
    for bad_drop in (0, None, "yes"):
        with pytest.raises(ValueError) as info:
            BatchSampler(range(3), 2, bad_drop)  # type: ignore[arg-type]
        assert (
            str(info.value) == f"drop_last should be a boolean value, but got drop_last={bad_drop}"
        )


def test_batch_sampler_accepts_numpy_int_batch_size() -> None:
    sampler = BatchSampler(range(5), np.int64(2), False)  # type: ignore[arg-type]
    assert list(sampler) == [[0, 1], [2, 3], [4]]
    assert type(sampler.batch_size) is int


def test_batch_sampler_errors_match_torch() -> None:
    torch = pytest.importorskip("torch")
    theirs = torch.utils.data.BatchSampler
    for args in ((0, False), (-1, False), (True, False), (2.0, False), (2, 0), (2, None)):
        _raises_same(
            lambda a=args: BatchSampler(range(3), *a),  # type: ignore[misc]
            lambda a=args: theirs(range(3), *a),
        )


# ------------------------------------------------------------------------ the array fast path


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 1000])
@pytest.mark.parametrize("batch_size", [1, 7, 256])
@pytest.mark.parametrize("drop_last", [False, True])
def test_epoch_batches_equal_list_path(n: int, batch_size: int, drop_last: bool) -> None:
    a = BatchSampler(RandomSampler(range(n), generator=4), batch_size, drop_last) if n else None
    b = BatchSampler(RandomSampler(range(n), generator=4), batch_size, drop_last) if n else None
    if a is None or b is None:
        a = BatchSampler(SequentialSampler(range(n)), batch_size, drop_last)
        b = BatchSampler(SequentialSampler(range(n)), batch_size, drop_last)
    for _ in range(2):
        batches = b._epoch_batches()
        assert batches is not None
        arrays = list(batches)
        assert all(x.dtype == np.int64 and x.ndim == 1 for x in arrays)
        assert list(a) == [x.tolist() for x in arrays]
    assert len(arrays) == len(a)


def test_epoch_batches_are_views_of_one_epoch() -> None:
    sampler = BatchSampler(RandomSampler(range(1000), generator=0), 100, False)
    batches = epoch_batches(sampler)
    assert batches is not None
    arrays = list(batches)
    assert all(x.base is arrays[0].base and x.base is not None for x in arrays)
    assert sorted(np.concatenate(arrays).tolist()) == list(range(1000))


def test_batch_sampler_draws_lazily_and_consumes_rng_like_iter() -> None:
    inner = RandomSampler(range(50), generator=2)
    sampler = BatchSampler(inner, 8, True)
    reference = RandomSampler(range(50), generator=2)
    it = iter(sampler)
    # nothing drawn until the first batch is requested (torch's BatchSampler is a generator)
    assert next(iter(inner)) == next(iter(reference))
    first = next(it)
    flat = [i for batch in [first, *it] for i in batch]
    assert flat == list(reference)[:48]


@pytest.mark.parametrize(
    "inner",
    [
        lambda: RandomSampler(range(10), generator=0),
        lambda: WeightedRandomSampler(WEIGHTS, 10, generator=0),
        lambda: SubsetRandomSampler([5, 6, 7], generator=0),
        lambda: SequentialSampler(range(10)),
        lambda: range(10),
        lambda: [3, 1, 2],
        lambda: (3, 1, 2),
        lambda: np.array([3, 1, 2], dtype=np.int32),
    ],
)
def test_samplers_with_array_form(inner: Any) -> None:
    assert epoch_batches(BatchSampler(inner(), 4, False)) is not None
    arr = epoch_indices(inner())
    assert arr is not None and arr.dtype == np.int64 and arr.ndim == 1
    assert arr.tolist() == list(inner())


def test_epoch_indices_plain_containers() -> None:
    assert epoch_indices(range(2, 20, 3)).tolist() == list(range(2, 20, 3))  # type: ignore[union-attr]
    assert epoch_indices([]).tolist() == []  # type: ignore[union-attr]
    assert epoch_indices([4, 2]).tolist() == [4, 2]  # type: ignore[union-attr]
    assert epoch_indices([np.int64(4), 2]).tolist() == [4, 2]  # type: ignore[union-attr]
    for no_array_form in (
        [1.0, 2.0],
        [True, False],
        [[0, 1], [2, 3]],
        [[0, 1], [2]],
        ["a"],
        [2**70],
        np.zeros((2, 2), dtype=np.int64),
        np.array([1.5]),
        _gen(3),
        iter([1, 2]),
        {1, 2},
        "abc",
        _GetItemOnly(3),
        5,
        None,
    ):
        assert epoch_indices(no_array_form) is None, no_array_form


def test_epoch_batches_without_array_form() -> None:
    assert epoch_batches([[0, 1], [2]]) is None
    assert epoch_batches(range(4)) is None
    assert BatchSampler(_gen(4), 2, False)._epoch_batches() is None
    assert BatchSampler(_Evens(4), 2, False)._epoch_batches() is None
    assert BatchSampler(_agen(4), 2, False)._epoch_batches() is None


def test_overriding_iter_disables_the_array_form() -> None:
    class Reversed(RandomSampler):
        def __iter__(self) -> Iterator[int]:
            return iter(range(len(self.data_source) - 1, -1, -1))

    class MyBatches(BatchSampler):
        def __iter__(self) -> Iterator[list[int]]:
            yield [42]

    class Tweaked(SequentialSampler):
        def _epoch_indices(self) -> Any:
            return super()._epoch_indices()[::-1].copy()

    assert epoch_indices(Reversed(range(3))) is None
    assert list(BatchSampler(Reversed(range(3)), 2, False)) == [[2, 1], [0]]
    assert epoch_batches(MyBatches(range(3), 2, False)) is None
    # overriding the array method alone changes both paths consistently
    assert list(Tweaked(range(3))) == [2, 1, 0]
    assert epoch_indices(Tweaked(range(3))).tolist() == [2, 1, 0]  # type: ignore[union-attr]


@pytest.mark.parametrize("n", [_CHUNK - 1, _CHUNK, _CHUNK + 1, 2 * _CHUNK + 5])
def test_iteration_across_chunk_boundaries(n: int) -> None:
    a = RandomSampler(range(n), generator=0)
    b = RandomSampler(range(n), generator=0)
    assert list(a) == b._epoch_indices().tolist()


# ---------------------------------------------------------------------------------- async paths


async def _agen(n: int, log: list[str] | None = None) -> AsyncIterator[int]:
    try:
        for i in range(n):
            yield i
    finally:
        if log is not None:
            log.append("closed")


class _AsyncOnly:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __aiter__(self) -> AsyncIterator[int]:
        return _agen(self.n)


@pytest.mark.anyio
@pytest.mark.parametrize("n", [0, 1, 6, 7])
@pytest.mark.parametrize("drop_last", [False, True])
async def test_batch_sampler_over_async_generator(
    anyio_backend: str, n: int, drop_last: bool
) -> None:
    expected = _torch_batches(range(n), 3, drop_last)
    got = [batch async for batch in BatchSampler(_agen(n), 3, drop_last)]
    assert got == expected
    sampler = BatchSampler(_AsyncOnly(n), 3, drop_last)
    assert [batch async for batch in sampler] == expected
    assert len(sampler) == len(expected)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "inner",
    [
        lambda: range(7),
        lambda: list(range(7)),
        lambda: _gen(7),
        lambda: SequentialSampler(range(7)),
        lambda: _GetItemOnly(7),
    ],
)
async def test_batch_sampler_async_over_sync_samplers(anyio_backend: str, inner: Any) -> None:
    got = [batch async for batch in BatchSampler(inner(), 3, False)]
    assert got == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.anyio
async def test_batch_sampler_async_matches_sync_for_random(anyio_backend: str) -> None:
    a = BatchSampler(RandomSampler(range(100), generator=3), 16, True)
    b = BatchSampler(RandomSampler(range(100), generator=3), 16, True)
    for _ in range(2):
        assert [batch async for batch in a] == list(b)


@pytest.mark.anyio
async def test_batch_sampler_async_closes_inner_generator_early(anyio_backend: str) -> None:
    log: list[str] = []
    it = BatchSampler(_agen(10, log), 2, False).__aiter__()
    assert await it.__anext__() == [0, 1]
    await it.aclose()  # type: ignore[attr-defined]
    assert log == ["closed"]


def test_batch_sampler_sync_iteration_over_async_only_sampler_is_a_clear_error() -> None:
    sampler = BatchSampler(_AsyncOnly(4), 2, False)
    with pytest.raises(TypeError, match="async"):
        list(sampler)


def test_batch_sampler_sync_iteration_over_non_iterable() -> None:
    with pytest.raises(TypeError):
        list(BatchSampler(5, 2, False))  # type: ignore[arg-type]


# ------------------------------------------------------------- epochs too long for one array

HUGE = 10**12


class _Huge:
    """A dataset-like object of HUGE items, of which only len() is read."""

    def __len__(self) -> int:
        return HUGE


def _first_batches(sampler: Any, k: int) -> list[list[int]]:
    batches = epoch_batches(sampler)
    assert batches is not None
    return [b.tolist() for b in itertools.islice(batches, k)]


@pytest.mark.parametrize(
    "make",
    [
        lambda: RandomSampler(range(10), replacement=True, num_samples=HUGE, generator=0),
        lambda: RandomSampler(range(10), num_samples=HUGE + 3, generator=0),
        lambda: WeightedRandomSampler([1.0, 2.0, 0.0, 3.0], HUGE, generator=0),
        lambda: SequentialSampler(_Huge()),
        lambda: SequentialSampler(range(HUGE)),
        lambda: range(HUGE),
    ],
    ids=["replacement", "without-replacement", "weighted", "sequential", "sequential-range",
         "range"],
)
def test_huge_epochs_start_at_once_in_bounded_memory(make: Any) -> None:
    import tracemalloc

    tracemalloc.start()
    try:
        sampler = make()
        first = list(itertools.islice(iter(sampler), 5))
        batches = _first_batches(BatchSampler(make(), 4, False), 3)
        indices = epoch_indices(make())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(first) == 5 and all(isinstance(i, int) for i in first)
    assert [len(b) for b in batches] == [4, 4, 4]
    # The array path and iteration give the same epoch.
    assert [i for b in batches for i in b][:5] == first
    assert indices is None  # no one-array form: the loader iterates instead
    assert peak < 200 * 2**20, peak  # blocks of 2**20 indices, not 8 TB
    assert len(sampler) == len(make()) >= HUGE
    assert len(BatchSampler(make(), 4, True)) == len(sampler) // 4


def test_huge_epoch_through_the_dataloader() -> None:
    from aloader import DataLoader

    class Items(aloader_Dataset):  # type: ignore[misc,valid-type]
        def __len__(self) -> int:
            return HUGE

        def __getitem__(self, index: int) -> int:
            return index

    loader = DataLoader(Items(), batch_size=4)
    assert len(loader) == HUGE // 4
    assert next(iter(loader)).tolist() == [0, 1, 2, 3]
    shuffled = DataLoader(
        Items(), batch_size=4,
        sampler=RandomSampler(Items(), replacement=True, num_samples=HUGE, generator=1),
    )
    batch = next(iter(shuffled))
    assert batch.shape == (4,) and batch.min() >= 0 and batch.max() < HUGE
    unbatched = DataLoader(Items(), batch_size=None)
    assert next(iter(unbatched)) == 0


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make an epoch of more than 40 indices "huge", drawn 16 at a time."""
    import aloader.data._distributed
    import aloader.data._indices
    import aloader.data._sampler

    monkeypatch.setattr(aloader.data._indices, "_EPOCH_MAX", 40)
    monkeypatch.setattr(aloader.data._indices, "_BLOCK", 16)
    monkeypatch.setattr(aloader.data._sampler, "_EPOCH_MAX", 40)
    monkeypatch.setattr(aloader.data._sampler, "_BLOCK", 16)
    monkeypatch.setattr(aloader.data._distributed, "_EPOCH_MAX", 40)


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("n", [1, 3, 7, 16, 50])
@pytest.mark.parametrize("num_samples", [41, 97, 160])
@pytest.mark.parametrize("batch_size", [1, 5, 16, 33])
@pytest.mark.parametrize("drop_last", [False, True])
def test_chunked_epoch_equals_the_one_array_epoch(
    n: int, num_samples: int, batch_size: int, drop_last: bool
) -> None:
    # Without replacement, the chunks are the same permutations the one-array path draws.
    lazy = RandomSampler(range(n), num_samples=num_samples, generator=5)
    assert epoch_indices(lazy) is None
    a = BatchSampler(RandomSampler(range(n), num_samples=num_samples, generator=5),
                     batch_size, drop_last)
    b = BatchSampler(RandomSampler(range(n), num_samples=num_samples, generator=5),
                     batch_size, drop_last)
    rng = np.random.default_rng(5)
    for _ in range(2):
        full, rest = divmod(num_samples, n)
        parts = [permutation(rng, n) for _ in range(full)]
        if rest:
            parts.append(permutation(rng, n)[:rest])
        expected = np.concatenate(parts).tolist()
        batches = _first_batches(a, 10**9)
        assert [i for batch in batches for i in batch] == (
            expected[: len(expected) - len(expected) % batch_size] if drop_last else expected
        )
        assert all(len(batch) == batch_size for batch in batches[:-1])
        assert list(b) == batches
        assert len(a) == len(batches)


@pytest.mark.usefixtures("small_blocks")
def test_chunked_replacement_and_weighted_epochs() -> None:
    for make in (
        lambda: RandomSampler(range(9), replacement=True, num_samples=100, generator=2),
        lambda: WeightedRandomSampler([0.5, 0.0, 2.0, 1.0], 100, generator=2),
        lambda: SequentialSampler(range(100)),
    ):
        it = list(make())
        assert len(it) == 100
        assert [i for b in _first_batches(BatchSampler(make(), 7, False), 10**9) for i in b] == it
        assert list(make()) == it  # reproducible
    weighted = list(WeightedRandomSampler([0.5, 0.0, 2.0, 1.0], 100, generator=2))
    assert 1 not in weighted
    assert list(SequentialSampler(range(100))) == list(range(100))
