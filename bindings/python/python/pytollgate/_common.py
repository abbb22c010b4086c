"""What the blocking and the asyncio limiters share: the config handed to the engine, and
how its answers become the client's."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any, Dict, Iterable, Mapping, Optional, Union

from tollgate_client import Decision, RateLimitError, Seconds, _core
from tollgate_client._units import seconds

from . import _native

#: A leased limit: True, or ``{"term": seconds or "30s", "share": ..., "floor": ...,
#: "hotAfter": takes}``.
LeaseOptions = Union[bool, Mapping[str, Union[float, str]]]


def _ms(duration: Seconds, what: str) -> float:
    return seconds(duration, what) * 1_000


def config_json(
    store: str,
    limits: Optional[Mapping[str, Mapping[str, Any]]],
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
        name: _core.normalize_config(config, name) for name, config in (limits or {}).items()
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
