"""A concurrency limit in the middleware (``concurrency=``), through real HTTP: FastAPI under
uvicorn, Django under a threaded WSGI server and as an ASGI app under uvicorn. A slot is
acquired before the handler and let go once the response ends, however it ends: the last
body sent, the handler raising, the client gone mid-stream; a refusal is 429 (or 503) with
``Retry-After``; a request refused by the concurrency limit takes no rate limit's token, and
one refused by the rate limits gives its slot back at once."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any, Callable, Dict, Iterator, List, Tuple
from urllib.parse import urlsplit
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
from conftest import fresh
from test_guide import ROOT, blocks  # before test_middleware, which puts the client's tests first on the path
from test_middleware import django_settings, get

from pytollgate import MINUTE, AsyncRateLimiter, RateLimiter

#: One slot, held 30 s at most: a refusal's Retry-After is 30 (29.9... s, up).
SLOT = {"kind": "concurrency", "max": 1, "ttl": "30s"}
USER = {"x-user": "alice"}


class Gates:
    """What the test's handlers wait for: ``entered`` once a handler runs, ``go`` to let it
    answer (threading events: the servers run in threads of their own)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()

    async def wait_async(self) -> None:
        self.entered.set()
        while not self.go.is_set():
            await asyncio.sleep(0.005)

    def wait(self) -> None:
        self.entered.set()
        assert self.go.wait(10)


def in_background(url: str) -> Tuple[threading.Thread, List[Any]]:
    answers: List[Any] = []
    thread = threading.Thread(target=lambda: answers.append(get(url, USER)), daemon=True)
    thread.start()
    return thread, answers


def in_flight(limiter: Any, name: str, key: str = "alice") -> int:
    if isinstance(limiter, AsyncRateLimiter):
        return asyncio.run(limiter.get_slots_value(name, key)).in_flight
    return int(limiter.get_slots_value(name, key).in_flight)


def eventually_free(limiter: Any, name: str) -> None:
    """The slot is let go soon (a stream's end is seen by the server a moment later)."""
    deadline = time.monotonic() + 5
    while in_flight(limiter, name) != 0:
        assert time.monotonic() < deadline, "the slot was never let go"
        time.sleep(0.02)


def hang_up_mid_stream(url: str) -> None:
    """A GET whose client reads the head and a first chunk of the body, then leaves."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
        s.sendall(f"GET {parts.path} HTTP/1.1\r\nHost: x\r\nx-user: alice\r\n\r\n".encode())
        received = b""
        while b"chunk" not in received:
            data = s.recv(4096)
            assert data, received
            received += data
        assert received.split(b" ")[1] == b"200", received


def the_one_slot(url: str, limiter: Any, name: str, gates: Gates, refused_status: int) -> None:
    """One request holds the slot; a second is refused with ``refused_status``, Retry-After
    30 and tollgate's body; once the first is answered, no slot is in flight."""
    first, answers = in_background(url + "slow")
    assert gates.entered.wait(10)
    assert in_flight(limiter, name) == 1
    status, headers, body = get(url + "slow", USER)
    assert status == refused_status
    assert headers["retry-after"] == "30"
    answer = json.loads(body)
    assert answer["kind"] == "RateLimited" and answer["name"] == name
    assert 29_000 < answer["retryAfter"] <= 30_000
    assert "ratelimit" not in headers  # no rate limit was taken from
    gates.go.set()
    first.join(10)
    assert answers[0][0] == 200 and answers[0][2] == "done"
    assert in_flight(limiter, name) == 0


