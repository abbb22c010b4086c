"""pytollgate: rate limits in this Python process on tollgate's Rust engine.

>>> from pytollgate import RateLimiter, MINUTE
>>> limiter = RateLimiter("memory", limits={
...     "send_message": {"kind": "token bucket", "rate": 10, "period": MINUTE, "capacity": 3},
... })
>>> [limiter.limit("send_message", key="alice").ok for _ in range(4)]
[True, True, True, False]

``RateLimiter`` blocks (with the GIL released while it waits for a store);
``AsyncRateLimiter`` is the same for asyncio. Their methods, answers and errors are
``tollgate_client``'s: moving to a tollgate server is a change of class.
"""

from tollgate_client import (
    DAY,
    HOUR,
    MINUTE,
    SECOND,
    Adjusted,
    Decision,
    LimitCall,
    LimitConfig,
    RateLimitError,
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
    "Adjusted",
    "AsyncRateLimiter",
    "Decision",
    "LimitCall",
    "LimitConfig",
    "RateLimit",
    "RateLimitError",
    "RateLimiter",
    "TollgateError",
    "TransactionResult",
    "ValueReading",
    "__version__",
    "parse_rate",
]
