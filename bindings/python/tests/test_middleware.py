"""The ASGI (FastAPI) and Django middleware through real HTTP requests to a real listening app
(uvicorn; wsgiref), over the in-process limiter and over a tollgate server's client: the
status, the header fields and the body as the tower layer writes them (`"name";q=<rate in
the window>;w=<window s>`, `"name";r=<remaining, down>;t=<s until full, up>`, `Retry-After`
in whole seconds up, `{"kind": "RateLimited", "name", "retryAfter"}`)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

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


# ASGI: FastAPI under uvicorn, in a thread of its own with its own event loop.


@pytest.fixture
def asgi_server() -> Iterator[Callable[[Any], str]]:
    import uvicorn

    servers = []

    def start(app: Any) -> str:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        for _ in range(200):
            if server.started:
                break
            threading.Event().wait(0.025)
        servers.append((server, thread))
        port = server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


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


def test_asgi_in_process(asgi_server: Callable[[Any], str]) -> None:
    name = fresh("asgi")
    url = asgi_server(fastapi_app(AsyncRateLimiter("memory", limits={name: CONFIG}), name))
    three_requests(url + "/", name)


def test_asgi_over_a_servers_client(asgi_server: Callable[[Any], str], tmp_path: Path) -> None:
    name = fresh("asgi")
    toml = f'[limits.{name}]\nkind = "token bucket"\nrate = 10\nperiod = "1m"\ncapacity = 2\n'
    with tollgate(toml, tmp_path) as server:
        url = asgi_server(fastapi_app(tollgate_client.AsyncRateLimiter(server.url), name))
        three_requests(url + "/", name)


def test_asgi_several_limits_the_ip_and_a_store_down(asgi_server: Callable[[Any], str]) -> None:
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


def django_server(limiter: Any, name: str) -> Tuple[str, Callable[[], None]]:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            DEBUG=False,
            ALLOWED_HOSTS=["127.0.0.1"],
            ROOT_URLCONF=__name__,
            MIDDLEWARE=["pytollgate.django.RateLimitMiddleware"],
            SECRET_KEY="test",
        )
        django.setup()
    settings.TOLLGATE = {"limiter": limiter, "limits": name, "key": {"header": "x-user"}}
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
