"""One exception tree: catch :class:`AloaderError` to catch everything aloader raises itself.

Errors that torch.utils.data raises as a builtin type keep that type (the subclasses below also
derive from it, shown after the name), so code written against torch catches them unchanged::

    AloaderError
    +-- LoaderTimeoutError  (RuntimeError)   no batch within the loader's ``timeout``
    +-- LoaderClosedError   (RuntimeError)   the epoch's iterator was closed or has failed
    +-- WorkerError         (RuntimeError)   a worker process died or the workers stopped
    +-- SampleRngError      (RuntimeError)   sample_rng() outside a fetch (or without index)
    +-- FailureBudgetExceeded                more samples failed than ``max_failures`` allows
    +-- Throttled                            raised by a dataset: the store asks to slow down
    +-- SourceError                          a streaming source could not produce records
    |   +-- RecordError     (ValueError)     a malformed record
    |   +-- FetchError      (OSError)        reading a file or URL failed
    |       +-- ObjectNotFoundError (FileNotFoundError)  no object at an object store URL
    |       |   +-- BucketNotFoundError                  ... because its bucket does not exist
    |       +-- AccessDeniedError   (PermissionError)    the store refused the credentials
    |       +-- EndpointUnreachableError (ConnectionError)  the store's endpoint cannot be reached
    +-- QueueFullError                       a Batcher's queue is full
    +-- BatcherClosedError                   a Batcher is closed or closing
    +-- BatcherTimeoutError (TimeoutError)   a Batcher request was not served in time
    +-- BatchResultError    (ValueError)     a batch function returned the wrong results
    +-- BatchCostError      (RuntimeError)   an item costs more than a whole batch may

Errors raised by user code (a dataset, ``collate_fn``, a batch function) keep their own type
and gain a note saying where they were raised; they are not wrapped in this tree.
"""

from __future__ import annotations

__all__ = (
    "AccessDeniedError",
    "AloaderError",
    "BatchCostError",
    "BatchResultError",
    "BatcherClosedError",
    "BatcherTimeoutError",
    "BucketNotFoundError",
    "EndpointUnreachableError",
    "FailureBudgetExceeded",
    "FetchError",
    "LoaderClosedError",
    "LoaderTimeoutError",
    "ObjectNotFoundError",
    "QueueFullError",
    "RecordError",
    "SampleRngError",
    "SourceError",
    "Throttled",
    "WorkerError",
)


class AloaderError(Exception):
    """Base class of the exceptions aloader defines."""


# --------------------------------------------------------------------------- DataLoader


class LoaderTimeoutError(AloaderError, RuntimeError):
    """No batch arrived within the loader's ``timeout`` (torch raises a RuntimeError)."""


class LoaderClosedError(AloaderError, RuntimeError):
    """The epoch's iterator was closed, or has already reported the error that ended it.

    torch raises a RuntimeError with the same message.
    """

    def __init__(self, message: str = "DataLoader iterator was closed") -> None:
        super().__init__(message)


class WorkerError(AloaderError, RuntimeError):
    """A worker process died (killed by a signal, or exited), or the workers were stopped.

    The message is torch's ("DataLoader worker (pid N) is killed by signal: ..."), and like
    torch's it is a RuntimeError.
    """


class SampleRngError(AloaderError, RuntimeError):
    """:func:`aloader.sample_rng` was called outside a DataLoader's fetch of a sample, or
    inside ``__getitems__`` without the sample's index."""


class FailureBudgetExceeded(AloaderError):
    """More samples of an epoch failed than the loader's ``max_failures`` allows.

    Its ``__cause__`` is the last sample's error (with its own type and notes).

    Attributes:
        count: the samples that failed in the epoch.
        budget: the ``max_failures`` exceeded (a count, or a fraction of the samples).
        errors: the last errors (at most 16), the cause last.
        indices: the failed samples' indices, in the order they failed.
    """

    def __init__(self, message: str, *, count: int = 0, budget: float = 0,
                 errors: list[BaseException] | None = None,
                 indices: list[object] | None = None) -> None:
        super().__init__(message)
        self.count = count
        self.budget = budget
        self.errors: list[BaseException] = errors or []
        self.indices: list[object] = indices or []


