"""Stopping real vLLM servers leaves nothing behind. vLLM's engine and API server talk through POSIX shared memory
(/dev/shm, 160 and 250 MB per server here) that they unlink only on a clean exit; stopped while requests were in
flight, a server used to leave both segments behind (20 segments, about 4 GB of RAM, after one day of test runs).
The launcher now removes what the stopped group had mapped.

It stops the session's two servers (tests/e2e/conftest.py runs it after every other test of the run) once each
says, on its own /metrics, that it is running requests. A server with requests in flight waits for them on SIGTERM,
so the stop ends in SIGKILL after a grace of GRACE_S: the path that used to leak."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from routewise_vllm.fleet.vllm import SERVED_MODEL_NAME, VllmServer, stop_servers

pytestmark = pytest.mark.vllm

REQUESTS_PER_SERVER = 16
MAX_TOKENS = 900  # with the prompt, within the servers' 1,024 positions; seconds of decoding on a shared core
GRACE_S = 5.0  # SIGTERM to SIGKILL: the requests above outlast it


def _generate(base_url: str) -> None:
    body = {"model": SERVED_MODEL_NAME, "prompt": "hello " * 50, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=120).read()
    except OSError:
        pass  # the server is being stopped under it: that is the point


def running(base_url: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        page = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(page) for s in f.samples
               if s.name == "vllm:num_requests_running")


@pytest.mark.timeout(300)
def test_servers_stopped_under_load_leave_no_shared_memory(vllm_fleet: list[VllmServer]):
    servers = vllm_fleet
    assert all(s.process.poll() is None for s in servers), "the session's servers were already stopped"
    pool = ThreadPoolExecutor(REQUESTS_PER_SERVER * len(servers))
    in_flight: list[float] = []
    try:
        mapped = [p for s in servers for p in s.shared_memory() if p.exists()]
        assert mapped, "vLLM maps no /dev/shm segment: this test would check nothing"
        for i in range(REQUESTS_PER_SERVER * len(servers)):
            pool.submit(_generate, servers[i % len(servers)].base_url)
        deadline = time.monotonic() + 120  # an outer bound for a busy host
        while time.monotonic() < deadline:
            in_flight = [running(s.base_url) for s in servers]
            if all(n > 0 for n in in_flight):
                break
            time.sleep(0.2)
    finally:
        stop_servers(servers, grace_s=GRACE_S)
        pool.shutdown(wait=True, cancel_futures=True)
    assert all(n > 0 for n in in_flight), f"requests running per server when stopped: {in_flight}"
    assert all(s.process.returncode is not None for s in servers)
    assert not [p for p in mapped if p.exists()], f"left in /dev/shm: {sorted(map(str, mapped))}"
