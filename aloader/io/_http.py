"""Streaming HTTP(S) bodies: timeouts, bounded retries, resumption by byte range.

The client. On asyncio, requests go through aiohttp when it is installed, else httpx; on trio,
through httpx (aiohttp runs on asyncio only); a ``client_factory`` always gives an
``httpx.AsyncClient``. ``benchmarks/bench_http_clients.py`` measured the choice: httpx's
connection pool checks every connection it holds at each request (``is_idle``,
``has_expired``, a ``poll`` and a ``getpeername`` per connection), so its cost per request
grows with the requests in flight, while aiohttp's stays flat and is several times smaller at
8 in flight already. So the shards an epoch reads at once share one aiohttp session (of as
many connections), while on httpx each read-ahead slot has a client of its own connection
(:func:`shares_one_pool`). aiohttp's ``trust_env`` (proxies from the environment, ``.netrc``
credentials) is on only when the environment sets a proxy or has a ``.netrc`` file: it costs
two thread hops per request. The two are wrapped in :class:`HttpClient`, which hands this
module the status, headers and raw body of a response and sorts each library's errors into
transient (retried) and fatal ones, so that everything below is one mechanism for both. Both
libraries are imported on first use, so ``import aloader`` stays light.

A body is read as a sequence of chunks, by the resumable read every remote source shares
(:mod:`aloader.io._resumable`: offsets, failures, backoff, the version check); this module is
its HTTP transport. When the connection fails (refused, reset, cut in the middle of the body,
timed out) or the server answers a transient status (5xx, 408, 429), the request is retried
after an exponential backoff, asking for the rest of the body only (``Range: bytes=N-``, where
N counts the bytes already delivered). A server that ignores ranges answers 200 with the
whole body: the first N bytes are then skipped (a 200 that carries a ``Content-Range`` is a
part, read as a 206 is). A body that ends before the length its response announced (a
``Content-Range`` shorter than asked) is resumed the same way. A resumption whose response
tells another length of the body (or another ETag) than an earlier one did is an error: the
resource changed. A retry's range that the server answers 416 with the length already read
(a cut just before a chunked body's last, empty chunk) ends the body. A client error such as
404 fails at once, and so does a redirect to a URL that is not http(s) (``data:``,
``file:``, ...).

Content codings. Requests ask for ``Accept-Encoding: identity``; a server may still send a
coded body (``Content-Encoding: gzip``, as object stores do for files uploaded that way). Such
a body is decoded as it streams (by :mod:`aloader.io._codecs`, the decoders of compressed
shards): gzip and deflate with zlib, ``br`` with the brotli (or brotlicffi) package and
``zstd`` with zstandard (or Python 3.14's ``compression.zstd``) when installed; any other
coding, or one whose decoder is missing, is a :class:`FetchError` naming the URL and the
coding, never bytes parsed as if they were plain. A transfer coding other than chunked
(``Transfer-Encoding: gzip, chunked``: legal, rare) is undone the same way. A Range request
on a coded body would count bytes of the coded representation, not the decoded ones N
counts, and a decoder cannot start in the middle of its stream: so a coded body is resumed
by reading it again from its start (without Range) and skipping the N decoded bytes already
delivered. A coded stream that stops before its end marker is retried like a connection cut;
one that does not decode fails at once.

An object store's objects read through signed URLs (:mod:`aloader.io._objstore`) take this same
path with a :class:`Via`: a URL signed for each request, errors worded by the store's rules
and naming the object's own URL (never the signed one), ``If-Match`` on every request once the
ETag is known, and the body handed on as stored (no content coding undone).

Limits: a plain body with neither ``Content-Length`` nor chunked framing, cut by the server,
cannot be told from a complete one (HTTP has no way); the record formats then report a
truncated last record where they can.
"""

from __future__ import annotations

import functools
import os
import re
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .._backend import current_backend
from .._exceptions import FetchError
from .._stats import SourceStats
from .._util import Closing
from ._checksums import store_digests
from ._codecs import CodingError, Decoder, MissingPackage, Truncated, decoded, decoder
from ._resumable import Part, Reading, Retry, resumable_chunks, where

if TYPE_CHECKING:
    import httpx

