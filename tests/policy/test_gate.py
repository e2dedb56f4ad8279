"""The gated policy (router/policy/gated.py): its switching rule on hand-computed views, and that each mode decides
as its policy would on its own, behind FallbackPolicy, with and without late binding's restricted view."""

from __future__ import annotations

import numpy as np
import pytest

from routewise_vllm.router.policy import ClusterView, ReplicaSnapshot, RequestInfo
from routewise_vllm.router.policy.base import Policy
from routewise_vllm.router.policy.fallback import FallbackPolicy
from routewise_vllm.router.policy.gated import (GatedPolicy, cached_fraction, load_ratio, next_cache, next_state,
                                                speed_spread)
from routewise_vllm.router.policy.late_binding import restrict
from routewise_vllm.router.policy.registry import (DEFAULT_MODEL_PATH, GATED, check_policy_name, is_learned, make_policy,
                                                   policy_names)
from routewise_vllm.router.policy.served import guard_settings

REQ = RequestInfo("q", 1000, 64)


class Scorer(Policy):
    """A scoring stand-in for the learned policy: prefers the highest index (its logits are the indices)."""

    name = "scorer"

    def scores(self, view, request):
        return np.arange(len(view.replicas), dtype=np.float64)

    def best(self, view, request):
        return None

    def choose(self, view, request):
        return int(np.argmax(np.where([r.healthy for r in view.replicas], self.scores(view, request), -np.inf)))


class Lowest(Policy):
    """A heuristic stand-in: the lowest healthy index."""

    name = "lowest"

    def choose(self, view, request):
        return next(i for i, r in enumerate(view.replicas) if r.healthy)


# ---------------------------------------------------------------- the spread and the rule, by hand


def test_speed_spread_is_the_slowest_floor_over_the_fastest():
    # 0.030 / 0.010 = 3.0; a replica without a floor (None) does not count
    assert speed_spread(view(0.010, 0.020, 0.030, None)) == pytest.approx(3.0)
    # 0.012 / 0.010 = 1.2, a replica late binding marked full (unhealthy) still counts: its speed is known
    v = view(0.010, 0.012)
    assert speed_spread(restrict(v, [0])) == pytest.approx(1.2)


@pytest.mark.parametrize("floors", [(0.010,), (0.010, None, None, None, None), (None, None)])
def test_speed_spread_is_unknown_until_enough_replicas_are_measured(floors):
    # at least 2 floors and at least half of the replicas: 1 of 1, 1 of 5 and 0 of 2 are not enough
    assert speed_spread(view(*floors)) is None


def test_speed_spread_counts_half_the_replicas_as_enough():
    # 2 of 4 measured: 2 >= 2 and 2 >= 0.5 x 4; 0.015 / 0.010 = 1.5
    assert speed_spread(view(0.010, None, 0.015, None)) == pytest.approx(1.5)


def loaded(*replicas: tuple[float | None, int]) -> ClusterView:
    """Replicas with these (TPOT floor, requests in flight), each holding a request's 2 blocks."""
    return ClusterView(tuple(ReplicaSnapshot(f"r{i}", True, n, 0, tpot_floor_s=f, prefix_match_blocks=2)
                             for i, (f, n) in enumerate(replicas)))


def test_load_ratio_is_the_slowest_floors_load_over_the_fastest_floors():
    # slowest floor 0.040 has 11 in flight, fastest 0.010 has 2: (11 + 1) / (2 + 1) = 4; the unmeasured one's 50 is not
    # counted
    assert load_ratio(loaded((0.010, 2), (0.020, 0), (0.040, 11), (None, 50))) == pytest.approx(4.0)
    assert load_ratio(loaded((0.010, 2), (None, 9))) is None  # one floor: nothing to compare


