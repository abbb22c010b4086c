"""The blocking client, and the calls it shares with the in-process limiter."""

from __future__ import annotations

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

__all__ = ["RateLimiter", "Hold", "Held"]


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

    def acquire(
        self,
        name: str,
        key: Optional[str] = None,
        count: Optional[int] = None,
        ttl: Optional[Milliseconds] = None,
        throws: bool = False,
    ) -> Acquired:
        """Takes ``count`` slots (default 1) of the concurrency limit ``name`` for ``key``
        (SPEC §6f). Granted: a ``ticket`` that holds them until :meth:`release`, or until
        ``expires_at`` (now + ``ttl``, default the limit's, on the store's clock), which
        :meth:`renew` moves. Refused, nothing taken: ``retry_after``, the ms until the
        earliest holder's expiry. ``ttl``: milliseconds, or a string with its unit
        (``"2m"``). A ``count`` above the limit's ``max`` raises :class:`TollgateError`
        (400): it could never be granted. ``throws``: a refusal raises
        :class:`RateLimitError`."""
        body = self._bodies.acquire(name, key, count, ttl, throws)
        return _core.acquired(self._send("acquire", body))

    def hold(
        self,
        name: str,
        key: Optional[str] = None,
        count: Optional[int] = None,
        ttl: Optional[Milliseconds] = None,
    ) -> "Hold":
        """Slots of ``name`` held for a ``with`` block, released when it ends, however it
        ends::

            with limiter.hold("exports", key=tenant) as slot:
                run_export()  # slot.ticket, slot.renew() for a long one

        Acquired as the block is entered (the arguments are ``acquire``'s); a refusal raises
        :class:`RateLimitError` there (``retry_after`` in it), and the block does not run."""
        return Hold(self, name, key, self._bodies.acquire(name, key, count, ttl, False))

    def release(self, name: str, key: Optional[str] = None, *, ticket: str) -> bool:
        """Frees the slots of ``ticket`` (acquired with ``key``): ``True``, or ``False`` for
        a ticket unknown, released already or expired (never an error: a release may race
        its expiry)."""
        return _core.released(self._send("release", self._bodies.ticket(name, key, ticket)))

    def renew(
        self,
        name: str,
        key: Optional[str] = None,
        *,
        ticket: str,
        ttl: Optional[Milliseconds] = None,
    ) -> Renewed:
        """Holds the slots of ``ticket`` (acquired with ``key``) for ``ttl`` more from now
        (default the limit's), for a long task: ``ok`` with the new ``expires_at``, or not
        ``ok`` when the ticket had expired (its slots may be someone else's by then)."""
        body = self._bodies.ticket(name, key, ticket, ttl)
        return _core.renewed(self._send("renew", body))

    def get_slots_value(self, name: str, key: Optional[str] = None) -> SlotsValue:
        """A concurrency limit's slots for ``key``: those in flight, its ``max``, and the
        tickets holding them. (``check`` says whether an acquire would be granted,
        ``reset`` frees every slot.)"""
        body = self._bodies.value(name, key, None, None)
        return _core.slots_value(self._send("value", body))

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


class Held(_core.Slot):
    """Slots of a concurrency limit held in a ``with limiter.hold(...) as slot:`` block:
    its ``name``, ``key`` and ``ticket``, and ``expires_at``, moved by :meth:`renew`."""

    __slots__ = ("_limiter",)

    def __init__(
        self, limiter: Limiter, name: str, key: Optional[str], ticket: str, expires_at: float
    ) -> None:
        super().__init__(name, key, ticket, expires_at)
        self._limiter = limiter

    def renew(self, ttl: Optional[Milliseconds] = None) -> bool:
        """Holds the slots for ``ttl`` more from now (default the limit's): ``True``, or
        ``False`` when the ticket had expired or was released (its slots may be someone
        else's by then: stop the work)."""
        if self._released:
            return False
        return self._renewed(self._limiter.renew(self.name, self.key, ticket=self.ticket, ttl=ttl))

    def release(self) -> bool:
        """Lets the slots go now: ``True``, or ``False`` when they had expired already or
        were released by an earlier call (which then sends nothing). Raises
        :class:`TollgateError` when the store cannot say; the slots are then free at
        ``expires_at``."""
        if self._released:
            return False
        freed = self._limiter.release(self.name, self.key, ticket=self.ticket)
        self._released = True
        return freed


class Hold:
    """What :meth:`Limiter.hold` answers: a context manager that acquires as its block is
    entered (raising :class:`RateLimitError` when refused) and releases when the block
    ends, however it ends. A release that fails then (the store down) is not raised, so
    that it cannot hide how the block ended; the slots are free at their expiry. Call
    ``slot.release()`` inside the block to know."""

    __slots__ = ("_limiter", "_name", "_key", "_body", "_held")

    def __init__(self, limiter: Limiter, name: str, key: Optional[str], body: bytes) -> None:
        self._limiter, self._name, self._key, self._body = limiter, name, key, body
        self._held: Optional[Held] = None

    def __enter__(self) -> Held:
        if self._held is not None:
            raise RuntimeError("this hold's block is running already; call hold() for another")
        ticket, expires_at = _core.held(self._name, self._limiter._send("acquire", self._body))
        self._held = Held(self._limiter, self._name, self._key, ticket, expires_at)
        return self._held

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        held, self._held = self._held, None
        if held is not None:
            try:
                held.release()
            except TollgateError:
                pass  # the slots are free at their expiry (see above)
