"""The sync facade's event loop: one per loader, for every ``for`` epoch, closed with the loader.

No test asserts a duration.
"""

from __future__ import annotations

import _thread
import asyncio
import gc
import http.server
import queue
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from loopthreads import ignore_earlier_loops, loop_threads  # noqa: F401

import aloader
from aloader import DataLoader


class LoopBound(aloader.Dataset[int]):
    """Creates once, and keeps, what binds to the running loop, as an HTTP client does.

    An ``asyncio.Lock`` under contention creates futures of the loop it first waited on; a
    later loop using it raises, as a pooled connection of a closed loop does.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.loops: set[int] = set()
        self.lock: asyncio.Lock | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        loop = asyncio.get_running_loop()
        if self.lock is None:
            self.lock = asyncio.Lock()
            self.loop = loop
        self.loops.add(id(loop))
        async with self.lock:
            await asyncio.sleep(0)  # the others queue up on the lock: futures of this loop
        return index


def test_every_for_epoch_runs_on_one_loop() -> None:
    dataset = LoopBound(12)
    loader = DataLoader(dataset, batch_size=3, max_concurrency=4)
    for _ in range(3):
        assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert len(dataset.loops) == 1
    assert len(loop_threads()) == 1
    # A broken-off epoch and a new iterator keep the same loop.
    for _ in loader:
        break
    next(iter(loader))
    gc.collect()
    assert len(dataset.loops) == 1
    assert dataset.loop is not None and not dataset.loop.is_closed()
    loader.close()
    assert dataset.loop.is_closed()
    assert loop_threads() == []


def test_close_then_for_again_starts_a_new_loop() -> None:
    dataset = LoopBound(4)
    loader = DataLoader(dataset, batch_size=2)
    assert len(list(loader)) == 2
    loader.close()
    loader.close()  # idempotent
    assert loop_threads() == []
    dataset.lock = None  # the old loop's objects are gone with it
    assert len(list(loader)) == 2
    assert len(dataset.loops) == 2
    loader.close()
    assert loop_threads() == []


def test_close_ends_an_open_iterator() -> None:
    loader = DataLoader(LoopBound(20), batch_size=2)
    iterator = iter(loader)
    next(iterator)
    loader.close()
    assert loop_threads() == []
    with pytest.raises(StopIteration):
        next(iterator)
    iterator.close()  # nothing left to stop


def test_garbage_collecting_the_loader_closes_its_loop() -> None:
    dataset = LoopBound(8)
    loader = DataLoader(dataset, batch_size=2)
    assert len(list(loader)) == 4
    iterator = iter(loader)
    next(iterator)
    assert len(loop_threads()) == 1
    ref = weakref.ref(loader)
    del loader, iterator
    gc.collect()
    assert ref() is None  # the loop's thread does not keep the loader alive
    assert loop_threads() == []
    assert dataset.loop is not None and dataset.loop.is_closed()


def test_no_loop_thread_leak_over_many_loaders() -> None:
    for _ in range(5):
        loader = DataLoader(LoopBound(4), batch_size=2)
        list(loader)
        list(loader)
        assert len(loop_threads()) == 1
        loader.close()
    assert loop_threads() == []
    for _ in range(3):
        list(DataLoader(LoopBound(4), batch_size=2))
    gc.collect()
    assert loop_threads() == []


async def test_async_for_runs_on_the_callers_loop(anyio_backend: str) -> None:
    class Where(aloader.Dataset[int]):
        def __len__(self) -> int:
            return 4

        async def __getitem__(self, index: int) -> int:
            return threading.get_ident()

    loader = DataLoader(Where(), batch_size=2)
    threads = {int(t) for b in [b async for b in loader] for t in b}
    assert threads == {threading.get_ident()}
    assert loop_threads() == []


class _Numbers(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the client pools connections of its loop

    def do_GET(self) -> None:
        body = self.path.strip("/").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Numbers)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_httpx_client_kept_by_the_dataset_lives_across_for_epochs(server: str) -> None:
    httpx = pytest.importorskip("httpx")

    class Remote(aloader.Dataset[int]):
        client: Any = None

        def __len__(self) -> int:
            return 6

        async def __getitem__(self, index: int) -> int:
            if self.client is None:
                self.client = httpx.AsyncClient(base_url=server)
            response = await self.client.get(f"/{index}")
            return int(response.text)

    dataset = Remote()
    loader = DataLoader(dataset, batch_size=3, max_concurrency=3)
    for _ in range(3):  # epoch 2 used to fail with "Event loop is closed"
        assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5]]
    loader.close()


def test_a_loop_left_open_at_exit_is_closed() -> None:
    script = """
