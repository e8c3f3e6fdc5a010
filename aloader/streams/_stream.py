"""The fluent :class:`Stream` API: epochs (``set_epoch``), iteration (``async for``, a plain
``for``), resume (``state_dict`` / ``load_state_dict``) and the transforms ``shuffle``, ``map``
and ``filter``.

A :class:`Stream` is an :class:`~aloader.IterableDataset` with ``async def __aiter__``, so
``DataLoader(stream, batch_size=...)`` batches it. Internally every stage passes *blocks* (lists
of items) to the next one, so per-item costs stay small; the consumer still receives one item at
a time. An epoch runs in :mod:`aloader.streams._runtime` (a plain ``for``'s in
:mod:`aloader.streams._syncfor`); positions and their checks live in
:mod:`aloader.streams._positions`; each transform's stage is a module of its own
(:mod:`~aloader.streams._shuffle`, :mod:`~aloader.streams._map`,
:mod:`~aloader.streams._filter`, :mod:`~aloader.streams._interleave`), and
:func:`~aloader.as_stream` is :mod:`aloader.streams._iterated`'s.

Invariant: a stream's state is JSON builtins only (no items), and loading it on an equal
stream makes its next iteration yield exactly the rest of the saved epoch.
"""

from __future__ import annotations

import weakref
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Sequence,
)
from typing import Any, Literal, TypeVar, overload

from .._exceptions import FetchError, RecordError, SourceError
from .._facade import PrivateLoop, SyncIterator, forbid_running_loop
from .._util import Closing
from .._workerinfo import get_worker_info, served_epoch, worker_slot
from ..data._dataset import IterableDataset
from ..data._random import GeneratorLike
from ._context import _Context
from ._filter import FilterStage
from ._map import MapStage
from ._positions import (
    _END,
    _START,
    _bad_state,
    _discard,
    _state_of,
    check_field,
    check_same,
    check_stage,
)
from ._runtime import _StreamIterator
from ._shuffle import ShuffleStage
from ._syncfor import _LocalPairs, _Pairs, _sync_items

__all__ = (
    "FetchError",
    "RecordError",
    "SourceError",
    "Stream",
)

T_co = TypeVar("T_co", covariant=True)
U = TypeVar("U")

STATE_FORMAT = "aloader.Stream"
STATE_VERSION = 1