def order_with_the_rate_limits(url: str, limiter: Any, slots: str, rate: str, gates: Gates) -> None:
    """The rate limit has 2 tokens. A request refused by the concurrency limit takes none;
    one refused by the rate limit gives its slot back at once."""
    first, answers = in_background(url + "slow")
    assert gates.entered.wait(10)
    assert json.loads(get(url + "slow", USER)[2])["name"] == slots  # refused: the slot
    gates.go.set()
    first.join(10)
    assert answers[0][0] == 200
    assert answers[0][1]["ratelimit"] == f'"{rate}";r=1;t=30'  # the refused request took no token
    assert get(url + "fast", USER)[0] == 200  # the second token
    for _ in range(2):
        status, headers, body = get(url + "fast", USER)
        # Refused by the rate limit, not by a slot left held by the request before.
        assert (status, json.loads(body)["name"]) == (429, rate)
        assert headers["ratelimit"] == f'"{rate}";r=0;t=60'
    assert in_flight(limiter, slots) == 0


def rate_and_slot(slots: str, rate: str) -> Dict[str, Any]:
    return {slots: SLOT, rate: {"kind": "token bucket", "rate": 2, "period": MINUTE, "capacity": 2}}


# ASGI: FastAPI under uvicorn.


def fastapi_app(limiter: Any, gates: Gates, **options: Any) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse, StreamingResponse

    from pytollgate.asgi import RateLimitMiddleware

    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=limiter, key={"header": "x-user"}, **options)

    @app.get("/slow", response_class=PlainTextResponse)
    async def slow() -> str:
        await gates.wait_async()
        return "done"

    @app.get("/fast", response_class=PlainTextResponse)
    async def fast() -> str:
        return "done"

    @app.get("/fails")
    async def fails() -> str:
        raise RuntimeError("the handler failed")

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks() -> Any:
            yield b"chunk 0\n"
            gates.entered.set()
            while True:  # until the client leaves
                await asyncio.sleep(0.01)
                yield b"chunk\n"

        return StreamingResponse(chunks())

    @app.get("/stream-to-the-end")
    async def stream_to_the_end() -> StreamingResponse:
        async def chunks() -> Any:
            yield b"chunk 0\n"
            await gates.wait_async()
            yield b"the end\n"

        return StreamingResponse(chunks())

    return app


@pytest.mark.parametrize("status", [429, 503])
def test_asgi_one_slot(status: int, asgi_server: Callable[..., str]) -> None:
    name, gates = fresh("slots"), Gates()
    limiter = AsyncRateLimiter("memory", limits={name: SLOT})
    options = {} if status == 429 else {"concurrency_status_code": 503}
    url = asgi_server(fastapi_app(limiter, gates, concurrency=name, **options)) + "/"
    the_one_slot(url, limiter, name, gates, status)


def test_asgi_slot_let_go_when_the_handler_raises_or_the_client_leaves(asgi_server: Callable[..., str]) -> None:
    name, gates = fresh("slots"), Gates()
    limiter = AsyncRateLimiter("memory", limits={name: SLOT})
    url = asgi_server(fastapi_app(limiter, gates, concurrency=name)) + "/"
    assert get(url + "fails", USER)[0] == 500
    assert in_flight(limiter, name) == 0
    hang_up_mid_stream(url + "stream")
    eventually_free(limiter, name)
    assert get(url + "fast", USER)[0] == 200


def test_asgi_a_stream_holds_its_slot_to_its_last_chunk(asgi_server: Callable[..., str]) -> None:
    import httpx

    name, gates = fresh("slots"), Gates()
    limiter = AsyncRateLimiter("memory", limits={name: SLOT})
    url = asgi_server(fastapi_app(limiter, gates, concurrency=name)) + "/"
    with httpx.Client(timeout=10) as client:
        with client.stream("GET", url + "stream-to-the-end", headers=USER) as response:
            chunks = response.iter_bytes()
            assert next(chunks).startswith(b"chunk 0")
            assert in_flight(limiter, name) == 1  # the handler returned; its body goes on
            assert get(url + "fast", USER)[0] == 429
            gates.go.set()
            assert b"".join(chunks).endswith(b"the end\n")
    eventually_free(limiter, name)


