"""calculate_rate_limit against the server's own algebra, through ``tollgate simulate`` at
explicit times: equal to the last bit over random configs, states, times and counts, with
calendar windows in five zones around the autumn daylight-saving changes of 2026."""

from __future__ import annotations

import json
import random
import subprocess
from datetime import datetime, timezone
from typing import Any, Dict, List

from servers import BIN

from tollgate_client import MINUTE, calculate_rate_limit

ZONES = ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata", "UTC"]
LENGTH = {"day": 86_400_000, "week": 7 * 86_400_000, "month": 31 * 86_400_000, "year": 366 * 86_400_000}


def make_case(u: random.Random, i: int, calendar: bool) -> Dict[str, Any]:
    pick = u.choice
    rate = pick([1, 3, 10, 0.7, 1 + u.random() * 999])
    capacity = None if u.random() < 0.4 else pick([rate, rate * 2, 1 + u.random() * 100])
    max_reserved = None if u.random() < 0.6 else pick([0, 1, u.random() * 50])
    config: Dict[str, Any] = {"kind": "fixed window", "rate": rate}
    if calendar:
        unit = pick(list(LENGTH))
        config["calendar"] = unit
        if u.random() < 0.9:
            config["timeZone"] = pick(ZONES)
        length = LENGTH[unit]
        # From 2026-10-20 over three weeks: both autumn changes and the 1st of November.
        t0 = 1_792_454_400_000 + u.randrange(21 * 86_400_000) + pick([0, u.random()])
    else:
        config["kind"] = pick(["token bucket", "fixed window"])
        length = pick([1_000, MINUTE, 3_600_000, 7, 1 + u.random() * 1e6])
        config["period"] = length
        if config["kind"] == "fixed window" and u.random() < 0.5:
            config["start"] = pick([0, u.random() * 1e7, -u.random() * 1e5])
        t0 = 1_700_000_000_000 + u.randrange(10**9) + pick([0, u.random()])
    if capacity is not None:
        config["capacity"] = capacity
    if max_reserved is not None:
        config["maxReserved"] = max_reserved
    cap = capacity if capacity is not None else rate
    t1 = t0 + pick([0, u.random() * length, u.random() * 4 * length, 1, 3_600_000])
    reserve = u.random() < 0.4
    most = (cap * 3 + 5 if max_reserved is None else cap + max_reserved) if reserve else cap

    def count() -> float:
        return pick([0, 1, most, u.random() * most, float(u.randrange(int(most) + 1))])

    return {
        "name": f"c{i}",
        "config": config,
        "t0": t0,
        "t1": t1,
        "first": count(),
        "count": min(count(), most),
        "reserve": reserve,
    }


def run_cases(cases: List[Dict[str, Any]]) -> List[str]:
    lines = []
    for c in cases:
        body = {"name": c["name"], "config": c["config"]}
        lines.append({"at": c["t0"], "op": "limit", **body, "count": c["first"], "reserve": True})
        lines.append({"at": c["t0"], "op": "value", **body})
        lines.append({"at": c["t1"], "op": "check", **body, "count": c["count"], "reserve": c["reserve"]})
        lines.append({"at": c["t1"], "op": "limit", **body, "count": c["count"], "reserve": c["reserve"]})
        lines.append({"at": c["t1"], "op": "value", **body})
    text = "".join(json.dumps(line) + "\n" for line in lines)
    run = subprocess.run(
        [BIN, "simulate", "--seed", "7"], input=text, capture_output=True, text=True, check=True
    )
    out = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(out) == len(lines)
    failures = []
    outcomes = set()
    for i, c in enumerate(cases):
        _, before, check, limit, after = out[i * 5 : i * 5 + 5]
        if "error" in before or "error" in check or "error" in limit:
            failures.append(f"the server refused {c}: {before} {check} {limit}")
            continue
        state = None if before["ts"] == 0 else {"value": before["value"], "ts": before["ts"]}
        calc = calculate_rate_limit(state, before["config"], c["t1"], c["count"], c["reserve"])
        for op, answer in (("check", check), ("limit", limit)):
            if answer["ok"] != calc.ok or answer.get("retryAfter") != calc.retry_after:
                failures.append(f"{op} {c}: server {answer}, client {calc}")
        dropped = after["ts"] == 0 and calc.value == before["config"]["capacity"]
        if limit["ok"] and not dropped and (after["value"], after["ts"]) != (calc.value, calc.ts):
            failures.append(f"state {c}: server {after}, client {calc}")
        outcomes.add((limit["ok"], "retryAfter" in limit))
    assert failures[:3] == []
    return sorted(f"{ok}/{wait}" for ok, wait in outcomes)


def test_equals_the_server_over_random_cases() -> None:
    u = random.Random(20261127)
    outcomes = run_cases([make_case(u, i, calendar=False) for i in range(3_000)])
    assert outcomes == ["False/True", "True/False", "True/True"]


def test_equals_the_server_for_calendar_windows_in_five_zones() -> None:
    u = random.Random(20261128)
    outcomes = run_cases([make_case(u, i, calendar=True) for i in range(1_000)])
    assert outcomes == ["False/True", "True/False", "True/True"]


def test_a_month_in_berlin_ends_at_local_midnight_after_the_autumn_change() -> None:
    def ms(*parts: int) -> float:
        return datetime(*parts, tzinfo=timezone.utc).timestamp() * 1000

    month = {"kind": "fixed window", "rate": 1000, "calendar": "month", "timeZone": "Europe/Berlin"}
    oct30 = ms(2026, 10, 30, 12)
    spent = calculate_rate_limit(None, month, oct30, 1000)
    assert spent.ts == ms(2026, 9, 30, 22), "October began at 00:00 UTC+2"
    refused = calculate_rate_limit({"value": spent.value, "ts": spent.ts}, month, oct30, 1)
    assert not refused.ok and refused.retry_after == ms(2026, 10, 31, 23) - oct30
    day = {"kind": "fixed window", "rate": 1, "calendar": "day", "timeZone": "Europe/Berlin"}
    noon = ms(2026, 10, 25, 12)
    taken = calculate_rate_limit(None, day, noon, 1)
    again = calculate_rate_limit({"value": taken.value, "ts": taken.ts}, day, noon, 1)
    assert again.retry_after is not None
    assert noon + again.retry_after - taken.ts == 25 * 3_600_000, "a day of 25 hours"