class Stream(IterableDataset[T_co]):
    """A composable async stream of items: an iterable dataset with ``async def __aiter__``.

    Every ``async for`` over a stream is one epoch. Without :meth:`set_epoch`, each new
    iteration advances the epoch counter (0, 1, 2, ...), which seeds shard orders and shuffles
    together with their seeds, like ``DistributedSampler``'s ``seed + epoch``. After
    ``set_epoch(e)`` every iteration uses epoch ``e`` until the next call.

    With loader worker processes, the loader's copy of the stream claims each epoch's number
    as an iteration would (``set_epoch``'s value, else its counter, which advances), and the
    workers' copies iterate that epoch, persistent or not. So every epoch has a new order, the
    same sequence of orders per seed: with one worker exactly that of ``num_workers=0``; with
    more, each epoch's shard order is that of ``num_workers=0``, split across the workers, and
    each worker's shuffles are seeded by (seed, epoch, worker). Another stream iterated
    inside a worker (held by a dataset of your own) uses its own ``set_epoch`` value if it has
    one, else the loader's epoch (:attr:`aloader.WorkerInfo.epoch`).

    Streams compose: ``source.shuffle(1000, seed=0).map(parse, concurrency=16).filter(ok)``,
    and :func:`interleave` mixes several. Memory stays bounded: an epoch reads at most a couple
    of blocks ahead of its consumer, and every stage documents what it holds.

    Streams resume (torchdata's protocol): :meth:`state_dict` says where the consumer of the
    current epoch is, and :meth:`load_state_dict` on an equal stream makes its next iteration
    yield exactly the rest of that epoch, then the same later epochs. Sources resume inside a
    shard at the record (a seek, a ``Range`` request), ``shuffle`` by replaying its input from
    a checkpoint, ``map`` and ``filter`` through their input, ``interleave`` from each input's
    position; a stage of your own that only defines ``_blocks`` is replayed from its start
    and the items the consumer had discarded. ``map(..., ordered=False)`` has no position to
    save (:meth:`state_dict` raises ValueError). A state belongs to one loader worker slot
    (``worker`` in it: [id, num_workers]) and, during an epoch, to one rank of one world size
    of its sharded sources (``world``): ``load_state_dict`` resumes it in the same slot and
    on the same rank; a :class:`~aloader.DataLoader`'s own state resumes with any
    ``num_workers`` (it runs the saved slots as virtual replicas), and on any world size
    between epochs, never inside one (each rank's shards would change).
    """

    # Class-level defaults keep subclasses free of any required __init__ call.
    _fixed_epoch: int | None = None
    _next_epoch: int = 0
    #: Blocks the background task may read ahead of the consumer.
    _prefetch_blocks: int = 2
    # The latest iterator (for state_dict), and what load_state_dict left for the next one.
    _live: weakref.ref[Any] | None = None
    _resume_epoch: int | None = None
    _resume_at: dict[str, Any] | None = None
    # Per worker slot: (epoch, reading) of the latest iterator, until it read to the end.
    _readings: dict[tuple[int, int], tuple[int, dict[Any, Any]]] | None = None

    def _blocks(self, ctx: _Context) -> AsyncGenerator[list[T_co], None]:
        """This epoch's items, in blocks (lists); subclasses implement it."""
        raise NotImplementedError

    def _upstreams(self) -> Sequence[Stream[Any]]:
        return ()

    def _loopless(self) -> bool:
        """Whether this stage's epoch can run inline: given a :class:`_Context` with no task
        group, its ``_blocks_at`` starts no task, and with ``blocking`` it awaits no real
        event (no thread, no sleep). Then a sync ``for`` drives the chain on the consumer's
        thread with no loop (:class:`_LocalPairs`), and an ``async for`` (or the loader's
        ``_take``) pulls it in the consumer's own task, with no background task and no
        channel between them (:meth:`_StreamIterator._receive`). False unless a stage says
        so."""
        return False

    @property
    def epoch(self) -> int:
        """The epoch the next iteration will use."""
        return self._fixed_epoch if self._fixed_epoch is not None else self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for every following iteration (of this stream and its inputs).

        Args:
            epoch: epoch number; with the seeds, it decides shard orders and shuffles.
        """
        self._fixed_epoch = int(epoch)
        for upstream in self._upstreams():
            upstream.set_epoch(epoch)

    def __aiter__(self) -> AsyncIterator[T_co]:
        """Start one epoch: items one by one, read in the background at most a few blocks
        ahead of the consumer (a loopless stream's, such as ``TextLines`` over local files:
        in the consumer's task as it reaches them);
        after :meth:`load_state_dict`, the rest of the epoch it saved.

        The iterator is an async generator (``aclose()`` closes it; leaving an ``async for``
        early leaves it to be closed when it is garbage-collected, as any async generator).
        """
        return self._open().items()

    def _open(self) -> _StreamIterator[T_co]:
        """Start one epoch: its iterator, with the position :meth:`state_dict` reads (the
        loader's way in: it cuts batches with ``_take``)."""
        at = self._resume_at
        epoch = self._claim_epoch()
        iterator = _StreamIterator(self, epoch, self._prefetch_blocks, at,
                                   self._reading_of(epoch, at))
        if at == _END:
            iterator._finished = True
        self._live = weakref.ref(iterator)
        return iterator

    def _reading_of(self, epoch: int, at: dict[str, Any] | None) -> dict[Any, Any]:
        """The reading an iteration of ``epoch`` opened now from ``at`` counts into
        (:attr:`_Context.reading`): from a position inside the epoch, the reading of this
        stream's latest iterator of it in this worker slot if that one did not read to the
        end (a state this stream saved, resumed: its counts go on, what the old iterator read
        ahead is not counted again); else a new one (an epoch from its start, or a state
        saved by another stream, which counts from its position)."""
        slot = worker_slot()
        readings = self._readings
        if readings is None:
            readings = self._readings = {}
        kept = readings.get(slot)
        if at is not None and kept is not None and kept[0] == epoch:
            return kept[1]
        reading: dict[Any, Any] = {}
        readings[slot] = (epoch, reading)
        return reading

    def _reading_done(self, slot: tuple[int, int], reading: dict[Any, Any]) -> None:
        """``reading`` (of worker ``slot``) read its epoch to the end (see _reading_of).

        In a loader's worker it stays: the worker's pipeline reads ahead of the loader's
        consumer, whose epoch is not over yet (the loader forgets it when it is)."""
        if served_epoch() is not None:
            return
        readings = self._readings
        if readings is not None:
            kept = readings.get(slot)
            if kept is not None and kept[1] is reading:
                del readings[slot]

    # Resume (torchdata's protocol) -------------------------------------------------------
    def _blocks_at(
        self, ctx: _Context, at: dict[str, Any] | None
    ) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        """This epoch's (block, token) pairs from position ``at`` (None: the start); see
        ``_state``. A stage that only defines ``_blocks`` is resumed by counting: its epoch
        is replayed from the start and the items the consumer had are discarded."""
        if at is not None:
            check_stage(at, "count", type(self).__name__)
        return _discard(self._counted(ctx), 0 if at is None else at["skip"])

    async def _counted(self, ctx: _Context) -> AsyncGenerator[tuple[list[T_co], Any], None]:
        count = 0
        async with Closing(self._blocks(ctx)) as blocks:
            async for block in blocks:
                size = len(block)
                yield block, count
                del block  # not kept while the next is made (see aloader.streams._positions)
                count += size

    def _state(self, token: Any, skip: int) -> dict[str, Any]:
        """The position at item ``skip`` of the block ``token`` names, as JSON builtins."""
        return {"stage": "count", "skip": int(token) + skip}

    def _check(self, at: dict[str, Any], slot: tuple[int, int, int]) -> None:
        """Validate a position of this stage (and its inputs) before anything is applied, for
        ``slot``: (epoch, worker id, num_workers)."""
        check_stage(at, "count", type(self).__name__)

    def state_dict(self) -> dict[str, Any]:
        """Where this stream is: the epoch counter and, during an epoch, the position of the
        consumer of its latest iterator (what it received, not what was read ahead).

        The state is small, JSON builtins only (no items): shard, byte offset and record
        numbers of the sources, the shuffle buffer's random state and where its input must
        be replayed from, ... :meth:`load_state_dict` on an equal stream (same arguments,
        same shards) resumes it exactly. A :class:`~aloader.DataLoader` records the position
        of each batch it cuts, so its own ``state_dict`` reflects the batches delivered.
        """
        live = self._live() if self._live is not None else None
        snapshot = live._snapshot() if isinstance(live, _StreamIterator) else None
        return self._state_from(snapshot)

    def _state_from(self, snapshot: tuple[Any, ...] | None, *,
                    counters: Stream[Any] | None = None, at_end: bool = False
                    ) -> dict[str, Any]:
        """The state for an iterator's ``_snapshot()`` (None: no epoch under way); the epoch
        counters are those of ``counters`` (by default this stream). A finished iterator
        means no epoch under way, or with ``at_end`` (a loader's epoch that has not ended
        yet) its epoch at its end, which resumes with nothing left."""
        owner = self if counters is None else counters
        state: dict[str, Any] = {
            "format": STATE_FORMAT, "version": STATE_VERSION, "stream": type(self).__name__,
            "next_epoch": owner._next_epoch, "fixed_epoch": owner._fixed_epoch,
            "epoch": None, "position": None, "worker": [0, 1], "world": self._worlds(),
        }
        if snapshot is not None:
            epoch, token, pos, finished, at, slot = snapshot
            state["worker"] = [slot[0], slot[1]]
            if finished and at_end:
                state["epoch"], state["position"] = epoch, _END
            elif not finished:
                state["epoch"] = epoch
                state["position"] = at if token is _START else _state_of(self, token, pos)
        seeds = [stage.seed for stage in self._unseeded()]
        if seeds:
            state["seeds"] = seeds
        return state

    def _unseeded(self) -> list[ShuffleStage[Any]]:
        """The shuffles of this chain built without a seed (which drew one), inputs depth
        first, in an order that is the same in every copy of the chain."""
        found: list[ShuffleStage[Any]] = []
        seen: set[int] = set()

        def visit(stream: Stream[Any]) -> None:
            if id(stream) in seen:
                return
            seen.add(id(stream))
            if isinstance(stream, ShuffleStage) and not stream.seed_given:
                found.append(stream)
            for upstream in stream._upstreams():
                visit(upstream)

        visit(self)
        return found

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration continues the saved epoch
        where its consumer was (or starts the next one, if none was under way).

        Raises:
            ValueError: a state of another format or version, of another kind of stream,
                stage or shard list, taken by another loader worker, or taken during an epoch
                on another rank or world size; it names the field. Nothing is applied then.
            TypeError: ``state`` is not a dict.
        """
        self._apply_state(self._parse_state(state, worker_slot()))

    def _parse_state(self, state: Any, slot: tuple[int, int]) -> tuple[Any, ...]:
        """The validated parts of a state meant for worker ``slot`` (id, num_workers)."""
        where = type(self).__name__
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict needs a dict, but got {type(state).__name__}")
        check_same(state, "format", STATE_FORMAT, where)
        check_same(state, "version", STATE_VERSION, where)
        check_same(state, "stream", type(self).__name__, where)
        next_epoch = check_field(state, "next_epoch", int, where)
        fixed = check_field(state, "fixed_epoch", (int, type(None)), where)
        epoch = check_field(state, "epoch", (int, type(None)), where)
        position = check_field(state, "position", (dict, type(None)), where)
        worker = check_field(state, "worker", list, where)
        if worker != list(slot):
            # A loader resumes another num_workers' replicas as virtual ones, each in its
            # saved slot (aloader.loader._epochs): a mismatch is a state given to the wrong replica.
            raise _bad_state(where, "worker", f"is {worker!r} ([worker id, num_workers]), but "
                             f"this is worker {list(slot)}: a stream's state resumes in the "
                             "worker slot it was saved in (a DataLoader resumes it with any "
                             "num_workers)")
        world = check_field(state, "world", list, where)
        if position is not None and world != self._worlds():
            raise _bad_state(where, "world", f"is {world!r} ([rank, world_size] of each "
                             "sharded source, and its records_per_rank where set), but this "
                             f"stream's is {self._worlds()!r}: a "
                             "state taken during an epoch resumes only on the same rank of "
                             "the same world size (one taken between epochs, on any)")
        if position is not None:
            if epoch is None:
                raise _bad_state(where, "epoch", "is None, but a position is given")
            if position != _END:
                self._check(position, (epoch, slot[0], slot[1]))
        seeds = state.get("seeds")
        unseeded = self._unseeded()
        if seeds is not None and (not isinstance(seeds, list) or len(seeds) != len(unseeded)
                                  or not all(type(seed) is int and seed >= 0 for seed in seeds)):
            raise _bad_state(where, "seeds", f"is {seeds!r}, but this stream has "
                             f"{len(unseeded)} shuffles built without a seed, whose seeds "
                             "it should list (non-negative ints)")
        return next_epoch, fixed, epoch, position, seeds

    def __getstate__(self) -> dict[str, Any]:
        # The latest iterator is this process's (and a weak reference does not pickle).
        state = self.__dict__.copy()
        state.pop("_live", None)
        # What each worker slot's reading counted of an epoch it did not read to the end
        # goes along (small: a tally per pass), so that a copy resuming that epoch in the
        # same slot (a loader's next workers) counts on from it, not again.
        if state.get("_readings"):
            state["_readings"] = dict(state["_readings"])
        return state

    def _worlds(self) -> list[list[int]]:
        """The split of every sharded source of this stream (:meth:`_world`), inputs first
        to last: a position inside an epoch belongs to that split of the shards."""
        worlds = []
        own = self._world()
        if own is not None:
            worlds.append(own)
        for upstream in self._upstreams():
            worlds.extend(upstream._worlds())
        return worlds

    def _world(self) -> list[int] | None:
        """This stage's split of its shards, ``[rank, world_size]`` (None: it has none)."""
        rank, size = getattr(self, "rank", None), getattr(self, "world_size", None)
        return [rank, size] if type(rank) is int and type(size) is int else None

    def _set_worlds(self, worlds: list[list[int]]) -> None:
        """Put every sharded source of this stream on the split of ``worlds``, in
        :meth:`_worlds`' order (it takes them off the front): a copy made to finish an epoch
        another rank of another world size began (see aloader.streams._resume)."""
        if self._world() is not None:
            self._set_world(worlds.pop(0))
        for upstream in self._upstreams():
            upstream._set_worlds(worlds)

    def _set_world(self, world: list[int]) -> None:
        # A stage of your own that splits by its rank and world_size attributes (_world);
        # not declared on Stream, which has neither.
        vars(self).update(rank=world[0], world_size=world[1])

    def _apply_state(self, parsed: tuple[Any, ...]) -> None:
        self._next_epoch, self._fixed_epoch, self._resume_epoch, self._resume_at = parsed[:4]
        seeds = parsed[4] if len(parsed) > 4 else None
        if seeds is not None:  # the seeds the unseeded shuffles drew in the saved run
            for stage, seed in zip(self._unseeded(), seeds, strict=True):
                stage.seed = seed

    def __iter__(self) -> Iterator[T_co]:
        """One epoch for synchronous code: what ``async for`` over the stream yields.

        A loopless stream (:meth:`_loopless`: a sharded source whose shards are all local
        files, such as ``TextLines(dir)`` or ``JsonLines(dir)``, with any compression,
        sharding, ``records_per_rank`` or ``skip_errors``) runs its epoch on this thread with
        no event loop and no thread: each block is read (one shard after another, a blocking
        read as a plain ``open(f)`` loop's), decoded and handed on when the consumer reaches
        it. Any other stream (remote shards, transforms, streams of
        your own) runs on an event loop of its own in a background thread (see
        :mod:`aloader._facade`), closed with the iterator, and its items cross to this thread
        in whole blocks. Both run the same chain of stages, so they give the same items,
        stats and states. Leaving the ``for`` early (``break``, an exception) closes the
        stream's iterator and so its files and connections, as leaving an ``async for`` does,
        and so does the iterator's ``close()``. :meth:`state_dict` says what this thread
        received, not what was read ahead.

        Raises:
            RuntimeError: a ``for`` inside a running event loop, which it would block.
        """
        forbid_running_loop("Stream", "item in stream")
        if self._loopless():
            iterator = self._open()
            return _sync_items(iterator, _LocalPairs(iterator))
        opened: list[_StreamIterator[T_co]] = []

        def open_() -> AsyncIterator[tuple[list[T_co], Any]]:
            # On the loop, as an async for would open it there.
            opened.append(self._open())
            return _Pairs(opened[0])

        pairs = SyncIterator(open_, PrivateLoop(), owns_loop=True)
        return _sync_items(opened[0], pairs)

    def _claim_epoch(self) -> int:
        """The epoch of an iteration starting now; advances the counter as iterating does.

        The loader calls it on its copy when its workers iterate the stream instead.
        """
        resumed, self._resume_epoch, self._resume_at = self._resume_epoch, None, None
        served = served_epoch()
        if served is not None:  # in a loader worker
            info = get_worker_info()
            if info is not None and info.dataset is self:
                return served  # what the loader's copy claimed, set_epoch included
            if self._fixed_epoch is None:
                self._next_epoch = served + 1
                return served
        if resumed is not None:  # the epoch a state was saved in (already counted)
            return resumed
        if self._fixed_epoch is not None:
            return self._fixed_epoch
        epoch = self._next_epoch
        self._next_epoch = epoch + 1
        return epoch

    # Transforms --------------------------------------------------------------------------
    def shuffle(self, buffer_size: int, seed: GeneratorLike = None) -> Stream[T_co]:
        """Shuffle the stream through a buffer of ``buffer_size`` items (webdataset's
        ``shuffle(n)``, tf.data's ``shuffle``).

        The buffer fills with the first ``buffer_size`` items; then each new item takes the
        place of a uniformly chosen buffered one, which is emitted; at the end the rest is
        emitted in random order. The stage never holds more than ``buffer_size`` items. The
        order depends only on the input order, the seed, the epoch and the worker, so it is
        reproducible.

        Its saved state holds no item: a checkpoint (the input's position, the random state
        and how full the buffer was, taken every ``max(256, buffer_size)`` input items)
        older than every buffered item, and the outputs to discard. Resuming replays the input
        from there, about ``buffer_size * (ln(buffer_size) + 1)`` items (measured: 940 for
        100, 9 900 for 1 000, 100 000 for 10 000), and continues exactly.

        Args:
            buffer_size: items held at most (1 keeps the order).
            seed: None (fresh entropy), an int or a numpy Generator; one base seed is drawn
                from it at construction and each epoch's shuffle is seeded by
                ``(base seed, epoch, worker)``.

        Raises:
            ValueError: ``buffer_size`` is not a positive integer.
        """
        return _Shuffled(self, buffer_size, seed)

    @overload
    def map(
        self, fn: Callable[[T_co], Awaitable[U]], *, concurrency: int | Literal["auto"] = 1,
        ordered: bool = True, concurrency_limit: int | None = None,
    ) -> Stream[U]: ...

    @overload
    def map(
        self, fn: Callable[[T_co], U], *, concurrency: int | Literal["auto"] = 1,
        ordered: bool = True, concurrency_limit: int | None = None,
    ) -> Stream[U]: ...

    def map(
        self,
        fn: Callable[[T_co], Any],
        *,
        concurrency: int | Literal["auto"] = 1,
        ordered: bool = True,
        concurrency_limit: int | None = None,
    ) -> Stream[Any]:
        """Apply ``fn`` to every item.

        ``fn`` may be a plain function or an ``async def``. With ``concurrency=1`` calls run
        one at a time on the event loop (a plain function should be quick). With
        ``concurrency=n > 1``, up to ``n`` calls run at once: async functions on the event
        loop, plain functions in worker threads (for blocking I/O or code that releases the
        GIL). The stage then holds at most ``2 * n`` items (running or finished and waiting),
        and starts its helper tasks as items arrive, so a huge ``n`` costs nothing more than
        the calls actually in flight. A failing call raises its error once the results before
        it are delivered, whatever the concurrency.

        ``concurrency="auto"`` lets the calls in flight tune themselves from their measured
        throughput and latency (see :mod:`aloader._tuning`), up to ``concurrency_limit``
        (default 1024): for a function that calls a remote service whose good concurrency you
        do not know. The controller's limit and history are in the stream's ``tuning``; the
        stage's state (``state_dict``) keeps its limit. A call that raises
        :class:`~aloader.Throttled` waits ``retry_after`` (or a growing backoff) and is made
        again, in its place, counted in the stage's ``throttled``, not as an error.

        Args:
            fn: the function.
            concurrency: calls in flight at most, or ``"auto"``.
            ordered: keep the input order (True), or emit results as they finish (False: not
                reproducible, but one slow item does not hold back the others).
            concurrency_limit: the most calls ``"auto"`` lets run at once (default 1024).

        Raises:
            ValueError: ``concurrency`` is not a positive integer or ``"auto"``, or
                ``concurrency_limit`` is not a positive integer (or is given without
                ``"auto"``).
        """
        return _Mapped[Any](self, fn, concurrency, ordered, concurrency_limit)

    def filter(self, predicate: Callable[[T_co], bool | Awaitable[bool]]) -> Stream[T_co]:
        """Keep the items for which ``predicate`` (plain or ``async def``) is true.

        Args:
            predicate: called once per item, in order.
        """
        return _Filtered(self, predicate)


# --------------------------------------------------------------------------- the transforms
#
# Each transform's stage is a module of its own (_shuffle, _map, _filter) that needs Stream
# only for its annotations; its stream class is made here, where the method that returns it
# is, so that the modules import one way.


class _Shuffled(ShuffleStage[T_co], Stream[T_co]):
    """``shuffle``'s stream (:mod:`aloader.streams._shuffle`)."""


class _Mapped(MapStage[U], Stream[U]):
    """``map``'s stream (:mod:`aloader.streams._map`)."""


class _Filtered(FilterStage[T_co], Stream[T_co]):
    """``filter``'s stream (:mod:`aloader.streams._filter`)."""
