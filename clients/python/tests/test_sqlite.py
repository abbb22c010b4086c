"""The same exact scenarios on the SQLite store, and its state surviving a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import scenarios
from conftest import LIMITS, open_client
from servers import Server, tollgate

from tollgate_client import HOUR, RateLimiter


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sqlite") / "tollgate.db"


@pytest.fixture(scope="module")
def sqlite_server(db: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tollgate(LIMITS, tmp_path_factory.mktemp("sqlite-1"), f"sqlite://{db}") as s:
        yield s


@pytest.fixture
async def sqlite_client(flavour: str, sqlite_server: Server) -> Any:
    async with open_client(flavour, sqlite_server.url) as c:
        yield c


async def test_token_bucket(sqlite_client: Any, key: str) -> None:
    await scenarios.token_bucket_capacity_three(sqlite_client, key)


async def test_value(sqlite_client: Any, key: str) -> None:
    await scenarios.value_after_two_of_three(sqlite_client, key)


async def test_fixed_window(sqlite_client: Any, key: str) -> None:
    await scenarios.fixed_window_exact(sqlite_client, key)


async def test_transaction(sqlite_client: Any, key: str) -> None:
    await scenarios.transaction_all_or_nothing(sqlite_client, key)


async def test_check(sqlite_client: Any, key: str) -> None:
    await scenarios.check_takes_nothing(sqlite_client, key)


def test_state_survives_a_restart(tmp_path: Path, key: str) -> None:
    db = tmp_path / "restart.db"
    with tollgate(LIMITS, tmp_path / "a", f"sqlite://{db}") as s:
        with RateLimiter(s.url) as c:
            # A window that began 1 s ago and lasts an hour: it outlives both servers.
            start = float(int(c.get_server_time()) - 1000)
            config = {"kind": "fixed window", "rate": 3, "period": HOUR, "start": start}
            assert c.limit("fw", key=key, count=2, config=config).ok
            before = c.get_value("fw", key=key, config=config)
            assert (before.value, before.ts) == (1, start)
    with tollgate(LIMITS, tmp_path / "b", f"sqlite://{db}") as s:
        with RateLimiter(s.url, limits={"fw": config}) as c:
            assert c.get_value("fw", key=key) == before
            assert c.limit("fw", key=key).ok
            assert not c.limit("fw", key=key).ok
