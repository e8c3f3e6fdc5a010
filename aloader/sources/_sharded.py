"""The base of the sources that read records from a list of shards (:class:`ShardedSource`)
and the options they share (:class:`SourceOptions`).

A sharded source reads a list of shards (local paths, directories, glob patterns,
``http(s)://`` URLs, or object store URLs, prefixes and patterns such as
``s3://bucket/data/*.jsonl``, freely mixed). Each epoch, the consumer (one worker of one rank)
reads its share of the shards (see :mod:`aloader.sources._sharding`), a few shards at a time
(:mod:`aloader.sources._readahead`), and hands their records on in shard order; what it reads
is counted once per epoch (:mod:`aloader.sources._counting`). A subclass gives the record
format (``_decoder``): :mod:`aloader.sources._sources` holds the ready ones.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import secrets
import warnings
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any, Literal, TypedDict, TypeVar, cast

from .._log import source_log
from .._stats import SourceStats
from .._tuning import Controller, Hedger, ReadTuning, check_concurrency, check_hedge
from .._util import Closing, check_int, check_seconds
from .._workerinfo import worker_slot
from ..io._cache import Fetch, ShardCache, Version, check_cache, make_version
from ..io._compression import (
    Compression,
    CorruptStream,
    Decompressor,
    check_compression,
    decompressed,
    decompressor_for,
    shard_compression,
)
from ..io._files import file_chunks
from ..io._http import HttpClient, HttpOptions, http_chunks, make_client
from ..io._objstore import ObjectAccess, is_object_url
from ..io._resumable import split_chunks
from ..streams._context import _Context
from ..streams._positions import (
    _START,
    _bad_state,
    _discard,
    check_field,
    check_same,
    check_stage,
)
from ..streams._stream import Stream
from ._clients import _Clients, _then_closed
from ._counting import _Counting, _Tally, _tally
from ._formats import BadRecords, Decoder
from ._identity import check_identity, file_identity, same_version
from ._quota import _up_to, even_mode, worker_quota
from ._readahead import SplitReader, read_in_order
from ._sharding import (
    EvenRanks,
    ShardsLike,
    assign_shards,
    check_ranks,
    expand_shards,
    is_url,
    rank_share,
    resolve_world,
    uneven_shares,
)

__all__ = ("ShardedSource", "SourceOptions")

T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")

DEFAULT_CONCURRENCY = 8
DEFAULT_CONCURRENCY_LIMIT = 64  # "auto": the most shards read at once (3 chunks each)
DEFAULT_CHUNK_SIZE = 1 << 16
DEFAULT_MAX_RECORD_BYTES = 1 << 26


class SourceOptions(TypedDict, total=False):
    """Keyword options common to every sharded source (see :class:`ShardedSource`)."""

    shuffle_shards: bool
    seed: int
    rank: int | None
    world_size: int | None
    even_ranks: bool | None
    records_per_rank: int | None
    concurrency: int | Literal["auto"]
    concurrency_limit: int | None
    hedge: float | Literal["auto"] | None
    chunk_size: int
    max_record_bytes: int
    skip_errors: bool
    timeout: float | None
    retries: int
    backoff: float
    max_backoff: float
    headers: Mapping[str, str] | None
    client_factory: Callable[[], Any] | None
    store: Any
    compression: Compression
    cache_dir: str | os.PathLike[str] | None
    cache_limit: int | None


class ShardedSource(Stream[T_co]):
    """Base of the sources that read records from a list of shards (files or URLs).

    Each epoch, this consumer (worker ``w`` of ``W`` of rank ``r`` of ``R``) reads the shards
    at positions ``r * W + w``, ``r * W + w + R * W``, ... of the epoch's shard order, so every
    shard is read exactly once per epoch across all ranks and workers. Up to ``concurrency``
    shards are read at once and their records handed on in shard order, so the output is
    reproducible. The memory held is bounded: at most ``concurrency * 3`` chunks of
    ``chunk_size`` bytes (decompressed) plus the stream's few blocks of read-ahead. The
    read-ahead holds bytes: a chunk is parsed into records when the consumer reaches it.

    Args:
        shards: a path, directory, glob pattern or ``http(s)://`` URL, or a sequence of them.
            Directories and patterns expand to their files sorted by name.
        shuffle_shards: shuffle the shard order at every epoch, with a permutation seeded by
            ``seed + epoch`` (the same on every rank and worker).
        seed: the shard shuffling seed; must be the same on every rank.
        rank: this process's rank; defaults to torch.distributed's initialized process
            group's, else the ``RANK`` environment variable, else 0.
        world_size: number of ranks; defaults to the process group's, else ``WORLD_SIZE``,
            else 1.
        even_ranks: ``True``: give every rank the same number of shards per epoch, so that
            a distributed job does not hang on a rank that ran out of batches. Each rank
            reads ``len(shards) // world_size`` shards: a rank whose share holds one more
            drops one of its shards that epoch, in turn (see
            :mod:`aloader.sources._sharding`), logged at INFO on ``aloader.sources`` and
            counted in ``stats.shards_dropped``. Equal shard counts mean equal batches only
            when the shards hold equal numbers of records; ``records_per_rank`` makes them
            exact. With it on, fewer shards than ranks is a ``ValueError`` at construction
            (a rank would read nothing). Off (None or ``False``, the default), every shard is
            read exactly once per epoch across the ranks, and the ranks may get different
            numbers of records: when their numbers of shards differ, rank 0 warns once per
            epoch (a ``UserWarning`` naming the imbalance and these two remedies).
        records_per_rank: deliver exactly this many records per epoch on every rank: each
            consumer stops at its part of it and, if its shards hold fewer, reads them again
            from the start (a new pass; the records read again are counted in
            ``stats.repeated``). The parts are ``records_per_rank // A`` (plus one for the
            first ``records_per_rank % A`` workers) for ``A = min(num_workers, len(shards) //
            world_size)`` workers on every rank, the others reading nothing, so the ranks
            also get the same number of batches. No shard is dropped. Like webdataset's
            ``with_epoch``; choose about the records per rank (``total / world_size``) for
            one pass. A consumer whose shards hold no record is a :class:`SourceError`.
        concurrency: shards read at once (read-ahead; one HTTP connection each), or
            ``"auto"``: as many as the store serves well, found from the reads' measured
            throughput and latency and lowered when the store throttles (see
            :mod:`aloader._tuning`; the limit and its history are in ``stats.concurrency``).
        concurrency_limit: the most shards ``"auto"`` reads at once (default 64): each holds
            up to three chunks of ``chunk_size``.
        hedge: ``"auto"`` (the default): a remote read whose answer is late beyond the 95th
            percentile of the source's recent ones gets a second request for the same range,
            the first answer is read and the other cancelled, with at most 5% extra requests
            (counted in ``stats.hedged``); a number of seconds: hedge after that long
            instead; None: never.
        chunk_size: bytes per read from a file or a response.
        max_record_bytes: longest line or record accepted (a guard on memory).
        skip_errors: skip malformed records instead of raising, counting them in
            ``stats.skipped`` (``stats.skipped_errors`` keeps the last errors). I/O errors and
            HTTP failures always raise.
        timeout: HTTP connect and read timeout in seconds (None: no limit).
        retries: HTTP attempts after the first, counted since the last byte received;
            connection errors, timeouts, 5xx and 408 are retried, other statuses are not. A
            store that throttles (429, a 503 with ``Retry-After``, an object store's 503
            SlowDown) is waited for (``Retry-After``, else the backoff) and asked again
            without using up ``retries``, counted in ``stats.throttled``.
        backoff: delay before the first retry (doubles at each one, with jitter).
        max_backoff: longest delay between retries.
        headers: extra HTTP request headers.
        client_factory: called at each epoch to make the ``httpx.AsyncClient`` (closed at the
            end of the epoch), for custom transports, proxies or authentication.
        store: an obstore store (``obstore.store.S3Store(...)``, ``GCSStore``, ``AzureStore``)
            used for every object store URL (``s3://bucket/key``, ``gs://``, ``az://``) of
            ``shards``, for custom credentials and endpoints; the URLs name objects as the
            store sees them (keys under its ``prefix``, if it has one). Without it, each
            bucket's store comes from the URL and the environment variables (see
            :mod:`aloader.io._objstore`). It must pickle, for worker processes.

    Object store URLs (``s3://``, ``gs://``, ``az://``, ``abfs://``) are read through obstore
    (``pip install obstore``): one ending in ``/`` stands for the objects under that prefix
    and one with ``*``, ``?`` or ``[`` for the keys it matches, listed at construction and
    sorted. They are streamed with ranged GETs, retried with the same ``retries``,
    ``backoff`` and ``timeout`` and resumed from the last byte handed on, as
    :mod:`aloader.io._objstore` describes; a missing object or bucket, refused credentials and
    an unreachable endpoint raise :class:`ObjectNotFoundError`,
    :class:`BucketNotFoundError`, :class:`AccessDeniedError` and
    :class:`EndpointUnreachableError` (all :class:`FetchError`).
        compression: ``"auto"`` (by the shard's suffix: ``.gz``/``.tgz``, ``.zst``, ``.bz2``),
            ``"gzip"``, ``"zstd"`` (needs the zstandard package), ``"bz2"`` or None (read the
            bytes as they are). Shards are decompressed as they stream, with bounded memory; a
            corrupt or truncated stream is a :class:`RecordError` naming the shard (skipped as
            one record, ending the shard, with ``skip_errors=True``). See
            :mod:`aloader.io._compression`.
        cache_dir: a local directory keeping the remote shards read (``http(s)://``,
            ``s3://``, ``gs://``, ``az://``), so that later epochs read them from local disk
            without any request; it may be shared by the processes of one machine (ranks,
            workers, jobs), which download each shard once. A copy is keyed by the URL and the
            object's version (size and ETag, or Last-Modified), so a changed object is
            downloaded again; a source pins the version it first sees (from its listing, or
            the store's first answer in a process). The first epoch still streams: records
            flow while the shard is written to the cache. Counted in ``stats.cache_hits``,
            ``cache_misses``, ``cache_bytes`` and ``cache_evicted``. An epoch whose shards
            (this consumer's) are all kept at their pinned versions is read as local files
            are: in the consumer's task (``async for``, the loader) or, for a sync ``for``,
            on its thread with no event loop, with no background task; a copy evicted
            meanwhile by another process is still downloaded, only without read-ahead. See
            :mod:`aloader.io._cache`. Local shards are read where they are.
        cache_limit: the most bytes ``cache_dir`` keeps (None: no limit); the least recently
            used shards are evicted to stay under it, and a shard that cannot fit is read
            without being kept. Needs ``cache_dir``.

    Resume (:meth:`~aloader.Stream.state_dict`): the state names this worker's shard (its
    number in the epoch's list and its name, checked on load), the byte offset and line or
    record number where the consumer's block starts, and the records to skip from there. A
    resumed shard is read from that offset: a seek for files, ``Range: bytes=offset-`` over
    HTTP, a ranged GET on object stores, so at most one chunk is read again. Compressed
    shards, ``.npy`` arrays and tar shards (whose header and pax records come first) are read
    again from their start, their delivered records skipped: offsets into a compressed stream
    cannot be seeked.

    HTTP bodies sent with a ``Content-Encoding`` (gzip, deflate; br and zstd when their
    package is installed) are decoded; any other coding is a :class:`FetchError` (see
    :mod:`aloader.io._http`).

    Attributes:
        shards: the expanded list of shards.
        rank: this process's rank.
        world_size: number of ranks.
        even_ranks: how the ranks are evened out: None (not at all), ``"shards"`` (the same
            number of shards) or ``"records"`` (``records_per_rank``).
        records_per_rank: the records per rank and epoch, or None.
        stats: :class:`~aloader.SourceStats` counters (records, bytes, skipped, ...): each
            epoch's content once, however often a part of it is read again (see its docs).

    Raises:
        FileNotFoundError: a shard path does not exist.
        ValueError: a bad option, an empty pattern or directory, a rank out of range, or
            (ranks evened out) fewer shards than ranks.
        FetchError: listing an object store prefix or pattern failed.
    """

    shards: list[str]
    shuffle_shards: bool
    seed: int
    rank: int
    world_size: int
    even_ranks: EvenRanks
    records_per_rank: int | None
    _even_arg: bool | None
    concurrency: int | Literal["auto"]
    concurrency_limit: int | None
    hedge: float | Literal["auto"] | None
    chunk_size: int
    max_record_bytes: int
    skip_errors: bool
    http: HttpOptions
    compression: Compression
    _shard_cache: ShardCache | None
    _objects: ObjectAccess
    _versions: dict[str, Version]
    stats: SourceStats

    def __init__(
        self,
        shards: ShardsLike,
        *,
        shuffle_shards: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        even_ranks: bool | None = None,
        records_per_rank: int | None = None,
        concurrency: int | Literal["auto"] = DEFAULT_CONCURRENCY,
        concurrency_limit: int | None = None,
        hedge: float | Literal["auto"] | None = "auto",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        skip_errors: bool = False,
        timeout: float | None = 30.0,
        retries: int = 5,
        backoff: float = 0.1,
        max_backoff: float = 10.0,
        headers: Mapping[str, str] | None = None,
        client_factory: Callable[[], Any] | None = None,
        store: Any = None,
        compression: Compression = "auto",
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
    ) -> None:
        self.compression = check_compression(compression)
        self._shard_cache = check_cache(cache_dir, cache_limit)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed should be an integer, but got seed={seed!r}")
        self.shuffle_shards = bool(shuffle_shards)
        self.seed = seed
        self.rank, self.world_size = resolve_world(rank, world_size)
        self._even_arg = even_ranks  # what even_ranks follows from on another world size
        self.even_ranks = even_mode(even_ranks, records_per_rank, self.world_size)
        self.records_per_rank = records_per_rank
        self.concurrency = cast(Any, check_concurrency("concurrency", concurrency))
        if concurrency_limit is not None:
            check_int("concurrency_limit", concurrency_limit)
            if concurrency != "auto":
                raise ValueError("concurrency_limit bounds concurrency='auto', but got "
                                 f"concurrency={concurrency!r}")
        self.concurrency_limit = concurrency_limit
        self.hedge = cast(Any, check_hedge("hedge", hedge, auto=True))
        self.chunk_size = check_int("chunk_size", chunk_size)
        self.max_record_bytes = check_int("max_record_bytes", max_record_bytes)
        self.skip_errors = bool(skip_errors)
        self.http = HttpOptions(
            timeout=None if timeout is None else check_seconds("timeout", timeout),
            retries=check_int("retries", retries, minimum=0),
            backoff=check_seconds("backoff", backoff),
            max_backoff=check_seconds("max_backoff", max_backoff),
            headers=dict(headers) if headers else None,
            chunk_size=self.chunk_size,
            client_factory=client_factory,
        )
        self._objects = ObjectAccess(store, self.http)
        self.shards: list[str] = expand_shards(shards, self._objects)
        # The versions of the remote shards this source reads from the cache (see _cache),
        # pinned by the listing where there was one.
        self._versions: dict[str, Version] = {}
        if self._shard_cache is not None:
            for url, meta in self._objects.listed.items():
                if (version := make_version(*meta)) is not None:
                    self._versions[url] = version
        self._objects.listed.clear()  # not carried to every worker
        tuner = (Controller(concurrency_limit or DEFAULT_CONCURRENCY_LIMIT)
                 if concurrency == "auto" else None)
        hedger = None if self.hedge is None else Hedger(
            None if self.hedge == "auto" else self.hedge)
        # Shared by this source's reads (and kept from epoch to epoch): the controller of its
        # shards read at once, and the hedger of its late answers.
        self._tuning = ReadTuning(tuner, hedger)
        self.stats = SourceStats(tuner=tuner)
        # Names this source's tallies in an epoch's reading (see _counting) the same in every
        # process: a worker's reading, carried to the loader, goes on in the next workers.
        self._tally_key = secrets.token_hex(8)
        if self.even_ranks is not None:
            self._check_ranks()

    def _loopless(self) -> bool:
        # Inline: local files, and remote shards whose copies are kept in the cache at the
        # version this source pinned (read as local files, no request: ShardCache.chunks),
        # for every shard this consumer reads in the epoch being opened. Any other remote read
        # needs the store, so a loop, and read-ahead to be fast. A copy evicted after this
        # look is still read right inline, from the store (ShardCache.chunks; on a loop of
        # its own in a blocking epoch), only without read-ahead.
        if not any(_remote(name) for name in self.shards):
            return True
        cache = self._shard_cache
        if cache is None or type(self)._blocks_at is not ShardedSource._blocks_at:
            return False  # (ParquetRows reads its own way: its copies, through threads)
        epoch, (worker_id, num_workers) = self._opening()
        versions = self._versions
        return all(not _remote(name) or cache.holds(name, versions.get(name))
                   for name in self.shards_for(epoch, worker_id, num_workers))

    def _opening(self) -> tuple[int, tuple[int, int]]:
        """The epoch and consumer ``(worker_id, num_workers)`` of the iteration being opened:
        the newest iterator's while it has received nothing (the loader's and ``async for``'s
        look, from its first ``_receive``), else those the next one claims (a sync ``for``'s
        look, before it opens its iterator)."""
        live = self._live() if self._live is not None else None
        if live is not None and live._token is _START and not live._finished \
                and live._driver is None and live._inline is None:
            return live._epoch, live._slot
        epoch = self._resume_epoch if self._resume_epoch is not None else self.epoch
        return epoch, worker_slot()

    def _world(self) -> list[int]:
        # records_per_rank is part of the split: each consumer's quota follows from it.
        world = [self.rank, self.world_size]
        return world if self.records_per_rank is None else [*world, self.records_per_rank]

    def _set_world(self, world: list[int]) -> None:
        rank, size, *quota = world
        self.rank, self.world_size = resolve_world(rank, size)
        self.records_per_rank = quota[0] if quota else None
        self.even_ranks = even_mode(self._even_arg, self.records_per_rank, size)

    def _check_ranks(self) -> None:
        """Refuse, at construction, a rank that would read nothing (ranks evened out)."""
        check_ranks(len(self.shards), rank=self.rank, world_size=self.world_size)

    def _note_shares(self, ctx: _Context, num_units: int) -> None:
        """At the start of an epoch (once per rank: by its worker 0), say what the ranks'
        shares are when they differ: the unit this rank drops because ``even_ranks=True``
        asked (logged at INFO, counted), or, with nothing dropped, a warning from rank 0
        naming the imbalance and the remedies."""
        extra = num_units % self.world_size
        if ctx.worker_id != 0 or not extra:
            return
        if self.even_ranks == "shards":
            if self.rank < extra:
                self.stats.shards_dropped += 1
                if not source_log.isEnabledFor(logging.INFO):
                    return
                _, dropped = rank_share(num_units, rank=self.rank, world_size=self.world_size,
                                        epoch=ctx.epoch, seed=self.seed,
                                        shuffle=self.shuffle_shards, even="shards")
                assert dropped is not None
                source_log.info(
                    "epoch %d: rank %d of %d leaves out %s (even_ranks=True: every rank reads "
                    "%d of the %d %s this epoch)", ctx.epoch, self.rank, self.world_size,
                    self._unit_name(dropped, num_units), num_units // self.world_size,
                    num_units, self._units(num_units))
        elif self.even_ranks is None and self.rank == 0:
            warnings.warn(uneven_shares(ctx.epoch, num_units, self.world_size,
                                        self._units(num_units)), UserWarning, stacklevel=2)

    def _units(self, num_units: int) -> str:
        """What the ``num_units`` units of an epoch are, in :meth:`_note_shares`'s words."""
        return "shards"

    def _unit_name(self, unit: int, num_units: int) -> str:
        """Unit number ``unit`` of an epoch of ``num_units``, in :meth:`_note_shares`'s words."""
        return f"shard {unit} ({self.shards[unit]})"

    def _decoder(self, name: str, bad: BadRecords) -> Decoder[T_co]:
        raise NotImplementedError

    def shards_for(
        self, epoch: int | None = None, worker_id: int | None = None,
        num_workers: int | None = None,
    ) -> list[str]:
        """The shards this rank's worker reads in an epoch, in reading order.

        Args:
            epoch: the epoch (default: the one the next iteration uses).
            worker_id: the worker (default: this process's, 0 outside workers).
            num_workers: workers per rank (default: this process's, 1 outside workers).
        """
        own_id, own_count = worker_slot()
        indices = assign_shards(
            len(self.shards),
            rank=self.rank,
            world_size=self.world_size,
            worker_id=own_id if worker_id is None else worker_id,
            num_workers=own_count if num_workers is None else num_workers,
            epoch=self.epoch if epoch is None else epoch,
            seed=self.seed,
            shuffle=self.shuffle_shards,
            even=self.even_ranks,
        )
        return [self.shards[i] for i in indices]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.shards)} shards, rank {self.rank} of "
                f"{self.world_size}, shuffle_shards={self.shuffle_shards})")

    def _quota_of(self, ctx: _Context, num_units: int) -> tuple[int, str]:
        """This consumer's part of ``records_per_rank`` and its name for errors."""
        assert self.records_per_rank is not None
        quota = worker_quota(self.records_per_rank, num_units, self.world_size,
                             ctx.worker_id, ctx.num_workers)
        names = self.shards_for(ctx.epoch, ctx.worker_id, ctx.num_workers)
        return quota, (f"worker {ctx.worker_id} of {ctx.num_workers} of rank {self.rank} of "
                       f"{self.world_size} (shards {names})")

    # Resume: a block's token is (shard number in this epoch's list, its name, the byte
    # offset and record counter where the block's first record starts, the records of the
    # shard before it, the shard's identity: see aloader.sources._identity). A resumed shard
    # is read from that offset (a seek, a Range request), except a compressed shard and
    # formats that need the shard's start (.npy headers, tar members), which are read from
    # their start, skipping the records already delivered. A resumed shard that ends before
    # the position's records is not the shard the state was taken in: an error, never a
    # skip carried into the next shard.

    def _blocks_at(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        skip = 0 if at is None else at["skip"]
        tuning = None if at is None else at.get("concurrency")
        if tuning is not None and self._tuning.tuner is not None:
            self._tuning.tuner.load_state_dict(tuning)
        if self.records_per_rank is None:
            return _discard(self._shard_blocks(ctx, at), skip)
        quota, where = self._quota_of(ctx, len(self.shards))
        numbers = itertools.count(0 if at is None else at["pass"])  # _up_to's, in its order

        def passes(start: dict[str, Any] | None) -> AsyncGenerator[tuple[list[T_co], Any], None]:
            return self._shard_blocks(ctx, start, next(numbers))

        repeated = _tally(ctx, (self._tally_key, ctx.epoch, "repeated"),
                          None if at is None else at["delivered"] + skip)[0]
        return _discard(_up_to(quota, passes, self.stats, where, at, repeated), skip)

    async def _shard_blocks(
        self, ctx: _Context, at: dict[str, Any] | None, number: int = 0
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        """Pass ``number`` over this consumer's shards (of ``records_per_rank``'s passes),
        from ``at``; what it counts goes on from what its reading counted of it (_Tally)."""
        names = self.shards_for(ctx.epoch, ctx.worker_id, ctx.num_workers)
        first = 0
        resume: tuple[int, int, int, int, Any] | None = None
        if at is not None:
            first = at["shard"]
            self._check_shard(at, names)
            resume = (at["offset"], at["counter"], at["records"], at["skip"],
                      at.get("identity"))
        counted, new = _tally(ctx, (self._tally_key, ctx.epoch, number),
                              None if at is None else at["records"] + at["skip"],
                              first, 0 if at is None else at["offset"])
        if at is None and new:
            self._note_shares(ctx, len(self.shards))
        # An inline epoch reads one shard after another in the consumer's task (or thread):
        # with no task of its own, nothing could read ahead.
        slots = 1 if ctx.inline else min(self._at_once(), len(names) - first)
        clients: _Clients | None = None
        # A blocking epoch reads only copies from the cache, on this thread, with no client;
        # a shard that needs the store after all makes its own (see _chunks).
        if not ctx.blocking and any(_remote(name) for name in names[first:]):
            # A connection per read-ahead slot (shard i reuses the keep-alive connection of
            # shard i - concurrency); a client_factory's one client is shared by all.
            clients = _Clients(self.http, 1 if self.http.client_factory is not None else slots,
                               hedging=self._tuning.hedger is not None)
        readers = [
            functools.partial(self._read, index, names[index],
                              None if clients is None else clients.slot(i),
                              resume if index == first else None, ctx.blocking, counted)
            for i, index in enumerate(range(first, len(names)))
        ]
        async with Closing(_then_closed(read_in_order(ctx, readers, slots, self._tuning.tuner),
                                        clients)) as blocks:
            async for block in blocks:
                yield block

    def _at_once(self) -> int:
        """The most shards read at once: ``concurrency``, or with ``"auto"`` its limit's
        bound (the controller decides how many of them, as the reads go)."""
        tuner = self._tuning.tuner
        return tuner.maximum if tuner is not None else cast(int, self.concurrency)

    @property
    def tuning(self) -> dict[str, Any] | None:
        """With ``concurrency="auto"``: the controller's limit, estimates and history (as in
        :attr:`LoaderStats.concurrency`), else None. Also ``stats.concurrency``."""
        return self.stats.concurrency

    def _check_shard(self, at: dict[str, Any], names: list[str]) -> None:
        shard = check_field(at, "shard", int, "shards")
        if shard >= len(names):
            raise _bad_state("shards", "shard", f"is {shard}, but this worker reads "
                             f"{len(names)} shards in this epoch")
        check_same(at, "name", names[shard], "shards")

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        check_stage(at, "shards", "shards")
        for field in ("offset", "counter", "records"):
            check_field(at, field, int, "shards")
        check_field(at, "name", str, "shards")
        check_field(at, "skip", int, "shards")
        if self.records_per_rank is not None:
            check_field(at, "pass", int, "shards")
            check_field(at, "delivered", int, "shards")
        tuning = at.get("concurrency")
        if tuning is not None and self._tuning.tuner is not None:
            try:
                Controller().load_state_dict(tuning)
            except ValueError as exc:
                raise _bad_state("shards", "concurrency", str(exc)) from None
        self._check_shard(at, self.shards_for(*slot))
        name = at["name"]
        # Each record before a seekable position took a byte at least (a line its newline);
        # a position read from the shard's start (compressed, or a format that needs it)
        # has offset 0 and counts its records only.
        for field in ("counter", "records"):
            if at["offset"] and at[field] > at["offset"]:
                raise _bad_state("shards", field, f"is {at[field]}, more than the bytes before "
                                 f"the position (offset {at['offset']}) could hold")
        check_identity(at, name, _remote(name),
                       shard_compression(name, self.compression) is not None)

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.records_per_rank is not None:
            number, delivered, token = token
            extra = {"pass": number, "delivered": delivered}
        index, name, offset, counter, records, identity = token
        if identity:
            extra["identity"] = dict(identity)
        tuner = self._tuning.tuner
        if tuner is not None:  # a resumed source starts at the limit it had
            extra["concurrency"] = tuner.state_dict()
        return {"stage": "shards", "shard": index, "name": name, "offset": offset,
                "counter": counter, "records": records, "skip": skip, **extra}

    def _read(
        self, index: int, name: str, client: Callable[[], HttpClient] | None,
        resume: tuple[int, int, int, int, Any] | None = None, blocking: bool = False,
        counted: _Tally | None = None,
    ) -> SplitReader:
        """One shard's records, block by block (a block per chunk, or per piece of one where
        the decoder has a ``piece``), with their tokens; from ``resume`` (offset, counter,
        records before, records of the block the consumer had, the shard's saved identity)
        if given; a local file read on this thread with ``blocking`` (a loopless epoch's);
        counted in the stats beyond what its pass ``counted``."""
        counting = _Counting(self.skip_errors, self.stats,
                             _Tally() if counted is None else counted, index)
        decoder = self._decoder(name, counting)
        inflate = decompressor_for(name, self.compression, self.chunk_size)
        start = records = skip = need = 0
        saved = None
        if resume is not None:
            offset, counter, records, need, saved = resume
            if decoder.seekable and inflate is None:
                decoder.start_at(offset, counter)
                start = offset
            else:
                skip, records = records, 0
        # Filled as the shard is opened (a file's) or answers first (a remote one's).
        identity: dict[str, Any] = {} if _remote(name) else file_identity(name) or {}

        def on_version(size: int | None, etag: str | None, modified: str | None) -> None:
            identity.update(same_version(name, saved, size, etag, modified) or {})

        def decode(chunks: AsyncGenerator[bytes, None]
                   ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
            blocks = self._records(index, name, decoder, chunks, records, start, counting,
                                   identity, saved)
            if skip:
                blocks = _discard(blocks, skip, f"shard {name!r}")
            # The records the consumer had of the position's block must be there.
            return _at_least(blocks, need, name) if need else blocks

        return SplitReader(
            functools.partial(self._chunks, name, client, decoder, inflate, start, blocking,
                              on_version),
            decode)

    def _fetch(
        self, name: str, client: Callable[[], HttpClient] | None, stats: SourceStats,
        on_size: Callable[[int], None] | None,
        on_version: Callable[[int | None, str | None, str | None], None] | None, start: int,
    ) -> AsyncGenerator[bytes, None]:
        """A remote shard's bytes from its store (HTTP or an object store), from ``start``."""
        if client is not None and is_url(name):
            return http_chunks(client(), name, self.http, stats, on_size, start, on_version,
                               tuning=self._tuning)
        # An object store may read through the epoch's HTTP client too (signed URLs).
        return self._objects.chunks(name, stats, on_size, start, on_version, client=client,
                                    tuning=self._tuning)

    def _fetch_alone(
        self, name: str, stats: SourceStats, on_size: Callable[[int], None],
        on_version: Callable[[int | None, str | None, str | None], None], start: int,
    ) -> AsyncGenerator[bytes, None]:
        """:meth:`_fetch` with an HTTP client of its own, closed with it: a blocking epoch's
        read of a shard whose copy went missing, run on an event loop of its own, which no
        client of the epoch belongs to."""
        client = make_client(self.http, 1) if is_url(name) else None
        return _then_closed(self._fetch(name, None if client is None else lambda: client,
                                        stats, on_size, on_version, start), client)

    def _chunks(
        self, name: str, client: Callable[[], HttpClient] | None, decoder: Decoder[T_co],
        inflate: Decompressor | None, start: int, blocking: bool = False,
        on_version: Callable[[int | None, str | None, str | None], None] | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """A shard's bytes from ``start`` (its store, the cache or a file), decompressed;
        ``on_version`` gets a remote shard's version from its store's first answer."""
        stats = self.stats
        # A compressed shard's size says nothing of the length its formats check.
        on_size = decoder.set_size if inflate is None else None
        if _remote(name):
            if self._shard_cache is None:
                chunks = self._fetch(name, client, stats, on_size, on_version, start)
            else:
                # With no loop (blocking), only a copy in the cache is read here (_loopless).
                fetch: Fetch = (functools.partial(self._fetch_alone, name, stats) if blocking
                                else functools.partial(self._fetch, name, client, stats))
                chunks = self._shard_cache.chunks(name, fetch, self._versions, stats,
                                                  self.chunk_size, on_size, start, blocking)
        else:
            chunks = file_chunks(name, self.chunk_size, on_size, start, blocking=blocking)
        if inflate is not None:
            chunks = decompressed(chunks, inflate)
        return chunks

    async def _records(
        self, index: int, name: str, decoder: Decoder[T_co],
        chunks: AsyncGenerator[bytes, None], records_before: int, start: int,
        counting: _Counting, identity: dict[str, Any], saved: dict[str, Any] | None = None,
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        """The records of a shard's ``chunks`` (its content from byte ``start``, its record
        ``records_before`` first), a block per chunk (per piece of one where the decoder has
        a ``piece``), with their tokens (``identity`` is the shard's, as it fills; ``saved``
        the identity a resumed shard must have); counted in the stats beyond what
        ``counting``'s reading counted already (see :class:`_Tally`)."""
        counting.start()
        done = records_before
        at = start  # the content's offset of the next chunk
        piece = decoder.piece
        try:
            async with Closing(chunks) as pieces:
                async for chunk in pieces:
                    if not identity and _remote(name):  # read from the cache: its version
                        version = self._versions.get(name)
                        if version is not None:
                            identity.update(same_version(name, saved, *version, None) or {})
                    end = at + len(chunk)
                    counting.count_bytes(at, end)
                    at = end
                    # A block per piece of the chunk where the format asks for smaller ones.
                    for part in (chunk,) if piece is None else split_chunks(chunk, piece):
                        records = decoder.feed(part)
                        if records:
                            first = done
                            done += len(records)  # before the yield, which may close this
                            counting.count_records(first, done)
                            yield records, (index, name, *decoder.mark, first, identity)
                        if decoder.pending is not None:
                            raise decoder.pending
        except CorruptStream as exc:
            # The rest of the shard is lost, its last partial record with it (never parsed).
            if not counting.end(exc.error):
                raise exc.error from None
            return
        while records := decoder.finish():
            first = done
            done += len(records)
            counting.count_records(first, done)
            yield records, (index, name, *decoder.mark, first, identity)
        if decoder.pending is not None:
            raise decoder.pending
        counting.end()


async def _at_least(blocks: AsyncGenerator[tuple[list[T], Any], None], need: int, name: str
                    ) -> AsyncGenerator[tuple[list[T], Any], None]:
    """A resumed shard's ``blocks``, which must hold at least ``need`` records from the
    position: fewer, the shard is not the one the state was taken in (or the state is not
    this stream's), and carrying the rest of the skip into the next shard would lose its
    records."""
    seen = 0
    async with Closing(blocks) as pairs:
        async for block, token in pairs:
            seen += len(block)
            yield block, token
    if seen < need:
        raise _bad_state("shards", "skip", f"is {need}, but shard {name!r} has only {seen} "
                         "records from the position's offset: it changed since the state was "
                         "saved, or the state is not this stream's")


def _remote(name: str) -> bool:
    """Whether shard ``name`` is read from a store (HTTP or an object store), not a file."""
    return is_url(name) or is_object_url(name)
