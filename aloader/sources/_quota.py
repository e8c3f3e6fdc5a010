"""Evening the ranks out: how a source does it (:func:`even_mode`, from ``even_ranks`` and
``records_per_rank``), each worker's part of ``records_per_rank`` (:func:`worker_quota`), and
exactly that many records from passes over a consumer's shards (:func:`_up_to`).

Invariant: with ``records_per_rank``, every rank delivers exactly that many records per epoch,
split the same way over the same number of busy workers on every rank.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from .._exceptions import SourceError
from .._stats import SourceStats
from .._util import Closing, check_int
from ._counting import _Tally
from ._sharding import EvenRanks, busy_workers


def even_mode(even_ranks: bool | None, records_per_rank: int | None, world_size: int
              ) -> EvenRanks:
    """How a source evens its ranks out, from its ``even_ranks`` and ``records_per_rank``."""
    if records_per_rank is not None:
        check_int("records_per_rank", records_per_rank)
        if even_ranks is False:
            raise ValueError("records_per_rank gives every rank the same records: it cannot be "
                             "combined with even_ranks=False")
        return "records"
    # Off unless asked: every record is read exactly once per epoch (torch's
    # DistributedSampler drops nothing by default either); unequal shares are warned about.
    return "shards" if even_ranks else None


def worker_quota(records_per_rank: int, num_units: int, world_size: int, worker_id: int,
                 num_workers: int) -> int:
    """This worker's part of ``records_per_rank``: split over the busy workers
    (:func:`~aloader.sources._sharding.busy_workers`), the same parts on every rank."""
    busy = busy_workers(num_units, world_size, num_workers)
    if worker_id >= busy:
        return 0
    return records_per_rank // busy + (worker_id < records_per_rank % busy)


async def _up_to(
    quota: int,
    passes: Callable[[dict[str, Any] | None], AsyncGenerator[tuple[list[Any], Any], None]],
    stats: SourceStats,
    where: str,
    at: dict[str, Any] | None = None,
    counted: _Tally | None = None,
) -> AsyncGenerator[tuple[list[Any], Any], None]:
    """Exactly ``quota`` items from passes over a consumer's shards: the first pass's items
    (``passes(at)``, from ``at`` when resuming), then, if they were fewer, those of new passes
    from the start (counted in ``stats.repeated`` beyond the items its reading ``counted``:
    ``records``, the items before the first not counted), the last block cut at the quota.

    Tokens become ``(pass, items before the block, token)``; ``at`` holds ``pass`` and
    ``delivered`` (the items before its block) when resuming.
    """
    number = 0 if at is None else at["pass"]
    delivered = 0 if at is None else at["delivered"]
    if counted is None:
        counted = _Tally()
    first = True
    while delivered < quota:
        got = 0
        async with Closing(passes(at if first else None)) as blocks:
            async for block, token in blocks:
                if len(block) > quota - delivered:
                    block = block[: quota - delivered]
                before = delivered
                delivered += len(block)  # before the yield, which may close this
                got += len(block)
                if number:
                    stats.repeated += counted.new_records(before, delivered)
                yield block, (number, before, token)
                if delivered >= quota:
                    return
        if got == 0 and not (first and at is not None):
            # A pass of nothing would repeat forever.
            raise SourceError(f"records_per_rank: {where} holds no records, so its quota of "
                              f"{quota} records cannot be filled")
        first = False
        number += 1
