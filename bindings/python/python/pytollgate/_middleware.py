"""What every framework's middleware decides, whatever the framework: the request's key, its
limits taken all or nothing, and the answer's status, header fields and body, written as
tollgate's tower layer writes them (crates/tollgate/src/tower): ``RateLimit-Policy`` and
``RateLimit`` on every answer, ``429`` with ``Retry-After`` in whole seconds and
``{"kind": "RateLimited", "name", "retryAfter"}`` on a refusal, ``503 {"error": "rate limit
store unavailable", "mayHaveTaken"}`` when the store fails (fail closed; the store's own
message, which names its host, user and database, goes to the log, never to the client),
``400 {"error"}`` without a key."""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generic, Iterable, List, Mapping, NotRequired, Optional, Tuple, TypedDict, Union

from tollgate_client import Milliseconds, TollgateError, TransactionResult
from tollgate_client._units import milliseconds

from . import _native
from ._common import Name

#: Where the middleware says what a client is not told: a store's failures (summed up, at
#: most one warning every LOG_EVERY seconds) and a setup that cannot work (once).
logger = logging.getLogger("pytollgate")

class LimitEntry(TypedDict, Generic[Name]):
    """One limit a request takes from, with a count other than 1."""

    name: Name
    count: NotRequired[float]


#: One limit a request takes from: its name, or ``{"name": ..., "count": ...}``.
LimitRef = Union[Name, LimitEntry[Name]]

#: A middleware's limits: one, or several (a list or a tuple) taken all or nothing. mypy
#: checks the names against a limiter annotated with a ``Literal`` of its names. (A lone
#: dict is not inferred then: give a limit with a count in a list, ``[{"name": ..., "count":
#: 5}]``. The list and tuple types, not ``Sequence``, are what let mypy infer a list of
#: names, which it would otherwise widen to ``str``.)
Names = Union[Name, LimitEntry[Name], List[LimitRef[Name]], Tuple[LimitRef[Name], ...]]

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


@dataclass
class Verdict:
    """An answer of the middleware's own, in place of the app's: ``status``, ``headers`` and
    the JSON ``body`` (no key, a store that failed, a setup that cannot work)."""

    passes: bool
    status: int = 200
    headers: Dict[str, str] = field(default_factory=dict)
    body: bytes = b""


@dataclass(frozen=True)
class RateLimit:
    """A request's decision, for its handlers (``request.state.rate_limit`` in ASGI,
    ``request.rate_limit`` in Django): ``ok``, and of the limit that decided (the one refusing
    with the longest wait, else the one with the least left of its capacity) its ``name``,
    ``limit`` (capacity), ``remaining`` (whole tokens) and ``reset`` (seconds until full);
    ``retry_after`` (seconds) when refused. The numbers are None when no one knows them (a
    request let through while the store failed). Over a tollgate server's client, ``limit``
    is the policy's quota (``q``: the rate over its window), since the server's answer
    carries no capacity. ``policy`` and ``current`` are the
    ``RateLimit-Policy`` and ``RateLimit`` header fields written for it."""

    ok: bool
    name: str
    limit: Optional[float] = None
    remaining: Optional[float] = None
    reset: Optional[float] = None
    retry_after: Optional[float] = None
    policy: Optional[str] = None
    current: Optional[str] = None


class Options(TypedDict, total=False):
    """The options every middleware and decorator takes (see pytollgate.asgi), for mypy."""

    key: KeySource
    ipv6_subnet: Ipv6Subnet
    skip: Optional[Callable[[Any], Any]]
    handler: Optional[Callable[[Any, RateLimit], Any]]
    message: Optional[RefusalMessage]
    status_code: int
    standard_headers: bool
    legacy_headers: bool
    fail_open: bool
    concurrency: Optional[ConcurrencyRef[Any]]
    concurrency_status_code: int


class ConcurrencyEntry(TypedDict, Generic[Name]):
    """A concurrency limit a request holds slots of, with a ``count`` other than 1 or a
    ``ttl`` other than the limit's (milliseconds, or a string with its unit: ``"2m"``)."""

    name: Name
    count: NotRequired[int]
    ttl: NotRequired[Milliseconds]


#: The concurrency limit a request holds a slot of while it is answered: its name, or
#: ``{"name": ..., "count": ..., "ttl": ...}``.
ConcurrencyRef = Union[Name, ConcurrencyEntry[Name]]


def limits_of(limits: Names[Any]) -> List[Dict[str, object]]:
    """The middleware's limits as transaction entries, checked once at setup."""
    listed = [limits] if isinstance(limits, (str, Mapping)) else list(limits)
    entries: List[Dict[str, object]] = [
        {"name": ref} if isinstance(ref, str) else dict(ref) for ref in listed
    ]
    if not entries or any(not isinstance(e.get("name"), str) or not e["name"] for e in entries):
        raise ValueError("limits: give at least one limit name")
    for e in entries:
        count = e.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, (int, float)) or count < 0:
            raise ValueError(f"limits: the count of {e['name']!r} is a number >= 0, not {count!r}")
    return entries


def key_of(
    source: KeySource,
    request: object,
    ip: Optional[str],
    header: Callable[[str], Optional[str]],
    ipv6_subnet: Optional[int] = DEFAULT_IPV6_SUBNET,
) -> object:
    """The key, ``None`` for none (refused), or ``...`` for one shared value (``"global"``);
    a key function's answer as it returned it (an awaitable, for an async one)."""
    if callable(source):
        return source(request)
    if source == "global":
        return ...
    if source == "ip":
        return ip_key(ip, ipv6_subnet) if ip else None
    return header(source["header"].lower())  # type: ignore[index]


def check_key(source: KeySource) -> KeySource:
    """``source``, checked once at setup."""
    if callable(source) or source in ("ip", "global"):
        return source
    if isinstance(source, Mapping) and isinstance(source.get("header"), str):
        return source
    raise ValueError(
        f"key is 'ip', 'global', {{'header': name}} or a function of the request (sync or "
        f"async) that returns the key, not {source!r}"
    )


