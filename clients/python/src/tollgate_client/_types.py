"""The values the client returns and takes: decisions, readings, transaction calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, TypedDict

from ._units import Milliseconds

__all__ = [
    "DAY",
    "HOUR",
    "MINUTE",
    "SECOND",
    "Decision",
    "LimitCall",
    "LimitConfig",
    "Adjusted",
    "TransactionResult",
    "ValueReading",
    "Acquired",
    "Renewed",
    "SlotsValue",
]

#: One second in milliseconds (every period and wait of the API is in ms).
SECOND: float = 1_000.0
#: One minute in milliseconds.
MINUTE: float = 60 * SECOND
#: One hour in milliseconds.
HOUR: float = 60 * MINUTE
#: One day in milliseconds.
DAY: float = 24 * HOUR


class LimitConfig(TypedDict, total=False):
    """A limit's config as the API spells it (SPEC §1). ``kind``, ``rate`` and ``period``
    are needed; the rest have defaults on the server. ``max_reserved`` is accepted for
    ``maxReserved`` too (any snake_case key is sent in camelCase)."""

    kind: str  # "token bucket" or "fixed window"
    rate: float  # tokens per period
    #: Milliseconds (at least 1,000 as a bare number: 60 would be 60 ms, and is refused), or
    #: a string with its unit, "10s", "1m", "250ms".
    period: Milliseconds
    capacity: float  # default: rate
    maxReserved: float  # default: unbounded
    shards: int  # default: 1
    start: float  # fixed windows only: alignment, ms since the Unix epoch
    calendar: str  # fixed windows only, in place of period and start: day, week, month, year
    timeZone: str  # the IANA zone of calendar windows; default "UTC"


@dataclass(frozen=True)
class Decision:
    """The answer to ``limit`` or ``check``: granted (``ok``) or not, and how long to wait
    in milliseconds (``retry_after``; ``None`` when the server sent none: nothing to wait
    for). A granted reservation (``reserve=True``) is ``ok`` with a ``retry_after``: the
    time at which the booked tokens are there."""

    ok: bool
    retry_after: Optional[float] = None


@dataclass(frozen=True)
class TransactionResult:
    """The answer to a ``transaction``: ``ok`` when every limit granted (and then all of them
    took), else nothing was taken anywhere. ``results`` has one :class:`Decision` per limit,
    in the order sent; ``retry_after`` is the longest wait among them."""

    ok: bool
    retry_after: Optional[float] = None
    results: List[Decision] = field(default_factory=list)
    #: With ``fields=True``: the answer's ``RateLimit-Policy``, ``RateLimit`` and
    #: ``Retry-After`` header fields by their lower-case names, as the server wrote them
    #: (what the middleware sends).
    fields: Optional[Dict[str, str]] = None
    #: With a concurrency limit among the limits (at most one), when every limit granted:
    #: its slot's ticket, taken together with the tokens; release it when the work is done.
    ticket: Optional[str] = None
    #: With ``ticket``: when its slots are free again unless renewed (ms since the epoch).
    expires_at: Optional[float] = None


@dataclass(frozen=True)
class Adjusted:
    """The answer to ``adjust``: the limit's ``value`` after it (negative while in debt),
    and while it is negative ``retry_after``, the milliseconds until it is back at 0 (the
    next requests wait for it)."""

    value: float
    retry_after: Optional[float] = None


@dataclass(frozen=True)
class ValueReading:
    """The stored state of a limit (``get_value``): ``value`` tokens at time ``ts`` (ms since
    the Unix epoch; 0 for a key with no state yet), the ``shard`` read, and the ``config``
    with every default filled in (a fixed window's ``start`` set), as the server sent it."""

    value: float
    ts: float
    shard: int
    config: Dict[str, Any]


@dataclass(frozen=True)
class LimitCall:
    """One limit of a ``transaction``. Plain dicts work too, with the same keys (snake_case
    or camelCase)."""

    name: str
    key: Optional[str] = None
    count: Optional[float] = None
    reserve: bool = False
    config: Optional[Mapping[str, Any]] = None


@dataclass(frozen=True)
class Acquired:
    """The answer to ``acquire`` (a concurrency limit's slots, SPEC §6f): granted (``ok``)
    with the ``ticket`` that holds the slots, a string of digits to give back as it came, and
    ``expires_at``, when they are free again unless released or renewed (ms since the Unix
    epoch, on the store's clock); or refused, nothing taken, with ``retry_after``: the ms
    until the earliest holder's expiry (a release may free a slot sooner)."""

    ok: bool
    ticket: Optional[str] = None
    expires_at: Optional[float] = None
    retry_after: Optional[float] = None


@dataclass(frozen=True)
class Renewed:
    """The answer to ``renew``: ``ok`` with the new ``expires_at``, or not ``ok`` when the
    ticket had expired (its slots may be someone else's by then: stop the work, or acquire
    again)."""

    ok: bool
    expires_at: Optional[float] = None


@dataclass(frozen=True)
class SlotsValue:
    """A concurrency limit's slots for a key (``get_slots_value``): ``in_flight`` held by
    unexpired tickets, the limit's ``max``, and how many tickets (``holders``) hold them."""

    in_flight: int
    max: int
    holders: int
