"""Real faulty ONNX files behind FallbackPolicy: every fault is served by LOR, with its reason."""

from __future__ import annotations

import numpy as np
import pytest

from routewise_vllm.router.policy import LeastOutstanding, Policy
from routewise_vllm.router.policy.fallback import BUDGET_MIN_SAMPLES
from routewise_vllm.router.policy.onnx_policy import OnnxPolicy

from .helpers import guarded, make_request, make_view
from .onnx_models import (
    attention_model, corrupt_file, feature_weights, fixed_width_model, linear_model, nan_model, prefer_replica_model,
    slow_model,
)

LOADS = [7, 3, 9, 1, 5]  # LOR picks index 3


def decide_many(policy, views, n=30):
    out = []
    for i in range(n):
        view = views[i % len(views)]
        out.append((view, policy.decide(view, make_request(i))))
    return out


def lor_index(view) -> int:
    return LeastOutstanding(seed=1).choose(view, make_request())


def test_good_model_decides_without_fallback(tmp_path):
    # scores -outstanding: must pick the least loaded replica itself, no fallback
    policy = guarded(OnnxPolicy(linear_model(tmp_path / "good.onnx")), budget_s=0.05)
    views = [make_view(LOADS), make_view([2, 8, 0, 4]), make_view([5, 5, 1, 9, 9, 9, 9, 9])]
    for view, d in decide_many(policy, views):
        assert d.fallback_reason is None, d
        assert d.index == int(np.argmin([r.outstanding for r in view.replicas]))


def test_attention_model_serves(tmp_path):
    policy = guarded(OnnxPolicy(attention_model(tmp_path / "attn.onnx")), budget_s=0.05)
    for view, d in decide_many(policy, [make_view(LOADS), make_view([1] * 16)]):
        assert d.fallback_reason is None and 0 <= d.index < len(view)


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda p: corrupt_file(p), "unavailable"),
        (lambda p: corrupt_file(p, source=linear_model(p.with_name("src.onnx"))), "unavailable"),
        (lambda p: linear_model(p, spec_hash="0123456789abcdef"), "spec_mismatch"),
        (lambda p: nan_model(p), "nan"),
    ],
    ids=["corrupt-bytes", "truncated-model", "other-feature-hash", "nan-logits"],
)
def test_faulty_model_falls_back_to_lor(tmp_path, build, reason):
    policy = guarded(OnnxPolicy(build(tmp_path / "bad.onnx")))
    views = [make_view(LOADS), make_view([4, 0, 6]), make_view([3, 3, 2, 8, 1, 9, 9])]
    for view, d in decide_many(policy, views):
        assert d.fallback_reason == reason, d
        assert d.index == lor_index(view)
        assert view.replicas[d.index].healthy


def test_slow_model_answers_are_used_until_most_recent_decisions_are_over_budget_then_it_is_skipped(tmp_path):
    primary = OnnxPolicy(slow_model(tmp_path / "slow.onnx"))
    policy = guarded(primary, budget_s=1e-6)
    calls = []
    scores = primary.scores
    primary.scores = lambda view, request: calls.append(1) or scores(view, request)
    view = make_view([3, 1, 4, 2])
    decisions = [policy.decide(view, make_request(i)) for i in range(BUDGET_MIN_SAMPLES + 10)]
    used = decisions[:BUDGET_MIN_SAMPLES]
    assert all(d.fallback_reason is None and d.elapsed_s > 1e-6 and d.index == 1 for d in used)  # slow, not discarded
    skipped = decisions[BUDGET_MIN_SAMPLES:]
    assert all(d.fallback_reason == "over_budget" and d.primary_index is None and d.index == 1 for d in skipped)
    assert len(calls) == BUDGET_MIN_SAMPLES  # no request pays for a model whose answer would be discarded


def test_onnxruntime_error_at_run_time_falls_back(tmp_path):
    policy = guarded(OnnxPolicy(fixed_width_model(tmp_path / "fixed.onnx", replicas=4)), budget_s=0.05)
    ok = policy.decide(make_view([3, 1, 4, 2]), make_request())
    assert ok.fallback_reason is None and ok.index == 1  # the model itself works at its width
    d = policy.decide(make_view(LOADS), make_request())
    assert d.fallback_reason == "exception" and "Reshape" in d.error
    assert d.index == 3


def test_stale_stats_fall_back(tmp_path):
    policy = guarded(OnnxPolicy(prefer_replica_model(tmp_path / "p.onnx", 0)), budget_s=0.05)
    fresh = policy.decide(make_view(LOADS, stats_age_s=1.0), make_request())
    assert fresh.fallback_reason is None and fresh.index == 0
    stale = policy.decide(make_view(LOADS, stats_age_s=30.0), make_request())
    assert stale.fallback_reason == "stale_stats" and stale.index == 3


def test_overload_guard_overrides_a_pick_far_above_the_least_loaded(tmp_path):
    policy = guarded(OnnxPolicy(prefer_replica_model(tmp_path / "p.onnx", 2)), budget_s=0.05, overload_margin=32)
    near = policy.decide(make_view([10, 5, 30, 40]), make_request())
    assert near.fallback_reason is None and near.index == 2  # 25 above the least: allowed
    far = policy.decide(make_view([10, 5, 40, 40]), make_request())
    assert far.fallback_reason == "overload_guard" and far.primary_index == 2 and far.index == 1


def test_learned_model_never_routes_to_an_unhealthy_replica(tmp_path):
    # the model's favourite replica (2) is unhealthy: the masked scores pick among healthy ones
    policy = guarded(OnnxPolicy(prefer_replica_model(tmp_path / "p.onnx", 2)), budget_s=0.05)
    d = policy.decide(make_view([1, 1, 1, 1], healthy=[True, True, False, True]), make_request())
    assert d.fallback_reason is None and d.index in (1, 3)


class _PicksUnhealthy(Policy):
    name = "picks-unhealthy"

    def choose(self, view, request):
        return next(i for i, r in enumerate(view.replicas) if not r.healthy)


def test_masked_pick_falls_back():
    policy = guarded(_PicksUnhealthy(), budget_s=None)
    d = policy.decide(make_view([1, 0, 2], healthy=[True, False, True]), make_request())
    assert d.fallback_reason == "masked_pick" and d.primary_index == 1 and d.index == 0


def test_weights_helper_names_features():
    w = feature_weights(outstanding=-1.0, kv_cache_usage=2.0)
    assert w.sum() == 1.0 and np.count_nonzero(w) == 2


def test_pooled_model_serves_and_ignores_masked_rows(tmp_path):
    from routewise_vllm.router.policy.onnx_policy import OnnxPolicy as P

    from .onnx_models import pooled_model

    policy = P(pooled_model(tmp_path / "pooled.onnx"))
    view = make_view([1, 2, 3, 4])
    s = policy.scores(view, make_request())
    assert s.shape == (4,) and np.all(np.isfinite(s))
    # permutation-equivariant: reversing the replicas reverses the scores
    rev = make_view([4, 3, 2, 1])
    assert np.allclose(policy.scores(rev, make_request()), s[::-1], atol=1e-5)
