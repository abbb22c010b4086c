"""What the sync and async clients share: request bodies, reading answers, errors.

Nothing here does I/O, so both clients build the same requests and read answers the same
way; each of them only adds its own ``send``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import fields as dataclass_fields
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import httpx

from ._types import (
    Acquired,
    Adjusted,
    Decision,
    LimitCall,
    Renewed,
    SlotsValue,
    TransactionResult,
    ValueReading,
)
from ._units import Milliseconds, check_period, milliseconds
from ._version import __version__
from .errors import RateLimitError, TollgateError

__all__ = ["Core", "TransactionCall", "Limits", "Reply", "Body"]

#: A transaction's limit: a :class:`LimitCall`, or a mapping with the same keys.
TransactionCall = Union[LimitCall, Mapping[str, Any]]
#: Configs in code: limit name -> config.
Limits = Mapping[str, Mapping[str, Any]]

# Compact and strict: NaN and infinities are not JSON (the server could only call the body
# malformed), so they are refused before anything is sent; so is a string that is not
# Unicode (a lone surrogate), which UTF-8 cannot encode (escaped, the server would only
# call it malformed).
_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


# NaN and infinities are not JSON either way: an answer with them is not JSON.
_decoder = json.JSONDecoder(parse_constant=_refuse)


def _decode(content: bytes) -> Any:
    """The JSON value of `content`; ValueError if it is not JSON (too deeply nested
    included)."""
    try:
        return _decoder.decode(content.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply") from None

# At most this much of an answer that is not what the API sends is quoted in an error.
_SNIPPET = 200

_LIMIT_CALL_FIELDS = tuple(f.name for f in dataclass_fields(LimitCall))


def camel(key: str) -> str:
    """``max_reserved`` -> ``maxReserved``; camelCase keys come back unchanged."""
    if "_" not in key:
        return key
    head, *rest = key.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def normalize_config(config: Mapping[str, Any], name: str = "a limit's config") -> Dict[str, Any]:
    """A config with its keys in the API's camelCase. Its values are checked by the server
    (whose 400 names the field), but for a ``period`` written as a bare number below a
    second, refused here (``ValueError``: see :func:`~tollgate_client._units.check_period`)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"a limit config is a mapping (dict), not {type(config).__name__}")
    normal = {camel(key): value for key, value in config.items()}
    check_period(normal.get("period"), name)
    return normal


#: The header fields an answer's reader keeps.
FIELDS = ("ratelimit-policy", "ratelimit", "retry-after")


class Reply(NamedTuple):
    """An answer, read whole: what the readers below need of it."""

    #: The request's path (``/v1/limit``), for messages.
    path: str
    #: Whether the call may take tokens (``limit``, ``transaction``, ``reset``, ``adjust``).
    writes: bool
    status: int
    reason: str
    content: bytes
    #: The answer's rate limit header fields (``ratelimit-policy``, ``ratelimit``,
    #: ``retry-after``), when it has them.
    fields: Mapping[str, str] = {}


class Body:
    """An answer's body as it arrives, refused once it passes ``cap`` bytes (or says it
    will, in its Content-Length). Asked for as ``identity`` (see :func:`headers`), so what
    arrives is what is read: an answer encoded all the same is not the API's."""

    __slots__ = ("_path", "_writes", "_status", "_reason", "_cap", "_data", "_fields")

    def __init__(self, path: str, writes: bool, response: httpx.Response, cap: int) -> None:
        self._path, self._writes, self._cap = path, writes, cap
        self._status, self._reason = response.status_code, response.reason_phrase
        self._data = bytearray()
        self._fields = {f: response.headers[f] for f in FIELDS if f in response.headers}
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            raise self._too_large()
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", ""):
            raise _unexpected(self.reply(), f"encoded ({encoding}) although asked not to be")

    def add(self, chunk: bytes) -> None:
        self._data += chunk
        if len(self._data) > self._cap:
            raise self._too_large()

    def reply(self) -> Reply:
        data = bytes(self._data)
        return Reply(self._path, self._writes, self._status, self._reason, data, self._fields)

    def _too_large(self) -> TollgateError:
        return TollgateError(
            f"the answer of {self._path} is larger than max_answer_bytes ({self._cap} bytes); "
            "raise it if the server's answers are meant to be that large",
            self._status,
            _unknown_outcome(self._writes, self._status),
        )


