"""Durations as the server writes them, in every parameter that is one (a limit's period,
the client's timeout, the algebra's configs), and a period that is surely a mistake refused;
arguments of the wrong type refused as the server refuses them, nothing taken."""

from __future__ import annotations

import time
from typing import Any

import pytest
from conftest import open_client
from servers import Server, silent_server

from tollgate_client import MINUTE, RateLimiter, TollgateError, calculate_rate_limit


async def test_a_timeout_with_its_unit(flavour: str) -> None:
    with silent_server() as (url, _):
        async with open_client(flavour, url, timeout="200ms") as c:
            start = time.monotonic()
            with pytest.raises(TollgateError, match="timed out"):
                await c.check("sendMessage", key="k")
            assert 0.15 < time.monotonic() - start < 2
    for bad in ("soon", "1e3ms", "10"):
        with pytest.raises(ValueError, match="timeout: .* is not a duration"):
            RateLimiter("http://127.0.0.1:1", timeout=bad)


async def test_a_period_with_its_unit_is_sent_as_written(flavour: str, server: Server, key: str) -> None:
    async with open_client(flavour, server.url) as c:
        config = {"kind": "token bucket", "rate": 2, "period": "1m"}
        assert (await c.limit("codeInline", key=key, count=2, config=config)).ok
        reading = await c.get_value("codeInline", key=key, config=config)
        assert reading.config["period"] == 60_000 and reading.value == 0


def test_a_bare_period_under_a_second_is_refused_before_anything_is_sent() -> None:
    """``{"rate": 10, "period": 60}``: 60 ms, surely meant as a minute."""
    with pytest.raises(ValueError, match=r'period is 60, a number of milliseconds.*"60s"'):
        RateLimiter("http://127.0.0.1:1", limits={"x": {"kind": "token bucket", "rate": 10, "period": 60}})
    limiter = RateLimiter("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="period is 999"):
        limiter.limit("y", config={"kind": "fixed window", "rate": 1, "period": 999})
    with pytest.raises(ValueError, match="period is 1"):
        limiter.transaction([{"name": "y", "config": {"kind": "fixed window", "rate": 1, "period": 1}}])
    RateLimiter("http://127.0.0.1:1", limits={"x": {"kind": "token bucket", "rate": 10, "period": "60ms"}})


def test_the_algebra_reads_a_period_with_its_unit() -> None:
    config: Any = {"kind": "token bucket", "rate": 10, "period": MINUTE, "capacity": 10}
    written = {**config, "period": "1m"}
    now = 1.7e12
    state = {"value": 0.0, "ts": now}
    assert calculate_rate_limit(state, written, now) == calculate_rate_limit(state, config, now)


@pytest.mark.parametrize(
    "bad", [{"reserve": "yes"}, {"count": True}, {"key": "\ud800"}], ids=["reserve", "count", "surrogate"]
)
async def test_arguments_of_the_wrong_type_are_refused(flavour: str, server: Server, key: str, bad: Any) -> None:
    arguments = {"key": key, **bad}
    async with open_client(flavour, server.url) as c:
        with pytest.raises(TollgateError) as error:
            await c.limit("sendMessage", **arguments)
        assert not error.value.may_have_taken
        with pytest.raises(TollgateError):
            await c.transaction([{"name": "sendMessage", **arguments}])
        assert (await c.get_value("sendMessage", key=key)).ts == 0  # nothing taken
