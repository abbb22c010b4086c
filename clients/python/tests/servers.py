"""Processes and sockets the tests run against: the real tollgate binary, and small loopback
servers of the tests' own (one that never answers, one where connecting hangs, a fake store
that never answers, a web server that answers what tollgate never would, and one that runs
a test's script on each connection: trickling, cutting short, dropping). Everything listens
on 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import http.server
import os
import queue
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

BIN = os.environ.get(
    "TOLLGATE_BIN", str(Path(__file__).resolve().parents[3] / "target" / "debug" / "tollgate")
)
BANNER = re.compile(r"tollgate listening on (http://\S+)")
START_TIMEOUT = 30.0


class Server:
    """A running `tollgate serve`."""

    def __init__(self, url: str, process: "subprocess.Popen[str]", output: List[str]) -> None:
        self.url = url
        self.process = process
        self.output = output


@contextlib.contextmanager
def tollgate(config: str, directory: Path, store: str = "memory") -> Iterator[Server]:
    """Starts `tollgate serve` on a free loopback port with `config` (TOML), reads its
    address from the banner (stdout or stderr), and stops it afterwards."""
    if not os.access(BIN, os.X_OK):
        raise RuntimeError(
            f"no tollgate binary at {BIN}: build it (cargo build) or set TOLLGATE_BIN"
        )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tollgate.toml"
    path.write_text(config)
    process = subprocess.Popen(
        [BIN, "serve", "--listen", "127.0.0.1:0", "--store", store, "--config", str(path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=directory,
    )
    output: List[str] = []
    lines: "queue.Queue[str]" = queue.Queue()

    def pump(stream: IO[str]) -> None:
        # Both pipes are read to their end, so the server never blocks on a full one.
        for line in stream:
            output.append(line)
            lines.put(line)

    for stream in (process.stdout, process.stderr):
        threading.Thread(target=pump, args=(stream,), daemon=True).start()
    try:
        url = None
        deadline = time.monotonic() + START_TIMEOUT
        while url is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"tollgate printed no banner in {START_TIMEOUT} s: {output}")
            try:
                line = lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                if process.poll() is not None:
                    time.sleep(0.1)  # the last lines
                    raise RuntimeError(
                        f"tollgate exited with {process.returncode}: {''.join(output)}"
                    ) from None
                continue
            match = BANNER.search(line)
            if match:
                url = match.group(1)
        yield Server(url, process, output)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def _accepting(
    serve: Optional[Callable[[socket.socket, threading.Event], None]] = None,
) -> Iterator[Tuple[int, List[socket.socket]]]:
    """A loopback listener: its port, and the connections it has accepted, each kept (and,
    with `serve`, served on a thread of its own until the event is set) until the block
    ends; then every one is shut down and closed."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    held: List[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            held.append(conn)
            if serve is not None:
                threading.Thread(target=serve, args=(conn, stop), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], held
    finally:
        stop.set()
        thread.join()
        listener.close()
        for conn in held:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


@contextlib.contextmanager
def silent_server() -> Iterator[Tuple[str, List[socket.socket]]]:
    """A loopback socket that accepts connections and reads them, and never answers."""
    with _accepting() as (port, held):
        yield f"http://127.0.0.1:{port}", held


