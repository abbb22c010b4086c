"""pytollgate in-process against `limits` (under slowapi and Flask-Limiter), in one run, in
interleaved rounds (pytollgate, limits, pytollgate, ...), hits/s as the median of the rounds:

  memory: RateLimiter("memory").limit(name, key) vs FixedWindowRateLimiter(MemoryStorage).hit,
          one call after another over 1,000 keys
  redis:  the same on one Redis (TOLLGATE_REDIS_URL, default 127.0.0.1:6379) vs
          FixedWindowRateLimiter(RedisStorage), one call after another (blocking)
  mw mem, mw redis: a middleware's decision with what its header fields need: pytollgate's
          middleware core (the Gate every pytollgate middleware decides through: the
          decision, the RateLimit given to handlers, the RateLimit-Policy and RateLimit
          values) vs what slowapi does with headers_enabled, limits' hit then
          get_window_stats

    VIRTUAL_ENV=... maturin develop --release -m bindings/python/Cargo.toml
    python bench.py [ROUNDS] [SCALE]

Nothing is refused on either side (the limits are far above what a run takes).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable, Dict, List

from limits import RateLimitItemPerHour
from limits.storage import MemoryStorage, RedisStorage
from limits.strategies import FixedWindowRateLimiter

from pytollgate import HOUR, RateLimiter
from pytollgate._middleware import Gate

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
SCALE = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
REDIS = os.environ.get("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379")
TAG = f"{os.getpid()}x{int(time.time())}"
KEYS = [f"user{i}" for i in range(1_000)]
BIG = {"kind": "fixed window", "rate": 10**12, "period": HOUR}
ITEM = RateLimitItemPerHour(10**12)


def measure(call: Callable[[str], object], calls: int) -> float:
    started = time.perf_counter()
    for i in range(calls):
        call(KEYS[i % 1_000])
    return calls / (time.perf_counter() - started)


def compare(label: str, contenders: Dict[str, Callable[[str], object]], calls: int) -> None:
    results: Dict[str, List[float]] = {name: [] for name in contenders}
    for call in contenders.values():
        measure(call, max(1, calls // 5))  # warm-up
    for _ in range(ROUNDS):
        for name, call in contenders.items():
            results[name].append(measure(call, calls))
    ours, theirs = contenders
    a, b = statistics.median(results[ours]), statistics.median(results[theirs])
    rounds = lambda xs: " ".join(f"{x / 1e3:.0f}" for x in xs)  # noqa: E731
    print(
        f"{label:<9} {ours} {a:,.0f}/s, {theirs} {b:,.0f}/s: {a / b:.2f}x"
        f"  (rounds: {rounds(results[ours])} k vs {rounds(results[theirs])} k)"
    )


name = f"mem{TAG}"
memory = RateLimiter("memory", limits={name: BIG})
peer = FixedWindowRateLimiter(MemoryStorage())
compare(
    "memory",
    {"pytollgate": lambda k: memory.limit(name, key=k), "limits": lambda k: peer.hit(ITEM, name, k)},
    int(200_000 * SCALE),
)

name = f"redis{TAG}"
redis = RateLimiter(REDIS, limits={name: BIG}, store_deadline=2.0)
redis_peer = FixedWindowRateLimiter(RedisStorage(REDIS))
compare(
    "redis",
    {"pytollgate": lambda k: redis.limit(name, key=k), "limits": lambda k: redis_peer.hit(ITEM, name, k)},
    int(20_000 * SCALE),
)


def with_stats(storage: FixedWindowRateLimiter, name: str) -> Callable[[str], object]:
    def call(key: str) -> object:
        return storage.hit(ITEM, name, key), storage.get_window_stats(ITEM, name, key)

    return call


name = f"mwmem{TAG}"
memory = RateLimiter("memory", limits={name: BIG})
gate = Gate(memory, name, asynchronous=False, fail_open=False, where="bench")
compare("mw mem", {"pytollgate": gate.decide, "limits": with_stats(peer, name)}, int(200_000 * SCALE))

name = f"mwredis{TAG}"
redis = RateLimiter(REDIS, limits={name: BIG}, store_deadline=2.0)
gate = Gate(redis, name, asynchronous=False, fail_open=False, where="bench")
compare("mw redis", {"pytollgate": gate.decide, "limits": with_stats(redis_peer, name)}, int(20_000 * SCALE))
