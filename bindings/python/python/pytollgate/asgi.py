"""ASGI middleware (FastAPI, Starlette, any ASGI app): each HTTP request takes its limits.

    from fastapi import FastAPI
    from pytollgate import AsyncRateLimiter, MINUTE
    from pytollgate.asgi import RateLimitMiddleware

    limiter = AsyncRateLimiter("redis://127.0.0.1:6379", limits={
        "per_ip": {"kind": "token bucket", "rate": 60, "period": MINUTE},
    })
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=limiter, limits="per_ip")
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, List, MutableMapping, Optional, Tuple, Union, overload

import tollgate_client

from . import _middleware
from ._async import AsyncRateLimiter
from ._common import Name
from ._middleware import DEFAULT_IPV6_SUBNET, ConcurrencyRef, Ipv6Subnet, KeySource, Names, RateLimit, RefusalMessage, Verdict

if TYPE_CHECKING:
    from typing_extensions import Unpack


class MiddlewareOptions(_middleware.Options, total=False):
    """The options of :class:`RateLimitMiddleware`, for mypy."""

    exempt: Iterable[str]


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

__all__ = ["RateLimitMiddleware"]


class RateLimitMiddleware:
    """Takes ``limits`` (one name, or several taken all or nothing) for each HTTP request,
    keyed as ``key`` says: ``"ip"`` (default: the ASGI ``client`` address; behind a proxy,
    have the server set it from the proxy's header, as uvicorn's ``--proxy-headers`` does),
    ``{"header": "x-api-key"}``, ``"global"``, or a function of the ASGI scope (sync or
    ``async def``) that returns the key. Other scopes (websocket, lifespan) pass untouched.

    ``limiter`` is ``pytollgate.AsyncRateLimiter`` (in-process: each decision goes through
    the engine's direct path, no JSON) or ``tollgate_client.AsyncRateLimiter`` (a server's).
    The limits, the key and every option are checked here: a limit the limiter does not
    define, a blocking ``RateLimiter``, a bad key or option raise at once, with the fix.

    Options, under express-rate-limit's names where they mean the same:

    - ``exempt``: paths let through untaken (``"/docs"``, ``"/static/*"`` for every path
      under it). CORS preflights (``OPTIONS`` with ``Access-Control-Request-Method``) always
      pass: the browser sends them, and one refused fails the request it asks for.
    - ``skip``: a function of the scope (sync or async); true lets the request through.
    - ``status_code`` (default 429), ``message`` (text, a dict sent as JSON, or a function of
      the scope and the :class:`~pytollgate.RateLimit`), or ``handler``: a function of the
      scope and the ``RateLimit`` (sync or async) returning an ASGI app to answer with (a
      Starlette ``Response`` is one).
    - ``standard_headers`` (default True): ``RateLimit-Policy`` and ``RateLimit``;
      ``legacy_headers`` (default False): ``X-RateLimit-Limit``, ``-Remaining``, ``-Reset``
      as slowapi writes them. ``Retry-After`` on every refusal.
    - ``fail_open`` (default False): while the store fails, requests pass (without header
      fields) instead of 503; each failure is still logged.
    - ``concurrency``: a concurrency limit's name (or ``{"name", "count", "ttl"}``), keyed
      by ``key``: each request holds a slot of it from before the rate limits and the app
      until its response ends, however it ends; released once, as the last of the body goes
      out (a streaming response holds it to its last chunk), when the app raises, or when
      the request is cancelled. A refusal is ``concurrency_status_code`` (default 429; 503
      says the server is busy) with ``Retry-After`` and ``message``'s body (``handler``
      answers the rate limits' refusals only), and takes no rate limit's token; a request
      the rate limits refuse gives its slot back at once. ``limits`` may be left out then.

    The decision is ``request.state.rate_limit`` (``scope["state"]["rate_limit"]``) for the
    app. ``ipv6_subnet``: the ``"ip"`` key of an IPv6 client is its /56 network (default 56),
    a prefix length from 1 to 128, ``False`` (or 128) for whole addresses; IPv4-mapped
    addresses (``::ffff:1.2.3.4``) are keyed as their IPv4.

    A request without a client address (a server on a unix socket, without the proxy's
    header taken) cannot be keyed by ``"ip"``: it is answered 500 with how to fix that, said
    once in the log. The store's failures are 503 ``{"error": "rate limit store
    unavailable", "mayHaveTaken"}``, their detail in the ``pytollgate`` logger. An answer of
    the middleware's own that cannot be sent any more (the client gone, a response already
    sent by a middleware before it) is dropped; the decision was taken all the same."""

    @overload
    def __init__(
        self,
        app: App,
        *,
        limiter: AsyncRateLimiter[Name],
        limits: Optional[Names[Name]] = None,
        **options: Unpack[MiddlewareOptions],
    ) -> None: ...
    @overload
    def __init__(
        self,
        app: App,
        *,
        limiter: tollgate_client.AsyncRateLimiter,
        limits: Optional[Names[str]] = None,
        **options: Unpack[MiddlewareOptions],
    ) -> None: ...
    def __init__(
        self,
        app: App,
        *,
        limiter: object,
        limits: Optional[Names[Any]] = None,
        key: KeySource = "ip",
        ipv6_subnet: Ipv6Subnet = DEFAULT_IPV6_SUBNET,
        exempt: Iterable[str] = (),
        skip: Optional[Callable[[Scope], Any]] = None,
        handler: Optional[Callable[[Scope, RateLimit], Any]] = None,
        message: Optional[RefusalMessage] = None,
        status_code: int = 429,
        standard_headers: bool = True,
        legacy_headers: bool = False,
        fail_open: bool = False,
        concurrency: Optional[ConcurrencyRef[Any]] = None,
        concurrency_status_code: int = 429,
    ) -> None:
        self.app = app
        if limits is None and concurrency is None:
            raise TypeError(
                "RateLimitMiddleware takes limits (rate limits' names), concurrency (a "
                "concurrency limit's name), or both"
            )
        self.slots = None if concurrency is None else _middleware.Slots(
            limiter, concurrency, concurrency_status_code,
            asynchronous=True, fail_open=fail_open, where="RateLimitMiddleware",
        )
        self.gate = None if limits is None else _middleware.Gate(
            limiter, limits, asynchronous=True, fail_open=fail_open, where="RateLimitMiddleware"
        )
        self.label = self.gate.label if self.gate is not None else self.slots.label  # type: ignore[union-attr]
        self.key = _middleware.check_key(key)
        self.ipv6_subnet = _middleware.check_ipv6_subnet(ipv6_subnet)
        self.exempt = _middleware.Exempt(exempt)
        if skip is not None and not callable(skip):
            raise TypeError(f"skip is a function of the request, not {skip!r}")
        self.skip, self.skip_is_async = skip, _middleware.is_async(skip)
        if handler is not None and not callable(handler):
            raise TypeError(f"handler is a function of (scope, rate_limit), not {handler!r}")
        self.handler = handler
        self.refusal = _middleware.Refusal(status_code, message)
        self.standard, self.legacy = bool(standard_headers), bool(legacy_headers)
        self.setup = _middleware.Setup()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._passes(scope):
            await self.app(scope, receive, send)
            return
        if self.skip is not None:
            skipped = self.skip(scope)
            if (await skipped) if self.skip_is_async else skipped:
                await self.app(scope, receive, send)
                return
        key = await self._key(scope)
        if isinstance(key, Verdict):
            await _answer(send, key.status, key.headers.items(), key.body, "application/json")
            return
        if self.slots is None:
            await self._limited(scope, receive, send, key)
            return
        held = await self.slots.acquire_async(key)
        if isinstance(held, Verdict):
            await _answer(send, held.status, held.headers.items(), held.body, "application/json")
            return
        if isinstance(held, RateLimit):
            # Refused by the concurrency limit: no rate limit was taken from.
            body, content_type = self.refusal.body(scope, held)
            await _answer(send, self.slots.status, self.slots.refusal_fields(held), body, content_type)
            return
        if held is None:  # the store failed, and fail_open let the request through
            await self._limited(scope, receive, send, key)
            return
        release = held.release_async

        async def release_then_send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # The last of the body is made: the work is done (and a client that reads
                # the whole answer finds the slot free).
                await release()
            await send(message)

        try:
            await self._limited(scope, receive, release_then_send, key)
        finally:
            # The app raised or returned without a last body (a refusal by the rate limits
            # is sent through release_then_send), or the request was cancelled.
            await release()

    async def _limited(self, scope: Scope, receive: Receive, send: Send, key: Optional[str]) -> None:
        """The app, behind the rate limits if there are any."""
        if self.gate is None:
            await self.app(scope, receive, send)
            return
        decided = await self.gate.decide_async(key)
        if isinstance(decided, Verdict):
            await _answer(send, decided.status, decided.headers.items(), decided.body, "application/json")
            return
        scope.setdefault("state", {})["rate_limit"] = decided
        fields = _middleware.header_fields(decided, self.standard, self.legacy)
        if not decided.ok:
            await self._refuse(scope, receive, send, decided, fields)
            return
        if not fields:
            await self.app(scope, receive, send)
            return
        added = [(k.encode(), v.encode()) for k, v in fields]

        async def send_with_fields(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + added
            await send(message)

        await self.app(scope, receive, send_with_fields)

    def _passes(self, scope: Scope) -> bool:
        """An exempt path, or a CORS preflight."""
        if scope["path"] in self.exempt:
            return True
        if scope.get("method") == "OPTIONS":
            return any(name == b"access-control-request-method" for name, _ in scope.get("headers", ()))
        return False

    async def _key(self, scope: Scope) -> Union[Optional[str], Verdict]:
        """The request's key (None: the limits' one global value), or the answer to a
        request without one."""
        client = scope.get("client")
        ip: Optional[str] = client[0] if client else None
        key: Any
        if self.key == "ip":
            key = _middleware.ip_key(ip, self.ipv6_subnet) if ip else None
        elif self.key == "global":
            key = ...
        else:
            key = _middleware.key_of(self.key, scope, ip, lambda name: _header(scope, name))
            if inspect.isawaitable(key):  # an async key function (or one that returns a coroutine)
                key = await key
        if key is ...:
            return None
        if key is None or key == "":
            if self.key == "ip":
                return self.setup.no_address(self.label, _FIX)
            return _middleware.missing_key(self.label)
        return key if isinstance(key, str) else str(key)  # a user's id, say

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, decided: RateLimit, fields: List[Tuple[str, str]]
    ) -> None:
        if self.handler is None:
            body, content_type = self.refusal.body(scope, decided)
            await _answer(send, self.refusal.status, fields, body, content_type)
            return
        answer = self.handler(scope, decided)
        if inspect.isawaitable(answer):
            answer = await answer
        added = [(k.encode(), v.encode()) for k, v in fields]

        async def send_with_fields(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + added
            await send(message)

        await answer(scope, receive, send_with_fields)


def _header(scope: Scope, name: str) -> Optional[str]:
    wanted = name.encode("latin-1")
    for field, value in scope.get("headers", ()):
        if field.lower() == wanted:
            return str(value.decode("latin-1"))
    return None


#: How an ASGI server is told to take the client's address from a proxy's header.
_FIX = "uvicorn --forwarded-allow-ips=ADDRESS, or '*' on a unix socket only the proxy reaches"


async def _answer(
    send: Send, status: int, fields: Iterable[Tuple[str, str]], body: bytes, content_type: str
) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in fields]
    try:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    except (OSError, RuntimeError) as e:
        # The response moved on while the decision was made: the client left (a server
        # raises an OSError on a send after a disconnect, as ASGI asks) or a middleware
        # before this one answered already (a timeout: uvicorn raises RuntimeError on a
        # second response). No one is left to tell; the decision stands.
        _middleware.logger.debug("the rate limit answer was not sent: %r", e)
