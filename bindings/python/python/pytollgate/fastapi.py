"""FastAPI: limits per route, as a dependency or as a decorator.

    from fastapi import Depends, FastAPI, Request
    from pytollgate import AsyncRateLimiter, RateLimit
    from pytollgate.fastapi import rate_limit, rate_limited

    limiter = AsyncRateLimiter("redis://127.0.0.1:6379", limits={"perUser": "100/minute", "login": "5/minute"})
    app = FastAPI()

    @app.get("/items", dependencies=[Depends(rate_limit(limiter, "perUser", key=lambda r: r.headers.get("x-user")))])
    async def items() -> list[str]: ...

    @app.post("/login")
    @rate_limited(limiter, "login")
    async def login(request: Request) -> dict[str, str]: ...

Both take the limits through the same gate as the ASGI middleware (``pytollgate.asgi``):
checked when the route is declared, decided on the engine's direct path. A refusal raises
:class:`RateLimitExceeded` (an ``HTTPException``: 429 with ``Retry-After`` and the header
fields, FastAPI's ``{"detail": ...}`` body); an app that wants its own answer adds an
exception handler for it, as slowapi's users do. The decision is ``request.state.rate_limit``
(and the dependency's value).
"""

from __future__ import annotations

import functools
import json
import inspect
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, TypedDict, overload

from fastapi import HTTPException, Request, Response
from starlette.concurrency import run_in_threadpool

import tollgate_client

from . import _middleware
from ._async import AsyncRateLimiter
from ._common import Name
from ._middleware import DEFAULT_IPV6_SUBNET, Ipv6Subnet, KeySource, Names, RateLimit, RefusalMessage, Verdict

if TYPE_CHECKING:
    from typing_extensions import Unpack


class RouteOptions(TypedDict, total=False):
    """The options of :func:`rate_limit` and :func:`rate_limited`, for mypy."""

    key: KeySource
    ipv6_subnet: Ipv6Subnet
    skip: Optional[Callable[[Request], Any]]
    message: Optional[RefusalMessage]
    status_code: int
    standard_headers: bool
    legacy_headers: bool
    fail_open: bool


#: What :func:`rate_limit` gives: a dependency of the request and its response.
Dependency = Callable[[Request, Response], Awaitable[Optional[RateLimit]]]
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

__all__ = ["RateLimitExceeded", "rate_limit", "rate_limited"]


class RateLimitExceeded(HTTPException):
    """A request refused by a route's limits: ``status_code`` (429 unless the route says
    otherwise), ``headers`` (``Retry-After``, the rate limit fields), ``detail`` (the
    message), and the decision as ``rate_limit``."""

    def __init__(self, status_code: int, detail: Any, headers: dict[str, str], rate_limit: RateLimit) -> None:
        super().__init__(status_code, detail, headers)
        self.rate_limit = rate_limit


class _Route:
    """One route's limits and options, checked once."""

    def __init__(
        self,
        where: str,
        limiter: object,
        limits: Names[Any],
        key: KeySource,
        ipv6_subnet: Ipv6Subnet,
        skip: Optional[Callable[[Request], Any]],
        message: Optional[RefusalMessage],
        status_code: int,
        standard_headers: bool,
        legacy_headers: bool,
        fail_open: bool,
    ) -> None:
        self.gate = _middleware.Gate(limiter, limits, asynchronous=True, fail_open=fail_open, where=where)
        self.key = _middleware.check_key(key)
        self.ipv6_subnet = _middleware.check_ipv6_subnet(ipv6_subnet)
        if skip is not None and not callable(skip):
            raise TypeError(f"skip is a function of the request, not {skip!r}")
        self.skip = skip
        self.refusal = _middleware.Refusal(status_code, message)
        self.standard, self.legacy = bool(standard_headers), bool(legacy_headers)
        self.setup = _middleware.Setup()

    async def take(self, request: Request, response: Optional[Response]) -> Optional[RateLimit]:
        """The decision (None: skipped), its header fields set on ``response``; raises
        :class:`RateLimitExceeded` on a refusal and ``HTTPException`` on a failure."""
        if self.skip is not None:
            skipped = self.skip(request)
            if (await skipped) if inspect.isawaitable(skipped) else skipped:
                return None
        client = request.client
        ip = client.host if client else None
        key: Any = _middleware.key_of(self.key, request, ip, request.headers.get, self.ipv6_subnet)
        if inspect.isawaitable(key):  # an async key function (or one that returns a coroutine)
            key = await key
        if key is None or key == "":
            verdict = (
                self.setup.no_address(self.gate.first, "uvicorn --forwarded-allow-ips")
                if self.key == "ip"
                else _middleware.missing_key(self.gate.first)
            )
            raise HTTPException(verdict.status, _error(verdict))
        decided = await self.gate.decide_async(None if key is ... else key)
        if isinstance(decided, Verdict):
            raise HTTPException(decided.status, _error(decided))
        request.state.rate_limit = decided
        fields = _middleware.header_fields(decided, self.standard, self.legacy)
        if not decided.ok:
            body, content_type = self.refusal.body(request, decided)
            detail: Any = body.decode() if content_type.startswith("text/") else json.loads(body)
            raise RateLimitExceeded(self.refusal.status, detail, dict(fields), decided)
        if response is not None and fields:
            # Appended as they are: the response is the one FastAPI made for the route's
            # dependencies, with no such field yet (MutableHeaders would search each name).
            response.raw_headers.extend((k.encode(), v.encode()) for k, v in fields)
        return decided


