"""The stores the tests run on: memory and a SQLite file always; Redis, Redis Cluster and
PostgreSQL from TOLLGATE_REDIS_URL, TOLLGATE_REDIS_CLUSTER_URL and TOLLGATE_POSTGRES_URL.
Without one its tests skip, unless TOLLGATE_REQUIRE_BACKENDS=1, where they fail."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Tuple

import pytest

REQUIRED = os.environ.get("TOLLGATE_REQUIRE_BACKENDS") == "1"
NETWORKED = [
    ("redis", "TOLLGATE_REDIS_URL"),
    ("redis cluster", "TOLLGATE_REDIS_CLUSTER_URL"),
    ("postgres", "TOLLGATE_POSTGRES_URL"),
]


def networked(variable: str) -> Optional[str]:
    url = os.environ.get(variable)
    if url is None and REQUIRED:
        pytest.fail(f"TOLLGATE_REQUIRE_BACKENDS=1 but {variable} is not set")
    return url


def stores(tmp: str) -> List[Tuple[str, Optional[str]]]:
    return [("memory", "memory"), ("sqlite", f"sqlite://{tmp}/states.db")] + [
        (label, os.environ.get(variable)) for label, variable in NETWORKED
    ]


STORE_LABELS = ["memory", "sqlite"] + [label for label, _ in NETWORKED]


@pytest.fixture(params=STORE_LABELS)
def store(request: pytest.FixtureRequest, tmp_path: object) -> str:
    label = request.param
    if label == "memory":
        return "memory"
    if label == "sqlite":
        return f"sqlite://{tmp_path}/states.db"
    variable = dict(NETWORKED)[label]
    url = networked(variable)
    if url is None:
        pytest.skip(f"no {variable}")
    return url


def fresh(prefix: str) -> str:
    """A name no earlier run used (runs share Redis and PostgreSQL)."""
    return f"{prefix}{os.getpid()}x{int(time.time() * 1000)}x{random.randrange(10**6)}"


async def ticks_during(work: "asyncio.Future[Any]") -> int:
    """How many turns a ticker task got while `work` ran: whether the loop went on."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)  # the ticker is running
    ticks = 0
    await work
    task.cancel()
    return ticks


@pytest.fixture
def asgi_server() -> Iterator[Callable[..., str]]:
    """``start(app, **options)``: an ASGI app under uvicorn (with its ``options``: a unix
    socket, the proxy's header trusted), in a thread of its own with its own event loop; its
    URL. Stopped at the end of the test."""
    import uvicorn

    servers = []

    def start(app: Any, **options: Any) -> str:
        options = {"host": "127.0.0.1", "port": 0, **options}
        config = uvicorn.Config(app, log_level="error", lifespan="off", **options)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        for _ in range(200):
            if server.started:
                break
            threading.Event().wait(0.025)
        servers.append((server, thread))
        if "uds" in options:
            return "http://localhost"
        port = server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)