@contextlib.contextmanager
def refusing_address() -> Iterator[str]:
    """An address where nothing listens: a port bound (so nobody else takes it) but not
    listening, so a connection is refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        host, port = sock.getsockname()
        yield f"http://{host}:{port}"
    finally:
        sock.close()


@contextlib.contextmanager
def fake_redis_that_hangs() -> Iterator[int]:
    """A Redis stand-in on loopback: it answers the commands a client sends while it
    connects (CLIENT SETINFO, PING, SELECT, ...), so the connection is made, and never
    answers anything else. A store request sent to it reaches the store and its answer
    never comes back: the case where tokens may have been taken."""
    def commands(buffer: bytes) -> Tuple[List[List[bytes]], bytes]:
        """The whole RESP arrays at the front of `buffer`, and what is left."""
        done: List[List[bytes]] = []
        while buffer.startswith(b"*"):
            end = buffer.find(b"\r\n")
            if end < 0:
                break
            count, pos, parts = int(buffer[1:end]), end + 2, []
            for _ in range(count):
                end = buffer.find(b"\r\n", pos)
                if end < 0 or buffer[pos : pos + 1] != b"$":
                    return done, buffer
                length = int(buffer[pos + 1 : end])
                if len(buffer) < end + 2 + length + 2:
                    return done, buffer
                parts.append(buffer[end + 2 : end + 2 + length])
                pos = end + 2 + length + 2
            if len(parts) < count:
                break
            done.append(parts)
            buffer = buffer[pos:]
        return done, buffer

    def serve(conn: socket.socket, stop: threading.Event) -> None:
        buffer = b""
        while not stop.is_set():
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            parsed, buffer = commands(buffer + data)
            for command in parsed:
                name = command[0].upper() if command else b""
                if name == b"PING":
                    conn.sendall(b"+PONG\r\n")
                elif name in (b"CLIENT", b"SELECT", b"AUTH", b"READONLY"):
                    conn.sendall(b"+OK\r\n")
                # Anything else (the script that takes tokens): no answer, ever.

    with _accepting(serve) as (port, _):
        yield port


def _read_request(conn: socket.socket, stop: threading.Event) -> bool:
    """Reads one request whole (its headers, then a Content-Length body) from `conn`, whose
    timeout is short; False when the connection closed first (or was closed by a script)
    or the block ended."""
    buffer = b""
    while not stop.is_set():
        try:
            conn.settimeout(0.1)
            data = conn.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return False
        if not data:
            return False
        buffer += data
        end = buffer.find(b"\r\n\r\n")
        if end >= 0:
            found = re.search(rb"\r\ncontent-length: *(\d+)", buffer[:end], re.IGNORECASE)
            if len(buffer) >= end + 4 + (int(found.group(1)) if found else 0):
                return True
    return False


@contextlib.contextmanager
def scripted_server(
    script: Callable[[socket.socket, threading.Event], None],
) -> Iterator[str]:
    """A loopback server that reads each request whole, then hands the connection to
    `script(conn, stop)`, which may answer, trickle, stall or close it (and must return
    soon once `stop` is set, when the block ends)."""

    def serve(conn: socket.socket, stop: threading.Event) -> None:
        while _read_request(conn, stop):
            script(conn, stop)

    with _accepting(serve) as (port, _):
        yield f"http://127.0.0.1:{port}"


def http_answer(status: int, body: bytes, headers: Optional[Dict[str, str]] = None) -> bytes:
    """An HTTP/1.1 answer, with a Content-Length unless `headers` says otherwise."""
    fields = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    fields.update(headers or {})
    head = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    return f"HTTP/1.1 {status} X\r\n{head}\r\n".encode() + body


@contextlib.contextmanager
def unaccepting_address() -> Iterator[str]:
    """An address where connecting hangs: a listener whose queue of connections not yet
    accepted is full (one held there), so the kernel drops the next connection's SYN."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname(), timeout=2)
    try:
        host, port = listener.getsockname()
        yield f"http://{host}:{port}"
    finally:
        filler.close()
        listener.close()


class Recorded(NamedTuple):
    method: str
    path: str
    headers: Dict[str, str]
    body: bytes


@contextlib.contextmanager
def odd_web_server(
    status: int,
    body: bytes,
    content_type: str = "text/html",
    record: Optional[List[Recorded]] = None,
) -> Iterator[str]:
    """A loopback HTTP server answering every request with `status` and `body`: what a
    proxy or a wrong address might answer, never tollgate. Requests are appended to
    `record`, if given."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            sent = self.rfile.read(length)
            if record is not None:
                headers = {k.lower(): v for k, v in self.headers.items()}
                record.append(Recorded(self.command, self.path, headers, sent))
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()

