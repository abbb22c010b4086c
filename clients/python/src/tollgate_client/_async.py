"""The asyncio client: the same methods as :class:`RateLimiter`, awaited."""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Any, Dict, Mapping, Optional, Sequence, Type, TypeVar

import httpx

from . import _core, _deadline
from ._core import Limits, TransactionCall
from ._types import (
    Acquired,
    Adjusted,
    Decision,
    Renewed,
    SlotsValue,
    TransactionResult,
    ValueReading,
)
from ._units import Milliseconds, Seconds, seconds
from .errors import TollgateError

__all__ = ["AsyncRateLimiter", "AsyncHold", "AsyncHeld"]


_Self = TypeVar("_Self", bound="AsyncLimiter")


class AsyncLimiter:
    """The calls of an asyncio rate limiter, whatever answers them: a tollgate server
    (:class:`AsyncRateLimiter`) or tollgate's engine in this process (``pytollgate``). As
    the blocking ``Limiter`` (``_sync.py``), with its door, ``_send``, a coroutine."""

    _bodies: _core.Bodies

    async def _send(self, op: str, body: Optional[bytes] = None) -> _core.Reply:
        """The answer to operation ``op`` (a key of ``_core.ROUTES``: ``"limit"``,
        ``"check"``, ...) with ``body``, as the HTTP API gives it."""
        raise NotImplementedError

    async def _take(
        self,
        writes: bool,
        name: str,
        key: Optional[str],
        count: Optional[float],
        reserve: bool,
        throws: bool,
        config: Optional[Mapping[str, Any]],
    ) -> Decision:
        """``limit`` (``writes``) or ``check``: the calls made most, which a door may answer
        by a path of its own."""
        body = self._bodies.single(name, key, count, reserve, throws, config)
        return _core.decision(await self._send("limit" if writes else "check", body))

    async def limit(
        self,
        name: str,
        key: Optional[str] = None,
        count: Optional[float] = None,
        reserve: bool = False,
        throws: bool = False,
        config: Optional[Mapping[str, Any]] = None,
    ) -> Decision:
        """Takes ``count`` tokens (default 1) of ``name`` for ``key`` if it can; a refusal
        takes nothing. ``reserve``: book a shortfall ahead instead (granted, with the wait
        in ``retry_after``)."""
        return await self._take(True, name, key, count, reserve, throws, config)

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
        return await self._take(False, name, key, count, reserve, throws, config)

    async def transaction(
        self, limits: Sequence[TransactionCall], throws: bool = False, fields: bool = False
    ) -> TransactionResult:
        """Takes from every limit or from none: each a :class:`LimitCall` or a dict of
        ``name``, ``key``, ``count``, ``reserve``, ``config``. ``throws``: a refusal raises
        :class:`RateLimitError` (naming the limit with the longest wait). ``fields``: also
        give the answer's ``RateLimit`` header fields (``TransactionResult.fields``)."""
        body, count = self._bodies.transaction(limits, throws)
        return _core.transaction_result(await self._send("transaction", body), count, fields)

    async def reset(self, name: str, key: Optional[str] = None) -> None:
        """Forgets the state of ``name`` for ``key``: it is full again."""
        _core.answer(await self._send("reset", self._bodies.reset(name, key)))

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
        body = self._bodies.adjust(name, key, count, config)
        return _core.adjusted(await self._send("adjust", body))

    async def get_value(
        self,
        name: str,
        key: Optional[str] = None,
        sample_shards: Optional[int] = None,
        config: Optional[Mapping[str, Any]] = None,
    ) -> ValueReading:
        """The stored state of ``name`` for ``key``, and its config with every default."""
        body = self._bodies.value(name, key, sample_shards, config)
        return _core.value_reading(await self._send("value", body))

    async def acquire(
        self,
        name: str,
        key: Optional[str] = None,
        count: Optional[int] = None,
        ttl: Optional[Milliseconds] = None,
        throws: bool = False,
    ) -> Acquired:
        """Takes ``count`` slots (default 1) of the concurrency limit ``name`` for ``key``
        (SPEC §6f): a ``ticket`` and its ``expires_at``, or ``retry_after`` when refused
        (see the blocking ``RateLimiter.acquire``)."""
        body = self._bodies.acquire(name, key, count, ttl, throws)
        return _core.acquired(await self._send("acquire", body))

    def hold(
        self,
        name: str,
        key: Optional[str] = None,
        count: Optional[int] = None,
        ttl: Optional[Milliseconds] = None,
    ) -> "AsyncHold":
        """Slots of ``name`` held for an ``async with`` block, released when it ends,
        however it ends (an exception, a cancellation)::

            async with limiter.hold("exports", key=tenant) as slot:
                await run_export()

        Acquired as the block is entered; a refusal raises :class:`RateLimitError` there,
        and the block does not run."""
        return AsyncHold(self, name, key, self._bodies.acquire(name, key, count, ttl, False))

    async def release(self, name: str, key: Optional[str] = None, *, ticket: str) -> bool:
        """Frees the slots of ``ticket`` (acquired with ``key``): ``True``, or ``False`` for
        a ticket unknown, released already or expired."""
        body = self._bodies.ticket(name, key, ticket)
        return _core.released(await self._send("release", body))

    async def renew(
        self,
        name: str,
        key: Optional[str] = None,
        *,
        ticket: str,
        ttl: Optional[Milliseconds] = None,
    ) -> Renewed:
        """Holds the slots of ``ticket`` for ``ttl`` more from now (default the limit's):
        ``ok`` with the new ``expires_at``, or not ``ok`` when the ticket had expired."""
        body = self._bodies.ticket(name, key, ticket, ttl)
        return _core.renewed(await self._send("renew", body))

    async def get_slots_value(self, name: str, key: Optional[str] = None) -> SlotsValue:
        """A concurrency limit's slots for ``key``: those in flight, its ``max``, and the
        tickets holding them."""
        body = self._bodies.value(name, key, None, None)
        return _core.slots_value(await self._send("value", body))

    async def get_server_time(self) -> float:
        """The store's clock (a server's store), in ms since the Unix epoch."""
        return _core.server_time(await self._send("time"))

    async def get_config(self) -> Dict[str, Dict[str, Any]]:
        """The limits defined (by the server, or in this process), name -> config with
        every default filled in."""
        return _core.server_limits(await self._send("config"))

    async def aclose(self) -> None:
        """Ends the limiter's use (what that frees is the door's)."""
        raise NotImplementedError

    async def __aenter__(self: _Self) -> _Self:
        return self

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        await self.aclose()


