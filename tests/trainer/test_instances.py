"""Training instances: deterministic per spec, randomised within bounds, windows and faults."""

from __future__ import annotations

import numpy as np

from simulator.config import ClusterConfig, FaultConfig, ReplicaGroup
from simulator.types import SimRequest
from trainer.config import EnvConfig
from trainer.instances import InstanceBuilder, InstanceSpec, perturb, retime_faults, window


def _requests(n: int, tenant: str = "") -> list[SimRequest]:
    return [SimRequest(i, i * 0.5, 100 + i, 10, tenant=tenant) for i in range(n)]


def test_same_spec_same_instance_and_different_seed_differs():
    b = InstanceBuilder(EnvConfig(scenarios=["steady-chat"]))
    spec = InstanceSpec("steady-chat", 5, 1.1, True, 200)
    c1, r1 = b.build(spec)
    c2, r2 = b.build(spec)
    assert c1 == c2 and r1 == r2 and len(r1) == 200
    _, r3 = b.build(InstanceSpec("steady-chat", 6, 1.1, True, 200))
    assert [q.arrival_s for q in r3] != [q.arrival_s for q in r1]


def test_perturb_scales_load_and_respects_max_replicas():
    cfg = EnvConfig(scenarios=["x"], max_replicas=5)
    cluster = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-h100", count=4)])
    reqs = _requests(10)
    c, out = perturb(cluster, reqs, cfg, np.random.default_rng(0), load=2.0, randomise=False)
    assert c == cluster
    assert np.allclose([q.arrival_s for q in out], [q.arrival_s / 2.0 for q in reqs])
    for seed in range(20):
        c, out = perturb(cluster, reqs, cfg, np.random.default_rng(seed), load=1.0, randomise=True)
        assert 1 <= c.replica_count() <= 5
        lo, hi = cfg.randomisation.speed_factor
        assert all(lo <= g.speed_factor <= hi for g in c.replicas)
        # more replicas => proportionally more traffic (arrivals compressed by the capacity ratio)
        ratio = c.replica_count() / 4
        assert np.isclose(out[-1].arrival_s, reqs[-1].arrival_s / ratio)


def test_window_rebases_times_and_scores_warmup():
    reqs = _requests(50, tenant="warmup")
    part = window(reqs, 20, np.random.default_rng(1))
    assert len(part) == 20 and part[0].arrival_s == 0.0
    assert [q.request_id for q in part] == list(range(20))
    assert all(q.tenant == "" for q in part)
    assert window(reqs, 100, np.random.default_rng(1)) is reqs


def test_faults_after_the_window_are_moved_into_it():
    cluster = ClusterConfig(
        replicas=[ReplicaGroup(profile="llama3-8b-h100", count=4)],
        faults=[FaultConfig(kind="crash", replica=1, at_s=60.0, duration_s=60.0), FaultConfig(kind="slowdown", replica=0, at_s=1.0)],
    )
    reqs = _requests(41)  # spans 20 s
    out = retime_faults(cluster, reqs, np.random.default_rng(0))
    crash, slow = out.faults
    assert 4.0 <= crash.at_s <= 10.0 and crash.duration_s <= 8.0
    assert slow.at_s == 1.0  # already inside the window: untouched
