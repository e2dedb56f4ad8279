"""A real redis-server (Debian's package) on a random loopback port, in its own process group, no persistence;
stopped (and its group killed) on exit. Skips locally, fails under CI, when redis-server or the redis client is
missing.

redis-server cannot bind port 0 (it means "no TCP"), so a free port is picked and handed to it: another program can
take it in between. Such a start is caught, not trusted: the server that answers must report this process's pid
(INFO server), and a server that exits (the port was taken) is started again on another port."""

from __future__ import annotations

import os
import re
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


class PortTaken(RuntimeError):
    """redis-server exited at start: its port was taken by another program."""


class RedisServer:
    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0, attempts: int = 1) -> None:
        """Starts it (again, on the same port) and waits until it answers; up to `attempts` tries on a fresh port
        when the port turns out taken (the first start: a restart keeps its port, which clients know)."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout_s)
            except PortTaken:
                if attempt == attempts - 1:
                    raise
                self.port = _free_port()

    def _start_once(self, timeout_s: float) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise PortTaken(f"redis-server exited with {self.proc.returncode} on port {self.port}")
            if self._answers_as_ours():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer on port {self.port} in {timeout_s:.0f} s")
            time.sleep(0.02)

    def _answers_as_ours(self) -> bool:
        """The server on the port is the one started here: INFO server names its pid (another test's redis-server
        that took the port first would answer too)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(b"INFO server\r\n")
                reply = b""
                while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
        except OSError:
            return False
        found = re.search(rb"process_id:(\d+)", reply)
        return found is not None and self.proc is not None and int(found.group(1)) == self.proc.pid

    def stop(self) -> None:
        """SIGKILL to its process group (no shutdown save: it has no persistence anyway)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(require_redis())
    server.start(attempts=5)
    try:
        yield server
    finally:
        server.stop()
