"""The io hot path: what an epoch of single-item async fetches keeps while it runs, and the
benchmark that measures it against the bare program (paired rounds).

An epoch's live memory must not grow with its length: a per-item record kept until the epoch
ends outgrows a core's cache within a few thousand items, and every item then pays for it.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from aloader import DataLoader


class Quick:
    """An async dataset whose fetches yield once to the loop and return the index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> int:
        await anyio.lowlevel.checkpoint()
        return i


@pytest.mark.anyio
async def test_per_item_statistics_stay_bounded_during_an_epoch(anyio_backend: str) -> None:
    # 200 batches of 4 items, fetched item by item: the fetch stage appends one latency per
    # item, folded every few batches, so what waits to be folded never holds the epoch.
    n, batch = 800, 4
    loader = DataLoader(Quick(n), batch_size=batch, max_concurrency=8, collate_fn=list)
    seen: list[int] = []
    peak = 0
    async for got in loader:
        seen += got
        collector = loader._stats
        assert collector is not None
        peak = max(peak, len(collector.fetch.pending))
    assert seen == list(range(n))
    assert peak <= 64 * batch  # the fold interval's items and those fetched ahead
    stats = loader.stats()  # the counts stay exact across the folds
    assert stats.stages["fetch"].count == n
    assert stats.items == n and stats.batches == n // batch


def test_bench_quotes_the_paired_median_beside_the_best() -> None:
    from aloader._cli import load_bench_engine

    engine = load_bench_engine()
    calls: list[str] = []

    def run(name: str, rates: list[float]) -> Any:
        def once() -> float:
            calls.append(name)
            return rates[calls.count(name) - 1]
        return once

    # The loader's rounds at 0.5x, 0.9x and 0.8x of the limit's: best 80 of 100, median 0.8x.
    rounds = engine._rounds(3, run("limit", [100.0, 50.0, 100.0]),
                            run("loader", [50.0, 45.0, 80.0]))
    assert calls == ["limit", "loader"] * 3  # interleaved, round by round
    assert rounds == [[100.0, 50.0], [50.0, 45.0], [100.0, 80.0]]
    assert engine._paired_median(rounds, 1, 0) == pytest.approx(0.8)
    row = engine._ratio_row("io", 80.0, 100.0, "bare", 0.9, "-", 0.8)
    assert row.ratio == "0.80x (paired median 0.80x)" and row.met is False
