"""How a limiter reaches its engine (the store opened, its limits defined), whatever its door:
opened again after a failed open, opened anew in a child after ``fork``, refused after
``close()``. Each limiter keeps its engine in ``_engine`` (``None`` until it is open), so a
call's path is one attribute read; everything else happens when that is ``None``."""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from typing import FrozenSet, List, Optional

from tollgate_client import TollgateError

from . import _native

#: After a failed open, calls fail at once (503) for this many seconds before one opens
#: again: the cadence at which the circuit breaker probes a store that failed after it was
#: opened, so that a store down at start costs callers what a store down later costs, and a
#: store that stays down is asked four times a second, not once per call.
RETRY_EVERY = 0.25


class Opening:
    """The engine of a limiter, and what it knows of opening it."""

    _config: str
    #: The names of the concurrency limits (``kind: "concurrency"``), whose ``check`` the
    #: engine's direct take does not answer (it knows rate limits): the JSON path does.
    _concurrency: FrozenSet[str]
    #: The engine, once open; None before, after a failed open, in a child after fork (for
    #: a networked or SQLite store) and after close.
    _engine: Optional[_native.Engine]
    _closed: bool
    #: Why the last open failed, and when the next may be tried (time.monotonic()).
    _failure: str
    _retry_at: float
    #: Held while deciding to open (never while waiting for the store in asyncio).
    _lock: threading.Lock

    def _start(self, config: str) -> None:
        self._config = config
        limits = json.loads(config)["limits"]
        self._concurrency = frozenset(
            name for name, table in limits.items() if table.get("kind") == "concurrency"
        )
        self._engine = None
        self._closed = False
        self._failure = ""
        self._retry_at = 0.0
        self._lock = threading.Lock()
        _limiters.add(self)

    def _may_open(self) -> None:
        """Raises the error every call gets while no open may be tried: after close, and
        within RETRY_EVERY of a failed open."""
        if self._closed:
            raise TollgateError("the limiter is closed", None, False)
        if time.monotonic() < self._retry_at:
            raise self._down()

    def _failed(self, error: object) -> TollgateError:
        self._failure = str(error)
        self._retry_at = time.monotonic() + RETRY_EVERY
        return self._down()

    def _down(self) -> TollgateError:
        return TollgateError(f"the store could not be opened: {self._failure}", 503, False)

    def _forked(self) -> None:
        """In a child after fork: a networked or SQLite engine's connections and threads are
        the parent's; the next call opens the store anew. The memory store's engine is kept:
        the child goes on from a copy of the parent's states."""
        self._lock = threading.Lock()  # another thread of the parent may have held it
        engine = self._engine
        if engine is not None and not engine.immediate:
            _inherited.append(engine)
            self._engine = None
        self._retry_at = 0.0


_limiters: "weakref.WeakSet[Opening]" = weakref.WeakSet()
#: The engines a forked child inherited from its parent: never used (their connections are
#: the parent's, their runtime has no threads here) and never dropped (dropping one would
#: close connections the parent still uses, or wait for runtime threads that are not here).
_inherited: List[_native.Engine] = []


def _after_fork_in_child() -> None:
    _native.forked()
    for limiter in list(_limiters):
        limiter._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
