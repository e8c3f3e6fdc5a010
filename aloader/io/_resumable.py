"""One resumable read of a remote resource, whatever the transport: HTTP(S) URLs
(:mod:`aloader.io._http`) and object stores (:mod:`aloader.io._objstore`, obstore's GETs or
URLs it signs).

A transport only opens ranged responses (:meth:`Transport.open`) and words its failures;
everything else is here, once:

Invariant: ``offset`` counts the bytes handed on (those before ``start`` count as such), and
every attempt asks the transport for the resource from ``offset`` on (to ``end``). A piece
received is handed on before the next one is awaited, so the bytes received before a failure
are progress: the next attempt resumes after them, nothing handed on is read twice, nothing
is skipped.

* Failures: a transport raises :class:`Retry` for a failure worth another attempt (a dropped
  connection, a body cut short, a 5xx, throttling, a timeout), anything else (an error
  :class:`~aloader.FetchError`) fails the read at once. Retries count since the last byte
  received: ``failures`` goes back to 0 whenever a piece arrives, and the read fails once
  more than ``retries`` attempts in a row brought nothing (the transport words that error:
  :meth:`Transport.gave_up`). Each retry waits an exponential backoff with jitter
  (:func:`retry_delay`, at least the server's ``Retry-After``), is counted in
  ``stats.retries`` and logged.
* Version check: the first answer's length and ETag are the resource's; an answer that tells
  another length or another ETag (without ``etag``, the first answer's) is an error
  (:meth:`Transport.changed`): the rest would come from another version. The version is
  reported once (``on_version``), the length with each answer that tells it (``on_size``).
* Completeness: a body that ends before the length its answer announced (or before ``end``)
  is retried from where it stopped; a failure after the last byte (a connection dropped once
  the body was whole) ends the read. An answer that starts before ``offset`` (a server that
  ignored the range, a coded body read again from its start) has its first bytes skipped.
"""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

import anyio

from .._exceptions import FetchError
from .._log import http_log
from .._stats import SourceStats
from .._util import Closing

__all__ = ("FirstAnswer", "Part", "Reading", "Retry", "RetryOptions", "Transport",
           "resumable_chunks", "retry_delay", "split_chunks", "where")


class RetryOptions(Protocol):
    """What a read takes of a source's options (:class:`~aloader.HttpOptions` has them)."""

    @property
    def retries(self) -> int: ...
    @property
    def backoff(self) -> float: ...
    @property
    def max_backoff(self) -> float: ...
    @property
    def chunk_size(self) -> int: ...


