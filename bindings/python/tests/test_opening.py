"""How a limiter reaches its store: one down when the limiter is made is used once it is up
(no restart), an asyncio limiter serves any event loop, and a closed one refuses calls."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Awaitable, Callable, List, TypeVar

import pytest
from conftest import fresh, networked
from network import Forwarder, free_port, moved, target_of

from pytollgate import HOUR, AsyncRateLimiter, RateLimiter, TollgateError

WINDOW = {"kind": "fixed window", "rate": 10, "period": HOUR, "start": 0}
T = TypeVar("T")


@pytest.fixture(params=["redis", "postgres"])
def real_store(request: pytest.FixtureRequest) -> str:
    variable = f"TOLLGATE_{request.param.upper()}_URL"
    url = networked(variable)
    if url is None:
        pytest.skip(f"no {variable}")
    return url


def until_answered(call: Callable[[], T], within: float = 10.0) -> T:
    """``call()``'s answer, retried while it raises TollgateError (at most ``within`` s)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return call()
        except TollgateError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_store_down_at_start_is_used_once_it_is_up(real_store: str) -> None:
    """Made while nothing listens on the store's port: every call fails (503, nothing
    taken); then the store comes up on that port (a forwarder to the real one) and calls
    are answered, without a new limiter."""
    port, name = free_port(), fresh("late")
    limiter = RateLimiter(moved(real_store, port), limits={name: WINDOW}, store_deadline=0.5)
    for _ in range(3):
        with pytest.raises(TollgateError) as error:
            limiter.limit(name, key="k")
        assert error.value.status == 503 and not error.value.may_have_taken
    with Forwarder(port, target_of(real_store)):
        assert until_answered(lambda: limiter.limit(name, key="k", count=10)).ok
        assert not limiter.limit(name, key="k").ok


async def test_a_store_down_at_start_is_used_once_it_is_up_async(real_store: str) -> None:
    port, name = free_port(), fresh("late")
    limiter = AsyncRateLimiter(moved(real_store, port), limits={name: WINDOW}, store_deadline=0.5)
    for _ in range(3):
        with pytest.raises(TollgateError) as error:
            await limiter.limit(name, key="k")
        assert error.value.status == 503 and not error.value.may_have_taken
    with Forwarder(port, target_of(real_store)):
        deadline = time.monotonic() + 10
        while True:
            try:
                assert (await limiter.limit(name, key="k", count=10)).ok
                break
            except TollgateError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        assert not (await limiter.limit(name, key="k")).ok


def test_a_store_that_cannot_be_opened_at_start_is_opened_later(tmp_path: Path) -> None:
    """An open that fails (PostgreSQL and Redis connect lazily; a SQLite file on a volume
    not mounted yet cannot be opened): tried again on a later call, at most every quarter
    of a second, on both doors."""
    store = f"sqlite://{tmp_path}/later/states.db"
    blocking = RateLimiter(store, limits={"x": WINDOW})
    awaited = AsyncRateLimiter(store, limits={"x": WINDOW})
    with pytest.raises(TollgateError, match="could not be opened") as error:
        blocking.limit("x", key="k")
    assert error.value.status == 503 and not error.value.may_have_taken
    with pytest.raises(TollgateError, match="could not be opened"):
        asyncio.run(awaited.limit("x", key="k"))
    (tmp_path / "later").mkdir()
    assert until_answered(lambda: blocking.limit("x", key="k", count=4)).ok
    assert until_answered(lambda: asyncio.run(awaited.limit("x", key="k", count=6))).ok
    assert not blocking.limit("x", key="k").ok


def test_a_store_that_stays_down_is_not_opened_at_every_call() -> None:
    """While the store is down, calls fail at once, and an open is tried at most every
    quarter of a second: 200 calls in a row cost far less than 200 opens."""
    port, name = free_port(), fresh("down")
    opened: List[float] = []
    accepted = 0

    def count() -> None:
        nonlocal accepted
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            accepted += 1
            connection.close()  # a PostgreSQL that hangs up at once

    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    threading.Thread(target=count, daemon=True).start()
    try:
        started = time.monotonic()
        limiter = RateLimiter(f"postgres://postgres@127.0.0.1:{port}/test", limits={name: WINDOW}, store_deadline=0.5)
        for _ in range(200):
            with pytest.raises(TollgateError):
                limiter.limit(name, key="k")
            opened.append(time.monotonic())
        elapsed = time.monotonic() - started
    finally:
        listener.close()
    # One open at the constructor, then one per 0.25 s at most (each may connect a few
    # times: a pool's first connection and its retries).
    assert accepted <= 8 * (2 + elapsed / 0.25), (accepted, elapsed)


def in_a_loop_of_its_own(make: Callable[[], Awaitable[T]]) -> T:
    """``make()`` awaited in a new event loop in a new thread (each thread's loop is its
    own, as in a server with a loop per worker thread)."""
    answers: List[T] = []
    errors: List[BaseException] = []

    def run() -> None:
        try:
            answers.append(asyncio.run(make()))  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if errors:
        raise errors[0]
    return answers[0]


def test_an_async_limiter_outlives_the_loop_of_its_first_call(real_store: str) -> None:
    """The first call's loop ends before the store is open (its call cancelled, the loop
    closed): the limiter is not tied to it, and serves the next loop."""
    name = fresh("loops")
    limiter = AsyncRateLimiter(real_store, limits={name: WINDOW}, store_deadline=2.0)

    async def cut_short() -> None:
        task = asyncio.ensure_future(limiter.limit(name, key="k"))
        await asyncio.sleep(0)  # the open is under way on the module's runtime
        task.cancel()

    asyncio.run(cut_short())
    assert asyncio.run(limiter.limit(name, key="k", count=9)).ok
    assert in_a_loop_of_its_own(lambda: limiter.get_value(name, key="k")).value == 1


def test_two_loops_making_first_calls_at_once_both_succeed(real_store: str) -> None:
    name = fresh("loops")
    limiter = AsyncRateLimiter(real_store, limits={name: WINDOW}, store_deadline=2.0)
    ready = threading.Barrier(2)
    answers: List[bool] = []
    errors: List[BaseException] = []

    def loop() -> None:
        async def first() -> bool:
            return (await limiter.limit(name, key="k", count=5)).ok

        ready.wait(10)
        try:
            answers.append(asyncio.run(first()))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert answers == [True, True]


def test_calls_after_close_are_refused_as_the_http_clients_are() -> None:
    """tollgate_client's RateLimiter raises TollgateError (no status, nothing taken) for a
    call after close(); so does each in-process limiter, on every store."""
    limiter = RateLimiter("memory", limits={"x": WINDOW})
    assert limiter.limit("x", key="k").ok
    limiter.close()
    for call in (
        lambda: limiter.limit("x", key="k"),
        lambda: limiter.transaction([{"name": "x", "key": "k"}]),
        limiter.get_config,
    ):
        with pytest.raises(TollgateError, match="closed") as error:
            call()
        assert error.value.status is None and not error.value.may_have_taken

    async def closed() -> None:
        async with AsyncRateLimiter("memory", limits={"x": WINDOW}) as limiter:
            assert (await limiter.limit("x", key="k")).ok
        with pytest.raises(TollgateError, match="closed") as error:
            await limiter.limit("x", key="k")
        assert error.value.status is None and not error.value.may_have_taken

    asyncio.run(closed())