def _unknown_outcome(writes: bool, status: int) -> bool:
    """``may_have_taken`` for an answer that cannot be read as the API's: a write may have
    been applied, unless the status (4xx) says the request was refused."""
    return writes and not 400 <= status < 500


def _number(x: object) -> Optional[float]:
    """`x` as a float if it is a finite JSON number, else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        number = float(x)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return number if math.isfinite(number) else None


def _wait(x: object) -> Optional[float]:
    """`x` as a float if it is a ``retryAfter``: a finite number of ms, not negative."""
    number = _number(x)
    return number if number is not None and number >= 0 else None


def _snippet(reply: Reply) -> str:
    text = reply.content[:_SNIPPET].decode("utf-8", "replace").strip()
    return text if text else "(empty body)"


def _unexpected(reply: Reply, what: str) -> TollgateError:
    return TollgateError(
        f"unexpected answer from {reply.path}: {what}: {_snippet(reply)}",
        reply.status,
        _unknown_outcome(reply.writes, reply.status),
    )


def error_of(reply: Reply) -> Union[RateLimitError, TollgateError]:
    """The exception for an answer that is not a 200."""
    status = reply.status
    try:
        body = _decode(reply.content)
    except ValueError:
        body = None
    if isinstance(body, dict):
        if status == 429 and body.get("kind") == "RateLimited":
            name, wait = body.get("name"), _wait(body.get("retryAfter"))
            if isinstance(name, str) and wait is not None:
                return RateLimitError(name, wait, "RateLimited")
        message = body.get("error")
        if isinstance(message, str):
            # The server's own error: nothing taken unless it says so.
            return TollgateError(message, status, body.get("mayHaveTaken") is True)
    reason = reply.reason or "error"
    return TollgateError(
        f"HTTP {status} {reason}: {_snippet(reply)}",
        status,
        _unknown_outcome(reply.writes, status),
    )


# Failures before the request went out: nothing can have been taken.
_UNSENT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ProxyError,
    httpx.UnsupportedProtocol,
    RuntimeError,
)


def transport_error(exc: Exception, url: Any, writes: bool) -> TollgateError:
    """An httpx exception (or a closed client) as a :class:`TollgateError` without a
    status: the request got no answer. A write may have been applied once it was sent:
    after anything but a failure to connect, or to get a connection at all."""
    taken = writes and not isinstance(exc, _UNSENT)
    if isinstance(exc, httpx.TimeoutException):
        phase = {
            httpx.ConnectTimeout: "connecting to",
            httpx.ReadTimeout: "waiting for the answer of",
            httpx.WriteTimeout: "sending the request to",
            httpx.PoolTimeout: "waiting for a free connection to",
        }.get(type(exc), "talking to")
        return TollgateError(f"timed out {phase} {url} (the client's timeout)", None, taken)
    if isinstance(exc, httpx.ConnectError):
        return TollgateError(f"cannot connect to {url}: {exc or type(exc).__name__}")
    if isinstance(exc, RuntimeError):
        return TollgateError(f"the client is closed; cannot send to {url}")
    return TollgateError(
        f"request to {url} failed: {type(exc).__name__}: {exc}", None, taken
    )


def answer(reply: Reply) -> Dict[str, Any]:
    """The JSON object of a 200 answer; anything else raises."""
    if reply.status != 200:
        raise error_of(reply)
    try:
        body = _decode(reply.content)
    except ValueError:
        raise _unexpected(reply, "not JSON") from None
    if not isinstance(body, dict):
        raise _unexpected(reply, "not a JSON object")
    return body


def decision_of(body: object, reply: Reply) -> Decision:
    """A decision: ``ok`` a boolean, ``retryAfter`` absent or a wait."""
    if isinstance(body, dict) and isinstance(body.get("ok"), bool):
        if "retryAfter" not in body:
            return Decision(body["ok"])
        wait = _wait(body["retryAfter"])
        if wait is not None:
            return Decision(body["ok"], wait)
    raise _unexpected(reply, "not a decision")


def decision(reply: Reply) -> Decision:
    return decision_of(answer(reply), reply)


def transaction_result(reply: Reply, count: int, fields: bool = False) -> TransactionResult:
    """A transaction's answer, with one decision per limit of the `count` sent (and the
    answer's rate limit header fields if `fields`)."""
    body = answer(reply)
    overall = decision_of(body, reply)
    results = body.get("results")
    if not isinstance(results, list) or len(results) != count:
        raise _unexpected(reply, f"not one result per limit ({count})")
    ticket, expires_at = body.get("ticket"), body.get("expiresAt")
    if ticket is not None and (not isinstance(ticket, str) or _number(expires_at) is None):
        raise _unexpected(reply, "not a transaction: its ticket is not one")
    return TransactionResult(
        overall.ok,
        overall.retry_after,
        [decision_of(r, reply) for r in results],
        dict(reply.fields) if fields else None,
        ticket,
        _number(expires_at) if ticket is not None else None,
    )


