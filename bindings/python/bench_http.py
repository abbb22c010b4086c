"""pytollgate's middleware against slowapi (FastAPI) and django-ratelimit (Django) over real
HTTP, each app in its own process as users run them, in one run, rounds taking turns:

  FastAPI: uvicorn, 1 worker; pytollgate.fastapi.rate_limited vs slowapi's @limiter.limit
           (headers_enabled), on memory and on Redis
  Django:  gunicorn, 1 sync worker; pytollgate.django.rate_limit vs django-ratelimit's
           @ratelimit (LocMemCache; Django's RedisCache), on memory and on Redis

Each round is `wrk -t1 -c16 -d{SECONDS}s` against 127.0.0.1; requests/s, the median of the
rounds, and the app's CPU time per request (its processes' user + system time over the
requests it served, from /proc): on a shared machine the second moves far less with the
load than the first, and their ratio is the throughput each would have on a core of its
own. One key (the client's address), a limit far above what a run takes: nothing is
refused. slowapi and django-ratelimit are installed for this benchmark only:

    pip install slowapi django-ratelimit uvicorn gunicorn fastapi django redis
    python bench_http.py [ROUNDS] [SECONDS]     # BENCH_ONLY="memory fastapi": a part of it
"""

from __future__ import annotations

import os
import re
import socket
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Tuple

REDIS = os.environ.get("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379")
RATE = "1000000000/hour"
APP = os.environ.get("BENCH_APP", "")
STORE = os.environ.get("BENCH_STORE", "memory")
NAME = f"http{os.environ.get('BENCH_TAG', '')}"


# The apps, made when this module is imported by uvicorn or gunicorn (BENCH_APP says which).

if APP == "fastapi-tollgate":
    from fastapi import FastAPI, Request

    from pytollgate import AsyncRateLimiter
    from pytollgate.fastapi import rate_limited

    limiter = AsyncRateLimiter(STORE, limits={NAME: RATE}, store_deadline=2.0)
    app = FastAPI()

    @app.get("/")
    @rate_limited(limiter, NAME, key="ip", legacy_headers=True)
    async def hello(request: Request) -> dict[str, str]:
        return {"hello": "world"}

elif APP == "fastapi-slowapi":
    from fastapi import FastAPI, Request, Response
    from slowapi import Limiter, _rate_limit_exceeded_handler
    from slowapi.errors import RateLimitExceeded
    from slowapi.util import get_remote_address

    peer = Limiter(key_func=get_remote_address, storage_uri="memory://" if STORE == "memory" else STORE, headers_enabled=True)
    app = FastAPI()
    app.state.limiter = peer
    app.add_exception_handler(RateLimitExceeded, _rate_limit_exceeded_handler)  # type: ignore[arg-type]

    @app.get("/")
    @peer.limit(RATE)
    async def hello(request: Request, response: Response) -> dict[str, str]:  # slowapi's headers need it
        return {"hello": "world"}