def is_async(function: object) -> bool:
    """Whether calling ``function`` gives an awaitable (an ``async def``, or an object whose
    ``__call__`` is one)."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)
    )


#: Said to the client when the ``"ip"`` key finds no address, and logged once.
NO_ADDRESS = (
    "{label}: the request has no client address, so its \"ip\" key cannot be "
    "found (a server on a unix socket behind a proxy?). Have the server take the client's "
    "address from the proxy's header ({fix}), or give the middleware a key function."
)


class Setup:
    """What the middleware says of a setup that cannot work: logged once, as Django's
    ImproperlyConfigured would be, and told to each request it fails (a 500: the fault is
    the server's, not the client's)."""

    def __init__(self) -> None:
        self._said = False

    def no_address(self, label: str, fix: str) -> Verdict:
        message = NO_ADDRESS.format(label=label, fix=fix)
        if not self._said:
            self._said = True
            logger.error("%s Every request keyed by \"ip\" fails with 500 until then.", message)
        return Verdict(False, 500, {}, _json({"error": message}))


def missing_key(label: str) -> Verdict:
    """``label``: ``Rate limit NAME`` (the first limit), or ``Concurrency limit NAME`` for a
    middleware with no rate limits."""
    return Verdict(False, 400, {}, _json({"error": f"{label}: no key in the request."}))


class Exempt:
    """The paths a middleware lets through untaken: each exactly, or every path under it
    when it ends with ``*`` (``"/static/*"``)."""

    def __init__(self, paths: Iterable[str]) -> None:
        if isinstance(paths, str):
            raise TypeError(f"exempt is a list of paths, not the string {paths!r}")
        listed = list(paths)
        if any(not isinstance(p, str) or not p.startswith("/") for p in listed):
            raise ValueError(f"exempt paths start with '/' (a '*' at the end: every path under it): {listed!r}")
        self.exact = frozenset(p for p in listed if not p.endswith("*"))
        self.prefixes = tuple(p[:-1] for p in listed if p.endswith("*"))

    def __contains__(self, path: str) -> bool:
        return path in self.exact or (bool(self.prefixes) and path.startswith(self.prefixes))


#: A custom refusal's body: text (sent as text/plain), a dict or list (sent as JSON), or a
#: function of the request and its :class:`RateLimit` that returns one of them.
RefusalMessage = Union[str, Mapping[str, object], List[object], Callable[[Any, RateLimit], object]]


class Refusal:
    """How a middleware answers a refused request, fixed when it is made: ``status_code``
    (default 429), and ``message`` (the body; default ``{"kind": "RateLimited", "name",
    "retryAfter"}`` with the wait in ms, as the server and the tower layer write it);
    ``Retry-After`` and the header fields are written in any case."""

    def __init__(self, status_code: int, message: Optional[RefusalMessage]) -> None:
        if isinstance(status_code, bool) or not isinstance(status_code, int) or not 400 <= status_code <= 599:
            raise ValueError(f"status_code is an HTTP error status (400 to 599), not {status_code!r}")
        if message is not None and not (callable(message) or isinstance(message, (str, Mapping, list))):
            raise TypeError(f"message is text, a dict, a list or a function of (request, rate_limit), not {message!r}")
        self.status = status_code
        self.message = message

    def body(self, request: object, rate_limit: RateLimit) -> Tuple[bytes, str]:
        """The body and its content type."""
        message: object = self.message
        if message is None:
            wait = (rate_limit.retry_after or 0.0) * 1_000
            message = {"kind": "RateLimited", "name": rate_limit.name, "retryAfter": wait}
        elif callable(message):
            message = message(request, rate_limit)
        if isinstance(message, str):
            return message.encode(), "text/plain; charset=utf-8"
        return _json(message), "application/json"


def header_fields(rate_limit: RateLimit, standard: bool, legacy: bool) -> List[Tuple[str, str]]:
    """The header fields of a decision (names in lower case): the IETF ``RateLimit-Policy``
    and ``RateLimit`` (``standard``), the ``X-RateLimit-Limit``, ``-Remaining`` and ``-Reset``
    that slowapi and express-rate-limit write (``legacy``: the reset as a Unix time in
    seconds, as both write it), and ``Retry-After`` in whole seconds when refused."""
    fields: List[Tuple[str, str]] = []
    if standard and rate_limit.current is not None and rate_limit.policy is not None:
        fields.append(("ratelimit-policy", rate_limit.policy))
        fields.append(("ratelimit", rate_limit.current))
    if legacy and rate_limit.remaining is not None and rate_limit.limit is not None:
        reset = math.ceil(time.time() + (rate_limit.reset or 0.0))
        fields.append(("x-ratelimit-limit", _whole(rate_limit.limit)))
        fields.append(("x-ratelimit-remaining", _whole(rate_limit.remaining)))
        fields.append(("x-ratelimit-reset", str(reset)))
    if not rate_limit.ok:
        fields.append(("retry-after", str(max(0, math.ceil(rate_limit.retry_after or 0.0)))))
    return fields


def _whole(x: float) -> str:
    return str(int(x)) if x == int(x) else str(x)


def checked_limiter(limiter: object, asynchronous: Optional[bool], where: str, method: str) -> Tuple[bool, bool]:
    """Whether ``limiter`` is pytollgate's (in this process) and whether it blocks, checked
    against the middleware: an async limiter in a sync middleware or the reverse, an object
    that is no limiter (one without ``method``) raise, naming the fix."""
    from ._async import AsyncRateLimiter
    from ._sync import RateLimiter

    in_process = isinstance(limiter, (RateLimiter, AsyncRateLimiter))
    if in_process:
        if asynchronous is True and isinstance(limiter, RateLimiter):
            raise TypeError(
                f"{where} is async, and pytollgate.RateLimiter blocks the event loop while "
                "it waits for the store: give it pytollgate.AsyncRateLimiter (the same "
                "arguments)"
            )
        if asynchronous is False and isinstance(limiter, AsyncRateLimiter):
            raise TypeError(
                f"{where} is sync and cannot await pytollgate.AsyncRateLimiter: give it "
                "pytollgate.RateLimiter (the same arguments)"
            )
    else:
        call = getattr(limiter, method, None)
        if not callable(call):
            raise TypeError(
                f"{where} takes a limiter: pytollgate's RateLimiter / AsyncRateLimiter, "
                f"or tollgate_client's; not {limiter!r}"
            )
        awaited = is_async(call)
        if (awaited and asynchronous is False) or (not awaited and asynchronous is True):
            wanted = "AsyncRateLimiter" if asynchronous else "RateLimiter"
            raise TypeError(
                f"{where} is {'sync' if awaited else 'async'}: give it "
                f"tollgate_client.{wanted}, not {limiter!r}"
            )
    blocking = not (isinstance(limiter, AsyncRateLimiter) or is_async(getattr(limiter, method, None)))
    return in_process, blocking


class Gate:
    """One middleware's limits, resolved when it is made, and its decisions: through the
    engine's direct path for pytollgate's limiters (no JSON, the limits' configs and
    policies looked up once), through one ``transaction`` for a tollgate server's client.

    Raises at construction, naming the fix: a limit the in-process limiter does not define,
    an async limiter in a sync middleware or the reverse, an object that is no limiter.
    ``asynchronous=None`` (Django's middleware, whose settings serve WSGI and ASGI alike)
    takes a blocking limiter in an async stack too: its decisions are made in a thread of
    the event loop's executor, but on the memory store, where they are made at once."""

    def __init__(
        self,
        limiter: object,
        limits: Names[Any],
        *,
        asynchronous: Optional[bool],
        fail_open: bool,
        where: str,
    ) -> None:
        self.entries = limits_of(limits)
        self.names = [str(e["name"]) for e in self.entries]
        self.first = self.names[0]
        #: What the middleware's own answers are about: ``Rate limit NAME``.
        self.label = f"Rate limit {self.first}"
        if not isinstance(fail_open, bool):
            raise TypeError(f"fail_open is True or False, not {fail_open!r}")
        self.fail_open = fail_open
        self.limiter = limiter
        self.failures = Failures()
        self.in_process, self.blocking = checked_limiter(limiter, asynchronous, where, "transaction")
        if self.in_process:
            defined = json.loads(limiter._config)["limits"]  # type: ignore[attr-defined]
            for name in self.names:
                if name not in defined:
                    raise ValueError(
                        f"{where}: the limit {name!r} is not defined on the limiter (its "
                        f"limits: {', '.join(sorted(defined)) or 'none'}); define it in "
                        f"the limiter's limits={{...}}, or fix the name"
                    )
                if defined[name].get("kind") == "concurrency":
                    raise ValueError(
                        f"{where}: {name!r} is a concurrency limit, which a request holds a "
                        f"slot of while it is answered: give it as concurrency={name!r}, not "
                        "among the limits"
                    )
        self._engine: object = None
        self._gate: Optional[_native.Gate] = None
        #: The gate's RateLimit-Policy if it has one limit (made once, in the gate), and
        #: whether its engine answers at once (the memory store).
        self._policy: Optional[str] = None
        self._immediate = False
        self._said_awaitable = False
        self._counts = [(name, float(e.get("count", 1))) for name, e in zip(self.names, self.entries)]  # type: ignore[arg-type]

    def _gate_of(self, engine: _native.Engine) -> _native.Gate:
        """The native gate of ``engine`` (made anew for a limiter's new engine: after
        ``fork``, after a failed open)."""
        if engine is not self._engine:
            gate = self._gate = engine.gate(self._counts)
            self._engine, self._policy, self._immediate = engine, gate.policy, engine.immediate
            return gate
        assert self._gate is not None
        return self._gate

    async def decide_async(self, key: object) -> Union[RateLimit, Verdict]:
        """The decision for ``key`` (None: the limits' global value; anything else but a
        string, such as a user's id, as its text), awaited."""
        if key is not None and not isinstance(key, str):
            key = self._text(key)
            if isinstance(key, Verdict):
                return key
        limiter: Any = self.limiter
        if self.blocking:
            engine = limiter._engine if self.in_process else None
            if engine is not None and engine.immediate:
                return self.decide(key)
            return await asyncio.get_running_loop().run_in_executor(None, self.decide, key)
        try:
            if not self.in_process:
                return self._of_result(await limiter.transaction(self._calls(key), fields=True))
            engine = limiter._engine
            if engine is None:
                engine = await limiter._native()
            gate = self._gate_of(engine)
            if self._immediate:
                return self._read(gate.decide(key))
            loop = asyncio.get_running_loop()
            future: asyncio.Future[_native.Gated] = loop.create_future()
            got = gate.decide_async(key, loop, future)
            return self._read(await future if got is None else got)
        except Exception as e:  # noqa: BLE001 - any failure fails closed (or open, if asked)
            return self._failed(e)

    def decide(self, key: object) -> Union[RateLimit, Verdict]:
        """The decision for ``key``, blocking (the GIL released while the store answers)."""
        if key is not None and not isinstance(key, str):
            key = self._text(key)
            if isinstance(key, Verdict):
                return key
        limiter: Any = self.limiter
        try:
            if not self.in_process:
                return self._of_result(limiter.transaction(self._calls(key), fields=True))
            engine = limiter._engine
            if engine is None:
                engine = limiter._native()
            return self._read(self._gate_of(engine).decide(key))
        except Exception as e:  # noqa: BLE001
            return self._failed(e)

    def _text(self, key: object) -> Union[str, Verdict]:
        """A key function's answer that is not a string: its text (an int id), or a 500 for
        an awaitable, which a sync middleware cannot wait for (said once in the log)."""
        if inspect.isawaitable(key):
            if inspect.iscoroutine(key):
                key.close()  # never awaited: no warning about it at exit
            message = (
                f"Rate limit {self.first}: the key function returned an awaitable, which this "
                "sync middleware cannot wait for; make it a plain function, or serve the app "
                "with an async middleware and an AsyncRateLimiter"
            )
            if not self._said_awaitable:
                self._said_awaitable = True
                logger.error("%s", message)
            return Verdict(False, 500, {}, _json({"error": message}))
        return str(key)

    def _read(self, got: _native.Gated) -> Union[RateLimit, Verdict]:
        if len(got) == 3:
            status, message, taken = got
            return self._failed(TollgateError(message, status, taken))
        ok, wait, index, limit, remaining, reset, policy, current = got
        if remaining != remaining:  # NaN: granted by a limit that fails open
            return RateLimit(ok, self.names[index])
        return RateLimit(
            ok,
            self.names[index],
            limit,
            float(math.floor(remaining)),
            reset / 1_000,
            None if ok else wait / 1_000,
            policy or self._policy,
            current,
        )

    def _failed(self, error: Exception) -> Union[RateLimit, Verdict]:
        verdict = self.failures.failed(error)
        if self.fail_open and verdict.status >= 500:
            return RateLimit(True, self.first)
        return verdict

    def _calls(self, key: Optional[str]) -> List[Dict[str, object]]:
        return [entry if key is None else {**entry, "key": key} for entry in self.entries]

    def _of_result(self, result: TransactionResult) -> RateLimit:
        """A server's answer, read as the native gate's: the deciding limit's numbers from
        its ``RateLimit`` member (``"name";r=R;t=T``) and its policy's ``q``."""
        results = result.results
        refusing = [i for i, r in enumerate(results) if not r.ok]
        fields = result.fields or {}
        policy, current = fields.get("ratelimit-policy"), fields.get("ratelimit")
        members = _members(current)
        if refusing:
            index = max(refusing, key=lambda i: results[i].retry_after or 0.0)
        else:
            index = min(
                range(len(results)),
                key=lambda i: members.get(self.names[i], (None, None))[0] or 0.0,
            )
        name = self.names[index]
        wait = results[index].retry_after or result.retry_after or 0.0
        remaining, reset = members.get(name, (None, None))
        quota = _members(policy, "q").get(name, (None, None))[0]
        return RateLimit(
            result.ok, name, quota, remaining, reset, None if result.ok else wait / 1_000, policy, current
        )


def _members(field: Optional[str], first: str = "r") -> Dict[str, Tuple[Optional[float], Optional[float]]]:
    """``"name";r=1;t=6, ...`` as name -> (r, t) (or, with ``first="q"``, (q, w))."""
    found: Dict[str, Tuple[Optional[float], Optional[float]]] = {}
    for member in (field or "").split(", "):
        parts = member.split(";")
        if len(parts) < 2 or not parts[0].startswith('"'):
            continue
        params = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        second = "w" if first == "q" else "t"
        try:
            found[parts[0][1:-1]] = (float(params[first]), float(params.get(second, 0)))
        except (KeyError, ValueError):
            continue
    return found


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


class Slots:
    """One middleware's concurrency limit (SPEC §6f), resolved when it is made: each request
    acquires ``count`` slots of it for its key before the handler runs, and gives them back
    once (:class:`Held`) when its response ends, however it ends. A refusal is answered
    ``status_code`` (429, or 503 for a server that says it is busy) with ``Retry-After``:
    the wait until the earliest holder's expiry, in whole seconds up (a release may free a
    slot sooner). The store's failures are the rate limits': 503, or through with
    ``fail_open`` (and no slot held).

    Raises at construction, naming the fix: a name the in-process limiter does not define as
    a concurrency limit, a count above its ``max``, a count or ttl that is no such thing,
    a limiter of the wrong door (as :class:`Gate`)."""

    def __init__(
        self,
        limiter: object,
        concurrency: ConcurrencyRef[Any],
        status_code: int,
        *,
        asynchronous: Optional[bool],
        fail_open: bool,
        where: str,
    ) -> None:
        entry: Mapping[str, Any] = {"name": concurrency} if isinstance(concurrency, str) else concurrency
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"concurrency is a concurrency limit's name, or {{'name': ..., 'count': ..., "
                f"'ttl': ...}}; not {concurrency!r}"
            )
        unknown = set(entry) - {"name", "count", "ttl"}
        if unknown:
            raise ValueError(f"concurrency: {name!r} has no option {', '.join(sorted(unknown))} (count, ttl)")
        count = entry.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(
                f"concurrency: the count of {name!r} is a whole number of slots, at least 1; not {count!r}"
            )
        ttl = entry.get("ttl")
        if ttl is not None:
            ttl = milliseconds(ttl, f"concurrency: the ttl of {name!r}")
            if not ttl > 0:
                raise ValueError(f"concurrency: the ttl of {name!r} is more than 0 ms, not {entry['ttl']!r}")
        if isinstance(status_code, bool) or not isinstance(status_code, int) or not 400 <= status_code <= 599:
            raise ValueError(
                f"concurrency_status_code is an HTTP error status (429, or 503), not {status_code!r}"
            )
        if not isinstance(fail_open, bool):
            raise TypeError(f"fail_open is True or False, not {fail_open!r}")
        self.in_process, self.blocking = checked_limiter(limiter, asynchronous, where, "acquire")
        if self.in_process:
            defined = json.loads(limiter._config)["limits"]  # type: ignore[attr-defined]
            config = defined.get(name)
            if config is None or config.get("kind") != "concurrency":
                names = sorted(n for n, c in defined.items() if c.get("kind") == "concurrency")
                what = "not defined on the limiter" if config is None else "a rate limit, not a concurrency limit"
                raise ValueError(
                    f"{where}: concurrency={name!r} is {what} (its concurrency limits: "
                    f"{', '.join(names) or 'none'}); define it in the limiter's limits as "
                    "{'kind': 'concurrency', 'max': ...}, or fix the name"
                )
            if count > config.get("max", count):
                raise ValueError(
                    f"concurrency: a count of {count} slots of {name!r} could never be granted "
                    f"(its max is {config['max']})"
                )
        self.name, self.count, self.ttl = name, (None if count == 1 else count), ttl
        self.status = status_code
        self.fail_open = fail_open
        self.limiter: Any = limiter
        self.failures = Failures()
        #: What the middleware's own answers are about when it has no rate limits.
        self.label = f"Concurrency limit {name}"

    async def acquire_async(self, key: Optional[str]) -> Union[Held, RateLimit, Verdict, None]:
        """The request's slots (a :class:`Held`), a refusal (a ``RateLimit`` not ``ok``, its
        ``retry_after`` in seconds), a failure's answer, or None: through, the store failing
        and ``fail_open`` set, no slot held."""
        if self.blocking:
            engine = self.limiter._engine if self.in_process else None
            if engine is not None and engine.immediate:
                return self.acquire(key)
            return await asyncio.get_running_loop().run_in_executor(None, self.acquire, key)
        try:
            got = await self.limiter.acquire(self.name, key, self.count, self.ttl)
        except Exception as e:  # noqa: BLE001 - any failure fails closed (or open, if asked)
            return self._failed(e)
        return self._read(key, got, asyncio.get_running_loop())

    def acquire(self, key: Optional[str]) -> Union[Held, RateLimit, Verdict, None]:
        """:meth:`acquire_async`, blocking."""
        try:
            got = self.limiter.acquire(self.name, key, self.count, self.ttl)
        except Exception as e:  # noqa: BLE001
            return self._failed(e)
        return self._read(key, got, None)

    def _read(self, key: Optional[str], got: Any, loop: Optional[asyncio.AbstractEventLoop]) -> Union[Held, RateLimit]:
        if got.ok:
            return Held(self, key, got.ticket, loop)
        return RateLimit(False, self.name, retry_after=(got.retry_after or 0.0) / 1_000)

    def _failed(self, error: Exception) -> Optional[Verdict]:
        verdict = self.failures.failed(error)
        if self.fail_open and verdict.status >= 500:
            return None
        return verdict

    def refusal_fields(self, refused: RateLimit) -> List[Tuple[str, str]]:
        """A refusal's header fields: ``Retry-After`` alone (no rate limit decided)."""
        return header_fields(refused, False, False)