def value_reading(reply: Reply) -> ValueReading:
    body = answer(reply)
    value, ts, shard = (_number(body.get(k)) for k in ("value", "ts", "shard"))
    config = body.get("config")
    if (
        value is not None
        and ts is not None
        and shard is not None
        and shard.is_integer()
        and shard >= 0
        and isinstance(config, dict)
    ):
        return ValueReading(value, ts, int(shard), config)
    raise _unexpected(reply, "not a value")


def adjusted(reply: Reply) -> Adjusted:
    """An adjust's answer: ``value`` a number, ``retryAfter`` absent or a wait."""
    body = answer(reply)
    value = _number(body.get("value"))
    if value is not None:
        if "retryAfter" not in body:
            return Adjusted(value)
        wait = _wait(body["retryAfter"])
        if wait is not None:
            return Adjusted(value, wait)
    raise _unexpected(reply, "not an adjust's answer")


def _time(x: object) -> Optional[float]:
    """`x` as a float if it is a time on the store's clock: finite, not negative."""
    number = _number(x)
    return number if number is not None and number >= 0 else None


def _tally(x: object) -> Optional[int]:
    """`x` as an int if it is a count of slots or holders: a whole number, not negative."""
    number = _number(x)
    return int(number) if number is not None and number.is_integer() and number >= 0 else None


def acquired(reply: Reply) -> Acquired:
    """An acquire's answer: a ticket (a string of digits) and its expiry, or a wait."""
    body = answer(reply)
    ok = body.get("ok")
    if ok is True:
        ticket, expires_at = body.get("ticket"), _time(body.get("expiresAt"))
        if isinstance(ticket, str) and ticket.isascii() and ticket.isdigit():
            if expires_at is not None:
                return Acquired(True, ticket, expires_at)
    elif ok is False:
        wait = _wait(body.get("retryAfter"))
        if wait is not None:
            return Acquired(False, retry_after=wait)
    raise _unexpected(reply, "not an acquire's answer")


def released(reply: Reply) -> bool:
    """A release's answer: whether the ticket's slots were freed by it."""
    body = answer(reply)
    if isinstance(body.get("released"), bool):
        return bool(body["released"])
    raise _unexpected(reply, "not a release's answer")


def renewed(reply: Reply) -> Renewed:
    """A renew's answer: the new expiry, or not ok."""
    body = answer(reply)
    ok = body.get("ok")
    if ok is False:
        return Renewed(False)
    expires_at = _time(body.get("expiresAt"))
    if ok is True and expires_at is not None:
        return Renewed(True, expires_at)
    raise _unexpected(reply, "not a renew's answer")


