"""The serving layer through the live router, with fake vLLM upstreams: faulty models, hot reload,
shadow and A/B metrics, the rollback guard and the decision log. Every request must succeed."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from routewise_vllm.router.policy.fallback import BUDGET_MIN_SAMPLES
from routewise_vllm.router.serving.decision_log import log_files
from routewise_vllm.router.settings import RouterSettings

from .conftest import AUTH
from .onnx_models import corrupt_file, linear_model, nan_model, prefer_replica_model, slow_model


# Tests that check which replica a model picks give it a generous budget: on a busy test machine a
# decision can overrun 0.5 ms now and then, and over_budget (rightly) hands it to LOR.
EXACT = dict(decision_budget_s=0.05)


async def metrics(client) -> dict[tuple[str, tuple], float]:
    text = await (await client.get("/metrics")).text()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(m, name, **labels) -> float:
    return sum(v for (n, lbl), v in m.items() if n == name and all((k, str(x)) in lbl for k, x in labels.items()))


async def send(client, i: int, key: str | None = None, stream: bool | None = None):
    stream = (i % 2 == 0) if stream is None else stream
    headers = {"x-routewise-key": key} if key else {}
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": f"hello {i} " * 20, "max_tokens": 4,
                                                       "stream": stream}, headers=headers)
    await resp.read()
    return resp


async def until(cond, timeout_s: float = 30.0) -> None:
    """Poll until `cond()`; the timeout is an outer bound for a busy host, not what a test asserts."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def load(client, n: int, concurrency: int = 8, key=None):
    sem = asyncio.Semaphore(concurrency)

    async def one(i):
        async with sem:
            return await send(client, i, key(i) if key else None)

    return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.parametrize("build,reason", [
    (lambda p: corrupt_file(p), "unavailable"),
    (lambda p: nan_model(p), "nan"),
    (lambda p: slow_model(p), "over_budget"),
    (lambda p: linear_model(p, spec_hash="0000111122223333"), "spec_mismatch"),
], ids=["corrupt", "nan", "slow", "other-feature-hash"])
async def test_faulty_model_never_fails_a_request(tmp_path, fakes, router_client, build, reason):
    a, b = await fakes(2)
    path = build(tmp_path / "model.onnx")
    client = await router_client([a.url, b.url], policy=str(path))
    # a slow model's answers are used until most of its recent decisions overran the budget, then it is skipped
    n = 24 + (BUDGET_MIN_SAMPLES if reason == "over_budget" else 0)
    responses = await load(client, n)
    assert [r.status for r in responses] == [200] * n
    m = await metrics(client)
    expected = 24
    assert total(m, "llm_router_fallbacks_total", policy="model", reason=reason) == expected
    info = (await (await client.get("/admin/policy", headers=AUTH)).json())["arms"]["main"]
    assert info["fallbacks"] == {reason: expected}
    if reason in ("unavailable", "spec_mismatch"):
        assert info["describe"]["primary"]["load_error"]  # the admin API says why


async def test_reload_mid_traffic_live(tmp_path, fakes, router_client):
    a, b = await fakes(2)
    first, second = (prefer_replica_model(tmp_path / f"{v}.onnx", i, version=v) for i, v in ((0, "a"), (1, "b")))
    live = tmp_path / "live.onnx"
    shutil.copy(first, live)
    client = await router_client([a.url, b.url], policy=str(live), policy_watch_interval_s=None, **EXACT)
    ids = [a.url.removeprefix("http://"), b.url.removeprefix("http://")]

    async def reloads():
        await asyncio.sleep(0.05)
        r1 = await client.post("/admin/policy/reload", json={"path": str(second)}, headers=AUTH)
        await asyncio.sleep(0.05)
        r2 = await client.post("/admin/policy/reload", json={"path": str(corrupt_file(tmp_path / "bad.onnx"))},
                               headers=AUTH)
        return r1.status, await r1.json(), r2.status, await r2.json()

    traffic = asyncio.create_task(load(client, 200, concurrency=4))
    s1, j1, s2, j2 = await reloads()
    responses = await traffic
    assert [r.status for r in responses] == [200] * 200
    assert s1 == 200 and j1["ok"] and j1["policy"]["version"] == "b"
    assert s2 == 422 and j2["result"] == "unavailable" and j2["policy"]["version"] == "b"
    after = [(await send(client, 1000 + i)).headers["x-routewise-replica"] for i in range(10)]
    assert after == [ids[1]] * 10  # the new policy routes, the bad file changed nothing
    served = [r.headers["x-routewise-replica"] for r in responses]
    assert served[0] == ids[0] and ids[1] in served  # both policies served during the run
    m = await metrics(client)
    assert total(m, "llm_router_policy_reload_total", result="ok") == 1
    assert total(m, "llm_router_policy_reload_total", result="unavailable") == 1
    assert total(m, "llm_router_fallbacks_total") == 0
    assert total(m, "llm_router_policy_info", arm="main", version="b") == 1
    assert total(m, "llm_router_policy_info", arm="main", version="a") == 0


