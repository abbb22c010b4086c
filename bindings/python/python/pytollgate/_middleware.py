"""What every framework's middleware decides, whatever the framework: the request's key, its
limits taken all or nothing, and the answer's status, header fields and body, written as
tollgate's tower layer writes them (crates/tollgate/src/tower): ``RateLimit-Policy`` and
``RateLimit`` on every answer, ``429`` with ``Retry-After`` in whole seconds and
``{"kind": "RateLimited", "name", "retryAfter"}`` on a refusal, ``503 {"error",
"mayHaveTaken"}`` when the store fails (fail closed), ``400 {"error"}`` without a key."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

from tollgate_client import TollgateError, TransactionResult

#: One limit a request takes from: its name, or ``{"name": ..., "count": ...}``.
LimitRef = Union[str, Mapping[str, object]]

#: Where a request's key comes from: ``"ip"`` (the peer's address), ``"global"`` (one value
#: for every request), ``{"header": "x-api-key"}``, or a function of the framework's request
#: that returns the key (None: the request has none, and is refused with 400).
KeySource = Union[str, Mapping[str, str], Callable[..., Optional[str]]]

_NAMES = {"ratelimit-policy": "RateLimit-Policy", "ratelimit": "RateLimit", "retry-after": "Retry-After"}


@dataclass
class Verdict:
    """Pass the request on (with ``headers`` on its answer), or answer it with ``status``,
    ``headers`` and the JSON ``body``."""

    passes: bool
    status: int = 200
    headers: Dict[str, str] = field(default_factory=dict)
    body: bytes = b""


def limits_of(limits: Union[LimitRef, Sequence[LimitRef]]) -> List[Dict[str, object]]:
    """The middleware's limits as transaction entries, checked once at setup."""
    listed = [limits] if isinstance(limits, (str, Mapping)) else list(limits)
    entries: List[Dict[str, object]] = [
        {"name": ref} if isinstance(ref, str) else dict(ref) for ref in listed
    ]
    if not entries or any(not isinstance(e.get("name"), str) or not e["name"] for e in entries):
        raise ValueError("limits: give at least one limit name")
    return entries


def key_of(source: KeySource, request: object, ip: Optional[str], header: Callable[[str], Optional[str]]) -> object:
    """The key, ``None`` for none (refused), or ``...`` for one shared value (``"global"``)."""
    if callable(source):
        return source(request)
    if source == "global":
        return ...
    if source == "ip":
        return ip
    if isinstance(source, Mapping) and isinstance(source.get("header"), str):
        return header(source["header"].lower())
    raise ValueError(f"key is 'ip', 'global', {{'header': name}} or a function, not {source!r}")


def missing_key(source: KeySource, first: str) -> Verdict:
    what = "no peer address" if source == "ip" else "no key in the request"
    return Verdict(False, 400, {}, _json({"error": f"Rate limit {first}: {what}."}))


def calls(entries: List[Dict[str, object]], key: object) -> List[Dict[str, object]]:
    return [entry if key is ... else {**entry, "key": key} for entry in entries]


def verdict(entries: List[Dict[str, object]], result: TransactionResult) -> Verdict:
    """How to answer, from the transaction's result (taken with ``fields=True``)."""
    headers = {_NAMES.get(k, k): v for k, v in (result.fields or {}).items()}
    if result.ok:
        headers.pop("Retry-After", None)
        return Verdict(True, 200, headers)
    # The refusal that waits longest names the answer, as the tower layer's does.
    refusing = 0
    for i, r in enumerate(result.results):
        longest = result.results[refusing]
        if not r.ok and (longest.ok or (r.retry_after or 0) > (longest.retry_after or 0)):
            refusing = i
    wait = result.results[refusing].retry_after or result.retry_after or 0.0
    headers.setdefault("Retry-After", str(max(0, math.ceil(wait / 1_000))))
    body = {"kind": "RateLimited", "name": entries[refusing]["name"], "retryAfter": wait}
    return Verdict(False, 429, headers, _json(body))


def failed(error: Exception) -> Verdict:
    """A limiter that gave no decision: fail closed."""
    if isinstance(error, TollgateError) and error.status is not None and 400 <= error.status < 500:
        return Verdict(False, error.status, {}, _json({"error": error.message}))
    taken = error.may_have_taken if isinstance(error, TollgateError) else True
    message = error.message if isinstance(error, TollgateError) else str(error)
    return Verdict(False, 503, {}, _json({"error": message, "mayHaveTaken": taken}))


def _json(body: object) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
