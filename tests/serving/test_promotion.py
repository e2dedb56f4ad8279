"""Candidate promotion through the live router (fake vLLM upstreams): a candidate reloaded into the
treatment arm is promoted when no worse than the primary, rolled back when worse; both are counted
on /metrics; every request succeeds throughout."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from routewise_vllm.router.settings import RouterSettings

from .conftest import AUTH
from .onnx_models import prefer_replica_model
from .test_live_serving import EXACT, load, metrics, send, total

GUARD = dict(ab_share=0.5, ab_window_requests=60, ab_min_samples=30, ab_auto_promote=True, **EXACT)


async def start(tmp_path, fakes, router_client):
    fast, slow = await fakes(2)
    slow.token_delay_s = 0.1  # first byte 100 ms later than on the fast replica
    control = prefer_replica_model(tmp_path / "control.onnx", 1, version="primary-slow")
    placeholder = prefer_replica_model(tmp_path / "treatment.onnx", 1, version="placeholder")
    client = await router_client([fast.url, slow.url], policy=str(control), ab_treatment=str(placeholder), **GUARD)
    return client


async def hand_over(client, path) -> dict:
    resp = await client.post("/admin/policy/reload", json={"path": str(path), "arm": "treatment"}, headers=AUTH)
    body = await resp.json()
    assert resp.status == 200, body
    return body


async def test_better_candidate_is_promoted_to_primary(tmp_path, fakes, router_client):
    client = await start(tmp_path, fakes, router_client)
    candidate = prefer_replica_model(tmp_path / "cand-1.onnx", 0, version="cand-fast")
    card = {"finetune": {"validation_before": {"mae_log_ttft": 0.61}, "validation_after": {"mae_log_ttft": 0.25}}}
    (tmp_path / "cand-1.json").write_text(json.dumps(card))  # what trainer finetune writes beside the model
    await hand_over(client, candidate)
    m = await metrics(client)
    assert total(m, "llm_router_policy_candidate_mae_log_ttft", stage="before") == 0.61
    assert total(m, "llm_router_policy_candidate_mae_log_ttft", stage="after") == 0.25
    assert total(m, "llm_router_policy_candidate_state", state="evaluating") == 1
    state = (await (await client.get("/admin/ab", headers=AUTH)).json())["promotion"]
    assert state["state"] == "evaluating" and state["candidate"] == str(candidate)
    responses = await load(client, 320, concurrency=16, key=lambda i: f"user-{i}")
    assert [r.status for r in responses] == [200] * 320
    ab = await (await client.get("/admin/ab", headers=AUTH)).json()
    assert ab["promotion"]["state"] == "promoted", ab
    last = ab["promotion"]["history"][-1]
    assert last["result"] == "promoted" and "3 checks in a row" in last["reason"], last
    policy = (await (await client.get("/admin/policy", headers=AUTH)).json())["arms"]["control"]
    assert policy["version"] == "cand-fast"  # the primary now runs the candidate
    m = await metrics(client)
    assert total(m, "llm_router_policy_promotions_total", result="promoted") == 1
    assert total(m, "llm_router_policy_promotions_total", result="rolled_back") == 0
    # control-arm requests now go to the fast replica
    after = [(await send(client, 2000 + i, key=f"user-{i}")) for i in range(10)]
    ctrl = [r.headers["x-routewise-replica"] for r in after if r.headers["x-routewise-arm"] == "control"]
    assert ctrl and len(set(ctrl)) == 1


async def test_worse_candidate_is_rolled_back_and_never_promoted(tmp_path, fakes, router_client):
    fast, slow = await fakes(2)
    slow.token_delay_s = 0.1
    control = prefer_replica_model(tmp_path / "control.onnx", 0, version="primary-fast")
    client = await router_client([fast.url, slow.url], policy=str(control),
                                 ab_treatment=str(prefer_replica_model(tmp_path / "t.onnx", 0, version="placeholder")), **GUARD)
    await hand_over(client, prefer_replica_model(tmp_path / "cand-bad.onnx", 1, version="cand-slow"))
    responses = await load(client, 320, concurrency=16, key=lambda i: f"user-{i}")
    assert [r.status for r in responses] == [200] * 320
    ab = await (await client.get("/admin/ab", headers=AUTH)).json()
    assert ab["promotion"]["state"] == "rolled_back" and ab["rollback_active"], ab
    assert "rollback guard tripped (p99)" in ab["promotion"]["history"][-1]["reason"]
    policy = (await (await client.get("/admin/policy", headers=AUTH)).json())["arms"]["control"]
    assert policy["version"] == "primary-fast"
    m = await metrics(client)
    assert total(m, "llm_router_policy_promotions_total", result="rolled_back") == 1
    assert total(m, "llm_router_policy_promotions_total", result="promoted") == 0
    assert ("llm_router_policy_candidate_mae_log_ttft", (("stage", "after"),)) not in m  # no card, no figure
    # the next candidate lifts the latch and is judged from empty windows
    await hand_over(client, prefer_replica_model(tmp_path / "cand-2.onnx", 0, version="cand-2"))
    ab = await (await client.get("/admin/ab", headers=AUTH)).json()
    assert not ab["rollback_active"] and ab["promotion"]["state"] == "evaluating"
    assert ab["window"]["treatment"]["requests"] == 0


async def test_exploration_share_is_bounded_counted_and_kept_out_of_the_guard(tmp_path, fakes, router_client):
    fast, slow = await fakes(2)
    slow.token_delay_s = 0.1
    control = prefer_replica_model(tmp_path / "control.onnx", 0, version="primary-fast")
    # ratio 3: millisecond TTFBs of two arms on the same fast replica differ by 20 % on a busy 2-core box, while
    # explored requests counted against the candidate would make its p99 ~15x (the slow replica adds 100 ms)
    client = await router_client([fast.url, slow.url], policy=str(control), ab_explore_share=0.2,
                                 ab_treatment=str(prefer_replica_model(tmp_path / "t.onnx", 0, version="cand-fast")),
                                 **(GUARD | {"ab_max_p99_ratio": 3.0}))
    responses = await load(client, 300, concurrency=16, key=lambda i: f"user-{i}")
    assert [r.status for r in responses] == [200] * 300
    treated = [r for r in responses if r.headers["x-routewise-arm"] == "treatment"]
    on_slow = sum(r.headers["x-routewise-replica"] == slow.url.split("//")[1] for r in treated)
    m = await metrics(client)
    explored = total(m, "llm_router_exploration_decisions_total")
    assert 0.08 * len(treated) < explored < 0.35 * len(treated), (explored, len(treated))
    assert 0 < on_slow <= explored  # the policy itself never picks the slow replica; only exploration does
    ab = await (await client.get("/admin/ab", headers=AUTH)).json()
    # explored requests (100 ms slower) are not the candidate's doing: the guard never saw them, so it did not trip
    assert not ab["rollback_active"], ab
    control_arm = [r for r in responses if r.headers["x-routewise-arm"] == "control"]
    assert all(r.headers["x-routewise-replica"] == fast.url.split("//")[1] for r in control_arm)
    with pytest.raises(ValidationError, match="ab_explore_share"):
        RouterSettings(ab_explore_share=0.5)
