"""What goes over the wire: only the fields that are set, in the API's camelCase, with the
token; recorded by a loopback server of the test's own."""

from __future__ import annotations

import json
from typing import Any, Dict, List

from conftest import open_client
from servers import Recorded, odd_web_server

from tollgate_client import HOUR, LimitCall

CODE = {"kind": "fixed window", "rate": 3, "period": HOUR, "max_reserved": 2}


def sent(record: List[Recorded]) -> Dict[str, Any]:
    return json.loads(record.pop(0).body)


async def test_only_set_fields_are_sent(flavour: str) -> None:
    record: List[Recorded] = []
    with odd_web_server(200, b'{"ok":true}', "application/json", record) as url:
        async with open_client(flavour, url, token="t0k", limits={"code": CODE}) as c:
            await c.limit("n")
            assert record[0].path == "/v1/limit" and record[0].method == "POST"
            assert record[0].headers["authorization"] == "Bearer t0k"
            assert record[0].headers["content-type"] == "application/json"
            assert sent(record) == {"name": "n"}
            await c.check("n", key="k", count=0, reserve=True, throws=True)
            assert record[0].path == "/v1/check"
            assert sent(record) == {
                "name": "n", "key": "k", "count": 0, "reserve": True, "throws": True}
            await c.limit("code", key="k", reserve=False, throws=False)
            assert sent(record) == {
                "name": "code",
                "key": "k",
                "config": {"kind": "fixed window", "rate": 3, "period": HOUR,
                           "maxReserved": 2},
            }
            await c.limit("code", config={"kind": "token bucket", "rate": 1, "period": 1000})
            assert sent(record)["config"] == {"kind": "token bucket", "rate": 1, "period": 1000}


async def test_transaction_value_reset_bodies(flavour: str) -> None:
    record: List[Recorded] = []
    # One answer for every request: a transaction's of four limits, a value, a time.
    answer = (
        b'{"ok":true,"results":[{"ok":true},{"ok":true},{"ok":true},{"ok":true}],'
        b'"value":1,"ts":2,"shard":0,"config":{},"now":5}'
    )
    with odd_web_server(200, answer, "application/json", record) as url:
        async with open_client(flavour, url, limits={"code": CODE}) as c:
            await c.transaction(
                [
                    LimitCall("a"),
                    LimitCall("code", key="k", count=2, reserve=True),
                    {"name": "b", "key": None, "count": 1, "reserve": False,
                     "config": {"kind": "fixed window", "rate": 1, "period": 1000,
                                "max_reserved": 0}},
                    {"name": "code", "config": {"kind": "token bucket", "rate": 1,
                                                "period": 1000}},
                ],
                throws=True,
            )
            assert record[0].path == "/v1/transaction"
            assert sent(record) == {
                "limits": [
                    {"name": "a", "throws": True},
                    {"name": "code", "key": "k", "count": 2, "reserve": True,
                     "config": {"kind": "fixed window", "rate": 3, "period": HOUR,
                                "maxReserved": 2}},
                    {"name": "b", "count": 1,
                     "config": {"kind": "fixed window", "rate": 1, "period": 1000,
                                "maxReserved": 0}},
                    {"name": "code", "config": {"kind": "token bucket", "rate": 1,
                                                "period": 1000}},
                ]
            }
            reading = await c.get_value("code", key="k", sample_shards=2)
            assert (reading.value, reading.ts, reading.shard) == (1.0, 2.0, 0)
            assert record[0].path == "/v1/value"
            assert sent(record) == {
                "name": "code", "key": "k", "sampleShards": 2,
                "config": {"kind": "fixed window", "rate": 3, "period": HOUR,
                           "maxReserved": 2},
            }
            assert await c.reset("code", key="k") is None
            assert record[0].path == "/v1/reset"
            assert sent(record) == {"name": "code", "key": "k"}
            assert await c.get_server_time() == 5.0
            assert (record[0].method, record[0].path) == ("GET", "/v1/time")


def test_properties() -> None:
    from tollgate_client import AsyncRateLimiter, RateLimiter

    with RateLimiter("http://127.0.0.1:1/", limits={"a": {"max_reserved": 1}}) as c:
        assert c.url == "http://127.0.0.1:1"
        assert c.limits == {"a": {"maxReserved": 1}}
        c.limits["a"]["maxReserved"] = 5  # a copy
        assert c.limits == {"a": {"maxReserved": 1}}
        assert repr(c) == "RateLimiter('http://127.0.0.1:1')"
    a = AsyncRateLimiter("http://127.0.0.1:1/prefix", limits={"a": {"rate": 1}})
    assert (a.url, a.limits) == ("http://127.0.0.1:1/prefix", {"a": {"rate": 1}})


async def test_base_path_is_kept(flavour: str) -> None:
    record: List[Recorded] = []
    with odd_web_server(200, b'{"now":1}', "application/json", record) as url:
        async with open_client(flavour, url + "/tollgate/") as c:
            assert await c.get_server_time() == 1.0
            assert record[0].path == "/tollgate/v1/time"
