"""The 2-worker path's per-batch costs: how answers are read and how arrays cross.

The loader reads each worker's answers from a reader the asyncio loop calls whenever the
socket is readable, registered once per epoch (a wait per read cost a future, two
``epoll_ctl`` calls and a task step per answer); on trio it still waits per read. A plain
C-ordered numpy array crosses the transport as its buffer, dtype string and shape, rebuilt
exactly as numpy's own pickle would rebuild it: the same values, dtype, shape, order and
writeability, in band or in shared memory; other arrays keep numpy's own reduction.
"""

from __future__ import annotations

import asyncio.selector_events
import pickle
from typing import Any

import numpy as np
import pytest
from sourcetools import Items

from aloader import DataLoader
from aloader.workers import _shm


def test_the_loader_registers_each_workers_socket_once_per_epoch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    dl = DataLoader(Items(120), batch_size=2, collate_fn=list, num_workers=2,
                    persistent_workers=True)
    assert [b for batch in dl for b in batch] == list(range(120))  # the workers start
    assert dl._pool is not None
    fds = {worker.fd for worker in dl._pool.workers}
    registered: list[int] = []
    add_reader = asyncio.selector_events.BaseSelectorEventLoop.add_reader

    def counting(self: Any, fd: Any, callback: Any, *args: Any) -> Any:
        if fd in fds:
            registered.append(fd)
        return add_reader(self, fd, callback, *args)

    monkeypatch.setattr(asyncio.selector_events.BaseSelectorEventLoop, "add_reader", counting)

    async def epoch() -> list[int]:
        return [b async for batch in dl for b in batch]

    for _ in range(2):  # on asyncio's own loop (a sync for may run on uvloop's)
        assert asyncio.run(epoch()) == list(range(120))
    # 60 answers an epoch, read by one registration per worker and epoch (one per answer,
    # 60, before).
    assert sorted(registered) == sorted([*fds, *fds])


def _arrays() -> list[np.ndarray[Any, Any]]:
    base = np.arange(24, dtype=np.int64).reshape(4, 6)
    readonly = np.arange(5.0)
    readonly.flags.writeable = False
    structured = np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")])
    return [
        np.array([True, False]), np.arange(5, dtype=np.int8), np.arange(5, dtype=np.uint16),
        np.arange(5, dtype=">i8"), np.arange(4, dtype=np.float16),
        np.array([1.5, np.nan, -np.inf]), np.array([1 + 2j, 3j]),
        np.array(["ab", "c\u00e9", ""]), np.array([b"x", b"yz"]),
        np.array(["2026-12-02T03:00", "NaT"], dtype="datetime64[ns]"),
        np.array([1, 2], dtype="timedelta64[s]"), np.array(7), np.zeros((0, 3)),
        base, np.asfortranarray(base), base[:, ::2], base.T, readonly, structured,
        np.array([{"a": 1}, None], dtype=object), np.zeros(3, dtype=("i4", (2,))),
        np.arange(1 << 14, dtype=np.float64),  # 128 KiB: through shared memory
        np.ma.masked_array([1, 2], mask=[0, 1]),
    ]


@pytest.mark.parametrize("array", _arrays(), ids=lambda a: f"{a.dtype.str}{a.shape}")
def test_an_array_crosses_the_transport_as_numpys_pickle_rebuilds_it(
        array: np.ndarray[Any, Any]) -> None:
    codec = _shm.Codec(_shm.owner(), "ftest5")
    got = _shm.decode(codec.encode({"x": array, "again": [array]}))["x"]
    want = pickle.loads(pickle.dumps(array, protocol=5))
    assert type(got) is type(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.flags.writeable == want.flags.writeable
    assert got.flags.c_contiguous == want.flags.c_contiguous
    assert got.flags.f_contiguous == want.flags.f_contiguous
    if array.dtype.kind == "O":
        assert got.tolist() == want.tolist()
    else:
        assert np.array_equal(got, want, equal_nan=array.dtype.kind in "fcmM")
    if isinstance(array, np.ma.MaskedArray):
        assert np.array_equal(got.mask, want.mask)


def test_a_plain_array_pickles_no_dtype_object() -> None:
    codec = _shm.Codec(_shm.owner(), "ftest5")
    batch = {"id": np.arange(256), "x": [np.ones(256), np.zeros(256, dtype=np.float32)]}
    message = codec.encode(batch)
    # numpy's reduction names the dtype class and its rebuilder; this one names neither.
    assert b"numpy" not in message
    got = _shm.decode(message)
    assert got["id"].tolist() == list(range(256)) and got["id"].dtype == np.int64
    assert got["x"][1].dtype == np.float32 and got["x"][0].tolist() == [1.0] * 256


def test_a_shared_array_stays_one_array() -> None:
    codec = _shm.Codec(_shm.owner(), "ftest5")
    array = np.arange(10)
    got = _shm.decode(codec.encode([array, array, array[2:]]))
    assert got[0] is got[1]  # pickle's memo, as before
    assert got[2].tolist() == list(range(2, 10))


class Slow(Items):
    """The worker's pid per item, a little slowly (a worker can be killed mid-epoch)."""

    def __getitem__(self, i: int) -> int:
        import os
        import time

        time.sleep(0.002)
        return os.getpid()


@pytest.mark.anyio
async def test_answers_and_a_dead_worker_on_each_backend(anyio_backend: str) -> None:
    import os
    import signal

    import aloader

    dl = DataLoader(Items(40), batch_size=4, collate_fn=list, num_workers=2,
                    persistent_workers=True)
    try:
        for _ in range(2):
            assert [b async for batch in dl for b in batch] == list(range(40))
    finally:
        dl.close()
    slow = DataLoader(Slow(200), batch_size=4, collate_fn=list, num_workers=2, timeout=60)
    try:
        batches = aiter(slow)
        victim = (await anext(batches))[0]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(aloader.WorkerError) as dead:
            async for _ in batches:
                pass
        assert str(dead.value) == f"DataLoader worker (pid {victim}) is killed by signal: Killed. "
    finally:
        slow.close()
