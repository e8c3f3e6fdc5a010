"""Ray Data as a source: :func:`from_ray` and the stream it makes, :class:`RayRows`.

A Ray ``Dataset`` (or a ``DataIterator``: a ``streaming_split`` part, Ray Train's
``get_dataset_shard``) becomes a :class:`~aloader.Stream` of its rows, so that a
:class:`~aloader.DataLoader` batches, collates, counts (``stats()``) and checkpoints it as any
other stream. Ray does the reading and the preprocessing (its own tasks and actors); aloader
takes the rows as they come.

Invariant: every epoch is one ``iter_rows()`` of the Ray object, pulled in a worker thread a
block of :data:`BLOCK_ROWS` rows at a time (Ray's iteration blocks; the event loop never
does, and a cancel does not wait for Ray to answer), so the rows come in Ray's order and the
stream holds at most one block beyond the stream's own read-ahead. Ray cannot seek into an
iteration, so a state saved mid-epoch is the number of rows the consumer received, and
resuming iterates anew and discards that many (the :class:`~aloader.Stream` base's resume by
counting, torchdata's fast-forward): exact wherever Ray's order repeats from one iteration
to the next (a materialized dataset, ``DataContext.execution_options.preserve_order =
True``, one consumer of a split); it costs reading those rows again.

ray is not imported here: the object given is only asked for ``iter_rows()`` (duck typing),
so anything with Ray's ``DataIterator`` interface works (the tests' stand-in does), and
``import aloader`` never imports Ray.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import anyio
import anyio.to_thread

from .._workerinfo import get_worker_info
from ..streams._context import _Context
from ..streams._stream import Stream

__all__ = ("BLOCK_ROWS", "RayRows", "from_ray")

#: Rows pulled from Ray per thread call (a block of the stream).
BLOCK_ROWS = 256


class RayRows(Stream[dict[str, Any]]):
    """The rows of a Ray ``Dataset`` or ``DataIterator``, as a stream (see :func:`from_ray`).

    Attributes:
        source: the Ray object, iterated anew (``iter_rows()``) at every epoch.
    """

    def __init__(self, source: Any) -> None:
        self.source = source

    def __repr__(self) -> str:
        return f"RayRows({type(self.source).__name__})"

    async def _blocks(self, ctx: _Context) -> AsyncGenerator[list[dict[str, Any]], None]:
        if get_worker_info() is not None:
            # Each worker would need a connection to the Ray cluster, and each would read the
            # whole dataset: Ray already reads in parallel, in its own processes.
            raise ValueError(
                "a from_ray() stream runs in the loader's process: use num_workers=0 (Ray "
                "Data reads and preprocesses in parallel itself; every loader worker would "
                "read the whole dataset again)")
        rows: Iterator[dict[str, Any]] = iter(self.source.iter_rows())
        busy = threading.Lock()  # held by the thread pulling from Ray

        def pull() -> list[dict[str, Any]]:
            with busy:
                return list(itertools.islice(rows, BLOCK_ROWS))

        def close() -> None:
            # Ray's iteration is a generator: closing it stops its prefetching. A pull still
            # running (abandoned by a cancel: Ray may wait on its cluster for long) keeps
            # it; it is closed when dropped.
            if busy.acquire(blocking=False):
                try:
                    getattr(rows, "close", lambda: None)()
                finally:
                    busy.release()

        try:
            # A cancel (a closed loader, a timeout, Ctrl-C) does not wait for Ray's answer.
            while block := await anyio.to_thread.run_sync(pull, abandon_on_cancel=True):
                yield block
                del block  # not kept while the next is made (see aloader.streams._positions)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(close)


def from_ray(dataset_or_shard: Any) -> Stream[dict[str, Any]]:
    """A Ray ``Dataset`` or ``DataIterator`` as an aloader :class:`~aloader.Stream` of rows.

    Give it a ``ray.data.Dataset``, one part of ``Dataset.streaming_split(n)``, or, in a Ray
    Train worker, ``ray.train.get_dataset_shard("train")``; the rows (dicts, as Ray's
    ``iter_rows()`` gives them) then go through aloader's stages and loader: ``map``,
    ``shuffle``, ``DataLoader(..., batch_size=..., collate_fn=...)``, ``stats()``,
    ``async for``, and ``state_dict()``::

        shard = ray.train.get_dataset_shard("train")
        loader = aloader.DataLoader(aloader.from_ray(shard), batch_size=64)
        for epoch in range(epochs):
            for batch in loader:
                ...

    Each epoch iterates the Ray object anew. Resume: Ray cannot seek into an iteration, so a
    checkpoint taken mid-epoch holds the number of rows delivered, and the resumed epoch
    iterates Ray again and skips them (resume by counting). It is exact where Ray gives the
    same order again (a materialized dataset, or ``preserve_order`` set in Ray's
    ``DataContext``; a ``streaming_split`` hands blocks to whichever part asks first, so
    its parts' orders vary); it costs reading the skipped rows again. A state taken between
    epochs resumes anywhere.

    Run it with ``num_workers=0``: Ray Data already reads and preprocesses in parallel (its
    own processes); a loader worker would need its own connection to the cluster and would
    read all of the data again (it raises ``ValueError``).

    Args:
        dataset_or_shard: a ``ray.data.Dataset`` or ``ray.data.DataIterator`` (anything
            with Ray's ``iter_rows()``). Install Ray with ``pip install aloader[ray]``.

    Returns:
        A stream of the rows (``dict`` per row).

    Raises:
        TypeError: the object has no ``iter_rows()``.
    """
    if isinstance(dataset_or_shard, Stream):
        raise TypeError("from_ray needs a Ray Dataset or DataIterator, but got an aloader "
                        f"Stream ({type(dataset_or_shard).__name__})")
    if not callable(getattr(dataset_or_shard, "iter_rows", None)):
        raise TypeError("from_ray needs a Ray Dataset or DataIterator (an object with "
                        f"iter_rows()), but got {type(dataset_or_shard).__name__}")
    return RayRows(dataset_or_shard)