def test_a_spread_the_load_explains_is_no_evidence():
    # floors 4x apart every decision; evidence 2 latches. The slow replica with 8 in flight where the fast one has 2:
    # (8 + 1) / (2 + 1) = 3 >= 3, explained by its batch: never latches, the heuristic decides (Lowest: replica 0)
    gate = GatedPolicy(Scorer(), Lowest(), evidence=2, dwell=10, cache_window=1)
    pol = served(gate)
    for i in range(5):
        assert pol.decide(loaded((0.010, 2), (0.040, 8)), req(i)).index == 0
    assert (gate.evidence, gate.latch, gate.spread) == (0, 0, pytest.approx(4.0))
    # the same floors with 7 in flight: 8 / 3 < 3, evidence of speed; the second such decision latches learned
    # (the scorer: the last replica)
    assert pol.decide(loaded((0.010, 2), (0.040, 7)), req(5)).index == 0
    assert pol.decide(loaded((0.010, 2), (0.040, 7)), req(6)).index == 1
    assert (gate.evidence, gate.latch) == (2, 10)


# (latch, evidence) before, the decision's spread, (latch, evidence) after; thresholds 2.0, at most 3 of evidence, a
# dwell of 100 decisions. A latch above 0 means learned.
@pytest.mark.parametrize("before, spread, after", [
    ((0, 0), None, (0, 0)),          # nothing measured: nothing changes
    ((0, 0), 1.9, (0, 0)),
    ((0, 0), 2.0, (0, 1)),           # >= 2.0: evidence 1 of 3, no latch yet
    ((0, 1), 2.5, (0, 2)),
    ((0, 2), 2.0, (100, 3)),         # evidence 3: learned for 100 decisions, this one included
    ((100, 3), 1.2, (99, 2)),        # latched: learned whatever the spread
    ((99, 2), 2.2, (100, 3)),        # back at 3: renewed
    ((1, 0), 1.2, (0, 0)),           # the latch runs out: the gate looks again
    ((0, 1), 1.5, (0, 0)),           # evidence never below 0
    ((0, 3), 9.0, (100, 3)),         # nor above 3
])
def test_speed_rule(before, spread, after):
    assert next_state(*before, spread, 2.0, 3, 100) == after


def test_cached_fraction_is_the_best_replica_share_of_the_request_blocks():
    r = RequestInfo("q", 1000, 64, tuple(range(8)))
    v = ClusterView((ReplicaSnapshot("a", True, 0, 0, prefix_match_blocks=2),
                     ReplicaSnapshot("b", False, 0, 0, prefix_match_blocks=6)))
    assert cached_fraction(v, r) == pytest.approx(6 / 8)  # a replica late binding marked full still holds its cache
    assert cached_fraction(v, REQ) == 0.0  # no prefix blocks


# (share, on) before, the decision's number (seen) and cached fraction, (share, on) after; window 4, on at >= 0.3,
# off below 0.2
@pytest.mark.parametrize("before, seen, fraction, after", [
    ((0.0, False), 1, 0.9, (0.9, True)),        # the first decision: the mean of one
    ((0.9, True), 2, 0.1, (0.5, True)),         # the mean of two: (0.9 + 0.1) / 2
    ((0.3, False), 3, 0.0, (0.2, False)),       # 0.3 + (0 - 0.3) / 3 = 0.2 < 0.3: stays off
    ((0.4, True), 10, 0.0, (0.3, True)),        # past the window: 0.4 + (0 - 0.4) / 4 = 0.3
    ((0.24, True), 10, 0.0, (0.18, False)),     # 0.24 - 0.06 = 0.18 < 0.2: off
    ((0.22, True), 10, 0.2, (0.215, True)),     # between 0.2 and 0.3: stays on
    ((0.22, False), 10, 0.6, (0.315, True)),    # 0.22 + 0.38 / 4 = 0.315 >= 0.3: on
])
def test_cache_rule(before, seen, fraction, after):
    share, on = next_cache(*before, seen, fraction, 4, 0.3, 0.2)
    assert (share, on) == (pytest.approx(after[0]), after[1])


