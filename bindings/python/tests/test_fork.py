"""After ``fork``: a child's calls work, on the child's own runtime and connections, as
gunicorn ``--preload`` and ``multiprocessing`` fork them (before the fix every store call
of a child hung for ever: the runtime's threads are not in a forked child). Every wait here
is bounded."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, List, Optional

import pytest
from conftest import fresh, networked
from network import free_port

from pytollgate import HOUR, AsyncRateLimiter, RateLimiter

HERE = Path(__file__).resolve().parent
WINDOW = {"kind": "fixed window", "rate": 10, "period": HOUR, "start": 0}


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("worker", ["sync", "gthread"])
def test_gunicorn_preload_serves_the_django_middleware_on_redis(worker: str) -> None:
    """The guide's Django settings under ``gunicorn --preload`` (the limiter made and used
    in the master): 2 workers answer, and exactly the limit (3) is admitted between them."""
    url = networked("TOLLGATE_REDIS_URL")
    if url is None:
        pytest.skip("no TOLLGATE_REDIS_URL")
    port = free_port()
    env = {**os.environ, "FORKED_STORE": url, "FORKED_NAME": fresh("gunicorn")}
    command = [
        sys.executable, "-m", "gunicorn", "--preload", "--workers", "2", "--worker-class", worker,
        "--threads", "2", "--bind", f"127.0.0.1:{port}", "--timeout", "20", "--chdir", str(HERE),
        "--log-level", "warning", "forked_app:application",
    ]
    server = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        started = time.monotonic() + 30
        while time.monotonic() < started:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None, "gunicorn exited"
                time.sleep(0.1)
        answers = [status(f"http://127.0.0.1:{port}/") for _ in range(8)]
        assert sorted(answers) == [200] * 3 + [429] * 5, answers
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


# A fork pool: the limiter is the parent's, made (and used) before the pool forks.
_pooled: Optional[RateLimiter] = None
_pooled_name = ""


def _take(_: int) -> bool:
    assert _pooled is not None
    return _pooled.limit(_pooled_name, key="k").ok


def test_a_fork_pool_admits_exactly_the_limit_on_redis() -> None:
    global _pooled, _pooled_name
    url = networked("TOLLGATE_REDIS_URL")
    if url is None:
        pytest.skip("no TOLLGATE_REDIS_URL")
    _pooled_name = fresh("pool")
    _pooled = RateLimiter(url, limits={_pooled_name: WINDOW}, store_deadline=2.0)
    assert _pooled.check(_pooled_name, key="k").ok
    with multiprocessing.get_context("fork").Pool(4) as pool:
        answers = pool.map_async(_take, range(40)).get(timeout=60)
    assert sum(answers) == 10
    # The parent's own connection was not disturbed by the children.
    assert not _pooled.limit(_pooled_name, key="k").ok
    assert _pooled.limit(_pooled_name, key="other").ok


def in_child(work: Callable[[], List[object]]) -> List[object]:
    """``work()`` in a forked child, its answers back through a pipe (at most 30 s)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            answers = work()
            os.write(write, repr(answers).encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            pytest.fail("the forked child did not answer within 30 s")
        time.sleep(0.02)
    with os.fdopen(read) as answers:
        return list(eval(answers.read() or "[]"))


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def networked_or_file(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/states.db"
    url = networked(f"TOLLGATE_{request.param.upper()}_URL")
    if url is None:
        pytest.skip(f"no TOLLGATE_{request.param.upper()}_URL")
    return url


def test_a_limiter_made_in_the_parent_works_in_a_child(networked_or_file: str) -> None:
    """Both doors: a blocking limiter and an asyncio one, opened and used in the parent; the
    child's calls are answered, from the same states (the store's); the parent's go on."""
    name = fresh("child")
    blocking = RateLimiter(networked_or_file, limits={name: WINDOW}, store_deadline=2.0)
    awaited = AsyncRateLimiter(networked_or_file, limits={name: WINDOW}, store_deadline=2.0)
    assert blocking.limit(name, key="k", count=4).ok
    assert asyncio.run(awaited.limit(name, key="k", count=4)).ok

    def child() -> List[object]:
        async def twice() -> List[bool]:
            return [(await awaited.limit(name, key="k")).ok for _ in range(2)]

        return [blocking.limit(name, key="k").ok, blocking.limit(name, key="k").ok, *asyncio.run(twice())]

    # 8 taken: 2 left for the child's 4 calls.
    assert in_child(child) == [True, True, False, False]
    assert not blocking.limit(name, key="k").ok
    assert asyncio.run(awaited.get_value(name, key="k")).value == 0


def test_the_memory_store_of_a_child_is_a_copy_of_the_parents() -> None:
    """What the guide says: a child goes on from the parent's states at the fork, and what it
    takes is its own."""
    limiter = RateLimiter("memory", limits={"x": WINDOW})
    assert limiter.limit("x", key="k", count=8).ok
    assert in_child(lambda: [limiter.limit("x", key="k").ok for _ in range(3)]) == [True, True, False]
    assert limiter.get_value("x", key="k").value == 2  # the child's takes are not the parent's


def test_a_limiter_made_in_a_child_works() -> None:
    """The runtime was started in the parent (by any limiter, even on memory): a limiter
    made new in the child starts the child's own."""
    url = networked("TOLLGATE_REDIS_URL")
    if url is None:
        pytest.skip("no TOLLGATE_REDIS_URL")
    RateLimiter("memory").get_config()
    name = fresh("new")

    def child() -> List[Any]:
        limiter = RateLimiter(url, limits={name: WINDOW}, store_deadline=2.0)
        return [limiter.limit(name, key="k", count=10).ok, limiter.limit(name, key="k").ok]

    assert in_child(child) == [True, False]
