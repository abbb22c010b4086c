"""The blocking in-process limiter."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from tollgate_client import Decision, TollgateError, _core
from tollgate_client._core import Limits
from tollgate_client._sync import Limiter

from . import _common, _native
from ._common import LeaseOptions

__all__ = ["RateLimiter"]


class RateLimiter(Limiter):
    """A rate limiter in this process, on ``store``: ``memory``, ``sqlite://PATH``,
    ``redis://HOST:PORT/DB`` (``redis+cluster://…``, ``redis+sentinel://…/MASTER``,
    ``rediss…`` over TLS) or ``postgres://USER@HOST/DB``. ``limits``: name -> config (SPEC §1,
    snake_case or camelCase keys), defined for every call.

    ``store_deadline``: the most seconds a call waits for Redis or PostgreSQL (or SQLite's
    write lock), default 0.25; ``max_keys``: the memory store's most live states; ``leases``:
    limits served from leases (Redis, PostgreSQL), name -> ``True`` or
    ``{"term": seconds, "share": ..., "floor": ...}``; ``fail_open``: names granted while the
    store fails.

    The methods are those of ``tollgate_client.RateLimiter``, with its answers and errors.
    A call that waits for the store releases the GIL; safe to share between threads.
    ``close()`` (or a ``with`` block) gives back the leases this process holds.
    """

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
        config = _common.validated(
            _common.config_json(store, limits, store_deadline, max_keys, leases, fail_open)
        )
        self._store = store
        # The limits are defined in the engine: calls carry no config of their own.
        self._bodies = _core.Bodies(None)
        self._failed: Optional[str] = None
        self._engine: Optional[_native.Engine] = None
        try:
            self._engine = _native.open(config)
        except RuntimeError as e:
            # A store that cannot be reached: each call says so, as the server would.
            self._failed = str(e)

    def _native(self) -> _native.Engine:
        if self._engine is None:
            raise TollgateError(f"the store could not be opened: {self._failed}", 503, False)
        return self._engine

    def _send(self, op: str, body: Optional[bytes] = None) -> _core.Reply:
        """The engine's answer to ``op``, as the server's HTTP API gives it."""
        engine = self._native()
        if op == "time":
            answer = engine.time()
        elif op == "config":
            answer = engine.config()
        else:
            answer = engine.run(op, body or b"")
        return _common.reply(op, answer)

    def _take(
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
            try:
                taken = self._native().take(name, key, count, reserve, writes)
            except TypeError:
                pass  # an argument of another type: the JSON path says what is wrong
            else:
                return _common.decision(taken, "limit" if writes else "check", name, throws)
        return super()._take(writes, name, key, count, reserve, throws, config)

    def close(self) -> None:
        """Gives back the leases this process holds (their unused tokens return to the store
        for the other processes)."""
        if self._engine is not None:
            self._engine.close()

    def __repr__(self) -> str:
        return f"RateLimiter({self._store!r})"