__all__ = ("HttpClient", "HttpOptions", "HttpTransport", "Via", "env_configures_http",
           "http_chunks", "make_client", "shares_one_pool")

_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
# A 416's Content-Range: the body's length.
_UNSATISFIED = re.compile(r"bytes\s+\*/(\d+)")
# Statuses worth retrying: server errors, request timeout, too many requests.
_TRANSIENT = frozenset({408, 429})
# The most bytes a decoder hands on at once (before they are split to chunk_size).
_MAX_PIECE = 1 << 24


@dataclass(frozen=True)
class HttpOptions:
    """How sources fetch URLs.

    Attributes:
        timeout: seconds for connecting and for each read (None: no limit): a server that
            stops sending fails the attempt (retried from the last byte received); one that
            keeps sending, however slowly, is not stopped (no limit on a whole response).
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


def make_client(options: HttpOptions, connections: int, env: bool | None = None
                ) -> HttpClient:
    """The client for one epoch (closed at its end), keeping up to ``connections``
    connections: aiohttp on asyncio when it is installed, else httpx (see the module's
    docstring); the ``client_factory``'s ``httpx.AsyncClient`` when there is one.

    ``env`` is :func:`env_configures_http` when the caller already asked (the clients of one
    epoch share the answer), None to ask here."""
    if options.client_factory is not None:
        return _HttpxClient(options.client_factory())
    if current_backend() == "asyncio":
        try:
            import aiohttp
        except ImportError:
            pass
        else:
            return _AiohttpClient(aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=connections, ssl=_ssl_context()),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=options.timeout,
                                              sock_read=options.timeout),
                headers=dict(options.headers) if options.headers else None,
                auto_decompress=False,  # the body as sent: this module decodes it
                # Proxies from HTTP(S)_PROXY and NO_PROXY, as httpx has it (and aiohttp's
                # .netrc credentials). Only when there are some: with trust_env, aiohttp looks
                # both up in a thread at every request, two thread hops in each request's path.
                trust_env=env_configures_http() if env is None else env,
            ))
    import httpx

    return _HttpxClient(httpx.AsyncClient(
        timeout=httpx.Timeout(options.timeout),
        limits=httpx.Limits(max_connections=connections,
                            max_keepalive_connections=connections),
        headers=dict(options.headers) if options.headers else None,
        follow_redirects=True,
        verify=_ssl_context(),
    ))


def shares_one_pool(options: HttpOptions) -> bool:
    """Whether :func:`make_client` gives an aiohttp client here, whose pool's cost per request
    stays flat with the connections it holds: then the shards an epoch reads at once share one
    client (one session, not one per shard slot: 7 ms less per epoch of 16 slots). httpx's pool
    checks every connection it holds at each request, so there each slot keeps a client of
    one connection."""
    if options.client_factory is not None or current_backend() != "asyncio":
        return False
    try:
        import aiohttp  # noqa: F401 - only whether it is installed
    except ImportError:
        return False
    return True


def env_configures_http() -> bool:
    """Whether the environment sets a proxy or has a ``.netrc`` file: what aiohttp's
    ``trust_env`` would find (without either it finds nothing, so it is turned off)."""
    import urllib.request  # aiohttp imports it already

    if urllib.request.getproxies():
        return True
    path = os.environ.get("NETRC")
    if path is None:
        try:
            path = os.path.join(os.path.expanduser("~"), ".netrc")
        except RuntimeError:  # no home directory: aiohttp finds no file either
            return False
    return os.path.exists(path)


class _Failed(Exception):
    """A request that failed in the client library, sorted by :class:`HttpClient`."""

    def __init__(self, error: str, transient: bool, cause: BaseException,
                 connect: bool = False) -> None:
        super().__init__(error)
        self.transient = transient
        self.cause = cause
        self.connect = connect  # no connection was made (refused, no route, DNS)


@dataclass
class _Reply:
    """What this module reads of a response: the status, the headers (looked up ignoring
    case), and the raw body (as sent: content codings not undone)."""

    status: int
    reason: str
    headers: Mapping[str, str]
    body: AsyncGenerator[bytes, None]


class HttpClient:
    """One HTTP client library behind the interface :func:`http_chunks` uses.

    Invariant: every exception of the library, raised while a request is made or its body
    is read, leaves :meth:`get` as :class:`_Failed`, transient (worth retrying: connection
    refused, reset or cut, timeouts, a malformed response) or not (a redirect out of http(s),
    ...), with a message naming what failed.
    """

    def get(self, url: str, headers: Mapping[str, str]) -> Any:
        """An async context manager: a GET of ``url``, following redirects, as a _Reply."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close the connections."""
        raise NotImplementedError

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


