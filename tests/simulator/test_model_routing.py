"""The simulator routes by model as the live router does: a request goes only to the replicas of its model."""

from __future__ import annotations

import numpy as np
import pytest

from routewise_vllm.router.policy.registry import BASELINES, make_policy
from routewise_vllm.simulator.cluster import ClusterSim, simulate
from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup
from routewise_vllm.simulator.types import SimRequest

FLEET = ClusterConfig(replicas=[
    ReplicaGroup(profile="llama3-8b-a100", count=2, models=["alpha"]),
    ReplicaGroup(profile="llama3-8b-a100", count=1, models=["beta", "beta-lora"]),
    ReplicaGroup(profile="llama3-8b-a100", count=1, models=["alpha", "beta"]),
])
SERVES = {"alpha": {0, 1, 3}, "beta": {2, 3}, "beta-lora": {2}}


def requests(n: int = 300, seed: int = 0) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1 / 25.0, n))
    models = rng.choice(sorted(SERVES), n)
    return [SimRequest(i, float(arr[i]), int(rng.integers(50, 1500)), int(rng.integers(1, 200)), max_tokens=200,
                       model=str(models[i])) for i in range(n)]


@pytest.mark.parametrize("policy", [*BASELINES, "learned"])
def test_every_policy_routes_each_request_to_a_replica_of_its_model(policy):
    reqs = requests()
    records = simulate(FLEET, reqs, make_policy(policy, seed=0), seed=0)
    index = {rid: i for i, rid in enumerate(ClusterSim(FLEET, []).replica_ids)}
    for req, rec in zip(reqs, records):
        assert index[rec.replica_id] in SERVES[req.model], (policy, req.model, rec.replica_id)
        assert np.isfinite(rec.finish_s) and not rec.error
    assert {index[r.replica_id] for r in records} == {0, 1, 2, 3}


def test_views_mark_other_models_replicas_out_and_a_wrong_dispatch_is_refused():
    sim = ClusterSim(FLEET, requests(20), seed=0)
    seen = set()
    while (d := sim.next_decision()) is not None:
        view, info = d
        assert set(view.healthy_indices()) == SERVES[info.model]
        wrong = next(i for i in range(4) if i not in SERVES[info.model])
        with pytest.raises(ValueError, match="does not serve model"):
            sim.dispatch(wrong)
        sim.dispatch(min(SERVES[info.model]))
        seen.add(info.model)
    assert seen == set(SERVES)
    with pytest.raises(ValueError, match="no replica serves model 'gamma'"):
        ClusterSim(FLEET, [SimRequest(0, 0.0, 10, 10, model="gamma")])


def test_a_fleet_without_model_lists_routes_as_before():
    plain = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=3)])
    reqs = requests(200)
    untagged = [SimRequest(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, max_tokens=r.max_tokens)
                for r in reqs]
    lor = make_policy("least-outstanding", seed=0)
    a = [(r.replica_id, r.finish_s) for r in simulate(plain, reqs, lor, seed=1)]
    b = [(r.replica_id, r.finish_s) for r in simulate(plain, untagged, make_policy("least-outstanding", seed=0), seed=1)]
    assert a == b