class Throttled(AloaderError):
    """Raise it from a dataset's ``__getitem__`` (or ``__getitems__``, or a ``Stream.map``
    function) when the store it reads from asks you to slow down (an HTTP 429 or 503 with
    ``Retry-After``, S3's SlowDown, a quota error).

    Throttling is not failure: the loader lowers its concurrency (with
    ``max_concurrency="auto"``), waits ``retry_after`` seconds (or a backoff growing from
    0.1 s when None), and fetches the same index again, keeping the batch's order and each
    sample exactly once. Counted in ``stats().throttled``, not as a failure, and not against
    ``max_failures``; a fetch throttled 64 times in a row fails with this error.

    Args:
        retry_after: seconds the store asked to wait (its ``Retry-After``), or None.
        message: what the store said, for the error if it comes to that.

    Raises:
        ValueError: ``retry_after`` is negative, infinite or not a number.
    """

    def __init__(self, retry_after: float | None = None, message: str | None = None) -> None:
        if retry_after is not None and (
            isinstance(retry_after, bool) or not isinstance(retry_after, (int, float))
            or not 0 <= retry_after < float("inf")
        ):
            raise ValueError("retry_after should be a non-negative number of seconds or None, "
                             f"but got retry_after={retry_after!r}")
        text = message or ("throttled" if retry_after is None
                           else f"throttled (retry after {retry_after:g} s)")
        super().__init__(text)
        self.retry_after: float | None = None if retry_after is None else float(retry_after)


# --------------------------------------------------------------------------- sources


class SourceError(AloaderError):
    """A source could not produce its records: the message names the file or URL and where.

    Attributes:
        source: the path or URL, when known.
        offset: the byte offset in it, when known.
        line: the 1-based line number (line-oriented formats), when known.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        offset: int | None = None,
        line: int | None = None,
    ) -> None:
        super().__init__(message)
        self.source = source
        self.offset = offset
        self.line = line


class RecordError(SourceError, ValueError):
    """A malformed record (bad JSON, bad encoding, a truncated or oversized record)."""


class FetchError(SourceError, OSError):
    """Reading a file or URL failed: an HTTP error status, or retries ran out.

    Attributes:
        status_code: the HTTP status that caused it, or None for connection errors.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        offset: int | None = None,
        status_code: int | None = None,
    ) -> None:
        super().__init__(message, source=source, offset=offset)
        self.status_code = status_code


class ObjectNotFoundError(FetchError, FileNotFoundError):
    """An object store URL (``s3://``, ``gs://``, ``az://``) names no object (HTTP 404)."""


class BucketNotFoundError(ObjectNotFoundError):
    """An object store URL names a bucket (or container) that does not exist."""


class AccessDeniedError(FetchError, PermissionError):
    """The object store refused the request: bad or missing credentials, or no permission
    (HTTP 401 or 403)."""


class EndpointUnreachableError(FetchError, ConnectionError):
    """The object store's endpoint could not be connected to, after the retries."""


# --------------------------------------------------------------------------- Batcher


class QueueFullError(AloaderError):
    """The batcher's queue is full: the request was rejected at once.

    A server should answer it with "503 Service Unavailable" (and possibly ``Retry-After``).
    """


class BatcherClosedError(AloaderError):
    """The batcher is closed or closing and admits no request.

    Also raised for a request that was still queued or running when :meth:`Batcher.aclose`
    gave up draining.
    """


class BatcherTimeoutError(AloaderError, TimeoutError):
    """A request was not served within its timeout (it is also a builtin :class:`TimeoutError`)."""


class BatchResultError(AloaderError, ValueError):
    """The batch function did not return one result per item of the batch."""


class BatchCostError(AloaderError, RuntimeError):
    """An item's cost alone exceeds what one batch may cost (``max_batch_cost``, or
    ``max_batch_size`` measured by ``batch_size_fn``): it could never be batched, so it is
    refused when submitted. Ray Serve raises a ``RuntimeError`` there; this is one too."""
