"""Stopping real vLLM servers leaves nothing behind. vLLM's engine and API server talk through POSIX shared memory
(/dev/shm, 160 and 250 MB per server here) that they unlink only on a clean exit; stopped while requests were in
flight, a server used to leave both segments behind (20 segments, about 4 GB of RAM, after one day of test runs).
The launcher now removes what the stopped group had mapped."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from routewise_vllm.fleet.vllm import FLEET_ARGS, SERVED_MODEL_NAME, start_servers, stop_servers
from tests.e2e.conftest import STARTUP_TIMEOUT_S


def _generate(base_url: str) -> None:
    body = {"model": SERVED_MODEL_NAME, "prompt": "hello " * 50, "max_tokens": 200, "ignore_eos": True}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=60).read()
    except OSError:
        pass  # the server is being stopped under it: that is the point


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_servers_stopped_under_load_leave_no_shared_memory(vllm_python_path, tiny_model_dir, tmp_path):
    servers = start_servers(2, tiny_model_dir, vllm_python_path, tmp_path / "fleet", extra_args=FLEET_ARGS,
                            startup_timeout_s=STARTUP_TIMEOUT_S)
    pool = ThreadPoolExecutor(16)
    try:
        mapped = [p for s in servers for p in s.shared_memory() if p.exists()]
        assert mapped, "vLLM maps no /dev/shm segment: this test would check nothing"
        for i in range(32):
            pool.submit(_generate, servers[i % 2].base_url)
        time.sleep(3.0)  # requests in flight on both
    finally:
        stop_servers(servers)
        pool.shutdown(wait=True, cancel_futures=True)
    assert all(s.process.returncode is not None for s in servers)
    assert not [p for p in mapped if p.exists()], f"left in /dev/shm: {sorted(map(str, mapped))}"
