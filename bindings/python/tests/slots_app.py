"""The FastAPI app of test_middleware_slots.py under gunicorn with uvicorn's workers, as it is
deployed: each worker process imports this and makes its own AsyncRateLimiter on Redis
(SLOTS_STORE), whose concurrency limit SLOTS_NAME (2 at once) the workers share. ``/slow``
answers after SLOTS_HOLD seconds; ``/stream`` streams until its client leaves."""

from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, StreamingResponse

from pytollgate import AsyncRateLimiter
from pytollgate.asgi import RateLimitMiddleware

NAME = os.environ["SLOTS_NAME"]
HOLD = float(os.environ.get("SLOTS_HOLD", "1"))
limiter = AsyncRateLimiter(
    os.environ["SLOTS_STORE"], limits={NAME: {"kind": "concurrency", "max": 2, "ttl": "30s"}}, store_deadline=2.0
)
app = FastAPI()
app.add_middleware(RateLimitMiddleware, limiter=limiter, concurrency=NAME, key="global")


@app.get("/slow", response_class=PlainTextResponse)
async def slow() -> str:
    await asyncio.sleep(HOLD)
    return f"done by {os.getpid()}"


@app.get("/stream")
async def stream() -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"chunk 0\n"
        while True:
            await asyncio.sleep(0.01)
            yield b"chunk\n"

    return StreamingResponse(chunks())
