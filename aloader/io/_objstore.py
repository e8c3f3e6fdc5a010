"""Object store shards (``s3://``, ``gs://``, ``az://``) through obstore: listing and reading.

A shard URL ``scheme://bucket/key`` names the object ``key`` of the bucket (a container for
Azure: ``az://container/key``, ``abfs[s]://...``). The store is made from the URL's
``scheme://bucket`` with obstore's ``from_url``, so credentials, region and endpoint come from
the usual environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``, ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP``, ``GOOGLE_SERVICE_ACCOUNT``,
``AZURE_STORAGE_ACCOUNT_NAME``, ...), or a source's ``store=`` (an obstore store) is used for
every object URL instead, for custom credentials and endpoints. ``http(s)://`` URLs keep
aloader's own httpx path (:mod:`aloader.io._http`), not obstore's.

Listing (at the source's construction, once, in the process that builds it). A URL ending in
``/`` (or naming only the bucket) stands for the objects directly under that prefix, not
hidden ones (no segment starting with ``.``), like a local directory; a URL with ``*``, ``?``
or ``[`` is a pattern matched against the keys with the local glob's rules (``*`` and ``?``
within one segment, ``**`` across any number of them, hidden objects only where the pattern
names them). The objects are listed with obstore's streaming list under the longest literal
prefix of the pattern, and sorted by key, so every rank and worker sees the same shard order.
Any other URL is one object, not checked until it is read.

Reading. Invariant: ``offset`` counts the bytes handed on, and every attempt asks for the
object from ``offset`` on (``Range: bytes=offset-``), with ``If-Match`` the ETag of the first
response so that an object replaced meanwhile fails instead of splicing two versions (and a
resumed answer of another size or ETag fails too, for a store that does not keep to it). A
dropped connection, a body cut short, a 5xx, a throttling answer (S3 ``SlowDown``, 429) or a
timeout is retried after an exponential backoff, resuming from ``offset``: nothing handed on is
read twice and nothing is skipped. Retries are aloader's (the source's ``retries``,
``backoff``, ``max_backoff``, counted in ``stats.retries``): the stores made here have
obstore's own retries off. A store passed with ``store=`` keeps its own ``retry_config``
(obstore retries a failed request up to 10 times within 3 minutes by default, before aloader
sees it). A missing object, a missing bucket, refused credentials and an unreachable endpoint
each raise their own :class:`FetchError` subclass naming the URL. The object's bytes are
handed on as stored (a ``Content-Encoding`` it was uploaded with is not undone), whichever
path reads them.

Which client reads the bytes. Listing is always obstore's. An object's bytes are read by one
of two paths, with the same invariant, retries, errors and cache:

* Signed URLs, through aloader's own HTTP path (:func:`aloader.io._http.http_chunks`, the one
  ``http(s)://`` shards use) with aiohttp, on asyncio where aiohttp is installed, for an S3
  store that aloader made from the URL and an environment of static credentials
  (``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``, maybe ``AWS_SESSION_TOKEN``), a region
  and an endpoint only (no other ``AWS_`` setting obstore reads: see :data:`_SIGNING_ENV`),
  where the endpoint is AWS's own or an ``http://`` one with ``AWS_ALLOW_HTTP``, and the
  source has no ``headers`` or ``client_factory`` of its own. Each request is signed by
  obstore (``obstore.sign``, in the loop's thread: static credentials need no request) when
  it is made, so a resumption hours later is signed anew. Why: obstore's async API hands
  every piece of a body from its runtime's thread to the event loop's (that thread takes the
  GIL while the loop's thread parses, then a ``call_soon_threadsafe`` wake-up): on the 2-core
  benchmark (64 shards) ~3,900 futex calls per epoch (the HTTP path: 1) and up to ~150 ms of
  CPU more than plain HTTP's ~260 ms, while the HTTP path reads the same bytes in the loop's
  own thread. Error answers are sorted as obstore's are (the status and S3's ``<Code>``), and
  no message quotes a signed URL.
* obstore's own reads otherwise: a ``store=`` given (its client options and credentials are
  obstore's to apply), GCS and Azure, credentials from a service (instance metadata, web
  identity: signing would wait on it), any other ``AWS_`` setting (SSE-C keys, requester
  pays, anonymous access, proxies, ...), another https endpoint (its certificate may need
  roots that the HTTP path does not hold), Parquet's ranged reads, and where the HTTP path
  would be httpx's (trio, or no aiohttp), which costs more per request than obstore's
  threads (a trio epoch of the benchmark: ~430 ms of CPU against ~320). On asyncio, obstore's
  async API (``get_async`` and the body's async iterator); on trio, where that API needs
  asyncio's loop, obstore's blocking API in worker threads (``anyio.to_thread``), one thread
  call per request and per piece of body.

Forks: obstore's runtime (tokio) does not survive ``fork()``: a process forked after its first
request hangs at its own first request. So :func:`runtime_started` keeps aloader's worker
launcher from forking its template from such a process (see
:func:`aloader.workers._spawn.may_fork`),
and a forked process that inherited a started runtime gets a :class:`FetchError` saying so.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import anyio.to_thread

from .._backend import current_backend
from .._exceptions import (
    AccessDeniedError,
    BucketNotFoundError,
    EndpointUnreachableError,
    FetchError,
    ObjectNotFoundError,
)
from .._stats import SourceStats
from .._util import usable_cpus
from ._checksums import etag_md5
from ._http import HttpClient, HttpOptions, HttpTransport, Via, shares_one_pool
from ._resumable import Part, Reading, Retry, resumable_chunks, retry_delay, where

__all__ = ("ObjectAccess", "is_object_url", "runtime_started")

# URL schemes read through obstore, and the environment variable prefix of each family.
_FAMILIES = {
    "s3": "AWS", "s3a": "AWS",
    "gs": "GOOGLE",
    "az": "AZURE", "azure": "AZURE", "abfs": "AZURE", "abfss": "AZURE", "adl": "AZURE",
}
# obstore's store classes, by the family of schemes they serve.
_STORE_FAMILY = {"S3Store": "AWS", "GCSStore": "GOOGLE", "AzureStore": "AZURE"}
_GLOB_CHARS = frozenset("*?[")
_LIST_CHUNK = 1000
# The whole request's time limit: obstore's default (30 s) would cut long bodies.
_NO_LIMIT = timedelta(days=365)

_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]+)</Code>")
# The first URL an error quotes: the endpoint's (obstore's "Error performing list request:
# Error performing GET http://host/...", or "Error performing GET http://host/...").
_TARGET = re.compile(r"\b(https?)://([^\s/?#]+)")
_CONNECT = re.compile(r"error sending request|kind: Connect|onnection refused|dns error",
                      re.IGNORECASE)
_BUCKET_MISSING = ("NoSuchBucket", "ContainerNotFound", "NoSuchContainer",
                   "bucket does not exist")
_THROTTLED = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                        "ServerBusy", "InternalError", "ServiceUnavailable"})

# The process whose obstore runtime is started (None: not started in any process this one
# was forked from).
_RUNTIME_PID: int | None = None
# Stores made from URLs in this process, by _store_key: (scheme://bucket, timeout, and the
# family's environment variables, so that a source made after the endpoint or credentials
# changed gets a store of the new ones, as a worker started then does).
_StoreKey = tuple[str, float | None, tuple[tuple[str, str], ...]]
_STORES: dict[_StoreKey, Any] = {}
# Whether each of those stores' objects are read through signed URLs (see _may_sign).
_SIGNED: dict[_StoreKey, bool] = {}
# The environment variables that leave an S3 store made from the environment reading
# objects as a plain GET of a signed URL does: static credentials, region, endpoint, and the
# AWS command line's own settings, which obstore does not read. Any other AWS_ variable may
# change the requests (SSE-C keys, requester pays, anonymous access, proxies, ...): then
# obstore reads the objects itself.
_SIGNING_ENV = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
    "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_ALLOW_HTTP",
    "AWS_CA_BUNDLE", "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_PAGER", "AWS_DEFAULT_OUTPUT",
})
# How long a signed URL is valid: each request is signed when it is made, so this only has
# to cover clock skew between this machine and the store.
_SIGNED_FOR = timedelta(hours=1)
_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
# obstore's min_chunk_size for a body's pieces as they arrive (see _ObjectTransport).
_AS_THEY_COME = 1


def is_object_url(shard: str) -> bool:
    """Whether ``shard`` is an object store URL (``s3://``, ``gs://``, ``az://``, ...)."""
    scheme, sep, _ = shard.partition("://")
    return bool(sep) and scheme.lower() in _FAMILIES


def runtime_started() -> bool:
    """Whether this process has used obstore (and so may not fork safely any more)."""
    return os.getpid() == _RUNTIME_PID


# Whether aloader set TOKIO_WORKER_THREADS for obstore's runtime, not started yet.
_SET_THREADS = False


def _obstore(url: str) -> Any:
    """The obstore module, after checking that this process may use it."""
    global _RUNTIME_PID
    pid = os.getpid()
    if _RUNTIME_PID is not None and pid != _RUNTIME_PID:
        raise FetchError(
            f"{url}: this process was forked from one that had already used obstore, whose "
            "runtime does not survive a fork (its requests would hang); start worker "
            "processes with the 'spawn' or 'forkserver' method", source=url)
    try:
        import obstore
    except ImportError:
        raise ImportError(f"reading {url} needs the obstore package: pip install obstore"
                          ) from None
    if _RUNTIME_PID is None:
        _start_runtime(obstore)
    _RUNTIME_PID = pid
    return obstore


def _start_runtime(obstore: Any) -> None:
    """Have obstore's tokio runtime start with half this process's cores as its worker
    threads, unless ``TOKIO_WORKER_THREADS`` says otherwise (see :func:`_runtime_started`).

    The runtime only moves bytes for the loader's one Python thread, which parses them. With
    a worker thread per core (tokio's default) its threads hand each connection's wake-ups to
    one another: on 2 cores an S3 epoch of the benchmark spent ~60 ms more CPU (of ~260) than
    with one thread, and its wall time followed. tokio reads the variable once, when the
    runtime starts (at the first request awaited), so it is set until then only.
    """
    global _SET_THREADS
    if "TOKIO_WORKER_THREADS" in os.environ:
        return
    cores = usable_cpus()[0] or 2
    os.environ["TOKIO_WORKER_THREADS"] = str(max(1, cores // 2))
    _SET_THREADS = True


def _may_sign(scheme: str, allow_http: bool) -> bool:
    """Whether a store made for ``scheme`` from this environment has its objects read through
    signed URLs (see the module's description): an S3 store with static credentials (signing
    then never waits on a credential service), no other setting than :data:`_SIGNING_ENV`'s,
    and AWS's own endpoints or an http one where http is allowed."""
    if _FAMILIES[scheme] != "AWS":
        return False
    env = os.environ
    if not (env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY")):
        return False
    if any(name.startswith("AWS_") and name not in _SIGNING_ENV for name in env):
        return False
    endpoint = urlsplit(env.get("AWS_ENDPOINT_URL") or env.get("AWS_ENDPOINT")
                        or "https://s3.amazonaws.com")
    if endpoint.scheme.lower() == "http":
        return allow_http
    # Another https endpoint may have a certificate that obstore's roots hold and the HTTP
    # path's do not (a private CA in the system's store): obstore reads those.
    host = (endpoint.hostname or "").lower()
    return endpoint.scheme.lower() == "https" and (host == "amazonaws.com"
                                                   or host.endswith(".amazonaws.com"))


def _store_key(scheme: str, bucket: str, timeout: float | None) -> _StoreKey:
    """The key of the store made for ``scheme://bucket`` from the current environment."""
    family = _FAMILIES[scheme] + "_"
    env = tuple(sorted(item for item in os.environ.items() if item[0].startswith(family)))
    return f"{scheme}://{bucket}", timeout, env


def _runtime_started() -> None:
    """The first request returned: the runtime runs, the variable set for it goes."""
    global _SET_THREADS
    if _SET_THREADS:
        _SET_THREADS = False
        os.environ.pop("TOKIO_WORKER_THREADS", None)


def _split(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, key) of an object store URL."""
    # Not urlsplit: ``?`` and ``#`` are pattern and key characters here, not a query.
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"an object store URL should name a bucket, as in "
                         f"'{scheme}://bucket/key', but got {url!r}")
    return scheme.lower(), bucket, key


def _translate(pattern: str) -> str:
    """A regular expression matching what the glob ``pattern`` matches, segment-wise."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "*":
            if (pattern.startswith("**", i) and (i == 0 or pattern[i - 1] == "/")
                    and (i + 2 == n or pattern[i + 2] == "/")):
                if i + 2 == n:
                    out.append(".*")
                    i += 2
                else:
                    out.append("(?:[^/]*/)*")
                    i += 3
                continue
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = pattern.find("]", i + 2 if pattern.startswith("[!", i) else i + 1)
            if end < 0 or (end == i + 1):
                out.append(re.escape(char))
            else:
                body = pattern[i + 1 : end]
                negate = body.startswith("!")
                body = body[1:] if negate else body
                out.append("[" + ("^/" if negate else "") + body.replace("\\", "\\\\") + "]")
                i = end
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


@dataclass
class _Failure:
    """What a failed obstore call means for the loop."""

    kind: str  # missing, bucket, denied, changed, range, unreachable, transient, fatal
    status: int | None
    text: str


def _short(exc: BaseException) -> str:
    """obstore's message without its debug dump."""
    text = str(exc).split("\n\nDebug source")[0]
    text = re.sub(r"<\?xml.*", "", text, flags=re.DOTALL).strip().rstrip(":")
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


def _classify(exc: Exception) -> _Failure | None:
    """The meaning of ``exc`` raised by obstore, or None for an error that is not obstore's."""
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if not (module.startswith("obstore") or isinstance(exc, FileNotFoundError)):
        return None
    text = str(exc)
    match = _STATUS.search(text)
    status = int(match.group(1)) if match else None
    code_match = _CODE.search(text)
    code = code_match.group(1) if code_match else ""
    short = _short(exc)
    if code:
        short = f"{code}: {short}"
    # The kind of error obstore names, or else the status it quotes, says what failed.
    meaning = status
    if isinstance(exc, FileNotFoundError) or name == "NotFoundError" or status == 404:
        meaning, status = 404, status or 404
    elif name in ("PermissionDeniedError", "UnauthenticatedError"):
        meaning = 403
    elif name == "PreconditionError" and status not in (401, 403):
        meaning = 412
    if meaning is not None:
        return _Failure(_answered(meaning, code, text, short).kind, status, short)
    if name not in ("GenericError", "JoinError", "BaseError"):
        return _Failure("fatal", None, short)  # invalid path, unsupported, configuration
    if "builder error" in text:
        hint = (" (an http:// endpoint needs allow_http: AWS_ALLOW_HTTP=true, or "
                "client_options={'allow_http': True} on the store)" if "BadScheme" in text
                else "")
        return _Failure("fatal", None, short + hint)
    if _CONNECT.search(text):
        return _Failure("unreachable", None, short)
    return _Failure("transient", None, short)  # a dropped connection, a timeout, a cut body


def _answered(status: int, code: str, text: str, short: str) -> _Failure:
    """The meaning of an error answer of ``status`` (S3's error ``code`` in it, if any),
    ``text`` all that is known of it, ``short`` the words an error quotes."""
    if status == 404:
        bucket = any(marker in text for marker in _BUCKET_MISSING)
        return _Failure("bucket" if bucket else "missing", status, short)
    if status in (401, 403):
        return _Failure("denied", status, short)
    if status == 412:
        return _Failure("changed", status, short)
    if status == 416:
        return _Failure("range", status, short)
    transient = status >= 500 or status in (408, 429) or code in _THROTTLED
    return _Failure("transient" if transient else "fatal", status, short)


def _endpoint(text: str) -> str | None:
    """The endpoint (``scheme://host:port``) an error's text quotes, if any."""
    match = _TARGET.search(text)
    return None if match is None else f"{match.group(1)}://{match.group(2)}"


def _configured_endpoint(url: str, store: Any) -> str | None:
    """The endpoint a store was given (``store=``'s config) or that the environment sets for
    ``url``'s kind of store, if any: named when an error quotes none."""
    config = getattr(store, "config", None)
    if isinstance(config, dict):
        for key in ("endpoint", "aws_endpoint", "endpoint_url"):
            if isinstance(config.get(key), str) and "://" in config[key]:
                return str(config[key])
    family = _FAMILIES.get(_split(url)[0])
    names = {"AWS": ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"), "AZURE": ("AZURE_STORAGE_ENDPOINT",),
             "GOOGLE": ("GOOGLE_CLOUD_STORAGE_ENDPOINT",)}.get(family or "", ())
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


def _error(url: str, failure: _Failure, offset: int | None = None,
           attempts: int = 1, endpoint: str | None = None) -> FetchError:
    """The error raised for ``failure`` on ``url`` (``endpoint``: the store's, named when
    ``failure``'s text does not quote it: see :func:`_configured_endpoint`)."""
    _, bucket, key = _split(url)
    where = f" at byte offset {offset}" if offset else ""
    kwargs: dict[str, Any] = {"source": url, "offset": offset, "status_code": failure.status}
    if failure.kind == "bucket":
        return BucketNotFoundError(f"{url}: the bucket {bucket!r} does not exist "
                                   f"({failure.text})", **kwargs)
    if failure.kind in ("missing", "range"):
        return ObjectNotFoundError(f"{url}: no object {key!r} in the bucket {bucket!r}"
                                   f"{where} ({failure.text})", **kwargs)
    if failure.kind == "denied":
        return AccessDeniedError(f"{url}: access denied: the store refused the credentials "
                                 f"or their permissions ({failure.text})", **kwargs)
    if failure.kind == "changed":
        return FetchError(f"{url}: the object changed in the store while it was being read"
                          f"{where} ({failure.text})", **kwargs)
    if failure.kind == "unreachable":
        target = _endpoint(failure.text) or endpoint or "its endpoint"
        return EndpointUnreachableError(
            f"{url}: cannot connect to {target} after "
            f"{attempts} attempt{'s' if attempts > 1 else ''}{where} ({failure.text})", **kwargs)
    if failure.kind == "transient":
        return FetchError(f"{url}: giving up after {attempts} failed attempt"
                          f"{'s' if attempts > 1 else ''}{where}; last error: {failure.text}",
                          **kwargs)
    return FetchError(f"{url}: {failure.text}{where} (not retried)", **kwargs)


def _version_of(meta: Any) -> tuple[int, str | None, str | None]:
    """(size, ETag, Last-Modified) of an object's metadata, from a listing or a GET."""
    modified = meta.get("last_modified")
    return (int(meta["size"]), meta.get("e_tag"),
            None if modified is None else str(modified))


class _Calls:
    """obstore's calls, through the API the running event loop can use."""

    def __init__(self, obstore: Any, threaded: bool) -> None:
        self.obstore = obstore
        self.threaded = threaded

    async def get(self, store: Any, path: str, options: dict[str, Any]) -> Any:
        try:
            if self.threaded:
                return await anyio.to_thread.run_sync(
                    lambda: self.obstore.get(store, path, options=options),
                    abandon_on_cancel=True)
            return await self.obstore.get_async(store, path, options=options)
        finally:
            _runtime_started()

    async def next(self, stream: Any) -> bytes | None:
        if self.threaded:
            piece: bytes | None = await anyio.to_thread.run_sync(
                next, stream, None, abandon_on_cancel=True)
            return piece
        try:
            return await stream.__anext__()  # type: ignore[no-any-return]
        except StopAsyncIteration:
            return None


class _Presigned(Via):
    """An S3 object read through URLs signed for each request, by aloader's HTTP path:
    failures worded and sorted as obstore's are (:func:`_answered`, :func:`_error`)."""

    def __init__(self, name: str, obstore: Any, store: Any, path: str) -> None:
        self.name = name
        self._obstore = obstore
        self._store = store
        self._path = path
        self._endpoint: str | None = None

    def url(self) -> str:
        try:
            signed: str = self._obstore.sign(self._store, "GET", self._path, _SIGNED_FOR)
        except Exception as exc:
            failure = _classify(exc)
            if failure is None:
                raise
            raise _error(self.name, failure) from None
        finally:
            _runtime_started()
        if self._endpoint is None:
            parts = urlsplit(signed)
            self._endpoint = f"{parts.scheme}://{parts.netloc}"
        return signed

    def refused(self, status: int, reason: str, body: bytes, offset: int) -> FetchError | str:
        text = body.decode("utf-8", "replace")
        code_match, message = _CODE.search(text), _MESSAGE.search(text)
        code = code_match.group(1) if code_match else ""
        short = " ".join(part for part in (
            f"{code}:" if code else "", message.group(1).strip() if message else "",
            f"(HTTP {status} {reason})".replace(" )", ")")) if part)
        if len(short) > 300:  # as _short keeps obstore's
            short = short[:297] + "..."
        failure = _answered(status, code, text, short)
        if failure.kind == "transient":
            return short
        return _error(self.name, failure, offset)

    def gave_up(self, error: str, status: int | None, offset: int, failures: int,
                connect: bool) -> FetchError:
        failure = _Failure("unreachable" if connect else "transient", status, error)
        return _error(self.name, failure, offset, failures, self._endpoint)

    def digests(self, headers: Mapping[str, str]) -> dict[str, str]:
        # S3's ETag of a single-part upload is its MD5, unless the object is encrypted with
        # a KMS key or the client's own (SSE-KMS, DSSE-KMS, SSE-C): their ETags are not.
        encryption = headers.get("x-amz-server-side-encryption", "AES256").strip()
        if encryption != "AES256" or "x-amz-server-side-encryption-customer-algorithm" in \
                headers:
            return {}
        md5 = etag_md5(headers.get("ETag"))
        return {} if md5 is None else {"md5": md5}


@dataclass(frozen=True)
class ObjectAccess:
    """How a source reaches object store URLs: the store (or None: one per bucket, from the
    URL and the environment) and the retry and timeout options.

    Attributes:
        store: an obstore store used for every object URL, or None.
        options: timeouts, retries, backoff and chunk size (the source's HTTP options).
    """

    store: Any = None
    options: HttpOptions = field(default_factory=HttpOptions)
    #: ``{url: (size, ETag, Last-Modified)}`` of the objects listed (by :meth:`expand`).
    listed: dict[str, tuple[int, str | None, str | None]] = field(
        default_factory=dict, compare=False, repr=False)

    def _store(self, url: str, obstore: Any) -> tuple[Any, str]:
        """(store, path in it) for ``url``."""
        scheme, bucket, key = _split(url)
        if self.store is not None:
            return self.store, key
        timeout = self.options.timeout
        cache_key = _store_key(scheme, bucket, timeout)
        store = _STORES.get(cache_key)
        if store is None:
            client: dict[str, Any] = {"timeout": _NO_LIMIT}
            if timeout is not None:
                client["connect_timeout"] = timedelta(seconds=timeout)
                client["read_timeout"] = timedelta(seconds=timeout)
            # Client options given here replace those obstore reads from the environment.
            allow = os.environ.get(f"{_FAMILIES[scheme]}_ALLOW_HTTP")
            if allow is not None:
                client["allow_http"] = allow.strip().lower() in ("1", "true", "yes", "on")
            try:
                store = obstore.store.from_url(f"{scheme}://{bucket}", client_options=client,
                                               retry_config={"max_retries": 0})
            except Exception as exc:
                raise FetchError(f"{url}: cannot make a store for {scheme}://{bucket}: "
                                 f"{type(exc).__name__}: {_short(exc)}", source=url) from None
            for stale in [key for key in _STORES if key[:2] == cache_key[:2]]:
                del _STORES[stale]  # of an environment gone (rotated keys): one per bucket
                _SIGNED.pop(stale, None)
            _STORES[cache_key] = store
            _SIGNED[cache_key] = _may_sign(scheme, bool(client.get("allow_http")))
        return store, key

    def _presigned(self, url: str, obstore: Any) -> _Presigned | None:
        """How ``url`` is read through signed URLs, or None where obstore reads it."""
        store, path = self._store(url, obstore)
        if self.store is not None or self.options.headers or not shares_one_pool(self.options):
            # A store's client options and credentials are obstore's to apply; the source's
            # own headers (authorization, ...) and client_factory are for its http(s) URLs;
            # and httpx (trio, or asyncio without aiohttp) costs more per request than
            # obstore's threads (the benchmark's trio epoch: ~430 ms of CPU against ~320).
            return None
        scheme, bucket, _ = _split(url)
        if not _SIGNED.get(_store_key(scheme, bucket, self.options.timeout)):
            return None
        return _Presigned(url, obstore, store, path)

    def check(self, url: str) -> None:
        """Check that ``url`` fits the store given (its bucket and its kind), if any.

        Raises:
            ValueError: a URL of another bucket or another kind of store than ``store``'s.
        """
        scheme, bucket, _ = _split(url)
        if self.store is None:
            return
        family = _STORE_FAMILY.get(type(self.store).__name__)
        if family is not None and family != _FAMILIES[scheme]:
            raise ValueError(f"the shard {url!r} is not for the store given "
                             f"({type(self.store).__name__})")
        config = getattr(self.store, "config", None)
        if isinstance(config, dict):
            own = config.get("bucket") or config.get("container_name")
            if own and own != bucket:
                raise ValueError(f"the shard {url!r} names the bucket {bucket!r}, but the "
                                 f"store given is for the bucket {own!r}")

    def expand(self, spec: str) -> list[str]:
        """The object URLs ``spec`` stands for (see the module's description), sorted.

        Raises:
            ValueError: a prefix or pattern that matches no object, or a bad URL.
            FetchError: listing failed (its subclasses for a missing bucket, refused
                credentials, an unreachable endpoint).
        """
        self.check(spec)
        scheme, bucket, key = _split(spec)
        glob_at = next((i for i, char in enumerate(key) if char in _GLOB_CHARS), None)
        if glob_at is None and key and not key.endswith("/"):
            return [spec]
        if glob_at is None:
            prefix, pattern = key, re.escape(key) + "[^/]+"
        else:
            prefix, pattern = key[: key.rfind("/", 0, glob_at) + 1], _translate(key)
        matcher = re.compile(pattern + r"\Z")
        hidden_ok = "/." in "/" + key[len(prefix):]
        metas = self._list(spec, prefix)
        keys = sorted(path for path in metas
                      if matcher.match(path)
                      and (hidden_ok or "/." not in "/" + path[len(prefix):]))
        if not keys:
            what = "pattern" if glob_at is not None else "prefix"
            raise ValueError(f"no objects match the {what} {spec!r}")
        urls = [f"{scheme}://{bucket}/{path}" for path in keys]
        for shard, path in zip(urls, keys, strict=True):
            self.listed[shard] = _version_of(metas[path])
        return urls

    def _list(self, spec: str, prefix: str) -> dict[str, Any]:
        """Every key under ``prefix`` with its metadata, retried (and resumed after the last
        key) on failures."""
        obstore = _obstore(spec)
        store, _ = self._store(spec, obstore)
        keys: dict[str, Any] = {}
        last: str | None = None
        failures = 0
        while True:
            try:
                stream = obstore.list(store, prefix.rstrip("/") or None,
                                      offset=last, chunk_size=_LIST_CHUNK)
                for chunk in stream:
                    for meta in chunk:
                        keys[meta["path"]] = meta
                        last = meta["path"]
                    failures = 0
                return keys
            except Exception as exc:
                failure = _classify(exc)
                if failure is None:
                    raise
                failures += 1
                if (failure.kind not in ("transient", "unreachable")
                        or failures > self.options.retries):
                    raise _error(spec, failure, attempts=failures,
                                 endpoint=_configured_endpoint(spec, store)) from None
            time.sleep(retry_delay(self.options, failures))

    def chunks(
        self, url: str, stats: SourceStats, on_size: Callable[[int], None] | None = None,
        start: int = 0,
        on_version: Callable[[int | None, str | None, str | None], None] | None = None,
        end: int | None = None, etag: str | None = None,
        client: Callable[[], HttpClient] | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """The bytes of the object at ``url``, chunk by chunk, retried and resumed as the
        module describes (the read itself is
        :func:`~aloader.io._resumable.resumable_chunks`).

        Args:
            url: an object store URL.
            stats: counts the retries.
            on_size: called with the object's size before its first chunk.
            start: the byte to start at (a ranged GET: a resumed shard is not read again).
            on_version: called with the object's size, ETag and Last-Modified before its
                first chunk (what :mod:`aloader.io._cache` keys a copy by).
            end: the byte to stop before (a bounded ranged GET: only ``start:end`` is asked
                for, as random access needs), or None for the object's end.
            etag: the version to read (``If-Match`` from the first request on): the reads of
                one file at several ranges then all see the same object, or fail.
            client: what gives the epoch's HTTP client, for an object read through signed
                URLs (see the module's description); None: obstore reads it.

        Raises:
            FetchError: (or a subclass, as the generator runs) the object cannot be read, as
                the module describes.
        """
        return resumable_chunks(_ObjectTransport(self, url, client), url, self.options, stats,
                                on_size, start, on_version, end, etag)


class _ObjectTransport:
    """Ranged GETs of one object for :func:`~aloader.io._resumable.resumable_chunks`: through
    signed URLs (:class:`~aloader.io._http.HttpTransport` with a :class:`_Presigned`) or
    obstore's own GETs, chosen at the first request.

    An attempt that follows a failed one takes the body's pieces as they arrive (obstore's
    smallest ``min_chunk_size``) instead of gathering ``chunk_size`` bytes first: the bytes
    received before a cut are then handed on, and the next attempt resumes after them, so a
    connection that is always cut after a few KiB still makes progress. The first attempt
    gathers ``chunk_size`` bytes per piece (fewer hand-offs from obstore's thread).
    """

    def __init__(self, access: ObjectAccess, url: str,
                 client: Callable[[], HttpClient] | None) -> None:
        self.access = access
        self.url = url
        self.client = client
        self.ready = False
        self.http: HttpTransport | None = None  # the signed URLs' transport, if any
        self.calls: _Calls | None = None
        self.store: Any = None
        self.path = ""

    def _start(self) -> None:
        """Choose how the object is read (its store made, this process checked)."""
        obstore = _obstore(self.url)
        via = None if self.client is None else self.access._presigned(self.url, obstore)
        if self.client is not None and via is not None:
            self.http = HttpTransport(self.client(), self.url, self.access.options, via)
        else:
            self.store, self.path = self.access._store(self.url, obstore)
            self.calls = _Calls(obstore, threaded=current_backend() == "trio")
        self.ready = True

    @asynccontextmanager
    async def open(self, reading: Reading) -> AsyncIterator[Part | None]:
        if not self.ready:
            self._start()
        try:
            async with self._open(reading) as part:
                yield part
        except ObjectNotFoundError as exc:
            hint = "" if type(exc) is not ObjectNotFoundError or reading.offset else \
                await self._prefix_hint()
            if not hint:
                raise
            raise ObjectNotFoundError(f"{exc}{hint}", source=exc.source, offset=exc.offset,
                                      status_code=exc.status_code) from None

    async def _prefix_hint(self) -> str:
        """For a key that names no object but a prefix of some (``s3://bucket/data`` where
        ``data/...`` exist): the suggestion of the prefix, with its ``/``."""
        _, _, key = _split(self.url)
        if not key or key.endswith("/"):
            return ""
        obstore = _obstore(self.url)
        store, path = self.access._store(self.url, obstore)

        def objects_under() -> bool:
            try:
                return any(len(chunk) for chunk in obstore.list(store, path, chunk_size=1))
            except Exception:  # the hint is a courtesy: any error means none
                return False
            finally:
                _runtime_started()

        if not await anyio.to_thread.run_sync(objects_under, abandon_on_cancel=True):
            return ""
        return (f"; objects exist under {self.url}/: for the objects under that prefix, end "
                "the URL with '/'")

    @asynccontextmanager
    async def _open(self, reading: Reading) -> AsyncIterator[Part | None]:
        if self.http is not None:
            async with self.http.open(reading) as part:
                yield part
            return
        calls = self.calls
        assert calls is not None
        url = self.url
        request: dict[str, Any] = {}
        if reading.end is not None:
            request["range"] = (reading.offset, reading.end)
        elif reading.offset:
            request["range"] = {"offset": reading.offset}
        if reading.etag is not None:
            request["if_match"] = reading.etag
        size = self.access.options.chunk_size
        try:
            result = await calls.get(self.store, self.path, request)
            first = result.range[0]
            if first != reading.offset:
                raise FetchError(f"{url}: asked for bytes from {reading.offset}, but the "
                                 f"store sent bytes from {first}", source=url,
                                 offset=reading.offset)
            total, tag, modified = _version_of(result.meta)
            stream = result.stream(min_chunk_size=_AS_THEY_COME if reading.failures else size)
            yield Part(_pieces(calls, stream), 0, total, tag, modified)
        except (Retry, FetchError):
            raise
        except Exception as exc:
            failure = _classify(exc)
            if failure is None:
                raise
            if failure.kind not in ("transient", "unreachable"):
                raise _error(url, failure, reading.offset, reading.failures + 1) from None
            raise Retry(failure.text, connect=failure.kind == "unreachable",
                        status=failure.status) from None

    def gave_up(self, reading: Reading, last: Retry) -> FetchError:
        if self.http is not None:
            return self.http.gave_up(reading, last)
        failure = _Failure("unreachable" if last.connect else "transient", last.status,
                           str(last))
        return _error(self.url, failure, reading.offset, reading.failures,
                      _configured_endpoint(self.url, self.store))

    def changed(self, reading: Reading, what: str) -> FetchError:
        if self.http is not None:
            return self.http.changed(reading, what)
        return FetchError(f"{self.url}: the object changed in the store while it was being "
                          f"read ({what}){where(reading.offset)}", source=self.url,
                          offset=reading.offset)


async def _pieces(calls: _Calls, stream: Any) -> AsyncGenerator[bytes, None]:
    """The pieces of an obstore body, as its stream hands them on."""
    while (piece := await calls.next(stream)) is not None:
        yield piece
