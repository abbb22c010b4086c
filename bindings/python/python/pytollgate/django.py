"""Django: a middleware that limits every request, and a decorator that limits one view.

    # settings.py
    from pytollgate import RateLimiter, MINUTE
    TOLLGATE = {
        "limiter": RateLimiter("redis://127.0.0.1:6379", limits={
            "per_ip": {"kind": "token bucket", "rate": 60, "period": MINUTE},
        }),
        "limits": "per_ip",          # or a list, taken all or nothing
        "key": "ip",                 # or {"header": "x-api-key"}, "global", a function of the request
        "ipv6_subnet": 56,           # the "ip" key of an IPv6 client: its /56 (False: whole addresses)
        "exempt": ["/healthz"],      # and the other options of rate_limit below
        # "concurrency": "exports",  # a concurrency limit's slot held while a request is answered
    }
    MIDDLEWARE = ["pytollgate.django.RateLimitMiddleware", ...]

    # views.py
    from pytollgate.django import rate_limit

    @rate_limit(limiter, "login", key="ip")
    def login(request): ...

The limiter is ``pytollgate.RateLimiter`` (in-process) or ``tollgate_client.RateLimiter`` (a
server's) for sync views and a sync middleware stack, their ``AsyncRateLimiter`` for async
views and an async stack (the middleware is async-capable: Django runs it as the stack
around it runs). "ip" is ``REMOTE_ADDR`` (behind a proxy, a function that reads the proxy's
header), keyed as the ASGI middleware keys it (``pytollgate.asgi``). A request without
``REMOTE_ADDR`` (gunicorn on a unix socket) cannot be keyed by "ip": it is answered 500 with
how to fix that, said once in the log. The store's failures are 503 ``{"error": "rate limit
store unavailable", "mayHaveTaken"}``, their detail in the ``pytollgate`` logger.

Neither writes to the client itself: each returns a response (its own, or the view's with
its header fields), and the server sends it, or drops it if the client left.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union, overload

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse

import tollgate_client

from . import _middleware
from ._async import AsyncRateLimiter
from ._common import Name
from ._middleware import DEFAULT_IPV6_SUBNET, ConcurrencyRef, Ipv6Subnet, KeySource, Names, RateLimit, RefusalMessage, Verdict
from ._sync import RateLimiter

if TYPE_CHECKING:
    from typing_extensions import Unpack


class ViewOptions(_middleware.Options, total=False):
    """The options of :func:`rate_limit`, for mypy."""

    block: bool

__all__ = ["RateLimitMiddleware", "rate_limit"]

#: How a Django deployment gives the middleware the client's address behind a proxy.
_FIX = "a middleware before this one that sets REMOTE_ADDR from X-Forwarded-For"

View = Callable[..., Any]


class _Limited:
    """What the middleware and the decorator share: the gate, the key and the options,
    checked once; per request, the decision and the response."""

    def __init__(
        self,
        where: str,
        asynchronous: Optional[bool],
        limiter: object,
        limits: Optional[Names[Any]],
        key: KeySource = "ip",
        ipv6_subnet: Ipv6Subnet = DEFAULT_IPV6_SUBNET,
        exempt: Iterable[str] = (),
        skip: Optional[Callable[[HttpRequest], Any]] = None,
        handler: Optional[Callable[[HttpRequest, RateLimit], Any]] = None,
        message: Optional[RefusalMessage] = None,
        status_code: int = 429,
        standard_headers: bool = True,
        legacy_headers: bool = False,
        fail_open: bool = False,
        block: bool = True,
        concurrency: Optional[ConcurrencyRef[Any]] = None,
        concurrency_status_code: int = 429,
    ) -> None:
        if limits is None and concurrency is None:
            raise TypeError(f"{where} takes limits (rate limits' names), concurrency (a concurrency limit's name), or both")
        self.slots = None if concurrency is None else _middleware.Slots(
            limiter, concurrency, concurrency_status_code,
            asynchronous=asynchronous, fail_open=fail_open, where=where,
        )
        self.gate = None if limits is None else _middleware.Gate(
            limiter, limits, asynchronous=asynchronous, fail_open=fail_open, where=where
        )
        self.label = self.gate.label if self.gate is not None else self.slots.label  # type: ignore[union-attr]
        self.key = _middleware.check_key(key)
        if _middleware.is_async(key) and not asynchronous:
            raise TypeError(f"{where} is sync and cannot await the key function {key!r}")
        self.ipv6_subnet = _middleware.check_ipv6_subnet(ipv6_subnet)
        self.exempt = _middleware.Exempt(exempt)
        for name, function in (("skip", skip), ("handler", handler)):
            if function is not None and not callable(function):
                raise TypeError(f"{name} is a function of the request, not {function!r}")
            if _middleware.is_async(function) and not asynchronous:
                raise TypeError(f"{where} is sync and cannot await the {name} {function!r}")
        self.skip, self.handler = skip, handler
        self.refusal = _middleware.Refusal(status_code, message)
        self.standard, self.legacy, self.block = bool(standard_headers), bool(legacy_headers), bool(block)
        self.setup = _middleware.Setup()

    def passes(self, request: HttpRequest) -> bool:
        """An exempt path, a CORS preflight: through untaken (see ``skip`` for the rest)."""
        if request.path in self.exempt:
            return True
        return request.method == "OPTIONS" and "access-control-request-method" in request.headers

    def key_of(self, request: HttpRequest) -> Any:
        ip = request.META.get("REMOTE_ADDR") or None
        return _middleware.key_of(self.key, request, ip, request.headers.get, self.ipv6_subnet)

    def no_key(self) -> Verdict:
        if self.key == "ip":
            return self.setup.no_address(self.label, _FIX)
        return _middleware.missing_key(self.label)

    def take(self, request: HttpRequest, key: Any, view: Callable[[HttpRequest], Any]) -> Any:
        """The response to a request with ``key`` (``...``: the one global value): the
        concurrency limit's slots acquired first (a refusal takes no rate limit's token),
        then the rate limits, then the view; the slots let go when the response is made, or
        for a streaming one when its stream ends or is closed."""
        text = self._text(key)
        if isinstance(text, Verdict):
            return _json_response(text)
        held: Optional[_middleware.Held] = None
        if self.slots is not None:
            got = self.slots.acquire(text)
            if isinstance(got, Verdict):
                return _json_response(got)
            if isinstance(got, RateLimit):
                return self._refused_by_slots(request, got)
            held = got  # None: the store failed, and fail_open let the request through
        try:
            decided = None if self.gate is None else self.gate.decide(text)
            response = self.respond(request, decided, view)
        except BaseException:
            if held is not None:
                held.release()
            raise
        if held is not None:
            if getattr(response, "streaming", False):
                response.streaming_content = _stream_holding(response.streaming_content, held)
            else:
                held.release()
        return response

    async def take_async(self, request: HttpRequest, key: Any, view: Callable[[HttpRequest], Any]) -> Any:
        """:meth:`take`, awaited."""
        text = self._text(key)
        if isinstance(text, Verdict):
            return _json_response(text)
        held: Optional[_middleware.Held] = None
        if self.slots is not None:
            got = await self.slots.acquire_async(text)
            if isinstance(got, Verdict):
                return _json_response(got)
            if isinstance(got, RateLimit):
                return self._refused_by_slots(request, got)
            held = got  # None: the store failed, and fail_open let the request through
        try:
            decided = None if self.gate is None else await self.gate.decide_async(text)
            response = await _maybe(self.respond(request, decided, view))
        except BaseException:  # the view raised, or the request was cancelled (the client gone)
            if held is not None:
                await held.release_async()
            raise
        if held is not None:
            if getattr(response, "streaming", False):
                response.streaming_content = _stream_holding(response.streaming_content, held)
            else:
                await held.release_async()
        return response

    def _text(self, key: Any) -> Union[Optional[str], Verdict]:
        if key is ...:
            return None
        if isinstance(key, str):
            return key
        return self.gate._text(key) if self.gate is not None else str(key)

    def _refused_by_slots(self, request: HttpRequest, refused: RateLimit) -> HttpResponse:
        assert self.slots is not None
        body, content_type = self.refusal.body(request, refused)
        response = HttpResponse(body, status=self.slots.status, content_type=content_type)
        return _with(response, self.slots.refusal_fields(refused))

    def respond(
        self, request: HttpRequest, decided: Union[RateLimit, Verdict, None], view: Callable[[HttpRequest], Any]
    ) -> Any:
        """The view's response (``view`` called, its result returned as it comes: awaitable
        in an async stack) or the refusal's, whichever the decision says (None: no rate
        limits)."""
        if decided is None:
            return view(request)
        if isinstance(decided, Verdict):
            return _json_response(decided)
        request.rate_limit = decided
        if not decided.ok and self.block:
            fields = _middleware.header_fields(decided, self.standard, self.legacy)
            if self.handler is not None:
                return _with(self.handler(request, decided), fields)
            body, content_type = self.refusal.body(request, decided)
            return _with(HttpResponse(body, status=self.refusal.status, content_type=content_type), fields)
        # Not blocked: the view reads request.rate_limit.ok (django-ratelimit's block=False).
        return _with(view(request), _middleware.header_fields(decided, self.standard, self.legacy))


def _with(response: Any, fields: list[tuple[str, str]]) -> Any:
    """``response`` with the header fields (awaited first, if it is awaitable)."""
    if inspect.isawaitable(response):

        async def later() -> Any:
            return _with(await response, fields)

        return later()
    for name, value in fields:
        response[name] = value
    return response


def _stream_holding(content: Any, held: _middleware.Held) -> Any:
    """A streaming response's content that lets ``held`` go when it ends: its last chunk,
    an error, or the server's ``close()`` of the response (a client gone, a stream never
    started); failing those, when the content is dropped (Django's ASGI handler neither
    closes the response nor ends its stream when a disconnect cancels the request while it
    sends a chunk)."""
    if hasattr(content, "__aiter__"):
        return _AsyncStreamHolding(content, held)
    return _StreamHolding(content, held)


class _StreamHolding:
    def __init__(self, content: Any, held: _middleware.Held) -> None:
        self._content, self._held = iter(content), held
        weakref.finalize(self, held.release_soon)

    def __iter__(self) -> "_StreamHolding":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._content)
        except BaseException:
            self._held.release_soon()
            raise

    def close(self) -> None:
        self._held.release_soon()


class _AsyncStreamHolding:
    def __init__(self, content: Any, held: _middleware.Held) -> None:
        self._content, self._held = aiter(content), held
        weakref.finalize(self, held.release_soon)

    def __aiter__(self) -> "_AsyncStreamHolding":
        return self

    async def __anext__(self) -> Any:
        try:
            return await anext(self._content)
        except BaseException:  # the end, an error, or the request cancelled (the client gone)
            await self._held.release_async()
            raise

    def close(self) -> None:
        self._held.release_soon()


def _json_response(verdict: Verdict) -> HttpResponse:
    response = HttpResponse(verdict.body, status=verdict.status, content_type="application/json")
    for name, value in verdict.headers.items():
        response[name] = value
    return response


class RateLimitMiddleware:
    """Every request takes the limits of ``settings.TOLLGATE`` (``limiter``, ``limits`` and
    the options of :func:`rate_limit`), checked when Django makes the middleware. Sync or
    async as the stack around it: a ``RateLimiter`` in a sync stack, an ``AsyncRateLimiter``
    in an async one (ASGI with async middleware only)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.asynchronous = iscoroutinefunction(get_response)
        if self.asynchronous:
            markcoroutinefunction(self)
        config: dict[str, Any] = dict(getattr(settings, "TOLLGATE", {}))
        if "limiter" not in config or ("limits" not in config and "concurrency" not in config):
            raise ValueError(
                "settings.TOLLGATE needs a 'limiter', and its 'limits' (rate limits' names), "
                "its 'concurrency' (a concurrency limit's name), or both"
            )
        if "block" in config:
            raise ValueError("settings.TOLLGATE: 'block' is an option of the view decorator only")
        # None: a blocking limiter serves an async stack too (the same settings serve WSGI and
        # ASGI), its waits for the store in the loop's executor.
        config.setdefault("limits", None)
        self.limited = _Limited(
            "pytollgate.django.RateLimitMiddleware", None if self.asynchronous else False, **config
        )

    def __call__(self, request: HttpRequest) -> Any:
        if self.asynchronous:
            return self.__acall__(request)
        limited = self.limited
        if limited.passes(request) or (limited.skip is not None and limited.skip(request)):
            return self.get_response(request)
        key = limited.key_of(request)
        if key is None or key == "":
            return _json_response(limited.no_key())
        return limited.take(request, key, self.get_response)

    async def __acall__(self, request: HttpRequest) -> Any:
        limited = self.limited
        if limited.passes(request) or (limited.skip is not None and await _maybe(limited.skip(request))):
            return await self.get_response(request)
        key = await _maybe(limited.key_of(request))
        if key is None or key == "":
            return _json_response(limited.no_key())
        return await limited.take_async(request, key, self.get_response)