def _error(verdict: Verdict) -> Any:
    return json.loads(verdict.body).get("error")


@overload
def rate_limit(limiter: AsyncRateLimiter[Name], limits: Names[Name], **options: Unpack[RouteOptions]) -> Dependency: ...
@overload
def rate_limit(
    limiter: tollgate_client.AsyncRateLimiter, limits: Names[str], **options: Unpack[RouteOptions]
) -> Dependency: ...
def rate_limit(
    limiter: object,
    limits: Names[Any],
    *,
    key: KeySource = "ip",
    ipv6_subnet: Ipv6Subnet = DEFAULT_IPV6_SUBNET,
    skip: Optional[Callable[[Request], Any]] = None,
    message: Optional[RefusalMessage] = None,
    status_code: int = 429,
    standard_headers: bool = True,
    legacy_headers: bool = False,
    fail_open: bool = False,
) -> Dependency:
    """A dependency, ``Depends(rate_limit(limiter, "perUser", key=...))``: each request of the
    route takes ``limits`` (a name or several, all or nothing) for its key, and its value is
    the :class:`~pytollgate.RateLimit` (None when ``skip`` let the request through).

    ``limiter``: ``pytollgate.AsyncRateLimiter`` or ``tollgate_client.AsyncRateLimiter``.
    ``key``: ``"ip"`` (the client's address), ``"global"``, ``{"header": name}``, or a
    function of the Starlette ``Request`` (sync or ``async def``). ``message``,
    ``status_code``: the refusal's detail and status (see :class:`RateLimitExceeded`).
    ``standard_headers``, ``legacy_headers``, ``fail_open``, ``ipv6_subnet``: as for
    ``pytollgate.asgi.RateLimitMiddleware``. The header fields reach a route's answer when
    it returns a value, not a ``Response`` of its own (FastAPI merges a dependency's
    ``Response`` only then); :func:`rate_limited` writes them on either."""
    route = _Route(
        "rate_limit(...)", limiter, limits, key, ipv6_subnet, skip, message, status_code,
        standard_headers, legacy_headers, fail_open,
    )

    async def rate_limit_dependency(request: Request, response: Response) -> Optional[RateLimit]:
        return await route.take(request, response)

    return rate_limit_dependency


@overload
def rate_limited(limiter: AsyncRateLimiter[Name], limits: Names[Name], **options: Unpack[RouteOptions]) -> Decorator: ...
@overload
def rate_limited(
    limiter: tollgate_client.AsyncRateLimiter, limits: Names[str], **options: Unpack[RouteOptions]
) -> Decorator: ...
def rate_limited(
    limiter: object,
    limits: Names[Any],
    *,
    key: KeySource = "ip",
    ipv6_subnet: Ipv6Subnet = DEFAULT_IPV6_SUBNET,
    skip: Optional[Callable[[Request], Any]] = None,
    message: Optional[RefusalMessage] = None,
    status_code: int = 429,
    standard_headers: bool = True,
    legacy_headers: bool = False,
    fail_open: bool = False,
) -> Decorator:
    """A route decorator (under ``@app.get(...)``, as slowapi's ``@limiter.limit``): the same
    as :func:`rate_limit`, and the header fields written on the route's answer whatever it
    returns. The endpoint needs no ``request`` parameter (one is added for the decorator's
    use when it has none); a sync endpoint still runs in the thread pool."""

    def decorate(endpoint: Callable[..., Any]) -> Callable[..., Any]:
        where = f"@rate_limited on {getattr(endpoint, '__qualname__', endpoint)!r}"
        route = _Route(
            where, limiter, limits, key, ipv6_subnet, skip, message, status_code,
            standard_headers, legacy_headers, fail_open,
        )
        signature = inspect.signature(endpoint)
        own = {
            p.annotation: p.name for p in signature.parameters.values() if p.annotation in (Request, Response, "Request", "Response")
        }
        asked_request = own.get(Request) or own.get("Request")
        asked_response = own.get(Response) or own.get("Response")
        extra = []
        if asked_request is None:
            extra.append(inspect.Parameter("_tollgate_request", inspect.Parameter.KEYWORD_ONLY, annotation=Request))
        if asked_response is None:
            extra.append(inspect.Parameter("_tollgate_response", inspect.Parameter.KEYWORD_ONLY, annotation=Response))
        is_coroutine = inspect.iscoroutinefunction(endpoint)

        @functools.wraps(endpoint)
        async def limited_endpoint(*args: Any, **kwargs: Any) -> Any:
            request = kwargs[asked_request] if asked_request else kwargs.pop("_tollgate_request")
            response = kwargs[asked_response] if asked_response else kwargs.pop("_tollgate_response")
            await route.take(request, response)
            if is_coroutine:
                answer = await endpoint(*args, **kwargs)
            else:
                answer = await run_in_threadpool(endpoint, *args, **kwargs)
            if isinstance(answer, Response):
                for name, value in response.headers.items():
                    if name.startswith(("ratelimit", "x-ratelimit")):
                        answer.headers[name] = value
            return answer

        parameters = list(signature.parameters.values())
        # Keyword-only parameters go after the others, before a **kwargs.
        at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
        limited_endpoint.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=parameters[:at] + extra + parameters[at:]
        )
        return limited_endpoint

    return decorate