def _named(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _HttpxClient(HttpClient):
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    @asynccontextmanager
    async def get(self, url: str, headers: Mapping[str, str]) -> AsyncIterator[_Reply]:
        import httpx

        try:
            async with self.client.stream("GET", url, headers=headers) as response:
                body: Any = response.aiter_raw()  # an async generator (typed as an iterator)
                yield _Reply(response.status_code, response.reason_phrase, response.headers,
                             body)
        except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise _Failed(_named(exc), True, exc, isinstance(exc, httpx.ConnectError)) from exc
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            # The URL itself was checked: an unsupported or invalid one comes from a
            # redirect (to data:, file:, ...), which httpx follows without asking.
            raise _Failed(f"{_named(exc)}{_httpx_redirected(exc, url)}", False, exc) from exc

    async def aclose(self) -> None:
        await self.client.aclose()


class _AiohttpClient(HttpClient):
    def __init__(self, session: Any) -> None:
        self.session = session

    @asynccontextmanager
    async def get(self, url: str, headers: Mapping[str, str]) -> AsyncIterator[_Reply]:
        import aiohttp

        try:
            async with self.session.get(url, headers=headers, allow_redirects=True) as response:
                yield _Reply(response.status, response.reason or "", response.headers,
                             _read_all(response.content))
        except (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError) as exc:
            # The URL itself was checked: this one comes from a redirect.
            target = getattr(exc, "url", exc)
            raise _Failed(f"{type(exc).__name__} (the server redirected to {target})", False,
                          exc) from exc
        except aiohttp.TooManyRedirects as exc:
            # Its own message is its status and URL ("0, message='', url=...").
            raise _Failed(f"TooManyRedirects: more than {len(exc.history)} redirects in a row "
                          f"(a redirect loop?), the last to {exc.request_info.real_url}", False,
                          exc) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Connection errors, bodies cut short (ClientPayloadError), timeouts, malformed
            # responses (ClientResponseError from the parser): as httpx's network and
            # protocol errors, worth retrying.
            raise _Failed(_aiohttp_named(exc), True, exc,
                          isinstance(exc, aiohttp.ClientConnectorError)) from exc

    async def aclose(self) -> None:
        await self.session.close()


def _aiohttp_named(exc: BaseException) -> str:
    """``_named(exc)``, aiohttp's common failures named as httpx names them, so that a
    message reads the same whichever client made the request."""
    import aiohttp

    kinds: tuple[tuple[type[BaseException], str], ...] = (
        (aiohttp.ConnectionTimeoutError, "ConnectTimeout"),
        (aiohttp.SocketTimeoutError, "ReadTimeout"),
        (aiohttp.ClientConnectorError, "ConnectError"),
        (aiohttp.ClientPayloadError, "RemoteProtocolError"),
        (aiohttp.ServerDisconnectedError, "RemoteProtocolError"),
    )
    for kind, name in kinds:
        if isinstance(exc, kind):
            return f"{name}: {exc}" if str(exc) else name
    return _named(exc)


async def _read_all(content: Any) -> AsyncGenerator[bytes, None]:
    """An aiohttp body's pieces as the network delivers them."""
    while piece := await content.readany():
        yield piece


class Via:
    """A resource that :func:`http_chunks` reaches by URLs other than its name: an object
    store's, by URLs signed for each request (:mod:`aloader.io._objstore`).

    Invariant: the URLs requested never reach an error message (they may carry credentials
    in their query string): every message names :attr:`name`, and each failure is worded by
    the store's rules (:meth:`refused`, :meth:`gave_up`), as its own client words it. The body
    is handed on as stored (a ``Content-Encoding`` is not undone, as the store's own client
    does not undo it), and every request after the first asks for the version the first
    answer sent (``If-Match``).
    """

    name: str
    #: How an error says that the resource changed while it was read.
    changed = "the object changed in the store"

    def url(self) -> str:
        """The URL of the next request (signed now: a resumption hours later still works)."""
        raise NotImplementedError

    def refused(self, status: int, reason: str, body: bytes, offset: int) -> FetchError | str:
        """An answer other than 200, 206 (and a 416 that ends the body): the error to raise
        at once, or the text of a transient failure (retried)."""
        raise NotImplementedError

    def gave_up(self, error: str, status: int | None, offset: int, failures: int,
                connect: bool) -> FetchError:
        """The error once retries ran out, ``error`` the last failure's text (``connect``:
        no connection could be made)."""
        raise NotImplementedError

    def digests(self, headers: Mapping[str, str]) -> dict[str, str]:
        """The store's checksums of the object that an answer's ``headers`` tell beyond
        the standard ones (:func:`~aloader.io._checksums.store_digests`)."""
        return {}


# What a refused answer's body is read of (an S3 error document is well under it).
_ERROR_BODY = 1 << 16
_QUERY = re.compile(r"(https?://[^\s?'\"<>]*)\?[^\s'\"<>]*")


def _scrubbed(text: str) -> str:
    """``text`` without the query strings of the URLs it quotes (signatures)."""
    return _QUERY.sub(r"\1", text)


async def _head_of(body: AsyncGenerator[bytes, None], limit: int) -> bytes:
    """The first ``limit`` bytes of ``body`` at most."""
    parts: list[bytes] = []
    got = 0
    async with Closing(body) as pieces:
        async for piece in pieces:
            parts.append(piece)
            got += len(piece)
            if got >= limit:
                break
    return b"".join(parts)[:limit]


# --------------------------------------------------------------------------- content codings

# The content codings a response may carry (gzip, deflate; br and zstd with their packages).
_HTTP_CODINGS = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd"})


def _codings(value: str | None) -> list[str]:
    """The codings of a ``Content-Encoding`` or ``Transfer-Encoding`` header, in the order they
    were applied (``chunked``, the framing the client library undoes, left out)."""
    if not value:
        return []
    names = [name.strip().lower() for name in value.split(",")]
    return [name for name in names if name and name not in ("identity", "chunked")]


def _body_decoders(url: str, headers: Mapping[str, str], limit: int) -> list[Decoder]:
    """Decoders undoing a response's codings: a transfer coding (``Transfer-Encoding: gzip,
    chunked``, which aiohttp hands on undone, and httpx refuses), then its content codings.

    Raises:
        FetchError: a coding that is unknown, or whose optional package is not installed.
    """
    return (_decoders(url, headers.get("Transfer-Encoding"), limit, "Transfer-Encoding")
            + _decoders(url, headers.get("Content-Encoding"), limit))


def _decoders(url: str, value: str | None, limit: int,
              header: str = "Content-Encoding") -> list[Decoder]:
    """Decoders undoing ``{header}: value``, the last applied first.

    Raises:
        FetchError: a coding that is unknown, or whose optional package is not installed.
    """
    decoders: list[Decoder] = []
    for coding in reversed(_codings(value)):
        if coding not in _HTTP_CODINGS:
            raise FetchError(f"{url}: the server sent the body with {header} "
                             f"{coding!r}, which aloader cannot decode (gzip, deflate, br and "
                             "zstd can be)", source=url)
        try:
            decoders.append(decoder(coding, limit))
        except MissingPackage as exc:
            packages = " or ".join(sorted(exc.packages))
            raise FetchError(f"{url}: the server sent the body with {header} "
                             f"{coding!r}, which needs the {packages} package to decode "
                             f"(pip install {exc.packages[0]}); it is not installed",
                             source=url) from None
    return decoders


# --------------------------------------------------------------------------- reading


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff


def _length_of(total: int | None, headers: Mapping[str, str]) -> int | None:
    """The body's length: ``total`` if a response told it, else what a 416's
    ``Content-Range: bytes */N`` says, else None."""
    if total is not None:
        return total
    match = _UNSATISFIED.fullmatch(headers.get("Content-Range", "").strip())
    return None if match is None else int(match.group(1))


class HttpTransport:
    """GETs of one URL with ``Range`` for :func:`~aloader.io._resumable.resumable_chunks`:
    the statuses, ranges and codings sorted as the module describes."""

    def __init__(self, client: HttpClient, url: str, options: HttpOptions,
                 via: Via | None) -> None:
        self.client = client
        self.url = url
        self.via = via
        self.limit = min(options.chunk_size, _MAX_PIECE)
        self.checked = via is not None  # the URL was checked (a Via's are signed, not given)
        self.coded = False  # the server sends the body with a content coding: from its start

    @asynccontextmanager
    async def open(self, reading: Reading) -> AsyncIterator[Part | None]:
        url, via = self.url, self.via
        if not self.checked:
            problem = _url_problem(url)
            if problem is not None:
                raise FetchError(f"{url}: {problem}", source=url)
            self.checked = True
        offset, end = reading.offset, reading.end
        while True:  # twice at most: a range of a coded body is asked for again, whole
            headers = {"Accept-Encoding": "identity"}
            if via is not None and reading.etag is not None:
                headers["If-Match"] = reading.etag
            if end is not None and not self.coded:
                headers["Range"] = f"bytes={offset}-{end - 1}"
            elif offset and not self.coded:
                headers["Range"] = f"bytes={offset}-"
            status: int | None = None
            try:
                async with self.client.get(url if via is None else via.url(),
                                           headers) as response:
                    status = response.status
                    part = await self._part(reading, headers, response)
                    yield part
                    return
            except _AskAgain:
                continue
            except _Failed as exc:
                if not exc.transient:
                    if via is not None:  # the cause quotes the signed URL
                        raise FetchError(f"{url}: {_scrubbed(str(exc))}{where(reading.offset)}",
                                         source=url, offset=reading.offset) from None
                    raise FetchError(f"{url}: {exc}{where(reading.offset)}", source=url,
                                     offset=reading.offset) from exc.cause
                raise Retry(str(exc) if via is None else _scrubbed(str(exc)),
                            connect=exc.connect, status=status) from None
            except CodingError as exc:
                raise FetchError(f"{url}: the {exc.coding} body {exc.detail}"
                                 f"{where(reading.offset)} (decoded bytes)", source=url,
                                 offset=reading.offset, status_code=status) from None
            except Truncated as exc:
                raise Retry(f"the {exc.coding} body ended before the end of its stream",
                            status=status) from None

    async def _part(self, reading: Reading, headers: Mapping[str, str],
                    response: _Reply) -> Part | None:
        """What ``response`` (to a request with ``headers``) brings; None: the body is whole
        already.

        Raises:
            _AskAgain: ask again (a range of a coded body: the whole body this time).
        """
        url, via, offset = self.url, self.via, reading.offset
        status, reason = response.status, response.reason
        if status == 416 and offset == _length_of(reading.total, response.headers):
            return None  # every byte came (a cut before a chunked body's last chunk)
        retry_after = _retry_after(response.headers.get("Retry-After"))
        if via is not None and status not in (200, 206):
            outcome = via.refused(status, reason,
                                  await _head_of(response.body, _ERROR_BODY), offset)
            if isinstance(outcome, FetchError):
                raise outcome
            raise Retry(outcome, retry_after, status=status)
        if status >= 500 or status in _TRANSIENT:
            raise Retry(f"HTTP {status} {reason}".rstrip(), retry_after, status=status)
        if status not in (200, 206):
            raise FetchError(f"{url}: HTTP {status} {reason}{where(offset)} (not retried)",
                             source=url, offset=offset, status_code=status)
        try:
            decoders = [] if via is not None else _body_decoders(url, response.headers,
                                                                 self.limit)
        except FetchError as exc:
            exc.offset, exc.status_code = offset, status
            raise
        skip = 0
        total: int | None = None
        match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
        if decoders:
            if status == 206:
                if "Range" not in headers:
                    raise FetchError(f"{url}: HTTP 206 to a request for the whole body",
                                     source=url, offset=offset, status_code=status)
                # A range of the coded bytes, which offset does not count: read the body
                # again from its start (not a failure, and only once: the next request asks
                # for no range).
                self.coded = True
                raise _AskAgain
            self.coded = True
            skip = offset
        elif status == 206 or match is not None:
            # A 200 with a Content-Range is a part too (as some proxies answer a range):
            # taken for the whole body, its first bytes would be skipped.
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
        digests: dict[str, str] = {}
        if not decoders:
            digests = store_digests(response.headers, status == 200 and "Range" not in headers)
            if via is not None:
                digests.update(via.digests(response.headers))
        return Part(decoded(response.body, decoders) if decoders else response.body, skip,
                    total, response.headers.get("ETag"), response.headers.get("Last-Modified"),
                    status, plain=not decoders, digests=digests)

    def gave_up(self, reading: Reading, last: Retry) -> FetchError:
        if self.via is not None:
            return self.via.gave_up(str(last), last.status, reading.offset, reading.failures,
                                    last.connect)
        failures = reading.failures
        return FetchError(
            f"{self.url}: giving up after {failures} failed attempt"
            f"{'s' if failures > 1 else ''}{where(reading.offset)}; last error: {last}",
            source=self.url, offset=reading.offset, status_code=last.status,
        )

    def changed(self, reading: Reading, what: str) -> FetchError:
        words = "the resource changed on the server" if self.via is None else self.via.changed
        return FetchError(f"{self.url}: {words} while it was being read ({what})"
                          f"{where(reading.offset)}", source=self.url, offset=reading.offset,
                          status_code=reading.status)


class _AskAgain(Exception):
    """The answer is not the one to read: ask again (not a failure)."""


def http_chunks(
    client: HttpClient,
    url: str,
    options: HttpOptions,
    stats: SourceStats,
    on_size: Callable[[int], None] | None = None,
    start: int = 0,
    on_version: Callable[[int | None, str | None, str | None], None] | None = None,
    end: int | None = None,
    etag: str | None = None,
    via: Via | None = None,
) -> AsyncGenerator[bytes, None]:
    """The body of ``url``, chunk by chunk (decoded), retried and resumed as the module
    describes (the read itself is :func:`~aloader.io._resumable.resumable_chunks`).

    Args:
        client: the epoch's client.
        url: the URL.
        options: timeouts, retries and backoff.
        stats: counts the retries.
        on_size: called with the body's length when a response first tells it (a plain
            body's ``Content-Length`` or ``Content-Range``), before the chunks it announces.
        start: the byte to start at: the body from there, asked for as a resumption is
            (``Range: bytes=start-``), so a resumed shard is not read again from byte 0.
        on_version: called, before the first chunk, with the plain body's length (None when
            unknown or coded), ETag and Last-Modified of the first response that sends the
            body (what :mod:`aloader.io._cache` keys a copy by).
        end: the byte to stop before (``Range: bytes=start-(end-1)``, as random access
            needs), or None for the body's end.
        etag: the version to read: a response with another ETag is an error, so that the
            reads of one file at several ranges all see the same resource.
        via: the URLs to request and the wording of failures, for a resource named ``url``
            that is not requested at ``url`` itself (see :class:`Via`).

    Raises:
        FetchError: (as the generator runs) an error status that is not transient (at once),
            a redirect to a URL that is not http(s), a content coding that cannot be decoded,
            a response that does not fit the resumption (wrong range, changed ETag), or
            retries exhausted.
    """
    return resumable_chunks(HttpTransport(client, url, options, via), url, options, stats,
                            on_size, start, on_version, end, etag)


@functools.lru_cache(maxsize=1 << 14)
def _url_problem(url: str) -> str | None:
    """Why ``url`` is not a valid http(s) URL, or None. Cached: every epoch asks again about
    the same shards, and httpx's parse costs about a microsecond per character."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        return f"not a valid URL: {exc}"
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return "not a valid http(s) URL"
    return None


def _httpx_redirected(exc: Exception, url: str) -> str:
    """`` (redirected to ...)`` when ``exc`` concerns another URL than ``url``."""
    import httpx

    if isinstance(exc, httpx.InvalidURL):
        return " (the server redirected to a URL that is not a valid http(s) URL)"
    try:
        target = str(exc.request.url)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # httpx raises RuntimeError when it has no request
        return ""
    return f" (the server redirected to {target})" if target != url else ""
