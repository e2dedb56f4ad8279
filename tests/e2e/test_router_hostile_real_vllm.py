"""Hostile client input through the real router in front of real vLLM CPU servers (defects once found in the
router, checked where a user would meet them): gzip bodies, the path escape to vLLM's own endpoints, and vLLM's 4xx answers to
input it refuses never ejecting a replica."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from openai import AsyncOpenAI, BadRequestError

from routewise_vllm.fleet.router_process import start_router

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]


def post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def test_hostile_clients_never_eject_real_replicas(vllm_servers, vllm_work_dir: Path):
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()
    # (vLLM 0.32 itself ignores Content-Encoding on a plain body; the emulator and other servers fail it)
    router = start_router(list(vllm_servers), "least-outstanding", vllm_work_dir / "router-hostile",
                          env={"ROUTEWISE_BREAKER_FAILURE_THRESHOLD": "2"})
    try:
        url = f"http://127.0.0.1:{router.port}"
        for _ in range(10):  # used to take every replica out in 5 requests
            status, out = post(url + "/v1/completions", gzip.compress(body),
                               {"Content-Type": "application/json", "Content-Encoding": "gzip"})
            assert status == 200, out[:300]
        for path in ("/v1/%2e%2e/reset_prefix_cache", "/v1/%2e%2e/sleep?level=1", "/v1/%2e%2e/collective_rpc"):
            status, out = post(url + path, b"{}", {"Content-Type": "application/json"})
            assert status == 404 and json.loads(out)["error"]["code"] == "not_found", (path, out[:200])
        api = AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=30)
        for _ in range(6):  # vLLM's own 4xx on input it refuses
            with pytest.raises(BadRequestError):
                await api.completions.create(model="tiny", prompt="x", max_tokens=100_000)
        replicas = router.admin_replicas()
        assert all(r["routable"] and r["breaker"]["trips"] == 0 for r in replicas.values()), replicas
    finally:
        rc = router.stop()  # an assert here would replace the failure above with its own
    assert rc == 0, f"router did not drain and exit cleanly (rc={rc}); log:\n{router.log_tail()}"
