"""Concurrency limits (SPEC §6f) against the real server, on both clients: acquire up to max,
release, renew, ``hold`` as a ``with`` / ``async with`` block released however it ends, and
the errors of each. The servers define ``exports``: 2 slots, held 1 minute (conftest)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, List

import pytest
from conftest import FULL_TOKEN, LIMITS, READ_TOKEN, open_client
from servers import Server, tollgate

from tollgate_client import (
    Acquired,
    AsyncHeld,
    AsyncRateLimiter,
    Held,
    RateLimiter,
    RateLimitError,
    Renewed,
    SlotsValue,
    TollgateError,
)


async def test_acquire_up_to_max_then_refused_until_a_release(client: Any, key: str) -> None:
    before = await client.get_server_time()
    first = await client.acquire("exports", key=key)
    second = await client.acquire("exports", key=key)
    assert first.ok and second.ok
    assert first.ticket is not None and first.ticket.isdigit()
    assert first.ticket != second.ticket
    assert first.retry_after is None
    # The limit's ttl, from the store's clock.
    assert first.expires_at is not None
    assert before + 60_000 <= first.expires_at < before + 65_000
    assert await client.get_slots_value("exports", key=key) == SlotsValue(2, 2, 2)

    refused = await client.acquire("exports", key=key)
    assert (refused.ok, refused.ticket, refused.expires_at) == (False, None, None)
    # Until the earliest holder's expiry.
    assert refused.retry_after is not None and 55_000 < refused.retry_after <= 60_000
    assert (await client.check("exports", key=key)).ok is False
    assert await client.get_slots_value("exports", key=key) == SlotsValue(2, 2, 2)
    # Another key has slots of its own.
    assert (await client.acquire("exports", key=key + "-other")).ok

    assert await client.release("exports", key, ticket=first.ticket) is True
    assert await client.release("exports", key, ticket=first.ticket) is False, "released twice"
    assert await client.get_slots_value("exports", key=key) == SlotsValue(1, 2, 1)
    assert (await client.check("exports", key=key)).ok is True
    assert (await client.acquire("exports", key=key)).ok

    # reset frees every slot.
    await client.reset("exports", key=key)
    assert await client.get_slots_value("exports", key=key) == SlotsValue(0, 2, 0)


async def test_count_takes_several_and_more_than_max_is_an_error(client: Any, key: str) -> None:
    assert (await client.acquire("exports", key=key, count=2)).ok
    assert await client.get_slots_value("exports", key=key) == SlotsValue(2, 2, 1)
    assert not (await client.acquire("exports", key=key)).ok
    with pytest.raises(TollgateError) as e:
        await client.acquire("exports", key=key, count=3)
    assert e.value.status == 400
    assert "more than the limit's max of 2" in e.value.message
    assert e.value.may_have_taken is False


async def test_renew_moves_the_expiry_and_fails_after_it(client: Any, key: str) -> None:
    long = await client.acquire("exports", key=key, ttl="30s")
    renewed = await client.renew("exports", key, ticket=long.ticket, ttl="2m")
    assert renewed.ok
    assert renewed.expires_at - long.expires_at > 80_000

    brief = await client.acquire("exports", key=key, ttl=150)
    assert brief.ok
    refused = await client.acquire("exports", key=key)
    assert not refused.ok and refused.retry_after <= 150
    await asyncio.sleep(0.3)
    assert await client.renew("exports", key, ticket=brief.ticket) == Renewed(False)
    assert await client.release("exports", key, ticket=brief.ticket) is False
    # Its slot came free by itself.
    assert (await client.acquire("exports", key=key)).ok
    # A ticket is its key's: under another key it is unknown.
    assert await client.release("exports", key + "-other", ticket=long.ticket) is False
    assert await client.release("exports", key, ticket=long.ticket) is True


async def test_throws_raises_a_rate_limit_error(client: Any, key: str) -> None:
    await client.acquire("exports", key=key, count=2)
    with pytest.raises(RateLimitError) as e:
        await client.acquire("exports", key=key, throws=True)
    assert (e.value.kind, e.value.name) == ("RateLimited", "exports")
    assert 55_000 < e.value.retry_after <= 60_000


def test_with_hold_releases_however_the_block_ends(server: Server, key: str) -> None:
    with RateLimiter(server.url) as limiter:
        with limiter.hold("exports", key=key, ttl="30s") as slot:
            assert isinstance(slot, Held)
            assert (slot.name, slot.key) == ("exports", key)
            assert slot.ticket.isdigit() and not slot.released
            assert limiter.get_slots_value("exports", key).in_flight == 1
            before = slot.expires_at
            assert slot.renew(ttl="2m") is True
            assert slot.expires_at - before > 80_000
        assert limiter.get_slots_value("exports", key).in_flight == 0
        assert slot.released

        # An exception in the block comes out as it was, the slot released.
        with pytest.raises(ZeroDivisionError):
            with limiter.hold("exports", key=key):
                assert limiter.get_slots_value("exports", key).in_flight == 1
                1 / 0
        assert limiter.get_slots_value("exports", key).in_flight == 0

        # A return from inside the block, and a release inside it (then none at the end).
        def work() -> bool:
            with limiter.hold("exports", key=key) as slot:
                return slot.release()

        assert work() is True
        assert limiter.get_slots_value("exports", key).in_flight == 0

        # Refused: RateLimitError as the block is entered, and the block does not run.
        limiter.acquire("exports", key=key, count=2)
        ran: List[bool] = []
        with pytest.raises(RateLimitError) as e:
            with limiter.hold("exports", key=key):
                ran.append(True)
        assert ran == []
        assert e.value.name == "exports" and 55_000 < e.value.retry_after <= 60_000
        assert limiter.get_slots_value("exports", key).in_flight == 2


async def test_async_with_hold_releases_however_the_block_ends(server: Server, key: str) -> None:
    async with AsyncRateLimiter(server.url) as limiter:
        async with limiter.hold("exports", key=key) as slot:
            assert isinstance(slot, AsyncHeld)
            assert (await limiter.get_slots_value("exports", key)).in_flight == 1
            assert await slot.renew() is True
        assert (await limiter.get_slots_value("exports", key)).in_flight == 0

        with pytest.raises(KeyError):
            async with limiter.hold("exports", key=key):
                assert (await limiter.get_slots_value("exports", key)).in_flight == 1
                raise KeyError("the work failed")
        assert (await limiter.get_slots_value("exports", key)).in_flight == 0

        # A task cancelled inside the block: released all the same.
        entered = asyncio.Event()

        async def work() -> None:
            async with limiter.hold("exports", key=key):
                entered.set()
                await asyncio.sleep(60)

        task = asyncio.ensure_future(work())
        await entered.wait()
        assert (await limiter.get_slots_value("exports", key)).in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await limiter.get_slots_value("exports", key)).in_flight == 0

        await limiter.acquire("exports", key=key, count=2)
        with pytest.raises(RateLimitError):
            async with limiter.hold("exports", key=key):
                raise AssertionError("the block ran without its slot")


async def test_a_held_slot_after_its_expiry(client: Any, key: str) -> None:
    acquired = await client.acquire("exports", key=key, ttl=100)
    assert isinstance(acquired, Acquired) and acquired.ok
    await asyncio.sleep(0.2)
    assert await client.renew("exports", key, ticket=acquired.ticket) == Renewed(False)


def test_a_release_that_fails_at_the_end_is_not_raised(tmp_path: Path, key: str) -> None:
    """The server goes away inside the block: the block's own outcome comes out (its
    exception, or nothing), not the release's failure; ``release()`` says it."""
    for fails in (True, False):
        with tollgate(LIMITS, tmp_path / str(fails)) as own:
            with RateLimiter(own.url, timeout=2) as limiter:
                try:
                    with limiter.hold("exports", key=key) as slot:
                        own.process.kill()
                        own.process.wait()
                        if fails:
                            raise KeyError("the work's own error")
                except KeyError as e:
                    assert fails and e.args == ("the work's own error",)
                assert not slot.released
                with pytest.raises(TollgateError) as error:
                    slot.release()
                assert error.value.status is None


