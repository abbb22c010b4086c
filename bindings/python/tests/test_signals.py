"""Ctrl-C during a blocking call that waits for a store: KeyboardInterrupt at once, not when
the store deadline passes (before the fix: 8 s at store_deadline=10)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from network import free_port


def test_ctrl_c_ends_a_wait_for_a_store_that_does_not_answer() -> None:
    port = free_port()
    script = textwrap.dedent(
        f"""
        import socket, sys
        from pytollgate import RateLimiter, HOUR
        silent = socket.socket(); silent.bind(("127.0.0.1", {port})); silent.listen(64)
        limiter = RateLimiter("redis://127.0.0.1:{port}", limits={{"x": {{"kind": "fixed window", "rate": 2, "period": HOUR}}}}, store_deadline=10)
        print("calling", flush=True)
        try:
            limiter.limit("x", key="k")
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(3)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "calling"
        time.sleep(0.5)  # in the call, waiting for the store
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        code = child.wait(timeout=15)
        waited = time.monotonic() - sent
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert code == 3 and child.stdout.read().strip() == "interrupted"
    assert waited < 2.0, f"Ctrl-C took {waited:.1f} s"