import asyncio, aloader
from aloader import DataLoader

class D(aloader.Dataset):
    def __len__(self): return 100
    async def __getitem__(self, i):
        await asyncio.sleep(0)
        return i

loader = DataLoader(D(), batch_size=2)
list(loader)
iterator = iter(loader)
next(iterator)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=str(_root()))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert done.stderr == ""


def _root() -> Any:
    import pathlib

    return pathlib.Path(aloader.__file__).parent.parent


def test_for_batches_match_async_for() -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(LoopBound(10), batch_size=4, shuffle=True, generator=3)

    loader = make()
    sync = [np.asarray(b).tolist() for epoch in range(2) for b in loader]
    loader.close()

    async def run() -> list[list[int]]:
        loader = make()
        return [np.asarray(b).tolist() for epoch in range(2) async for b in _aiter(loader)]

    assert sync == anyio.run(run)


async def _aiter(loader: DataLoader[Any]) -> Any:
    async for batch in loader:
        yield batch


def _epoch_in_child(loader: DataLoader[Any], out: Any) -> None:
    out.put([b.tolist() for b in loader])


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_a_forked_child_gets_a_loop_of_its_own() -> None:
    import multiprocessing

    loader = DataLoader(LoopBound(4), batch_size=2)
    assert len(list(loader)) == 2  # the parent's loop is running
    loader.dataset.lock = None  # bound to the parent's loop
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_epoch_in_child, args=(loader, out))
    child.start()
    try:
        assert out.get(timeout=60) == [[0, 1], [2, 3]]
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    loader.close()


