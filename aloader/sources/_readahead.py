"""Reading a consumer's shards in order, a few at a time (:func:`read_in_order`): reader
``i + concurrency`` starts once reader ``i`` has been consumed to its end, and the blocks are
handed on in shard order, so the output is reproducible.

Invariant: each running reader holds at most ``depth`` finished blocks plus the one it is
handing over; a :class:`SplitReader` holds bytes there, decoded only where they are consumed.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import anyio

from .._util import Closing, Signal
from ..streams._channel import _Channel
from ..streams._context import _Context


class SplitReader:
    """A shard read in two halves: ``fetch`` gives the shard's raw pieces (network, disk,
    decompression), ``decode`` turns them, in order, into the blocks the reader hands on.

    :func:`read_in_order` runs ``fetch`` ahead in its own task and ``decode`` where the blocks
    are consumed, so that what waits in the read-ahead is bytes, which the cyclic garbage
    collector never looks at, rather than thousands of decoded records per chunk, which every
    collection would walk (tens of milliseconds per JSON Lines epoch).
    """

    __slots__ = ("decode", "fetch")

    def __init__(self, fetch: Callable[[], AsyncGenerator[Any, None]],
                 decode: Callable[[AsyncGenerator[Any, None]], AsyncGenerator[Any, None]]
                 ) -> None:
        self.fetch = fetch
        self.decode = decode


#: What reads one shard when called: its blocks (an async generator), or a SplitReader.
Reader = Callable[[], AsyncGenerator[Any, None] | SplitReader]


def _blocks_of(reader: Reader) -> AsyncGenerator[Any, None]:
    """All of a reader's blocks, read and decoded in the calling task."""
    made = reader()
    if isinstance(made, SplitReader):
        return made.decode(made.fetch())
    return made


async def read_in_order(
    ctx: _Context,
    readers: Sequence[Reader],
    slots: int,
) -> AsyncGenerator[Any, None]:
    """The blocks of ``readers`` in order: one after another, or ``slots`` reading at once
    (:func:`_read_ahead`, two blocks deep) when ``slots`` > 1."""
    if slots <= 1:
        for reader in readers:
            async with Closing(_blocks_of(reader)) as blocks:
                async for block in blocks:
                    yield block
        return
    async with Closing(_read_ahead(ctx, readers, slots, 2)) as blocks:
        async for block in blocks:
            yield block


async def _drain(channel: _Channel[Any]) -> AsyncGenerator[Any, None]:
    """A channel's items until its end (its writer's error raised after them)."""
    while True:
        try:
            item = await channel.get()
        except StopAsyncIteration:
            return
        yield item


async def _read_ahead(
    ctx: _Context,
    readers: Sequence[Reader],
    concurrency: int,
    depth: int,
) -> AsyncGenerator[Any, None]:
    """The blocks of ``readers`` in order, with up to ``concurrency`` of them reading at once.

    Reader ``i + concurrency`` starts once reader ``i`` has been consumed to its end. Each
    running reader holds at most ``depth`` finished blocks (a :class:`SplitReader`: pieces,
    decoded here as they are consumed) plus the one it is handing over.
    """
    channels: list[_Channel[Any] | None] = [None] * len(readers)
    # What each reader made (set with its channel): the decode half of a SplitReader, or None.
    decoders: list[Callable[[AsyncGenerator[Any, None]], AsyncGenerator[Any, None]] | None] \
        = [None] * len(readers)
    slots = anyio.Semaphore(concurrency)
    signal = Signal()
    scope = anyio.CancelScope()

    async def read(source: AsyncGenerator[Any, None], channel: _Channel[Any]) -> None:
        try:
            async with Closing(source) as blocks:
                async for block in blocks:
                    await channel.put(block)
        except Exception as exc:  # _Abandoned included: then nobody reads it
            channel.end(exc)
        else:
            channel.end()

    launched = anyio.Event()

    async def launch() -> None:
        try:
            with scope:
                async with anyio.create_task_group() as group:
                    for index in range(len(readers)):
                        await slots.acquire()
                        channel: _Channel[Any] = _Channel(depth)
                        try:
                            made = readers[index]()
                        except Exception as exc:  # the reader's error, in its turn
                            channel.end(exc)
                        else:
                            if isinstance(made, SplitReader):
                                decoders[index] = made.decode
                                made = made.fetch()
                            group.start_soon(read, made, channel)
                        channels[index] = channel
                        signal.notify()
        finally:
            launched.set()

    ctx.spawn(launch)
    try:
        for index in range(len(readers)):
            while (channel := channels[index]) is None:
                await signal.wait()
            items = _drain(channel)
            decode = decoders[index]
            if decode is not None:
                items = decode(items)
            async with Closing(items) as blocks:
                async for block in blocks:
                    yield block
            slots.release()
    finally:
        scope.cancel()
        for channel in channels:
            if channel is not None:
                channel.abandon()
        # Readers share the epoch's HTTP client: they must be done before it closes.
        with anyio.CancelScope(shield=True):
            await launched.wait()
