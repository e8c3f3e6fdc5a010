"""The tests' HTTP server: the demo's :class:`ShardServer` plus faults injected on demand.

:class:`FaultyServer` serves like :class:`aloader._demo.ShardServer` (keep-alive, ETag, byte
ranges, latency) and can be told to misbehave on the next requests for a file: answer an error
status, cut a body short and hang up, stall, or replace the file. The demo never needs faults,
so they live here, with the tests.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from aloader._demo import ShardServer, make_jsonl_shards
from aloader._demo._server import ShardHandler

__all__ = ("FaultyServer", "make_jsonl_shards")


class _Fault:
    __slots__ = ("kind", "times", "value")

    def __init__(self, kind: str, value: Any, times: int) -> None:
        self.kind = kind
        self.value = value
        self.times = times


class FaultyServer(ShardServer):
    """A :class:`ShardServer` whose next answers for a file can be made to fail.

    Faults queued for a file apply in order, one request each (``times`` requests for a fault
    given ``times``); the other files and later requests are served normally.
    """

    def __init__(self, files: Mapping[str, bytes], **kwargs: Any) -> None:
        super().__init__(files, **kwargs)
        self._faults: dict[str, deque[_Fault]] = {}
        self._faults_lock = threading.Lock()

    def _add(self, name: str, fault: _Fault) -> None:
        with self._faults_lock:
            self._faults.setdefault(name, deque()).append(fault)

    def fail(self, name: str, status: int, times: int = 1,
             retry_after: str | None = None) -> None:
        """Answer the next ``times`` requests for ``name`` with ``status`` (e.g. 503), with
        ``Retry-After: retry_after`` if given (a throttling answer: a 429, or a 503 with it)."""
        self._add(name, _Fault("status", (status, retry_after), times))

    def cut(self, name: str, after: int, times: int = 1) -> None:
        """Send only ``after`` bytes of the next ``times`` bodies, then close the connection."""
        self._add(name, _Fault("cut", after, times))

    def stall(self, name: str, seconds: float, times: int = 1) -> None:
        """Wait ``seconds`` before answering the next ``times`` requests (for timeouts)."""
        self._add(name, _Fault("stall", seconds, times))

    def replace(self, name: str, body: bytes) -> None:
        """Replace the file ``name`` with ``body`` when its next request arrives (after the
        faults queued before this one)."""
        self._add(name, _Fault("replace", body, 1))

    def _take_fault(self, name: str) -> _Fault | None:
        with self._faults_lock:
            queue = self._faults.get(name)
            if not queue:
                return None
            fault = queue[0]
            fault.times -= 1
            if fault.times <= 0:
                queue.popleft()
            return fault

    def respond(self, handler: ShardHandler, name: str, range_header: str | None) -> None:
        fault = self._take_fault(name)
        if fault is None:
            super().respond(handler, name, range_header)
            return
        if fault.kind == "replace":
            self.files[name] = fault.value
        elif fault.kind == "stall":
            time.sleep(fault.value)
        elif fault.kind == "status":
            status, retry_after = fault.value
            handler.send((int(status), {} if retry_after is None else
                          {"Retry-After": retry_after}, b""))
            return
        status, headers, body = self.answer(name, range_header)
        if fault.kind == "cut" and status in (200, 206):
            # Promise the whole body, send part of it, then hang up: the client sees a short
            # read.
            handler.send_head(status, headers, len(body))
            handler.wfile.write(body[: int(fault.value)])
            handler.wfile.flush()
            handler.close_connection = True
            return
        handler.send((status, headers, body))
