"""The session's two real vLLM CPU servers, each serving a model the other does not (conftest.OWN_MODELS) beside
the one both serve, behind one router: every request lands on a server of its model, streamed or not,
`/v1/models` is the union, and a model nobody serves is a 404 that lists the others."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from routewise_vllm.fleet.router_process import start_router
from routewise_vllm.fleet.vllm import SERVED_MODEL_NAME
from routewise_vllm.router.settings import replica_id
from tests.e2e.conftest import OWN_MODELS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODELS = OWN_MODELS
REQUESTS = 120  # 60 per model, every other one streamed


def _post(url: str, body: dict) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers.get("x-routewise-replica", ""), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("x-routewise-replica", ""), e.read()


@pytest.mark.timeout(600)
def test_each_request_lands_on_a_server_of_its_model(vllm_servers, tmp_path: Path):
    from openai import OpenAI

    router = start_router(list(vllm_servers), "learned", tmp_path / "router",
                          env={"ROUTEWISE_LATE_BINDING": "1", "ROUTEWISE_REPLICA_HEADER": "1"})
    try:
        serves = {replica_id(url): m for url, m in zip(vllm_servers, MODELS)}
        client = OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert sorted(m.id for m in client.models.list().data) == sorted([SERVED_MODEL_NAME, *MODELS])

        def one(i: int) -> tuple[str, int, str, bytes]:
            model = MODELS[i % 2]
            body = {"model": model, "prompt": f"request {i} counts words", "max_tokens": 8, "ignore_eos": True,
                    "stream": bool(i // 2 % 2)}
            return (model, *_post(router.base_url + "/v1/completions", body))

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(REQUESTS)))
        assert all(status == 200 for _, status, _, _ in results), [(m, s, b[:200]) for m, s, _, b in results if s != 200]
        assert all(serves[replica] == model for model, _, replica, _ in results)
        streamed = [b for _, _, _, b in results if b.startswith(b"data:")]
        assert len(streamed) == REQUESTS // 2 and all(b.rstrip().endswith(b"data: [DONE]") for b in streamed)

        # vLLM names its first served name in responses; the replica header says which server answered
        status, replica, body = _post(router.base_url + "/v1/chat/completions",
                                      {"model": MODELS[1], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert status == 200 and serves[replica] == MODELS[1] and json.loads(body)["choices"], body[:300]
        status, _, body = _post(router.base_url + "/v1/completions", {"model": "nobody", "prompt": "x", "max_tokens": 1})
        assert status == 404 and all(m in body.decode() for m in MODELS), body[:300]
    finally:
        router.stop()
