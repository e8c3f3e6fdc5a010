"""A local HTTP server on 127.0.0.1 that models an object store, for ``bench_auto.py``.

Every ``GET /<name>`` answers a body of the object ``<name>`` (``Range: bytes=a-b`` honoured,
206 with ``Content-Range``), after a *service time*; keep-alive HTTP/1.1. The store's shape:

* ``parallel``: requests served at once; the others wait in a FIFO queue (the "knee": past it
  more requests in flight add latency, not throughput);
* ``rate``: a token bucket of ``rate`` requests per second (``burst`` tokens deep); a request
  that finds no token is answered ``429 Too Many Requests`` with ``Retry-After: 1`` at once;
* ``tail``: that share of requests has its first byte ``tail_factor`` times later (a
  straggler), chosen at random per request (a second request for the same object is most
  likely quick, as with a store's slow node).

Bodies: ``objects`` objects named ``0`` ... of ``size`` bytes each, JSON Lines records
(``{"id": i, "x": ...}``) padded to the size, so the same server feeds a dataset's ranged GETs
and a source's shards. Run in a process of its own (:func:`serve`), so that its CPU is not the
client's; the counters (served, throttled) come back through ``stats``.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from dataclasses import dataclass
from typing import Any

__all__ = ("Model", "body_of", "serve")


@dataclass
class Model:
    """The store's shape (see the module)."""

    service: float = 0.05
    parallel: int = 200
    rate: float | None = None
    burst: float = 0.0
    tail: float = 0.0
    tail_factor: float = 50.0
    objects: int = 1000
    records: int = 8
    seed: int = 0


def body_of(model: Model, name: int) -> bytes:
    """Object ``name``'s bytes: ``model.records`` JSON Lines records."""
    lines = [b'{"id": %d, "x": "%s"}\n' % (name * model.records + i, b"a" * 40)
             for i in range(model.records)]
    return b"".join(lines)


class _Store:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.bodies = [body_of(model, i) for i in range(model.objects)]
        self.busy = 0
        self.queue: collections.deque[asyncio.Future[None]] = collections.deque()
        self.tokens = model.burst
        self.last = time.monotonic()
        self.rng = random.Random(model.seed)
        self.served = 0
        self.throttled = 0
        self.slow = 0

    def take_token(self) -> bool:
        rate = self.model.rate
        if rate is None:
            return True
        now = time.monotonic()
        self.tokens = min(max(self.model.burst, 1.0), self.tokens + (now - self.last) * rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def _hand_over(self) -> None:
        """A request is served: its slot goes to the first one waiting (not cancelled)."""
        while self.queue:
            waiter = self.queue.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.busy -= 1

    async def serve(self, name: int, first: int, last: int | None) -> tuple[int, list[bytes],
                                                                                  bytes]:
        if not self.take_token():
            self.throttled += 1
            return 429, [b"Retry-After: 1"], b""
        if self.busy >= self.model.parallel:
            waiter = asyncio.get_running_loop().create_future()
            self.queue.append(waiter)
            await waiter  # the slot is handed over: busy stays
        else:
            self.busy += 1
        try:
            service = self.model.service
            if self.model.tail and self.rng.random() < self.model.tail:
                service *= self.model.tail_factor
                self.slow += 1
            await asyncio.sleep(service)
        finally:
            self._hand_over()
        body = self.bodies[name % len(self.bodies)]
        self.served += 1
        size = len(body)
        if first or last is not None:
            end = size - 1 if last is None else min(last, size - 1)
            return 206, [b"Content-Range: bytes %d-%d/%d" % (first, end, size)], \
                body[first:end + 1]
        return 200, [], body


class _Protocol(asyncio.Protocol):
    def __init__(self, store: _Store) -> None:
        self.store = store
        self.buffer = b""
        self.transport: Any = None
        self.tasks: set[asyncio.Future[None]] = set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            path = lines[0].split(b" ")[1]
            first, last = 0, None
            for line in lines[1:]:
                if line[:6].lower() == b"range:":
                    spec = line.split(b"=", 1)[1].strip()
                    a, _, b = spec.partition(b"-")
                    first = int(a)
                    last = int(b) if b else None
            if path == b"/_stats":  # the counters so far, as JSON (then reset)
                store = self.store
                body = b'{"served": %d, "throttled": %d, "slow": %d}' % (
                    store.served, store.throttled, store.slow)
                store.served = store.throttled = store.slow = 0
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                     % (len(body), body))
                continue
            name = int(path.rsplit(b"/", 1)[-1].split(b".")[0] or b"0")
            task = asyncio.ensure_future(self.answer(name, first, last))
            self.tasks.add(task)  # asyncio keeps only weak references to tasks
            task.add_done_callback(self.tasks.discard)

    async def answer(self, name: int, first: int, last: int | None) -> None:
        status, headers, body = await self.store.serve(name, first, last)
        reason = {200: b"OK", 206: b"Partial Content", 429: b"Too Many Requests"}[status]
        head = [b"HTTP/1.1 %d %s" % (status, reason), b"Content-Length: %d" % len(body),
                b'ETag: "v1"', *headers]
        if not self.transport.is_closing():
            self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)


def serve(model: Model, port_queue: Any, stop: Any) -> None:
    """The server process: listen on 127.0.0.1, put the port on ``port_queue``, serve until
    ``stop`` is set (``GET /_stats`` answers the counters since the last such request)."""

    async def main() -> None:
        store = _Store(model)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Protocol(store), "127.0.0.1", 0,
                                          backlog=4096)
        port_queue.put(server.sockets[0].getsockname()[1])
        while not stop.is_set():
            await asyncio.sleep(0.05)
        server.close()

    asyncio.run(main())