async def _maybe(value: Any) -> Any:
    return (await value) if inspect.isawaitable(value) else value


@overload
def rate_limit(
    limiter: Union[RateLimiter[Name], AsyncRateLimiter[Name]],
    limits: Optional[Names[Name]] = None,
    **options: Unpack[ViewOptions],
) -> Callable[[View], View]: ...
@overload
def rate_limit(
    limiter: Union[tollgate_client.RateLimiter, tollgate_client.AsyncRateLimiter],
    limits: Optional[Names[str]] = None,
    **options: Unpack[ViewOptions],
) -> Callable[[View], View]: ...
def rate_limit(
    limiter: object,
    limits: Optional[Names[Any]] = None,
    *,
    key: KeySource = "ip",
    ipv6_subnet: Ipv6Subnet = DEFAULT_IPV6_SUBNET,
    skip: Optional[Callable[[HttpRequest], Any]] = None,
    handler: Optional[Callable[[HttpRequest, RateLimit], Any]] = None,
    message: Optional[RefusalMessage] = None,
    status_code: int = 429,
    standard_headers: bool = True,
    legacy_headers: bool = False,
    fail_open: bool = False,
    block: bool = True,
    concurrency: Optional[ConcurrencyRef[Any]] = None,
    concurrency_status_code: int = 429,
) -> Callable[[View], View]:
    """A view decorator: each call of the view takes ``limits`` for the request's key, as the
    middleware does. A sync view takes a ``RateLimiter``, an ``async def`` view an
    ``AsyncRateLimiter`` (a mismatch raises when the view is decorated, with the fix).

    ``key``: ``"ip"`` (``REMOTE_ADDR``), ``"global"``, ``{"header": name}``, or a function of
    the request (``async def`` for an async view too). ``skip(request)``: true lets it through
    untaken. A refusal is ``status_code`` (429) with ``message`` (text, a dict sent as JSON,
    or a function of the request and the :class:`~pytollgate.RateLimit`) or whatever
    ``handler(request, rate_limit)`` returns; with ``block=False`` the view is called anyway
    and reads ``request.rate_limit.ok`` (django-ratelimit's ``request.limited``). The
    decision is ``request.rate_limit``; ``standard_headers``, ``legacy_headers`` and
    ``fail_open`` as for the ASGI middleware.

    ``concurrency`` (a concurrency limit's name, or ``{"name", "count", "ttl"}``) holds a
    slot of it per request, from before the rate limits and the view until the response is
    made, or, for a ``StreamingHttpResponse``, until its stream ends or the server closes it
    (a client gone); refused, ``concurrency_status_code`` (429, or 503) with
    ``Retry-After``. ``limits`` may be left out then. The middleware takes both in
    ``settings.TOLLGATE``."""

    def decorate(view: View) -> View:
        asynchronous = iscoroutinefunction(view)
        where = f"@rate_limit on {getattr(view, '__qualname__', view)!r}"
        limited = _Limited(
            where, asynchronous, limiter, limits, key, ipv6_subnet, (), skip, handler, message,
            status_code, standard_headers, legacy_headers, fail_open, block, concurrency,
            concurrency_status_code,
        )

        if asynchronous:

            @functools.wraps(view)
            async def limited_async_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                def call(request: HttpRequest) -> Any:
                    return view(request, *args, **kwargs)

                if limited.passes(request) or (limited.skip is not None and await _maybe(limited.skip(request))):
                    return await view(request, *args, **kwargs)
                key = await _maybe(limited.key_of(request))
                if key is None or key == "":
                    return _json_response(limited.no_key())
                return await limited.take_async(request, key, call)

            return limited_async_view

        @functools.wraps(view)
        def limited_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            def call(request: HttpRequest) -> Any:
                return view(request, *args, **kwargs)

            if limited.passes(request) or (limited.skip is not None and limited.skip(request)):
                return view(request, *args, **kwargs)
            key = limited.key_of(request)
            if key is None or key == "":
                return _json_response(limited.no_key())
            return limited.take(request, key, call)

        return limited_view

    return decorate