def test_asgi_order_with_the_rate_limits(asgi_server: Callable[..., str]) -> None:
    slots, rate, gates = fresh("slots"), fresh("rate"), Gates()
    limiter = AsyncRateLimiter("memory", limits=rate_and_slot(slots, rate))
    url = asgi_server(fastapi_app(limiter, gates, limits=rate, concurrency=slots)) + "/"
    order_with_the_rate_limits(url, limiter, slots, rate, gates)


def test_the_options_are_checked_when_the_middleware_is_made() -> None:
    from pytollgate.asgi import RateLimitMiddleware

    name, rate = fresh("slots"), fresh("rate")
    limiter = AsyncRateLimiter("memory", limits={name: SLOT, rate: "5/minute"})

    def app(*_: Any) -> None: ...

    def made(**options: Any) -> Any:
        return RateLimitMiddleware(app, limiter=limiter, **options)

    with pytest.raises(TypeError, match="limits .* concurrency .* or both"):
        made()
    with pytest.raises(ValueError, match="not defined on the limiter .*its concurrency limits: " + name):
        made(concurrency="nope")
    with pytest.raises(ValueError, match="a rate limit, not a concurrency limit"):
        made(concurrency=rate)
    with pytest.raises(ValueError, match=f"give it as concurrency='{name}'"):
        made(limits=name)
    with pytest.raises(ValueError, match="could never be granted .*max is 1"):
        made(concurrency={"name": name, "count": 2})
    with pytest.raises(ValueError, match="whole number of slots"):
        made(concurrency={"name": name, "count": 0})
    with pytest.raises(ValueError, match="ttl"):
        made(concurrency={"name": name, "ttl": 0})
    with pytest.raises(ValueError, match="no option tll"):
        made(concurrency={"name": name, "tll": "1m"})
    with pytest.raises(ValueError, match="concurrency_status_code"):
        made(concurrency=name, concurrency_status_code=200)
    with pytest.raises(TypeError, match="AsyncRateLimiter"):
        RateLimitMiddleware(app, limiter=RateLimiter("memory", limits={name: SLOT}), concurrency=name)
    assert made(concurrency={"name": name, "count": 1, "ttl": "2m"}).slots.ttl == 120_000


# Django: its WSGI handler under a threaded wsgiref, and its ASGI handler under uvicorn.


