"""The ASGI (FastAPI) and Django middleware through real HTTP requests to a real listening app
(uvicorn; wsgiref), over the in-process limiter and over a tollgate server's client: the
status, the header fields and the body as the tower layer writes them (`"name";q=<rate in
the window>;w=<window s>`, `"name";r=<remaining, down>;t=<s until full, up>`, `Retry-After`
in whole seconds up, `{"kind": "RateLimited", "name", "retryAfter"}`)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
from conftest import fresh

import tollgate_client
from pytollgate import MINUTE, AsyncRateLimiter, RateLimiter

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "clients" / "python" / "tests"))
from servers import tollgate  # noqa: E402

CONFIG = {"kind": "token bucket", "rate": 10, "period": MINUTE, "capacity": 2}


def get(url: str, headers: Optional[Dict[str, str]] = None) -> Tuple[int, Dict[str, str], str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()


def three_requests(url: str, name: str) -> None:
    user = {"x-user": "alice"}
    status, headers, body = get(url, user)
    assert (status, body) == (200, "hello")
    assert headers["ratelimit-policy"] == f'"{name}";q=10;w=60'
    assert headers["ratelimit"] == f'"{name}";r=1;t=6'
    status, headers, _ = get(url, user)
    assert status == 200 and headers["ratelimit"] == f'"{name}";r=0;t=12'
    status, headers, body = get(url, user)
    assert status == 429
    assert headers["ratelimit-policy"] == f'"{name}";q=10;w=60'
    assert headers["ratelimit"] == f'"{name}";r=0;t=12'
    assert headers["retry-after"] == "6"
    assert headers["content-type"].startswith("application/json")
    answer = json.loads(body)
    assert answer["kind"] == "RateLimited" and answer["name"] == name
    assert 5_000 < answer["retryAfter"] <= 6_000
    assert get(url, {"x-user": "bob"})[0] == 200
    status, _, body = get(url)
    assert status == 400 and "no key in the request" in json.loads(body)["error"]


# ASGI: FastAPI under uvicorn (the asgi_server fixture of conftest.py).


def fastapi_app(limiter: Any, limits: Any, key: Any = None) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    from pytollgate.asgi import RateLimitMiddleware

    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=limiter, limits=limits, key=key or {"header": "x-user"})

    @app.get("/", response_class=PlainTextResponse)
    async def hello() -> str:
        return "hello"

    return app


def test_asgi_in_process(asgi_server: Callable[..., str]) -> None:
    name = fresh("asgi")
    url = asgi_server(fastapi_app(AsyncRateLimiter("memory", limits={name: CONFIG}), name))
    three_requests(url + "/", name)


def test_asgi_over_a_servers_client(asgi_server: Callable[..., str], tmp_path: Path) -> None:
    name = fresh("asgi")
    toml = f'[limits.{name}]\nkind = "token bucket"\nrate = 10\nperiod = "1m"\ncapacity = 2\n'
    with tollgate(toml, tmp_path) as server:
        url = asgi_server(fastapi_app(tollgate_client.AsyncRateLimiter(server.url), name))
        three_requests(url + "/", name)


def test_asgi_several_limits_the_ip_and_a_store_down(asgi_server: Callable[..., str]) -> None:
    per_ip, everyone = fresh("perIp"), fresh("everyone")
    limiter = AsyncRateLimiter("memory", limits={
        per_ip: {"kind": "token bucket", "rate": 10, "period": MINUTE, "capacity": 5},
        everyone: {"kind": "fixed window", "rate": 1, "period": MINUTE, "start": 0},
    })
    url = asgi_server(fastapi_app(limiter, [per_ip, everyone], key="ip"))
    assert get(url + "/")[0] == 200
    status, headers, body = get(url + "/")
    assert status == 429 and json.loads(body)["name"] == everyone
    # Refused by the global limit, the per-IP limit kept its token: 4 left.
    assert headers["ratelimit"].startswith(f'"{per_ip}";r=4;')
    down = AsyncRateLimiter("redis://127.0.0.1:1", limits={per_ip: CONFIG}, store_deadline=0.5)
    url = asgi_server(fastapi_app(down, per_ip, key="ip"))
    status, _, body = get(url + "/")
    assert status == 503 and json.loads(body)["mayHaveTaken"] is False


# Django: its WSGI handler under wsgiref, in a thread.


def django_settings(**tollgate: Any) -> None:
    """Django set up once for this process, with ``settings.TOLLGATE = tollgate`` (read by
    the middleware when an application is made)."""
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            DEBUG=False,
            ALLOWED_HOSTS=["127.0.0.1", "localhost"],
            ROOT_URLCONF=__name__,
            MIDDLEWARE=["pytollgate.django.RateLimitMiddleware"],
            SECRET_KEY="test",
        )
        django.setup()
    settings.TOLLGATE = tollgate


def django_server(limiter: Any, name: str) -> Tuple[str, Callable[[], None]]:
    django_settings(limiter=limiter, limits=name, key={"header": "x-user"})
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from django.core.wsgi import get_wsgi_application

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    httpd = make_server("127.0.0.1", 0, get_wsgi_application(), handler_class=Quiet)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()

    def stop() -> None:
        httpd.shutdown()
        thread.join(10)

    return f"http://127.0.0.1:{httpd.server_port}/", stop


def hello(_request: Any) -> Any:
    from django.http import HttpResponse

    return HttpResponse("hello")


def _urlpatterns() -> Any:
    from django.urls import path

    return [path("", hello)]


def __getattr__(attribute: str) -> Any:  # Django reads ROOT_URLCONF's urlpatterns lazily
    if attribute == "urlpatterns":
        return _urlpatterns()
    raise AttributeError(attribute)


def test_django_in_process() -> None:
    name = fresh("django")
    url, stop = django_server(RateLimiter("memory", limits={name: CONFIG}), name)
    try:
        three_requests(url, name)
    finally:
        stop()


def test_django_over_a_servers_client(tmp_path: Path) -> None:
    name = fresh("django")
    toml = f'[limits.{name}]\nkind = "token bucket"\nrate = 10\nperiod = "1m"\ncapacity = 2\n'
    with tollgate(toml, tmp_path) as server:
        url, stop = django_server(tollgate_client.RateLimiter(server.url), name)
        try:
            three_requests(url, name)
        finally:
            stop()


# As deployed: IPv6 clients, a store that fails, a unix socket behind a proxy, an answer
# that comes after the response moved on.


def forwarded(url: str, address: str) -> int:
    """A request that a proxy says comes from ``address`` (X-Forwarded-For, trusted)."""
    return get(url, {"x-forwarded-for": address})[0]


ADDRESSES_OF_ONE_64 = [f"2001:db8:abcd:1234:{i:x}:{i * 7:x}:{i * 13:x}:{i + 1:x}" for i in range(20)]


@pytest.mark.parametrize("framework", ["asgi", "django"])
def test_ipv6_clients_are_keyed_by_their_56(framework: str, asgi_server: Callable[..., str]) -> None:
    """20 addresses of one /64 share one limit of 3: 3 admitted. Another /64 of the same /56
    shares it too; another /56 does not, nor an IPv4 client. Real HTTP through uvicorn, which
    sets the client's address from the proxy's header as deployed behind one (Django as an
    ASGI app: REMOTE_ADDR is that address)."""
    name = fresh("ipv6")
    limiter = AsyncRateLimiter("memory", limits={name: {"kind": "fixed window", "rate": 3, "period": MINUTE}})
    if framework == "asgi":
        app = fastapi_app(limiter, name, key="ip")
    else:
        from django.core.asgi import get_asgi_application

        django_settings(limiter=RateLimiter("memory", limits={name: {"kind": "fixed window", "rate": 3, "period": MINUTE}}), limits=name)
        app = get_asgi_application()
    url = asgi_server(app, proxy_headers=True, forwarded_allow_ips="*") + "/"
    answers = [forwarded(url, address) for address in ADDRESSES_OF_ONE_64]
    assert answers == [200] * 3 + [429] * 17
    assert forwarded(url, "2001:db8:abcd:12ff::1") == 429  # the same /56
    assert forwarded(url, "2001:db8:abcd:1300::1") == 200  # the next /56
    assert forwarded(url, "192.0.2.1") == 200


def test_ipv6_subnet_is_an_option(asgi_server: Callable[..., str]) -> None:
    name = fresh("ipv6")
    config = {name: {"kind": "fixed window", "rate": 1, "period": MINUTE}}
    from fastapi import FastAPI

    from pytollgate.asgi import RateLimitMiddleware

    whole = FastAPI()
    whole.add_middleware(RateLimitMiddleware, limiter=AsyncRateLimiter("memory", limits=config), limits=name, ipv6_subnet=False)
    url = asgi_server(whole, proxy_headers=True, forwarded_allow_ips="*") + "/"
    assert [forwarded(url, a) for a in ADDRESSES_OF_ONE_64[:5]] == [404] * 5  # each its own, and no route
    for bad in (0, 129, True, "56", 56.0):
        with pytest.raises(ValueError, match="ipv6_subnet"):
            RateLimitMiddleware(whole, limiter=AsyncRateLimiter("memory", limits=config), limits=name, ipv6_subnet=bad)


def test_the_ip_key_is_written_as_the_node_and_tower_middlewares_write_it() -> None:
    """The key's text (express-rate-limit's for a /56: the network's first address in RFC
    5952 form and its length): IPv4 as it is, v4-mapped folded to IPv4, the zone dropped."""
    from pytollgate._middleware import check_ipv6_subnet, ip_key

    cases = [
        ("203.0.113.7", 56, "203.0.113.7"),
        ("2001:db8:abcd:1234:5:6:7:8", 56, "2001:db8:abcd:1200::/56"),
        ("2001:DB8:0:0:0:0:0:1", 56, "2001:db8::/56"),
        ("2001:db8:abcd:1234:5:6:7:8", 64, "2001:db8:abcd:1234::/64"),
        ("2001:db8:abcd:1234:5:6:7:8", 48, "2001:db8:abcd::/48"),
        ("2001:db8:abcd:1234:5:6:7:8", 127, "2001:db8:abcd:1234:5:6:7:8/127"),
        ("2001:db8:abcd:1234:5:6:7:8", None, "2001:db8:abcd:1234:5:6:7:8"),
        ("2001:0db8:0000:0000:0001:0000:0000:0001", None, "2001:db8::1:0:0:1"),
        ("2001:db8:0:1:1:1:1:1", None, "2001:db8:0:1:1:1:1:1"),
        ("fe80::1%eth0", None, "fe80::1"),
        ("fe80::1234:5678%3", 56, "fe80::/56"),
        ("::ffff:192.0.2.1", 56, "192.0.2.1"),
        ("::ffff:c000:0201", None, "192.0.2.1"),
        ("::1", 56, "::/56"),
        ("::1", None, "::1"),
        ("testclient", 56, "testclient"),
    ]
    assert [ip_key(address, subnet) for address, subnet, _ in cases] == [key for _, _, key in cases]
    # 128 bits is the whole address, as the tower layer's ipv6_subnet(128) writes it.
    assert check_ipv6_subnet(128) is None and check_ipv6_subnet(False) is None


PG_DOWN_SECRET = "postgres://secretuser:hunter2@127.0.0.1:{port}/secretdb"


@pytest.mark.parametrize("framework", ["asgi", "django"])
def test_a_store_that_fails_is_not_described_to_the_client(
    framework: str, asgi_server: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    """A PostgreSQL that is down: the 503's body names nothing of it (user, host, port,
    database); the log has the detail, once however many requests fail (at most one
    warning every 10 s)."""
    from network import free_port

    port, name = free_port(), fresh("secret")
    store = PG_DOWN_SECRET.format(port=port)
    if framework == "asgi":
        url = asgi_server(fastapi_app(AsyncRateLimiter(store, limits={name: CONFIG}, store_deadline=0.2), name)) + "/"
    else:
        url, stop = django_server(RateLimiter(store, limits={name: CONFIG}, store_deadline=0.2), name)
    caplog.set_level(logging.WARNING, logger="pytollgate")
    try:
        answers = [get(url, {"x-user": "alice"}) for _ in range(20)]
    finally:
        if framework == "django":
            stop()
    for status, _, body in answers:
        assert status == 503
        assert json.loads(body) == {"error": "rate limit store unavailable", "mayHaveTaken": False}
    warnings = [r.getMessage() for r in caplog.records if r.name == "pytollgate"]
    assert len(warnings) == 1, warnings
    assert "postgres" in warnings[0]  # the store's own message
    assert "hunter2" not in warnings[0]  # the URL's password is never shown


def test_asgi_on_a_unix_socket_says_how_to_key_by_ip(
    asgi_server: Callable[..., str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn --uds (behind a proxy): no client address. The "ip" key answers 500 with how
    to fix it, said once in the log; the proxy's header trusted, the same requests are keyed
    by it."""
    import httpx

    name = fresh("uds")
    config = {name: {"kind": "fixed window", "rate": 2, "period": MINUTE}}
    caplog.set_level(logging.ERROR, logger="pytollgate")
    socket_path = str(tmp_path / "app.sock")
    asgi_server(fastapi_app(AsyncRateLimiter("memory", limits=config), name, key="ip"), uds=socket_path)
    with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), timeout=10) as client:
        answers = [client.get("http://localhost/") for _ in range(3)]
    for answer in answers:
        assert answer.status_code == 500
        assert "no client address" in answer.json()["error"]
        assert "--forwarded-allow-ips" in answer.json()["error"] and "key function" in answer.json()["error"]
    assert len([r for r in caplog.records if r.name == "pytollgate"]) == 1

    trusted = str(tmp_path / "trusted.sock")
    asgi_server(
        fastapi_app(AsyncRateLimiter("memory", limits=config), name, key="ip"),
        uds=trusted,
        forwarded_allow_ips="*",
    )
    with httpx.Client(transport=httpx.HTTPTransport(uds=trusted), timeout=10) as client:
        statuses = [client.get("http://localhost/", headers={"x-forwarded-for": "192.0.2.9"}).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]  # keyed by the proxy's header


