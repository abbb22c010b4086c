"""How the native module hands an asyncio call its answer: on the event loop's own thread
(``loop.call_soon_threadsafe``), unless the caller stopped waiting."""

from __future__ import annotations

import asyncio


def settle(future: asyncio.Future[object], ok: bool, value: object) -> None:
    if future.done():  # cancelled meanwhile
        return
    if ok:
        future.set_result(value)
    else:
        assert isinstance(value, BaseException)
        future.set_exception(value)