async def test_errors(flavour: str, read_token_server: Server, key: str) -> None:
    async with open_client(flavour, read_token_server.url, token=FULL_TOKEN) as c:
        with pytest.raises(TollgateError) as e:
            await c.acquire("sendMessage")
        assert e.value.status == 400 and "is a rate limit" in e.value.message
        with pytest.raises(TollgateError) as e:
            await c.acquire("nope")
        assert e.value.status == 404 and "Concurrency limit nope not defined" in e.value.message
        with pytest.raises(TollgateError) as e:
            await c.limit("exports")
        assert e.value.status == 400 and "take its slots with /v1/acquire" in e.value.message
        with pytest.raises(TollgateError) as e:
            await c.release("exports", ticket="abc")
        assert e.value.status == 400 and "ticket" in e.value.message
        # A concurrency limit's value is read with get_slots_value, a rate limit's with
        # get_value.
        with pytest.raises(TollgateError, match="unexpected answer from /v1/value"):
            await c.get_value("exports")
        with pytest.raises(TollgateError, match="not a concurrency limit's value"):
            await c.get_slots_value("sendMessage")
        # Before anything is sent.
        with pytest.raises(TypeError, match="ticket is the string an acquire answered"):
            await c.release("exports", ticket=7)
        with pytest.raises(ValueError, match="ttl"):
            await c.acquire("exports", ttl="2 minutes")
        with pytest.raises(TollgateError, match="cannot be sent as JSON"):
            await c.renew("exports", ticket="1", ttl=float("nan"))
    # A read token may check and read, not acquire, release or renew.
    async with open_client(flavour, read_token_server.url, token=READ_TOKEN) as reader:
        assert (await reader.check("exports", key=key)).ok
        assert await reader.get_slots_value("exports", key=key) == SlotsValue(0, 2, 0)
        for call in (
            lambda: reader.acquire("exports"),
            lambda: reader.release("exports", ticket="1"),
            lambda: reader.renew("exports", ticket="1"),
        ):
            with pytest.raises(TollgateError) as e:
                await call()
            assert e.value.status == 403


def test_hold_checks_its_arguments_when_called() -> None:
    limiter = RateLimiter("http://127.0.0.1:1")
    with pytest.raises(TypeError):
        limiter.hold("exports", ttl=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ttl"):
        limiter.hold("exports", ttl="soon")
    started = time.monotonic()
    limiter.hold("exports")  # nothing sent until the block is entered
    assert time.monotonic() - started < 0.5
    limiter.close()
