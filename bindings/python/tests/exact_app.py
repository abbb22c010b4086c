"""The app of test_routes.py's exactness test, under uvicorn with several workers: one limit
of EXACT_RATE a day on EXACT_STORE, keyed by x-user (a day: a window of its own alignment
ends inside a burst of a few seconds about never, where a minute's did now and then, and the
burst then saw two windows' worth)."""

import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from pytollgate import AsyncRateLimiter
from pytollgate.asgi import RateLimitMiddleware

name = os.environ["EXACT_NAME"]
limiter = AsyncRateLimiter(os.environ["EXACT_STORE"], limits={name: f"{os.environ['EXACT_RATE']}/d"}, store_deadline=2.0)
app = FastAPI()
app.add_middleware(RateLimitMiddleware, limiter=limiter, limits=name, key={"header": "x-user"})


@app.get("/", response_class=PlainTextResponse)
async def hello() -> str:
    return "hello"
