"""Django middleware: each request takes its limits, configured in settings.

    # settings.py
    from pytollgate import RateLimiter, MINUTE
    TOLLGATE = {
        "limiter": RateLimiter("redis://127.0.0.1:6379", limits={
            "per_ip": {"kind": "token bucket", "rate": 60, "period": MINUTE},
        }),
        "limits": "per_ip",          # or a list, taken all or nothing
        "key": "ip",                 # or {"header": "x-api-key"}, "global", a function of the request
        "ipv6_subnet": 56,           # the "ip" key of an IPv6 client: its /56 (False: whole addresses)
    }
    MIDDLEWARE = ["pytollgate.django.RateLimitMiddleware", ...]

The limiter is ``pytollgate.RateLimiter`` (in-process) or ``tollgate_client.RateLimiter`` (a
server's); "ip" is ``REMOTE_ADDR`` (behind a proxy, a function that reads the proxy's header),
keyed as the ASGI middleware keys it (``pytollgate.asgi``). A request without ``REMOTE_ADDR``
(gunicorn on a unix socket) cannot be keyed by "ip": it is answered 500 with how to fix that,
said once in the log. The store's failures are 503 ``{"error": "rate limit store
unavailable", "mayHaveTaken"}``, their detail in the ``pytollgate`` logger.

The middleware never writes to the client itself: it returns a response (its own, or the
view's with its header fields), and the server sends it, or drops it if the client left.
"""

from __future__ import annotations

from typing import Any, Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from . import _middleware

__all__ = ["RateLimitMiddleware"]

#: How a Django deployment gives the middleware the client's address behind a proxy.
_FIX = "a middleware before this one that sets REMOTE_ADDR from X-Forwarded-For"


class RateLimitMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        config: dict[str, Any] = dict(getattr(settings, "TOLLGATE", {}))
        if "limiter" not in config or "limits" not in config:
            raise ValueError("settings.TOLLGATE needs a 'limiter' and its 'limits'")
        self.limiter = config["limiter"]
        self.key = _middleware.check_key(config.get("key", "ip"))
        self.ipv6_subnet = _middleware.check_ipv6_subnet(
            config.get("ipv6_subnet", _middleware.DEFAULT_IPV6_SUBNET)
        )
        self.entries = _middleware.limits_of(config["limits"])
        self.first = str(self.entries[0]["name"])
        self.failures = _middleware.Failures()
        self.setup = _middleware.Setup()

    def __call__(self, request: HttpRequest) -> HttpResponse:
        ip = request.META.get("REMOTE_ADDR") or None
        key = _middleware.key_of(self.key, request, ip, request.headers.get, self.ipv6_subnet)
        if key is None or key == "":
            if self.key == "ip":
                verdict = self.setup.no_address(self.first, _FIX)
            else:
                verdict = _middleware.missing_key(self.first)
        else:
            try:
                result = self.limiter.transaction(_middleware.calls(self.entries, key), fields=True)
            except Exception as e:  # noqa: BLE001 - any failure fails closed
                verdict = self.failures.failed(e)
            else:
                verdict = _middleware.verdict(self.entries, result)
        if verdict.passes:
            response = self.get_response(request)
        else:
            response = HttpResponse(verdict.body, status=verdict.status, content_type="application/json")
        for name, value in verdict.headers.items():
            response[name] = value
        return response
