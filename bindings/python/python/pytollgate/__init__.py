"""pytollgate: rate limits in this Python process on tollgate's Rust engine.

>>> from pytollgate import RateLimiter, MINUTE
>>> limiter = RateLimiter("memory", limits={
...     "send_message": {"kind": "token bucket", "rate": 10, "period": MINUTE, "capacity": 3},
... })
>>> [limiter.limit("send_message", key="alice").ok for _ in range(4)]
[True, True, True, False]

``RateLimiter`` blocks (with the GIL released while it waits for a store);
``AsyncRateLimiter`` is the same for asyncio. A concurrency limit (``{"kind": "concurrency",
"max": 4, "ttl": "2m"}``) bounds work in flight: ``acquire``/``release``/``renew`` its slots,
or hold them for a block (``with limiter.hold("exports", key=tenant) as slot:``). Their methods, answers and errors are
``tollgate_client``'s: moving to a tollgate server is a change of class.
"""

from tollgate_client import (
    DAY,
    HOUR,
    MINUTE,
    SECOND,
    Acquired,
    Adjusted,
    AsyncHeld,
    AsyncHold,
    Decision,
    Held,
    Hold,
    LimitCall,
    LimitConfig,
    RateLimitError,
    Renewed,
    SlotsValue,
    TollgateError,
    TransactionResult,
    ValueReading,
)

from ._async import AsyncRateLimiter
from ._common import parse_rate
from ._middleware import RateLimit
from ._sync import RateLimiter

__version__ = "0.1.0"

__all__ = [
    "DAY",
    "HOUR",
    "MINUTE",
    "SECOND",
    "Acquired",
    "Adjusted",
    "AsyncHeld",
    "AsyncHold",
    "AsyncRateLimiter",
    "Decision",
    "Held",
    "Hold",
    "LimitCall",
    "LimitConfig",
    "RateLimit",
    "RateLimitError",
    "RateLimiter",
    "Renewed",
    "SlotsValue",
    "TollgateError",
    "TransactionResult",
    "ValueReading",
    "__version__",
    "parse_rate",
]