elif APP.startswith("django-"):
    import django
    from django.conf import settings

    cache = (
        {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
        if STORE == "memory"
        else {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": STORE}
    )
    settings.configure(
        DEBUG=False, ALLOWED_HOSTS=["127.0.0.1"], ROOT_URLCONF=__name__, SECRET_KEY="bench",
        MIDDLEWARE=[], CACHES={"default": cache}, SILENCED_SYSTEM_CHECKS=["django_ratelimit.E003", "django_ratelimit.W001"],
    )
    django.setup()
    from django.core.wsgi import get_wsgi_application
    from django.http import HttpResponse
    from django.urls import path

    if APP == "django-tollgate":
        from pytollgate import RateLimiter
        from pytollgate.django import rate_limit

        limiter_sync = RateLimiter(STORE, limits={NAME: RATE}, store_deadline=2.0)

        @rate_limit(limiter_sync, NAME, key="ip")
        def view(request: object) -> HttpResponse:
            return HttpResponse("hello")

    else:
        from django_ratelimit.decorators import ratelimit

        @ratelimit(key="ip", rate="1000000000/h", group=NAME)
        def view(request: object) -> HttpResponse:
            return HttpResponse("hello")

    urlpatterns = [path("", view)]
    application = get_wsgi_application()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(app: str, store: str, port: int, tag: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "BENCH_APP": app, "BENCH_STORE": store, "BENCH_TAG": tag}
    here = os.path.dirname(os.path.abspath(__file__))
    bin_dir = os.path.dirname(sys.executable)
    if app.startswith("fastapi"):
        command = [f"{bin_dir}/uvicorn", "bench_http:app", "--host", "127.0.0.1", "--port", str(port),
                   "--log-level", "error", "--no-access-log"]
    else:
        command = [f"{bin_dir}/gunicorn", "bench_http:application", "-b", f"127.0.0.1:{port}", "-w", "1",
                   "--log-level", "error"]
    server = subprocess.Popen(command, cwd=here, env=env)
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    return server


def cpu_seconds(pid: int) -> float:
    """User + system time of ``pid`` and its children (gunicorn's workers), from /proc."""
    total = 0.0
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as children:
                total += sum(cpu_seconds(int(child)) for child in children.read().split())
    except FileNotFoundError:
        pass
    return total


def wrk(port: int, seconds: int, pid: int = 0) -> Tuple[float, float]:
    """Requests/s, and the app's CPU µs per request."""
    before = cpu_seconds(pid) if pid else 0.0
    out = subprocess.run(
        ["wrk", "-t1", "-c16", f"-d{seconds}s", f"http://127.0.0.1:{port}/"],
        capture_output=True, text=True, timeout=seconds + 30,
    ).stdout
    if "Non-2xx" in out:
        raise SystemExit(f"refused or failed answers in a round:\n{out}")
    used = cpu_seconds(pid) - before if pid else 0.0
    rate, served = re.search(r"Requests/sec:\s+([\d.]+)", out), re.search(r"(\d+) requests in", out)
    assert rate and served, out
    return float(rate.group(1)), used * 1e6 / max(1, int(served.group(1)))


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    seconds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    tag = f"{os.getpid()}x{int(time.time())}"
    pairs = [("fastapi-tollgate", "fastapi-slowapi"), ("django-tollgate", "django-ratelimit")]
    only = os.environ.get("BENCH_ONLY", "")  # "memory", "fastapi", "memory fastapi": a part of the run
    for store in ("memory", REDIS):
        for ours, theirs in pairs:
            label = "memory" if store == "memory" else "redis"
            if any(word not in (label, ours.split("-")[0]) for word in only.split()):
                continue
            ports = {ours: free_port(), theirs: free_port()}
            servers = {app: serve(app, store, port, tag) for app, port in ports.items()}
            try:
                rates: Dict[str, List[float]] = {ours: [], theirs: []}
                cpus: Dict[str, List[float]] = {ours: [], theirs: []}
                for app, port in ports.items():
                    wrk(port, 1)  # warm-up
                for _ in range(rounds):
                    for app, port in ports.items():
                        rate, cpu = wrk(port, seconds, servers[app].pid)
                        rates[app].append(rate)
                        cpus[app].append(cpu)
            finally:
                for server in servers.values():
                    server.terminate()
                    server.wait(10)
            a, b = statistics.median(rates[ours]), statistics.median(rates[theirs])
            ca, cb = statistics.median(cpus[ours]), statistics.median(cpus[theirs])
            shown = lambda xs: " ".join(f"{x:,.0f}" for x in xs)  # noqa: E731
            print(f"{label:<7} {ours} {a:,.0f}/s, {theirs} {b:,.0f}/s: {a / b:.2f}x  "
                  f"(rounds: {shown(rates[ours])} vs {shown(rates[theirs])})", flush=True)
            print(f"{'':<7} CPU per request: {ours} {ca:,.0f} us, {theirs} {cb:,.0f} us: {cb / ca:.2f}x  "
                  f"(rounds: {shown(cpus[ours])} vs {shown(cpus[theirs])})", flush=True)


if __name__ == "__main__" and not APP:
    main()
