"""Streaming HTTP(S) bodies with httpx: timeouts, bounded retries, resumption by byte range.

A body is read as a sequence of chunks. When the connection fails (refused, reset, cut in the
middle of the body, timed out) or the server answers a transient status (5xx, 408, 429), the
request is retried after an exponential backoff, asking for the rest of the body only
(``Range: bytes=N-``, where N counts the bytes already delivered). A server that ignores ranges
answers 200 with the whole body: the first N bytes are then skipped. A client error such as 404
fails at once. httpx is imported on first use, so ``import aloader`` stays light.
"""

from __future__ import annotations

import random
import re
import ssl
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from ._formats import SourceStats
from ._streams import FetchError, _Closing

if TYPE_CHECKING:
    import httpx

__all__ = ("HttpOptions", "http_chunks", "make_client")

_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
# Statuses worth retrying: server errors, request timeout, too many requests.
_TRANSIENT = frozenset({408, 429})


@dataclass(frozen=True)
class HttpOptions:
    """How sources fetch URLs.

    Attributes:
        timeout: seconds for connecting and for each read (None: no limit).
        retries: attempts after the first one, counted since the last byte received.
        backoff: delay before the first retry, in seconds; doubles at each retry.
        max_backoff: the longest delay between attempts.
        headers: extra request headers (authorization, ...).
        chunk_size: bytes per chunk handed to the decoder.
        client_factory: makes the ``httpx.AsyncClient`` for one epoch (closed at its end), or
            None for the default one.
    """

    timeout: float | None = 30.0
    retries: int = 5
    backoff: float = 0.1
    max_backoff: float = 10.0
    headers: Mapping[str, str] | None = None
    chunk_size: int = 1 << 16
    client_factory: Callable[[], Any] | None = None


_SSL_CONTEXT: ssl.SSLContext | None = None


def _ssl_context() -> ssl.SSLContext:
    """The default verifying TLS context, built once per process: loading the CA bundle
    costs tens of milliseconds, too much to pay at every epoch's new client."""
    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        import httpx

        _SSL_CONTEXT = httpx.create_ssl_context()
    return _SSL_CONTEXT


def make_client(options: HttpOptions, connections: int) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` for one epoch, keeping up to ``connections`` connections."""
    if options.client_factory is not None:
        return options.client_factory()  # type: ignore[no-any-return]
    import httpx

    return httpx.AsyncClient(
        timeout=httpx.Timeout(options.timeout),
        limits=httpx.Limits(max_connections=connections,
                            max_keepalive_connections=connections),
        headers=dict(options.headers) if options.headers else None,
        follow_redirects=True,
        verify=_ssl_context(),
    )


class _Transient(Exception):
    """A retryable status."""

    def __init__(self, status: int, reason: str, retry_after: float | None) -> None:
        super().__init__(f"HTTP {status} {reason}".rstrip())
        self.status = status
        self.retry_after = retry_after


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff


def _where(offset: int) -> str:
    return f" at byte offset {offset}" if offset else ""


async def http_chunks(
    client: httpx.AsyncClient,
    url: str,
    options: HttpOptions,
    stats: SourceStats,
) -> AsyncGenerator[bytes, None]:
    """The body of ``url``, chunk by chunk, retried and resumed as the module describes.

    Args:
        client: the epoch's client.
        url: the URL.
        options: timeouts, retries and backoff.
        stats: counts the retries.

    Raises:
        FetchError: an error status that is not transient (at once), a response that does not
            fit the resumption (wrong range, changed ETag), or retries exhausted.
    """
    import httpx

    offset = 0  # bytes delivered so far
    failures = 0  # failed attempts since the last byte received
    etag: str | None = None
    total: int | None = None
    while True:
        headers = {"Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        retry_after: float | None = None
        status: int | None = None
        try:
            async with client.stream("GET", url, headers=headers) as response:
                status = response.status_code
                reason = response.reason_phrase
                if status == 416 and total is not None and offset >= total:
                    return
                if status >= 500 or status in _TRANSIENT:
                    raise _Transient(status, reason,
                                     _retry_after(response.headers.get("Retry-After")))
                if status not in (200, 206):
                    raise FetchError(
                        f"{url}: HTTP {status} {reason}{_where(offset)} (not retried)",
                        source=url, offset=offset, status_code=status,
                    )
                tag = response.headers.get("ETag")
                if etag is not None and tag is not None and tag != etag:
                    raise FetchError(
                        f"{url}: the resource changed on the server while it was being read "
                        f"(ETag {etag} became {tag}){_where(offset)}",
                        source=url, offset=offset, status_code=status,
                    )
                etag = etag or tag
                skip = 0
                if status == 206:
                    match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
                    if match is None or int(match.group(1)) != offset:
                        raise FetchError(
                            f"{url}: asked for bytes from {offset}, but the server sent "
                            f"Content-Range {response.headers.get('Content-Range')!r}",
                            source=url, offset=offset, status_code=status,
                        )
                    if match.group(3) != "*":
                        total = int(match.group(3))
                else:
                    skip = offset  # the server ignored the range: drop what we already have
                    length = response.headers.get("Content-Length")
                    if length is not None and length.isdigit():
                        total = int(length)
                size = options.chunk_size
                # Network reads as they come (no rechunking buffer that a failure would lose),
                # split to at most chunk_size bytes.
                async with _Closing(response.aiter_raw()) as pieces:  # type: ignore[arg-type]
                    async for piece in pieces:
                        if skip:
                            if len(piece) <= skip:
                                skip -= len(piece)
                                continue
                            piece = piece[skip:]
                            skip = 0
                        failures = 0
                        for start in range(0, len(piece), size):
                            chunk = piece[start : start + size] if len(piece) > size else piece
                            offset += len(chunk)
                            yield chunk
                if skip:
                    raise FetchError(
                        f"{url}: the body is now shorter than the {offset} bytes already read",
                        source=url, offset=offset, status_code=status,
                    )
            return
        except _Transient as exc:
            error: str = str(exc)
            retry_after = exc.retry_after
        except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except httpx.HTTPError as exc:
            raise FetchError(f"{url}: {type(exc).__name__}: {exc}{_where(offset)}",
                             source=url, offset=offset) from exc
        failures += 1
        if failures > options.retries:
            raise FetchError(
                f"{url}: giving up after {failures} failed attempt"
                f"{'s' if failures > 1 else ''}{_where(offset)}; last error: {error}",
                source=url, offset=offset, status_code=status,
            )
        stats.retries += 1
        delay = min(options.max_backoff, options.backoff * 2 ** (failures - 1))
        if retry_after is not None:
            delay = max(delay, min(retry_after, options.max_backoff))
        # Jitter spreads the retries of many workers hitting the same server.
        await anyio.sleep(delay * (0.5 + 0.5 * random.random()))
