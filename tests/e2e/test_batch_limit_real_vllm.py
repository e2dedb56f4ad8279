"""The batch limit the router infers from real vLLM servers' /metrics equals each server's --max-num-seqs.

Two real vLLM CPU servers at --max-num-seqs 4 and 8, with KV cache enough that their batch caps bind first (the
router's KV-derived limit, capacity // late_binding_tokens_per_request, stays above 8), behind `router serve` in the
default configuration (the learned policy, late binding on, no limit given). Load past both caps until the router
exports llm_router_replica_batch_limit{source="inferred"} for both.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from routewise_vllm.fleet.router_process import start_router
from routewise_vllm.fleet.vllm import SERVED_MODEL_NAME, start_servers, stop_servers
from routewise_vllm.router.settings import replica_id
from tests.e2e.conftest import STARTUP_TIMEOUT_S

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CAPS = (4, 8)
# 64 MiB of KV: about 64k tokens (2 MiB held ~2,048 in the session fleet), so the KV-derived limit is ~32
SERVER_ARGS = [["--max-num-seqs", str(n), "--kv-cache-memory-bytes", "64M"] for n in CAPS]
IN_FLIGHT = 3 * sum(CAPS)  # past both caps at once


def _generate(router_url: str, stop: threading.Event) -> None:
    body = (b'{"model": "%s", "prompt": "%s", "max_tokens": 48, "ignore_eos": true}'
            % (SERVED_MODEL_NAME.encode(), b"count the words in this sentence " * 4))
    while not stop.is_set():
        req = urllib.request.Request(f"{router_url}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()
        except OSError:
            time.sleep(0.1)


def _batch_limits(router_url: str) -> dict[str, tuple[float, str]]:
    with urllib.request.urlopen(f"{router_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.labels["replica"]: (s.value, s.labels["source"]) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "llm_router_replica_batch_limit"}


@pytest.mark.timeout(900)
def test_inferred_batch_limits_equal_the_servers_max_num_seqs(vllm_python_path, tiny_model_dir, tmp_path: Path):
    servers = start_servers(len(CAPS), tiny_model_dir, vllm_python_path, tmp_path / "fleet", extra_args=SERVER_ARGS,
                            startup_timeout_s=STARTUP_TIMEOUT_S)
    router = None
    stop = threading.Event()
    pool = ThreadPoolExecutor(IN_FLIGHT)
    try:
        urls = [s.base_url for s in servers]
        router = start_router(urls, "learned", tmp_path / "router", scrape_interval_s=0.25,
                              env={"ROUTEWISE_LATE_BINDING": "1"})  # the default configuration (start_router turns it off)
        assert _batch_limits(router.base_url) == {}  # nothing inferred before any load
        for _ in range(IN_FLIGHT):
            pool.submit(_generate, router.base_url, stop)
        want = {replica_id(u): (float(n), "inferred") for u, n in zip(urls, CAPS)}
        deadline = time.monotonic() + 300  # an outer bound for a busy host
        seen: dict[str, tuple[float, str]] = {}
        while time.monotonic() < deadline:
            seen = _batch_limits(router.base_url)
            if seen.keys() == want.keys():
                break
            time.sleep(1.0)
        assert seen == want
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        if router is not None:
            router.stop()
        stop_servers(servers)
