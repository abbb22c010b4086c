"""The app of test_routes.py's exactness test, under uvicorn with several workers: one limit
of EXACT_RATE a minute on EXACT_STORE, keyed by x-user."""

import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from pytollgate import AsyncRateLimiter
from pytollgate.asgi import RateLimitMiddleware

name = os.environ["EXACT_NAME"]
limiter = AsyncRateLimiter(os.environ["EXACT_STORE"], limits={name: f"{os.environ['EXACT_RATE']}/m"}, store_deadline=2.0)
app = FastAPI()
app.add_middleware(RateLimitMiddleware, limiter=limiter, limits=name, key={"header": "x-user"})


@app.get("/", response_class=PlainTextResponse)
async def hello() -> str:
    return "hello"