async def test_file_watch_live(tmp_path, fakes, router_client):
    a, b = await fakes(2)
    live = tmp_path / "live.onnx"
    shutil.copy(prefer_replica_model(tmp_path / "a.onnx", 0), live)
    client = await router_client([a.url, b.url], policy=str(live), policy_watch_interval_s=0.05, **EXACT)
    assert (await send(client, 0)).headers["x-routewise-replica"] == a.url.removeprefix("http://")
    tmp = tmp_path / "incoming.tmp"
    shutil.copy(prefer_replica_model(tmp_path / "b.onnx", 1), tmp)
    os.replace(tmp, live)
    deadline = asyncio.get_running_loop().time() + 30  # an outer bound for a busy host
    while (await send(client, 1)).headers["x-routewise-replica"] != b.url.removeprefix("http://"):
        assert asyncio.get_running_loop().time() < deadline, "the watcher never picked up the new file"
        await asyncio.sleep(0.02)
    state = await (await client.get("/admin/serving", headers=AUTH)).json()
    assert state["reload"]["main"]["last"]["ok"]


async def test_shadow_and_ab_metrics_under_load(tmp_path, fakes, router_client):
    a, b = await fakes(2)
    treatment = prefer_replica_model(tmp_path / "prefer1.onnx", 1)
    client = await router_client([a.url, b.url], policy="least-outstanding", ab_treatment=str(treatment),
                                 ab_share=0.5, shadow_policy="round-robin", **EXACT)
    keys = [f"user-{i % 40}" for i in range(120)]
    responses = await load(client, 120, key=lambda i: keys[i])
    assert [r.status for r in responses] == [200] * 120
    arms = [r.headers["x-routewise-arm"] for r in responses]
    # users 0..39 by the pinned hash (tests/serving/test_arms.py): T = treatment at a share of 0.5
    assert "".join(a[0].upper() for a in arms[:40]) == "TCTCCCTTTCTCCCCTTCTTCCCTCTCTTCCCCCCCCCCT"
    assert arms == arms[:40] * 3
    assert all(r.headers["x-routewise-replica"] == b.url.removeprefix("http://")
               for r, arm in zip(responses, arms) if arm == "treatment")
    await asyncio.sleep(0.05)
    m = await metrics(client)
    n_treat = arms.count("treatment")
    assert total(m, "llm_router_requests_total", arm="treatment") == n_treat
    assert total(m, "llm_router_requests_total", arm="control") == 120 - n_treat
    assert total(m, "llm_router_e2e_latency_seconds_count", arm="treatment") == n_treat
    assert total(m, "llm_router_shadow_decisions_total", shadow_policy="round-robin") == 120
    agree = total(m, "llm_router_shadow_decisions_total", agreement="agree")
    disagree = total(m, "llm_router_shadow_decisions_total", agreement="disagree")
    assert agree > 0 and disagree > 0
    assert total(m, "llm_router_shadow_disagreement_load_delta_count") == disagree
    assert total(m, "llm_router_ab_treatment_share") == 0.5 and total(m, "llm_router_ab_rollback_active") == 0
    state = await (await client.get("/admin/ab", headers=AUTH)).json()
    assert state["enabled"] and state["effective_share"] == 0.5 and not state["rollback_active"]


async def run_ab(tmp_path, fakes, router_client, treatment_index: int, control_index: int = 0):
    fast, slow = await fakes(2)
    slow.token_delay_s = 0.1  # first byte 100 ms later than on the fast replica: far above scheduling jitter
    control = prefer_replica_model(tmp_path / "control.onnx", control_index, version="control")
    treatment = prefer_replica_model(tmp_path / "treatment.onnx", treatment_index, version="treatment")
    client = await router_client([fast.url, slow.url], policy=str(control), ab_treatment=str(treatment), ab_share=0.5,
                                 ab_window_requests=60, ab_min_samples=30, **EXACT)
    responses = await load(client, 240, concurrency=16, key=lambda i: f"user-{i}")
    assert [r.status for r in responses] == [200] * 240
    return client, [r.headers["x-routewise-arm"] for r in responses]


