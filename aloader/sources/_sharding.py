"""Which shards one consumer reads: the split across ranks and worker processes.

A *consumer* is one worker process of one rank (the main process counts as worker 0 of 1 when
the loader runs no workers). Every consumer computes the same shard order for an epoch (a
permutation seeded by ``seed + epoch`` when shuffling, as ``DistributedSampler`` does). Rank
``r`` of ``R`` takes every ``R``-th shard of it from position ``r``, and worker ``w`` of ``W``
every ``W``-th shard of its rank's share from position ``w``. So each shard is read exactly once
per epoch overall, also when there are more consumers than shards (some then read none), and a
rank's share does not depend on how many workers it runs.

Even ranks (``even="shards"``): a distributed job hangs when one rank runs out of batches
before the others. Every rank then reads the same number of shards, ``num_shards // R``: a
rank whose share holds one more drops one of its shards in that epoch, the one at position
``epoch % len(share)`` of its share, so that (without shuffling) each of its shards is
dropped once every ``len(share)`` epochs and read in all the others, and the rank keeps its
own shards from epoch to epoch. With ``even="records"`` (a fixed number of records per rank,
enforced by the source) nothing is dropped. In both, the share is split over ``A =
min(W, num_shards // R)`` workers, the same number on every rank, so that every rank runs as
many busy workers. Unlike ``DistributedSampler`` nothing is padded: a repeated shard would be
read twice.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, TypeAlias

import numpy as np

from ..data._distributed import default_place
from ..data._random import permutation

if TYPE_CHECKING:
    from ..io._objstore import ObjectAccess

__all__ = (
    "ShardsLike",
    "EvenRanks",
    "assign_shards",
    "busy_workers",
    "check_ranks",
    "expand_shards",
    "is_url",
    "rank_share",
    "resolve_world",
    "uneven_shares",
)

ShardsLike: TypeAlias = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
#: How ranks are evened out: not at all, by shard count, or by records (the source's quota).
EvenRanks: TypeAlias = Literal["shards", "records"] | None

_UINT64 = 1 << 64
_GLOB_CHARS = frozenset("*?[")


def is_url(shard: str) -> bool:
    """Whether ``shard`` names an HTTP(S) URL rather than a local path."""
    head = shard[:8].lower()
    return head.startswith("http://") or head.startswith("https://")


def _expand_one(spec: str, objects: ObjectAccess | None) -> list[str]:
    if is_url(spec):
        return [spec]
    from ..io._objstore import ObjectAccess, is_object_url  # imports _formats, which imports us

    if is_object_url(spec):
        return (objects or ObjectAccess()).expand(spec)
    if any(char in _GLOB_CHARS for char in spec):
        matches = sorted(path for path in glob.glob(spec, recursive=True)
                         if os.path.isfile(path))
        if not matches:
            raise ValueError(f"no shard files match the pattern {spec!r}")
        return matches
    if os.path.isdir(spec):
        files = sorted(
            os.path.join(spec, name)
            for name in os.listdir(spec)
            if not name.startswith(".") and os.path.isfile(os.path.join(spec, name))
        )
        if not files:
            raise ValueError(f"the shard directory {spec!r} holds no files")
        return files
    if not os.path.exists(spec):
        raise FileNotFoundError(f"shard file {spec!r} does not exist")
    return [spec]


def expand_shards(shards: ShardsLike, objects: ObjectAccess | None = None) -> list[str]:
    """Turn a shard specification into the list of shards, in a deterministic order.

    Args:
        shards: one path, URL, directory or glob pattern, or a sequence of them. A directory
            stands for the (non-hidden) files directly in it, a pattern (``*``, ``?``, ``[``,
            ``**`` with recursion) for the files it matches; both are sorted by name so that
            every rank and worker sees the same list. Object store URLs (``s3://``, ...)
            ending in ``/`` or holding a pattern are listed the same way
            (:meth:`aloader.io._objstore.ObjectAccess.expand`).
        objects: the store and options to list object store URLs with (default: stores
            from the URLs and the environment).

    Returns:
        Paths and URLs, in the order given (expansions sorted in place).

    Raises:
        FileNotFoundError: a plain path does not exist.
        ValueError: a pattern matches nothing, a directory is empty, or no shard is given.
        TypeError: ``shards`` is not a string, a path or a sequence of them.
    """
    if isinstance(shards, (str, os.PathLike)):
        specs = [shards]
    elif isinstance(shards, Sequence):
        specs = list(shards)
    else:
        raise TypeError(
            "shards should be a path, a URL, a directory, a glob pattern or a sequence of them, "
            f"but got {type(shards).__name__}"
        )
    out: list[str] = []
    for spec in specs:
        if not isinstance(spec, (str, os.PathLike)):
            raise TypeError(f"a shard should be a path or a URL, but got {spec!r}")
        out.extend(_expand_one(os.fspath(spec), objects))
    if not out:
        # An epoch of nothing would look like a finished one: refuse it where it is made.
        raise ValueError("no shards given: shards should name at least one file or URL")
    return out


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's rank and the world size, from the arguments or as torch would take them.

    Args:
        rank: the rank, or None for the initialized process group's, else the ``RANK``
            environment variable, else 0 (:func:`~aloader.data._distributed.default_place`).
        world_size: the number of ranks, or None for the process group's, else
            ``WORLD_SIZE``, else 1.

    Raises:
        ValueError: with ``DistributedSampler``'s message when the rank is out of range, or
            when the world size is not positive.
    """
    rank, world_size = default_place(rank, world_size)
    if world_size < 1:
        raise ValueError(f"world_size should be a positive integer, but got {world_size}")
    if rank >= world_size or rank < 0:
        raise ValueError(
            f"Invalid rank {rank}, rank should be in the interval [0, {world_size - 1}]"
        )
    return rank, world_size


def shard_order(num_shards: int, *, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The epoch's shard order, the same on every rank and worker."""
    if not shuffle:
        return list(range(num_shards))
    value = int(seed) + int(epoch)
    rng = np.random.default_rng(value % _UINT64 if value < 0 else value)
    return permutation(rng, num_shards).tolist()  # type: ignore[no-any-return]


def rank_share(
    num_shards: int, *, rank: int, world_size: int, epoch: int = 0, seed: int = 0,
    shuffle: bool = False, even: EvenRanks = None,
) -> tuple[list[int], int | None]:
    """The shards rank ``rank`` reads in one epoch, in reading order, and the one it drops
    to even the ranks out (None when it drops none); see the module's docstring."""
    order = shard_order(num_shards, epoch=epoch, seed=seed, shuffle=shuffle)
    share = order[rank::world_size]
    dropped = None
    if even == "shards" and len(share) > num_shards // world_size:
        dropped = share.pop(epoch % len(share))
    return share, dropped


def check_ranks(num_units: int, *, rank: int, world_size: int, what: str = "shard") -> None:
    """Refuse a split that leaves a rank with nothing to read.

    Raises:
        ValueError: naming the ranks left out, this rank, the world size and the count.
    """
    if num_units < world_size:
        left = (f"rank {num_units}" if num_units == world_size - 1
                else f"ranks {num_units} to {world_size - 1}")
        raise ValueError(
            f"{num_units} {what}s for world_size {world_size}: {left} would read no {what} and "
            f"every epoch of theirs would be empty (this process is rank {rank}); give at "
            f"least {world_size} {what}s (more, smaller shards) or run fewer ranks"
        )


def uneven_shares(epoch: int, num_units: int, world_size: int, units: str = "shards") -> str:
    """The warning for an epoch whose ``num_units`` cannot be split evenly over the ranks
    (none dropped): who reads how many, why it matters, and the two remedies."""
    each, extra = divmod(num_units, world_size)

    def some(count: int) -> str:
        return f"{count} {units[:-1] if count == 1 else units}"  # (units: a plural noun)

    def ranks(first: int, last: int, count: int) -> str:
        what = some(count) if count else "nothing"
        if first == last:
            return f"rank {first} reads {what}"
        return f"ranks {first} to {last} read {what}" + (" each" if count else "")

    shares = (f"epoch {epoch}: {num_units} {units} over {world_size} ranks: "
              f"{ranks(0, extra - 1, each + 1)}, {ranks(extra, world_size - 1, each)}. Every "
              f"record is read once, but the ranks get different numbers of records and of "
              f"batches, and a distributed job whose ranks must take the same number of steps "
              f"hangs when one runs out.")
    if not each:  # even_ranks and records_per_rank refuse a rank with nothing to read
        return (f"{shares} Give at least {world_size} {units} (more, smaller ones) or run "
                f"fewer ranks, then pass even_ranks=True or records_per_rank=N to even the "
                f"ranks out.")
    return (f"{shares} Pass even_ranks=True (every rank reads {some(each)}, those with one "
            f"more leave one out each epoch, in turn) or records_per_rank=N (exactly N "
            f"records on every rank, its {units} read again from the start where they hold "
            f"fewer).")


def assign_shards(
    num_shards: int,
    *,
    rank: int,
    world_size: int,
    worker_id: int,
    num_workers: int,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = False,
    even: EvenRanks = None,
) -> list[int]:
    """The shards one consumer reads in one epoch, in reading order.

    Args:
        num_shards: how many shards there are.
        rank: this process's rank, in ``range(world_size)``.
        world_size: number of ranks.
        worker_id: this worker's id, in ``range(num_workers)``.
        num_workers: loader workers per rank (1 when the loader runs none).
        epoch: the epoch, which seeds the shuffle together with ``seed``.
        seed: the shuffling seed; must be the same on every rank.
        shuffle: shuffle the shard order at every epoch.
        even: None, or how every rank gets the same work: ``"shards"`` (every rank reads
            ``num_shards // world_size`` shards, dropping one in turn) or ``"records"`` (no
            shard dropped); both split a rank's share over the same number of workers on
            every rank.

    Returns:
        Shard indices: over all ``(rank, worker_id)`` pairs every index in
        ``range(num_shards)`` appears exactly once (without ``even="shards"``), or at most
        once, the ranks' dropped shards left out (with it).

    Raises:
        ValueError: an argument is out of range.
    """
    if num_shards < 0:
        raise ValueError(f"num_shards should be non-negative, but got {num_shards}")
    if num_workers < 1 or not 0 <= worker_id < num_workers:
        raise ValueError(f"Invalid worker id {worker_id} for {num_workers} workers")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"Invalid rank {rank}, rank should be in the interval [0, {world_size - 1}]"
        )
    share, _ = rank_share(num_shards, rank=rank, world_size=world_size, epoch=epoch, seed=seed,
                          shuffle=shuffle, even=even)
    busy = num_workers if even is None else busy_workers(num_shards, world_size, num_workers)
    return share[worker_id::busy] if worker_id < busy else []


def busy_workers(num_shards: int, world_size: int, num_workers: int) -> int:
    """The workers per rank that read shards when the ranks are evened out: as many on every
    rank (at least 1)."""
    return max(1, min(num_workers, num_shards // world_size))
