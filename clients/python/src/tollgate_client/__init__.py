"""tollgate-client: the Python client of a tollgate rate limiting server.

>>> from tollgate_client import RateLimiter, MINUTE
>>> with RateLimiter("http://127.0.0.1:8787") as limiter:          # doctest: +SKIP
...     if not limiter.limit("sendMessage", key="alice").ok:
...         ...

``RateLimiter`` blocks; ``AsyncRateLimiter`` is the same for asyncio. Errors:
``RateLimitError`` (a refusal asked for with ``throws=True``) and ``TollgateError``
(everything else); neither is a subclass of the other.
"""

from ._algebra import Calculation, calculate_rate_limit
from ._async import AsyncRateLimiter
from ._sync import RateLimiter
from ._types import (
    DAY,
    HOUR,
    MINUTE,
    SECOND,
    Adjusted,
    Decision,
    LimitCall,
    LimitConfig,
    TransactionResult,
    ValueReading,
)
from ._units import Milliseconds, Seconds
from ._version import __version__
from .errors import RateLimitError, TollgateError

__all__ = [
    "DAY",
    "HOUR",
    "MINUTE",
    "SECOND",
    "Adjusted",
    "AsyncRateLimiter",
    "Calculation",
    "Decision",
    "LimitCall",
    "LimitConfig",
    "Milliseconds",
    "RateLimitError",
    "RateLimiter",
    "Seconds",
    "TollgateError",
    "TransactionResult",
    "ValueReading",
    "__version__",
    "calculate_rate_limit",
]
