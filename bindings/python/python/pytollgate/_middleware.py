"""What every framework's middleware decides, whatever the framework: the request's key, its
limits taken all or nothing, and the answer's status, header fields and body, written as
tollgate's tower layer writes them (crates/tollgate/src/tower): ``RateLimit-Policy`` and
``RateLimit`` on every answer, ``429`` with ``Retry-After`` in whole seconds and
``{"kind": "RateLimited", "name", "retryAfter"}`` on a refusal, ``503 {"error": "rate limit
store unavailable", "mayHaveTaken"}`` when the store fails (fail closed; the store's own
message, which names its host, user and database, goes to the log, never to the client),
``400 {"error"}`` without a key."""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

from tollgate_client import TollgateError, TransactionResult

#: Where the middleware says what a client is not told: a store's failures (summed up, at
#: most one warning every LOG_EVERY seconds) and a setup that cannot work (once).
logger = logging.getLogger("pytollgate")

#: One limit a request takes from: its name, or ``{"name": ..., "count": ...}``.
LimitRef = Union[str, Mapping[str, object]]

#: Where a request's key comes from: ``"ip"`` (the peer's address, see :func:`ip_key`),
#: ``"global"`` (one value for every request), ``{"header": "x-api-key"}``, or a function of
#: the framework's request that returns the key (None: the request has none, and is refused
#: with 400).
KeySource = Union[str, Mapping[str, str], Callable[..., Optional[str]]]

#: The prefix length an IPv6 address is keyed by: one host (a home, a VM, a phone) is given a
#: /64 at least, often a /56 or a /48, and changes address within it at will; a /56 is what
#: express-rate-limit groups by default. ``False`` (or ``None``, or 128): the whole address.
Ipv6Subnet = Union[int, bool, None]
DEFAULT_IPV6_SUBNET = 56


def check_ipv6_subnet(subnet: Ipv6Subnet) -> Optional[int]:
    """The prefix length to mask IPv6 addresses to, or None for whole addresses."""
    if subnet is None or subnet is False:
        return None
    if isinstance(subnet, bool) or not isinstance(subnet, int) or not 1 <= subnet <= 128:
        raise ValueError(
            f"ipv6_subnet is a prefix length from 1 to 128 (default {DEFAULT_IPV6_SUBNET}), "
            f"or False for whole addresses; not {subnet!r}"
        )
    return None if subnet == 128 else subnet


def ip_key(address: str, subnet: Optional[int]) -> str:
    """The ``"ip"`` key of a peer address, the same text as the Node and tower middlewares
    write: IPv4 as it is; IPv4-mapped IPv6 (``::ffff:1.2.3.4``) as its IPv4; any other IPv6
    without its zone (``%eth0``) and masked to ``subnet`` bits, as the network's first
    address in RFC 5952 form and its length (``2001:db8:abcd:1200::/56``), or whole in RFC
    5952 form when ``subnet`` is None (as the tower layer's ``ipv6_subnet(128)`` writes it).
    Anything else (a test client's name) as it is."""
    if ":" not in address:
        return address
    try:
        ip = ipaddress.IPv6Address(address)
    except ValueError:
        return address
    mapped = ip.ipv4_mapped
    if mapped is not None:
        return str(mapped)
    bits = int(ip)  # without the zone
    if subnet is None:
        return ipaddress.IPv6Address(bits).compressed
    host = 128 - subnet
    return f"{ipaddress.IPv6Address(bits >> host << host).compressed}/{subnet}"

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


def key_of(
    source: KeySource,
    request: object,
    ip: Optional[str],
    header: Callable[[str], Optional[str]],
    ipv6_subnet: Optional[int] = DEFAULT_IPV6_SUBNET,
) -> object:
    """The key, ``None`` for none (refused), or ``...`` for one shared value (``"global"``)."""
    if callable(source):
        return source(request)
    if source == "global":
        return ...
    if source == "ip":
        return ip_key(ip, ipv6_subnet) if ip else None
    if isinstance(source, Mapping) and isinstance(source.get("header"), str):
        return header(source["header"].lower())
    raise ValueError(f"key is 'ip', 'global', {{'header': name}} or a function, not {source!r}")


def check_key(source: KeySource) -> KeySource:
    """``source``, checked once at setup."""
    if callable(source) or source in ("ip", "global"):
        return source
    if isinstance(source, Mapping) and isinstance(source.get("header"), str):
        return source
    raise ValueError(f"key is 'ip', 'global', {{'header': name}} or a function, not {source!r}")


#: Said to the client when the ``"ip"`` key finds no address, and logged once.
NO_ADDRESS = (
    "Rate limit {first}: the request has no client address, so its \"ip\" key cannot be "
    "found (a server on a unix socket behind a proxy?). Have the server take the client's "
    "address from the proxy's header ({fix}), or give the middleware a key function."
)


class Setup:
    """What the middleware says of a setup that cannot work: logged once, as Django's
    ImproperlyConfigured would be, and told to each request it fails (a 500: the fault is
    the server's, not the client's)."""

    def __init__(self) -> None:
        self._said = False

    def no_address(self, first: str, fix: str) -> Verdict:
        message = NO_ADDRESS.format(first=first, fix=fix)
        if not self._said:
            self._said = True
            logger.error("%s Every request keyed by \"ip\" fails with 500 until then.", message)
        return Verdict(False, 500, {}, _json({"error": message}))


def missing_key(first: str) -> Verdict:
    return Verdict(False, 400, {}, _json({"error": f"Rate limit {first}: no key in the request."}))


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


#: The most often a middleware logs a store's failures: one warning in this many seconds,
#: with how many it sums up, however many requests fail meanwhile.
LOG_EVERY = 10.0


class Failures:
    """A middleware's store failures, for the log: the first at once, then at most one
    warning every LOG_EVERY seconds, counting the failures since the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0.0
        self._since = 0

    def failed(self, error: Exception) -> Verdict:
        """A limiter that gave no decision: fail closed, the detail to the log."""
        status = error.status if isinstance(error, TollgateError) else None
        if isinstance(error, TollgateError) and status is not None and 400 <= status < 500:
            # The request's own fault (a name not defined, a key too long): its message
            # names only what the request sent.
            return Verdict(False, status, {}, _json({"error": error.message}))
        taken = error.may_have_taken if isinstance(error, TollgateError) else True
        self._log(error)
        body = {"error": "rate limit store unavailable", "mayHaveTaken": taken}
        return Verdict(False, 503, {}, _json(body))

    def _log(self, error: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            self._since += 1
            if now < self._next:
                return
            count, self._since, self._next = self._since, 0, now + LOG_EVERY
        detail = error.message if isinstance(error, TollgateError) else repr(error)
        logger.warning(
            "the rate limit store failed %d time%s since the last warning (requests answered "
            "503, at most one warning every %g s): %s",
            count,
            "" if count == 1 else "s",
            LOG_EVERY,
            detail,
        )


def _json(body: object) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