# ---------------------------------------------------------------- decisions in each mode, served


def served(gate: GatedPolicy) -> FallbackPolicy:
    return FallbackPolicy(gate, Lowest())


def req(i: int, cached: bool = True) -> RequestInfo:
    return RequestInfo(f"q{i}", 1000, 64, (1, 2) if cached else ())


def view(*floors: float | None, match: int = 2) -> ClusterView:
    """Replicas with these TPOT floors, each holding `match` of a request's blocks."""
    return ClusterView(tuple(ReplicaSnapshot(f"r{i}", True, 0, 0, tpot_floor_s=f, prefix_match_blocks=match)
                             for i, f in enumerate(floors)))


def test_each_decision_is_made_in_the_mode_its_own_view_sets():
    gate = GatedPolicy(Scorer(), Lowest(), evidence=1, dwell=2, cache_window=2)
    pol = served(gate)
    # requests without prefix blocks: the cache does not decide, learned (the scorer picks the last replica)
    assert pol.decide(view(0.010, 0.011, 0.010, match=0), req(0, cached=False)).index == 2
    assert gate.mode == "learned"
    # every replica holds the request's 2 blocks: fraction 1, share (0 + 1) / 2 = 0.5 >= 0.3, the cache decides; the
    # spread 0.011 / 0.010 = 1.1 < 2.0: this very decision is the heuristic's (the lowest index), by the primary
    d = pol.decide(view(0.010, 0.011, 0.010), req(1))
    assert (d.index, d.fallback_reason, gate.mode) == (0, None, "heuristic")
    # no floors known yet counts as no evidence: still the heuristic
    assert pol.decide(view(None, None, None), req(2)).index == 0
    # 0.025 / 0.010 = 2.5 >= 2.0: evidence 1, learned for 2 decisions (dwell), this one included
    d = pol.decide(view(0.010, 0.025, 0.010), req(3))
    assert (d.index, d.fallback_reason, gate.mode, gate.latch) == (2, None, "learned", 2)
    assert [pol.decide(view(0.010, 0.011, 0.010), req(i)).index for i in (4, 5, 6)] == [2, 0, 0]
    # the share was 0.98 after 6 cached requests; each uncached one halves it (window 2): 0.49, 0.25 (on: >= 0.2), 0.12
    # (off): learned
    assert [pol.decide(view(0.010, 0.011, 0.010, match=0), req(i, cached=False)).index for i in (7, 8, 9)] == [0, 0, 2]
    assert gate.switches == 4
    assert gate.decisions == {"learned": 4, "heuristic": 6}


def test_one_decision_applies_the_rule_once(monkeypatch):
    # FallbackPolicy asks best, then scores, then choose for one heuristic decision: the rule runs once per decision
    from routewise_vllm.router.policy import gated

    calls = []
    monkeypatch.setattr(gated, "speed_spread", lambda v, *a: calls.append(v) or gated_spread(v))
    gate = GatedPolicy(Scorer(), Lowest(), dwell=3)
    pol = served(gate)
    uniform = view(0.010, 0.011, 0.010)
    assert pol.decide(restrict(uniform, [1, 2]), req(0), uniform).index == 1  # the heuristic's, on the candidates
    assert pol.decide(uniform, req(1)).index == 0
    assert len(calls) == 2


gated_spread = speed_spread


def test_behind_late_binding_learned_scores_the_fleet_and_the_heuristic_sees_the_candidates():
    gate = GatedPolicy(Scorer(), Lowest())
    pol = served(gate)
    mixed = view(0.010, 0.030, 0.010)  # learned: the cache share is not on yet (no request without blocks seen)
    # late binding let replicas 0 and 1 go: the scorer scores the whole fleet and picks among them (1)
    assert pol.decide(restrict(mixed, [0, 1], ), req(0, cached=False), mixed).index == 1
    gate.latch = 0  # the latch has run out
    uniform = view(0.010, 0.011, 0.010)  # 1.1: the heuristic, on the candidates 1 and 2 (the lowest: 1)
    d = pol.decide(restrict(uniform, [1, 2]), req(1), uniform)
    assert (d.index, d.fallback_reason, gate.mode) == (1, None, "heuristic")


