"""The port a server started on port 0 bound: read from the line it prints, or from the sockets its process
listens on. No port is picked beforehand and handed over, which another program could take in between."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from routewise_vllm.fleet.vllm import listening_ports

# `fleet emulate --port 0` and tests/deploy/fake_vllm.py --port 0: "... serving ... on http://127.0.0.1:PORT"
SERVING = re.compile(r"serving .*\bon http://127\.0\.0\.1:(\d+)")


def _tail(log: Path | None) -> str:
    return log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""


def announced_port(proc: subprocess.Popen, log: Path, what: str, timeout_s: float = 60.0) -> int:
    """The port in the serving line `proc` wrote to `log`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = SERVING.search(log.read_text(errors="replace")) if log.exists() else None
        if found:
            return int(found.group(1))
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode} before saying its port\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} said no port in {timeout_s:g} s\n{_tail(log)}")
        time.sleep(0.05)


def listening_port(proc: subprocess.Popen, what: str, timeout_s: float = 60.0, log: Path | None = None) -> int:
    """The one TCP port `proc` itself listens on, once it does (a server that does not print its port)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ports = listening_ports(proc.pid)
        if len(ports) > 1:
            raise AssertionError(f"{what} listens on several ports {sorted(ports)}: which one serves is unknown")
        if ports:
            return ports.pop()
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode} before listening\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not listen in {timeout_s:g} s\n{_tail(log)}")
        time.sleep(0.05)
