"""tollgate-client: the Python client of a tollgate rate limiting server.

>>> from tollgate_client import RateLimiter, MINUTE
>>> with RateLimiter("http://127.0.0.1:8787") as limiter:          # doctest: +SKIP
...     if not limiter.limit("sendMessage", key="alice").ok:
...         ...

``RateLimiter`` blocks; ``AsyncRateLimiter`` is the same for asyncio. Concurrency limits'
slots are taken with ``acquire`` (``release``, ``renew``), or held for a ``with`` block:

>>> with limiter.hold("exports", key="acme") as slot:          # doctest: +SKIP
...     run_export()

Errors: ``RateLimitError`` (a refusal asked for with ``throws=True``, or of a ``hold``) and
``TollgateError`` (everything else); neither is a subclass of the other.
"""

from ._algebra import Calculation, calculate_rate_limit
from ._async import AsyncHeld, AsyncHold, AsyncRateLimiter
from ._sync import Held, Hold, RateLimiter
from ._types import (
    DAY,
    HOUR,
    MINUTE,
    SECOND,
    Acquired,
    Adjusted,
    Decision,
    LimitCall,
    LimitConfig,
    Renewed,
    SlotsValue,
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
    "Acquired",
    "Adjusted",
    "AsyncHeld",
    "AsyncHold",
    "AsyncRateLimiter",
    "Calculation",
    "Decision",
    "Held",
    "Hold",
    "LimitCall",
    "LimitConfig",
    "Milliseconds",
    "RateLimitError",
    "RateLimiter",
    "Renewed",
    "Seconds",
    "SlotsValue",
    "TollgateError",
    "TransactionResult",
    "ValueReading",
    "__version__",
    "calculate_rate_limit",
]
