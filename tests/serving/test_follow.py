"""`trainer follow` against a live router (fake vLLM upstreams): the router's own decision log is
fine-tuned on, the candidate is handed over as the A/B treatment and judged by the promotion
controller; a failing round hands nothing over and the router keeps serving."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH
from routewise_vllm.router.serving.decision_log import log_files
from routewise_vllm.trainer.finetune import FinetuneConfig
from routewise_vllm.trainer.follow import Follower

from .conftest import AUTH, TOKEN
from .test_live_serving import load


async def wait_for_records(directory, n: int) -> None:
    for _ in range(200):
        files = log_files(directory)
        if files and sum(f.read_text().count("\n") for f in files) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"decision log {directory} did not reach {n} records")


@pytest.mark.slow  # over 5 s on 2 cores: outside the fast loop
async def test_follow_hands_a_candidate_to_the_live_router(tmp_path, fakes, router_client):
    fast, slow = await fakes(2)
    slow.token_delay_s = 0.05
    primary = shutil.copy(DEFAULT_MODEL_PATH, tmp_path / "primary.onnx")
    treatment = shutil.copy(DEFAULT_MODEL_PATH, tmp_path / "treatment.onnx")
    logdir = tmp_path / "log"
    client = await router_client([fast.url, slow.url], policy=str(primary), ab_treatment=str(treatment), ab_share=0.5,
                                 ab_window_requests=60, ab_min_samples=30, ab_auto_promote=True,
                                 decision_log_dir=str(logdir), decision_budget_s=0.05)
    responses = await load(client, 120, concurrency=8, key=lambda i: f"user-{i}")
    assert [r.status for r in responses] == [200] * 120
    await wait_for_records(logdir, 120)
    url = str(client.make_url("")).rstrip("/")
    follower = Follower(logdir, tmp_path / "models", init=primary, router=url, admin_token=TOKEN, every_records=100,
                        min_improvement=-1e9, config=FinetuneConfig(epochs=1))  # hand over whatever it fits
    doc = await asyncio.to_thread(follower.step)
    candidate = (tmp_path / "models" / "candidate-000001.onnx").resolve()
    assert doc["action"] == "handed_over" and doc["router_status"] == 200, doc
    ab = await (await client.get("/admin/ab", headers=AUTH)).json()
    assert ab["promotion"]["state"] == "evaluating" and ab["promotion"]["candidate"] == str(candidate)
    policy = (await (await client.get("/admin/policy", headers=AUTH)).json())["arms"]["treatment"]
    assert policy["version"] == doc["report"]["policy_version"]
    assert (await asyncio.to_thread(follower.step))["action"] == "wait"  # nothing new since

    # a corrupt line: the round fails with file and line, nothing is handed over, the router keeps serving
    responses = await load(client, 110, concurrency=8, key=lambda i: f"user-{i}")
    await wait_for_records(logdir, 230)
    f = log_files(logdir)[-1]
    lines = f.read_text().split("\n")
    lines[3] = lines[3][:30]
    f.write_text("\n".join(lines))
    doc = await asyncio.to_thread(follower.step)
    assert doc["action"] == "failed" and f"{f}:4: not valid JSON" in doc["error"], doc
    assert not (tmp_path / "models" / "candidate-000002.onnx").exists()
    assert json.loads((tmp_path / "models" / "follow-state.json").read_text())["seq"] == 1
    responses = await load(client, 20, concurrency=4, key=lambda i: f"user-{i}")
    assert [r.status for r in responses] == [200] * 20
    ab = await (await client.get("/admin/ab", headers=AUTH)).json()
    assert ab["promotion"]["candidate"] == str(candidate)