def test_late_binding_holds_for_the_learned_policy_not_while_the_heuristic_routes():
    """The room stage asks the gate first (router.policy.pipeline), and the gate judges the request then: in learned
    mode late binding's rule applies; a request that finds the cache deciding goes at once to the heuristic's pick over
    every candidate (held, a request would go to whichever replica frees first, undoing the cache-aware pick)."""
    from routewise_vllm.router.policy.late_binding import LateBindingConfig, ReplicaLimit
    from routewise_vllm.router.policy.pipeline import HELD, POLICY_ROUTES, Pipeline, Room

    gate = GatedPolicy(Scorer(), Lowest(), cache_window=2)
    pol = served(gate)
    full = Room([ReplicaLimit(max_outstanding=1, max_prefill_tokens=10_000)] * 3, 0, False, 0.0, LateBindingConfig())
    busy = ClusterView(tuple(ReplicaSnapshot(f"r{i}", True, 1, 0, tpot_floor_s=0.010, prefix_match_blocks=m)
                             for i, m in enumerate((0, 2, 0))))
    # no blocks: fraction 0, the share stays 0, learned: held
    assert pol.binds_late(busy, req(0, cached=False)) and Pipeline().decide(busy, req(0, cached=False), pol, room=full) is HELD
    assert (gate.seen, gate.mode) == (1, "learned")  # asked twice about one request: judged once
    # replica 1 holds both blocks: fraction 1, share (0 + 1) / 2 = 0.5 >= 0.3: this very request goes at once
    out = Pipeline().decide(busy, req(1), pol, room=full)
    assert (out.index, out.late, gate.mode, gate.seen) == (0, POLICY_ROUTES, "heuristic", 2)  # Lowest's pick of all three


def test_every_request_the_room_stage_asks_about_counts_once_picked_or_not():
    """Requests late binding holds and then hands to the only replica with room are never picked: judged by the room
    stage's question, they still move the rule (before, an overloaded pool stayed in the mode it had before them), and
    one judged then keeps its mode at its pick, however many others came between."""
    gate = GatedPolicy(Scorer(), Lowest(), cache_window=4)
    uniform = view(0.010, 0.011, 0.010)
    assert gate.binds_late(uniform, req(0, cached=False))  # share 0: learned, may be held
    for i in range(1, 4):  # three cached requests, asked about and never picked: (0 + 1 + 1 + 1) / 4 = 0.75
        gate.binds_late(uniform, req(i))
    assert (gate.seen, gate.mode, gate.cache_share) == (4, "heuristic", pytest.approx(0.75))
    assert gate.decisions == {"learned": 0, "heuristic": 0}  # no pick yet
    # the first request, picked at last: in its own mode (learned: the scorer's pick, the last replica), not judged again
    assert served(gate).decide(uniform, req(0, cached=False)).index == 2
    assert gate.seen == 4 and gate.decisions == {"learned": 1, "heuristic": 0}


def test_the_judged_requests_are_forgotten_past_a_bound(monkeypatch):
    from routewise_vllm.router.policy import gated

    monkeypatch.setattr(gated, "JUDGED_MEMORY", 3)
    gate = GatedPolicy(Scorer(), Lowest())
    for i in range(5):
        gate.binds_late(view(0.010, 0.010), req(i))
    assert list(gate._judged) == ["q2", "q3", "q4"]
    gate.binds_late(view(0.010, 0.010), req(0))  # forgotten: judged as a new request
    assert gate.seen == 6


