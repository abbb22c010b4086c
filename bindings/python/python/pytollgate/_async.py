"""The asyncio in-process limiter: the same methods as :class:`RateLimiter`, awaited."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import Any, Generic, Iterable, Mapping, Optional, Tuple

from tollgate_client import Decision, Seconds, TollgateError, _core
from tollgate_client._async import AsyncLimiter

from . import _aio, _common, _native
from ._common import LeaseOptions, Limits, Name
from ._native import Engine
from ._opening import Opening

__all__ = ["AsyncRateLimiter"]

#: An open's outcome: (True, the engine) or (False, the error).
Opened = Tuple[bool, Any]


class AsyncRateLimiter(Opening, AsyncLimiter, Generic[Name]):
    """:class:`~pytollgate.RateLimiter` for asyncio, with the same arguments. The store is
    opened on the first call, on the module's runtime and for whichever event loops wait
    for it: the limiter is tied to no loop, and serves several at once (one per thread) or
    one after another. A call that waits for the store does not hold the event loop nor a
    thread of its own: its work runs on the module's runtime, and its answer comes back
    through the loop. On the memory store each call is answered where it is made (a refusal
    or an error answered at once still lets the loop run other tasks before it returns).
    ``aclose()`` (or ``async with``) gives back the leases this process holds; calls after
    it raise ``TollgateError``."""

    def __init__(
        self,
        store: str,
        limits: Optional[Limits[Name]] = None,
        *,
        store_deadline: Optional[Seconds] = None,
        max_keys: Optional[int] = None,
        leases: Optional[Mapping[str, LeaseOptions]] = None,
        fail_open: Optional[Iterable[str]] = None,
    ) -> None:
        config = _common.validated(
            _common.config_json(store, limits, store_deadline, max_keys, leases, fail_open)
        )
        self._store = store
        self._bodies = _core.Bodies(None)
        self._start(config)
        #: The open under way, which every loop that needs the engine waits for.
        self._pending: Optional[concurrent.futures.Future[Opened]] = None

    async def _native(self) -> Engine:
        engine = self._engine
        if engine is None:
            engine = await self._open()
        return engine

    async def _open(self) -> Engine:
        with self._lock:
            engine = self._engine
            if engine is not None:
                return engine
            pending = self._pending
            if pending is None:
                self._may_open()
                pending = self._pending = concurrent.futures.Future()
                _native.open_async(self._config, functools.partial(self._opened, pending))
        ok, value = await _aio.outcome(pending)
        if not ok:
            raise TollgateError(f"the store could not be opened: {value}", 503, False)
        assert isinstance(value, Engine)
        return value

    def _opened(self, pending: concurrent.futures.Future[Opened], ok: bool, value: Any) -> None:
        """The open's outcome, on a runtime thread: kept, then told to whoever waits."""
        with self._lock:
            if self._pending is pending:
                self._pending = None
                if not ok:
                    self._failed(value)
                elif not self._closed:
                    self._engine = value
        pending.set_result((ok, value))

    def _forked(self) -> None:
        super()._forked()
        self._pending = None  # its runtime thread is not in this process

    async def _send(self, op: str, body: Optional[bytes] = None) -> _core.Reply:
        """The engine's answer to ``op``, as the server's HTTP API gives it."""
        engine = await self._native()
        if op == "config":
            return _common.reply(op, engine.config())
        if engine.immediate and op != "time":
            # The memory store: answered here, then a turn of the event loop (see _at_once).
            answer = engine.run(op, body or b"")
            await _at_once()
            return _common.reply(op, answer)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_native.Reply] = loop.create_future()
        if op == "time":
            now = engine.time_async(loop, future)
        else:
            now = engine.run_async(op, body or b"", loop, future)
        if now is None:
            return _common.reply(op, await future)
        await _at_once()
        return _common.reply(op, now)

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
            future: Optional[asyncio.Future[_native.Taken]] = None
            try:
                taken: Optional[_native.Taken]
                if engine.immediate:
                    taken = engine.take(name, key, count, reserve, writes)
                else:
                    loop = asyncio.get_running_loop()
                    future = loop.create_future()
                    taken = engine.take_async(name, key, count, reserve, writes, loop, future)
            except (TypeError, UnicodeEncodeError, OverflowError):
                pass  # an argument of another type or range: the JSON path says what is wrong
            else:
                if taken is None:
                    assert future is not None
                    taken = await future
                elif not isinstance(taken, float) or taken < -1.0:
                    # A refusal or an error answered at once: see _at_once. A grant is not
                    # held back (a loop of grants ends when the limit is spent).
                    await _at_once()
                try:
                    return _common.decision(taken, "limit" if writes else "check", name, throws)
                except TollgateError:
                    # The direct take knows rate limits only: a concurrency limit's check (and the
                    # error of a limit of one) is the JSON path's.
                    if name not in self._concurrency:
                        raise
        return await super()._take(writes, name, key, count, reserve, throws, config)

    async def aclose(self) -> None:
        """Gives back the leases this process holds (on the runtime's threads), and ends the
        limiter: calls after this raise TollgateError."""
        with self._lock:
            self._closed = True
            engine, self._engine = self._engine, None
        if engine is not None:
            await asyncio.get_running_loop().run_in_executor(None, engine.close)

    def __repr__(self) -> str:
        return f"AsyncRateLimiter({self._store!r})"


async def _at_once() -> None:
    """After an answer that needed no wait (the memory store, a breaker open on a store that
    is down): one turn of the event loop, so that a loop of such calls (retrying a refusal
    or an error at once) lets the loop's other tasks run. It costs a turn (about 2.5 µs
    here), which a grant on the direct path is spared."""
    await asyncio.sleep(0)
