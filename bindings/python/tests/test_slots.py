"""Concurrency limits (SPEC §6f) in this process on every store, both limiters: acquire up to
max, release, renew, check and reset by the limit's name, ``hold`` as a ``with`` / ``async
with`` block released however it ends, and the limits' configs checked at construction."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from typing import Any, Dict, List

import pytest
from conftest import fresh
from test_guide import ROOT, blocks

from pytollgate import (
    MINUTE,
    Acquired,
    AsyncHeld,
    AsyncRateLimiter,
    Decision,
    Held,
    RateLimiter,
    RateLimitError,
    Renewed,
    SlotsValue,
    TollgateError,
)


def limits(exports: str, send: str) -> Dict[str, Dict[str, Any]]:
    return {
        exports: {"kind": "concurrency", "max": 2, "ttl": "1m"},
        send: {"kind": "token bucket", "rate": 10, "period": MINUTE},
    }


def test_acquire_release_renew(store: str) -> None:
    exports, send = fresh("exports"), fresh("send")
    with RateLimiter(store, limits=limits(exports, send)) as limiter:
        now = limiter.get_server_time()
        first = limiter.acquire(exports, key="acme")
        second = limiter.acquire(exports, key="acme")
        assert first.ok and second.ok
        assert first.ticket is not None and first.ticket.isdigit()
        assert first.ticket != second.ticket
        assert first.expires_at is not None and now + 59_000 <= first.expires_at < now + 65_000
        assert limiter.get_slots_value(exports, "acme") == SlotsValue(2, 2, 2)

        # Refused until the earliest expiry, nothing taken; another key has its own slots.
        refused = limiter.acquire(exports, key="acme")
        assert not refused.ok and refused.ticket is None
        assert refused.retry_after is not None and 55_000 < refused.retry_after <= 60_000
        assert limiter.check(exports, key="acme").ok is False
        assert limiter.get_slots_value(exports, "acme") == SlotsValue(2, 2, 2)
        assert limiter.acquire(exports, key="globex").ok
        with pytest.raises(RateLimitError) as raised:
            limiter.acquire(exports, key="acme", throws=True)
        assert raised.value.name == exports and raised.value.retry_after > 55_000

        # A release frees its slot, once.
        assert limiter.release(exports, "acme", ticket=first.ticket) is True
        assert limiter.release(exports, "acme", ticket=first.ticket) is False
        assert limiter.check(exports, key="acme") == Decision(True)
        assert limiter.get_slots_value(exports, "acme") == SlotsValue(1, 2, 1)

        # renew moves the expiry; past its expiry a ticket renews to not ok, releases to
        # False, and its slot is free.
        assert second.ticket is not None and second.expires_at is not None
        renewed = limiter.renew(exports, "acme", ticket=second.ticket, ttl="2m")
        assert renewed.ok and renewed.expires_at is not None
        assert renewed.expires_at - second.expires_at > 50_000
        brief = limiter.acquire(exports, key="acme", ttl=150)
        assert brief.ok and brief.ticket is not None
        assert not limiter.acquire(exports, key="acme").ok
        time.sleep(0.3)
        assert limiter.renew(exports, "acme", ticket=brief.ticket) == Renewed(False)
        assert limiter.release(exports, "acme", ticket=brief.ticket) is False
        assert limiter.get_slots_value(exports, "acme") == SlotsValue(1, 2, 1)

        # Several slots at once; more than max is an error.
        assert limiter.acquire(exports, key="initech", count=2).ok
        assert limiter.get_slots_value(exports, "initech") == SlotsValue(2, 2, 1)
        with pytest.raises(TollgateError) as error:
            limiter.acquire(exports, key="initech", count=3)
        assert error.value.status == 400 and "more than the limit's max of 2" in error.value.message
        # reset frees every slot of the key.
        limiter.reset(exports, "initech")
        assert limiter.get_slots_value(exports, "initech") == SlotsValue(0, 2, 0)

        # A rate limit's calls do not take a concurrency limit's name, nor the other way.
        with pytest.raises(TollgateError) as error:
            limiter.limit(exports, key="acme")
        assert error.value.status == 400
        assert "take its slots with /v1/acquire" in error.value.message
        with pytest.raises(TollgateError) as error:
            limiter.acquire(send)
        assert error.value.status == 400 and "is a rate limit" in error.value.message
        with pytest.raises(TollgateError) as error:
            limiter.acquire(fresh("nope"))
        assert error.value.status == 404
        assert limiter.get_config()[exports] == {"kind": "concurrency", "max": 2, "ttl": 60_000}


def test_a_transaction_takes_a_slot_and_tokens_all_or_nothing(store: str) -> None:
    exports, send = fresh("exports"), fresh("send")
    slots = {exports: {"kind": "concurrency", "max": 1, "ttl": "1m"}}
    rate = {send: {"kind": "token bucket", "rate": 10, "period": MINUTE}}
    with RateLimiter(store, limits={**slots, **rate}) as limiter:
        # One key's slot and tokens (a hash tag: one slot of a Redis Cluster).
        key = "{acme}"
        both = limiter.transaction([{"name": exports, "key": key}, {"name": send, "key": key, "count": 6}])
        assert both.ok and both.ticket is not None and both.ticket.isdigit()
        assert both.expires_at is not None
        assert limiter.get_slots_value(exports, key).in_flight == 1
        assert limiter.release(exports, key, ticket=both.ticket) is True
        # Refused by the tokens: no slot held; by the slots: no token taken.
        short = limiter.transaction([{"name": exports, "key": key}, {"name": send, "key": key, "count": 6}])
        assert not short.ok and short.ticket is None
        assert [r.ok for r in short.results] == [True, False]
        assert limiter.get_slots_value(exports, key).in_flight == 0
        held = limiter.acquire(exports, key=key)
        assert held.ticket is not None
        full = limiter.transaction([{"name": exports, "key": key}, {"name": send, "key": key}])
        assert [r.ok for r in full.results] == [False, True] and full.ticket is None
        left = limiter.get_value(send, key).value
        assert limiter.release(exports, key, ticket=held.ticket) is True
        again = limiter.transaction([{"name": send, "key": key}, {"name": exports, "key": key}])
        assert again.ok and again.ticket is not None
        assert limiter.get_value(send, key).value < left, "the token taken with the slot"
        assert limiter.release(exports, key, ticket=again.ticket) is True


def test_with_hold_releases_however_the_block_ends(store: str) -> None:
    exports, send = fresh("exports"), fresh("send")
    with RateLimiter(store, limits=limits(exports, send)) as limiter:
        with limiter.hold(exports, key="acme", ttl="30s") as slot:
            assert isinstance(slot, Held) and slot.ticket.isdigit()
            assert limiter.get_slots_value(exports, "acme").in_flight == 1
            before = slot.expires_at
            assert slot.renew(ttl="2m") is True and slot.expires_at - before > 80_000
        assert slot.released
        assert limiter.get_slots_value(exports, "acme").in_flight == 0

        with pytest.raises(ZeroDivisionError):
            with limiter.hold(exports, key="acme"):
                assert limiter.get_slots_value(exports, "acme").in_flight == 1
                1 / 0
        assert limiter.get_slots_value(exports, "acme").in_flight == 0

        # Refused: RateLimitError as the block is entered; the block does not run.
        limiter.acquire(exports, key="acme", count=2)
        ran: List[bool] = []
        with pytest.raises(RateLimitError) as raised:
            with limiter.hold(exports, key="acme"):
                ran.append(True)
        assert ran == [] and raised.value.name == exports
        assert limiter.get_slots_value(exports, "acme").in_flight == 2


async def test_async_with_hold_releases_however_the_block_ends(store: str) -> None:
    exports, send = fresh("exports"), fresh("send")
    async with AsyncRateLimiter(store, limits=limits(exports, send)) as limiter:
        first = await limiter.acquire(exports, key="acme")
        assert isinstance(first, Acquired) and first.ok and first.ticket is not None
        assert (await limiter.check(exports, key="acme")).ok
        assert await limiter.release(exports, "acme", ticket=first.ticket) is True

        async with limiter.hold(exports, key="acme") as slot:
            assert isinstance(slot, AsyncHeld)
            assert (await limiter.get_slots_value(exports, "acme")).in_flight == 1
            assert await slot.renew() is True
        assert (await limiter.get_slots_value(exports, "acme")).in_flight == 0

        with pytest.raises(KeyError):
            async with limiter.hold(exports, key="acme"):
                raise KeyError("the work failed")
        assert (await limiter.get_slots_value(exports, "acme")).in_flight == 0

        # A task cancelled inside its block: released all the same.
        entered = asyncio.Event()

        async def work() -> None:
            async with limiter.hold(exports, key="acme"):
                entered.set()
                await asyncio.sleep(60)

        task = asyncio.ensure_future(work())
        await entered.wait()
        assert (await limiter.get_slots_value(exports, "acme")).in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await limiter.get_slots_value(exports, "acme")).in_flight == 0

        # Past its expiry: renew says so.
        brief = await limiter.acquire(exports, key="acme", ttl=100)
        assert brief.ticket is not None
        await asyncio.sleep(0.2)
        assert await limiter.renew(exports, "acme", ticket=brief.ticket) == Renewed(False)

        await limiter.acquire(exports, key="acme", count=2)
        assert not (await limiter.check(exports, key="acme")).ok
        with pytest.raises(RateLimitError):
            async with limiter.hold(exports, key="acme"):
                raise AssertionError("the block ran without its slot")
        with pytest.raises(TollgateError) as error:
            await limiter.limit(exports)
        assert error.value.status == 400


def test_a_concurrency_limit_is_checked_at_construction() -> None:
    for bad, message in (
        ({"kind": "concurrency", "max": 0}, "max"),
        ({"kind": "concurrency"}, "a concurrency limit needs max"),
        ({"kind": "concurrency", "max": 2, "ttl": "soon"}, "ttl"),
        ({"kind": "concurrency", "max": 2, "rate": 3}, "unknown field `rate`"),
    ):
        with pytest.raises(ValueError, match=message):
            RateLimiter("memory", limits={"gpu": bad})
    with pytest.raises(ValueError, match="failOpen is not for a concurrency limit"):
        RateLimiter("memory", limits={"gpu": {"kind": "concurrency", "max": 2}}, fail_open=["gpu"])


def test_a_store_that_is_down_fails_each_call_and_the_block_is_not_entered() -> None:
    name = fresh("down")
    with RateLimiter("redis://127.0.0.1:1", limits={name: {"kind": "concurrency", "max": 1}},
                     store_deadline=0.3) as limiter:
        for call in (
            lambda: limiter.acquire(name),
            lambda: limiter.release(name, ticket="1"),
            lambda: limiter.renew(name, ticket="1"),
        ):
            with pytest.raises(TollgateError) as error:
                call()
            assert error.value.status == 503
        with pytest.raises(TollgateError):
            with limiter.hold(name):
                raise AssertionError("the block ran without its slot")


def test_a_slot_held_when_its_limiter_closes_is_left_to_its_expiry() -> None:
    name = fresh("closing")
    limiter = RateLimiter("memory", limits={name: {"kind": "concurrency", "max": 1}})
    with pytest.raises(KeyError):
        with limiter.hold(name) as slot:
            limiter.close()
            raise KeyError("the block's own error comes out, not the release's")
    assert not slot.released
    with pytest.raises(TollgateError):
        slot.release()


def test_the_chapters_example_prints_what_it_says() -> None:
    """The Python block of the guide's chapter "Concurrency limits" prints its ``# `` lines."""
    page = ROOT / "docs" / "src" / "concepts" / "concurrency.md"
    line, text = blocks(page)[0]  # the second is the middleware's (test_middleware_slots.py)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(text, f"{page.relative_to(ROOT)}:{line}", "exec"), {"__name__": "guide"})
    shown = [comment[2:] for comment in text.split("\n") if comment.startswith("# ")]
    assert shown == ["busy for 120 s", "SlotsValue(in_flight=0, max=1, holders=0)"]
    assert out.getvalue().splitlines() == shown