class AsyncRateLimiter(AsyncLimiter):
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
        timeout: Optional[Seconds] = 10.0,
        limits: Optional[Limits] = None,
        *,
        max_connections: int = _core.DEFAULT_MAX_CONNECTIONS,
        max_answer_bytes: int = _core.DEFAULT_MAX_ANSWER_BYTES,
    ) -> None:
        self._core = self._bodies = _core.Core(url, limits)
        self._max_connections = _core.check_max_connections(max_connections)
        self._max_answer_bytes = _core.check_max_answer_bytes(max_answer_bytes)
        self._timeout = None if timeout is None else seconds(timeout, "timeout")
        # Made on first use, inside the event loop (on 3.9 a semaphore binds to a loop).
        self._slots: Optional[asyncio.Semaphore] = None
        self._client = httpx.AsyncClient(
            headers=_core.headers(token),
            timeout=_core.timeout_of(self._timeout),
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

    async def _send(self, op: str, body: Optional[bytes] = None) -> _core.Reply:
        """Sends ``op``'s request and reads its answer whole, by the call's deadline (a wait
        for a slot included)."""
        method, url, writes = self._core.routes[op]
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

    async def aclose(self) -> None:
        """Closes the pool's connections. Calls after this raise TollgateError."""
        await self._client.aclose()

    def __repr__(self) -> str:
        return f"AsyncRateLimiter({self._core.base!r})"


class AsyncHeld(_core.Slot):
    """Slots of a concurrency limit held in an ``async with limiter.hold(...) as slot:``
    block: as the blocking ``Held``, its ``renew`` and ``release`` awaited."""

    __slots__ = ("_limiter",)

    def __init__(
        self,
        limiter: AsyncLimiter,
        name: str,
        key: Optional[str],
        ticket: str,
        expires_at: float,
    ) -> None:
        super().__init__(name, key, ticket, expires_at)
        self._limiter = limiter

    async def renew(self, ttl: Optional[Milliseconds] = None) -> bool:
        """Holds the slots for ``ttl`` more from now (default the limit's): ``True``, or
        ``False`` when the ticket had expired or was released."""
        if self._released:
            return False
        renewed = await self._limiter.renew(self.name, self.key, ticket=self.ticket, ttl=ttl)
        return self._renewed(renewed)

    async def release(self) -> bool:
        """Lets the slots go now: ``True``, or ``False`` when they had expired already or
        were released by an earlier call (which then sends nothing). Raises
        :class:`TollgateError` when the store cannot say."""
        if self._released:
            return False
        freed = await self._limiter.release(self.name, self.key, ticket=self.ticket)
        self._released = True
        return freed


class AsyncHold:
    """What :meth:`AsyncLimiter.hold` answers: an async context manager that acquires as
    its block is entered (raising :class:`RateLimitError` when refused) and releases when
    the block ends, however it ends (a cancellation included). A release that fails then is
    not raised (see the blocking ``Hold``)."""

    __slots__ = ("_limiter", "_name", "_key", "_body", "_held")

    def __init__(self, limiter: AsyncLimiter, name: str, key: Optional[str], body: bytes) -> None:
        self._limiter, self._name, self._key, self._body = limiter, name, key, body
        self._held: Optional[AsyncHeld] = None

    async def __aenter__(self) -> AsyncHeld:
        if self._held is not None:
            raise RuntimeError("this hold's block is running already; call hold() for another")
        reply = await self._limiter._send("acquire", self._body)
        ticket, expires_at = _core.held(self._name, reply)
        self._held = AsyncHeld(self._limiter, self._name, self._key, ticket, expires_at)
        return self._held

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        held, self._held = self._held, None
        if held is not None:
            try:
                await held.release()
            except TollgateError:
                pass  # the slots are free at their expiry
