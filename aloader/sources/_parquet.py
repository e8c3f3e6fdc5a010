"""Parquet files as a stream of rows or column batches: :class:`ParquetRows`.

Invariant: every epoch, the *units* of the dataset (whole files when there are at least as
many files as consumers, else single row groups) are ordered as the epoch's shard order (see
:mod:`aloader.sources._sharding`) and split round-robin across the ``world_size * num_workers``
consumers with :func:`~aloader.sources._sharding.assign_shards`: each unit, hence each row, is read
by exactly one consumer. All consumers see the same list of files and, in row-group mode, read
the same footers, so they agree on the units without talking to each other. With the ranks
evened out (``even_ranks=True``), the units are what each rank reads the same number of, and
what a rank drops one of in turn (see :mod:`aloader.sources._sharding`).

pyarrow (the extra ``aloader[parquet]``) is imported when a :class:`ParquetRows` is made, not
with aloader; how its blocking reads are made, in threads and over ranged GETs, is
:mod:`aloader.sources._parquet_read`'s.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import itertools
import os
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, Literal, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread

from .._exceptions import RecordError, SourceError
from .._util import Closing, check_int
from .._workerinfo import worker_slot
from ..streams._context import _Context
from ..streams._positions import check_same
from ..streams._stream import Stream
from ._formats import BadRecords
from ._parquet_read import (
    _called,
    _is_remote,
    _LocalReader,
    _LocalStep,
    _located,
    _pyarrow,
    _RangeFile,
    _ReadThread,
    _reraise,
    _Unit,
    _UnitFailed,
    _UnitReader,
    open_parquet_shard,
)
from ._quota import _up_to
from ._readahead import read_in_order
from ._sharded import ShardedSource
from ._sharding import ShardsLike, assign_shards, check_ranks

T = TypeVar("T")

__all__ = ("ParquetRows",)

DEFAULT_BATCH_ROWS = 65536  # pyarrow's own default for iter_batches
# Rows (dicts) are made and handed on at most this many at a time, in the consumer's thread
# (see ParquetRows._items): a block's dicts are then still in the CPU's caches when the
# consumer takes and frees them. A 65536-row batch converted at once, in the read thread, made
# ~40 MB of dicts per block, three or four blocks alive at once (consumed, read ahead, being
# made), and cost ~1.25x the CPU time of pieces of 4096-8192 rows (1M rows, to_pylist alone).
ROW_BLOCK = 4096


# The rows of 1 to 8 columns, each made by a comprehension over ``zip`` of the columns that
# builds a dict display of the keys (bound to local names first): one BUILD_MAP per row, the
# same keys in the same order with the same values as RecordBatch.to_pylist(), which looks
# each value up by name in a dict of columns, then indexes the column by the row. Written
# out per width because a dict display's width is fixed in the code (dict(zip(keys, row))
# per row, the generic way, takes 2x the time; generating the code from the schema means
# exec, which no schema's names should reach).
def _rows1(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    (k0,) = keys
    return [{k0: a} for (a,) in zip(*columns, strict=True)]


def _rows2(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1 = keys
    return [{k0: a, k1: b} for a, b in zip(*columns, strict=True)]


def _rows3(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1, k2 = keys
    return [{k0: a, k1: b, k2: c} for a, b, c in zip(*columns, strict=True)]


def _rows4(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1, k2, k3 = keys
    return [{k0: a, k1: b, k2: c, k3: d} for a, b, c, d in zip(*columns, strict=True)]


def _rows5(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1, k2, k3, k4 = keys
    return [{k0: a, k1: b, k2: c, k3: d, k4: e}
            for a, b, c, d, e in zip(*columns, strict=True)]


def _rows6(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1, k2, k3, k4, k5 = keys
    return [{k0: a, k1: b, k2: c, k3: d, k4: e, k5: f}
            for a, b, c, d, e, f in zip(*columns, strict=True)]


def _rows7(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1, k2, k3, k4, k5, k6 = keys
    return [{k0: a, k1: b, k2: c, k3: d, k4: e, k5: f, k6: g}
            for a, b, c, d, e, f, g in zip(*columns, strict=True)]


def _rows8(keys: tuple[str, ...], columns: list[list[Any]]) -> list[Any]:
    k0, k1, k2, k3, k4, k5, k6, k7 = keys
    return [{k0: a, k1: b, k2: c, k3: d, k4: e, k5: f, k6: g, k7: h}
            for a, b, c, d, e, f, g, h in zip(*columns, strict=True)]


_MAKERS = (_rows1, _rows2, _rows3, _rows4, _rows5, _rows6, _rows7, _rows8)


@functools.lru_cache(maxsize=64)
def _row_maker(names: tuple[str, ...]) -> Callable[[list[list[Any]]], list[Any]] | None:
    """A function making the rows of a batch whose columns are ``names`` from its columns'
    values (``[column.to_pylist() for column in batch.columns]``): exactly what
    ``RecordBatch.to_pylist()`` gives, in 0.8x its time (0.63 against 0.78 ms per 4096 rows
    of five columns, the benchmark's, the columns' to_pylist included), or None where
    pyarrow's own is used: no columns, a name twice, more than 8 columns (see ``_rows1``).
    The names are values the functions take, never code."""
    if not names or len(set(names)) != len(names) or len(names) > len(_MAKERS):
        return None
    return functools.partial(_MAKERS[len(names) - 1], names)


def _rows_of(piece: Any) -> list[Any]:
    """``piece.to_pylist()`` (as :func:`_row_maker` makes it), with Python's cyclic garbage
    collector paused meanwhile.

    Making a piece allocates a dict per row, and every 700 allocations start a young
    collection, which traverses the piece's column lists and the rows made so far: none of
    them garbage (values of Arrow columns hold no cycles), but a piece of 4096 rows started
    six of them. Paused, a piece took 0.87x the time (1.39 against 1.61 ms per 4096 rows of
    the benchmark's five columns); the collection owed runs once, at the next allocation
    after. Left alone when the collector is off (a program's choice); a program turning it
    off from another thread during a piece (1-3 ms) would find it on again.
    """
    make = _row_maker(tuple(piece.schema.names))
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        if make is None:
            return piece.to_pylist()  # type: ignore[no-any-return]
        return make([column.to_pylist() for column in piece.columns])
    finally:
        if paused:
            gc.enable()


class ParquetRows(ShardedSource[Any]):
    """Rows of Parquet files, as dicts, or column batches; reading only the chosen columns.

    Each epoch a consumer (worker ``w`` of ``W`` of rank ``r`` of ``R``) reads its share of the
    data: whole files when there are at least ``R * W`` files, else row groups (every consumer
    then reads every file's footer to list them), so that more consumers than files still
    share the work. Either way each row is read exactly once per epoch across all ranks and
    workers, and, with ``shuffle_shards``, the files (or row groups) come in a new order every
    epoch, the same on every consumer. A consumer reads up to ``concurrency`` remote files at
    once (local files one at a time: their reads need the CPU, which pyarrow already uses on
    several threads) and hands their rows on in order, so the output is reproducible. It holds
    at most about ``3 * concurrency + 2`` batches of ``batch_rows`` rows (rows as dicts:
    a batch's Arrow data, and its dicts :data:`ROW_BLOCK` at a time).

    Rows (``as_batches=False``) are dicts ``{column: value}`` of Python values
    (``RecordBatch.to_pylist()``: nested structs are dicts, lists are lists, nulls None); the
    :class:`DataLoader` collates them into a dict of arrays. Batches (``as_batches=True``) are
    dicts ``{column: numpy array}`` of up to ``batch_rows`` rows each (shorter at the end of a
    file or row group), writable, strings and nested values as object arrays and integer
    columns with nulls as floats with NaN (pyarrow's ``to_numpy``); use
    ``DataLoader(..., batch_size=None)`` to take them as they are.

    Files may be local or remote: ``s3://``, ``gs://`` and ``az://`` URLs, prefixes and
    patterns (listed as the other sources list them) and ``http(s)://`` URLs, read with
    bounded ranged requests: the footer, then only the chosen columns' chunks of the row
    groups this consumer reads (see the module's description). The object store and HTTP
    options are :class:`ShardedSource`'s.

    Args:
        urls: Parquet paths, directories or glob patterns (a directory stands for all its
            non-hidden files: prefer a pattern such as ``"data/*.parquet"``).
        columns: the columns to read (top-level names, or dotted paths into structs), or None
            for all. A column that a file lacks is a :class:`SourceError` naming the file.
        batch_rows: rows per batch read (and per item with ``as_batches=True``).
        as_batches: yield column batches instead of rows.
        shuffle_shards: shuffle the files (or row groups) at every epoch, seeded by
            ``seed + epoch``; rows keep their order within a unit (add ``.shuffle(n)``).
        seed: the shuffling seed; the same on every rank.
        rank: this process's rank (default: torch.distributed's initialized process group's,
            else ``RANK``, else 0).
        world_size: number of ranks (default: the process group's, else ``WORLD_SIZE``,
            else 1).
        even_ranks: ``True``: every rank reads the same number of units (files, or row
            groups when there are fewer files than consumers) per epoch, leaving one out in
            turn where needed (off by default: every unit read once, a warning when the
            ranks' shares differ); see :class:`ShardedSource`. With it on, fewer row groups
            in all than ranks is a ``ValueError`` at construction (the footers are read to
            count them when there are fewer files than ranks).
        records_per_rank: exactly this many rows (or, with ``as_batches``, batches) per
            rank and epoch, as :class:`ShardedSource` does it.
        concurrency: remote files read at once (read-ahead); local ones are read one at a
            time. ``"auto"``: as many as the store serves well (see
            :class:`ShardedSource`'s ``concurrency``).
        concurrency_limit: the most remote files ``"auto"`` reads at once (default 64).
        skip_errors: a corrupt file (or row group) is counted in ``stats.skipped`` and the rest
            of that file skipped, instead of raising its :class:`RecordError`.
        timeout: seconds for connecting and for each read of a remote file (None: no limit).
        retries: attempts of a remote read after its first one.
        backoff: delay before the first retry, in seconds; doubles at each retry.
        max_backoff: the longest delay between attempts.
        headers: extra HTTP request headers (authorization, ...).
        client_factory: makes the ``httpx.AsyncClient`` for a file's HTTP reads.
        store: an obstore store for every object store URL (custom credentials, endpoint).
        cache_dir: a local directory keeping the remote files read, as
            :class:`ShardedSource`'s (shared by processes, least recently used evicted). A
            file is downloaded whole into it at its first read (random access needs the whole
            file: every column is kept, whatever ``columns`` asks), then read locally; one
            larger than ``cache_limit`` allows is read by ranges, as without a cache.
        cache_limit: the most bytes ``cache_dir`` keeps (None: no limit).

    Attributes:
        stats: counters; ``bytes`` counts the compressed column chunks read and the footers
            (what the reads fetch), ``shards`` the files read to their end.

    Raises:
        ImportError: pyarrow is not installed.
        FileNotFoundError: a path does not exist.
        ValueError: a bad option.
        FetchError: listing an object store prefix failed.
        TypeError: ``columns`` is not a sequence of names.
    """

    def __init__(
        self,
        urls: ShardsLike,
        *,
        columns: Sequence[str] | None = None,
        batch_rows: int = DEFAULT_BATCH_ROWS,
        as_batches: bool = False,
        shuffle_shards: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        even_ranks: bool | None = None,
        records_per_rank: int | None = None,
        concurrency: int | Literal["auto"] = 2,
        concurrency_limit: int | None = None,
        skip_errors: bool = False,
        timeout: float | None = 30.0,
        retries: int = 5,
        backoff: float = 0.1,
        max_backoff: float = 10.0,
        headers: Mapping[str, str] | None = None,
        client_factory: Callable[[], Any] | None = None,
        store: Any = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
    ) -> None:
        _pyarrow()
        super().__init__(urls, shuffle_shards=shuffle_shards, seed=seed, rank=rank,
                         world_size=world_size, even_ranks=even_ranks,
                         records_per_rank=records_per_rank, concurrency=concurrency,
                         concurrency_limit=concurrency_limit, hedge=None,
                         skip_errors=skip_errors, timeout=timeout, retries=retries,
                         backoff=backoff, max_backoff=max_backoff, headers=headers,
                         client_factory=client_factory, store=store, cache_dir=cache_dir,
                         cache_limit=cache_limit)
        if columns is not None:
            if isinstance(columns, (str, bytes)) or not isinstance(columns, Sequence) \
                    or not all(isinstance(c, str) for c in columns):
                raise TypeError(f"columns should be a sequence of column names (or None for "
                                f"all), but got columns={columns!r}")
            if not columns:
                raise ValueError("columns should name at least one column (or be None for all)")
        self.columns: list[str] | None = None if columns is None else list(columns)
        self.batch_rows: int = check_int("batch_rows", batch_rows)
        self.as_batches: bool = bool(as_batches)
        self._row_groups: list[int] | None = None  # per file, once every footer was read
        if self.even_ranks is not None and len(self.shards) < self.world_size:
            check_ranks(sum(self._row_group_counts()[0]), rank=self.rank,
                        world_size=self.world_size, what="row group")

    def _check_ranks(self) -> None:
        pass  # at the end of __init__: row groups count too, and URLs are refused first

    # Resumed by counting, Stream's default (replay the epoch, drop what was delivered), not
    # by the shard offsets of the byte-stream sources: a row group is read whole anyway.
    _blocks_at = Stream._blocks_at

    # A count means nothing over another list of files (one landed in the directory since,
    # another split): the position names the list, as the byte-stream sources' name their
    # shard, so that such a resume is refused instead of skipping the wrong rows.
    def _files(self) -> str:
        digest = hashlib.sha256("\n".join(self.shards).encode()).hexdigest()[:16]
        return f"{len(self.shards)} files, sha256 {digest}"

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        return {**Stream._state(self, token, skip), "files": self._files()}

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        Stream._check(self, at, slot)
        check_same(at, "files", self._files(), type(self).__name__)

    def __repr__(self) -> str:
        return (f"ParquetRows({len(self.shards)} files, rank {self.rank} of {self.world_size}, "
                f"columns={self.columns}, as_batches={self.as_batches})")

    # Planning ----------------------------------------------------------------------------
    def _row_group_counts(self) -> tuple[list[int], dict[int, RecordError]]:
        """Row groups per file and the errors of unreadable footers (blocking: footers are
        read); cached once every footer was read."""
        if self._row_groups is not None:
            return self._row_groups, {}
        _, pq = _pyarrow()
        counts = []
        errors: dict[int, RecordError] = {}
        for index, name in enumerate(self.shards):
            try:
                handle = open_parquet_shard(name, self)
                try:
                    counts.append(pq.read_metadata(handle).num_row_groups)
                finally:
                    if not isinstance(handle, str):
                        handle.close()
            except Exception as exc:
                error = _located(name, exc)
                if not isinstance(error, RecordError):
                    _reraise(error, exc)
                errors[index] = error
                counts.append(0)
        if not errors:
            self._row_groups = counts
        return counts, errors

    def _plan(self, epoch: int, worker_id: int, num_workers: int,
              skipped: list[RecordError] | None = None) -> tuple[list[_Unit], int]:
        """What this consumer reads in an epoch (blocking in row-group mode), and the number
        of units of the epoch; the unreadable footers that it is the one to count as skipped
        are appended to ``skipped``."""
        consumers = self.world_size * num_workers
        split = functools.partial(assign_shards, rank=self.rank, world_size=self.world_size,
                                  worker_id=worker_id, num_workers=num_workers, epoch=epoch,
                                  seed=self.seed, shuffle=self.shuffle_shards,
                                  even=self.even_ranks)
        if len(self.shards) >= consumers:
            return ([_Unit(i, self.shards[i], None, True) for i in split(len(self.shards))],
                    len(self.shards))
        counts, errors = self._row_group_counts()
        for index, error in errors.items():
            # Every consumer read the bad footer; one of them counts it when skipping.
            skip = self.skip_errors and index % consumers == self.rank * num_workers + worker_id
            if not self.skip_errors:
                raise error
            if skip and skipped is not None:
                skipped.append(error)
        units = [(file, group) for file, count in enumerate(counts) for group in range(count)]
        mine = [units[i] for i in split(len(units))]
        # Consecutive row groups of one file are read with one open and one reader.
        plan = []
        for file, run in itertools.groupby(mine, key=lambda unit: unit[0]):
            groups = [group for _, group in run]
            plan.append(_Unit(file, self.shards[file], groups, counts[file] - 1 in groups))
        return plan, len(units)

    def _units(self, num_units: int) -> str:
        return "files" if num_units == len(self.shards) else "row groups"

    def _unit_name(self, unit: int, num_units: int) -> str:
        if num_units == len(self.shards):
            return f"file {unit} ({self.shards[unit]})"
        number = unit
        for file, count in enumerate(self._row_groups or ()):  # (None: a footer was bad)
            if number < count:
                return f"row group {number} of file {file} ({self.shards[file]})"
            number -= count
        return f"row group {unit} of the epoch"

    async def _planned(self, ctx: _Context, skipped: list[RecordError] | None = None
                       ) -> tuple[list[_Unit], int]:
        """:meth:`_plan` of the epoch: in a thread when it reads footers (row groups), else
        here (it only splits the list of files: a thread call would cost more)."""
        args = (ctx.epoch, ctx.worker_id, ctx.num_workers, skipped)
        # A blocking epoch (a sync for with no loop, see Stream._loopless) has no thread to
        # wait on: its reads all run on the consumer's thread.
        if ctx.blocking or len(self.shards) >= self.world_size * ctx.num_workers:
            return self._plan(*args)
        return await anyio.to_thread.run_sync(self._plan, *args)

    def units_for(
        self, epoch: int | None = None, worker_id: int | None = None,
        num_workers: int | None = None,
    ) -> list[tuple[str, list[int] | None]]:
        """What this rank's worker reads in an epoch: ``(file, row groups)`` in reading order,
        row groups None for the whole file.

        Args:
            epoch: the epoch (default: the one the next iteration uses).
            worker_id: the worker (default: this process's, 0 outside workers).
            num_workers: workers per rank (default: this process's, 1 outside workers).
        """
        own_id, own_count = worker_slot()
        plan, _ = self._plan(self.epoch if epoch is None else epoch,
                             own_id if worker_id is None else worker_id,
                             own_count if num_workers is None else num_workers)
        return [(unit.name, unit.groups) for unit in plan]

    def shards_for(
        self, epoch: int | None = None, worker_id: int | None = None,
        num_workers: int | None = None,
    ) -> list[str]:
        """The files this rank's worker reads from in an epoch (some only in part, in
        row-group mode: see :meth:`units_for`)."""
        return [name for name, _ in self.units_for(epoch, worker_id, num_workers)]

    # Reading -----------------------------------------------------------------------------
    async def _blocks(self, ctx: _Context) -> AsyncGenerator[list[Any], None]:
        if self.records_per_rank is None:
            async with Closing(self._pass(ctx, True)) as blocks:
                async for block in blocks:
                    yield block
                    del block  # not kept while the next is made (see _items)
            return
        _, num_units = await self._planned(ctx)
        quota, where = self._quota_of(ctx, num_units)
        first = [True]

        async def passes(_: object) -> AsyncGenerator[tuple[list[Any], Any], None]:
            async with Closing(self._pass(ctx, first[0])) as blocks:
                first[0] = False
                async for block in blocks:
                    yield block, None
                    del block

        async with Closing(_up_to(quota, passes, self.stats, where)) as pairs:
            async for block, _ in pairs:
                yield block

    async def _pass(self, ctx: _Context, first: bool) -> AsyncGenerator[list[Any], None]:
        """One pass over this consumer's units; the first of the epoch counts what it left
        (unreadable footers, a dropped unit)."""
        skipped: list[RecordError] = []
        plan, num_units = await self._planned(ctx, skipped)
        if first:
            bad = BadRecords(True, self.stats)
            for error in skipped:
                bad(error)
            self._note_shares(ctx, num_units)
        # Local files one at a time (see the module's description), in one thread of their
        # own; remote ones in anyio's threads (their reads run on the loop from there).
        if not plan:
            return
        if any(_is_remote(unit.name) for unit in plan):
            readers: list[Callable[[], AsyncGenerator[list[Any], None]]] = [
                functools.partial(self._read_unit, unit) for unit in plan
            ]
            async with Closing(read_in_order(ctx, readers, min(self._at_once(), len(readers)),
                                             self._tuning.tuner)) as blocks:
                async for block in blocks:
                    yield block
                    del block  # not kept while the next is made (see _items)
            return
        async with Closing(self._read_local(plan, ctx.blocking)) as blocks:
            async for block in blocks:
                yield block
                del block

    def _leaves(self, name: str, schema: Any) -> list[int]:
        """Indices of the leaf columns read; an unknown column is an error (pyarrow would
        silently read none)."""
        paths = [schema.column(i).path for i in range(len(schema))]
        if self.columns is None:
            return list(range(len(paths)))
        chosen: set[int] = set()
        for column in self.columns:
            match = [i for i, path in enumerate(paths)
                     if path == column or path.startswith(column + ".")]
            if not match:
                names = sorted({path.split(".", 1)[0] for path in paths})
                raise SourceError(f"{name}: no column {column!r} in this Parquet file (its "
                                  f"columns: {', '.join(names)})", source=name)
            chosen.update(match)
        return sorted(chosen)

    def _convert(self, batch: Any) -> Any:
        """What a read thread hands on of a batch: with ``as_batches``, its one item (a dict
        of numpy arrays, made there); else the Arrow batch itself, whose rows
        :meth:`_items` makes where they are consumed."""
        if self.as_batches:
            return [{name: column.to_numpy(zero_copy_only=False, writable=True)
                     for name, column in zip(batch.schema.names, batch.columns, strict=True)}]
        return batch

    def _items(self, got: Any) -> Iterator[list[Any]]:
        """The blocks of items of what :meth:`_convert` gave: its one column batch, or its
        rows, :data:`ROW_BLOCK` at a time (``RecordBatch.to_pylist`` of a slice, as
        :func:`_rows_of` makes them). Rows are made here, on the event loop, not in the read
        thread: the conversion holds the GIL either way (so a thread did not free the loop,
        only cut its work into switch intervals, 5 ms), a piece blocks the loop for about as
        long (4096 rows of five columns: ~1.5 ms), and made in the thread that consumes them,
        the rows are still in its caches.

        No stage of the chain keeps a block it handed on once the next is asked for (``del
        block`` after each yield; the consumer keeps only its length: see the resume notes
        of :mod:`aloader.streams._positions`), so a block's ~2 MB of dicts are freed before the next
        block is made, which reuses that memory while it is in the caches."""
        if self.as_batches:
            yield got
            return
        for start in range(0, got.num_rows, ROW_BLOCK):
            yield _rows_of(got.slice(start, ROW_BLOCK))

    async def _read_unit(self, unit: _Unit) -> AsyncGenerator[list[Any], None]:
        """One remote file's (or its row groups') rows, a block per batch, each read by a
        call of anyio's threads (whose reads run on the event loop from there)."""
        stats = self.stats
        bad = BadRecords(self.skip_errors, stats)
        reader = _UnitReader(self, unit)
        try:
            while True:
                try:
                    items, rows, read = await anyio.to_thread.run_sync(reader.next)
                except Exception as exc:
                    stats.bytes += reader.footer  # what the failed call read, if anything
                    error = _located(unit.name, exc)
                    if isinstance(error, RecordError) and bad(error):
                        return
                    _reraise(error, exc)
                stats.bytes += read
                stats.records += rows
                if items is not None:
                    for block in self._items(items):
                        yield block
                        del block  # not kept while the next is made (see _items)
                if items is None or reader.rows >= reader.total:
                    break
            if unit.owns_last:
                stats.shards += 1
        finally:
            reader.close()
            if isinstance(reader.handle, _RangeFile):
                await reader.handle.aclose()

    async def _read_local(self, plan: list[_Unit], blocking: bool = False
                          ) -> AsyncGenerator[list[Any], None]:
        """A pass's local units' rows, a block per batch (or per :data:`ROW_BLOCK` rows), one
        unit after another, each batch read by a call of one :class:`_ReadThread` (see
        :class:`_LocalReader`). A call runs to its end (a cancellation, or the end of the
        pass, waits for it), so a file is never closed under a read. With ``blocking`` (an
        epoch with no event loop: a sync ``for``, see :meth:`Stream._loopless`) each batch is
        read on this thread when it is asked for, with no thread and no read ahead.

        The next batch's read is queued before this one is handed on (one batch read
        ahead): the thread decodes it while rows are made here (:meth:`_items`) or a column
        batch is handed on (measured at 1M rows: rows ~0.8x the CPU time of converting whole
        batches in the thread with no read ahead; column batches 0.9-0.95x the wall time).
        """
        stats = self.stats
        bad = BadRecords(self.skip_errors, stats)
        local = _LocalReader(self, plan)
        thread = None if blocking else _ReadThread(shared=True)
        submit = functools.partial(_called, local.next) if thread is None \
            else functools.partial(thread.submit, local.next)
        pending: Callable[[], Awaitable[_LocalStep | None]] | None = None
        try:
            while True:
                call, pending = pending or submit(), None
                try:
                    got = await call()
                except _UnitFailed as failed:
                    stats.bytes += failed.read  # what the failed call read, if anything
                    unit = plan[failed.index]
                    error = _located(unit.name, failed.error)
                    if isinstance(error, RecordError) and bad(error):
                        continue  # the thread went on with the next unit
                    _reraise(error, failed.error)
                if got is None:
                    break
                index, items, rows, read, done = got
                if thread is not None:
                    pending = thread.submit(local.next)
                stats.bytes += read
                stats.records += rows
                if items is not None:
                    for block in self._items(items):
                        yield block
                        del block  # not kept while the next is made (see _items)
                if done and plan[index].owns_last:
                    stats.shards += 1
        finally:
            if pending is not None:
                # The read ahead runs to its end before its file is closed; what it read or
                # raised is not this pass's any more.
                with contextlib.suppress(Exception):
                    await pending()
            local.close()
            if thread is not None:
                thread.close()

