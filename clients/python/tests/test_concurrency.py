"""Many calls at once admit exactly what the limit holds."""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor

from servers import Server

from tollgate_client import DAY, AsyncRateLimiter, RateLimiter

# 50 at once, then one more every 1,728 s: nothing flows back during a test.
BURST = {"kind": "token bucket", "rate": 50, "period": DAY, "capacity": 50}


async def test_200_concurrent_calls_admit_exactly_50(server: Server) -> None:
    key = uuid.uuid4().hex
    async with AsyncRateLimiter(server.url, limits={"burst": BURST}) as limiter:
        decisions = await asyncio.gather(*(limiter.limit("burst", key=key) for _ in range(200)))
        assert sum(d.ok for d in decisions) == 50
        refused = [d for d in decisions if not d.ok]
        assert len(refused) == 150
        # Each refusal waits for the one token it asked for: 1,728,000 ms less what came
        # back since the first take (well under a token).
        assert all(DAY / 50 - 60_000 < (d.retry_after or 0) <= DAY / 50 for d in refused)
        reading = await limiter.get_value("burst", key=key)
        assert 0 <= reading.value < 0.01


def test_200_calls_from_16_threads_admit_exactly_50(server: Server) -> None:
    key = uuid.uuid4().hex
    with RateLimiter(server.url, limits={"burst": BURST}) as limiter:
        with ThreadPoolExecutor(16) as pool:
            decisions = list(pool.map(lambda _: limiter.limit("burst", key=key), range(200)))
        assert sum(d.ok for d in decisions) == 50