class Retry(Exception):
    """A failed attempt worth another one.

    Attributes:
        retry_after: the server's ``Retry-After`` (seconds), or None.
        connect: no connection could be made (refused, no route, DNS).
        status: the answer's status, if there was one.
    """

    def __init__(self, message: str, retry_after: float | None = None, connect: bool = False,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.connect = connect
        self.status = status


@dataclass
class Reading:
    """The state of one read, which the transport sees (to ask for the right range, and to
    locate its errors).

    Attributes:
        name: the resource's name in messages (its URL; never a signed one).
        offset: the bytes handed on so far (those before the read's start count).
        end: the byte to stop before, or None for the resource's end.
        etag: the version to read: the one given, else the first answer's.
        total: the resource's length, once an answer told it.
        failures: failed attempts since the last byte received.
        status: the status of the answer being read, if any.
    """

    name: str
    offset: int
    end: int | None
    etag: str | None
    total: int | None = None
    failures: int = 0
    status: int | None = None

    def limit(self) -> int | None:
        """The byte the read ends before, if known."""
        if self.total is None:
            return self.end
        return self.total if self.end is None else min(self.end, self.total)


@dataclass
class Part:
    """One answer to a ranged request.

    Attributes:
        body: the answer's bytes, piece by piece as they arrive.
        skip: how many of its first bytes were handed on already (an answer from an earlier
            byte than ``offset``).
        total: the resource's whole length, if the answer tells it.
        etag: the answer's ETag, if any.
        modified: its Last-Modified, if any.
        status: its status, if it has one.
        plain: whether the body's bytes are the resource's own, which ``offset`` and
            ``total`` count (False: a body decoded from a content coding, whose length no
            answer tells).
        digests: the store's checksums of the whole resource, ``{algorithm: base64}``
            (see :func:`aloader.io._checksums.store_digests`).
    """

    body: AsyncGenerator[bytes, None]
    skip: int = 0
    total: int | None = None
    etag: str | None = None
    modified: str | None = None
    status: int | None = None
    plain: bool = True
    digests: dict[str, str] = field(default_factory=dict)


class FirstAnswer:
    """An ``on_version`` callback that keeps what the first answer told: the version
    (length, ETag, Last-Modified) and the store's checksums of the resource (which
    :func:`resumable_chunks` hands to this kind of callback only).

    Attributes:
        answered: whether an answer came.
        size, etag, modified: what it told.
        digests: the store's checksums, ``{algorithm: base64}``.
    """

    def __init__(self) -> None:
        self.answered = False
        self.size: int | None = None
        self.etag: str | None = None
        self.modified: str | None = None
        self.digests: dict[str, str] = {}

    def __call__(self, size: int | None, etag: str | None, modified: str | None) -> None:
        if not self.answered:
            self.answered = True
            self.size, self.etag, self.modified = size, etag, modified


class Transport(Protocol):
    """How a read reaches its resource (see the module's description)."""

    def open(self, reading: Reading) -> AbstractAsyncContextManager[Part | None]:
        """An answer for the bytes from ``reading.offset`` to ``reading.end``, asking for
        version ``reading.etag`` where the transport can; None: the body is known complete
        already (a range past its end, answered so). Errors raised while its body is read
        leave this context manager, which sorts them as :meth:`open` sorts its own.

        Raises:
            Retry: a failure worth another attempt.
            FetchError: any other failure (named after ``reading.name``, at its offset).
        """
        ...

    def gave_up(self, reading: Reading, last: Retry) -> FetchError:
        """The error once retries ran out (``last`` the last failure)."""
        ...

    def changed(self, reading: Reading, what: str) -> FetchError:
        """The error for an answer of another version (``what``: which field became what)."""
        ...


def where(offset: int) -> str:
    """`` at byte offset N``, or nothing at the start."""
    return f" at byte offset {offset}" if offset else ""


async def resumable_chunks(
    transport: Transport,
    name: str,
    options: RetryOptions,
    stats: SourceStats,
    on_size: Callable[[int], None] | None = None,
    start: int = 0,
    on_version: Callable[[int | None, str | None, str | None], None] | None = None,
    end: int | None = None,
    etag: str | None = None,
) -> AsyncGenerator[bytes, None]:
    """The bytes of ``name`` from ``start`` (to ``end``), chunk by chunk (at most
    ``options.chunk_size`` bytes), through ``transport``, retried and resumed as the module
    describes.

    Args:
        transport: opens the ranged answers.
        name: the resource's name in messages.
        options: retries, backoff and chunk size.
        stats: counts the retries.
        on_size: called with the resource's length whenever an answer tells it, before the
            chunks it announces.
        start: the byte to start at.
        on_version: called once, before the first chunk, with the length (None when
            unknown), ETag and Last-Modified of the first answer that sends the body.
        end: the byte to stop before, or None for the resource's end.
        etag: the version to read (an answer with another ETag is an error).

    Raises:
        FetchError: the transport's errors, a changed version, or retries exhausted.
    """
    reading = Reading(name, start, end, etag)
    size = options.chunk_size
    while True:
        try:
            async with transport.open(reading) as part:
                if part is None:
                    return
                reading.status = part.status
                _check_version(transport, reading, part)
                if part.total is not None:
                    reading.total = part.total
                    if on_size is not None:
                        on_size(part.total)
                if on_version is not None:
                    if isinstance(on_version, FirstAnswer):
                        on_version.digests = part.digests if part.plain else {}
                    on_version(reading.total if part.plain else None, part.etag,
                               part.modified)
                    on_version = None  # the first answer's: later ones resume the same body
                skip = part.skip
                # Network reads as they come (no rechunking buffer that a failure would lose),
                # split to at most chunk_size bytes.
                async with Closing(part.body) as pieces:
                    async for piece in pieces:
                        if skip:
                            if len(piece) <= skip:
                                skip -= len(piece)
                                continue
                            piece = piece[skip:]
                            skip = 0
                        reading.failures = 0
                        offset = reading.offset
                        if end is not None and offset + len(piece) >= end:
                            piece = piece[: end - offset]  # a server that ignored the range
                        for chunk in split_chunks(piece, size):
                            reading.offset += len(chunk)
                            yield chunk
                        if reading.offset == end:
                            return
                if skip:
                    raise FetchError(f"{name}: the body is now shorter than the "
                                     f"{reading.offset} bytes already read", source=name,
                                     offset=reading.offset, status_code=part.status)
                limit = reading.limit()
                if limit is not None and part.plain and reading.offset < limit:
                    # A range shorter than asked, or a length the body did not keep to.
                    raise Retry(f"the body ended at byte {reading.offset} of {reading.total}")
            return
        except Retry as exc:
            last = exc
        limit = reading.limit()
        if reading.total is not None and limit is not None and reading.offset >= limit:
            return  # the connection dropped after the last byte
        reading.failures += 1
        if reading.failures > options.retries:
            raise transport.gave_up(reading, last)
        stats.retries += 1
        delay = retry_delay(options, reading.failures, last.retry_after)
        http_log.info("retrying %s%s in %.2f s (attempt %d of %d): %s", name,
                      where(reading.offset), delay, reading.failures + 1, options.retries + 1,
                      last)
        await anyio.sleep(delay)


def _check_version(transport: Transport, reading: Reading, part: Part) -> None:
    """Check that ``part`` is of the version the read started with (see the module).

    Raises:
        FetchError: it is not.
    """
    if part.total is not None and reading.total is not None and part.total != reading.total:
        raise transport.changed(reading, f"its length {reading.total} became {part.total}")
    if reading.etag is not None and part.etag is not None and part.etag != reading.etag:
        raise transport.changed(reading, f"ETag {reading.etag} became {part.etag}")
    reading.etag = reading.etag or part.etag


def split_chunks(piece: bytes, size: int) -> Iterable[bytes]:
    """``piece`` as chunks of at most ``size`` bytes (``piece`` itself when it fits; nothing
    when it is empty): how a network read is handed on as a source's chunks. A piece that
    fits (most reads) costs a tuple, not a generator."""
    if 0 < len(piece) <= size:
        return (piece,)
    return (piece[start : start + size] for start in range(0, len(piece), size))


def retry_delay(options: RetryOptions, failures: int, retry_after: float | None = None
                ) -> float:
    """Seconds to wait before the next attempt after ``failures`` failed ones in a row."""
    # The exponent is capped: a float overflows past 2 ** 1023.
    delay = min(options.max_backoff, options.backoff * 2.0 ** min(failures - 1, 64))
    if retry_after is not None:
        delay = max(delay, min(retry_after, options.max_backoff))
    # Jitter spreads the retries of many workers hitting the same server.
    return delay * (0.5 + 0.5 * random.random())
