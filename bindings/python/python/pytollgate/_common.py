"""What the blocking and the asyncio limiters share: the config handed to the engine, and
how its answers become the client's."""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Dict, Iterable, Mapping, Optional, Union

from tollgate_client import Decision, RateLimitError, Seconds, _core
from tollgate_client._units import seconds

from . import _native

#: The names of a limiter's limits: ``str``, unless the limiter is annotated with a
#: ``Literal`` of them (``limiter: RateLimiter[Literal["perUser", "global"]] = ...``), which
#: mypy then checks every middleware's names against. (The default is for type checkers:
#: typing's TypeVar takes one from Python 3.13.)
if TYPE_CHECKING:
    from typing_extensions import TypeVar

    Name = TypeVar("Name", bound=str, default=str)
else:
    from typing import TypeVar

    Name = TypeVar("Name", bound=str)

#: The limits of a limiter: name -> config (a dict, see ``LimitConfig``), or a rate string
#: (``"5/minute"``, see :func:`parse_rate`).
Limits = Mapping[Name, Union[str, Mapping[str, Any]]]

#: A leased limit: True, or ``{"term": seconds or "30s", "share": ..., "floor": ...,
#: "hotAfter": takes}``.
LeaseOptions = Union[bool, Mapping[str, Union[float, str]]]


def _ms(duration: Seconds, what: str) -> float:
    return seconds(duration, what) * 1_000


def config_json(
    store: str,
    limits: Optional[Limits[Any]],
    store_deadline: Optional[Seconds],
    max_keys: Optional[int],
    leases: Optional[Mapping[str, LeaseOptions]],
    fail_open: Optional[Iterable[str]],
) -> str:
    """The limiter's settings as a config file's: ``{server, limits}`` as JSON."""
    if not isinstance(store, str):
        raise TypeError(f"store is a store URL such as 'memory', not {store!r}")
    server: Dict[str, Any] = {"store": store}
    if store_deadline is not None:
        server["storeDeadline"] = _ms(store_deadline, "store_deadline")
    if max_keys is not None:
        server["maxKeys"] = max_keys
    tables: Dict[str, Dict[str, Any]] = {
        name: parse_rate(config, name) if isinstance(config, str) else _core.normalize_config(config, name)
        for name, config in (limits or {}).items()
    }

    def known(what: str, name: str) -> Dict[str, Any]:
        if name not in tables:
            raise ValueError(f"{what} names {name!r}, which is not among the limits")
        return tables[name]

    if not isinstance(leases or {}, Mapping):
        raise TypeError(f"leases is a dict of limit name -> True or its options, not {leases!r}")
    for name, lease in (leases or {}).items():
        if lease is True:
            known("leases", name)["lease"] = True
        elif isinstance(lease, Mapping):
            tuning = dict(lease)
            if "term" in tuning:
                tuning["term"] = _ms(tuning["term"], "a lease's term")
            known("leases", name)["lease"] = tuning
        else:
            raise TypeError(f"leases[{name!r}] is True or a dict of term, share, floor, hotAfter")
    if isinstance(fail_open, (str, bytes)):
        # A string is iterable: its characters would be taken for names.
        raise TypeError(f"fail_open is a list of limit names, not the string {fail_open!r}")
    for name in fail_open or ():
        known("fail_open", name)["failOpen"] = True
    return json.dumps({"server": server, "limits": tables})


#: The units of a rate string, in milliseconds: slowapi's (``limits``') words and
#: django-ratelimit's letters.
_UNITS = {
    "s": 1_000, "sec": 1_000, "second": 1_000, "seconds": 1_000,
    "m": 60_000, "min": 60_000, "minute": 60_000, "minutes": 60_000,
    "h": 3_600_000, "hour": 3_600_000, "hours": 3_600_000,
    "d": 86_400_000, "day": 86_400_000, "days": 86_400_000,
}
_RATE = re.compile(r"\s*(\d+)\s*(?:/|per)\s*(\d*)\s*([a-z]+)\s*", re.IGNORECASE)


def parse_rate(rate: str, name: str = "a limit") -> Dict[str, Any]:
    """A rate string as slowapi (``"5/minute"``, ``"5 per minute"``, ``"100 per 2 hours"``)
    and django-ratelimit (``"5/m"``, ``"100/10m"``) write it, as the config it means here: a
    fixed window of that many requests per period, each key's windows aligned on their own
    (as django-ratelimit offsets them per key), the whole rate available at each window's
    start. ``ValueError`` with the forms accepted for anything else."""
    match = _RATE.fullmatch(rate)
    unit = _UNITS.get(match.group(3).lower()) if match else None
    if match is None or unit is None or int(match.group(1)) < 1:
        raise ValueError(
            f"the rate {rate!r} of {name} is not one this reads: write COUNT/PERIOD as "
            "\"5/minute\", \"5 per minute\", \"5/m\" or \"100/10m\" (units s, m, h, d or "
            "second, minute, hour, day), or give a config dict"
        )
    count, many = int(match.group(1)), int(match.group(2) or 1)
    return {"kind": "fixed window", "rate": count, "capacity": count, "period": many * unit}


def validated(config: str) -> str:
    _native.validate(config)
    return config


def reply(op: str, answer: _native.Reply) -> _core.Reply:
    status, content, headers = answer
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    _, path, writes = _core.ROUTES[op]  # the HTTP API's path, for messages
    return _core.Reply(path, writes, status, reason, content, dict(headers))


def decision(
    taken: _native.Taken, op: str, name: str, throws: bool
) -> Decision:
    """The decision of a direct ``take`` (see ``_native.Taken``), as the JSON path reads it."""
    if isinstance(taken, tuple):
        return _core.decision(reply(op, taken))
    if taken == -1:
        return Decision(True)
    if taken >= 0:
        return Decision(True, taken)
    wait = -2 - taken
    if throws:
        raise RateLimitError(name, wait, "RateLimited")
    return Decision(False, wait)
