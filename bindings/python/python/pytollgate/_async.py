"""The asyncio in-process limiter: the same methods as :class:`RateLimiter`, awaited."""

from __future__ import annotations

import asyncio
from typing import Any, Iterable, Mapping, Optional

from tollgate_client import Decision, TollgateError, _core
from tollgate_client._async import AsyncLimiter
from tollgate_client._core import Limits

from . import _common, _native
from ._common import LeaseOptions

__all__ = ["AsyncRateLimiter"]


class AsyncRateLimiter(AsyncLimiter):
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

    async def _send(self, op: str, body: Optional[bytes] = None) -> _core.Reply:
        """The engine's answer to ``op``, as the server's HTTP API gives it."""
        engine = await self._native()
        if op == "config":
            return _common.reply(op, engine.config())
        if engine.immediate and op != "time":
            # The memory store: answered here, without a turn of the event loop.
            return _common.reply(op, engine.run(op, body or b""))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_native.Reply] = loop.create_future()
        if op == "time":
            now = engine.time_async(loop, future)
        else:
            now = engine.run_async(op, body or b"", loop, future)
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
        """Straight to the engine, without JSON, unless the call brings a config."""
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
                return _common.decision(taken, "limit" if writes else "check", name, throws)
        return await super()._take(writes, name, key, count, reserve, throws, config)

    async def aclose(self) -> None:
        """Gives back the leases this process holds (on the runtime's threads)."""
        if self._engine is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._engine.close)

    def __repr__(self) -> str:
        return f"AsyncRateLimiter({self._store!r})"