def slots_value(reply: Reply) -> SlotsValue:
    """A concurrency limit's value: ``inFlight``, ``max`` and ``holders``."""
    body = answer(reply)
    in_flight, most, holders = (_tally(body.get(k)) for k in ("inFlight", "max", "holders"))
    if in_flight is not None and most is not None and holders is not None:
        return SlotsValue(in_flight, most, holders)
    raise _unexpected(
        reply, "not a concurrency limit's value (a rate limit's? read it with get_value)"
    )


def held(name: str, reply: Reply) -> Tuple[str, float]:
    """The ticket and expiry of a hold's acquire, as its block is entered; a refusal raises
    :class:`RateLimitError` (the block must not run without its slots)."""
    granted = acquired(reply)
    if granted.ticket is None or granted.expires_at is None:
        raise RateLimitError(name, granted.retry_after or 0.0, "RateLimited")
    return granted.ticket, granted.expires_at


class Slot:
    """A ticket's slots as a hold knows them, whichever limiter holds them: the concurrency
    limit's ``name``, the ``key`` and ``ticket`` they were acquired with, ``expires_at`` and
    ``released``. The blocking ``Held`` and the asyncio ``AsyncHeld`` add ``renew`` and
    ``release``."""

    __slots__ = ("name", "key", "ticket", "_expires_at", "_released")

    def __init__(self, name: str, key: Optional[str], ticket: str, expires_at: float) -> None:
        self.name = name
        self.key = key
        self.ticket = ticket
        self._expires_at = expires_at
        self._released = False

    @property
    def expires_at(self) -> float:
        """When the slots are free again unless renewed: ms since the Unix epoch, on the
        store's clock."""
        return self._expires_at

    @property
    def released(self) -> bool:
        """Whether ``release()`` has let the slots go (or found them expired already)."""
        return self._released

    def _renewed(self, renewed: Renewed) -> bool:
        """A renew's answer, its new expiry kept."""
        if renewed.ok and renewed.expires_at is not None:
            self._expires_at = renewed.expires_at
        return renewed.ok

    def __repr__(self) -> str:
        kind = type(self).__name__
        return f"{kind}(name={self.name!r}, key={self.key!r}, ticket={self.ticket!r})"


def server_time(reply: Reply) -> float:
    now = _number(answer(reply).get("now"))
    if now is not None:
        return now
    raise _unexpected(reply, "no time")


def server_limits(reply: Reply) -> Dict[str, Dict[str, Any]]:
    body = answer(reply)
    if all(isinstance(config, dict) for config in body.values()):
        return body
    raise _unexpected(reply, "not the limits")


def encode(body: Any) -> bytes:
    try:
        return _encode(body).encode()
    except UnicodeEncodeError:
        raise TollgateError(
            "the request cannot be sent: a string of it is not Unicode (a lone surrogate)"
        ) from None
    except (TypeError, ValueError) as e:
        # Nothing was sent: a NaN count, a key that is not a string or number, ...
        raise TollgateError(f"the request cannot be sent as JSON: {e}") from None


