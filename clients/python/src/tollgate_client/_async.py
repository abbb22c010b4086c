"""The asyncio client: the same methods as :class:`RateLimiter`, awaited."""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Any, Dict, Mapping, Optional, Sequence, Type

import httpx

from . import _core, _deadline
from ._core import Limits, TransactionCall
from ._types import Adjusted, Decision, TransactionResult, ValueReading

__all__ = ["AsyncRateLimiter"]


class AsyncRateLimiter:
    """The asynchronous client of a tollgate server, over one pool of keep-alive
    connections (an ``httpx.AsyncClient``). Same arguments, methods and errors as
    :class:`~tollgate_client.RateLimiter`; every method is a coroutine.

    Use it from one event loop, in an ``async with`` block or closed with ``aclose()``.

    Calls beyond ``max_connections`` in flight wait their turn in an ``asyncio.Semaphore``
    (within the call's ``timeout``, as they would in httpx's pool): httpcore's pool costs
    time in proportion to the requests queued in it, an asyncio queue does not.
    """

    def __init__(
        self,
        url: str,
        token: Optional[str] = None,
        timeout: Optional[float] = 10.0,
        limits: Optional[Limits] = None,
        *,
        max_connections: int = _core.DEFAULT_MAX_CONNECTIONS,
        max_answer_bytes: int = _core.DEFAULT_MAX_ANSWER_BYTES,
    ) -> None:
        self._core = _core.Core(url, limits)
        self._max_connections = _core.check_max_connections(max_connections)
        self._max_answer_bytes = _core.check_max_answer_bytes(max_answer_bytes)
        self._timeout = timeout
        # Made on first use, inside the event loop (on 3.9 a semaphore binds to a loop).
        self._slots: Optional[asyncio.Semaphore] = None
        self._client = httpx.AsyncClient(
            headers=_core.headers(token),
            timeout=_core.timeout_of(timeout),
            limits=_core.pool_limits(max_connections),
        )
        _deadline.install(self._client)

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._core.base

    @property
    def limits(self) -> Dict[str, Dict[str, Any]]:
        """The configs in code (camelCase keys), a copy."""
        return {name: dict(config) for name, config in self._core.limits.items()}

    async def _send(
        self, method: str, url: httpx.URL, body: Optional[bytes] = None, writes: bool = False
    ) -> _core.Reply:
        """Sends a request and reads its answer whole, by the call's deadline (a wait for a
        slot included). ``writes``: whether the call may take tokens."""
        deadline = _core.deadline_of(self._timeout)
        slots = self._slots
        if slots is None:
            slots = self._slots = asyncio.Semaphore(self._max_connections)
        if not slots.locked():
            await slots.acquire()  # a free slot: no suspension
        elif deadline is None:
            await slots.acquire()
        else:
            try:
                await asyncio.wait_for(slots.acquire(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                no_slot = httpx.PoolTimeout("no free slot")
                raise _core.transport_error(no_slot, url, writes) from None
        try:
            with _deadline.until(deadline):
                request = self._client.build_request(method, url, content=body)
                response = await self._client.send(request, stream=True)
                try:
                    answer = _core.Body(url.path, writes, response, self._max_answer_bytes)
                    async for chunk in response.aiter_raw():
                        answer.add(chunk)
                finally:
                    await response.aclose()
        except (httpx.HTTPError, httpx.StreamError) as e:
            raise _core.transport_error(e, url, writes) from None
        except RuntimeError as e:
            if self._client.is_closed:
                raise _core.transport_error(e, url, writes) from None
            raise
        finally:
            slots.release()
        return answer.reply()

    async def limit(
        self,
        name: str,
        key: Optional[str] = None,
        count: Optional[float] = None,
        reserve: bool = False,
        throws: bool = False,
        config: Optional[Mapping[str, Any]] = None,
    ) -> Decision:
        """Takes ``count`` tokens (default 1) of ``name`` for ``key`` if it can."""
        body = self._core.single(name, key, count, reserve, throws, config)
        return _core.decision(await self._send("POST", self._core.limit_url, body, writes=True))

    async def check(
        self,
        name: str,
        key: Optional[str] = None,
        count: Optional[float] = None,
        reserve: bool = False,
        throws: bool = False,
        config: Optional[Mapping[str, Any]] = None,
    ) -> Decision:
        """What ``limit`` would answer, taking nothing."""
        body = self._core.single(name, key, count, reserve, throws, config)
        return _core.decision(await self._send("POST", self._core.check_url, body))

    async def transaction(
        self, limits: Sequence[TransactionCall], throws: bool = False, fields: bool = False
    ) -> TransactionResult:
        """Takes from every limit or from none."""
        body, count = self._core.transaction(limits, throws)
        reply = await self._send("POST", self._core.transaction_url, body, writes=True)
        return _core.transaction_result(reply, count, fields)

    async def reset(self, name: str, key: Optional[str] = None) -> None:
        """Forgets the state of ``name`` for ``key``."""
        body = self._core.reset(name, key)
        _core.answer(await self._send("POST", self._core.reset_url, body, writes=True))

    async def adjust(
        self,
        name: str,
        key: Optional[str] = None,
        *,
        count: float,
        config: Optional[Mapping[str, Any]] = None,
    ) -> Adjusted:
        """Settles a cost known only after the work: ``count``, signed, is what the work
        used beyond (+) or below (-) what was taken for it. Never refused: a debt leaves a
        negative value that the next requests wait for; a give-back never raises the limit
        above its capacity."""
        body = self._core.adjust(name, key, count, config)
        return _core.adjusted(await self._send("POST", self._core.adjust_url, body, writes=True))

    async def get_value(
        self,
        name: str,
        key: Optional[str] = None,
        sample_shards: Optional[int] = None,
        config: Optional[Mapping[str, Any]] = None,
    ) -> ValueReading:
        """The stored state of ``name`` for ``key``, and its config with every default."""
        body = self._core.value(name, key, sample_shards, config)
        return _core.value_reading(await self._send("POST", self._core.value_url, body))

    async def get_server_time(self) -> float:
        """The server's (its store's) clock, in ms since the Unix epoch."""
        return _core.server_time(await self._send("GET", self._core.time_url))

    async def get_config(self) -> Dict[str, Dict[str, Any]]:
        """The limits the server defines, name -> config with every default filled in."""
        return _core.server_limits(await self._send("GET", self._core.config_url))

    async def aclose(self) -> None:
        """Closes the pool's connections. Calls after this raise TollgateError."""
        await self._client.aclose()

    async def __aenter__(self) -> "AsyncRateLimiter":
        return self

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncRateLimiter({self._core.base!r})"
