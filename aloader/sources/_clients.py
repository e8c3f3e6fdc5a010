"""An epoch's HTTP clients (:class:`_Clients`): made when a shard first needs one, shared by
the shards read at once, and closed with the read (:func:`_then_closed`), cancelled or not, so
that no connection outlives the epoch."""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable
from typing import Protocol, TypeVar

import anyio

from .._util import Closing
from ..io._http import HttpClient, HttpOptions, env_configures_http, make_client, shares_one_pool

T = TypeVar("T")


class _Clients:
    """An epoch's HTTP clients for ``count`` shards read at once, each made when a shard first
    needs it (an epoch read from the cache makes none): one client of ``count`` connections
    shared by all where its pool allows (:func:`~aloader.io._http.shares_one_pool`), else
    ``count`` single-connection clients shared round-robin by the shards."""

    def __init__(self, options: HttpOptions, count: int) -> None:
        self._options = options
        self._connections = count if shares_one_pool(options) else 1
        self._made: list[HttpClient | None] = [None] * (count // self._connections)
        self._env: bool | None = None  # env_configures_http(), asked once per epoch

    def slot(self, number: int) -> Callable[[], HttpClient]:
        """What gives the client of the ``number``-th shard read."""
        return functools.partial(self._get, number % len(self._made))

    def _get(self, index: int) -> HttpClient:
        client = self._made[index]
        if client is None:
            if self._env is None:
                self._env = env_configures_http()
            client = self._made[index] = make_client(self._options, self._connections,
                                                     self._env)
        return client

    async def aclose(self) -> None:
        for client in self._made:
            if client is not None:
                await client.aclose()


class _Closable(Protocol):
    async def aclose(self) -> None: ...


async def _then_closed(items: AsyncGenerator[T, None], client: _Closable | None
                       ) -> AsyncGenerator[T, None]:
    """``items``, then ``client`` closed (None: nothing to close) however they end: also when
    cancelled, shielded, so that its connections never outlive the read."""
    try:
        async with Closing(items) as each:
            async for item in each:
                yield item
    finally:
        if client is not None:
            with anyio.CancelScope(shield=True):
                await client.aclose()