def test_django_under_gunicorn_on_a_unix_socket_says_how_to_key_by_ip(tmp_path: Path) -> None:
    """gunicorn --bind unix:PATH gives Django an empty REMOTE_ADDR: 500 with how to fix it."""
    import os
    import signal
    import subprocess
    import time

    import httpx

    socket_path = str(tmp_path / "django.sock")
    env = {**os.environ, "FORKED_STORE": "memory", "FORKED_NAME": fresh("uds")}
    here = Path(__file__).resolve().parent
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "--workers", "1", "--bind", f"unix:{socket_path}",
         "--chdir", str(here), "--log-level", "warning", "forked_app:application"],
        env=env, start_new_session=True, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(socket_path):
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.05)
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), timeout=10) as client:
            answers = [client.get("http://127.0.0.1/") for _ in range(2)]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        _, log = server.communicate(timeout=10)
    for answer in answers:
        assert answer.status_code == 500
        assert "REMOTE_ADDR" in answer.json()["error"]
    assert log.count("no client address") == 1, log


def test_asgi_answers_after_the_response_moved_on_are_dropped(asgi_server: Callable[..., str]) -> None:
    """A timeout middleware before this one answers 504 after 20 ms and lets the request go
    on (as connect-timeout does in Express); the store is a Redis 100 ms away, or one that
    never answers. The middleware's own answers (429, 503), which come after the 504, must
    not raise out of the request; its decisions are counted all the same."""
    import os
    import socket

    from network import Forwarder, free_port, target_of

    from pytollgate.asgi import RateLimitMiddleware

    url = os.environ.get("TOLLGATE_REDIS_URL")
    if url is None:
        pytest.skip("no TOLLGATE_REDIS_URL")
    raised: List[BaseException] = []
    finished: List[int] = []

    async def hello(scope: Any, receive: Any, send: Any) -> None:
        try:  # an app that minds the response moving on, so that what is raised is ours
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"hello"})
        except RuntimeError:
            pass

    def timeout(app: Any) -> Any:
        async def timed(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return await app(scope, receive, send)
            inner = asyncio.ensure_future(app(scope, receive, send))
            done, _ = await asyncio.wait({inner}, timeout=0.02)
            if done:
                return inner.result()
            await send({"type": "http.response.start", "status": 504, "headers": []})
            await send({"type": "http.response.body", "body": b"timed out"})

            def record(task: "asyncio.Future[None]") -> None:
                finished.append(1)
                if task.exception() is not None:
                    raised.append(task.exception())  # type: ignore[arg-type]

            inner.add_done_callback(record)

        return timed

    name = fresh("late")
    slow_port, never_port = free_port(), free_port()
    never = socket.socket()
    never.bind(("127.0.0.1", never_port))
    never.listen(64)  # accepts, never answers
    with Forwarder(slow_port, target_of(url), delay=0.1):
        slow = AsyncRateLimiter(f"redis://127.0.0.1:{slow_port}", limits={name: CONFIG}, store_deadline=2.0)
        silent = AsyncRateLimiter(f"redis://127.0.0.1:{never_port}", limits={name: CONFIG}, store_deadline=0.2)
        for limiter in (slow, silent):
            app = timeout(RateLimitMiddleware(hello, limiter=limiter, limits=name, key="global"))
            base = asgi_server(app) + "/"
            assert [get(base)[0] for _ in range(6)] == [504] * 6
        deadline = time.monotonic() + 20
        while len(finished) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        never.close()
        assert len(finished) == 12
        assert raised == [], raised
        # Counted: the 2 of the bucket were taken by the first two requests on Redis.
        value = asyncio.run(AsyncRateLimiter(url, limits={name: CONFIG}).get_value(name))
        assert value.value == pytest.approx(0, abs=0.01)
