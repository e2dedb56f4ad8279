"""A real redis-server (Debian's package) on a random loopback port, in its own process group, no persistence;
stopped (and its group killed) on exit. Skips locally, fails under CI, when redis-server or the redis client is
missing."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.ci import skip_or_fail


def require_redis() -> str:
    """The redis-server binary (and the redis client importable), else skip (fail under CI)."""
    binary = shutil.which("redis-server")
    if binary is None:
        skip_or_fail("redis-server not installed (apt-get install redis-server; scripts/test.sh installs it)")
    try:
        import redis  # noqa: F401
    except ImportError:
        skip_or_fail("the redis client is not installed (pip install -e '.[test]')")
    return binary  # type: ignore[return-value]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        """Starts it (again, on the same port) and waits until it answers PING."""
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer on port {self.port} in {timeout_s:.0f} s")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGKILL to its process group (no shutdown save: it has no persistence anyway)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(require_redis())
    server.start()
    try:
        yield server
    finally:
        server.stop()
