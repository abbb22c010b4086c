"""Scenarios with exact numbers, run against any store and either client.

Where the algebra depends on when the server ran a request, the server's own clock
(`get_server_time`) read before and after brackets that instant, so each expected number is
an interval whose width is the time the calls took, and nothing else:

- token bucket, capacity 3, 10 per minute (a token every 6,000 ms): three takes from a full
  bucket, the fourth refused with retryAfter = 6000 - (t4 - t1), t1 and t4 the first and
  fourth take: so 6000 - (after - before) <= retryAfter <= 6000;
- fixed window aligned by `start` (a window began 1 s before the test): the refusal's wait
  is exactly the end of the window minus the request's time, and the value is exact.
"""

from __future__ import annotations

import math
from typing import Any

from tollgate_client import (
    HOUR,
    MINUTE,
    Adjusted,
    Decision,
    LimitCall,
    RateLimitError,
    TollgateError,
)

# Floating-point slack for numbers of about 1e12 ms (an ulp there is 2.4e-4 ms).
EPS = 1e-3


def window_config(start: float, rate: float = 3, period: float = HOUR) -> dict:
    return {"kind": "fixed window", "rate": rate, "period": period, "start": start}


async def window_start(c: Any) -> float:
    """A window start 1 s ago, in whole ms, by the server's clock."""
    return float(math.floor(await c.get_server_time()) - 1000)


async def token_bucket_capacity_three(c: Any, key: str) -> None:
    """sendMessage (server-defined): 10 per minute, capacity 3."""
    before = await c.get_server_time()
    for _ in range(3):
        assert await c.limit("sendMessage", key=key) == Decision(True, None)
    refused = await c.limit("sendMessage", key=key)
    after = await c.get_server_time()
    assert refused.ok is False
    assert 6000 - (after - before) - EPS <= refused.retry_after <= 6000 + EPS
    # A refusal took nothing: the stored state is that of the third take.
    reading = await c.get_value("sendMessage", key=key)
    assert before <= reading.ts <= after
    assert 0 <= reading.value <= (after - before) * 10 / MINUTE + EPS
    # check takes nothing either, and answers the same wait (less the time since).
    checked = await c.check("sendMessage", key=key)
    assert checked.ok is False
    assert 0 < checked.retry_after <= refused.retry_after + EPS
    assert await c.get_value("sendMessage", key=key) == reading


async def value_after_two_of_three(c: Any, key: str) -> None:
    fresh = await c.get_value("sendMessage", key=key)
    # No state yet: full, at ts 0, with every default of the config filled in.
    assert (fresh.value, fresh.ts, fresh.shard) == (3, 0, 0)
    assert fresh.config == {
        "kind": "token bucket",
        "rate": 10,
        "period": 60000,
        "capacity": 3,
        "shards": 1,
    }
    before = await c.get_server_time()
    assert (await c.limit("sendMessage", key=key)).ok
    assert (await c.limit("sendMessage", key=key)).ok
    after = await c.get_server_time()
    reading = await c.get_value("sendMessage", key=key)
    # 1 left, plus what flowed back between the two takes (10 per 60,000 ms).
    assert 1 <= reading.value <= 1 + (after - before) * 10 / MINUTE + EPS
    assert before <= reading.ts <= after
    assert reading.shard == 0


async def fixed_window_exact(c: Any, key: str) -> None:
    """An inline fixed window of 3 per hour whose window began 1 s ago."""
    start = await window_start(c)
    config = window_config(start)
    end = start + HOUR
    for _ in range(3):
        assert await c.limit("fw", key=key, config=config) == Decision(True, None)
    reading = await c.get_value("fw", key=key, config=config)
    assert (reading.value, reading.ts, reading.shard) == (0, start, 0)
    assert reading.config == {
        "kind": "fixed window",
        "rate": 3,
        "period": HOUR,
        "capacity": 3,
        "shards": 1,
        "start": start,
    }
    before = await c.get_server_time()
    refused = await c.limit("fw", key=key, config=config)
    after = await c.get_server_time()
    # Refused until the window ends: exactly `end - now`, now within [before, after].
    assert refused.ok is False
    assert end - after - EPS <= refused.retry_after <= end - before + EPS

    # Reservations book ahead: 2 more need the next window, 4 more the one after.
    before = await c.get_server_time()
    two = await c.limit("fw", key=key, count=2, reserve=True, config=config)
    four = await c.limit("fw", key=key, count=4, reserve=True, config=config)
    one = await c.check("fw", key=key, count=1, config=config)
    after = await c.get_server_time()
    assert two.ok and four.ok and not one.ok
    assert end - after - EPS <= two.retry_after <= end - before + EPS
    assert end + HOUR - after - EPS <= four.retry_after <= end + HOUR - before + EPS
    # -6 booked: a 7th token is there when three more windows have started.
    assert end + 2 * HOUR - after - EPS <= one.retry_after <= end + 2 * HOUR - before + EPS
    reading = await c.get_value("fw", key=key, config=config)
    assert (reading.value, reading.ts) == (-6, start)

    # Reset: the key is fresh again (full, no state).
    assert await c.reset("fw", key=key) is None
    reading = await c.get_value("fw", key=key, config=config)
    assert (reading.value, reading.ts) == (3, 0)
    assert await c.limit("fw", key=key, count=3, config=config) == Decision(True, None)
    assert (await c.get_value("fw", key=key, config=config)).value == 0


