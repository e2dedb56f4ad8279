"""The batch limit the router infers from real vLLM servers' /metrics equals each server's --max-num-seqs.

The session's two real vLLM CPU servers (--max-num-seqs 4 and 16) behind `router serve` in the default
configuration (the learned policy, late binding on, no limit given) except the KV tokens a request is assumed to
hold: 128, the size of this test's requests, so the router's KV-derived limit (capacity // that: 16 and 128 for
the servers' 2 and 16 MiB) stays above each batch cap and the caps bind first. Load past both caps until the
router exports llm_router_replica_batch_limit{source="inferred"} equal to each cap: a first plateau a step below a
cap (the scheduler's token budget, not the cap, leaving a request waiting) is raised by the router's probe.
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
from routewise_vllm.fleet.vllm import FLEET_ARGS, SERVED_MODEL_NAME
from routewise_vllm.router.settings import replica_id

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CAPS = tuple(int(args[args.index("--max-num-seqs") + 1]) for args in FLEET_ARGS)  # the session servers' (4, 16)
TOKENS_PER_REQUEST = 128  # a 28-word prompt and 48 tokens out hold about 80
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


@pytest.mark.timeout(600)
def test_inferred_batch_limits_equal_the_servers_max_num_seqs(vllm_servers, tmp_path: Path):
    stop = threading.Event()
    pool = ThreadPoolExecutor(IN_FLIGHT)
    router = start_router(list(vllm_servers), "learned", tmp_path / "router", scrape_interval_s=0.25,
                          env={"ROUTEWISE_LATE_BINDING": "1",  # the default configuration (start_router turns it off)
                               "ROUTEWISE_LATE_BINDING_TOKENS_PER_REQUEST": str(TOKENS_PER_REQUEST)})
    try:
        assert _batch_limits(router.base_url) == {}  # nothing inferred before any load
        for _ in range(IN_FLIGHT):
            pool.submit(_generate, router.base_url, stop)
        want = {replica_id(u): (float(n), "inferred") for u, n in zip(vllm_servers, CAPS)}
        deadline = time.monotonic() + 300  # an outer bound for a busy host
        seen: dict[str, tuple[float, str]] = {}
        while time.monotonic() < deadline:
            seen = _batch_limits(router.base_url)
            # A first plateau may be a step below the cap (router.batch_limit's probe then raises it); an inferred
            # limit never falls, so one above the cap is final and wrong.
            if seen == want or any(seen.get(r, (0.0,))[0] > n for r, (n, _) in want.items()):
                break
            time.sleep(1.0)
        assert seen == want
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        router.stop()
