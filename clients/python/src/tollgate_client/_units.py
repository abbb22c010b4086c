"""Durations, as every parameter of the Python packages takes them: a number in the unit its
type names (:data:`Milliseconds` for a limit's ``period``, as the API has it; :data:`Seconds`
for timeouts and deadlines, as Python has them), or a string that carries its unit in the
server's own grammar (``crates/core/src/config.rs``, ``parse_duration``): a number, then
``ms``, ``s``, ``m``, ``h`` or ``d`` (``"250ms"``, ``"10s"``, ``"1m"``, ``"1.5h"``, ``"1d"``).
"""

from __future__ import annotations

import math
import re
from typing import Union

__all__ = ["Milliseconds", "Seconds", "milliseconds", "seconds", "check_period"]

#: A duration in milliseconds (a number), or a string with its unit (``"1m"``).
Milliseconds = Union[float, str]
#: A duration in seconds (a number), or a string with its unit (``"250ms"``).
Seconds = Union[float, str]

_UNIT_MS = {"ms": 1.0, "s": 1_000.0, "m": 60_000.0, "h": 3_600_000.0, "d": 86_400_000.0}
# What Rust's f64 parser takes before the unit: the text is split at its first ASCII letter,
# so no exponent, "inf" or "nan" can be there.
_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)")


def parse(text: str) -> float:
    """The milliseconds of a duration string, as the server reads it; ValueError if it is
    not one."""
    trimmed = text.strip()
    split = next((i for i, c in enumerate(trimmed) if c.isascii() and c.isalpha()), None)
    if split is not None:
        number, unit = trimmed[:split].strip(), trimmed[split:]
        if unit in _UNIT_MS and _NUMBER.fullmatch(number):
            return float(number) * _UNIT_MS[unit]
    raise ValueError(
        f"{text!r} is not a duration: a number and its unit, ms, s, m, h or d (\"250ms\", \"1m\")"
    )


def _number(value: object, what: str, unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{what} is a number of {unit} or a string with its unit such as \"10s\", "
            f"not {value!r}"
        )
    return float(value)


def milliseconds(value: Milliseconds, what: str) -> float:
    """``value`` in milliseconds: a number as it is, a string by its unit."""
    if isinstance(value, str):
        try:
            return parse(value)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    return _number(value, what, "milliseconds")


def seconds(value: Seconds, what: str) -> float:
    """``value`` in seconds: a number as it is, a string by its unit."""
    if isinstance(value, str):
        try:
            return parse(value) / 1_000.0
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    return _number(value, what, "seconds")


#: A period given as a bare number below this many milliseconds is refused (see
#: :func:`check_period`).
SHORTEST_BARE_PERIOD = 1_000.0


def check_period(period: object, name: str) -> None:
    """Refuses a ``period`` written as a bare number below a second. A number is
    milliseconds, and one below 1,000 is almost always seconds meant (``"period": 60``:
    60 ms, a thousand times the rate asked for, which no test at a human pace notices);
    a period that short is rare, and written with its unit (``"60ms"``) it is taken."""
    if isinstance(period, bool) or not isinstance(period, (int, float)):
        return  # a string is read with its unit; anything else, the engine refuses by name
    if math.isfinite(period) and 0 < period < SHORTEST_BARE_PERIOD:
        shown = f"{period:g}"
        raise ValueError(
            f"{name}: period is {shown}, a number of milliseconds: {shown} ms. For "
            f"{shown} seconds write \"{shown}s\" (or {shown} * SECOND); to mean "
            f"milliseconds, write \"{shown}ms\""
        )
