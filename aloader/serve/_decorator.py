"""``@batch``: Ray Serve's ``@serve.batch`` decorator, on :class:`Batcher`.

A decorated ``async def`` function (or method) takes lists, one per parameter, and is called
with single values; each call becomes one item of a batch::

    @aloader.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def embed(texts: list[str], lang: list[str]) -> list[np.ndarray]: ...

    vector = await embed("hello", lang="en")  # from many concurrent tasks

    class Model:
        @aloader.batch(max_batch_size=8)
        async def generate(self, prompts: list[str]):  # an async generator: streams
            async for step in self.decode(prompts):
                yield step  # one result per prompt each step

    async for token in model.generate("Once upon"): ...

Each call's arguments are bound to the function's signature as a call would bind them (a bad
call is a ``TypeError`` in the caller), and the batch calls the function with one list per
parameter: ``f(key1=[a1, a2], key2=[b1, b2])``, positional-only parameters by position. A
parameter that no call of the batch passed is left out (its default applies, as Ray does); one
that some passed gets its default in the others' places. ``*args`` and ``**kwargs`` are
batched position by position and key by key; calls of one batch must then pass the same number
of extra positions and the same keys (else the batch fails with a ``TypeError``).

A function gets one batcher; a method one per instance (``instance.method`` is that
instance's batcher, a :class:`BatchMethod`, so ``instance.method.metrics()`` and
``await instance.method.aclose()`` work, and so do Ray's setters and getters).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

from .._util import is_async_callable
from ._batcher import Batcher
from ._checks import is_async_gen_callable

__all__ = ("BatchMethod", "batch")

# The per-call options of Batcher.__call__, recognised in a decorated function's calls unless
# the function has a parameter of that name (the function's own parameter wins).
_CALL_OPTIONS = frozenset({"timeout", "priority", "queue_timeout"})

_OPTIONS = frozenset({
    "max_batch_size", "batch_wait_timeout_s", "max_wait", "max_concurrent_batches",
    "batch_size_fn", "max_queue", "timeout", "queue_timeout", "collate_fn",
    "preferred_batch_sizes", "cost", "max_batch_cost", "allow_oversized", "promote_after",
    "to_thread", "close_timeout", "metrics_window", "name",
})  # fmt: skip

_MISSING: Any = inspect.Parameter.empty
_UNBOUND: Any = object()
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class _Call:
    """One call's arguments, bound to the batched function's parameters (name -> value, only
    those passed)."""

    __slots__ = ("arguments",)

    def __init__(self, arguments: dict[str, Any]) -> None:
        self.arguments = arguments

    def __repr__(self) -> str:
        return f"_Call({self.arguments!r})"


class _Signature:
    """How one call of a batched function becomes one item, and a batch of items one call.

    ``single``: the function batches one positional parameter, so a call's item is that
    argument itself (the common case: no binding, no repacking). Otherwise an item is a
    :class:`_Call`, and :meth:`call` turns a batch of them into the function's lists.
    """

    __slots__ = ("first", "options", "params", "signature", "single")

    def __init__(self, fn: Callable[..., Any], *, method: bool) -> None:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature: one argument
            signature = inspect.Signature([inspect.Parameter("items", _POSITIONAL[0])])
        params = list(signature.parameters.values())
        if method:
            params = params[1:]  # self
        self.params = params
        self.signature = signature.replace(parameters=params)
        self.options = _CALL_OPTIONS - {param.name for param in params}
        self.single = len(params) == 1 and params[0].kind in _POSITIONAL
        self.first: inspect.Parameter | None = params[0] if params else None

    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """A call's item and its batcher options (``timeout``, ``priority``,
        ``queue_timeout`` where the function has no parameter of that name).

        Raises:
            TypeError: The arguments do not fit the signature (as calling it would).
        """
        options = {name: kwargs.pop(name) for name in self.options.intersection(kwargs)}
        if self.single and len(args) == 1 and not kwargs:
            return args[0], options
        bound = self.signature.bind(*args, **kwargs)
        if self.single:
            return next(iter(bound.arguments.values())), options
        return _Call(bound.arguments), options

    def first_of(self, item: _Call) -> Any:
        """The call's first argument: what Ray Serve's ``batch_size_fn`` measures."""
        first = self.first
        assert first is not None
        value = item.arguments.get(first.name, first.default)
        if first.kind == inspect.Parameter.VAR_POSITIONAL:
            return value[0] if value else None
        return value

    def call(self, fn: Callable[..., Any], items: list[_Call]) -> Any:
        """``fn`` called once for the batch ``items``, with one list per parameter."""
        kwargs: dict[str, Any] = {}
        by_position: list[tuple[inspect.Parameter, list[Any] | None]] = []
        extra: list[list[Any]] = []  # *args, position by position
        has_varargs = any(
            param.kind == inspect.Parameter.VAR_POSITIONAL
            and any(item.arguments.get(param.name) for item in items)
            for param in self.params
        )
        for param in self.params:
            values = [item.arguments.get(param.name, _MISSING) for item in items]
            if param.kind == inspect.Parameter.VAR_POSITIONAL:
                extra = list(_transpose(param.name, [value or () for value in values]))
                continue
            if param.kind == inspect.Parameter.VAR_KEYWORD:
                kwargs.update(_by_key(param.name, [value or {} for value in values]))
                continue
            column = None
            if any(value is not _MISSING for value in values):
                column = [param.default if value is _MISSING else value for value in values]
            if param.kind == inspect.Parameter.POSITIONAL_ONLY or (
                has_varargs and param.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
            ):
                by_position.append((param, column))
            elif column is not None:
                kwargs[param.name] = column
        if not has_varargs:
            while by_position and by_position[-1][1] is None:
                by_position.pop()  # left out by every call: its default applies
        args = [param.default if column is None else column for param, column in by_position]
        return fn(*args, *extra, **kwargs)


def _transpose(name: str, rows: list[Sequence[Any]]) -> Iterator[list[Any]]:
    """``*name`` of each call, position by position (calls must pass as many)."""
    counts = {len(row) for row in rows}
    if len(counts) > 1:
        raise TypeError(
            f"the calls of one batch passed different numbers of *{name} arguments "
            f"({sorted(counts)}); batched calls must pass the same number"
        )
    return (list(column) for column in zip(*rows, strict=True))


def _by_key(name: str, rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """``**name`` of each call, key by key (calls must pass the same keys)."""
    keys = [sorted(row) for row in rows]
    if any(k != keys[0] for k in keys):
        raise TypeError(
            f"the calls of one batch passed different **{name} keys; batched calls must pass "
            "the same keys"
        )
    return {key: [row[key] for row in rows] for key in keys[0]}


class BatchMethod(Batcher[Any, Any]):
    """What :func:`batch` makes of a function or a method: a :class:`Batcher` that is called
    like the function, with one value per parameter.

    Decorating a plain function gives its one batcher: ``await f(x)``, ``f.metrics()``,
    ``f.set_max_batch_size(n)``. In a class body it is a descriptor: ``instance.method`` is
    that instance's own batcher (another :class:`BatchMethod`, made on first access and kept in
    the instance), and ``Class.method(instance, x)`` calls it too. A call returns the
    awaitable result, or, for an ``async def`` generator, the
    :class:`~aloader.serve._results.BatchStream` of its results (queued at once).
    """

    def __init__(
        self, fn: Callable[..., Any], options: dict[str, Any], *, bound: Any = _UNBOUND
    ) -> None:
        functools.update_wrapper(self, fn)
        self._method_fn = fn
        self._options = options
        self._attr = getattr(fn, "__name__", "batched")
        self._key = f"__aloader_batcher_{self._attr}"  # an instance's batcher, in the instance
        self._owner: type[Any] | None = None
        self._bound = bound
        method = bound is not _UNBOUND
        signature = self._signature = _Signature(fn, method=method)
        target = functools.partial(fn, bound) if method else fn
        batch_fn = target if signature.single else functools.partial(signature.call, target)
        settings = dict(options)
        if not signature.single:
            if settings.get("collate_fn") is not None:
                raise TypeError(
                    f"collate_fn takes the list of one argument, but {self._attr} batches "
                    f"{len(signature.params)} parameters"
                )
            for key in ("cost",):
                if settings.get(key) is not None:
                    settings[key] = _on_first(settings[key], signature)
            if settings.get("batch_size_fn") is not None:
                size_fn = settings["batch_size_fn"]
                settings["batch_size_fn"] = lambda calls: size_fn(
                    [signature.first_of(call) for call in calls]
                )
        if method:
            settings.setdefault("name", f"{type(bound).__name__}.{self._attr}")
        else:
            settings.setdefault("name", self._attr)
        super().__init__(batch_fn, **settings)
        # What the wrapped function is decides how it runs, not the wrapper around it.
        self._streaming = is_async_gen_callable(fn)
        self._in_loop = (
            self._streaming or is_async_callable(fn) or not options.get("to_thread", True)
        )

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self._attr = name
        self._key = f"__aloader_batcher_{name}"
        self._owner = owner

    @overload
    def __get__(self, instance: None, owner: type[Any] | None = None) -> BatchMethod: ...

    @overload
    def __get__(self, instance: object, owner: type[Any] | None = None) -> BatchMethod: ...

    def __get__(self, instance: object | None, owner: type[Any] | None = None) -> Any:
        if instance is None:
            return self
        try:
            namespace = vars(instance)
        except TypeError:
            raise TypeError(
                f"@batch needs instances with a __dict__ to keep one Batcher per instance; "
                f"{type(instance).__name__} has __slots__ without __dict__"
            ) from None
        batcher = namespace.get(self._key)
        if batcher.__class__ is BatchMethod:
            if batcher._bound is instance:
                return batcher
        elif batcher is not None and batcher is not _DETACHED:
            return batcher  # the instance's own replacement (a test's fake)
        # The first access, or a copy of an instance (copy.copy shares the original's
        # attributes; a deep copy or an unpickled one holds _DETACHED): a batcher of its own.
        # It is kept under a key of its own, not the method's name, which would shadow a
        # subclass's override of the method; so this is a data descriptor, consulted at every
        # access, which also checks which instance the batcher serves.
        batcher = BatchMethod(self._method_fn, self._options, bound=instance)
        namespace[self._key] = batcher
        return batcher

    def __set__(self, instance: object, value: Any) -> None:
        """Replace the method on one instance (``model.predict = fake``)."""
        vars(instance)[self._key] = value

    def __delete__(self, instance: object) -> None:
        """Undo a replacement (the next access makes a batcher again)."""
        try:
            del vars(instance)[self._key]
        except KeyError:
            raise AttributeError(self._attr) from None

    def __reduce__(self) -> str | tuple[Any, ...]:
        """A decorated function pickles by reference, as a function does; an instance's
        batcher (its queue, its dispatcher) belongs to this process and loop, so a pickled or
        deep-copied instance gets a batcher of its own when its method is first used."""
        if self._bound is _UNBOUND:
            qualname: str = getattr(self, "__qualname__", self._attr)  # update_wrapper's
            return qualname
        return (_detached, ())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Submit one call: the awaitable result, or the stream of an async generator's."""
        if self._owner is not None and self._bound is _UNBOUND:
            # The descriptor of a method, called on its class: Class.method(instance, ...).
            if args and isinstance(args[0], self._owner):
                return self.__get__(args[0])(*args[1:], **kwargs)
            raise TypeError(
                f"{self._attr} is a batched method: call it on an instance "
                "(use aloader.Batcher(fn) to batch a plain function)"
            )
        if self._signature.single and len(args) == 1 and not kwargs:
            item: Any = args[0]
            options: dict[str, Any] = {}
        else:
            item, options = self._signature.pack(args, kwargs)
        if self._streaming:
            return self.stream(item, **options)
        return Batcher.__call__(self, item, **options)


