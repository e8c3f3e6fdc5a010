"""An example factory for ``python -m aloader profile examples/profile_factory.py:make_loader``.

The profile command calls :func:`make_loader` and runs one epoch of the loader it returns,
then prints where the time went. This loader's dataset waits 5 ms per item (a remote store)
and only 4 fetches may be in flight, so the verdict says to raise ``max_concurrency``; point
the command at a factory of your own to profile your loader.
"""

from __future__ import annotations

import anyio
import numpy as np
import numpy.typing as npt

import aloader


class SlowStore(aloader.Dataset[npt.NDArray[np.float32]]):
    """``n`` items, each behind ``latency`` seconds of simulated network wait."""

    def __init__(self, n: int = 400, latency: float = 0.005) -> None:
        self.n = n
        self.latency = latency

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> npt.NDArray[np.float32]:
        await anyio.sleep(self.latency)
        return np.full(8, index, dtype=np.float32)


def make_loader() -> aloader.DataLoader[npt.NDArray[np.float32]]:
    """The loader to profile."""
    return aloader.DataLoader(SlowStore(), batch_size=16, max_concurrency=4)
