"""Every error: the server's (400, 401, 403, 404, 429, 503) and the client's own (timeout,
refused connection, an answer that is not the API's, a closed client)."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, List

import pytest
from conftest import FULL_TOKEN, LIMITS, READ_TOKEN, open_client
from servers import (
    Server,
    fake_redis_that_hangs,
    odd_web_server,
    refusing_address,
    silent_server,
    tollgate,
)

from tollgate_client import (
    AsyncRateLimiter,
    Decision,
    LimitCall,
    RateLimiter,
    RateLimitError,
    TollgateError,
)

WINDOW = {"kind": "fixed window", "rate": 1, "period": 3_600_000, "start": 0}


async def raises(call: Awaitable[Any]) -> TollgateError:
    try:
        await call
    except TollgateError as e:
        return e
    raise AssertionError("no TollgateError")


# -- 400 ------------------------------------------------------------------------------------


async def test_400_negative_count_names_the_field(client: Any, key: str) -> None:
    e = await raises(client.limit("sendMessage", key=key, count=-1))
    assert (e.status, e.may_have_taken) == (400, False)
    assert e.message == "Rate limit sendMessage count -1 must be a finite number >= 0."
    assert "count" in str(e)
    # Nothing was taken.
    assert (await client.get_value("sendMessage", key=key)).ts == 0


async def test_400_others(client: Any, key: str) -> None:
    e = await raises(client.limit("sendMessage", key=key, count=4))
    assert (e.status, e.message) == (400, "Rate limit sendMessage count 4 exceeds 3.")
    e = await raises(client.check("x", key=key, config={**WINDOW, "rate": -1}))
    assert e.status == 400 and "rate" in e.message
    e = await raises(client.limit("x", key=key, config={**WINDOW, "bogus": 1}))
    assert e.status == 400 and "bogus" in e.message
    e = await raises(client.limit("sendMessage", key=key, config=WINDOW))
    assert e.status == 400 and "defined by the server" in e.message
    e = await raises(client.get_value("sendMessage", key=key, sample_shards=0))
    assert e.status == 400 and "sampleShards" in e.message
    e = await raises(client.transaction([]))
    assert e.status == 400 and "limits" in e.message
    e = await raises(client.limit("", key=key))
    assert e.status == 400 and "name" in e.message


async def test_unsendable_request_is_refused_before_sending(client: Any, key: str) -> None:
    e = await raises(client.limit("sendMessage", key=key, count=float("nan")))
    assert e.status is None and "JSON" in e.message
    assert (await client.get_value("sendMessage", key=key)).ts == 0


async def test_bad_arguments_are_caught_in_python() -> None:
    with pytest.raises(ValueError):
        RateLimiter("127.0.0.1:8787")  # no scheme
    with pytest.raises(ValueError):
        RateLimiter("ftp://127.0.0.1")
    with RateLimiter("http://127.0.0.1:1") as c:
        with pytest.raises(TypeError):
            c.transaction({"name": "x"})  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            c.transaction([{"key": "no name"}])


# -- 401, 403 -------------------------------------------------------------------------------


# The server answers 401 and 403 before it reads a POST's body, and then closes the
# connection without saying `Connection: close` when the body had not arrived with the
# headers (httpx sends them apart): a request sent next on that keep-alive connection may
# fail with "Server disconnected without sending a response" (see
# test_refused_post_keeps_its_connection_or_says_close). So each refused call below gets a
# client, and a connection, of its own.


async def test_401_without_or_with_a_wrong_token(flavour: str, token_server: Server) -> None:
    calls: List[Callable[[Any], Awaitable[Any]]] = [
        lambda c: c.limit("sendMessage"),
        lambda c: c.get_server_time(),
        lambda c: c.check("sendMessage"),
        lambda c: c.get_value("sendMessage"),
    ]
    for token in (None, "wrong"):
        for call in calls:
            async with open_client(flavour, token_server.url, token=token) as c:
                e = await raises(call(c))
                assert e.status == 401 and "token" in e.message
    async with open_client(flavour, token_server.url, token=FULL_TOKEN) as c:
        assert (await c.limit("sendMessage", key="x")).ok
        assert await c.get_server_time() > 0


async def test_403_read_token_reads_but_cannot_write(
    flavour: str, read_token_server: Server, key: str
) -> None:
    """Needs a server with `[server] readTokens`."""
    writes: List[Callable[[Any], Awaitable[Any]]] = [
        lambda c: c.limit("sendMessage", key=key),
        lambda c: c.reset("sendMessage", key=key),
        lambda c: c.transaction([LimitCall("sendMessage", key=key)]),
        lambda c: c.adjust("sendMessage", key=key, count=1),
    ]
    for write in writes:
        async with open_client(flavour, read_token_server.url, token=READ_TOKEN) as c:
            e = await raises(write(c))
            assert e.status == 403 and "read token" in e.message
    async with open_client(flavour, read_token_server.url, token=READ_TOKEN) as c:
        assert await c.check("sendMessage", key=key) == Decision(True, None)
        assert (await c.get_value("sendMessage", key=key)).value == 3
        assert await c.get_server_time() > 0
        assert "sendMessage" in await c.get_config()
    async with open_client(flavour, read_token_server.url, token=FULL_TOKEN) as c:
        assert (await c.limit("sendMessage", key=key)).ok
        await c.reset("sendMessage", key=key)


def test_refused_post_keeps_its_connection_or_says_close(token_server: Server) -> None:
    """What a keep-alive client needs: after an error answer, either the connection still
    takes a request, or the answer said `Connection: close`. The headers and the body are
    sent apart, as httpx sends them."""
    host, port = token_server.url[len("http://"):].split(":")
    body = b'{"name":"sendMessage"}'
    head = (
        "POST /v1/limit HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nAuthorization: Bearer wrong\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=2) as sock:
        sock.sendall(head)
        time.sleep(0.05)
        sock.sendall(body)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 401")
        if b"\r\nconnection: close\r\n" in answer.lower():
            return  # announced: a client opens a new connection
        try:
            sock.sendall(b"GET /v1/time HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            again = sock.recv(65536)
        except OSError:
            again = b""
        assert again.startswith(b"HTTP/1.1 401"), "the connection was closed unannounced"


# -- 404, 429 -------------------------------------------------------------------------------


async def test_404_unknown_name(client: Any, key: str) -> None:
    for call in (
        client.limit("noSuchLimit", key=key),
        client.check("noSuchLimit"),
        client.get_value("noSuchLimit"),
        client.transaction([{"name": "noSuchLimit"}]),
    ):
        e = await raises(call)
        assert e.status == 404 and "noSuchLimit" in e.message and not e.may_have_taken


async def test_429_with_throws(client: Any, key: str) -> None:
    for _ in range(3):
        assert (await client.limit("sendMessage", key=key, throws=True)).ok
    for method in (client.limit, client.check):
        try:
            await method("sendMessage", key=key, throws=True)
        except RateLimitError as e:
            assert (e.kind, e.name) == ("RateLimited", "sendMessage")
            assert 5_000 < e.retry_after <= 6_000
            assert not isinstance(e, TollgateError)
        else:
            raise AssertionError("no RateLimitError")
    # Without throws, the same refusal is a Decision.
    assert not (await client.limit("sendMessage", key=key)).ok


def test_error_classes_are_unrelated() -> None:
    assert not issubclass(RateLimitError, TollgateError)
    assert not issubclass(TollgateError, RateLimitError)


# -- 503 ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unreachable_store_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Nothing listens on port 1: the server starts, and every store call fails.
    with tollgate(LIMITS, tmp_path_factory.mktemp("no-store"), "redis://127.0.0.1:1") as s:
        yield s


async def test_503_unreachable_store(flavour: str, unreachable_store_server: Server) -> None:
    async with open_client(flavour, unreachable_store_server.url) as c:
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: c.limit("sendMessage", key="k"),
            lambda: c.check("sendMessage", key="k"),
            lambda: c.get_value("sendMessage", key="k"),
            lambda: c.transaction([{"name": "sendMessage"}]),
            lambda: c.reset("sendMessage", key="k"),
            lambda: c.get_server_time(),
            lambda: c.limit("sendMessage", key="k", throws=True),
        ]
        for call in calls:
            e = await raises(call())
            # The store never saw the request: nothing taken, a retry is safe.
            assert (e.status, e.may_have_taken) == (503, False)
            assert "store" in e.message


async def test_503_may_have_taken(flavour: str, tmp_path: Path) -> None:
    """A store that gets the request and never answers: the server cannot know whether the
    tokens were taken, and says so."""
    config = "[server]\nstoreDeadline = 300\n" + LIMITS
    with fake_redis_that_hangs() as port:
        with tollgate(config, tmp_path, f"redis://127.0.0.1:{port}") as s:
            async with open_client(flavour, s.url) as c:
                e = await raises(c.limit("sendMessage", key="k"))
                assert (e.status, e.may_have_taken) == (503, True)
                assert "may have taken" in e.message


# -- no answer, or not the API's ------------------------------------------------------------


async def test_timeout(flavour: str) -> None:
    with silent_server() as (url, held):
        async with open_client(flavour, url, timeout=0.2) as c:
            start = time.monotonic()
            e = await raises(c.limit("sendMessage", key="k"))
            elapsed = time.monotonic() - start
            # The write went out and no answer came: it may have been applied.
            assert e.status is None and e.may_have_taken
            assert "timed out" in e.message
            assert 0.15 < elapsed < 2
            assert held  # it did connect: the wait was for the answer
            e = await raises(c.check("sendMessage", key="k"))
            assert e.status is None and not e.may_have_taken  # a read takes nothing


async def test_refused_connection(flavour: str) -> None:
    with refusing_address() as url:
        async with open_client(flavour, url) as c:
            for call in (c.limit("sendMessage"), c.get_server_time()):
                e = await raises(call)
                assert e.status is None and not e.may_have_taken
                assert "cannot connect" in e.message


async def test_answer_that_is_not_json(flavour: str) -> None:
    with odd_web_server(200, b"<html>hello</html>") as url:
        async with open_client(flavour, url) as c:
            e = await raises(c.limit("sendMessage"))
            assert e.status == 200 and "not JSON" in e.message and "<html>" in e.message
            e = await raises(c.get_server_time())
            assert e.status == 200
    with odd_web_server(200, b'{"something": "else"}', "application/json") as url:
        async with open_client(flavour, url) as c:
            e = await raises(c.limit("sendMessage"))
            assert e.status == 200 and "not a decision" in e.message
    with odd_web_server(502, b"Bad Gateway", "text/plain") as url:
        async with open_client(flavour, url) as c:
            e = await raises(c.limit("sendMessage"))
            assert e.status == 502 and "Bad Gateway" in e.message
    with odd_web_server(429, b"slow down", "text/plain") as url:
        async with open_client(flavour, url) as c:
            # A 429 that is not tollgate's RateLimited is no decision: a TollgateError.
            e = await raises(c.limit("sendMessage", throws=True))
            assert e.status == 429


def test_closed_client(server: Server) -> None:
    c = RateLimiter(server.url)
    assert c.get_server_time() > 0
    c.close()
    with pytest.raises(TollgateError, match="closed"):
        c.get_server_time()


async def test_closed_async_client(server: Server) -> None:
    c = AsyncRateLimiter(server.url)
    assert await c.get_server_time() > 0
    await c.aclose()
    with pytest.raises(TollgateError, match="closed"):
        await c.get_server_time()


async def test_calls_beyond_the_pool_wait_at_most_the_timeout() -> None:
    """AsyncRateLimiter queues calls beyond max_connections itself, bounded by `timeout`;
    a slot is given back whatever the call's fate."""
    import asyncio

    with silent_server() as (url, _):
        async with AsyncRateLimiter(url, timeout=0.2, max_connections=1) as c:
            start = time.monotonic()
            results = await asyncio.gather(
                *(c.limit("sendMessage") for _ in range(3)), return_exceptions=True
            )
            assert time.monotonic() - start < 2
            assert all(isinstance(r, TollgateError) and r.status is None for r in results)
            messages = sorted(str(r) for r in results)
            assert sum("waiting for a free connection" in m for m in messages) >= 1
            assert sum("waiting for the answer" in m for m in messages) >= 1
            # The slots came back: the next call gets as far as the socket again.
            e = await raises(c.limit("sendMessage"))
            assert "waiting for the answer" in e.message


def test_max_connections_is_checked() -> None:
    with pytest.raises(ValueError):
        RateLimiter("http://127.0.0.1:1", max_connections=0)
    with pytest.raises(ValueError):
        AsyncRateLimiter("http://127.0.0.1:1", max_connections=0)


def test_token_is_checked() -> None:
    for token in ("", "tök", "a b", "a\nb"):
        with pytest.raises(ValueError):
            RateLimiter("http://127.0.0.1:1", token=token)
