"""Every operation against the memory store, with exact numbers, on both clients."""

from __future__ import annotations

import time
from typing import Any

import scenarios
from conftest import open_client
from servers import Server

from tollgate_client import DAY, HOUR, MINUTE, SECOND, Decision


async def test_constants() -> None:
    assert (SECOND, MINUTE, HOUR, DAY) == (1000, 60_000, 3_600_000, 86_400_000)


async def test_token_bucket_capacity_three(client: Any, key: str) -> None:
    await scenarios.token_bucket_capacity_three(client, key)


async def test_value_after_two_of_three(client: Any, key: str) -> None:
    await scenarios.value_after_two_of_three(client, key)


async def test_fixed_window_limit_reserve_check_value_reset(client: Any, key: str) -> None:
    await scenarios.fixed_window_exact(client, key)


async def test_adjust_settles_after_the_work(client: Any, key: str) -> None:
    await scenarios.adjust_settles_after_the_work(client, key)


async def test_transaction_all_or_nothing(client: Any, key: str) -> None:
    await scenarios.transaction_all_or_nothing(client, key)


async def test_check_takes_nothing(client: Any, key: str) -> None:
    await scenarios.check_takes_nothing(client, key)


async def test_server_time(client: Any) -> None:
    local = time.time() * 1000
    first = await client.get_server_time()
    second = await client.get_server_time()
    assert isinstance(first, float)
    assert abs(first - local) < 5_000  # the same machine's clock
    assert first <= second


async def test_server_config(client: Any) -> None:
    config = await client.get_config()
    assert config["sendMessage"] == {
        "kind": "token bucket",
        "rate": 10,
        "period": 60000,
        "capacity": 3,
        "shards": 1,
    }
    assert config["daily"]["period"] == DAY


async def test_configs_in_code_and_server_defined_together(
    flavour: str, server: Server, key: str
) -> None:
    limits = {
        # snake_case is sent as camelCase
        "codeLimit": {"kind": "token bucket", "rate": 5, "period": MINUTE, "capacity": 2,
                      "max_reserved": 1},
    }
    async with open_client(flavour, server.url, limits=limits) as c:
        assert [(await c.limit("codeLimit", key=key)).ok for _ in range(3)] == [
            True, True, False]
        # maxReserved 1: one more may be booked ahead, two may not.
        booked = await c.limit("codeLimit", key=key, reserve=True)
        assert booked.ok and 0 < booked.retry_after <= 2 * 12_000
        assert not (await c.limit("codeLimit", key=key, reserve=True)).ok
        # Server-defined names are sent without a config, in the same limiter.
        assert [(await c.limit("sendMessage", key=key)).ok for _ in range(4)] == [
            True, True, True, False]
        code = await c.get_value("codeLimit", key=key)
        assert code.config == {"kind": "token bucket", "rate": 5, "period": 60000,
                               "capacity": 2, "maxReserved": 1, "shards": 1}
        assert -1 <= code.value < -1 + 0.01
        defined = await c.get_value("sendMessage", key=key)
        assert defined.config["capacity"] == 3
        # A config passed to the call wins over the one in code.
        other = {"kind": "fixed window", "rate": 7, "period": HOUR, "start": 0}
        assert (await c.get_value("codeLimit", key=key + "x", config=other)).config["rate"] == 7
        assert (await c.limit("daily", key=key)) == Decision(True, None)
        assert (await c.get_value("daily", key=key)).value == 4


async def test_key_is_optional(client: Any) -> None:
    # No key: the limit's global value (still isolated from keyed ones).
    name = "global" + str(time.monotonic_ns())
    config = {"kind": "fixed window", "rate": 2, "period": HOUR, "start": 0}
    assert (await client.limit(name, config=config)).ok
    assert (await client.get_value(name, config=config)).value == 1
    assert (await client.get_value(name, key="k", config=config)).value == 2
    await client.reset(name)
    assert (await client.get_value(name, config=config)).value == 2


async def test_sample_shards(client: Any, key: str) -> None:
    config = {"kind": "token bucket", "rate": 100, "period": DAY, "capacity": 100, "shards": 4}
    reading = await client.get_value("sharded", key=key, sample_shards=4, config=config)
    # Sharded: the estimate of the whole limit, at the server's now.
    assert reading.value == 100
    assert reading.ts > 0
    assert 0 <= reading.shard < 4
    assert reading.config["shards"] == 4