class Bodies:
    """How a client builds request bodies, with its configs in code: the server's client
    (:class:`Core`) and the in-process one (the ``pytollgate`` package) alike."""

    __slots__ = ("limits",)

    def __init__(self, limits: Optional[Limits]) -> None:
        self.limits: Dict[str, Dict[str, Any]] = {
            name: normalize_config(config, name) for name, config in (limits or {}).items()
        }

    def config_for(
        self, name: str, config: Optional[Mapping[str, Any]]
    ) -> Optional[Dict[str, Any]]:
        """The config to send inline: the call's own, else the one given in code for this
        name, else none (a name the server defines)."""
        if config is not None:
            return normalize_config(config, name)
        return self.limits.get(name)

    def single(
        self,
        name: str,
        key: Optional[str],
        count: Optional[float],
        reserve: bool,
        throws: bool,
        config: Optional[Mapping[str, Any]],
    ) -> bytes:
        body: Dict[str, Any] = {"name": name}
        if key is not None:
            body["key"] = key
        if count is not None:
            body["count"] = count
        if reserve is not False and reserve is not None:
            # Sent as it is: True, or anything else for the API to refuse (400), as a
            # transaction's limit is ("yes" is not True).
            body["reserve"] = reserve
        if throws:
            body["throws"] = True
        inline = self.config_for(name, config)
        if inline is not None:
            body["config"] = inline
        return encode(body)

    def transaction(
        self, calls: Sequence[TransactionCall], throws: bool
    ) -> Tuple[bytes, int]:
        """The body, and how many limits it holds (the answer has a result for each)."""
        if isinstance(calls, (str, bytes, Mapping, LimitCall)):
            raise TypeError("transaction takes a list of limits (LimitCall or dict)")
        limits: List[Dict[str, Any]] = [self._entry(call) for call in calls]
        if throws and limits:
            # The server raises the 429 if any limit of the transaction has throws.
            limits[0]["throws"] = True
        return encode({"limits": limits}), len(limits)

    def _entry(self, call: TransactionCall) -> Dict[str, Any]:
        if isinstance(call, LimitCall):
            items: Any = ((f, getattr(call, f)) for f in _LIMIT_CALL_FIELDS)
        elif isinstance(call, Mapping):
            items = call.items()
        else:
            raise TypeError(
                f"a transaction's limit is a LimitCall or a dict, not {type(call).__name__}"
            )
        entry: Dict[str, Any] = {}
        for key, value in items:
            # Unset fields are not sent; nor is reserve/throws False (the default).
            if value is None or value is False:
                continue
            key = camel(key)
            entry[key] = normalize_config(value, f"{call!r}") if key == "config" else value
        name = entry.get("name")
        if not isinstance(name, str):
            raise ValueError(f"a transaction's limit needs a name: {call!r}")
        if "config" not in entry and name in self.limits:
            entry["config"] = self.limits[name]
        return entry

    def reset(self, name: str, key: Optional[str]) -> bytes:
        body: Dict[str, Any] = {"name": name}
        if key is not None:
            body["key"] = key
        return encode(body)

    def adjust(
        self,
        name: str,
        key: Optional[str],
        count: float,
        config: Optional[Mapping[str, Any]],
    ) -> bytes:
        finite = isinstance(count, (int, float)) and math.isfinite(count)
        if isinstance(count, bool) or not finite:
            raise ValueError(f"adjust: count must be a finite number; got {count!r}")
        body: Dict[str, Any] = {"name": name, "count": count}
        if key is not None:
            body["key"] = key
        inline = self.config_for(name, config)
        if inline is not None:
            body["config"] = inline
        return encode(body)

    def value(
        self,
        name: str,
        key: Optional[str],
        sample_shards: Optional[int],
        config: Optional[Mapping[str, Any]],
    ) -> bytes:
        body: Dict[str, Any] = {"name": name}
        if key is not None:
            body["key"] = key
        if sample_shards is not None:
            body["sampleShards"] = sample_shards
        inline = self.config_for(name, config)
        if inline is not None:
            body["config"] = inline
        return encode(body)

    def acquire(
        self,
        name: str,
        key: Optional[str],
        count: Optional[int],
        ttl: Optional[Milliseconds],
        throws: bool,
    ) -> bytes:
        """The body of ``acquire`` (and ``hold``): a concurrency limit's name, never a
        config (the server, or the in-process limiter, defines it)."""
        body: Dict[str, Any] = {"name": name}
        if key is not None:
            body["key"] = key
        if count is not None:
            body["count"] = count
        if ttl is not None:
            body["ttl"] = milliseconds(ttl, "ttl")
        if throws:
            body["throws"] = True
        return encode(body)

    def ticket(
        self, name: str, key: Optional[str], ticket: str, ttl: Optional[Milliseconds] = None
    ) -> bytes:
        """The body of ``release`` and ``renew`` (with its ``ttl``)."""
        if not isinstance(ticket, str):
            raise TypeError(f"ticket is the string an acquire answered, not {ticket!r}")
        body: Dict[str, Any] = {"name": name, "ticket": ticket}
        if key is not None:
            body["key"] = key
        if ttl is not None:
            body["ttl"] = milliseconds(ttl, "ttl")
        return encode(body)


