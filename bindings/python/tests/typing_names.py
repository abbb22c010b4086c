"""Checked by mypy in test_routes.py, never run: each line marked ``# error`` must be an
error (a limit name that the limiter annotated with a Literal of its names does not
define), and no other line."""

from typing import Literal

from fastapi import FastAPI

import tollgate_client
from pytollgate import AsyncRateLimiter, RateLimiter
from pytollgate.asgi import RateLimitMiddleware
from pytollgate.django import rate_limit as view_limit
from pytollgate.fastapi import rate_limit, rate_limited

Limits = Literal["perUser", "global"]
limiter: AsyncRateLimiter[Limits] = AsyncRateLimiter("memory", limits={"perUser": "10/m", "global": "100/m"})
blocking: RateLimiter[Limits] = RateLimiter("memory", limits={"perUser": "10/m", "global": "100/m"})
untyped = AsyncRateLimiter("memory", limits={"perUser": "10/m"})
server = tollgate_client.AsyncRateLimiter("http://127.0.0.1:1")

rate_limit(limiter, "perUser")
rate_limit(limiter, ["perUser", "global"])
rate_limit(limiter, [{"name": "perUser"}, {"name": "global", "count": 2}])
rate_limit(limiter, ["perUser", {"name": "global", "count": 2}])
rate_limit(limiter, ("perUser", "global"))
rate_limit(limiter, "perUsr")  # error
rate_limit(limiter, ["perUser", "globl"])  # error
rate_limit(limiter, [{"name": "perUser"}, {"name": "globl"}])  # error
rate_limited(limiter, "perUsr", key="ip")  # error
view_limit(blocking, "perUser", block=False)
view_limit(blocking, "perUsr")  # error
RateLimitMiddleware(FastAPI(), limiter=limiter, limits="global", exempt=["/docs"])
RateLimitMiddleware(FastAPI(), limiter=limiter, limits="globl")  # error
# Without a Literal, and over a server's door, any name: checked when the middleware is made.
rate_limit(untyped, "anything")
rate_limit(server, ["anything", {"name": "else", "count": 2}])
view_limit(tollgate_client.RateLimiter("http://127.0.0.1:1"), "anything")
