from __future__ import annotations

import math

import numpy as np
import pytest

from routewise_vllm.router.policy import (
    FEATURE_NAMES,
    FEATURE_SPEC_HASH,
    N_FEATURES,
    ClusterTracker,
    ClusterView,
    FallbackPolicy,
    LeastOutstanding,
    NoHealthyReplica,
    Policy,
    PolicyUnavailable,
    PrefixIndex,
    ReplicaSnapshot,
    RequestInfo,
    TokenEstimator,
    action_mask,
    build_features,
    id_prefix_blocks,
    make_policy,
    policy_names,
    text_prefix_blocks,
)


def snap(i: int, outstanding: int = 0, healthy: bool = True, **kw) -> ReplicaSnapshot:
    return ReplicaSnapshot(f"r{i}", healthy, outstanding, 100 * outstanding, **kw)


REQ = RequestInfo("req", 120, 64, (1, 2, 3, 4))


def test_features_shape_padding_and_mask():
    view = ClusterView((snap(0, 3), snap(1, 0, healthy=False), snap(2, 1)))
    f = build_features(view, REQ)
    assert f.shape == (3, N_FEATURES) and f.dtype == np.float32
    padded = build_features(view, REQ, pad_to=5)
    assert padded.shape == (5, N_FEATURES)
    assert np.array_equal(padded[:3], f) and not padded[3:].any()
    assert action_mask(view, pad_to=5).tolist() == [1, 0, 1, 0, 0]
    with pytest.raises(ValueError, match="pad_to"):
        build_features(view, REQ, pad_to=2)


def test_features_are_permutation_equivariant():
    reps = [snap(0, 3, waiting=2, running=4, kv_cache_usage=0.4, stats_age_s=0.5), snap(1, 0), snap(2, 7, prefix_match_blocks=2)]
    f = build_features(ClusterView(tuple(reps)), REQ)
    g = build_features(ClusterView(tuple(reversed(reps))), REQ)
    assert np.array_equal(f, g[::-1])


def test_missing_stats_are_flagged_not_zeroed_silently():
    col = {n: i for i, n in enumerate(FEATURE_NAMES)}
    f = build_features(ClusterView((snap(0), snap(1, waiting=0, running=0, kv_cache_usage=0.0, stats_age_s=1.0))), REQ)
    assert f[0, col["stats_missing"]] == 1.0 and f[1, col["stats_missing"]] == 0.0
    assert math.isfinite(f[0, col["stats_age_s"]])  # never-scraped age is capped, not inf


def test_spec_hash_is_stable_hex():
    assert len(FEATURE_SPEC_HASH) == 16 and int(FEATURE_SPEC_HASH, 16) >= 0


def test_registry_knows_every_baseline_and_rejects_unknown():
    for name in policy_names(include_learned=False):
        assert make_policy(name, seed=0).name == name
    with pytest.raises(ValueError, match="unknown policy 'nope'.*least-outstanding"):
        make_policy("nope")


@pytest.mark.parametrize("name", policy_names(include_learned=False))
def test_every_baseline_picks_only_healthy(name):
    view = ClusterView((snap(0, 0, healthy=False), snap(1, 5), snap(2, 9), snap(3, 0, healthy=False)))
    pol = make_policy(name, seed=1)
    picks = {pol.choose(view, REQ) for _ in range(50)}
    assert picks <= {1, 2}
    with pytest.raises(NoHealthyReplica):
        pol.choose(ClusterView((snap(0, healthy=False),)), REQ)


def test_lor_breaks_ties_at_random_and_prefers_least():
    view = ClusterView((snap(0, 2), snap(1, 1), snap(2, 1)))
    pol = LeastOutstanding(seed=0)
    picks = [pol.choose(view, REQ) for _ in range(200)]
    assert set(picks) == {1, 2}


def test_prefix_aware_prefers_affinity_when_balanced_and_load_when_not():
    pol = make_policy("prefix-aware", seed=0)
    balanced = ClusterView((snap(0, 2), snap(1, 3, prefix_match_blocks=4)))
    assert pol.choose(balanced, REQ) == 1
    imbalanced = ClusterView((snap(0, 0), snap(1, 20, prefix_match_blocks=4)))
    assert pol.choose(imbalanced, REQ) == 0


