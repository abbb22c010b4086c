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
from ._middleware import KeySource, LimitRef, Verdict

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
    (websocket, lifespan) pass untouched."""

    def __init__(
        self,
        app: App,
        *,
        limiter: AsyncTransacting,
        limits: Union[LimitRef, Sequence[LimitRef]],
        key: KeySource = "ip",
    ) -> None:
        self.app, self.limiter, self.key = app, limiter, key
        self.entries = _middleware.limits_of(limits)

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
        key = _middleware.key_of(self.key, scope, ip, headers.get)
        if key is None or key == "":
            return _middleware.missing_key(self.key, str(self.entries[0]["name"]))
        try:
            result = await self.limiter.transaction(
                _middleware.calls(self.entries, key), fields=True
            )
        except Exception as e:  # noqa: BLE001 - any failure fails closed
            return _middleware.failed(e)
        return _middleware.verdict(self.entries, result)


async def _answer(send: Send, verdict: Verdict) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(verdict.body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in verdict.headers.items()]
    await send({"type": "http.response.start", "status": verdict.status, "headers": headers})
    await send({"type": "http.response.body", "body": verdict.body})
