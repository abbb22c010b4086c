"""How much the client costs over bare httpx: AsyncRateLimiter.limit against the same
requests sent with a bare httpx.AsyncClient (same pool limits, same JSON), with CONCURRENCY
calls in flight, in interleaved rounds (alternating which goes first), against a tollgate
server this script starts itself on loopback (--store memory) and stops at the end.

    python bench.py [--rounds 6] [--calls 3000] [--concurrency 64] [--connections 10]
                    [--max-seconds 300] [--bin PATH]

Bounded: ROUNDS x CALLS calls per side, and a --max-seconds deadline after which it stops
between rounds. Prints calls/s of each side per round and overall, and the ratio
client/bare (the target is >= 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, List, Tuple

import httpx

from tollgate_client import AsyncRateLimiter
from tollgate_client._core import DEFAULT_MAX_CONNECTIONS

DEFAULT_BIN = os.environ.get(
    "TOLLGATE_BIN", str(Path(__file__).resolve().parents[2] / "target" / "debug" / "tollgate")
)
# Admits everything: a billion a second.
CONFIG: Dict[str, Any] = {"kind": "token bucket", "rate": 1e9, "period": 1000, "capacity": 1e9}
SERVER_CONFIG = """
[limits.unused]
kind = "token bucket"
rate = 1
period = 1000
"""


def start_server(binary: str, directory: Path) -> Tuple["subprocess.Popen[str]", str]:
    config = directory / "bench.toml"
    config.write_text(SERVER_CONFIG)
    process = subprocess.Popen(
        [binary, "serve", "--listen", "127.0.0.1:0", "--store", "memory", "--config", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    found: List[str] = []
    ready = threading.Event()

    def pump(stream: Any) -> None:
        for line in stream:  # read to the end, so the server never blocks on a pipe
            match = re.search(r"tollgate listening on (http://\S+)", line)
            if match and not found:
                found.append(match.group(1))
                ready.set()

    for stream in (process.stdout, process.stderr):
        threading.Thread(target=pump, args=(stream,), daemon=True).start()
    if not ready.wait(30):
        process.kill()
        raise SystemExit("the server printed no 'tollgate listening on' line in 30 s")
    return process, found[0]


async def run(calls: int, concurrency: int, one: Callable[[int], Awaitable[bool]]) -> float:
    """calls/s of `calls` calls, `concurrency` in flight."""
    left = [calls]
    granted = [0]

    async def worker(i: int) -> None:
        while left[0] > 0:
            left[0] -= 1
            ok = await one(i)  # awaited first: `granted[0] += await ...` would lose counts
            granted[0] += ok

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    if granted[0] != calls:
        raise SystemExit(f"only {granted[0]} of {calls} calls were granted")
    return calls / elapsed


async def bench(
    url: str, rounds: int, calls: int, concurrency: int, connections: int, deadline: float
) -> int:
    # The bare client gets the pool the client makes for itself.
    pool = httpx.Limits(
        max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=5.0
    )
    keys = [f"k{i}" for i in range(concurrency)]
    bodies = [{"name": "bench", "key": k, "config": CONFIG} for k in keys]
    limit_url = url + "/v1/limit"
    async with AsyncRateLimiter(
        url, limits={"bench": CONFIG}, max_connections=connections
    ) as limiter, httpx.AsyncClient(limits=pool, timeout=10.0) as bare:

        async def with_client(i: int) -> bool:
            return (await limiter.limit("bench", key=keys[i])).ok

        async def with_bare(i: int) -> bool:
            response = await bare.post(limit_url, json=bodies[i])
            response.raise_for_status()
            return bool(response.json()["ok"])

        sides = {"client": with_client, "bare": with_bare}
        # Warm up: connections opened, code paths hot.
        for one in sides.values():
            await run(min(calls, 1000), concurrency, one)
        results: Dict[str, List[float]] = {"client": [], "bare": []}
        print(
            f"{rounds} rounds x {calls} calls per side, {concurrency} in flight, "
            f"pools of {connections} connections"
        )
        for r in range(rounds):
            if time.monotonic() > deadline:
                print("deadline reached; stopping")
                break
            order = ["client", "bare"] if r % 2 == 0 else ["bare", "client"]
            line = []
            for side in order:
                rate = await run(calls, concurrency, sides[side])
                results[side].append(rate)
                line.append(f"{side} {rate:8.0f}/s")
            print(f"round {r + 1}: " + "  ".join(line))
    if not results["client"] or not results["bare"]:
        return 1
    client = statistics.median(results["client"])
    bare_rate = statistics.median(results["bare"])
    print(f"median: client {client:.0f} calls/s, bare httpx {bare_rate:.0f} calls/s, "
          f"ratio client/bare {client / bare_rate:.3f}")
    paired = [c / b for c, b in zip(results["client"], results["bare"])]
    print("per-round ratios: " + " ".join(f"{x:.3f}" for x in paired))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--connections", type=int, default=DEFAULT_MAX_CONNECTIONS)
    parser.add_argument("--max-seconds", type=float, default=300.0)
    parser.add_argument("--bin", default=DEFAULT_BIN)
    args = parser.parse_args()
    if not (1 <= args.rounds <= 100 and 1 <= args.calls <= 100_000):
        parser.error("rounds in 1..=100, calls in 1..=100000")
    deadline = time.monotonic() + args.max_seconds
    with tempfile.TemporaryDirectory() as directory:
        process, url = start_server(args.bin, Path(directory))
        try:
            print(f"server {url} ({args.bin})")
            return asyncio.run(bench(
                url, args.rounds, args.calls, args.concurrency, args.connections, deadline
            ))
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


if __name__ == "__main__":
    sys.exit(main())