class Threaded(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


DJANGO_GATES = Gates()


def django_slow(_request: Any) -> Any:
    from django.http import HttpResponse

    DJANGO_GATES.wait()
    return HttpResponse("done")


async def django_slow_async(_request: Any) -> Any:
    from django.http import HttpResponse

    await DJANGO_GATES.wait_async()
    return HttpResponse("done")


def django_fast(_request: Any) -> Any:
    from django.http import HttpResponse

    return HttpResponse("done")


def django_fails(_request: Any) -> Any:
    raise RuntimeError("the view failed")


def django_stream(_request: Any) -> Any:
    from django.http import StreamingHttpResponse

    def chunks() -> Iterator[bytes]:
        yield b"chunk 0\n"
        while True:  # until the client leaves
            time.sleep(0.01)
            yield b"chunk\n"

    return StreamingHttpResponse(chunks())


async def django_stream_async(_request: Any) -> Any:
    from django.http import StreamingHttpResponse

    async def chunks() -> Any:
        yield b"chunk 0\n"
        while True:
            await asyncio.sleep(0.01)
            yield b"chunk\n"

    return StreamingHttpResponse(chunks())


def urlpatterns_of(asynchronous: bool) -> Any:
    from django.urls import path

    return [
        path("slow", django_slow_async if asynchronous else django_slow),
        path("fast", django_fast),
        path("fails", django_fails),
        path("stream", django_stream_async if asynchronous else django_stream),
    ]


@pytest.fixture
def django_urls(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """The URLs of this file's views for the test (sync or async views), as Django reads
    ``settings.ROOT_URLCONF`` for each request."""
    import sys
    import types

    def use(asynchronous: bool) -> None:
        django_settings()  # configured, if no test did so before
        from django.conf import settings

        module = types.ModuleType(f"slot_urls_{asynchronous}")
        module.urlpatterns = urlpatterns_of(asynchronous)  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setattr(settings, "ROOT_URLCONF", module.__name__)

    return use


def django_wsgi(**tollgate: Any) -> Tuple[str, Callable[[], None]]:
    django_settings(key={"header": "x-user"}, **tollgate)
    from django.core.wsgi import get_wsgi_application

    httpd = make_server("127.0.0.1", 0, get_wsgi_application(), server_class=Threaded, handler_class=Quiet)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()

    def stop() -> None:
        httpd.shutdown()
        thread.join(10)

    return f"http://127.0.0.1:{httpd.server_port}/", stop


@pytest.fixture
def django_gates() -> Gates:
    global DJANGO_GATES
    DJANGO_GATES = Gates()
    return DJANGO_GATES


def test_django_wsgi_one_slot_and_how_it_is_let_go(django_urls: Callable[[bool], None], django_gates: Gates) -> None:
    django_urls(False)
    name = fresh("slots")
    limiter = RateLimiter("memory", limits={name: SLOT})
    url, stop = django_wsgi(limiter=limiter, concurrency=name, concurrency_status_code=503)
    try:
        the_one_slot(url, limiter, name, django_gates, 503)
        assert get(url + "fails", USER)[0] == 500
        assert in_flight(limiter, name) == 0
        hang_up_mid_stream(url + "stream")
        eventually_free(limiter, name)
    finally:
        stop()


def test_django_wsgi_order_with_the_rate_limits(django_urls: Callable[[bool], None], django_gates: Gates) -> None:
    django_urls(False)
    slots, rate = fresh("slots"), fresh("rate")
    limiter = RateLimiter("memory", limits=rate_and_slot(slots, rate))
    url, stop = django_wsgi(limiter=limiter, limits=rate, concurrency=slots)
    try:
        order_with_the_rate_limits(url, limiter, slots, rate, django_gates)
    finally:
        stop()


def test_django_asgi_one_slot_and_how_it_is_let_go(
    django_urls: Callable[[bool], None], django_gates: Gates, asgi_server: Callable[..., str]
) -> None:
    """Django's ASGI handler under uvicorn, async views, an AsyncRateLimiter: the client
    that leaves mid-stream has its request cancelled by Django."""
    django_urls(True)
    name = fresh("slots")
    limiter = AsyncRateLimiter("memory", limits={name: SLOT})
    django_settings(limiter=limiter, key={"header": "x-user"}, concurrency=name)
    from django.core.asgi import get_asgi_application

    url = asgi_server(get_asgi_application()) + "/"
    the_one_slot(url, limiter, name, django_gates, 429)
    assert get(url + "fails", USER)[0] == 500
    assert in_flight(limiter, name) == 0
    hang_up_mid_stream(url + "stream")
    eventually_free(limiter, name)
    assert get(url + "fast", USER)[0] == 200


def test_django_view_decorator_holds_a_slot(django_gates: Gates) -> None:
    from django.test import RequestFactory

    from pytollgate.django import rate_limit

    django_settings(limiter=RateLimiter("memory", limits={"unused": "1/minute"}), limits="unused")
    name = fresh("slots")
    limiter = RateLimiter("memory", limits={name: SLOT})
    view = rate_limit(limiter, concurrency=name, key="global")(django_slow)
    request = RequestFactory().get("/")
    thread = threading.Thread(target=view, args=(request,), daemon=True)
    thread.start()
    assert django_gates.entered.wait(10)
    refused = view(RequestFactory().get("/"))
    assert refused.status_code == 429 and refused["Retry-After"] == "30"
    django_gates.go.set()
    thread.join(10)
    assert limiter.get_slots_value(name).in_flight == 0


def test_the_chapters_middleware_block_serves_what_it_says(asgi_server: Callable[..., str]) -> None:
    """The Python block of "In the middleware" (docs/src/concepts/concurrency.md), served:
    2 exports of a user at once, a third refused."""
    page = ROOT / "docs" / "src" / "concepts" / "concurrency.md"
    (line, text), = [(line, text) for line, text in blocks(page) if "RateLimitMiddleware" in text]
    scope: Dict[str, Any] = {"__name__": "guide"}
    exec(compile(text, f"{page.relative_to(ROOT)}:{line}", "exec"), scope)
    app, gates = scope["app"], Gates()

    @app.get("/exports")
    async def export() -> str:
        await gates.wait_async()
        return "done"

    url = asgi_server(app) + "/exports"
    held = [in_background(url) for _ in range(2)]
    deadline = time.monotonic() + 10
    while in_flight(scope["limiter"], "exportsInFlight") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    status, headers, _ = get(url, USER)
    assert (status, headers["retry-after"]) == (429, "300")
    gates.go.set()
    for thread, answers in held:
        thread.join(10)
        assert answers[0][0] == 200


def test_under_gunicorn_with_uvicorn_workers_on_redis() -> None:
    """As deployed: gunicorn, 2 uvicorn worker processes, one concurrency limit of 2 on Redis.
    6 requests at once, each held 1 s: exactly 2 answered, 4 refused, whichever worker took
    them; then none in flight. A client that leaves mid-stream frees its slot in its worker."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from conftest import networked
    from network import free_port

    url = networked("TOLLGATE_REDIS_URL")
    if url is None:
        pytest.skip("no TOLLGATE_REDIS_URL")
    name, port = fresh("gunicorn"), free_port()
    env = {**os.environ, "SLOTS_STORE": url, "SLOTS_NAME": name, "SLOTS_HOLD": "1"}
    command = [
        sys.executable, "-m", "gunicorn", "--workers", "2", "--worker-class", "uvicorn.workers.UvicornWorker",
        "--bind", f"127.0.0.1:{port}", "--timeout", "20", "--chdir", str(Path(__file__).resolve().parent),
        "--log-level", "warning", "slots_app:app",
    ]
    server = subprocess.Popen(command, env=env, start_new_session=True)
    limiter = RateLimiter(url, limits={name: {"kind": "concurrency", "max": 2, "ttl": "30s"}})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while get_or_none(base + "/slow") is None:
            assert time.monotonic() < deadline and server.poll() is None, "gunicorn did not start"
            time.sleep(0.1)
        while limiter.get_slots_value(name).in_flight:  # the probe's slot
            time.sleep(0.05)
        answers: List[Any] = []
        threads = [threading.Thread(target=lambda: answers.append(get(base + "/slow"))) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        statuses = sorted(status for status, _, _ in answers)
        assert statuses == [200] * 2 + [429] * 4, statuses
        assert all(headers["retry-after"] == "30" for status, headers, _ in answers if status == 429)
        assert limiter.get_slots_value(name).in_flight == 0
        for _ in range(2):  # whichever worker takes it
            hang_up_mid_stream(base + "/stream")
        deadline = time.monotonic() + 5
        while limiter.get_slots_value(name).in_flight:
            assert time.monotonic() < deadline, "a slot was never let go"
            time.sleep(0.02)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


def get_or_none(url: str) -> Any:
    try:
        return get(url)
    except OSError:
        return None


def test_django_a_stream_dropped_unread_frees_its_slot() -> None:
    """A streaming response that no server iterates nor closes (Django's ASGI handler, when
    a disconnect cancels the request as it sends a chunk) frees its slot when it is dropped."""
    import gc

    from django.test import RequestFactory

    from pytollgate.django import rate_limit

    django_settings()
    name = fresh("slots")
    limiter = RateLimiter("memory", limits={name: SLOT})
    view = rate_limit(limiter, concurrency=name, key="global")(django_stream)
    response = view(RequestFactory().get("/"))
    assert limiter.get_slots_value(name).in_flight == 1
    assert next(iter(response)) == b"chunk 0\n"
    del response
    gc.collect()
    assert limiter.get_slots_value(name).in_flight == 0