def test_speed_aware_prefers_faster_replica_at_equal_load():
    pol = make_policy("speed-aware", seed=0)
    view = ClusterView((snap(0, 2, tpot_ema_s=0.05), snap(1, 2, tpot_ema_s=0.01)))
    assert pol.choose(view, REQ) == 1


class _Scores(Policy):
    name = "scores"

    def __init__(self, scores=None, exc=None):
        super().__init__()
        self._scores, self._exc = scores, exc

    def choose(self, view, request):
        return int(np.argmax(self.scores(view, request)))

    def scores(self, view, request):
        if self._exc:
            raise self._exc
        return np.array(self._scores, dtype=float)


VIEW3 = ClusterView((snap(0, 5), snap(1, 0), snap(2, 1, healthy=False)))


@pytest.mark.parametrize(
    "primary, reason",
    [
        (_Scores([1.0, 2.0, 0.0]), None),
        (_Scores(exc=RuntimeError("boom")), "exception"),
        (_Scores(exc=PolicyUnavailable("spec_mismatch", "bad hash")), "spec_mismatch"),
        (_Scores([float("nan"), 1.0, 0.0]), "nan"),
        (_Scores([1.0, 2.0]), "nan"),  # wrong shape
    ],
)
def test_fallback_reasons(primary, reason):
    fb = FallbackPolicy(primary, LeastOutstanding(seed=0))
    d = fb.decide(VIEW3, REQ)
    assert d.fallback_reason == reason
    assert d.index == 1


def test_fallback_masked_pick_and_overload_guard_and_budget():
    class Pick(Policy):
        name = "pick"

        def __init__(self, i):
            super().__init__()
            self.i = i

        def choose(self, view, request):
            return self.i

    assert FallbackPolicy(Pick(2), LeastOutstanding()).decide(VIEW3, REQ).fallback_reason == "masked_pick"
    d = FallbackPolicy(Pick(0), LeastOutstanding(), overload_margin=3).decide(VIEW3, REQ)
    assert (d.fallback_reason, d.index) == ("overload_guard", 1)
    ticks = iter([0.0, 0.01])
    d = FallbackPolicy(Pick(0), LeastOutstanding(), budget_s=0.001, clock=lambda: next(ticks)).decide(VIEW3, REQ)
    assert (d.fallback_reason, d.index, d.elapsed_s) == (None, 0, 0.01)  # slow once: the computed answer is used


def test_a_persistently_slow_policy_is_skipped_for_a_cooldown_then_measured_again():
    from routewise_vllm.router.policy.fallback import BUDGET_COOLDOWN, BUDGET_TRIP, BUDGET_WINDOW

    class Pick(Policy):
        calls = 0

        def choose(self, view, request):
            Pick.calls += 1
            return 0

    cost = {"s": 0.0}
    fb = FallbackPolicy(Pick(), LeastOutstanding(), budget_s=0.001, cost=lambda view: cost["s"])
    for i in range(3 * BUDGET_WINDOW):  # a few slow decisions in every window (hiccups) never trip it
        cost["s"] = 0.002 if i % 10 == 0 else 0.0
        assert fb.decide(VIEW3, REQ).fallback_reason is None
    cost["s"] = 0.002
    reasons = [fb.decide(VIEW3, REQ).fallback_reason for _ in range(BUDGET_WINDOW)]
    tripped = reasons.index("over_budget")
    assert 0 < tripped <= BUDGET_TRIP and set(reasons[tripped:]) == {"over_budget"}
    assert fb.trips == 1 and fb.last_trip.slow == BUDGET_TRIP and fb.last_trip.slowest_s == 0.002  # what the router logs
    calls = Pick.calls
    skipped = [fb.decide(VIEW3, REQ) for _ in range(BUDGET_COOLDOWN - (len(reasons) - tripped))]
    assert Pick.calls == calls and all(d.fallback_reason == "over_budget" and d.index == 1 for d in skipped)
    cost["s"] = 0.0
    assert fb.decide(VIEW3, REQ).fallback_reason is None and Pick.calls == calls + 1  # measured afresh


