"""What an event loop sees of the asyncio limiter: a call answered at once with a refusal or
an error still lets the loop run; a loop closed with calls in flight says nothing per call;
a cancelled await's tokens are taken all the same (the guide says so)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest
from conftest import fresh, networked, ticks_during
from network import free_port

from pytollgate import HOUR, AsyncRateLimiter, TollgateError

WINDOW = {"kind": "fixed window", "rate": 2, "period": HOUR, "start": 0}


async def test_a_retry_loop_on_the_memory_store_lets_the_loop_run() -> None:
    """A retry loop that calls again at once after a refusal (answered where it is asked,
    on memory): other tasks run between its calls (before the fix none ran: 2.1 s frozen)."""
    limiter = AsyncRateLimiter("memory", limits={"x": WINDOW})

    async def retry() -> int:
        refused = 0
        while refused < 200:
            if not (await limiter.limit("x", key="k")).ok:
                refused += 1
        return refused

    assert await ticks_during(asyncio.ensure_future(retry())) >= 100


async def test_a_retry_loop_on_a_store_that_is_down_lets_the_loop_run() -> None:
    """The same on errors answered at once: a store down, its breaker open."""
    limiter = AsyncRateLimiter(f"redis://127.0.0.1:{free_port()}", limits={"x": WINDOW}, store_deadline=0.2)
    for _ in range(5):  # the first failures open the breaker: from then on, errors at once
        with pytest.raises(TollgateError):
            await limiter.limit("x", key="k")

    async def retry() -> int:
        for _ in range(200):
            try:
                await limiter.limit("x", key="k")
            except TollgateError:
                pass
        return 0

    assert await ticks_during(asyncio.ensure_future(retry())) >= 100


def test_a_loop_closed_with_calls_in_flight_says_nothing_per_call() -> None:
    """asyncio.run ends with 50 calls waiting for a store that answers late (a Redis that
    never answers, within the deadline): their answers come to a closed loop, with no
    traceback each (before the fix: one "Exception ignored" and its traceback per call)."""
    port = free_port()
    script = textwrap.dedent(
        f"""
        import asyncio, socket, time
        from pytollgate import AsyncRateLimiter, HOUR
        silent = socket.socket(); silent.bind(("127.0.0.1", {port})); silent.listen(64)
        limiter = AsyncRateLimiter("redis://127.0.0.1:{port}", limits={{"x": {{"kind": "fixed window", "rate": 2, "period": HOUR}}}}, store_deadline=0.3)

        async def main():
            for _ in range(50):
                asyncio.ensure_future(limiter.limit("x", key="k"))
            await asyncio.sleep(0.05)  # sent; the loop ends with them in flight

        asyncio.run(main())
        time.sleep(1.0)  # their answers (errors, past the deadline) come now
        print("done")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr


async def test_a_cancelled_await_still_takes_its_tokens() -> None:
    """As the guide says: a call sent to the store is decided there, whether its caller
    still waits or not (as a request sent to a server is)."""
    url = networked("TOLLGATE_REDIS_URL")
    if url is None:
        pytest.skip("no TOLLGATE_REDIS_URL")
    name = fresh("cancelled")
    limiter = AsyncRateLimiter(url, limits={name: WINDOW}, store_deadline=2.0)
    await limiter.get_server_time()  # opened
    call = asyncio.ensure_future(limiter.limit(name, key="k", count=2))
    await asyncio.sleep(0)
    call.cancel()
    for _ in range(100):
        if (await limiter.get_value(name, key="k")).value == 0:
            break
        await asyncio.sleep(0.02)
    assert (await limiter.get_value(name, key="k")).value == 0