# Any async iterable: a Stream's plain `for` -------------------------------------------------
class _Tracked:
    """An async iterable whose iterations record that they were closed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.closed = 0

    async def __aiter__(self) -> Any:
        try:
            for i in range(self.n):
                await anyio.sleep(0)
                yield {"i": i, "x": np.full(2, i)}
        finally:
            self.closed += 1


def test_for_over_a_stream_yields_what_async_for_yields() -> None:
    def make() -> aloader.Stream[Any]:
        return aloader.as_stream(range(20)).shuffle(8, seed=3).map(lambda x: x * 2)

    async def collect() -> list[Any]:
        return [x async for x in make()]

    assert [x for x in make()] == anyio.run(collect)
    assert len(loop_threads()) == 0  # each `for` closes the loop it ran on


def test_breaking_out_of_a_for_over_a_stream_closes_it() -> None:
    source = _Tracked(1000)
    stream = aloader.as_stream(source)
    seen = []
    for item in stream:
        seen.append(item["i"])
        if len(seen) == 3:
            break
    gc.collect()
    assert seen == [0, 1, 2]
    assert source.closed == 1
    assert len(loop_threads()) == 0
    # A second epoch starts afresh.
    assert [item["i"] for item in stream] == list(range(1000))
    assert source.closed == 2


def test_closing_a_stream_iterator_closes_the_stream() -> None:
    source = _Tracked(1000)
    iterator = iter(aloader.as_stream(source))
    assert next(iterator)["i"] == 0
    iterator.close()  # type: ignore[attr-defined]
    assert source.closed == 1
    with pytest.raises(StopIteration):
        next(iterator)


async def test_for_over_a_stream_inside_an_event_loop_is_refused(anyio_backend: str) -> None:
    with pytest.raises(RuntimeError, match="use `async for item in stream` instead"):
        iter(aloader.as_stream([1, 2]))


def test_the_facade_drives_any_async_iterator() -> None:
    from aloader._facade import PrivateLoop, SyncIterator

    source = _Tracked(5)
    items = SyncIterator(source.__aiter__, PrivateLoop(), owns_loop=True)
    assert [item["i"] for item in items] == [0, 1, 2, 3, 4]
    assert source.closed == 1
    assert len(loop_threads()) == 0


# Ctrl-C while a `for` waits -----------------------------------------------------------------
GUARD = 60.0  # seconds: only a hang gets anywhere near this


class _Watched(queue.SimpleQueue[Any]):
    """The hand-off queue, telling when the consumer starts to wait on it."""

    def __init__(self) -> None:
        self.waits = threading.Event()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if block:
            self.waits.set()
        return super().get(block, timeout)


def test_a_ctrl_c_that_trips_while_next_is_blocked_still_interrupts() -> None:
    """A SIGINT can trip without waking the blocked main thread: one landing just before the
    wait starts, one the kernel hands to another thread, ``_thread.interrupt_main()``."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    from aloader._facade import _END, PrivateLoop, SyncIterator

    async def never() -> Any:
        await anyio.sleep_forever()
        yield  # an async generator

    items = SyncIterator(never, PrivateLoop(), owns_loop=True)
    watched = items._pump.out = _Watched()  # nothing was put yet: `never` yields nothing
    caught = threading.Event()
    rescued = []

    def interrupt() -> None:
        watched.waits.wait(GUARD)
        _thread.interrupt_main()  # trips SIGINT; the main thread's wait goes on
        if not caught.wait(GUARD):
            rescued.append(True)  # the interrupt was not seen: end the hang to fail cleanly
            watched.put((_END, None))

    sender = threading.Thread(target=interrupt, daemon=True)
    sender.start()
    with pytest.raises(KeyboardInterrupt):
        next(items)
    caught.set()
    sender.join(GUARD)
    assert rescued == []
    items.close()
    assert len(loop_threads()) == 0


class _InterruptedAfterTaking(queue.SimpleQueue[Any]):
    """Raises KeyboardInterrupt after taking each of the first ``n`` items, as a Ctrl-C that
    lands between taking an item and telling the pump does."""

    def __init__(self, n: int) -> None:
        self.left = n

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        if self.left:
            self.left -= 1
            raise KeyboardInterrupt
        return item


def test_ctrl_c_between_taking_a_batch_and_telling_the_pump_leaves_it_running() -> None:
    from aloader._facade import PrivateLoop, SyncIterator

    gate = threading.Event()

    async def numbers() -> Any:
        await anyio.to_thread.run_sync(gate.wait, GUARD)  # until the queue is swapped
        for i in range(6):
            yield i

    items = SyncIterator(numbers, PrivateLoop(), owns_loop=True)
    items._pump.out = _InterruptedAfterTaking(2)
    gate.set()
    got: list[int] = []
    interrupts = []

    def consume() -> None:  # in a thread, so that a hang fails the test instead
        while True:
            try:
                got.append(next(items))
            except KeyboardInterrupt:
                interrupts.append(True)
            except StopIteration:
                return

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(GUARD)
    hung = consumer.is_alive()
    items.close()
    assert not hung
    # The interrupted next() calls took 0 and 1 with them; the rest comes once, in order.
    assert (len(interrupts), got) == (2, [2, 3, 4, 5])
    assert len(loop_threads()) == 0


# In-memory epochs run on the consumer's thread ---------------------------------------------
class _InMemory(aloader.Dataset[Any]):
    """A fast in-memory dataset (``_inline_fetch``) that records the threads fetching it, and
    raises ``raises`` once when fetching index ``at``."""

    _inline_fetch = True

    def __init__(self, n: int, at: int = -1, raises: BaseException | None = None) -> None:
        self.n = n
        self.at = at
        self.raises = raises
        self.threads: set[int] = set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        self.threads.add(threading.get_ident())
        if index == self.at and self.raises is not None:
            error, self.raises = self.raises, None
            raise error
        return np.array([index])