def test_fallback_stale_stats_and_low_confidence():
    stale = ClusterView((snap(0, 5, stats_age_s=30.0), snap(1, 0, stats_age_s=30.0)))
    fb = FallbackPolicy(_Scores([5.0, 0.0]), LeastOutstanding(), max_stats_age_s=10.0)
    assert fb.decide(stale, REQ).fallback_reason == "stale_stats"
    fb = FallbackPolicy(_Scores([1.0, 1.01, 0.0]), LeastOutstanding(), min_confidence=0.9)
    assert fb.decide(VIEW3, REQ).fallback_reason == "low_confidence"


def test_missing_learned_model_falls_back_with_reason(tmp_path):
    pol = make_policy(str(tmp_path / "missing.onnx"))
    d = FallbackPolicy(pol, LeastOutstanding()).decide(VIEW3, REQ)
    assert d.fallback_reason == "unavailable" and "missing.onnx" in d.error


def test_corrupt_model_names_the_file(tmp_path):
    bad = tmp_path / "corrupt.onnx"
    bad.write_bytes(b"not a model at all")
    pol = make_policy(str(bad))
    assert pol.load_error is not None and "corrupt.onnx" in str(pol.load_error)


def test_token_estimator_and_prefix_hashing():
    est = TokenEstimator()
    assert est.from_text("a" * 400) == 100
    rng = np.random.default_rng(0)
    ests = [est.from_true_tokens(1000, rng) for _ in range(2000)]
    assert 950 < np.median(ests) < 1050 and np.std(np.log(ests)) == pytest.approx(0.15, rel=0.1)
    a = text_prefix_blocks("x" * 256 * 3 + "tail")
    b = text_prefix_blocks("x" * 256 * 2 + "y" * 256)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert id_prefix_blocks([0, 5, 7])[:2] == id_prefix_blocks([0, 5, 9])[:2]
    assert id_prefix_blocks([1, 5])[1] != id_prefix_blocks([0, 5])[1]  # chained, not per-block


def test_prefix_index_lru_bound_and_match():
    idx = PrefixIndex(capacity_blocks=3)
    idx.insert("a", (1, 2, 3))
    assert idx.match("a", (1, 2, 9)) == 2
    idx.insert("a", (4, 5))
    assert idx.size("a") == 3 and idx.match("a", (1,)) == 0


def test_tracker_counts_and_view():
    ct = ClusterTracker(["a", "b"])
    r1 = RequestInfo("1", 100, 10, (7, 8))
    ct.dispatch(0, r1)
    v = ct.view(1.0, RequestInfo("2", 50, None, (7, 8, 9)))
    assert v.replicas[0].outstanding == 1 and v.replicas[0].outstanding_prompt_tokens == 100
    assert v.replicas[0].prefix_match_blocks == 2 and v.replicas[1].prefix_match_blocks == 0
    assert v.replicas[0].dispatched_since_scrape == 1 and v.replicas[0].stats_age_s == math.inf
    ct.trackers[0].on_scrape(2.0, 1, 3, 0.5, 1600)
    ct.trackers[0].on_complete("1", tpot_s=0.02)
    ct.trackers[0].on_complete("1", tpot_s=0.02)  # a second release never double-counts
    s = ct.view(3.5, r1).replicas[0]
    assert (s.outstanding, s.outstanding_prompt_tokens, s.dispatched_since_scrape) == (0, 0, 0)
    assert (s.waiting, s.running, s.kv_cache_usage, s.kv_capacity_tokens, s.stats_age_s) == (1, 3, 0.5, 1600, 1.5)
    assert s.tpot_ema_s == 0.02