@pytest.mark.slow  # over 5 s on 2 cores: outside the fast loop
async def test_rollback_guard_trips_when_treatment_is_slower(tmp_path, fakes, router_client):
    client, arms = await run_ab(tmp_path, fakes, router_client, treatment_index=1)
    state = await (await client.get("/admin/ab", headers=AUTH)).json()
    assert state["rollback_active"] and state["cause"] == "p99" and state["effective_share"] == 0.0, state
    after = [(await send(client, 1000 + i, key=f"user-{i}")).headers["x-routewise-arm"] for i in range(20)]
    assert after == ["control"] * 20  # after the trip, every key goes to control
    assert "treatment" in arms
    m = await metrics(client)
    assert total(m, "llm_router_ab_rollback_active") == 1 and total(m, "llm_router_ab_treatment_share") == 0
    assert total(m, "llm_router_ab_rollbacks_total", cause="p99") == 1
    reset = await (await client.post("/admin/ab/reset", headers=AUTH)).json()
    assert not reset["rollback_active"] and reset["effective_share"] == 0.5
    again = [(await send(client, i, key=f"user-{i}")).headers["x-routewise-arm"] for i in range(20)]
    assert "treatment" in again


@pytest.mark.slow  # over 5 s on 2 cores: outside the fast loop
async def test_rollback_guard_stays_off_when_arms_are_equal(tmp_path, fakes, router_client):
    # both arms on the slow replica: the 100 ms delay dominates the test machine's scheduling jitter
    client, arms = await run_ab(tmp_path, fakes, router_client, treatment_index=1, control_index=1)
    state = await (await client.get("/admin/ab", headers=AUTH)).json()
    assert not state["rollback_active"], state
    assert state["window"]["treatment"]["requests"] >= 30 and state["window"]["control"]["requests"] >= 30
    assert "treatment" in arms[-40:]


async def test_decision_log_from_a_live_run(tmp_path, fakes, router_client):
    a, b = await fakes(2)
    log_dir = tmp_path / "decisions"
    client = await router_client([a.url, b.url], policy="least-outstanding", shadow_policy="round-robin",
                                 decision_log_dir=str(log_dir))
    responses = await load(client, 30)
    assert [r.status for r in responses] == [200] * 30
    await client.close()  # the cleanup context flushes and closes the log
    records = [json.loads(line) for p in log_files(log_dir) for line in p.read_text().splitlines()]
    assert len(records) == 30 and len({r["id"] for r in records}) == 30
    for r in records:
        assert r["status"] == 200 and r["ok"] and r["e2e_s"] > 0 and r["shadow"]["policy"] == "round-robin"
        assert r["n_replicas"] == 2 and r["arm"] == "main" and r["replica"] in (a.url[7:], b.url[7:])
        assert (r["ttft_s"] is not None) == r["stream"] and (r["output_tokens"] == 4 if r["stream"] else True)
    # ... and the simulator replays it as a workload (train on your own traffic)
    from routewise_vllm.simulator.experiments import run_once
    from routewise_vllm.simulator.replay import read_decision_log, split_logged
    from routewise_vllm.simulator.scenario import replay_scenario

    logged = read_decision_log(log_dir)
    assert [r.request_id for r in logged] == [r["id"] for r in sorted(records, key=lambda r: r["t"])]
    scenario = tmp_path / "replay.yaml"
    scenario.write_text(yaml.safe_dump(replay_scenario(log_dir, "steady-chat")))
    for split in ("train", "eval"):
        summary = run_once(str(scenario), "least-outstanding", 0, split=split)
        assert summary["requests"] == len(split_logged(logged, split, 0.7)) and summary["completed_fraction"] == 1.0


@pytest.mark.parametrize("kwargs,field", [
    (dict(ab_treatment="/no/such/treatment.onnx", ab_share=0.5), "ab_treatment"),
    (dict(shadow_policy="/no/such/shadow.onnx"), "shadow_policy"),
    (dict(ab_share=0.5), "ab_share"),
    (dict(ab_share=-0.1, ab_treatment="round-robin"), "ab_share"),
    (dict(ab_treatment="nope", ab_share=0.5), "ab_treatment"),
    (dict(ab_treatment="round-robin", ab_share=0.5, ab_min_samples=900, ab_window_requests=100), "ab_min_samples"),
])
def test_bad_serving_settings_name_the_field(kwargs, field):
    with pytest.raises(ValidationError) as exc:
        RouterSettings(replicas=["http://127.0.0.1:9"], **kwargs)
    assert field in str(exc.value)


