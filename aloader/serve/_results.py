"""What a batch function returns, checked; how a batch's callers are answered; the stream a
streamed request reads.

:func:`_unpack` turns one batch's results into one result per item, or a
:class:`BatchResultError` saying what is wrong with them (a unary batch function's return
value, or each list a streaming one yields). :func:`_deliver`, :func:`_fail_batch` and
:func:`_answer_error` answer callers (no user code runs there); :func:`_stream_steps` hands a
streaming batch function's steps to its callers as they come. :class:`BatchStream` is what
:meth:`Batcher.stream` returns: the results of one request, in the order they came.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

import anyio

from .._backend import Waiter
from .._exceptions import BatchResultError
from ._metrics import _BatcherMetricsRecorder
from ._request import _DONE, _RUNNING, _Request, _StreamBatch

__all__ = (
    "BatchStream",
    "_answer_error",
    "_count_error",
    "_deliver",
    "_deliver_step",
    "_ends_stream",
    "_fail_batch",
    "_stream_steps",
    "_unpack",
)

R = TypeVar("R")


class _Binding(Protocol):
    new_waiter: Callable[[], Waiter]


class _StreamSource(Protocol):
    """The batcher's side of a stream (:class:`~aloader.serve._batcher.Batcher`)."""

    @property
    def _binding(self) -> _Binding: ...

    def _finish(self, request: _Request) -> None: ...

    def _leave(self, request: _Request, exc: BaseException | None) -> None: ...

    def _stream_dropped(self, request: _Request) -> None: ...

# The C-level getter: a subclass may override __traceback__ with a property that raises.
_traceback_of: Callable[[BaseException], Any] = vars(BaseException)["__traceback__"].__get__


def _ends_stream(result: object) -> bool:
    """Whether a streamed result ends its caller's stream: ``StopIteration`` or
    ``StopAsyncIteration`` (the class, as Ray Serve's streaming batch functions yield it, or an
    instance)."""
    if result is StopIteration or result is StopAsyncIteration:
        return True
    return issubclass(type(result), (StopIteration, StopAsyncIteration))


