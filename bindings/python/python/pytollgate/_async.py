"""The asyncio in-process limiter: the same methods as :class:`RateLimiter`, awaited."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Type

from tollgate_client import Adjusted, Decision, TollgateError, TransactionResult, ValueReading, _core
from tollgate_client._core import Limits, TransactionCall

from . import _common, _native
from ._common import LeaseOptions

__all__ = ["AsyncRateLimiter"]


class AsyncRateLimiter:
    """:class:`~pytollgate.RateLimiter` for asyncio, with the same arguments. The store is
    opened on the first call. A call that waits for the store does not hold the event loop
    nor a thread of its own: its work runs on the module's runtime, and its answer comes back
    through the loop. On the memory store each call is answered where it is made.
    ``aclose()`` (or ``async with``) gives back the leases this process holds."""

    def __init__(
        self,
        store: str,
        limits: Optional[Limits] = None,
        *,
        store_deadline: Optional[float] = None,
        max_keys: Optional[int] = None,
        leases: Optional[Mapping[str, LeaseOptions]] = None,
        fail_open: Optional[Iterable[str]] = None,
    ) -> None:
        self._config = _common.validated(
            _common.config_json(store, limits, store_deadline, max_keys, leases, fail_open)
        )
        self._store = store
        self._bodies = _core.Bodies(None)
        self._engine: Optional[_native.Engine] = None
        self._opening: Optional[asyncio.Future[_native.Engine]] = None

    async def _native(self) -> _native.Engine:
        if self._engine is not None:
            return self._engine
        if self._opening is None:
            loop = asyncio.get_running_loop()
            self._opening = loop.create_future()
            _native.open_async(self._config, loop, self._opening)
        try:
            self._engine = await asyncio.shield(self._opening)
        except RuntimeError as e:
            raise TollgateError(f"the store could not be opened: {e}", 503, False) from None
        return self._engine

    async def _run(self, op: str, body: bytes) -> _core.Reply:
        engine = await self._native()
        if engine.immediate:
            return _common.reply(op, engine.run(op, body))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_native.Reply] = loop.create_future()
        now = engine.run_async(op, body, loop, future)
        return _common.reply(op, now if now is not None else await future)

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
        op = "limit" if writes else "check"
        if config is None:
            engine = await self._native()
            try:
                if engine.immediate:
                    taken = engine.take(name, key, count, reserve, writes)
                else:
                    loop = asyncio.get_running_loop()
                    future: asyncio.Future[_native.Taken] = loop.create_future()
                    now = engine.take_async(name, key, count, reserve, writes, loop, future)
                    taken = now if now is not None else await future
            except TypeError:
                pass  # an argument of another type: the JSON path says what is wrong
            else:
                return _common.decision(taken, op, name, throws)
        body = self._bodies.single(name, key, count, reserve, throws, config)
        return _core.decision(await self._run(op, body))

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
        """Takes from every limit or from none. ``fields``: also give the answer's
        ``RateLimit`` header fields (``TransactionResult.fields``)."""
        body, count = self._bodies.transaction(limits, throws)
        return _core.transaction_result(await self._run("transaction", body), count, fields)

    async def reset(self, name: str, key: Optional[str] = None) -> None:
        """Forgets the state of ``name`` for ``key``."""
        _core.answer(await self._run("reset", self._bodies.reset(name, key)))

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
        return _core.adjusted(await self._run("adjust", body))

    async def get_value(
        self,
        name: str,
        key: Optional[str] = None,
        sample_shards: Optional[int] = None,
        config: Optional[Mapping[str, Any]] = None,
    ) -> ValueReading:
        """The stored state of ``name`` for ``key``, and its config with every default."""
        body = self._bodies.value(name, key, sample_shards, config)
        return _core.value_reading(await self._run("value", body))

    async def get_server_time(self) -> float:
        """The store's clock, in ms since the Unix epoch."""
        engine = await self._native()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_native.Reply] = loop.create_future()
        now = engine.time_async(loop, future)
        return _core.server_time(_common.reply("time", now if now is not None else await future))

    async def get_config(self) -> Dict[str, Dict[str, Any]]:
        """The limits defined, name -> config with every default filled in."""
        engine = await self._native()
        return _core.server_limits(_common.reply("config", engine.config()))

    async def aclose(self) -> None:
        """Gives back the leases this process holds (on the runtime's threads)."""
        if self._engine is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._engine.close)

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
        return f"AsyncRateLimiter({self._store!r})"