#: Each operation of the API: its method, its path, and whether it may take tokens (or
#: slots).
ROUTES: Dict[str, Tuple[str, str, bool]] = {
    "limit": ("POST", "/v1/limit", True),
    "check": ("POST", "/v1/check", False),
    "transaction": ("POST", "/v1/transaction", True),
    "reset": ("POST", "/v1/reset", True),
    "value": ("POST", "/v1/value", False),
    "adjust": ("POST", "/v1/adjust", True),
    "acquire": ("POST", "/v1/acquire", True),
    "release": ("POST", "/v1/release", True),
    "renew": ("POST", "/v1/renew", True),
    "time": ("GET", "/v1/time", False),
    "config": ("GET", "/v1/config", False),
}


class Core(Bodies):
    """A client's URLs, its configs in code, and how it builds request bodies."""

    __slots__ = ("base", "routes")

    def __init__(self, url: str, limits: Optional[Limits]) -> None:
        if not isinstance(url, str):
            raise TypeError(f"url is a string such as 'http://127.0.0.1:8787', not {url!r}")
        base = url.rstrip("/")
        try:
            parsed = httpx.URL(base)
        except httpx.InvalidURL as e:
            raise ValueError(f"url {url!r} is not a URL: {e}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"url {url!r} must be http:// or https:// with a host")
        if parsed.query or parsed.fragment:
            raise ValueError(f"url {url!r} must have no query or fragment")
        super().__init__(limits)
        self.base = base
        #: Each operation's request: method, URL (parsed once: each request takes the URL
        #: object as it is) and whether it may take tokens.
        self.routes: Dict[str, Tuple[str, httpx.URL, bool]] = {
            op: (method, httpx.URL(base + path), writes)
            for op, (method, path, writes) in ROUTES.items()
        }


def headers(token: Optional[str]) -> Dict[str, str]:
    result = {
        "Content-Type": "application/json",
        "Accept": "application/json",
        # What arrives is what is read, and counted against max_answer_bytes (a compressed
        # answer could grow a thousandfold as it is decoded).
        "Accept-Encoding": "identity",
        "User-Agent": f"tollgate-client-python/{__version__}",
    }
    if token is not None:
        if not isinstance(token, str) or not token or not all(" " < c < "\x7f" for c in token):
            raise ValueError("token must be a non-empty string of visible ASCII characters")
        result["Authorization"] = f"Bearer {token}"
    return result


def timeout_of(timeout: Optional[float]) -> httpx.Timeout:
    return httpx.Timeout(timeout)


def deadline_of(timeout: Optional[float]) -> Optional[float]:
    """When a call made now must end (``time.monotonic()``), or None."""
    return None if timeout is None else time.monotonic() + timeout


#: The most bytes an answer may have: far above any answer but that of ``get_config`` for a
#: config file of tens of thousands of limits.
DEFAULT_MAX_ANSWER_BYTES = 8 * 1024 * 1024


def check_max_answer_bytes(max_answer_bytes: int) -> int:
    if isinstance(max_answer_bytes, bool) or not isinstance(max_answer_bytes, int):
        raise TypeError("max_answer_bytes is an int")
    if max_answer_bytes < 1:
        raise ValueError("max_answer_bytes must be at least 1")
    return max_answer_bytes


#: Connections per client: with a server about a millisecond away, 10 carry more than an
#: httpx client can send (more connections only cost httpcore's pool more work per request).
DEFAULT_MAX_CONNECTIONS = 10


def check_max_connections(max_connections: int) -> int:
    if isinstance(max_connections, bool) or not isinstance(max_connections, int):
        raise TypeError("max_connections is an int")
    if max_connections < 1:
        raise ValueError("max_connections must be at least 1")
    return max_connections


def pool_limits(max_connections: int) -> httpx.Limits:
    """Every connection of the pool is kept alive (httpx keeps only 20 by default and closes
    the rest after each use: a busy client would keep opening connections). Idle ones are
    closed after 5 s, before the server's 10 s idle timeout can close them under a request."""
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=5.0,
    )
