"""The in-process limiters on every store: each call of tollgate_client's API, its answers
and its errors, through the real native module."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fresh, ticks_during

from pytollgate import (
    HOUR,
    MINUTE,
    Adjusted,
    AsyncRateLimiter,
    LimitCall,
    RateLimiter,
    RateLimitError,
    TollgateError,
)

HERE = Path(__file__).resolve().parent


def configs(send: str, day: str) -> dict[str, dict[str, object]]:
    return {
        send: {"kind": "token bucket", "rate": 10, "period": MINUTE, "capacity": 3},
        day: {"kind": "fixed window", "rate": 2, "period": HOUR, "start": 0},
    }


def test_every_call(store: str) -> None:
    send, day = fresh("send"), fresh("day")
    with RateLimiter(store, limits=configs(send, day)) as limiter:
        # Three granted, the fourth refused with the wait for one token (6 s at 10 a minute).
        assert [limiter.limit(send, key="{alice}").ok for _ in range(3)] == [True] * 3
        refused = limiter.limit(send, key="{alice}")
        assert not refused.ok and refused.retry_after is not None
        assert 5_000 < refused.retry_after <= 6_000
        assert limiter.limit(send, key="{bob}").ok
        # check takes nothing.
        assert limiter.check(send, key="{bob}", count=2).ok
        assert limiter.check(send, key="{bob}", count=2).ok
        with pytest.raises(RateLimitError) as raised:
            limiter.limit(send, key="{alice}", throws=True)
        assert raised.value.name == send and raised.value.retry_after > 0
        reserved = limiter.limit(send, key="{alice}", reserve=True)
        assert reserved.ok and reserved.retry_after is not None and reserved.retry_after > 0
        value = limiter.get_value(send, key="{alice}")
        assert value.value < 0 and value.config["capacity"] == 3
        assert abs(limiter.get_server_time() - value.ts) < 60_000
        # All or nothing (one hash tag: one Cluster slot).
        assert limiter.limit(day, key="{bob}", count=2).ok
        before = limiter.get_value(send, key="{bob}").value
        result = limiter.transaction([LimitCall(send, key="{bob}"), {"name": day, "key": "{bob}"}])
        assert not result.ok and [r.ok for r in result.results] == [True, False]
        assert abs(limiter.get_value(send, key="{bob}").value - before) < 0.01
        limiter.reset(send, key="{alice}")
        assert limiter.get_value(send, key="{alice}").ts == 0
        assert limiter.limit(send, key="{alice}", count=3).ok
        # A config of the call's own for another name; without one, an error taking nothing.
        inline = {"kind": "token bucket", "rate": 1, "period": MINUTE}
        assert limiter.limit(fresh("inline"), key="a", config=inline).ok
        with pytest.raises(TollgateError) as error:
            limiter.limit(fresh("unknown"), key="a")
        assert error.value.status == 404 and not error.value.may_have_taken
        with pytest.raises(TollgateError) as error:
            limiter.limit(send, key="{bob}", count=-1)
        assert error.value.status == 400 and "count" in error.value.message
        # adjust: the work used more than was taken (a debt), then less (given back).
        assert limiter.limit(day, key="{carol}").ok
        debt = limiter.adjust(day, key="{carol}", count=2)
        assert debt.value == -1 and debt.retry_after is not None and debt.retry_after > 0
        assert not limiter.limit(day, key="{carol}").ok
        assert limiter.adjust(day, key="{carol}", count=-5) == Adjusted(2)
        with pytest.raises(ValueError):
            limiter.adjust(day, key="{carol}", count=float("inf"))
        assert set(limiter.get_config()) == {send, day}


async def test_every_call_async(store: str) -> None:
    send, day = fresh("send"), fresh("day")
    async with AsyncRateLimiter(store, limits=configs(send, day)) as limiter:
        answers = [(await limiter.limit(send, key="k")).ok for _ in range(4)]
        assert answers == [True, True, True, False]
        assert (await limiter.check(send, key="other")).ok
        with pytest.raises(RateLimitError):
            await limiter.limit(send, key="k", throws=True)
        result = await limiter.transaction([{"name": send, "key": "{x}"}, {"name": day, "key": "{x}"}])
        assert result.ok
        assert (await limiter.get_value(send, key="{x}")).value == pytest.approx(2, abs=0.01)
        await limiter.reset(send, key="k")
        assert (await limiter.limit(send, key="k", count=3)).ok
        assert await limiter.get_server_time() > 1.7e12
        assert (await limiter.adjust(day, key="{y}", count=3)).value == -1
        assert await limiter.adjust(day, key="{y}", count=-3) == Adjusted(2)
        with pytest.raises(TollgateError) as error:
            await limiter.limit(send, key="k", count=-1)
        assert error.value.status == 400


async def test_the_event_loop_runs_while_the_store_works() -> None:
    """200 calls at once on Redis: their answers come back through the loop, which goes on
    meanwhile (a ticker runs), with no thread per call (the module's runtime has its own)."""
    import os
    import threading

    url = os.environ.get("TOLLGATE_REDIS_URL")
    if url is None:
        pytest.skip("no TOLLGATE_REDIS_URL")
    name = fresh("loop")
    # 200 at once on a loaded machine (and a debug build): a deadline that waits for them.
    limiter = AsyncRateLimiter(
        url, limits={name: {"kind": "token bucket", "rate": 150, "period": HOUR}}, store_deadline=10.0
    )
    await limiter.get_server_time()
    threads = threading.active_count()
    gathered = asyncio.ensure_future(asyncio.gather(*(limiter.limit(name, key="k") for _ in range(200))))
    assert await ticks_during(gathered) > 0
    assert sum(a.ok for a in gathered.result()) == 150
    assert threading.active_count() == threads


def test_bad_input_raises_at_the_constructor() -> None:
    with pytest.raises(ValueError, match="unknown store; use memory"):
        RateLimiter("mongodb://127.0.0.1")
    with pytest.raises(ValueError, match=r"\[limits\.x\]: invalid config: rate is -1"):
        RateLimiter("memory", limits={"x": {"kind": "token bucket", "rate": -1, "period": MINUTE}})
    with pytest.raises(ValueError, match="lease = true needs a Redis or PostgreSQL store"):
        RateLimiter("memory", limits={"x": {"kind": "token bucket", "rate": 1, "period": MINUTE}}, leases={"x": True})
    with pytest.raises(ValueError, match="leases names 'y'"):
        RateLimiter("memory", leases={"y": True})
    with pytest.raises(TypeError, match="store URL"):
        RateLimiter(None)  # type: ignore[arg-type]
    # snake_case keys are the API's camelCase.
    limiter = RateLimiter("memory", limits={"x": {"kind": "token bucket", "rate": 1, "period": MINUTE, "max_reserved": 2}})
    assert limiter.get_config()["x"]["maxReserved"] == 2


def test_a_store_that_is_down_never_answers_ok() -> None:
    name = fresh("down")
    config = {name: {"kind": "token bucket", "rate": 10, "period": MINUTE}}
    for url in ("redis://127.0.0.1:1", "postgres://postgres@127.0.0.1:1/test"):
        limiter = RateLimiter(url, limits=config, store_deadline=0.5)
        for call in (
            lambda: limiter.limit(name, key="a"),
            lambda: limiter.check(name, key="a"),
            lambda: limiter.transaction([{"name": name, "key": "a"}]),
        ):
            with pytest.raises(TollgateError) as error:
                call()
            assert error.value.status == 503 and error.value.may_have_taken is False


def test_the_direct_path_and_the_json_path_answer_alike() -> None:
    """limit and check of a defined limit take the direct path; with a config in the call the
    JSON path: the same decisions and the same errors."""
    defined, inline = fresh("direct"), fresh("json")
    config = {"kind": "token bucket", "rate": 1, "period": HOUR, "capacity": 5, "max_reserved": 2}
    limiter = RateLimiter("memory", limits={defined: config})
    calls = [
        ("limit", {"count": 2}), ("check", {"count": 4}), ("limit", {"count": 3}), ("limit", {}),
        ("limit", {"reserve": True}), ("limit", {"count": 2, "reserve": True}), ("check", {}),
    ]
    for method, options in calls:
        direct = getattr(limiter, method)(defined, key="k", **options)
        json_path = getattr(limiter, method)(inline, key="k", config=config, **options)
        assert direct.ok == json_path.ok, (method, options)
        assert (direct.retry_after is None) == (json_path.retry_after is None)

    def outcome(name: str, **extra: object) -> str:
        try:
            limiter.limit(name, key="k", count=-1, **extra)  # type: ignore[arg-type]
        except TollgateError as e:
            return f"{e.status} {e.message}".replace(name, "NAME")
        return "no error"

    assert outcome(defined) == outcome(inline, config=config)
    assert outcome(defined).startswith("400 Rate limit NAME count -1")


def test_the_package_is_typed_mypy_strict() -> None:
    package = HERE.parent / "python"
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--config-file", str(HERE.parent / "pyproject.toml"), str(package)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
