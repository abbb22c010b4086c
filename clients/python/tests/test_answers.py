"""The client against loopback servers of the tests' own that answer what tollgate never
would: answers trickled a byte at a time, cut short, stalled or too large, of the wrong
shape, connections dropped after the request. Every call ends with a TollgateError (or a
RateLimitError for a well-formed 429) within its timeout, in both clients."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Awaitable, Callable, Dict, List, Tuple

import pytest
from conftest import open_client
from servers import (
    http_answer,
    refusing_address,
    scripted_server,
    unaccepting_address,
)

from tollgate_client import (
    Acquired,
    AsyncRateLimiter,
    Decision,
    RateLimiter,
    RateLimitError,
    Renewed,
    SlotsValue,
    TollgateError,
    TransactionResult,
    ValueReading,
)

WINDOW = {"kind": "fixed window", "rate": 5, "period": 60_000, "start": 0}
MiB = 1024 * 1024
DEFAULT_CAP = 8 * MiB


async def raises(call: Awaitable[Any]) -> TollgateError:
    try:
        result = await call
    except TollgateError as e:
        return e
    raise AssertionError(f"no TollgateError: {result!r}")


def trickle(answer: bytes, at_once: int = 0) -> Callable[[socket.socket, threading.Event], None]:
    """A script that sends `answer[:at_once]`, then the rest a byte every 0.1 s (a few
    seconds in all, ended early when the connection or the block ends)."""

    def script(conn: socket.socket, stop: threading.Event) -> None:
        try:
            conn.sendall(answer[:at_once])
            for i in range(at_once, len(answer)):
                if stop.wait(0.1):
                    return
                conn.sendall(answer[i : i + 1])
        except OSError:
            return

    return script


# -- the timeout is a deadline for the whole call -------------------------------------------


async def test_an_answer_trickled_a_byte_at_a_time_is_cut_off_at_the_timeout(
    flavour: str,
) -> None:
    """Each byte comes well within the timeout: only a deadline for the whole call ends it.
    Trickled from the first byte (the headers), and after the headers (the body)."""
    body = b'{"ok":true' + b" " * 40 + b"}"
    for at_once, write in ((0, True), (len(http_answer(200, body)) - len(body), False)):
        with scripted_server(trickle(http_answer(200, body), at_once)) as url:
            async with open_client(flavour, url, timeout=1.0) as c:
                call = c.limit if write else c.check
                start = time.monotonic()
                e = await raises(call("a", config=WINDOW))
                elapsed = time.monotonic() - start
                assert e.status is None and "timed out" in e.message, e
                assert 0.9 < elapsed < 2.5, elapsed
                assert e.may_have_taken is write


async def test_a_body_cut_short_or_stalled_is_an_error(flavour: str) -> None:
    head = http_answer(200, b"", {"Content-Length": "50"})

    def cut(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(head + b'{"ok":true')
        conn.close()

    with scripted_server(cut) as url:
        async with open_client(flavour, url, timeout=3.0) as c:
            start = time.monotonic()
            e = await raises(c.limit("a", config=WINDOW))
            assert time.monotonic() - start < 2.5, "ended when the connection closed"
            assert e.status is None and e.may_have_taken
            e = await raises(c.check("a", config=WINDOW))
            assert e.status is None and not e.may_have_taken
    with scripted_server(trickle(head + b'{"ok":true', at_once=len(head) + 10)) as url:
        async with open_client(flavour, url, timeout=0.3) as c:
            e = await raises(c.get_server_time())
            assert e.status is None and "timed out" in e.message


# -- the size of an answer is capped --------------------------------------------------------


def too_large(mode: str) -> Callable[[socket.socket, threading.Event], None]:
    def script(conn: socket.socket, stop: threading.Event) -> None:
        try:
            if mode == "declared":
                # Declares 9 MiB and sends little: refused on its headers, not at the timeout.
                conn.sendall(http_answer(200, b"[1,", {"Content-Length": str(9 * MiB)}))
            elif mode == "chunked":
                # No length: 9 MiB of a JSON array, chunk by chunk, then its end.
                conn.sendall(b"HTTP/1.1 200 X\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n[\r\n")
                chunk = b"1," * (MiB // 2)
                for _ in range(9):
                    conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                conn.sendall(b"1\r\n]\r\n0\r\n\r\n")
            else:
                conn.sendall(http_answer(200, b'{"ok":true' + b" " * 200 + b"}"))
        except OSError:
            return

    return script


async def test_an_answer_larger_than_max_answer_bytes_is_refused(flavour: str) -> None:
    for mode in ("declared", "chunked"):
        with scripted_server(too_large(mode)) as url:
            async with open_client(flavour, url, timeout=5.0) as c:
                start = time.monotonic()
                e = await raises(c.get_config())
                assert time.monotonic() - start < 4, "refused, not timed out"
                assert e.status == 200, mode
                assert f"larger than max_answer_bytes ({DEFAULT_CAP} bytes)" in e.message, e
                assert not e.may_have_taken
    with scripted_server(too_large("small")) as url:
        async with open_client(flavour, url, max_answer_bytes=100) as c:
            e = await raises(c.limit("a", config=WINDOW))
            assert "larger than max_answer_bytes (100 bytes)" in e.message
            assert e.may_have_taken, "a write was answered, but what it did is unknown"
        async with open_client(flavour, url, max_answer_bytes=1000) as c:
            assert await c.limit("a", config=WINDOW) == Decision(True)


def test_max_answer_bytes_is_checked() -> None:
    for cls in (RateLimiter, AsyncRateLimiter):
        for bad in (0, -1):
            with pytest.raises(ValueError, match="max_answer_bytes"):
                cls("http://127.0.0.1:1", max_answer_bytes=bad)
        for wrong in (1.5, True, "10"):
            with pytest.raises(TypeError, match="max_answer_bytes"):
                cls("http://127.0.0.1:1", max_answer_bytes=wrong)  # type: ignore[arg-type]


# -- answers of the wrong shape -------------------------------------------------------------

VALUE = {"value": 1, "ts": 2, "shard": 0, "config": WINDOW}

# Bodies a 200 may not carry, per operation (as sent: JSON that Python's json reads).
WRONG: Dict[str, List[str]] = {
    "limit": [
        '{"ok":"true"}',
        '{"ok":1}',
        '{"ok":"false"}',
        '{"ok":null}',
        "{}",
        "[]",
        "null",
        '"ok"',
        '{"ok":true,"retryAfter":-1}',
        '{"ok":true,"retryAfter":"5"}',
        '{"ok":true,"retryAfter":null}',
        '{"ok":true,"retryAfter":true}',
        '{"ok":true,"retryAfter":NaN}',
        '{"ok":true,"retryAfter":Infinity}',
        '{"ok":true,"retryAfter":1e999}',
    ],
    "transaction": [
        '{"ok":true,"results":[]}',
        '{"ok":true,"results":[{"ok":true}]}',
        '{"ok":true,"results":[{"ok":true},{"ok":"true"}]}',
        '{"ok":true,"results":[{"ok":true},{"ok":true},{"ok":true}]}',
        '{"ok":true,"results":{"0":{"ok":true},"1":{"ok":true}}}',
        '{"ok":"true","results":[{"ok":true},{"ok":true}]}',
        '{"ok":false,"retryAfter":-5,"results":[{"ok":true},{"ok":false,"retryAfter":5}]}',
    ],
    "reset": ["[]", "null", '"done"'],
    "get_value": [
        json.dumps({**VALUE, "value": "1"}),
        json.dumps({**VALUE, "ts": None}),
        json.dumps({**VALUE, "shard": 0.5}),
        json.dumps({**VALUE, "shard": -1}),
        json.dumps({**VALUE, "shard": True}),
        json.dumps({**VALUE, "config": "x"}),
        '{"value":1,"ts":2,"shard":0}',
        '{"value":NaN,"ts":2,"shard":0,"config":{}}',
        '{"value":1e999,"ts":2,"shard":0,"config":{}}',
    ],
    "get_server_time": ['{"now":"5"}', '{"now":null}', "{}", "[5]", '{"now":-Infinity}'],
    "get_config": ["[]", "null", '{"a":1}', '{"a":[]}', "[" * 100_000],
    "acquire": [
        '{"ok":"true","ticket":"1","expiresAt":5}',
        '{"ok":true,"expiresAt":5}',
        '{"ok":true,"ticket":1,"expiresAt":5}',
        '{"ok":true,"ticket":"1a","expiresAt":5}',
        '{"ok":true,"ticket":"","expiresAt":5}',
        '{"ok":true,"ticket":"\u0661","expiresAt":5}',
        '{"ok":true,"ticket":"1"}',
        '{"ok":true,"ticket":"1","expiresAt":-5}',
        '{"ok":true,"ticket":"1","expiresAt":NaN}',
        '{"ok":false}',
        '{"ok":false,"retryAfter":-1}',
        "null",
    ],
    "release": ["{}", '{"released":"true"}', '{"released":1}', "[true]", "true"],
    "renew": ['{"ok":true}', '{"ok":true,"expiresAt":"5"}', '{"ok":1,"expiresAt":5}', "{}", "null"],
    "get_slots_value": [
        '{"inFlight":1,"max":2}',
        '{"inFlight":1.5,"max":2,"holders":1}',
        '{"inFlight":-1,"max":2,"holders":1}',
        '{"inFlight":"1","max":2,"holders":1}',
        '{"inFlight":true,"max":2,"holders":1}',
        json.dumps(VALUE),
    ],
}
WRONG["check"] = WRONG["limit"]

# Bodies a 200 may carry, and what the call answers.
RIGHT: Dict[str, List[Tuple[str, Any]]] = {
    "limit": [
        ('{"ok":true}', Decision(True)),
        ('{"ok":false,"retryAfter":5.5}', Decision(False, 5.5)),
        ('{"ok":true,"retryAfter":0,"later":"a newer server\'s field"}', Decision(True, 0)),
    ],
    "transaction": [
        (
            '{"ok":false,"retryAfter":5,"results":[{"ok":true},{"ok":false,"retryAfter":5}]}',
            TransactionResult(False, 5, [Decision(True), Decision(False, 5)]),
        )
    ],
    "reset": [("{}", None)],
    "get_value": [
        (json.dumps(VALUE), ValueReading(1, 2, 0, WINDOW)),
        (json.dumps({**VALUE, "value": -2.5, "shard": 3.0}), ValueReading(-2.5, 2, 3, WINDOW)),
    ],
    "get_server_time": [('{"now":1700000000000}', 1_700_000_000_000)],
    "get_config": [(json.dumps({"a": WINDOW}), {"a": WINDOW}), ("{}", {})],
    "acquire": [
        ('{"ok":true,"ticket":"12","expiresAt":5.5,"later":1}', Acquired(True, "12", 5.5)),
        ('{"ok":false,"retryAfter":250}', Acquired(False, retry_after=250)),
    ],
    "release": [('{"released":true}', True), ('{"released":false}', False)],
    "renew": [
        ('{"ok":true,"expiresAt":9}', Renewed(True, 9)),
        ('{"ok":false,"expiresAt":"x"}', Renewed(False)),
    ],
    "get_slots_value": [('{"inFlight":1,"max":2.0,"holders":1}', SlotsValue(1, 2, 1))],
}
RIGHT["check"] = RIGHT["limit"]


def canned(answer: Dict[str, Any]) -> Callable[[socket.socket, threading.Event], None]:
    """A script answering each request with `answer["status"]` and `answer["body"]`, as
    they are when the request comes (a test changes them between calls)."""

    def script(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(http_answer(answer["status"], answer["body"]))

    return script


def operations(c: Any) -> Dict[str, Callable[[], Awaitable[Any]]]:
    two = [{"name": "a"}, {"name": "a", "key": "k"}]
    return {
        "limit": lambda: c.limit("a"),
        "check": lambda: c.check("a"),
        "transaction": lambda: c.transaction(two),
        "reset": lambda: c.reset("a"),
        "get_value": lambda: c.get_value("a"),
        "get_server_time": lambda: c.get_server_time(),
        "get_config": lambda: c.get_config(),
        "acquire": lambda: c.acquire("slots"),
        "release": lambda: c.release("slots", ticket="7"),
        "renew": lambda: c.renew("slots", ticket="7"),
        "get_slots_value": lambda: c.get_slots_value("slots"),
    }


async def test_an_answer_of_the_wrong_shape_is_a_tollgate_error(flavour: str) -> None:
    answer: Dict[str, Any] = {"status": 200}
    with scripted_server(canned(answer)) as url:
        async with open_client(flavour, url, limits={"a": WINDOW}) as c:
            for name, call in operations(c).items():
                for body in WRONG[name]:
                    answer["body"] = body.encode()
                    e = await raises(call())
                    assert e.status == 200, (name, body)
                    assert e.message.startswith("unexpected answer from /v1/"), (name, body, e)
                for body, expected in RIGHT[name]:
                    answer["body"] = body.encode()
                    assert await call() == expected, (name, body)


async def test_a_429_is_a_rate_limit_error_only_when_it_is_tollgates(flavour: str) -> None:
    answer: Dict[str, Any] = {"status": 429}
    with scripted_server(canned(answer)) as url:
        async with open_client(flavour, url, limits={"a": WINDOW}) as c:
            answer["body"] = b'{"kind":"RateLimited","name":"a","retryAfter":1500}'
            try:
                await c.limit("a", throws=True)
            except RateLimitError as e:
                assert (e.name, e.retry_after) == ("a", 1500)
            else:
                raise AssertionError("no RateLimitError")
            for body in (
                {"kind": "RateLimited", "name": "a", "retryAfter": "soon"},
                {"kind": "RateLimited", "name": "a", "retryAfter": -1},
                {"kind": "RateLimited", "name": 5, "retryAfter": 1},
                {"kind": "RateLimited", "name": "a"},
                {"kind": "Other", "name": "a", "retryAfter": 1},
            ):
                answer["body"] = json.dumps(body).encode()
                e = await raises(c.limit("a", throws=True))
                assert (e.status, e.may_have_taken) == (429, False)
            # An error body is {"error": str}: its message; anything else is quoted, shortened.
            answer["status"] = 400
            answer["body"] = b'{"error":5}' + b" " * 1000
            e = await raises(c.limit("a"))
            assert e.status == 400 and '{"error":5}' in e.message and len(e.message) < 300
            answer["status"] = 503
            answer["body"] = b'{"error":"the store failed","mayHaveTaken":"yes"}'
            e = await raises(c.limit("a"))
            assert (e.message, e.may_have_taken) == ("the store failed", False), "only true is"


# -- may_have_taken -------------------------------------------------------------------------


async def test_may_have_taken_for_a_write_sent_and_left_unanswered_never_for_a_read(
    flavour: str,
) -> None:
    """True for a write (limit, transaction, reset, acquire, release, renew) that was sent
    and got no answer that could be read (timed out, connection lost, an answer not the
    API's unless a 4xx); false for a read (check, get_value, get_slots_value,
    get_server_time, get_config), and for a request never sent (refused, or timed out while
    connecting)."""
    behaviour = ""

    def script(conn: socket.socket, stop: threading.Event) -> None:
        answers = {
            "502": http_answer(502, b"<html>Bad Gateway</html>"),
            "400": http_answer(400, b"<html>Bad Request</html>"),
            "garbage": http_answer(200, b"<html>hello</html>"),
        }
        if behaviour == "drop":
            conn.close()  # the request was read: then the connection is lost
        elif behaviour in answers:
            conn.sendall(answers[behaviour])
        # "silent": never answers

    writes = ("limit", "transaction", "reset", "acquire", "release", "renew")
    with scripted_server(script) as url:
        async with open_client(flavour, url, timeout=0.3, limits={"a": WINDOW}) as c:
            for behaviour in ("silent", "drop", "502", "garbage", "400"):
                for name, call in operations(c).items():
                    e = await raises(call())
                    expected = name in writes and behaviour != "400"
                    assert e.may_have_taken is expected, (behaviour, name, e)
    for where in (refusing_address, unaccepting_address):
        with where() as url:
            async with open_client(flavour, url, timeout=0.3, limits={"a": WINDOW}) as c:
                for name, call in operations(c).items():
                    e = await raises(call())
                    assert e.status is None and not e.may_have_taken, (where, name, e)
