"""Django middleware: each request takes its limits, configured in settings.

    # settings.py
    from pytollgate import RateLimiter, MINUTE
    TOLLGATE = {
        "limiter": RateLimiter("redis://127.0.0.1:6379", limits={
            "per_ip": {"kind": "token bucket", "rate": 60, "period": MINUTE},
        }),
        "limits": "per_ip",          # or a list, taken all or nothing
        "key": "ip",                 # or {"header": "x-api-key"}, "global", a function of the request
    }
    MIDDLEWARE = ["pytollgate.django.RateLimitMiddleware", ...]

The limiter is ``pytollgate.RateLimiter`` (in-process) or ``tollgate_client.RateLimiter`` (a
server's); "ip" is ``REMOTE_ADDR`` (behind a proxy, a function that reads the proxy's header).
"""

from __future__ import annotations

from typing import Any, Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from . import _middleware

__all__ = ["RateLimitMiddleware"]


class RateLimitMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        config: dict[str, Any] = dict(getattr(settings, "TOLLGATE", {}))
        if "limiter" not in config or "limits" not in config:
            raise ValueError("settings.TOLLGATE needs a 'limiter' and its 'limits'")
        self.limiter = config["limiter"]
        self.key = config.get("key", "ip")
        self.entries = _middleware.limits_of(config["limits"])

    def __call__(self, request: HttpRequest) -> HttpResponse:
        ip = request.META.get("REMOTE_ADDR") or None
        key = _middleware.key_of(self.key, request, ip, request.headers.get)
        if key is None or key == "":
            verdict = _middleware.missing_key(self.key, str(self.entries[0]["name"]))
        else:
            try:
                result = self.limiter.transaction(_middleware.calls(self.entries, key), fields=True)
            except Exception as e:  # noqa: BLE001 - any failure fails closed
                verdict = _middleware.failed(e)
            else:
                verdict = _middleware.verdict(self.entries, result)
        if verdict.passes:
            response = self.get_response(request)
        else:
            response = HttpResponse(verdict.body, status=verdict.status, content_type="application/json")
        for name, value in verdict.headers.items():
            response[name] = value
        return response
