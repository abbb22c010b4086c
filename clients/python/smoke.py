"""Smoke test of an installed tollgate-client against a running server.

    python smoke.py http://127.0.0.1:8787 [TOKEN]

Uses a fixed window sent inline (so it needs no limit defined on the server) and a fresh
key. Prints what it does; exits 1 on any surprise, 2 on a usage error.
"""

from __future__ import annotations

import math
import sys
import uuid

from tollgate_client import HOUR, RateLimiter, TollgateError


def main(argv: list) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    url, token = argv[1], (argv[2] if len(argv) > 2 else None)
    key = "smoke-" + uuid.uuid4().hex
    surprises = []

    def expect(what: str, condition: bool) -> None:
        print(("ok      " if condition else "SURPRISE") + "  " + what)
        if not condition:
            surprises.append(what)

    try:
        with RateLimiter(url, token=token, timeout=5.0) as limiter:
            now = limiter.get_server_time()
            expect(f"get_server_time() = {now:.3f}", now > 1.6e12)
            start = float(math.floor(now) - 1000)  # a window that began 1 s ago
            config = {"kind": "fixed window", "rate": 2, "period": HOUR, "start": start}
            checked = limiter.check("smoke", key=key, config=config)
            expect(f"check -> {checked}", checked.ok and checked.retry_after is None)
            first = limiter.limit("smoke", key=key, config=config)
            second = limiter.limit("smoke", key=key, config=config)
            third = limiter.limit("smoke", key=key, config=config)
            expect(f"limit x2 -> {first}, {second}", first.ok and second.ok)
            wait = third.retry_after
            expect(
                f"limit #3 -> {third}",
                not third.ok and wait is not None and 0 < wait <= start + HOUR - now,
            )
            reading = limiter.get_value("smoke", key=key, config=config)
            expect(
                f"get_value -> value={reading.value} ts={reading.ts} shard={reading.shard}",
                (reading.value, reading.ts, reading.shard) == (0, start, 0)
                and reading.config.get("start") == start,
            )
            limiter.reset("smoke", key=key)
            full = limiter.get_value("smoke", key=key, config=config).value
            expect(f"reset -> value={full}", full == 2)
    except TollgateError as e:
        print(f"SURPRISE  {e!r}")
        return 1
    print("smoke: " + ("all good" if not surprises else f"{len(surprises)} surprise(s)"))
    return 1 if surprises else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
