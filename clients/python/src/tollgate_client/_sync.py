"""The blocking client."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Dict, Mapping, Optional, Sequence, Type

import httpx

from . import _core, _deadline
from ._core import Limits, TransactionCall
from ._types import Adjusted, Decision, TransactionResult, ValueReading

__all__ = ["RateLimiter"]


class RateLimiter:
    """A client of a tollgate server, over one pool of keep-alive connections.

    ``url`` is the server (``http://127.0.0.1:8787``); ``token`` its bearer token, if it asks
    for one; ``timeout`` the most seconds a call may take, from waiting for a connection to
    the answer's last byte (``None``: no limit); ``limits`` configs in code, name -> config,
    sent inline with every call for that name (names the server defines need none).
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
        timeout: Optional[float] = 10.0,
        limits: Optional[Limits] = None,
        *,
        max_connections: int = _core.DEFAULT_MAX_CONNECTIONS,
        max_answer_bytes: int = _core.DEFAULT_MAX_ANSWER_BYTES,
    ) -> None:
        self._core = _core.Core(url, limits)
        _core.check_max_connections(max_connections)
        self._max_answer_bytes = _core.check_max_answer_bytes(max_answer_bytes)
        self._timeout = timeout
        self._client = httpx.Client(
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

    def _send(
        self, method: str, url: httpx.URL, body: Optional[bytes] = None, writes: bool = False
    ) -> _core.Reply:
        """Sends a request and reads its answer whole, by the call's deadline. ``writes``:
        whether the call may take tokens."""
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
        body = self._core.single(name, key, count, reserve, throws, config)
        return _core.decision(self._send("POST", self._core.limit_url, body, writes=True))

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
        body = self._core.single(name, key, count, reserve, throws, config)
        return _core.decision(self._send("POST", self._core.check_url, body))

    def transaction(
        self, limits: Sequence[TransactionCall], throws: bool = False, fields: bool = False
    ) -> TransactionResult:
        """Takes from every limit or from none: each a :class:`LimitCall` or a dict of
        ``name``, ``key``, ``count``, ``reserve``, ``config``. ``throws``: a refusal raises
        :class:`RateLimitError` (naming the limit with the longest wait). ``fields``: also
        give the answer's ``RateLimit`` header fields (``TransactionResult.fields``)."""
        body, count = self._core.transaction(limits, throws)
        reply = self._send("POST", self._core.transaction_url, body, writes=True)
        return _core.transaction_result(reply, count, fields)

    def reset(self, name: str, key: Optional[str] = None) -> None:
        """Forgets the state of ``name`` for ``key``: it is full again."""
        body = self._core.reset(name, key)
        _core.answer(self._send("POST", self._core.reset_url, body, writes=True))

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
        body = self._core.adjust(name, key, count, config)
        return _core.adjusted(self._send("POST", self._core.adjust_url, body, writes=True))

    def get_value(
        self,
        name: str,
        key: Optional[str] = None,
        sample_shards: Optional[int] = None,
        config: Optional[Mapping[str, Any]] = None,
    ) -> ValueReading:
        """The stored state of ``name`` for ``key``, and its config with every default."""
        body = self._core.value(name, key, sample_shards, config)
        return _core.value_reading(self._send("POST", self._core.value_url, body))

    def get_server_time(self) -> float:
        """The server's (its store's) clock, in ms since the Unix epoch."""
        return _core.server_time(self._send("GET", self._core.time_url))

    def get_config(self) -> Dict[str, Dict[str, Any]]:
        """The limits the server defines, name -> config with every default filled in."""
        return _core.server_limits(self._send("GET", self._core.config_url))

    def close(self) -> None:
        """Closes the pool's connections. Calls after this raise TollgateError."""
        self._client.close()

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
        return f"RateLimiter({self._core.base!r})"