def test_an_in_memory_for_epoch_runs_on_the_consumers_thread_without_a_loop() -> None:
    dataset = _InMemory(10)
    loader = DataLoader(dataset, batch_size=4, shuffle=True, generator=5)
    sync = [[b.ravel().tolist() for b in loader] for _ in range(2)]
    assert dataset.threads == {threading.get_ident()}
    assert loop_threads() == []  # no loop was started for it

    async def run() -> list[list[list[int]]]:
        fresh = DataLoader(_InMemory(10), batch_size=4, shuffle=True, generator=5)
        return [[b.ravel().tolist() async for b in fresh] for _ in range(2)]

    assert sync == anyio.run(run)


def test_an_in_memory_for_epoch_resumes_from_the_batches_received() -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(_InMemory(20), batch_size=3, shuffle=True, generator=2)

    whole = [b.ravel().tolist() for b in make()]
    loader = make()
    it = iter(loader)
    got = [next(it).ravel().tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state["yielded"] == 3
    it.close()
    with pytest.raises(StopIteration):
        next(it)
    fresh = make()
    fresh.load_state_dict(state)
    assert got + [b.ravel().tolist() for b in fresh] == whole
    assert fresh.state_dict()["epoch"] == 1  # the epoch ended: the state is the next one's


def test_an_in_memory_for_epoch_takes_a_keyboard_interrupt_and_goes_on() -> None:
    dataset = _InMemory(12, at=5, raises=KeyboardInterrupt())
    loader = DataLoader(dataset, batch_size=2)
    it = iter(loader)
    got = [next(it).ravel().tolist() for _ in range(2)]
    with pytest.raises(KeyboardInterrupt):
        next(it)  # batch 2 (indices 4, 5) is lost with it
    assert loader.state_dict()["yielded"] == 2
    got += [b.ravel().tolist() for b in it]
    assert got == [[0, 1], [2, 3], [6, 7], [8, 9], [10, 11]]


def test_close_ends_an_in_memory_for_epoch() -> None:
    loader = DataLoader(_InMemory(20), batch_size=2)
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(StopIteration):
        next(it)
    for _ in loader:  # a later epoch starts afresh
        break
    assert [b.ravel().tolist() for b in loader][:2] == [[0, 1], [2, 3]]


def test_an_inline_epoch_with_an_async_collate_still_runs_on_a_loop() -> None:
    dataset = _InMemory(6)

    async def collate(samples: list[Any]) -> list[int]:
        await asyncio.sleep(0.001)  # a real event: a loop is needed
        return [int(s[0]) for s in samples]

    loader = DataLoader(dataset, batch_size=3, collate_fn=collate)
    assert list(loader) == [[0, 1, 2], [3, 4, 5]]
    assert len(loop_threads()) == 1
    loader.close()


def test_run_here_refuses_a_step_that_awaits_an_event() -> None:
    from aloader._facade import run_here

    async def plain() -> int:
        await asyncio.sleep(0)  # a bare yield only gives turns
        return 7

    assert run_here(plain()) == 7

    class Waits:
        def __await__(self) -> Any:
            yield "an event"

    async def waits() -> None:
        await Waits()

    with pytest.raises(RuntimeError, match="awaited an event"):
        run_here(waits())


# The pump's hand-off keeps each batch with its receipt --------------------------------------
def test_a_ctrl_c_after_taking_a_batch_leaves_the_state_of_the_batches_received() -> None:
    gate = threading.Event()

    class Gated(aloader.Dataset[Any]):
        def __len__(self) -> int:
            return 12

        async def __getitem__(self, index: int) -> Any:
            if index == 0:
                await anyio.to_thread.run_sync(gate.wait, GUARD)  # until the queue is swapped
            return index

    loader = DataLoader(Gated(), batch_size=2)
    it = iter(loader)
    pump = it._open()._pump  # type: ignore[union-attr]
    pump.out = _InterruptedAfterTaking(2)
    gate.set()
    got: list[list[int]] = []
    interrupts = []

    def consume() -> None:  # in a thread, so that a hang fails the test instead
        while len(got) < 2:
            try:
                got.append(next(it).tolist())
            except KeyboardInterrupt:
                interrupts.append(True)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(GUARD)
    assert not consumer.is_alive()
    assert (len(interrupts), got) == (2, [[4, 5], [6, 7]])
    state = loader.state_dict()
    it.close()
    loader.close()
    # Batches 2 and 3 were received, 0 and 1 lost with the interrupted next() calls.
    assert (state["yielded"], state["map"]["prefix"], state["map"]["delivered"]) == (2, 0, [2, 3])


# uvloop -------------------------------------------------------------------------------------
class _LoopKind(aloader.Dataset[Any]):
    def __init__(self) -> None:
        self.kinds: set[type] = set()

    def __len__(self) -> int:
        return 4

    async def __getitem__(self, index: int) -> int:
        self.kinds.add(type(asyncio.get_running_loop()))
        return index


def test_for_epochs_run_on_uvloop_when_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.delenv("ALOADER_UVLOOP", raising=False)
    dataset = _LoopKind()
    loader = DataLoader(dataset, batch_size=2)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    loader.close()
    assert dataset.kinds == {uvloop.Loop}


@pytest.mark.parametrize("how", ["env", "missing"])
def test_for_epochs_run_on_asyncio_without_uvloop(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "env":
        monkeypatch.setenv("ALOADER_UVLOOP", "0")
    else:
        monkeypatch.delenv("ALOADER_UVLOOP", raising=False)
        monkeypatch.setitem(sys.modules, "uvloop", None)  # its import fails, as uninstalled
    dataset = _LoopKind()
    loader = DataLoader(dataset, batch_size=2)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    loader.close()
    (kind,) = dataset.kinds
    assert kind.__module__.startswith("asyncio.")


def _until(condition: Any) -> None:
    deadline = threading.Event()
    for _ in range(int(GUARD * 100)):
        if condition():
            return
        deadline.wait(0.01)
    raise AssertionError("the pump never got there")


def test_batches_cross_in_blocks_one_wake_up_of_the_loop_per_block() -> None:
    from aloader._facade import PrivateLoop, SyncIterator, _Pump

    async def numbers() -> Any:
        for i in range(10):
            yield i

    items = SyncIterator(numbers, PrivateLoop(), owns_loop=True)
    pump = items._pump
    block = _Pump.AHEAD - _Pump.LOW
    assert block >= 2
    wakes: list[Any] = []
    call_soon = pump.call_soon
    pump.call_soon = lambda callback: (wakes.append(callback), call_soon(callback))[1]
    got = []
    for _ in range(3):
        _until(lambda: pump.out.qsize() == _Pump.AHEAD and pump.waiting is not None)
        before = len(wakes)
        for _ in range(block - 1):
            got.append(next(items))
            assert len(wakes) == before  # the pump waits on: the consumer has enough
        got.append(next(items))
        assert len(wakes) == before + 1  # one wake-up, and the pump refills a block
    got += list(items)
    assert got == list(range(10))
    assert len(loop_threads()) == 0


def test_an_in_memory_epoch_with_a_plain_sampler_runs_on_the_consumers_thread() -> None:
    class Backwards:  # a user's sampler: plain iteration, no array form
        def __iter__(self) -> Iterator[int]:
            return iter(range(9, -1, -1))

        def __len__(self) -> int:
            return 10

    dataset = _InMemory(10)
    loader = DataLoader(dataset, batch_size=4, sampler=Backwards())
    assert [b.ravel().tolist() for b in loader] == [[9, 8, 7, 6], [5, 4, 3, 2], [1, 0]]
    assert dataset.threads == {threading.get_ident()}
    assert loop_threads() == []