#: The releases under way whose request was cancelled meanwhile: kept here until they end
#: (the event loop holds only weak references to its tasks).
_releasing: "set[asyncio.Task[None]]" = set()


class Held:
    """A request's slots, released exactly once, by whichever comes first of the ways its
    response can end: the last body sent, the app raising, the request cancelled, a stream
    closed (which may come on another thread: see :meth:`release_soon`). A release that
    fails is logged, never raised: the slots are free at their ttl all the same."""

    __slots__ = ("slots", "key", "_ticket", "_loop", "_lock")

    def __init__(
        self, slots: Slots, key: Optional[str], ticket: str, loop: Optional[asyncio.AbstractEventLoop]
    ) -> None:
        self.slots, self.key = slots, key
        self._ticket: Optional[str] = ticket
        #: The event loop of an async limiter's acquire, where its release is made.
        self._loop = loop
        self._lock = threading.Lock()

    def _take(self) -> Optional[str]:
        """The ticket, the first time only."""
        with self._lock:
            ticket, self._ticket = self._ticket, None
        return ticket

    def release(self) -> None:
        """Lets the slots go (a blocking limiter), unless done already."""
        ticket = self._take()
        if ticket is not None:
            self._release(ticket)

    def _release(self, ticket: str) -> None:
        try:
            self.slots.limiter.release(self.slots.name, self.key, ticket=ticket)
        except Exception as e:  # noqa: BLE001
            self._log(e)

    async def release_async(self) -> None:
        """Lets the slots go, unless done already; a cancellation meanwhile does not stop
        the release (it goes on in a task of its own)."""
        ticket = self._take()
        if ticket is None:
            return
        if self._loop is None:  # a blocking limiter
            engine = self.slots.limiter._engine if self.slots.in_process else None
            if engine is not None and engine.immediate:
                self._release(ticket)
            else:
                await asyncio.get_running_loop().run_in_executor(None, self._release, ticket)
            return
        task = asyncio.ensure_future(self._release_async(ticket))
        _releasing.add(task)
        task.add_done_callback(_releasing.discard)
        await asyncio.shield(task)

    async def _release_async(self, ticket: str) -> None:
        try:
            await self.slots.limiter.release(self.slots.name, self.key, ticket=ticket)
        except Exception as e:  # noqa: BLE001
            self._log(e)

    def release_soon(self) -> None:
        """Lets the slots go from wherever this is called (a stream's ``close``, on a thread
        of Django's or on the event loop): at once for a blocking limiter, else as a task on
        the loop that acquired them."""
        loop = self._loop
        if loop is None:
            self.release()
            return
        ticket = self._take()
        if ticket is None:
            return

        def start() -> None:
            task = loop.create_task(self._release_async(ticket))
            _releasing.add(task)
            task.add_done_callback(_releasing.discard)

        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop closed: the slots are free at their ttl
            pass

    def _log(self, error: Exception) -> None:
        logger.warning(
            "the release of a slot of the concurrency limit %r failed (it is free at its ttl): %s",
            self.slots.name,
            error.message if isinstance(error, TollgateError) else repr(error),
        )


def _json(body: object) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