class _Detached:
    """What a pickled or deep-copied instance holds in place of its batcher."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<batcher of a copied instance, made again on first use>"


_DETACHED = _Detached()


def _detached() -> _Detached:
    return _DETACHED


def _on_first(fn: Callable[[Any], Any], signature: _Signature) -> Callable[[_Call], Any]:
    return lambda call: fn(signature.first_of(call))


@overload
def batch(fn: Callable[..., Any], /) -> BatchMethod: ...


@overload
def batch(
    fn: None = None,
    /,
    *,
    max_batch_size: int = ...,
    batch_wait_timeout_s: float = ...,
    max_wait: float = ...,
    max_concurrent_batches: int = ...,
    batch_size_fn: Callable[[list[Any]], float] | None = ...,
    max_queue: int = ...,
    timeout: float | None = ...,
    queue_timeout: float | None = ...,
    collate_fn: Callable[[list[Any]], Any] | None = ...,
    preferred_batch_sizes: Sequence[int] | None = ...,
    cost: Callable[[Any], float] | None = ...,
    max_batch_cost: float | None = ...,
    allow_oversized: bool = ...,
    promote_after: float | None = ...,
    to_thread: bool = ...,
    close_timeout: float | None = ...,
    metrics_window: int = ...,
    name: str | None = ...,
) -> Callable[[Callable[..., Any]], BatchMethod]: ...


def batch(
    fn: Callable[..., Any] | None = None, /, **options: Any
) -> BatchMethod | Callable[[Callable[..., Any]], BatchMethod]:
    """Batch the calls of an ``async def`` function or method, as Ray Serve's ``@serve.batch``.

    The function takes one list per parameter and returns one result per element (or, as an
    ``async def`` generator, yields one list of results per step: each call then returns the
    stream of its own results). Callers pass single values::

        class Model:
            @aloader.batch(max_batch_size=16, batch_wait_timeout_s=0.002)
            async def predict(self, xs: list[np.ndarray]) -> list[float]:
                return self.net(np.stack(xs)).tolist()

        y = await model.predict(x)  # one item in, one result out
        model.predict.set_max_batch_size(32)  # from the next batch on
        await model.predict.aclose()

    A call may pass the batcher's per-call options ``timeout=``, ``priority=`` and
    ``queue_timeout=``, except those the function has a parameter for.

    Args:
        fn: The function, when used as ``@batch`` without arguments.
        **options: Keyword arguments of :class:`Batcher`: Ray's ``max_batch_size``,
            ``batch_wait_timeout_s`` (or ``max_wait``), ``max_concurrent_batches``,
            ``batch_size_fn``, and ``max_queue``, ``timeout``, ``queue_timeout``,
            ``collate_fn``, ``preferred_batch_sizes``, ``cost``, ``max_batch_cost``,
            ``allow_oversized``, ``promote_after``, ``to_thread``, ``close_timeout``,
            ``metrics_window``, ``name``. A plain ``def`` is refused unless ``to_thread``
            is given (``to_thread=True`` runs it in a worker thread).

    Returns:
        A :class:`BatchMethod`, or a decorator that makes one.

    Raises:
        TypeError: ``fn`` is not callable or not ``async def``; an option is unknown or of
            the wrong type.
        ValueError: If an option is out of range.
    """
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise TypeError(f"batch() got unexpected keyword argument(s): {', '.join(unknown)}")
    # Validate now rather than on the first call of the first instance.
    Batcher(lambda items: items, **options)

    def decorate(function: Callable[..., Any]) -> BatchMethod:
        if not callable(function):
            raise TypeError(
                f"@batch can only be used to decorate functions or methods, got {function!r}"
            )
        if not (
            is_async_callable(function)
            or is_async_gen_callable(function)
            or "to_thread" in options
        ):
            raise TypeError(
                f"Functions decorated with @batch must be 'async def' (or pass to_thread=True "
                f"to run a plain function in a worker thread), got {function!r}"
            )
        return BatchMethod(function, options)

    if fn is None:
        return decorate
    return decorate(fn)
