"""FallbackPolicy's guards look at healthy replicas only, with Python's comparison semantics."""

from __future__ import annotations

import math

import numpy as np

from routewise_vllm.router.policy import ClusterView, FallbackPolicy, LeastOutstanding, Policy, ReplicaSnapshot, RequestInfo

REQ = RequestInfo("q", 100, 16)


def snap(i: int, outstanding: int = 0, healthy: bool = True, age: float = 1.0) -> ReplicaSnapshot:
    return ReplicaSnapshot(f"r{i}", healthy, outstanding, 0, stats_age_s=age)


class Scores(Policy):
    name = "scores"

    def __init__(self, scores):
        super().__init__()
        self._scores = scores

    def scores(self, view, request):
        return np.asarray(self._scores, dtype=np.float32)

    def choose(self, view, request):  # pragma: no cover - FallbackPolicy uses scores()
        raise AssertionError


def decide(view, scores, **kw):
    return FallbackPolicy(Scores(scores), LeastOutstanding(seed=0), **kw).decide(view, REQ)


def test_stale_stats_counts_healthy_replicas_that_have_stats():
    view = ClusterView((snap(0, age=math.inf, healthy=False), snap(1, age=2.0), snap(2, age=3.0)))
    assert decide(view, [0.0, 1.0, 0.0], max_stats_age_s=10).fallback_reason is None  # an int limit works too
    assert decide(view, [0.0, 1.0, 0.0], max_stats_age_s=2.5).fallback_reason == "stale_stats"
    assert decide(view, [0.0, 1.0, 0.0], max_stats_age_s=3.0).fallback_reason is None  # strictly older
    never = ClusterView((snap(0, age=math.inf), snap(1)))  # not scraped yet: no stats, nothing stale
    assert decide(never, [0.0, 1.0], max_stats_age_s=10.0).fallback_reason is None
    assert decide(ClusterView((snap(0, age=math.inf), snap(1, age=11.0))), [0.0, 1.0], max_stats_age_s=10.0).fallback_reason == "stale_stats"
    nan_first = ClusterView((snap(0, age=math.nan), snap(1, age=30.0)))
    assert decide(nan_first, [0.0, 1.0], max_stats_age_s=10.0).fallback_reason == "stale_stats"
    assert decide(ClusterView((snap(0, age=math.nan),)), [1.0], max_stats_age_s=10.0).fallback_reason is None


def test_overload_guard_measures_from_the_least_loaded_healthy_replica():
    view = ClusterView((snap(0, 0, healthy=False), snap(1, 5), snap(2, 9)))
    d = decide(view, [0.0, 0.0, 1.0], overload_margin=4)
    assert (d.fallback_reason, d.primary_index) == (None, 2)  # 9 - 5 = 4, not above the margin
    d = decide(view, [0.0, 0.0, 1.0], overload_margin=3)
    assert (d.fallback_reason, d.primary_index, d.index) == ("overload_guard", 2, 1)


def test_relative_overload_guard_lets_a_fast_replica_carry_more_but_stops_a_stuck_policy():
    # a fast replica carrying 3x the others plus the margin is fine ...
    busy_fast = ClusterView((snap(0, 10), snap(1, 10), snap(2, 60)))
    assert decide(busy_fast, [0.0, 0.0, 1.0], overload_margin=32, overload_ratio=3.0).fallback_reason is None
    assert decide(busy_fast, [0.0, 0.0, 1.0], overload_margin=32).fallback_reason == "overload_guard"  # absolute: 50 > 32
    # ... one beyond margin + 3x the others' mean is not: 63 - 3 x 10 = 33 > 32
    d = decide(ClusterView((snap(0, 10), snap(1, 10), snap(2, 63))), [0.0, 0.0, 1.0], overload_margin=32, overload_ratio=3.0)
    assert d.fallback_reason == "overload_guard" and d.index in (0, 1)
    # a policy stuck on one replica of an otherwise idle pair is stopped at margin + 1, as before
    stuck = ClusterView((snap(0, 33), snap(1, 0)))
    assert decide(stuck, [1.0, 0.0], overload_margin=32, overload_ratio=3.0).fallback_reason == "overload_guard"
    assert decide(ClusterView((snap(0, 32), snap(1, 0))), [1.0, 0.0], overload_margin=32, overload_ratio=3.0).fallback_reason is None
    # unhealthy replicas are not "others"; a lone healthy replica is never overloaded
    lone = ClusterView((snap(0, 0, healthy=False), snap(1, 500)))
    assert decide(lone, [0.0, 1.0], overload_margin=0, overload_ratio=3.0).fallback_reason is None