def test_reset_starts_over_in_learned_mode():
    gate = GatedPolicy(Scorer(), Lowest())
    served(gate).decide(view(0.010, 0.010), req(0))
    assert gate.mode == "heuristic"
    gate.reset(0)
    assert (gate.mode, gate.switches, gate.spread, gate.latch, gate.cache_share) == ("learned", 0, None, 0, 0.0)


def test_thresholds_are_checked():
    with pytest.raises(ValueError, match="mixed_min_spread"):
        GatedPolicy(Scorer(), Lowest(), mixed_min_spread=0.5)
    with pytest.raises(ValueError, match="dwell"):
        GatedPolicy(Scorer(), Lowest(), dwell=0)
    with pytest.raises(ValueError, match="max_load_ratio"):
        GatedPolicy(Scorer(), Lowest(), max_load_ratio=1.0)


# ---------------------------------------------------------------- the served name


def test_gated_is_a_learned_policy_name():
    assert GATED in policy_names()
    assert check_policy_name(GATED, "policy") == GATED
    assert is_learned(GATED)  # late binding on by default, the learned guards and decision cost
    assert guard_settings(GATED)["overload_ratio"] == 8.0
    gate = make_policy(GATED, seed=0)
    assert isinstance(gate, GatedPolicy)
    assert gate.heuristic.name == "llm-d"
    info = gate.describe()
    assert info["name"] == GATED and info["mode"] == "learned" and info["feature_spec_hash"]


def test_the_simulator_takes_the_gated_name():
    from routewise_vllm.simulator.experiments import resolve_policies

    assert resolve_policies("gated,learned") == ["gated", "learned"]


def test_a_model_served_as_gated_is_put_behind_a_new_gate_and_a_gate_hands_its_model_on():
    """registry.served_as: how an A/B promotion hands the treatment's model to the control arm."""
    from routewise_vllm.router.policy.registry import served_as

    model = Scorer()
    gate = served_as(GATED, model)
    assert isinstance(gate, GatedPolicy) and gate.learned is model and gate.heuristic.name == "llm-d"
    again = served_as(GATED, gate)  # a gated treatment promoted into a gated control: one gate, the same model
    assert isinstance(again, GatedPolicy) and again is not gate and again.learned is model
    assert served_as("learned", gate) is model and served_as("/models/x.onnx", model) is model


def test_gated_model_puts_the_gate_around_that_model_and_keeps_it_there():
    """`gated:MODEL`: the gate around a shipped model or an .onnx file; reloads and A/B promotions of that arm stay
    gated; names the gate cannot serve are refused, each naming what was wrong."""
    from routewise_vllm.router.policy.registry import MODELS_DIR, model_path, model_policy, served_as
    from routewise_vllm.simulator.experiments import ExperimentError, resolve_policies

    cache = MODELS_DIR / "cache-fleet.onnx"
    for name in ("gated:cache-fleet", f"gated:{cache}"):
        assert check_policy_name(name, "policy") == name and is_learned(name) and model_path(name) == cache
        gate = make_policy(name, seed=0)
        assert isinstance(gate, GatedPolicy) and gate.learned.path == cache and gate.heuristic.name == "llm-d"
        assert gate.describe()["version"].startswith("cache-fleet")
        reloaded = model_policy(name, DEFAULT_MODEL_PATH, seed=0)  # router.serving.reload with a new file
        assert isinstance(reloaded, GatedPolicy) and reloaded.learned.path == DEFAULT_MODEL_PATH
        assert isinstance(served_as(name, Scorer()), GatedPolicy)
        assert guard_settings(name) == guard_settings(GATED)
    assert resolve_policies("gated:cache-fleet,gated") == ["gated:cache-fleet", "gated"]
    for bad, words in (("gated:llm-d", "not 'llm-d'"), ("gated:gated", "not 'gated'"), ("gated:nope", "not 'nope'"),
                       ("gated:/no/such.onnx", "model file not found")):
        with pytest.raises(ValueError, match=words):
            check_policy_name(bad, "policy")
        with pytest.raises(ExperimentError, match=words):
            resolve_policies(bad)
