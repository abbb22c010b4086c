"""redis-py, with its defaults (HELLO 3, CLIENT SETINFO), against `tollgate serve --resp-listen`:
redis-cell's CL.THROTTLE integer by integer, pipelining, TG.* commands, tokens, and the asyncio
client. TOLLGATE_BIN names the binary (default: the workspace's debug build)."""

import asyncio
import os
import pathlib
import re
import subprocess
import tempfile
import threading
import time

import pytest
import redis
import redis.asyncio

HERE = pathlib.Path(__file__).parent
BIN = os.environ.get("TOLLGATE_BIN", str(HERE / "../../target/debug/tollgate"))

CONFIG = """
[limits.sendMessage]
kind = "token bucket"
rate = 10
period = "1m"
capacity = 3
"""


def start(env=None):
    """The binary on the memory store; its process and Redis protocol port."""
    directory = tempfile.mkdtemp(prefix="tollgate-resp-")
    config = pathlib.Path(directory, "tollgate.toml")
    config.write_text(CONFIG)
    server = subprocess.Popen(
        [BIN, "serve", "--store", "memory", "--listen", "127.0.0.1:0",
         "--resp-listen", "127.0.0.1:0", "--config", str(config)],
        cwd=directory,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        text=True,
    )
    for line in server.stdout:
        match = re.search(r"resp:\s+redis://127\.0\.0\.1:(\d+)", line)
        if match:
            # The rest of the banner, so that it never blocks on a full pipe.
            threading.Thread(target=server.stdout.read, daemon=True).start()
            return server, int(match.group(1))
    server.kill()
    raise RuntimeError("the server did not start")


@pytest.fixture
def served():
    server, port = start()
    yield port
    server.kill()
    server.wait()


def unique(label):
    return f"{label}{os.getpid()}x{time.time_ns()}"


def test_redis_py_with_its_defaults(served):
    r = redis.Redis(host="127.0.0.1", port=served)
    key = unique("py")
    assert r.execute_command("CL.THROTTLE", key, 15, 30, 60, 1) == [0, 16, 15, -1, 2]
    assert r.execute_command("CL.THROTTLE", key, 15, 30, 60) == [0, 16, 14, -1, 4]
    pipe = r.pipeline(transaction=False)
    for _ in range(20):
        pipe.execute_command("CL.THROTTLE", key + "p", 15, 30, 60, 1)
    assert sum(1 for reply in pipe.execute() if reply[0] == 0) == 16
    # RESP3 (redis-py's default): a map comes back as a dict.
    taken = r.execute_command("TG.LIMIT", "sendMessage", "KEY", key, "COUNT", "2")
    assert taken == {b"ok": True}
    value = r.execute_command("TG.VALUE", "sendMessage", "KEY", key)
    assert value[b"value"] == 1
    with pytest.raises(redis.ResponseError, match="period is -1"):
        r.execute_command("CL.THROTTLE", key, 15, 30, -1)
    assert r.ping() is True
    r.close()


def test_redis_py_default_pipeline_is_a_transaction(served):
    """redis-py's pipeline() is MULTI ... EXEC (transaction=True): each command's reply, each
    token taken once; a command refused while queued runs nothing; an error of a command that
    runs is its own reply (raised, or returned with raise_on_error=False)."""
    r = redis.Redis(host="127.0.0.1", port=served)
    key = unique("tx")
    pipe = r.pipeline()
    for _ in range(3):
        pipe.execute_command("CL.THROTTLE", key, 1, 1, 60)
    assert [reply[0] for reply in pipe.execute()] == [0, 0, 1]
    assert r.execute_command("CL.THROTTLE", key, 1, 1, 60, 0) == [0, 2, 0, -1, 120]
    other = unique("abort")
    pipe = r.pipeline()
    pipe.execute_command("CL.THROTTLE", other, 1, 1, 60)
    pipe.execute_command("NOPE")
    with pytest.raises(redis.ResponseError, match="unknown command 'NOPE'"):
        pipe.execute()
    assert r.execute_command("CL.THROTTLE", other, 1, 1, 60, 0) == [0, 2, 2, -1, 0]
    pipe = r.pipeline()
    pipe.execute_command("CL.THROTTLE", other, "x", 1, 60)
    pipe.execute_command("CL.THROTTLE", other, 1, 1, 60)
    pipe.execute_command("TG.LIMIT", "sendMessage", "KEY", other)
    bad, taken, limited = pipe.execute(raise_on_error=False)
    assert isinstance(bad, redis.ResponseError) and 'max_burst is "x"' in str(bad)
    assert taken == [0, 2, 1, -1, 60] and limited == {b"ok": True}
    # With the asyncio client too.
    async def run():
        client = redis.asyncio.Redis(host="127.0.0.1", port=served)
        async with client.pipeline() as pipe:
            for _ in range(3):
                pipe.execute_command("CL.THROTTLE", key + "a", 1, 1, 60)
            replies = await pipe.execute()
        await client.aclose()
        return [reply[0] for reply in replies]

    assert asyncio.run(run()) == [0, 0, 1]
    r.close()


def test_redis_py_resp2_and_a_token():
    server, port = start({"TOLLGATE_TOKENS": "secret-token"})
    try:
        key = unique("auth")
        r = redis.Redis(host="127.0.0.1", port=port, password="secret-token", protocol=2)
        assert r.execute_command("CL.THROTTLE", key, 1, 1, 60) == [0, 2, 1, -1, 60]
        taken = r.execute_command("TG.LIMIT", "sendMessage", "KEY", key)
        assert taken == [b"ok", 1]
        r.close()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, password="wrong").ping()
        without = redis.Redis(host="127.0.0.1", port=port, protocol=2)
        with pytest.raises(redis.AuthenticationError):
            without.execute_command("CL.THROTTLE", key, 1, 1, 60)
    finally:
        server.kill()
        server.wait()


def test_redis_py_asyncio(served):
    async def run():
        # 200 at once over 8 connections, against a burst of 50.
        pool = redis.asyncio.BlockingConnectionPool(
            host="127.0.0.1", port=served, max_connections=8
        )
        r = redis.asyncio.Redis(connection_pool=pool)
        key = unique("aio")
        replies = await asyncio.gather(
            *(r.execute_command("CL.THROTTLE", key, 49, 1, 86400) for _ in range(200))
        )
        await r.aclose()
        return sum(1 for reply in replies if reply[0] == 0)

    assert asyncio.run(run()) == 50
