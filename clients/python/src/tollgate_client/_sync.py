"""The blocking client, and the calls it shares with the in-process limiter."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Dict, Mapping, Optional, Sequence, Type, TypeVar

import httpx

from . import _core, _deadline
from ._core import Limits, TransactionCall
from ._types import Adjusted, Decision, TransactionResult, ValueReading
from ._units import Seconds, seconds

__all__ = ["RateLimiter"]


_Self = TypeVar("_Self", bound="Limiter")


class Limiter:
    """The calls of a rate limiter, whatever answers them: a tollgate server
    (:class:`RateLimiter`) or tollgate's engine in this process (``pytollgate``). Each call
    builds its request body with ``_bodies`` and hands it to the door, ``_send``, which gives
    back the answer as the server's HTTP API would; the answer is read here. So both doors
    have the same methods, answers and errors."""

    _bodies: _core.Bodies

    def _send(self, op: str, body: Optional[bytes] = None) -> _core.Reply:
        """The answer to operation ``op`` (a key of ``_core.ROUTES``: ``"limit"``,
        ``"check"``, ...) with ``body``, as the HTTP API gives it."""
        raise NotImplementedError

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
        """``limit`` (``writes``) or ``check``: the calls made most, which a door may answer
        by a path of its own."""
        body = self._bodies.single(name, key, count, reserve, throws, config)
        return _core.decision(self._send("limit" if writes else "check", body))

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
        takes nothing. ``reserve``: book a shortfall ahead instead (granted, with the wait
        in ``retry_after``)."""
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
        """Takes from every limit or from none: each a :class:`LimitCall` or a dict of
        ``name``, ``key``, ``count``, ``reserve``, ``config``. ``throws``: a refusal raises
        :class:`RateLimitError` (naming the limit with the longest wait). ``fields``: also
        give the answer's ``RateLimit`` header fields (``TransactionResult.fields``)."""
        body, count = self._bodies.transaction(limits, throws)
        return _core.transaction_result(self._send("transaction", body), count, fields)

    def reset(self, name: str, key: Optional[str] = None) -> None:
        """Forgets the state of ``name`` for ``key``: it is full again."""
        _core.answer(self._send("reset", self._bodies.reset(name, key)))

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
        return _core.adjusted(self._send("adjust", body))

    def get_value(
        self,
        name: str,
        key: Optional[str] = None,
        sample_shards: Optional[int] = None,
        config: Optional[Mapping[str, Any]] = None,
    ) -> ValueReading:
        """The stored state of ``name`` for ``key``, and its config with every default."""
        body = self._bodies.value(name, key, sample_shards, config)
        return _core.value_reading(self._send("value", body))

    def get_server_time(self) -> float:
        """The store's clock (a server's store), in ms since the Unix epoch."""
        return _core.server_time(self._send("time"))

    def get_config(self) -> Dict[str, Dict[str, Any]]:
        """The limits defined (by the server, or in this process), name -> config with
        every default filled in."""
        return _core.server_limits(self._send("config"))

    def close(self) -> None:
        """Ends the limiter's use (what that frees is the door's)."""
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.close()


class RateLimiter(Limiter):
    """A client of a tollgate server, over one pool of keep-alive connections.

    ``url`` is the server (``http://127.0.0.1:8787``); ``token`` its bearer token, if it asks
    for one; ``timeout`` the most a call may take, from waiting for a connection to the
    answer's last byte: seconds, or a string with its unit (``"500ms"``); ``None``: no limit.
    ``limits``: configs in code, name -> config (a ``period`` in milliseconds, or a string
    with its unit such as ``"1m"``), sent inline with every call for that name (names the
    server defines need none).
    ``max_connections`` bounds the pool (default 10: enough for a server a millisecond away;
    raise it for a distant one). ``max_answer_bytes`` bounds an answer's body (default
    8 MiB): a larger one raises :class:`~tollgate_client.TollgateError` unread.

    Safe to share between threads. Close it (``close()``, or use it in a ``with`` block)
    to close its connections.

    Every method raises :class:`~tollgate_client.TollgateError` when there is no decision
    (an error answer, a timeout, no connection), and ``limit``/``check``/``transaction``
    with ``throws=True`` raise :class:`~tollgate_client.RateLimitError` when refused.
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
        _core.check_max_connections(max_connections)
        self._max_answer_bytes = _core.check_max_answer_bytes(max_answer_bytes)
        self._timeout = None if timeout is None else seconds(timeout, "timeout")
        self._client = httpx.Client(
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

    def _send(self, op: str, body: Optional[bytes] = None) -> _core.Reply:
        """Sends ``op``'s request and reads its answer whole, by the call's deadline."""
        method, url, writes = self._core.routes[op]
        with _deadline.until(_core.deadline_of(self._timeout)):
            try:
                request = self._client.build_request(method, url, content=body)
                response = self._client.send(request, stream=True)
                try:
                    answer = _core.Body(url.path, writes, response, self._max_answer_bytes)
                    for chunk in response.iter_raw():
                        answer.add(chunk)
                finally:
                    response.close()
            except (httpx.HTTPError, httpx.StreamError) as e:
                raise _core.transport_error(e, url, writes) from None
            except RuntimeError as e:
                if self._client.is_closed:
                    raise _core.transport_error(e, url, writes) from None
                raise
        return answer.reply()

    def close(self) -> None:
        """Closes the pool's connections. Calls after this raise TollgateError."""
        self._client.close()

    def __repr__(self) -> str:
        return f"RateLimiter({self._core.base!r})"
