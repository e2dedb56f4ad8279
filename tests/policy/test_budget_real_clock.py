"""The shipped model as the router serves it (router.routing.guarded_policy: the deciding thread's CPU time
against the default decision budget) over 1,000 real-clock decisions never trips the budget rule: the rule that a
model over budget on every decision trips on its 51st (tests/policy/test_budget_rule.py), with the budget it ships
with, leaves the shipped model deciding. The same run with a budget nothing meets trips, so the clock is read."""

from __future__ import annotations

import numpy as np

from routewise_vllm.router.policy.fallback import BUDGET_COOLDOWN, BUDGET_TRIP
from routewise_vllm.router.policy.tracking import ClusterTracker
from routewise_vllm.router.policy.types import RequestInfo
from routewise_vllm.router.routing import guarded_policy
from routewise_vllm.router.settings import RouterSettings

DECISIONS = 1000
WIDTH = 8


def decide(budget_s: float) -> tuple[dict[str, int], list[float]]:
    """(fallbacks by reason, measured decision times) of DECISIONS decisions on changing views of WIDTH replicas."""
    settings = RouterSettings(replicas=[f"http://10.0.0.{i}:8000" for i in range(WIDTH)], policy="learned",
                              decision_budget_s=budget_s)
    policy = guarded_policy("learned", settings)
    rng = np.random.default_rng(3)
    cluster = ClusterTracker([f"10.0.0.{i}:8000" for i in range(WIDTH)])
    elapsed = []
    for k in range(DECISIONS):
        for t in cluster.trackers:
            t.on_scrape(k * 0.01, int(rng.integers(0, 8)), int(rng.integers(0, 32)), float(rng.uniform(0, 1)), 262_144)
        request = RequestInfo(f"q{k}", int(rng.integers(10, 4000)), int(rng.integers(1, 512)), (1, 2, k % 7))
        decision = policy.decide(cluster.view(k * 0.01, request), request)
        if decision.elapsed_s is not None:
            elapsed.append(decision.elapsed_s)
    return {r: n for r, n in policy.fallback_counts.items() if n}, elapsed


def test_the_shipped_model_never_trips_the_budget_on_the_real_clock():
    fallbacks, elapsed = decide(RouterSettings.model_fields["decision_budget_s"].default)
    assert "over_budget" not in fallbacks, (fallbacks, f"median {np.median(elapsed) * 1e6:.0f} us")
    assert len(elapsed) == DECISIONS  # every decision measured: the model was asked every time


def test_a_budget_nothing_meets_trips_on_the_real_clock():
    fallbacks, elapsed = decide(1e-9)
    assert len(elapsed) == BUDGET_TRIP and fallbacks["over_budget"] == min(BUDGET_COOLDOWN, DECISIONS - BUDGET_TRIP)