@pytest.mark.parametrize("argv,field", [
    (["--ab-share", "0.5"], "ab_share"),
    (["--ab-treatment", "round-robin", "--ab-share", "1.5"], "ab_share"),
    (["--ab-treatment", "/no/such/model.onnx", "--ab-share", "0.2"], "ab_treatment"),
    (["--shadow-policy", "nonsense"], "shadow_policy"),
])
def test_router_serve_refuses_bad_serving_flags(argv, field, capsys):
    from routewise_vllm.router.cli import main

    assert main(["serve", "--replica", "http://127.0.0.1:9", *argv]) == 2
    err = capsys.readouterr().err
    assert field in err and "invalid router settings" in err, err


async def test_decision_log_holds_the_model_input_of_each_decision(tmp_path, fakes, router_client):
    import numpy as np

    from routewise_vllm.router.policy.features import N_FEATURES, model_inputs
    from routewise_vllm.router.serving.decision_log import decode_features

    from .onnx_models import feature_weights

    a, b = await fakes(2)
    w = feature_weights(outstanding=-1.0, req_prompt_tokens_est=0.01)
    model = linear_model(tmp_path / "lin.onnx", weights=w)
    log_dir = tmp_path / "decisions"
    client = await router_client([a.url, b.url], policy=str(model), decision_log_dir=str(log_dir), **EXACT)
    responses = await load(client, 40, concurrency=6)
    assert [r.status for r in responses] == [200] * 40
    await client.close()
    records = [json.loads(line) for p in log_files(log_dir) for line in p.read_text().splitlines()]
    assert len(records) == 40
    for r in records:
        feats = decode_features(r)  # the build_features rows; the model input is model_inputs(rows, mask)
        assert feats.shape == (2, N_FEATURES) and r["fallback"] is None and r["policy"] == "lin"
        mask = np.array(r["mask"], dtype=np.float32)
        scores = np.where(mask > 0, model_inputs(feats, mask).astype(np.float64) @ w, -np.inf)
        assert r["index"] == int(np.argmax(scores))  # the logged input reproduces the model's decision


async def test_stale_stats_hand_learned_decisions_to_lor(tmp_path, fakes, router_client):
    """Stats older than max_stats_age_s hand the model's decisions to least-outstanding. Their age moves with the
    router's clock, which the test moves, not with waiting: a slow scrape on a busy host cannot age them early,
    and no decision budget is in the way (fallbacks here can only be stale_stats)."""
    from routewise_vllm.router.app import REPLICAS

    a, b = await fakes(2)
    model = prefer_replica_model(tmp_path / "prefer1.onnx", 1)
    ahead = [0.0]
    client = await router_client([a.url, b.url], clock=lambda: time.monotonic() + ahead[0], policy=str(model),
                                 max_stats_age_s=30.0, decision_budget_s=None)
    trackers = [r.tracker for r in client.app[REPLICAS].ordered]
    await until(lambda: all(t.last_scrape_s is not None for t in trackers))  # both scraped: stats are fresh
    fresh = await load(client, 10)
    assert {r.headers["x-routewise-replica"] for r in fresh} == {b.url[7:]}, {
        k: v for k, v in (await metrics(client)).items() if k[0] == "llm_router_fallbacks_total" and v}
    assert total(await metrics(client), "llm_router_fallbacks_total") == 0
    switched = {f: f.metrics_scrapes for f in (a, b)}
    for f in (a, b):
        f.metrics_mode = "http_500"  # scrapes fail from now on: the last stats age
    # two scrapes after the switch: any good scrape in flight at the switch has been taken in by then
    await until(lambda: all(f.metrics_scrapes >= switched[f] + 2 for f in (a, b)))
    last_good = max(t.last_scrape_s for t in trackers)
    ahead[0] = 60.0  # a minute on: the last good stats are older than the 30 s limit
    stale = await load(client, 10)
    assert max(t.last_scrape_s for t in trackers) == last_good  # no scrape succeeded meanwhile
    assert [r.status for r in stale] == [200] * 10
    m = await metrics(client)
    assert total(m, "llm_router_fallbacks_total", reason="stale_stats") == 10
    assert total(m, "llm_router_fallbacks_total") == 10
