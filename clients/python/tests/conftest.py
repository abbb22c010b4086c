"""Fixtures: tollgate servers (the real binary, `TOLLGATE_BIN`), and clients of both
flavours behind one awaitable interface so that each scenario runs on both."""

from __future__ import annotations

import contextlib
import sys
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from servers import Server, tollgate  # noqa: E402

from tollgate_client import AsyncRateLimiter, RateLimiter  # noqa: E402

# The limits the servers of the tests define.
LIMITS = """
[limits.sendMessage]
kind = "token bucket"
rate = 10
period = 60000
capacity = 3

[limits.daily]
kind = "fixed window"
rate = 5
period = "1d"

[limits.exports]
kind = "concurrency"
max = 2
ttl = "1m"
"""

FULL_TOKEN = "full-token"
READ_TOKEN = "read-token"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The server most tests share: memory store, no tokens. Tests use keys of their own."""
    with tollgate(LIMITS, tmp_path_factory.mktemp("memory")) as s:
        yield s


@pytest.fixture(scope="session")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server that asks for a bearer token."""
    config = f'[server]\ntokens = ["{FULL_TOKEN}"]\n' + LIMITS
    with tollgate(config, tmp_path_factory.mktemp("tokens")) as s:
        yield s


@pytest.fixture(scope="session")
def read_token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with a full token and a read token (`readTokens`)."""
    config = (
        f'[server]\ntokens = ["{FULL_TOKEN}"]\nreadTokens = ["{READ_TOKEN}"]\n' + LIMITS
    )
    with tollgate(config, tmp_path_factory.mktemp("read-tokens")) as s:
        yield s


@pytest.fixture
def key() -> str:
    """A key no other test uses."""
    return uuid.uuid4().hex


class AwaitableSync:
    """A sync RateLimiter whose methods can be awaited: one scenario, both clients."""

    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.limiter, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return method(*args, **kwargs)

        return call


@contextlib.asynccontextmanager
async def open_client(flavour: str, url: str, **options: Any) -> AsyncIterator[Any]:
    if flavour == "sync":
        with RateLimiter(url, **options) as limiter:
            yield AwaitableSync(limiter)
    else:
        async with AsyncRateLimiter(url, **options) as alimiter:
            yield alimiter


@pytest.fixture(params=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def client(flavour: str, server: Server) -> AsyncIterator[Any]:
    """A client of `server`, RateLimiter or AsyncRateLimiter."""
    async with open_client(flavour, server.url) as c:
        yield c
