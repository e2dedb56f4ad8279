"""Every arm and the shadow is served with its own kind's guards (router.policy.served), whatever
the main policy is: the learned treatment of `--policy least-outstanding --ab-treatment learned`
(scripts/demo.sh) gets the stale-stats and overload guards, a baseline arm beside a learned main
policy gets none, and explicit settings apply to every arm."""

from __future__ import annotations

from routewise_vllm.router.policy.fallback import LEARNED_GUARDS
from routewise_vllm.router.replicas import ReplicaSet
from routewise_vllm.router.routing import Router
from routewise_vllm.router.settings import RouterSettings
from routewise_vllm.router.telemetry import RouterMetrics

URLS = ["http://127.0.0.1:18001", "http://127.0.0.1:18002"]
LEARNED_ARM = (LEARNED_GUARDS["max_stats_age_s"], LEARNED_GUARDS["overload_margin"], LEARNED_GUARDS["overload_ratio"])
BASELINE_ARM = (None, None, 0.0)


def guards(policy) -> tuple:
    return policy.max_stats_age_s, policy.overload_margin, policy.overload_ratio


def router(**kw) -> Router:
    settings = RouterSettings(replicas=URLS, policy_watch_interval_s=None, **kw)
    return Router(settings, ReplicaSet(settings.replica_config(), lambda: None), RouterMetrics())


def test_learned_treatment_and_shadow_beside_a_baseline_get_the_learned_guards():
    r = router(policy="least-outstanding", ab_treatment="learned", ab_share=0.5, shadow_policy="learned")
    assert guards(r.arms["control"].policy) == BASELINE_ARM
    assert guards(r.arms["treatment"].policy) == LEARNED_ARM
    assert guards(r.serving.shadow.policy) == LEARNED_ARM
    assert r.arms["treatment"].policy.budget_s == r.settings.decision_budget_s


def test_baseline_treatment_and_shadow_beside_a_learned_policy_get_no_learned_guards():
    r = router(policy="learned", ab_treatment="least-outstanding", ab_share=0.5, shadow_policy="expected-wait")
    assert guards(r.arms["control"].policy) == LEARNED_ARM
    assert guards(r.arms["treatment"].policy) == BASELINE_ARM
    assert guards(r.serving.shadow.policy) == BASELINE_ARM


def test_explicit_guards_apply_to_every_arm():
    r = router(policy="least-outstanding", ab_treatment="learned", ab_share=0.5, max_stats_age_s=5.0, overload_margin=None)
    assert r.arms["control"].policy.max_stats_age_s == 5.0 and r.arms["treatment"].policy.max_stats_age_s == 5.0
    assert r.arms["treatment"].policy.overload_margin is None  # explicitly off
    assert r.arms["treatment"].policy.overload_ratio == LEARNED_GUARDS["overload_ratio"]


def test_a_budget_cooldown_is_logged_once_with_its_figures(caplog):
    """An operator sees why the policy stopped deciding: one warning when a cool-down starts, not one per decision."""
    import logging

    from routewise_vllm.router.policy.fallback import BUDGET_TRIP
    from routewise_vllm.router.policy.types import RequestInfo

    r = router(policy="expected-wait", decision_budget_s=0.0005)
    runner = r.main
    # two slow decisions (what once cooled a policy down on a busy host), fast ones, then a policy slow for good
    times = iter([0.0, 0.001] * 2 + [0.0, 0.0] * 150 + [0.0, 0.0015] * BUDGET_TRIP + [0.0, 0.0] * 50)
    runner.policy.clock = lambda: next(times)
    caplog.set_level(logging.WARNING, logger="router.routing")
    for t in r.replicas.cluster.trackers:
        t.healthy = True
    view = r.replicas.cluster.view(0.0, RequestInfo("q", 10, 5))
    reasons = [runner.decide(view, RequestInfo(f"q{i}", 10, 5)).fallback_reason for i in range(152 + BUDGET_TRIP + 20)]
    assert set(reasons[:152 + BUDGET_TRIP]) == {None} and set(reasons[152 + BUDGET_TRIP:]) == {"over_budget"}
    warnings = [rec.getMessage() for rec in caplog.records if "decision budget" in rec.getMessage()]
    assert len(warnings) == 1, warnings
    assert "expected-wait" in warnings[0] and "51 of its last 100 decisions" in warnings[0], warnings[0]
    assert "slowest 1.50 ms" in warnings[0]