def test_scores_of_unhealthy_replicas_are_ignored_but_not_of_healthy_ones():
    view = ClusterView((snap(0, healthy=False), snap(1), snap(2)))
    d = decide(view, [math.nan, 0.0, 2.0])
    assert (d.fallback_reason, d.index) == (None, 2)
    assert decide(view, [9.0, math.inf, 2.0]).fallback_reason == "nan"
    assert decide(view, [0.0, 1.0]).fallback_reason == "nan"  # wrong shape


class ScoresOnly(Policy):
    """The learned policy seen through scores() alone (no best()): FallbackPolicy's generic path."""

    name = "scores-only"

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def scores(self, view, request):
        return self.inner.scores(view, request)

    def choose(self, view, request):  # pragma: no cover - FallbackPolicy uses scores()
        raise AssertionError


def test_a_primary_best_decides_exactly_as_its_scores_do():
    """OnnxPolicy.best (one compiled call on the fast path) gives the FallbackPolicy the decisions that
    its scores() give through the generic path, guards and fallback reasons included."""
    from routewise_vllm.router.policy.onnx_policy import OnnxPolicy
    from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH

    learned = OnnxPolicy(DEFAULT_MODEL_PATH)
    assert hasattr(learned, "best")
    rng = np.random.default_rng(5)
    kw = {"max_stats_age_s": 30.0, "overload_margin": 4}
    fast = FallbackPolicy(learned, LeastOutstanding(seed=0), **kw)
    generic = FallbackPolicy(ScoresOnly(learned), LeastOutstanding(seed=0), **kw)
    reasons = set()
    for step in range(300):
        n = int(rng.choice([1, 2, 5, 16, 40]))
        view = ClusterView(tuple(
            ReplicaSnapshot(f"r{i}", bool(rng.random() < 0.85), int(rng.integers(0, 12)), int(rng.integers(0, 5000)),
                            int(rng.integers(0, 3000)), stats_age_s=float(rng.choice([1.0, 5.0, 40.0, math.inf])),
                            ttft_ema_s=float(rng.uniform(0.01, 1.0)), tpot_ema_s=float(rng.uniform(0.01, 0.1)))
            for i in range(n)))
        if not any(r.healthy for r in view.replicas):
            continue  # the router answers 503 before any policy is asked
        request = RequestInfo(f"q{step}", int(rng.integers(1, 4000)), int(rng.integers(1, 512)))
        a, b = fast.decide(view, request), generic.decide(view, request)
        assert (a.index, a.primary_index, a.fallback_reason) == (b.index, b.primary_index, b.fallback_reason), step
        reasons.add(a.fallback_reason)
    assert {None, "stale_stats", "overload_guard"} <= reasons, reasons


def test_with_a_context_a_scoring_primary_scores_the_whole_fleet_and_picks_among_the_views_healthy():
    """Late binding restricts the view (replicas without room marked unhealthy) and passes the fleet as `context`:
    the learned policy scores the fleet it was trained on, but may only pick a replica the view leaves healthy."""
    seen = []

    class Recording(Scores):
        def scores(self, view, request):
            seen.append(view)
            return super().scores(view, request)

    fleet = ClusterView((snap(0, 3), snap(1, 1), snap(2, 2)))
    restricted = ClusterView((snap(0, 3), snap(1, 1, healthy=False), snap(2, 2)))
    policy = FallbackPolicy(Recording([0.5, 9.0, 1.0]), LeastOutstanding(seed=0))
    d = policy.decide(restricted, REQ, fleet)
    assert seen == [fleet]  # scored on the fleet as it is ...
    assert (d.index, d.fallback_reason) == (2, None)  # ... but replica 1, the best score, has no room
    assert policy.decide(restricted, REQ).index == 2 and seen[-1] == restricted  # no context: the view itself

    class Heuristic(Policy):  # a primary without scores decides on the view, context or not
        name = "heuristic"

        def choose(self, view, request):
            seen.append(view)
            return 0

    assert FallbackPolicy(Heuristic(), LeastOutstanding(seed=0)).decide(restricted, REQ, fleet).index == 0
    assert seen[-1] == restricted
