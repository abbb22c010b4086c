"""A deadline for a whole call, which httpx does not have.

httpx's timeouts bound each wait on the network, one at a time: a server that sends its
answer a byte at a time, each within the timeout, keeps a call going for as long as it likes
(encode/httpx#1450). Every such wait goes through httpcore's network backend, with its
timeout as an argument. So the backend of each of a client's connection pools is wrapped:
each wait is cut to what is left of the deadline of the call being made, held in a context
variable (a thread's own in the blocking client, a task's own in the asyncio one). When
nothing is left, the wait fails as httpcore's own timeout would, and httpx reports it as
its ``ConnectTimeout``, ``ReadTimeout`` or ``WriteTimeout``.
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from typing import Any, Iterator, Optional, Type, Union

import httpcore
import httpx

__all__ = ["install", "until"]

_deadline: ContextVar[Optional[float]] = ContextVar("tollgate_client_deadline", default=None)


@contextlib.contextmanager
def until(deadline: Optional[float]) -> Iterator[None]:
    """Every wait on the network within the block ends by `deadline` (`time.monotonic()`
    seconds; None: no deadline)."""
    token = _deadline.set(deadline)
    try:
        yield
    finally:
        _deadline.reset(token)


def _left(timeout: Optional[float], expired: Type[Exception]) -> Optional[float]:
    """`timeout` cut to what is left of the deadline; `expired` raised if nothing is."""
    deadline = _deadline.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise expired("the call's deadline passed")
    return left if timeout is None else min(timeout, left)


class _Stream:
    """A connection whose every wait ends by the deadline."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: Optional[float] = None) -> bytes:
        data: bytes = self._stream.read(max_bytes, _left(timeout, httpcore.ReadTimeout))
        return data

    def write(self, buffer: bytes, timeout: Optional[float] = None) -> None:
        self._stream.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: Optional[str] = None, timeout: Any = None
    ) -> _Stream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _Stream(self._stream.start_tls(ssl_context, server_hostname, left))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _Backend:
    """httpcore's blocking network backend, making `_Stream`s."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def connect_tcp(
        self, host: str, port: int, timeout: Optional[float] = None, **options: Any
    ) -> _Stream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _Stream(self._backend.connect_tcp(host, port, left, **options))

    def connect_unix_socket(
        self, path: str, timeout: Optional[float] = None, **options: Any
    ) -> _Stream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _Stream(self._backend.connect_unix_socket(path, left, **options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class _AsyncStream:
    """An asyncio connection whose every wait ends by the deadline."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    async def read(self, max_bytes: int, timeout: Optional[float] = None) -> bytes:
        data: bytes = await self._stream.read(max_bytes, _left(timeout, httpcore.ReadTimeout))
        return data

    async def write(self, buffer: bytes, timeout: Optional[float] = None) -> None:
        await self._stream.write(buffer, _left(timeout, httpcore.WriteTimeout))

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self, ssl_context: Any, server_hostname: Optional[str] = None, timeout: Any = None
    ) -> _AsyncStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _AsyncStream(await self._stream.start_tls(ssl_context, server_hostname, left))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _AsyncBackend:
    """httpcore's asyncio network backend, making `_AsyncStream`s."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    async def connect_tcp(
        self, host: str, port: int, timeout: Optional[float] = None, **options: Any
    ) -> _AsyncStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _AsyncStream(await self._backend.connect_tcp(host, port, left, **options))

    async def connect_unix_socket(
        self, path: str, timeout: Optional[float] = None, **options: Any
    ) -> _AsyncStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _AsyncStream(await self._backend.connect_unix_socket(path, left, **options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def install(client: Union[httpx.Client, httpx.AsyncClient]) -> None:
    """Makes every connection pool of `client` (its transport's, and those of the proxies it
    mounts from the environment) keep to the deadline of `until`.

    httpx builds its pools itself and takes no network backend for them, so they are reached
    through attributes that are not public (``_transport``, ``_mounts``, ``_pool``,
    ``_network_backend``), the same from httpx 0.23 and httpcore 0.15 to httpx 0.28 and
    httpcore 1.0. A version without them is refused here rather than left without deadlines.
    """
    wrap = _AsyncBackend if isinstance(client, httpx.AsyncClient) else _Backend
    transports = [client._transport, *client._mounts.values()]
    for transport in transports:
        if transport is None:  # a pattern of NO_PROXY: no transport of its own
            continue
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if backend is None:
            raise RuntimeError(
                f"tollgate_client cannot bound a call's time with httpx {httpx.__version__} "
                f"(httpcore {httpcore.__version__}); httpx 0.23 to 0.28 are known to work"
            )
        setattr(pool, "_network_backend", wrap(backend))