async def adjust_settles_after_the_work(c: Any, key: str) -> None:
    """adjust (SPEC §4): a cost settled after the work, signed, never refused, never above
    capacity; a debt waits for the next window."""
    start = await window_start(c)
    config = window_config(start)  # 3 an hour, the window began 1 s ago
    assert await c.limit("fw", key=key, count=2, config=config) == Decision(True, None)
    assert await c.adjust("fw", key=key, count=-1, config=config) == Adjusted(2, None)
    before = await c.get_server_time()
    debt = await c.adjust("fw", key=key, count=4, config=config)
    after = await c.get_server_time()
    assert debt.value == -2
    assert debt.retry_after is not None
    assert start + HOUR - after - EPS <= debt.retry_after <= start + HOUR - before + EPS
    assert (await c.limit("fw", key=key, config=config)).ok is False, "the debt comes first"
    assert await c.adjust("fw", key=key, count=-10, config=config) == Adjusted(3, None)
    try:
        await c.adjust("fw", key=key, count=float("nan"), config=config)
    except ValueError as e:
        assert "finite" in str(e)
    else:
        raise AssertionError("a NaN count was sent")
    assert (await c.get_value("fw", key=key, config=config)).value == 3


async def transaction_all_or_nothing(c: Any, key: str) -> None:
    start = await window_start(c)
    a, b = window_config(start, rate=3), window_config(start, rate=1)
    end = start + HOUR
    both = [
        LimitCall("txA", key=key, config=a),  # a dataclass
        {"name": "txB", "key": key, "count": 1, "config": b},  # a dict
    ]
    first = await c.transaction(both)
    assert (first.ok, first.retry_after) == (True, None)
    assert first.results == [Decision(True, None), Decision(True, None)]

    before = await c.get_server_time()
    second = await c.transaction(both)
    after = await c.get_server_time()
    # txA alone would be granted, txB is empty: neither takes.
    assert second.ok is False
    assert second.results[0] == Decision(True, None)
    assert second.results[1].ok is False
    assert end - after - EPS <= second.results[1].retry_after <= end - before + EPS
    assert second.retry_after == second.results[1].retry_after
    assert (await c.get_value("txA", key=key, config=a)).value == 2
    assert (await c.get_value("txB", key=key, config=b)).value == 0

    # Snake-case keys are sent in camelCase (max_reserved -> maxReserved); a server-defined
    # limit (no config) and an inline one in one transaction.
    mixed = await c.transaction(
        [
            {"name": "sendMessage", "key": key, "count": 2, "reserve": False},
            {"name": "txA", "key": key, "count": 2, "config": {**a, "max_reserved": 0}},
        ]
    )
    assert mixed.ok and [r.ok for r in mixed.results] == [True, True]
    assert (await c.get_value("txA", key=key, config=a)).value == 0
    assert (await c.get_value("sendMessage", key=key)).value == 1

    # throws: the refusal is a RateLimitError naming the limit that refused.
    try:
        await c.transaction([LimitCall("txA", key=key, config=a)], throws=True)
    except RateLimitError as e:
        assert (e.kind, e.name) == ("RateLimited", "txA")
        assert 0 < e.retry_after <= HOUR
    else:
        raise AssertionError("no RateLimitError")
    assert (await c.get_value("txA", key=key, config=a)).value == 0


async def check_takes_nothing(c: Any, key: str) -> None:
    for _ in range(5):
        assert await c.check("sendMessage", key=key, count=3) == Decision(True, None)
    assert (await c.get_value("sendMessage", key=key)).ts == 0
    assert (await c.check("sendMessage", key=key, count=4, reserve=True)).ok


async def errors_are_tollgate_errors(c: Any, key: str) -> None:
    try:
        await c.limit("sendMessage", key=key, count=-1)
    except TollgateError as e:
        assert e.status == 400 and "count" in e.message
    else:
        raise AssertionError("no TollgateError")