def _unpack(results: Any, n: int, name: str) -> Sequence[Any]:
    """The ``n`` results of batch function ``name`` in a list (or the list or tuple itself),
    or a BatchResultError saying what is wrong with them.

    This is where the results object's own code (``__len__``, ``__getitem__``) runs.
    """
    if type(results) is list or type(results) is tuple:
        if len(results) == n:
            checked: Sequence[Any] = results
            return checked
        raise _count_error(len(results), n, name)
    what = f"batch function {name!r} returned "
    must = "; it must return a sequence (list, tuple or array) with one result per item"
    if results is None:
        raise BatchResultError(what + "None" + must)
    kind = type(results).__name__
    if isinstance(results, (str, bytes, bytearray)):
        # Indexing would hand each caller one character: a silent wrong result.
        raise BatchResultError(f"{what}a {kind}{must}")
    if inspect.isawaitable(results):
        if inspect.iscoroutine(results):
            results.close()  # never awaited: no "never awaited" warning at collection
        raise BatchResultError(f"{what}a {kind} once awaited (an `await` is missing?){must}")
    if hasattr(type(results), "__anext__"):
        raise BatchResultError(
            f"{what}an async iterator ({kind}): a streaming batch function's callers read "
            "their results with Batcher.stream(item), or call its @batch method directly"
        )
    if not hasattr(type(results), "__len__"):
        raise BatchResultError(f"{what}a {kind}, which has no len(){must}")
    try:
        count = len(results)
    except Exception as exc:
        raise BatchResultError(
            f"{what}a {kind} whose len() raised {type(exc).__name__}: {exc}{must}"
        ) from exc
    if count != n:
        raise _count_error(count, n, name)
    if not hasattr(type(results), "__getitem__"):
        raise BatchResultError(
            f"{what}a {kind} of length {count} that cannot be indexed; results[i] must "
            "be the result for item i"
        )
    unpacked = []
    index = 0
    try:
        for index in range(n):
            unpacked.append(results[index])
    except Exception as exc:
        raise BatchResultError(
            f"{what}a {kind} of length {count} whose results[{index}] raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return unpacked


def _count_error(count: int, n: int, name: str) -> BatchResultError:
    return BatchResultError(
        f"batch function {name!r} returned {count} results for a batch "
        f"of {n} items; it must return exactly one result per item"
    )


# -- answering the callers of a batch (no user code runs here) ----------------------------------


def _deliver_step(
    batch: list[_Request], results: Sequence[Any], metrics: _BatcherMetricsRecorder
) -> None:
    """Give each stream still read its result of one step (no user code runs here)."""
    for request, result in zip(batch, results, strict=True):
        if request.state != _RUNNING:
            continue  # ended, or its caller left
        chunks = request.chunks
        assert chunks is not None and request.batch is not None
        if _ends_stream(result):
            request.state = _DONE
            request.batch.live -= 1
            metrics.completed += 1
        elif issubclass(type(result), Exception):
            request.error = result
            request.tb = _traceback_of(result)
            request.state = _DONE
            request.batch.live -= 1
            metrics.failed += 1
        else:
            chunks.append(result)
        request.wake()


async def _stream_steps(
    batch: list[_Request], steps: Any, name: str, metrics: _BatcherMetricsRecorder
) -> None:
    """Hand each step of a streaming batch function ``name`` (``steps``: an async iterator of
    one sequence of results per step) to the streams of ``batch``, then end those still open.

    Once no caller reads any more (each has ended or left) the iteration stops: at the next
    step, or at once when the last one leaves while it waits (the batcher cancels
    ``_StreamBatch.scope``). The iterator is closed in every case; what it raises reaches the
    caller (the batcher fails the streams still open with it).
    """
    # Those still running: a caller may have left while the batch function started.
    shared = _StreamBatch(sum(request.state == _RUNNING for request in batch))
    for request in batch:
        request.batch = shared
    n = len(batch)
    try:
        with anyio.CancelScope() as scope:
            shared.scope = scope
            async for results in steps:
                _deliver_step(batch, _unpack(results, n, name), metrics)
                if not shared.live:
                    break
    finally:
        shared.scope = None
        aclose = getattr(steps, "aclose", None)
        if aclose is not None:
            await aclose()
    completed = 0
    for request in batch:
        if request.state == _RUNNING:
            request.state = _DONE
            request.wake()
            completed += 1
    metrics.completed += completed


def _deliver(
    batch: list[_Request], results: Sequence[Any], metrics: _BatcherMetricsRecorder
) -> None:
    """Answer the waiting callers from checked results (no user code runs here)."""
    completed = failed = 0
    for request, result in zip(batch, results, strict=True):
        if request.state != _RUNNING:
            continue  # its caller gave up: never resolve it
        # type(), not isinstance(): an object faking __class__ could not be raised.
        if issubclass(type(result), Exception):
            request.error = result
            request.tb = _traceback_of(result)
            failed += 1
        elif request.chunks is not None:
            request.chunks.append(result)  # a stream of one result
            completed += 1
        else:
            request.result = result
            completed += 1
        request.state = _DONE
        waiter = request.waiter
        if not waiter.done():  # on asyncio, a cancelled caller's future is done
            waiter.set_result(None)
    metrics.completed += completed
    metrics.failed += failed


def _answer_error(
    request: _Request, error: BaseException, metrics: _BatcherMetricsRecorder
) -> None:
    """Fail one request that no batch runs (queued, or just taken out of the queue)."""
    request.error = error
    request.tb = error.__traceback__
    request.state = _DONE
    request.wake()
    metrics.failed += 1


def _fail_batch(
    batch: list[_Request],
    error: BaseException,
    tb: TracebackType | None,
    metrics: _BatcherMetricsRecorder,
) -> int:
    """Fail the callers of ``batch`` still waiting with ``error``; return how many."""
    failed = 0
    for request in batch:
        if request.state == _RUNNING:
            request.error = error
            request.tb = tb
            request.state = _DONE
            request.wake()
            failed += 1
    metrics.failed += failed
    return failed


class BatchStream(Generic[R]):
    """The results of one request to a streaming batch function, as an async iterator.

    :meth:`Batcher.stream` returns it, and so does calling an ``async def`` generator method
    decorated with :func:`batch`. The request is queued when the stream is made (not at the
    first ``__anext__``), so the streams of several callers made together share a batch.
    Each list the batch function yields gives this stream its item's element; a
    ``StopIteration`` or ``StopAsyncIteration`` element ends this stream alone (the others go
    on); an exception instance in the element, or one raised by the batch function, is
    raised here after the results that came before it, and ends the stream. Results that
    arrive while nobody reads are kept in order for this stream, whatever the batch function
    yields meanwhile for the others.

    Leaving early (:meth:`aclose`, a cancelled ``__anext__``) takes the request out of its
    queue or batch; once every caller of a streaming batch has left, the batch function's
    iteration is cancelled and closed, and its execution slot goes to the next batch. A
    stream dropped before its end (a ``break`` out of ``async for``, a reader cancelled
    between two results) leaves when it is collected, as an async generator is closed then;
    read with ``async with contextlib.aclosing(stream):`` to leave at the ``break`` itself.
    """

    __slots__ = ("_batcher", "_over", "_reading", "_request")

    _batcher: _StreamSource
    _request: _Request
    _over: bool
    _reading: bool

    @classmethod
    def _open(cls, batcher: _StreamSource, request: _Request) -> BatchStream[Any]:
        """The stream of ``request`` (queued by ``batcher``); streams are made by
        :meth:`Batcher.stream`, not by users."""
        stream: BatchStream[Any] = cls.__new__(cls)
        stream._batcher = batcher
        stream._request = request
        stream._over = False
        stream._reading = False
        return stream

    def __aiter__(self) -> BatchStream[R]:
        return self

    async def __anext__(self) -> R:
        """The next result for this request.

        Raises:
            StopAsyncIteration: After the last result, or once the stream was closed.
            BatcherTimeoutError: If the request's timeout (or queue_timeout) passed.
            RuntimeError: If another task is reading this stream now (as an async
                generator's ``anext()`` while it runs).
            BaseException: What the batch function raised, or put in this item's element.
        """
        if self._reading:
            raise RuntimeError("this BatchStream is already being read by another task")
        if self._over:
            raise StopAsyncIteration
        request = self._request
        chunks = request.chunks
        assert chunks is not None
        self._reading = True
        try:
            while not chunks:
                if request.state >= _DONE:
                    self._over = True
                    self._batcher._finish(request)  # raises the error or timeout, if any
                    raise StopAsyncIteration
                waiter = request.waiter = self._batcher._binding.new_waiter()
                try:
                    await waiter
                except BaseException as exc:
                    self._over = True
                    self._batcher._leave(request, exc)
                    raise
                if self._over:  # closed by another task meanwhile
                    raise StopAsyncIteration
        finally:
            self._reading = False
        result: R = chunks.popleft()
        return result

    async def aclose(self) -> None:
        """Stop reading: the request leaves its queue or batch (the others' go on); a task
        waiting in ``__anext__`` gets ``StopAsyncIteration``."""
        if not self._over:
            self._over = True
            request = self._request
            self._batcher._leave(request, None)
            if request.chunks is not None:
                request.chunks.clear()  # what came and was never read goes now
            request.wake()

    def __del__(self) -> None:
        # Collected before its end, by whatever thread: the request leaves on the loop.
        if not self._over and self._request.state < _DONE:
            self._batcher._stream_dropped(self._request)

    def __repr__(self) -> str:
        state = "over" if self._over else ("answered" if self._request.state >= _DONE else "open")
        return f"<BatchStream of {self._batcher!r} {state}>"
