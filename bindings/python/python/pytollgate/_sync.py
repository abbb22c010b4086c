"""The blocking in-process limiter."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Type

from tollgate_client import Adjusted, Decision, TollgateError, TransactionResult, ValueReading, _core
from tollgate_client._core import Limits, TransactionCall

from . import _common, _native
from ._common import LeaseOptions

__all__ = ["RateLimiter"]


class RateLimiter:
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

    def _run(self, op: str, body: bytes) -> _core.Reply:
        return _common.reply(op, self._native().run(op, body))

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
        op = "limit" if writes else "check"
        if config is None:
            try:
                taken = self._native().take(name, key, count, reserve, writes)
            except TypeError:
                pass  # an argument of another type: the JSON path says what is wrong
            else:
                return _common.decision(taken, op, name, throws)
        body = self._bodies.single(name, key, count, reserve, throws, config)
        return _core.decision(self._run(op, body))

    def limit(
        self,
        name: str,
        key: Optional[str] = None,
        count: Optional[float] = None,
        reserve: bool = False,
        throws: bool = False,
        config: Optional[Mapping[str, Any]] = None,
    ) -> Decision:
        """Takes ``count`` tokens (default 1) of ``name`` for ``key`` if it can; a refusal
        takes nothing. ``reserve``: book a shortfall ahead instead."""
        return self._take(True, name, key, count, reserve, throws, config)

    def check(
        self,
        name: str,
        key: Optional[str] = None,
        count: Optional[float] = None,
        reserve: bool = False,
        throws: bool = False,
        config: Optional[Mapping[str, Any]] = None,
    ) -> Decision:
        """What ``limit`` would answer, taking nothing."""
        return self._take(False, name, key, count, reserve, throws, config)

    def transaction(
        self, limits: Sequence[TransactionCall], throws: bool = False, fields: bool = False
    ) -> TransactionResult:
        """Takes from every limit or from none. ``fields``: also give the answer's
        ``RateLimit`` header fields (``TransactionResult.fields``)."""
        body, count = self._bodies.transaction(limits, throws)
        return _core.transaction_result(self._run("transaction", body), count, fields)

    def reset(self, name: str, key: Optional[str] = None) -> None:
        """Forgets the state of ``name`` for ``key``: it is full again."""
        _core.answer(self._run("reset", self._bodies.reset(name, key)))

    def adjust(
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
        return _core.adjusted(self._run("adjust", body))

    def get_value(
        self,
        name: str,
        key: Optional[str] = None,
        sample_shards: Optional[int] = None,
        config: Optional[Mapping[str, Any]] = None,
    ) -> ValueReading:
        """The stored state of ``name`` for ``key``, and its config with every default."""
        body = self._bodies.value(name, key, sample_shards, config)
        return _core.value_reading(self._run("value", body))

    def get_server_time(self) -> float:
        """The store's clock, in ms since the Unix epoch."""
        return _core.server_time(_common.reply("time", self._native().time()))

    def get_config(self) -> Dict[str, Dict[str, Any]]:
        """The limits defined, name -> config with every default filled in."""
        return _core.server_limits(_common.reply("config", self._native().config()))

    def close(self) -> None:
        """Gives back the leases this process holds (their unused tokens return to the store
        for the other processes)."""
        if self._engine is not None:
            self._engine.close()

    def __enter__(self) -> "RateLimiter":
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RateLimiter({self._store!r})"
