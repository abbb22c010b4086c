"""One process of test_processes.py:
    python worker.py tollgate STORE NAME AT       200 calls at once (asyncio) at AT (epoch s)
    python worker.py limits REDIS_URL NAME AT     the same with `limits` (FixedWindowRateLimiter
                                                  on its RedisStorage), in 200 threads
Prints {"admitted": k}."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

mode, store, name, at = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
CALLS, LIMIT = 200, 50

if mode == "tollgate":
    from pytollgate import HOUR, AsyncRateLimiter

    async def main() -> int:
        limiter = AsyncRateLimiter(
            store, limits={name: {"kind": "fixed window", "rate": LIMIT, "period": HOUR, "start": 0}}
        )
        await limiter.get_server_time()  # opened before the start
        await asyncio.sleep(max(0.0, at - time.time()))
        answers = await asyncio.gather(*(limiter.limit(name, key="k") for _ in range(CALLS)))
        return sum(a.ok for a in answers)

    admitted = asyncio.run(main())
else:
    from limits import parse
    from limits.storage import RedisStorage
    from limits.strategies import FixedWindowRateLimiter

    peer = FixedWindowRateLimiter(RedisStorage(store))
    item = parse(f"{LIMIT}/hour")
    results: list[bool] = []
    lock = threading.Lock()

    def hit() -> None:
        ok = peer.hit(item, name, "k")
        with lock:
            results.append(ok)

    threads = [threading.Thread(target=hit) for _ in range(CALLS)]
    time.sleep(max(0.0, at - time.time()))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    admitted = sum(results)
print(json.dumps({"admitted": admitted}))
