"""The sync ``for``'s hand-off: a consumer waiting on the empty queue is woken once per block.

No test asserts a duration.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import pytest
from loopthreads import ignore_earlier_loops, loop_threads  # noqa: F401

import aloader
from aloader._facade import UVLOOP_ENV, PrivateLoop, SyncIterator, _Pump


class _Holder:
    pump: _Pump | None = None


async def _until_the_consumer_waits(holder: _Holder) -> _Pump:
    """On the loop: until the consumer waits on the empty hand-off queue."""
    while True:
        pump = holder.pump
        # The queue empty too: the flag of a wait whose batches were just put is still up
        # until the consumer wakes, and it takes them all before waiting again.
        if pump is not None and pump.consumer_waits and pump.out.qsize() == 0:
            return pump
        await asyncio.sleep(0.001)


def test_the_batches_of_one_loop_step_reach_a_waiting_consumer_together() -> None:
    # Made in one step of the loop while the consumer waits, batches wait in the pump until
    # the step ends and then cross together: the consumer's thread is woken (and handed the
    # GIL) once for the block, not once per batch.
    holder = _Holder()
    groups, size = 3, _Pump.AHEAD - 1
    seen: list[int] = []

    async def grouped() -> Any:
        for g in range(groups):
            pump = await _until_the_consumer_waits(holder)
            for i in range(size):  # no await in between: one step of the loop
                seen.append(pump.out.qsize())
                yield g * size + i

    items = SyncIterator(grouped, PrivateLoop(), owns_loop=True)
    holder.pump = items._pump
    assert list(items) == list(range(groups * size))
    assert seen == [0] * (groups * size)  # none had crossed before its step ended
    assert len(loop_threads()) == 0


class _WithErrors:
    """An async iterator of ``0..n-1`` that raises ``ValueError(i)`` instead of every
    ``every``-th item and goes on, a few items per step of the loop."""

    def __init__(self, n: int, every: int) -> None:
        self.n = n
        self.every = every
        self.i = 0

    def __aiter__(self) -> _WithErrors:
        return self

    async def __anext__(self) -> int:
        i = self.i
        if i == self.n:
            raise StopAsyncIteration
        self.i += 1
        if i % 3 == 0:
            await asyncio.sleep(0)  # a new step of the loop now and then
        if i % self.every == self.every - 1:
            raise ValueError(i)
        return i


@pytest.mark.parametrize("slow", [False, True])
def test_batches_and_errors_cross_in_order_once_each(slow: bool) -> None:
    # Batches held for the end of a step and batches put at once (the consumer busy) keep
    # their order with the errors between them.
    n, every = 60, 7
    items = SyncIterator(lambda: _WithErrors(n, every), PrivateLoop(), owns_loop=True)
    got: list[Any] = []
    pause = threading.Event()
    while True:
        try:
            got.append(next(items))
        except ValueError as exc:
            got.append(("error", exc.args[0]))
        except StopIteration:
            break
        if slow and len(got) % 5 == 0:
            pause.wait(0.002)  # the consumer busy: the pump gets ahead, puts at once
    expected = [("error", i) if i % every == every - 1 else i for i in range(n)]
    assert got == expected
    assert len(loop_threads()) == 0


def test_a_step_that_makes_more_than_ahead_batches_crosses_as_one_block() -> None:
    # A busy loop's step finishes more than AHEAD batches at once: for a consumer waiting on
    # the empty queue they cross together, up to BLOCK (one hand-off, the pump never stopping
    # for the consumer in the middle of the step), not in blocks of AHEAD.
    assert _Pump.BLOCK > _Pump.AHEAD
    holder = _Holder()
    groups, size = 3, _Pump.BLOCK
    blocks: list[int] = []

    async def grouped() -> Any:
        pump = holder.pump
        assert pump is not None
        flush = pump.flush

        def counted(hand_off: bool = True) -> None:
            if pump.pending:
                blocks.append(len(pump.pending))
            flush(hand_off)

        pump.flush = counted  # type: ignore[method-assign]
        for g in range(groups):
            await _until_the_consumer_waits(holder)
            for i in range(size):  # no await in between: one step of the loop
                yield g * size + i

    items = SyncIterator(grouped, PrivateLoop(), owns_loop=True)
    holder.pump = items._pump
    assert list(items) == list(range(groups * size))
    assert blocks == [size] * groups + [1]  # and the end, on its own
    assert len(loop_threads()) == 0



def _counted_blocks(pump: _Pump, blocks: list[int]) -> None:
    """Record the size of each block the pump puts."""
    flush = pump.flush

    def counted(hand_off: bool = True) -> None:
        if pump.pending:
            blocks.append(len(pump.pending))
        flush(hand_off)

    pump.flush = counted  # type: ignore[method-assign]


def test_a_busy_asyncio_loop_holds_a_block_over_several_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One batch per step, the loop busy (the pipeline's next step is ready each time): asyncio's
    # loop holds the block for HOLD_STEPS more steps, so that the waiting consumer's thread is
    # woken once for them all, where it was woken once per step (blocks of one).
    monkeypatch.setenv(UVLOOP_ENV, "0")
    holder = _Holder()
    groups, size = 3, _Pump.HOLD_STEPS + 1
    blocks: list[int] = []

    async def stepped() -> Any:
        pump = await _until_the_consumer_waits(holder)  # holder.pump set too
        _counted_blocks(pump, blocks)
        for g in range(groups):
            await _until_the_consumer_waits(holder)
            for i in range(size):
                yield g * size + i
                await asyncio.sleep(0)  # the next batch in the next step: the loop is busy
            while pump.pending or pump.out.qsize():  # until the consumer has the block
                await asyncio.sleep(0.001)

    items = SyncIterator(stepped, PrivateLoop(), owns_loop=True)
    holder.pump = items._pump
    assert list(items) == list(range(groups * size))
    assert blocks == [size] * groups + [1]  # and the end, on its own
    assert len(loop_threads()) == 0


def test_a_loop_kept_busy_does_not_keep_a_batch_from_a_waiting_consumer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The pipeline makes nothing more until the consumer has its batch, and keeps the loop
    # busy meanwhile (a callback ready at the end of every step): the batch is held for at
    # most HOLD_STEPS steps, never until BLOCK are held (that would be never).
    monkeypatch.setenv(UVLOOP_ENV, "0")
    received: list[int] = []
    spins: list[int] = []

    async def one_at_a_time() -> Any:
        for i in range(3):
            yield i
            spin = 0
            while len(received) <= i:  # set by the consumer's thread
                spin += 1
                if spin > 100_000:  # a failure rather than a hang
                    raise AssertionError(f"batch {i} was held from the waiting consumer")
                await asyncio.sleep(0)
            spins.append(spin)

    items = SyncIterator(one_at_a_time, PrivateLoop(), owns_loop=True)
    for item in items:
        received.append(item)
    assert received == [0, 1, 2]
    assert all(spin > _Pump.HOLD_STEPS for spin in spins)  # held while the loop was busy
    assert len(loop_threads()) == 0


def test_a_sync_for_under_a_trio_library_context_runs_on_its_asyncio_loop() -> None:
    # anyio.run(..., backend="trio") sets sniffio's context variable; a sync `for` started in
    # that context (a finalizer, or code between runs) carried it to its private asyncio loop,
    # where anyio then took the loop for trio ("must be called from async context").
    sniffio = pytest.importorskip("sniffio")
    import contextvars

    class Slow(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 12

        async def __getitem__(self, i: int) -> int:
            await anyio.sleep(0)
            return i

    def run() -> list[list[int]]:
        sniffio.current_async_library_cvar.set("trio")
        return [b.tolist() for b in aloader.DataLoader(Slow(), batch_size=4)]

    assert contextvars.copy_context().run(run) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
