from __future__ import annotations

from prometheus_client import CollectorRegistry

from routewise_vllm.router.policy import make_policy
from routewise_vllm.router.policy.onnx_policy import OnnxPolicy
from routewise_vllm.router.serving.metrics import ServingMetrics
from routewise_vllm.router.serving.shadow import ShadowEvaluator

from .helpers import guarded, make_request, make_view
from .onnx_models import corrupt_file, prefer_replica_model


def sample(reg, name, **labels):
    return reg.get_sample_value(name, labels) or 0.0


def test_shadow_agreement_and_load_delta(tmp_path):
    reg = CollectorRegistry()
    m = ServingMetrics(reg)
    shadow = ShadowEvaluator(guarded(OnnxPolicy(prefer_replica_model(tmp_path / "p.onnx", 0)), budget_s=0.05), "prefer0", m)
    actual = make_policy("least-outstanding", seed=0)
    views = [make_view([0, 5, 9]), make_view([4, 1, 9]), make_view([2, 6, 0])]  # LOR picks 0, 1, 2
    results = []
    for i, view in enumerate(views):
        pick = actual.choose(view, make_request(i))
        results.append(shadow.observe(view, make_request(i), pick, "least-outstanding"))
    assert [r.agree for r in results] == [True, False, False]
    assert [r.load_delta for r in results] == [0, 3, 2]
    assert sample(reg, "llm_router_shadow_decisions_total", policy="least-outstanding", shadow_policy="prefer0", agreement="agree") == 1
    assert sample(reg, "llm_router_shadow_decisions_total", policy="least-outstanding", shadow_policy="prefer0", agreement="disagree") == 2
    lbl = dict(policy="least-outstanding", shadow_policy="prefer0")
    assert sample(reg, "llm_router_shadow_disagreement_load_delta_count", **lbl) == 2
    assert sample(reg, "llm_router_shadow_disagreement_load_delta_bucket", le="1.0", **lbl) == 0
    assert sample(reg, "llm_router_shadow_disagreement_load_delta_bucket", le="2.0", **lbl) == 1
    assert sample(reg, "llm_router_shadow_disagreement_load_delta_bucket", le="4.0", **lbl) == 2
    assert shadow.describe()["agreement_rate"] == 1 / 3


def test_broken_shadow_counts_fallbacks_and_never_raises(tmp_path):
    reg = CollectorRegistry()
    shadow = ShadowEvaluator(guarded(OnnxPolicy(corrupt_file(tmp_path / "bad.onnx"))), "bad", ServingMetrics(reg))
    for i in range(5):
        r = shadow.observe(make_view([3, 1, 2]), make_request(i), 1, "learned")
        assert r.fallback_reason == "unavailable" and r.index == 1 and r.agree
    assert sample(reg, "llm_router_shadow_fallbacks_total", shadow_policy="bad", reason="unavailable") == 5
    # no healthy replica at all: the shadow reports nothing instead of raising
    assert shadow.observe(make_view([1, 1], healthy=[False, False]), make_request(), 0, "learned") is None
