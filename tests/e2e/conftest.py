"""Session fixtures: two real vLLM CPU servers, started once per test session and always stopped. Every test of
the real-vLLM tier shares them (the stop test, which stops them under load, runs last); a test that needs other
server flags starts its own and says why.

Each server serves the tiny model under two names: SERVED_MODEL_NAME, which both serve, and one of its own
(OWN_MODELS), so the multi-model test routes by model on the same pair. Each publishes its KV-cache events (a ZMQ
PUB socket it binds on a free port, `GET /kv_event_sources` names it), so routers in front of the pair follow them.

Use from any test module under tests/e2e/:

    @pytest.mark.vllm
    def test_something(vllm_servers):          # ["http://127.0.0.1:P0", "http://127.0.0.1:P1"]
        ...

`vllm_fleet` gives the `VllmServer` objects (ports, logs, processes); `vllm_python_path`, `tiny_model_dir` and
`vllm_work_dir` let a test start extra servers of its own with `start_servers(...)` (it must stop them with
`stop_servers` in a finally).
Without a vLLM venv the tests skip locally and fail under CI=true (CI must run them).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from routewise_vllm.fleet.vllm import (
    FLEET_ARGS,
    SERVED_MODEL_NAME,
    TINY_MODEL_MAX_POSITIONS,
    VLLM_PYTHON_ENV,
    VllmServer,
    ensure_tiny_model,
    free_ports,
    launch_server,
    start_servers,
    stop_servers,
    vllm_python,
)
from tests.ci import skip_or_fail

# Two servers start in 40-55 s on an idle 2-core machine and took 150 s with a dozen other jobs running.
STARTUP_TIMEOUT_S = float(os.environ.get("ROUTEWISE_VLLM_STARTUP_TIMEOUT_S", "300"))
# The model name only server i serves (vLLM answers every name of --served-model-name; responses and metrics carry
# the first, SERVED_MODEL_NAME)
OWN_MODELS = ("tiny-small", "tiny-roomy")
SESSION_FLEET_ARGS = [[*args, "--served-model-name", SERVED_MODEL_NAME, own] for args, own in zip(FLEET_ARGS, OWN_MODELS)]


def with_kv_events(per_server: list[list[str]]) -> list[list[str]]:
    """Each server's args plus a KV event publisher bound on a free port of its own (a wildcard endpoint)."""
    return [[*args, "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                        "endpoint": f"tcp://*:{port}", "topic": "kv"})]
            for args, port in zip(per_server, free_ports(len(per_server)))]


# Runs last: it stops the session's servers
STOPS_THE_FLEET = "test_vllm_stop.py"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The test that stops the shared servers goes after every other test of the run."""
    last = [item for item in items if item.path.name == STOPS_THE_FLEET]
    if last:
        items[:] = [item for item in items if item.path.name != STOPS_THE_FLEET] + last


@pytest.fixture(scope="session")
def vllm_python_path() -> Path:
    python = vllm_python()
    if python is None:
        reason = (
            f"no vLLM venv: set {VLLM_PYTHON_ENV} or run scripts/install-vllm.sh "
            "(creates .venv-vllm in the repo root)"
        )
        skip_or_fail(reason)
    return python


@pytest.fixture(scope="session")
def vllm_work_dir() -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="routewise-e2e-vllm-"))
    yield work
    if os.environ.get("ROUTEWISE_KEEP_VLLM_LOGS"):
        print(f"vLLM logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_python_path: Path, vllm_work_dir: Path) -> Path:
    return ensure_tiny_model(vllm_work_dir / "model", vllm_python_path)


@pytest.fixture(scope="session")
def vllm_fleet(vllm_python_path: Path, tiny_model_dir: Path, vllm_work_dir: Path) -> Iterator[list[VllmServer]]:
    t0 = time.monotonic()
    servers = start_servers(
        len(SESSION_FLEET_ARGS), tiny_model_dir, vllm_python_path, vllm_work_dir / "fleet",
        extra_args=with_kv_events(SESSION_FLEET_ARGS), startup_timeout_s=STARTUP_TIMEOUT_S,
    )
    print(f"\n{len(servers)} vLLM servers healthy in {time.monotonic() - t0:.1f} s: "
          + ", ".join(s.base_url for s in servers))
    # The servers live in their own sessions, so nothing else stops them: atexit covers an interpreter exit that
    # skips fixture teardown, and SIGTERM (CI cancelling the job) becomes KeyboardInterrupt so teardown runs.
    atexit.register(stop_servers, servers)
    previous_sigterm = _sigterm_as_keyboard_interrupt()
    try:
        yield servers
    finally:
        stop_servers(servers)
        atexit.unregister(stop_servers)
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)


def _sigterm_as_keyboard_interrupt():
    """Install a SIGTERM handler raising KeyboardInterrupt if SIGTERM has its default action; return the old one."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, handler)


@pytest.fixture(scope="session")
def vllm_servers(vllm_fleet: list[VllmServer]) -> list[str]:
    """Base URLs (no /v1) of the two session servers; index 0 is the small one, 1 the roomy one."""
    return [s.base_url for s in vllm_fleet]


FAILOVER_TEST = "test_failover_when_a_replica_is_killed_mid_load"
# The failover test's long streams must still be open upstream at the kill. On a quiet machine the tiny model decodes
# 4 streams at 500-700 tokens/s each, so 1,948-token streams (a 2,048 context) ended upstream 3-4 s after they
# started, before the kill (which came ~10 s after the router started while the test's client parsed one event per
# token). 16k-token streams last 25+ s even then; the kill cuts them, so their length costs no test time.
EXTRA_MAX_MODEL_LEN = TINY_MODEL_MAX_POSITIONS
EXTRA_KV_CACHE = "96M"  # 4 x 16k tokens at ~1 KiB per token, plus the short and held requests
# Tokens per SSE event of the long streams (vLLM's per-request `stream_interval`; the first token is sent alone):
# one event per token floods vLLM's API server, the router and the test's own client with thousands of events/s.
LONG_STREAM_INTERVAL = 32
EXTRA_STARTUP_TIMEOUT_S = float(os.environ.get("ROUTEWISE_VLLM_STARTUP_TIMEOUT_S", "300"))


@dataclass
class ExtraServer:
    server: VllmServer
    launched_at: float


@pytest.fixture(scope="session", autouse=True)
def extra_server(request, vllm_python_path, tiny_model_dir, vllm_work_dir) -> Iterator[ExtraServer | None]:
    """One more vLLM server for the failover test to kill, launched (not awaited) only if that test was collected.

    Session-scoped and autouse here, so it is set up before the shared fleet at the session's first test and boots
    beside it (the shared pair's start takes longer, the failover test then finds it healthy: launched from the test
    module, it booted behind the earlier tests and the failover test waited 40-90 s for it); the failover test
    kills it; stopped here in any case.
    """
    if not any(getattr(item, "originalname", item.name) == FAILOVER_TEST for item in request.session.items):
        yield None
        return
    work = vllm_work_dir / "extra"
    work.mkdir(parents=True, exist_ok=True)
    launched_at = time.monotonic()
    # a long context, so the failover test's long streams outlast the run-up to the kill; port 0: it binds a free
    # one, read once it is healthy
    server = launch_server(vllm_python_path, tiny_model_dir, 0, work, core=0,
                           extra_args=["--max-model-len", str(EXTRA_MAX_MODEL_LEN),
                                       "--kv-cache-memory-bytes", EXTRA_KV_CACHE])
    try:
        yield ExtraServer(server, launched_at)
    finally:
        server.stop()
