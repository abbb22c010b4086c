"""How the native module hands an asyncio call its answer: on the event loop's own thread
(``loop.call_soon_threadsafe``), unless the caller stopped waiting."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, TypeVar

T = TypeVar("T")


def settle(future: asyncio.Future[Any], ok: bool, value: object) -> None:
    if future.done():  # cancelled meanwhile
        return
    if ok:
        future.set_result(value)
    else:
        assert isinstance(value, BaseException)
        future.set_exception(value)


def outcome(pending: concurrent.futures.Future[T]) -> asyncio.Future[T]:
    """An asyncio future of the running loop with ``pending``'s result, which another thread
    sets. Cancelling it leaves ``pending`` (and the other loops waiting for it) alone; a loop
    closed before it comes is not told."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def done(pending: concurrent.futures.Future[T]) -> None:
        try:
            loop.call_soon_threadsafe(settle, future, True, pending.result())
        except RuntimeError:
            pass  # the loop is closed: no one waits

    pending.add_done_callback(done)
    return future
