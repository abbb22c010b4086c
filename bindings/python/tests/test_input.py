"""What a caller can get wrong: each refused with a clear error, nothing taken, the same on
the direct path (limit and check of a defined limit), the JSON path and a transaction; and
durations in their documented units, or with the unit written out."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Dict

import pytest

from pytollgate import HOUR, MINUTE, AsyncRateLimiter, RateLimiter, TollgateError, _common

WINDOW = {"kind": "fixed window", "rate": 10, "period": HOUR, "start": 0}


def calls(limiter: RateLimiter) -> Dict[str, Callable[..., Any]]:
    """The three ways in, each taking ``key`` and ``count``/``reserve``."""
    return {
        "direct": lambda **kw: limiter.limit("x", **kw),
        "json": lambda **kw: limiter.limit("inline", config=WINDOW, **kw),
        "transaction": lambda **kw: limiter.transaction([{"name": "x", **kw}]),
    }


@pytest.mark.parametrize(
    "bad",
    [
        {"key": "\ud800"},  # a lone surrogate: not Unicode (UnicodeEncodeError before)
        {"key": "k", "count": 10**400},  # no float holds it (OverflowError before)
        {"key": "k", "count": True},  # a bool is no count (taken as 1 before, directly)
        {"key": "k", "reserve": "yes"},  # not True (taken as True before, directly)
    ],
    ids=["lone surrogate", "huge count", "count=True", "reserve='yes'"],
)
def test_bad_arguments_are_a_tollgate_error_taking_nothing(bad: Dict[str, Any]) -> None:
    limiter = RateLimiter("memory", limits={"x": WINDOW})
    for way, call in calls(limiter).items():
        with pytest.raises(TollgateError) as error:
            call(**bad)
        assert not error.value.may_have_taken, way
    assert limiter.get_value("x", key="k").ts == 0  # nothing was ever taken
    assert limiter.limit("x", key="k", count=10).ok


async def test_bad_arguments_are_a_tollgate_error_in_asyncio() -> None:
    limiter = AsyncRateLimiter("memory", limits={"x": WINDOW})
    for bad in ({"key": "\ud800"}, {"key": "k", "count": 10**400}, {"key": "k", "count": True}, {"key": "k", "reserve": "yes"}):
        with pytest.raises(TollgateError):
            await limiter.limit("x", **bad)
    assert (await limiter.limit("x", key="k", count=10)).ok


def test_fail_open_is_a_list_of_names_not_a_string() -> None:
    limits = {"x": WINDOW, "y": WINDOW}
    with pytest.raises(TypeError, match="fail_open is a list of limit names"):
        RateLimiter("memory", limits=limits, fail_open="x")
    with pytest.raises(TypeError, match="leases is a dict"):
        RateLimiter("memory", limits=limits, leases="x")  # type: ignore[arg-type]
    RateLimiter("memory", limits=limits, fail_open=["x"])  # a list (or any iterable of names)


def test_a_transaction_of_thousands_of_limits_is_not_held_to_the_http_body_cap() -> None:
    """In-process, a body is the application's own: 3,000 limits (a 130 KB body, over the
    server's 64 KB) are one transaction."""
    limiter = RateLimiter("memory", limits={"per_user_send": WINDOW})
    limits = [{"name": "per_user_send", "key": f"user-{i}"} for i in range(3_000)]
    assert len(json.dumps({"limits": limits})) > 64 * 1024
    result = limiter.transaction(limits)
    assert result.ok and len(result.results) == 3_000
    assert limiter.get_value("per_user_send", key="user-2999").value == 9


# Units.


def test_a_period_written_as_a_bare_number_under_a_second_is_refused() -> None:
    """``{"rate": 10, "period": 60}`` meant a minute and got 60 ms (180 admitted in a
    second): refused, saying how to write either."""
    with pytest.raises(ValueError, match=r'period is 60, a number of milliseconds.*"60s".*"60ms"'):
        RateLimiter("memory", limits={"x": {"kind": "token bucket", "rate": 10, "period": 60}})
    with pytest.raises(ValueError, match="period is 0.5"):
        RateLimiter("memory").limit("y", key="k", config={"kind": "token bucket", "rate": 1, "period": 0.5})
    limiter = RateLimiter("memory", limits={
        "minute": {"kind": "token bucket", "rate": 10, "period": "1m"},
        "ms": {"kind": "token bucket", "rate": 10, "period": "60ms"},
        "number": {"kind": "token bucket", "rate": 10, "period": 60_000},
        "constant": {"kind": "token bucket", "rate": 10, "period": MINUTE},
    })
    periods = {name: config["period"] for name, config in limiter.get_config().items()}
    assert periods == {"minute": 60_000, "ms": 60, "number": 60_000, "constant": 60_000}


def test_durations_take_the_servers_strings() -> None:
    """store_deadline (seconds as a number) and a lease's term (the same) take "250ms",
    "2s", "1m"; a string that is not one is refused as the server refuses it."""
    config = json.loads(
        _common.config_json(
            "redis://127.0.0.1:6379",
            {"x": WINDOW},
            "250ms",
            None,
            {"x": {"term": "1m", "share": 0.1}},
            None,
        )
    )
    assert config["server"]["storeDeadline"] == 250
    assert config["limits"]["x"]["lease"]["term"] == 60_000
    number = json.loads(_common.config_json("memory", None, 0.25, None, None, None))
    assert number["server"]["storeDeadline"] == 250
    for bad in ("soon", "10 minutes", "1e3s", "s"):
        with pytest.raises(ValueError, match="store_deadline: .* is not a duration"):
            RateLimiter("memory", store_deadline=bad)
    with pytest.raises(TypeError, match="store_deadline is a number of seconds"):
        RateLimiter("memory", store_deadline=True)  # type: ignore[arg-type]
    RateLimiter("memory", store_deadline="2s")  # taken


def test_a_config_file_periods_grammar_is_the_servers() -> None:
    """The strings the server's parser takes (crates/core/src/config.rs), and its units."""
    from tollgate_client._units import parse

    taken = {"250ms": 250, "10s": 10_000, "1m": 60_000, "1.5h": 5_400_000, "1d": 86_400_000,
             " 2 s ": 2_000, ".5s": 500, "1.s": 1_000, "+3ms": 3}
    assert {text: parse(text) for text in taken} == taken
    for refused in ("1", "ms", "1 min", "1S", "1e3ms", "inf s", "1_000ms", "١s"):
        with pytest.raises(ValueError):
            parse(refused)


def test_the_async_limiter_takes_the_same_units() -> None:
    limiter = AsyncRateLimiter("memory", limits={"x": {"kind": "token bucket", "rate": 1, "period": "1h"}}, store_deadline="1s")
    assert asyncio.run(limiter.get_config())["x"]["period"] == 3_600_000
