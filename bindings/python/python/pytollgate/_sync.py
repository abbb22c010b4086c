"""The blocking in-process limiter."""

from __future__ import annotations

from typing import Any, Generic, Iterable, Mapping, Optional

from tollgate_client import Decision, Seconds, TollgateError, _core
from tollgate_client._sync import Limiter

from . import _common, _native
from ._common import LeaseOptions, Limits, Name
from ._native import Engine
from ._opening import Opening

__all__ = ["RateLimiter"]


class RateLimiter(Opening, Limiter, Generic[Name]):
    """A rate limiter in this process, on ``store``: ``memory``, ``sqlite://PATH``,
    ``redis://HOST:PORT/DB`` (``redis+cluster://…``, ``redis+sentinel://…/MASTER``,
    ``rediss…`` over TLS) or ``postgres://USER@HOST/DB``. ``limits``: name -> config (SPEC §1,
    snake_case or camelCase keys; ``period`` in milliseconds, or a string with its unit such
    as ``"1m"``), or a rate string as slowapi and django-ratelimit write them (``"5/minute"``,
    ``"5/m"``: a fixed window, see ``pytollgate.parse_rate``), defined for every call; or a
    concurrency limit, ``{"kind": "concurrency", "max": 4, "ttl": "2m"}`` (SPEC §6f), whose
    slots ``acquire`` and ``hold`` take.

    ``store_deadline``: the most a call waits for Redis or PostgreSQL (or SQLite's write
    lock), in seconds or a string with its unit (``"250ms"``), default 0.25; ``max_keys``:
    the memory store's most live states; ``leases``: limits served from leases (Redis,
    PostgreSQL), name -> ``True`` or ``{"term": seconds, "share": ..., "floor": ...}``;
    ``fail_open``: names granted while the store fails.

    The store is opened here; one that cannot be opened yet fails each call (503) and is
    opened again at most every quarter of a second, until it can be. After ``fork`` a child
    opens its own. The methods are those of ``tollgate_client.RateLimiter``, with its answers
    and errors. A call that waits for the store releases the GIL; safe to share between
    threads. ``close()`` (or a ``with`` block) gives back the leases this process holds;
    calls after it raise ``TollgateError``.
    """

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
        # The limits are defined in the engine: calls carry no config of their own.
        self._bodies = _core.Bodies(None)
        self._start(config)
        try:
            self._engine = _native.open(config)
        except RuntimeError as e:
            # A store that cannot be reached: each call says so, as the server would.
            self._failed(e)

    def _native(self) -> Engine:
        engine = self._engine
        if engine is None:
            engine = self._open()
        return engine

    def _open(self) -> Engine:
        """The engine, opened again if it may be (one thread at a time: the others wait for
        its outcome, and fail at once if it failed)."""
        with self._lock:
            engine = self._engine
            if engine is not None:
                return engine  # opened by the thread before
            self._may_open()
            try:
                engine = _native.open(self._config)
            except RuntimeError as e:
                raise self._failed(e) from None
            self._engine = engine
            return engine

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
            except (TypeError, UnicodeEncodeError, OverflowError):
                pass  # an argument of another type or range: the JSON path says what is wrong
            else:
                try:
                    return _common.decision(taken, "limit" if writes else "check", name, throws)
                except TollgateError:
                    # The direct take knows rate limits only: a concurrency limit's check (and the
                    # error of a limit of one) is the JSON path's.
                    if name not in self._concurrency:
                        raise
        return super()._take(writes, name, key, count, reserve, throws, config)

    def close(self) -> None:
        """Gives back the leases this process holds (their unused tokens return to the store
        for the other processes), and ends the limiter: calls after this raise
        TollgateError."""
        with self._lock:
            self._closed = True
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def __repr__(self) -> str:
        return f"RateLimiter({self._store!r})"
