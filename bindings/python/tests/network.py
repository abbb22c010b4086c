"""Loopback plumbing for the tests: a free port, a store's URL moved to another port, and a
TCP forwarder to the real store (started late: a store that comes up; or slow: a store far
away)."""

from __future__ import annotations

import socket
import threading
import time
from typing import List, Optional, Tuple
from urllib.parse import urlsplit, urlunsplit

DEFAULT_PORTS = {"redis": 6379, "postgres": 5432, "postgresql": 5432}


def free_port() -> int:
    """A loopback port nothing listens on (the system's pick, closed at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def target_of(url: str) -> Tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORTS[parts.scheme]


def moved(url: str, port: int) -> str:
    """``url`` with its host and port replaced by 127.0.0.1:``port`` (user and path kept)."""
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    netloc = f"{user}@127.0.0.1:{port}" if user else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


class Forwarder:
    """Listens on 127.0.0.1:``port`` and forwards each connection to ``target``, holding
    each chunk ``delay`` seconds first. ``with Forwarder(...)``: stopped, and every
    connection closed, at the end."""

    def __init__(self, port: int, target: Tuple[str, int], delay: float = 0.0) -> None:
        self.port, self.target, self.delay = port, target, delay
        self._listener: Optional[socket.socket] = None
        self._sockets: List[socket.socket] = []
        self._lock = threading.Lock()

    def __enter__(self) -> "Forwarder":
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self._listener = listener
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, []
        if listener is not None:
            listener.close()
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while True:
            listener = self._listener
            if listener is None:
                return
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is None:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                chunk = source.recv(65536)
                if not chunk:
                    break
                if self.delay:
                    time.sleep(self.delay)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass
