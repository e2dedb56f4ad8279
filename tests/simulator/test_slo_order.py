"""Late binding in the simulator holds per model and offers held requests earliest deadline first (the live router's
hold queue); a scenario's `classes` give requests their targets without changing the arrivals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from routewise_vllm.router.policy.late_binding import LateBindingConfig
from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.simulator import cluster as cluster_mod
from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup
from routewise_vllm.simulator.late_binding import simulate_late
from routewise_vllm.simulator.scenario import ScenarioSpec, load_scenario
from routewise_vllm.simulator.slo_order import class_figures, run
from routewise_vllm.simulator.types import SimRequest

DISJOINT = ClusterConfig(replicas=[
    ReplicaGroup(profile="llama3-8b-a100", count=1, models=["alpha"]),
    ReplicaGroup(profile="llama3-8b-a100", count=1, models=["beta"]),
])


def burst(n: int, rps: float, model: str, seed: int, start: int = 0) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1 / rps, n))
    return [SimRequest(start + i, float(arr[i]), int(rng.integers(200, 1500)), int(rng.integers(50, 300)),
                       max_tokens=300, model=model) for i in range(n)]


def test_held_requests_of_one_model_never_wait_on_anothers(monkeypatch):
    """alpha's replica is flooded, beta's lightly loaded: alpha requests are held, no beta request ever is (one queue
    for all models would hold every beta arrival behind alpha's held ones)."""
    reqs = burst(600, 60.0, "alpha", 1) + burst(60, 6.0, "beta", 2, start=1000)
    held_models: list[str | None] = []
    real_hold = cluster_mod.ClusterSim.hold

    def hold(self):
        held_models.append(self._pending[1].model)
        real_hold(self)

    monkeypatch.setattr(cluster_mod.ClusterSim, "hold", hold)
    records, reasons = simulate_late(DISJOINT, reqs, make_policy("least-outstanding", seed=0), seed=0,
                                     late=LateBindingConfig(timeout_s=30.0))
    assert reasons["held_requests"] > 20 and set(held_models) == {"alpha"}
    by_id = {r.request_id: r for r in records}
    assert all(np.isfinite(by_id[r.request_id].finish_s) for r in reqs)


def test_without_targets_deadline_order_is_fifo():
    reqs = burst(400, 60.0, "alpha", 3)
    runs = [simulate_late(DISJOINT, reqs, make_policy("least-outstanding", seed=0), seed=0, hold_order=order)[0]
            for order in ("fifo", "deadline")]
    assert [dataclasses.astuple(r) for r in runs[0]] == [dataclasses.astuple(r) for r in runs[1]]


def test_deadline_first_takes_the_tight_requests_first_on_the_same_arrivals():
    base = burst(500, 12.0, "alpha", 4)  # past what alpha's replica sustains: requests are held
    reqs = [dataclasses.replace(r, slo_class="tight", ttft_target_s=1.0) if r.request_id % 5 == 0 else r for r in base]
    targets = {"": cluster_slo(10.0), "tight": cluster_slo(1.0)}
    figures = {order: class_figures(simulate_late(DISJOINT, reqs, make_policy("least-outstanding", seed=0), seed=0,
                                                  hold_order=order)[0], reqs, targets)
               for order in ("fifo", "deadline")}
    assert figures["deadline"]["ttft_attainment:tight"] > figures["fifo"]["ttft_attainment:tight"] + 0.1


def cluster_slo(ttft_s: float):
    from routewise_vllm.simulator.metrics import Slo
    return Slo(ttft_s=ttft_s, tpot_s=10.0)


def test_the_suites_class_scenario_deadline_first_beats_fifo_for_the_tight_class_and_keeps_goodput():
    result = run("chat-slo-classes", seeds=[0])
    fifo, edf = result["fifo"][0], result["deadline"][0]
    assert edf["ttft_attainment:interactive"] >= fifo["ttft_attainment:interactive"] + 0.1
    assert edf["goodput_rps"] >= 0.99 * fifo["goodput_rps"]


def test_classes_leave_the_arrivals_alone_and_bad_shares_are_named():
    sc = load_scenario("chat-slo-classes", split="eval")
    _, with_classes = sc.build(np.random.default_rng(0))
    plain = dataclasses.replace(sc, spec=sc.spec.model_copy(update={"classes": []}))
    _, without = plain.build(np.random.default_rng(0))
    assert [(r.arrival_s, r.prompt_tokens) for r in with_classes] == [(r.arrival_s, r.prompt_tokens) for r in without]
    share = sum(r.slo_class == "interactive" for r in with_classes) / len(with_classes)
    assert 0.15 < share < 0.25 and {r.ttft_target_s for r in with_classes if r.slo_class == "batch"} == {5.0}
    data = sc.spec.model_dump()
    data["classes"] = [{"name": "a", "share": 0.7, "ttft_s": 1, "tpot_s": 1}, {"name": "b", "share": 0.5, "ttft_s": 1,
                                                                                 "tpot_s": 1}]
    with pytest.raises(ValueError, match="shares sum to 1.2"):
        ScenarioSpec.model_validate(data)
