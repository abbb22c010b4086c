"""The algebra of tollgate's SPEC §2 in Python: the same operations in the same order as the
server's, so that the numbers agree to the last bit (the tests compare them through
``tollgate simulate``). Calendar windows use the platform's time zone database (zoneinfo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from functools import lru_cache
from typing import Any, Mapping, Optional, Tuple
from zoneinfo import ZoneInfo

from ._units import milliseconds

__all__ = ["Calculation", "calculate_rate_limit"]

_HOUR = 3_600_000.0
_DAY = 24 * _HOUR
_LONGEST = {"day": 25 * _HOUR, "week": 7 * _DAY + _HOUR, "month": 31 * _DAY + _HOUR, "year": 366 * _DAY + _HOUR}
# The instants dates are counted for: Python's years 1 to 9998 (the server's reach
# further back; no limit's state lives there).
_FIRST_MS = -62_135_596_800_000.0 + _DAY
_LAST_MS = 253_370_678_400_000.0
_EPOCH = date(1970, 1, 1)


def _period(config: Mapping[str, Any]) -> float:
    """The config's period in ms (a number, or a string with its unit such as "1m")."""
    return milliseconds(config["period"], "period")


@dataclass(frozen=True)
class Calculation:
    """What :func:`calculate_rate_limit` finds: whether ``count`` would be granted, the wait
    (``retry_after``, ms; ``None`` when granted with tokens on hand), and the state a granted
    ``limit`` stores (``value``, ``ts``)."""

    ok: bool
    retry_after: Optional[float]
    value: float
    ts: float


def calculate_rate_limit(
    state: Optional[Mapping[str, float]],
    config: Mapping[str, Any],
    now: float,
    count: float = 1,
    reserve: bool = False,
) -> Calculation:
    """Evaluates a limit at ``now`` (ms since the epoch) for ``count`` tokens, as the server does.

    ``state`` is ``{"value", "ts"}`` of a stored state (``get_value``'s), or ``None`` for a key
    without one. ``config`` is the config ``get_value`` reports (every default filled in, a
    fixed window's ``start`` set): ``kind``, ``rate``, ``period`` or ``calendar`` and
    ``timeZone``, ``capacity``, ``maxReserved``.
    """
    start = _fresh(config, now) if state is None else (float(state["value"]), float(state["ts"]))
    value, ts = _advance(config, start, now, count)
    max_reserved = config.get("maxReserved")
    over = max_reserved is not None and -value > max_reserved
    ok = value >= 0 or (reserve and not over)
    if not value < 0:
        return Calculation(ok, None, value, ts)
    rate = float(config["rate"])
    if config["kind"] == "token bucket":
        wait = -value * _period(config) / rate
    else:
        wait = _windows_after(config, ts, math.ceil(-value / rate)) - now
    if ok:
        retry = _settle(now, wait, lambda at: _advance(config, (value, ts), at, 0)[0] >= 0)
    else:
        retry = _settle(now, wait, lambda at: _advance(config, start, at, count)[0] >= 0)
    return Calculation(ok, retry, value, ts)


def _capacity(config: Mapping[str, Any]) -> float:
    return float(config.get("capacity", config["rate"]))


def _fresh(config: Mapping[str, Any], now: float) -> Tuple[float, float]:
    if config["kind"] == "token bucket":
        return _capacity(config), now
    calendar = config.get("calendar")
    if calendar is not None:
        return _capacity(config), _start(calendar, config.get("timeZone", "UTC"), now)
    alignment = float(config.get("start", 0))
    period = _period(config)
    return _capacity(config), alignment + math.floor((now - alignment) / period) * period


def _at_most(x: float, most: float) -> float:
    # Not min(): the server's choice for NaN, kept.
    return x if x < most else most


def _advance(config: Mapping[str, Any], state: Tuple[float, float], now: float, count: float) -> Tuple[float, float]:
    value, ts = state
    rate, most = float(config["rate"]), _capacity(config)
    if config["kind"] == "token bucket":
        period = _period(config)
        return _at_most(value + (now - ts) * rate / period, most) - count, now
    calendar = config.get("calendar")
    if calendar is not None:
        zone = config.get("timeZone", "UTC")
        windows = _windows(calendar, zone, ts, now)
        ts = _start(calendar, zone, now) if windows > 0 else ts
        return _at_most(value + rate * windows, most) - count, ts
    period = _period(config)
    windows = math.floor((now - ts) / period)
    return _at_most(value + rate * windows, most) - count, ts + windows * period


def _windows_after(config: Mapping[str, Any], ts: float, k: int) -> float:
    calendar = config.get("calendar")
    if calendar is not None:
        return _after(calendar, config.get("timeZone", "UTC"), ts, k)
    return ts + _period(config) * k


def _settle(now: float, wait: float, done: Any) -> float:
    at = now + wait
    for _ in range(8):
        if done(at):
            return max(at - now, wait)
        at = math.nextafter(at, math.inf)
    return wait


# Calendar windows, counted as the server counts them (tollgate-algebra's calendar.rs): a
# window's index is its day, ISO week, month or year since the epoch in the zone's calendar;
# it starts at local midnight of its first date, read with fold=0 (a repeated midnight is the
# earlier instant, a skipped one is read with the offset before it, as the server does).


@lru_cache(maxsize=None)
def _zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


def _local_date(zone: str, t: float) -> date:
    ms = math.floor(min(max(t, _FIRST_MS), _LAST_MS))
    return datetime.fromtimestamp(ms // 1000, _zone(zone)).date()


def _index(unit: str, zone: str, t: float) -> int:
    d = _local_date(zone, t)
    days = (d - _EPOCH).days
    if unit == "day":
        return days
    if unit == "week":
        # 1970-01-01 was a Thursday: its ISO week began on Monday 1969-12-29 (day -3).
        return (days + 3) // 7
    if unit == "month":
        return d.year * 12 + d.month - 1
    return d.year


def _start_of(unit: str, zone: str, i: int) -> float:
    if unit == "day":
        first = _EPOCH + timedelta(days=i)
    elif unit == "week":
        first = _EPOCH + timedelta(days=i * 7 - 3)
    elif unit == "month":
        first = date(i // 12, i % 12 + 1, 1)
    else:
        first = date(i, 1, 1)
    midnight = datetime(first.year, first.month, first.day, tzinfo=_zone(zone))
    return float(round(midnight.astimezone(timezone.utc).timestamp()) * 1000)


def _start(unit: str, zone: str, t: float) -> float:
    return _start_of(unit, zone, _index(unit, zone, t))


def _after(unit: str, zone: str, t: float, k: int) -> float:
    i = _index(unit, zone, t)
    last = _index(unit, zone, _LAST_MS)
    reach = last - i
    if k <= reach:
        return _start_of(unit, zone, i + k)
    return _start_of(unit, zone, last) + (k - reach) * _LONGEST[unit]


def _windows(unit: str, zone: str, ts: float, now: float) -> int:
    return 0 if now <= ts else _index(unit, zone, now) - _index(unit, zone, ts)
