"""Change only the import: tensors of dtypes numpy lacks or torch cannot pickle.

torch's own pickle of a uint16/32/64, float8 or complex32 tensor cannot be loaded back (its
legacy storage format), and numpy has no float8 nor complex32. A TensorDataset of token ids
kept as torch.uint16 must reach aloader's workers, and their batches come back, as torch's
workers (which never pickle the dataset under fork) give them.
"""

from __future__ import annotations

import pytest

import aloader
from aloader.workers import _shm

torch = pytest.importorskip("torch")
tud = torch.utils.data

DTYPES = [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.complex32, torch.bfloat16, torch.bool]


def _view(batches: list[list[object]]) -> list[list[tuple[str, list[int], bytes]]]:
    # Bytes, so that float8's NaN patterns and complex32 compare exactly.
    return [[(str(t.dtype), list(t.shape), t.view(torch.uint8).numpy().tobytes())
             for t in batch] for batch in batches]  # type: ignore[attr-defined]


# torch warns once per process that complex32 is experimental.
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support:UserWarning")


def test_a_tensor_dataset_of_every_dtype_through_a_worker_like_torch() -> None:
    tensors = [torch.arange(6).to(dtype).reshape(3, 2) for dtype in DTYPES]
    theirs = list(tud.DataLoader(tud.TensorDataset(*tensors), batch_size=2))
    ours = list(aloader.DataLoader(aloader.TensorDataset(*tensors), batch_size=2, num_workers=1))
    assert _view(ours) == _view(theirs)


def test_non_contiguous_tensors_of_every_dtype_through_a_worker_like_torch() -> None:
    # Strided views (every other row, a transpose): torch's pickle of the uint16/32/64,
    # float8 and complex32 ones cannot be loaded back in the worker.
    tensors = [torch.arange(24).to(dtype).reshape(4, 6)[:, ::2] for dtype in DTYPES]
    tensors += [torch.arange(12).to(torch.uint16).reshape(3, 4).t()]
    assert not any(t.is_contiguous() for t in tensors)
    theirs = list(tud.DataLoader(tud.TensorDataset(*tensors), batch_size=3))
    ours = list(aloader.DataLoader(aloader.TensorDataset(*tensors), batch_size=3, num_workers=1))
    assert _view(ours) == _view(theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_codec_round_trips_a_tensor_of_each_dtype(dtype: object) -> None:
    tensor = torch.arange(70_000).to(dtype)  # out of band: above the threshold
    codec = _shm.Codec(_shm.owner(), "test", tensors=True)
    for by_value in ("never", "always"):
        back = _shm.decode(codec.encode([tensor, tensor[:3]], by_value=by_value))
        assert _view([back]) == _view([[tensor, tensor[:3]]])


def test_the_codec_round_trips_conjugate_views_of_complex32() -> None:
    # torch's pickle keeps the conjugate bit, in a format it cannot load complex32 back from.
    base = torch.arange(12.0).to(torch.complex32).reshape(3, 4) * (1 + 2j)
    views = [base.conj(), base.t().conj(), base[1, 2].conj(), base[:0].conj()]
    codec = _shm.Codec(_shm.owner(), "test", tensors=True)
    back = _shm.decode(codec.encode(views, by_value="never"))
    assert [t.shape for t in back] == [view.shape for view in views]
    flat = [view.resolve_conj().reshape(-1) for view in views]  # _view needs a dimension
    assert _view([[t.reshape(-1) for t in back]]) == _view([flat])


class _Counting(aloader.Dataset[int]):
    """Counts its fetches in a tensor in shared memory, as a worker-filled cache would."""

    def __init__(self) -> None:
        self.seen = torch.zeros(8, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        self.seen[index] += 1
        return index


def test_a_shared_tensor_of_the_dataset_is_shared_with_the_workers_like_torch() -> None:
    # Pickled, each worker wrote into its own copy: the loader's process saw zeros.
    theirs, ours = _Counting(), _Counting()
    list(tud.DataLoader(theirs, batch_size=2, num_workers=2))
    batches = aloader.DataLoader(ours, batch_size=2, num_workers=2)
    assert [batch.tolist() for batch in batches] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ours.seen.tolist() == theirs.seen.tolist() == [1] * 8


def test_a_codec_refusing_shared_tensors() -> None:
    codec = _shm.Codec(_shm.owner(), "test", tensors=True, shared_tensors=False)
    for by_value in ("never", "always"):
        assert _shm.decode(codec.encode(torch.ones(2), by_value=by_value)).tolist() == [1, 1]
        with pytest.raises(_shm.SharedTensorError, match="shared memory"):
            codec.encode({"x": torch.ones(2).share_memory_()}, by_value=by_value)