def test_tpot_floor_is_a_low_percentile_published_after_enough_completions_robust_to_bursts_and_slowdowns():
    from routewise_vllm.router.policy.tracking import TPOT_FLOOR_DROP, TPOT_FLOOR_MIN_SAMPLES, TPOT_FLOOR_RISE

    ct = ClusterTracker(["a"])
    t = ct.trackers[0]

    def complete(k: int, tpot: float | None) -> None:
        ct.dispatch(0, RequestInfo(f"q{k}", 10, 10))
        t.on_complete(f"q{k}", tpot)

    complete(0, 0.01)
    for k in range(1, TPOT_FLOOR_MIN_SAMPLES - 1):
        complete(k, 0.02)
    complete(99, None)  # no TPOT (a failure): not a sample
    assert t.tpot_floor_s is None  # one fast completion proves nothing
    complete(100, 0.02)
    assert t.tpot_floor_s == pytest.approx(0.01 * (1 + TPOT_FLOOR_RISE) ** (TPOT_FLOOR_MIN_SAMPLES - 1))
    assert ct.view(0.0, RequestInfo("v", 1)).replicas[0].tpot_floor_s == t.tpot_floor_s
    for k in range(200, 400):  # slowed for good: 200 completions later the floor is the new speed
        complete(k, 0.05)
    assert t.tpot_floor_s == 0.05 and t.tpot_ema_s == pytest.approx(0.05)
    complete(400, 1e-6)  # a stream whose tokens all came in one read: a TPOT near zero moves the floor 9 %
    assert t.tpot_floor_s == pytest.approx(0.05 * (1 - TPOT_FLOOR_DROP))
    rng = np.random.default_rng(0)
    for k, x in enumerate(rng.uniform(0.01, 0.03, 3000)):  # it settles near the 10th percentile
        complete(1000 + k, float(x))
    assert 0.011 < t.tpot_floor_s < 0.014


def test_tracker_counts_prompt_tokens_awaiting_their_first_token_once():
    ct = ClusterTracker(["a"])
    t = ct.trackers[0]
    for rid, prompt in (("1", 100), ("2", 40), ("3", 7)):
        ct.dispatch(0, RequestInfo(rid, prompt, 10))
    assert (t.awaiting_first_token, t.awaiting_prompt_tokens) == (3, 147)
    t.on_first_token("1", 0.1)
    t.on_first_token("1", 0.3)  # a preempted, recomputed request's second first token: counted once
    assert (t.awaiting_first_token, t.awaiting_prompt_tokens) == (2, 47)
    assert t.ttft_ema_s == pytest.approx(0.1 + 0.2 * (0.3 - 0.1))  # both still feed the TTFT EMA
    t.on_complete("2")  # failed before its first token
    t.on_complete("1", 0.02)
    s = ct.view(1.0, RequestInfo("4", 1)).replicas[0]
    assert (s.awaiting_first_token, s.awaiting_prompt_tokens, s.outstanding, s.outstanding_prompt_tokens) == (1, 7, 1, 7)
    t.on_first_token("unknown", 0.1)  # a late first token of a released request changes no count
    assert (t.awaiting_first_token, t.awaiting_prompt_tokens) == (1, 7)


def test_expected_wait_weighs_queued_prefill_by_speed_and_discounts_the_cached_prefix():
    pol = make_policy("expected-wait", seed=0)
    # same outstanding tokens, but replica 1's prompts are already past their first token
    view = ClusterView((snap(0, 2, awaiting_prompt_tokens=200), snap(1, 2, awaiting_prompt_tokens=0)))
    assert pol.choose(view, REQ) == 1
    # equal queued prefill: the replica three times slower per token loses ...
    view = ClusterView((snap(0, 2, awaiting_prompt_tokens=100, tpot_ema_s=0.03), snap(1, 2, awaiting_prompt_tokens=100, tpot_ema_s=0.01)))
    assert pol.choose(view, REQ) == 1
    # ... and the whole prompt cached on replica 0 outweighs 100 queued tokens on it
    view = ClusterView((snap(0, 2, awaiting_prompt_tokens=100, prefix_match_blocks=4), snap(1, 2, awaiting_prompt_tokens=0)))
    assert pol.choose(view, RequestInfo("req", 1200, 64, (1, 2, 3, 4))) == 0


def test_served_policy_is_a_learned_policy_behind_the_routers_default_guards(tmp_path):
    from routewise_vllm.router.policy.fallback import LEARNED_GUARDS
    from routewise_vllm.router.policy.served import LEARNED_COST, served_policy

    baseline = served_policy("least-token-load", seed=0)
    assert type(baseline.primary).__name__ == "LeastTokenLoad" and baseline.max_stats_age_s is None
    served = served_policy(str(tmp_path / "missing.onnx"), seed=0)
    assert isinstance(served, FallbackPolicy)
    assert served.max_stats_age_s == LEARNED_GUARDS["max_stats_age_s"] and served.cost is LEARNED_COST
    view = ClusterView((snap(0, 3, stats_age_s=1.0), snap(1, 1, stats_age_s=1.0)))
    decision = served.decide(view, REQ)
    assert (decision.index, decision.fallback_reason) == (1, "unavailable")  # LOR serves, saying why
