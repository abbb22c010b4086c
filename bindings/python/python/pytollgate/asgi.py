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

from typing import Any, Awaitable, Callable, Dict, MutableMapping, Optional, Protocol, Sequence, Union

from tollgate_client import TransactionResult

from . import _middleware
from ._middleware import DEFAULT_IPV6_SUBNET, Ipv6Subnet, KeySource, LimitRef, Verdict

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

__all__ = ["RateLimitMiddleware"]


class AsyncTransacting(Protocol):
    """What the middleware needs of a limiter: ``pytollgate.AsyncRateLimiter`` (in-process)
    or ``tollgate_client.AsyncRateLimiter`` (a server's)."""

    async def transaction(self, limits: Any, throws: bool = ..., fields: bool = ...) -> TransactionResult: ...


class RateLimitMiddleware:
    """Takes ``limits`` (one name, or several taken all or nothing) for each HTTP request,
    keyed as ``key`` says: ``"ip"`` (default: the ASGI ``client`` address; behind a proxy,
    have the server set it from the proxy's header, as uvicorn's ``--proxy-headers`` does),
    ``{"header": "x-api-key"}``, ``"global"``, or a function of the ASGI scope. Other scopes
    (websocket, lifespan) pass untouched.

    ``ipv6_subnet``: the ``"ip"`` key of an IPv6 client is its /56 network (default 56: one
    host changes address within its /64 or more at will), ``2001:db8:abcd:1200::/56``; a
    prefix length from 1 to 128, ``False`` (or 128) for whole addresses. IPv4-mapped addresses
    (``::ffff:1.2.3.4``) are keyed as their IPv4.

    A request without a client address (a server on a unix socket, without the proxy's
    header taken) cannot be keyed by ``"ip"``: it is answered 500 with how to fix that, said
    once in the log. The store's failures are 503 ``{"error": "rate limit store
    unavailable", "mayHaveTaken"}``, their detail in the ``pytollgate`` logger. An answer of
    the middleware's own that cannot be sent any more (the client gone, a response already
    sent by a middleware before it) is dropped; the decision was taken all the same."""

    def __init__(
        self,
        app: App,
        *,
        limiter: AsyncTransacting,
        limits: Union[LimitRef, Sequence[LimitRef]],
        key: KeySource = "ip",
        ipv6_subnet: Ipv6Subnet = DEFAULT_IPV6_SUBNET,
    ) -> None:
        self.app, self.limiter = app, limiter
        self.key = _middleware.check_key(key)
        self.ipv6_subnet = _middleware.check_ipv6_subnet(ipv6_subnet)
        self.entries = _middleware.limits_of(limits)
        self.first = str(self.entries[0]["name"])
        self.failures = _middleware.Failures()
        self.setup = _middleware.Setup()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        verdict = await self._decide(scope)
        if not verdict.passes:
            await _answer(send, verdict)
            return
        added = [(k.lower().encode(), v.encode()) for k, v in verdict.headers.items()]

        async def send_with_fields(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + added
            await send(message)

        await self.app(scope, receive, send_with_fields)

    async def _decide(self, scope: Scope) -> Verdict:
        client = scope.get("client")
        ip: Optional[str] = client[0] if client else None
        headers: Dict[str, str] = {}
        for name, value in scope.get("headers", []):
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        key = _middleware.key_of(self.key, scope, ip, headers.get, self.ipv6_subnet)
        if key is None or key == "":
            if self.key == "ip":
                return self.setup.no_address(self.first, _FIX)
            return _middleware.missing_key(self.first)
        try:
            result = await self.limiter.transaction(
                _middleware.calls(self.entries, key), fields=True
            )
        except Exception as e:  # noqa: BLE001 - any failure fails closed
            return self.failures.failed(e)
        return _middleware.verdict(self.entries, result)


#: How an ASGI server is told to take the client's address from a proxy's header.
_FIX = "uvicorn --forwarded-allow-ips=ADDRESS, or '*' on a unix socket only the proxy reaches"


async def _answer(send: Send, verdict: Verdict) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(verdict.body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in verdict.headers.items()]
    try:
        await send({"type": "http.response.start", "status": verdict.status, "headers": headers})
        await send({"type": "http.response.body", "body": verdict.body})
    except (OSError, RuntimeError) as e:
        # The response moved on while the decision was made: the client left (a server
        # raises an OSError on a send after a disconnect, as ASGI asks) or a middleware
        # before this one answered already (a timeout: uvicorn raises RuntimeError on a
        # second response). No one is left to tell; the decision stands.
        _middleware.logger.debug("the rate limit answer was not sent: %r", e)
