"""The two exceptions of the client.

``RateLimitError`` and ``TollgateError`` are deliberately *unrelated* classes (neither is
a subclass of the other): a refusal asked for with ``throws=True`` is an answer about the
limit, not a failure of the service, and ``except TollgateError`` must not swallow it by
accident. Catch both with ``except (RateLimitError, TollgateError)``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

__all__ = ["RateLimitError", "TollgateError"]


class RateLimitError(Exception):
    """A request made with ``throws=True`` was refused (the server answered 429).

    Nothing was taken. ``retry_after`` is how long to wait, in milliseconds, before the same
    request would be granted.
    """

    kind: str
    name: str
    retry_after: float

    def __init__(self, name: str, retry_after: float, kind: str = "RateLimited") -> None:
        self.kind = kind
        self.name = name
        self.retry_after = retry_after
        super().__init__(f"Rate limit {name} exceeded; retry after {retry_after:g} ms")

    def __repr__(self) -> str:
        return (
            f"RateLimitError(kind={self.kind!r}, name={self.name!r}, "
            f"retry_after={self.retry_after!r})"
        )

    def __reduce__(self) -> Tuple[Any, ...]:
        return (type(self), (self.name, self.retry_after, self.kind))


class TollgateError(Exception):
    """Anything but a decision: an error answer, or no usable answer at all.

    - ``status``: the HTTP status of the server's answer (400, 401, 403, 404, 503, ...), or
      ``None`` when there was no answer (timeout, refused connection, broken connection).
    - ``message``: the server's ``error`` text, or what went wrong on the way.
    - ``may_have_taken``: whether tokens may have been taken all the same, so that a retry
      may pay twice. ``True`` when the server says so (``mayHaveTaken: true``, on a 503: its
      store got the request and its answer never came back), and for a write (``limit``,
      ``transaction``, ``reset``) that was sent and got no answer that could be read: a
      timeout, a connection lost, an answer cut short, too large or not the API's (unless
      its status is 4xx, a refusal). ``False`` for a read (``check``, ``get_value``,
      ``get_server_time``, ``get_config``), for a request never sent (connection refused,
      the timeout passed while connecting or waiting for a connection, a closed client), and
      for the server's other error answers (nothing is taken by a request that errors).
    """

    status: Optional[int]
    message: str
    may_have_taken: bool

    def __init__(
        self, message: str, status: Optional[int] = None, may_have_taken: bool = False
    ) -> None:
        self.status = status
        self.message = message
        self.may_have_taken = may_have_taken
        super().__init__(f"{status}: {message}" if status is not None else message)

    def __repr__(self) -> str:
        return (
            f"TollgateError(status={self.status!r}, message={self.message!r}, "
            f"may_have_taken={self.may_have_taken!r})"
        )

    def __reduce__(self) -> Tuple[Any, ...]:
        return (type(self), (self.message, self.status, self.may_have_taken))
