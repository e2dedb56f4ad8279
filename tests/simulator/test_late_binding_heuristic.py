"""Heuristic late binding: the hold-or-dispatch rule (router.policy.late_binding) and its simulation over ClusterSim.hold()."""

from __future__ import annotations

import math

import pytest

from routewise_vllm.router.policy.late_binding import LateBindingConfig, ReplicaLimit, decide, speed_scales
from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.router.policy.types import ClusterView, ReplicaSnapshot
from routewise_vllm.simulator.cluster import simulate
from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup
from routewise_vllm.simulator.late_binding import simulate_late
from routewise_vllm.simulator.types import SimRequest

LIMIT = ReplicaLimit(max_outstanding=1, max_prefill_tokens=10_000)


def view(*outstanding: int, healthy: tuple[bool, ...] | None = None) -> ClusterView:
    healthy = healthy or (True,) * len(outstanding)
    return ClusterView(
        tuple(ReplicaSnapshot(f"r{i}", h, o, 0) for i, (o, h) in enumerate(zip(outstanding, healthy)))
    )


def test_rule_holds_when_no_replica_has_room_and_dispatches_to_those_with_room():
    cfg = LateBindingConfig(timeout_s=5.0, queue_per_replica=2)
    assert decide(view(1, 1), [LIMIT] * 2, 0, False, 0.0, cfg).reason == "hold"
    d = decide(view(1, 0, 0), [LIMIT] * 3, 0, False, 0.0, cfg)
    assert d.reason == "room" and d.candidates == (1, 2)
    # FIFO: a new arrival queues behind held requests even if a replica has room
    assert decide(view(1, 0), [LIMIT] * 2, 1, False, 0.0, cfg).reason == "hold"


def test_a_full_queue_dispatches_immediately_and_a_timeout_lets_the_policy_pick_any_healthy_replica():
    cfg = LateBindingConfig(timeout_s=5.0, queue_per_replica=2)
    full = decide(view(1, 1), [LIMIT] * 2, 4, False, 0.0, cfg)
    assert full.reason == "full" and full.candidates == (0, 1)
    timed_out = decide(view(3, 1, 2), [LIMIT] * 3, 0, True, 5.0, cfg)
    assert timed_out.reason == "timeout" and timed_out.candidates == (0, 1, 2)  # every one is at its limit
    unhealthy = decide(view(3, 1, 2, healthy=(True, False, True)), [LIMIT] * 3, 0, True, 6.0, cfg)
    assert unhealthy.reason == "timeout" and unhealthy.candidates == (0, 2)


def test_nothing_in_flight_never_holds():
    assert decide(view(0, 0), [ReplicaLimit(0, 0)] * 2, 3, False, 0.0, LateBindingConfig()).reason == "idle"


def one_slot_cluster() -> ClusterConfig:
    return ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=2, max_num_seqs=1)])


def burst(n: int) -> list[SimRequest]:
    return [SimRequest(i, 0.001 * i, 500, 50) for i in range(n)]


def test_held_requests_all_complete_and_holding_time_counts_in_ttft():
    records, reasons = simulate_late(one_slot_cluster(), burst(12), make_policy("least-outstanding"), seed=0,
                                     late=LateBindingConfig(timeout_s=1e9))  # fmt: skip
    assert reasons["held_requests"] >= 10 and reasons["timeout"] == 0 and reasons["full"] == 0
    assert all(math.isfinite(r.finish_s) and not r.error for r in records)  # nothing dropped
    service = records[0].e2e_s
    assert records[11].ttft_s > 4 * service  # five rounds of service ahead, waited in the router's queue
    first = [r.first_token_s for r in records]
    assert first == sorted(first)  # first in, first out


def test_queue_timeout_is_counted_and_dispatches_to_a_busy_replica():
    records, reasons = simulate_late(one_slot_cluster(), burst(12), make_policy("least-outstanding"), seed=0,
                                     late=LateBindingConfig(timeout_s=0.0))  # fmt: skip
    assert reasons["timeout"] >= 1
    assert all(math.isfinite(r.finish_s) for r in records)


def test_a_full_queue_dispatches_at_once():
    cfg = LateBindingConfig(timeout_s=1e9, queue_per_replica=1)  # capacity 2 held requests
    records, reasons = simulate_late(one_slot_cluster(), burst(12), make_policy("least-outstanding"), seed=0, late=cfg)
    assert reasons["full"] >= 1
    assert all(math.isfinite(r.finish_s) for r in records)


def test_with_room_everywhere_late_binding_routes_like_the_policy_alone():
    reqs = [SimRequest(i, 2.0 * i, 100, 10) for i in range(10)]  # one at a time: never a hold
    cfg = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=2)])
    plain = simulate(cfg, reqs, make_policy("least-outstanding"), seed=0)
    late, reasons = simulate_late(cfg, reqs, make_policy("least-outstanding"), seed=0)
    assert reasons["hold"] == 0
    assert [(r.replica_id, r.first_token_s) for r in plain] == [(r.replica_id, r.first_token_s) for r in late]


def test_compare_adds_late_rows_against_the_best_per_request_heuristic():
    from routewise_vllm.simulator.experiments import compare

    doc = compare(["bursty-code"], ["least-outstanding", "expected-wait", "learned"], [0], progress=False, late_binding=True)
    rows = {r["policy"]: r for r in doc["results"]}
    assert set(rows) == {"least-outstanding", "expected-wait", "learned",
                         "least-outstanding+late", "expected-wait+late", "learned+late"}  # the learned policy too
    assert rows["learned+late"]["metrics"]["held_share"] > 0
    from routewise_vllm.simulator.experiments import format_table

    lines = {line.split()[1]: line for line in format_table(doc).splitlines()[2:]}
    assert "held / timed out" in format_table(doc).splitlines()[0]
    assert lines["learned"].rstrip().endswith("-") and lines["learned+late"].rstrip().endswith("%")
    # Pinned (seed 0 is deterministic; recompute them when the simulator's behaviour is meant to change, as the
    # determinism golden says): the best per-request heuristic is least-outstanding at 5.538 s, and every ratio is
    # against it, the `+late` rows' too, never against a faster late row (expected-wait+late, 5.119 s)
    p99 = {"least-outstanding": 5.538105904759467, "expected-wait": 6.52043371364892, "learned": 6.232825522279359,
           "expected-wait+late": 5.119415421176877, "learned+late": 5.154437952416761}
    assert {p: rows[p]["ttft_p99_s"] for p in p99} == pytest.approx(p99, rel=1e-9)
    ratios = {p: rows[p]["ttft_p99_vs_best_heuristic"] for p in p99}
    assert ratios == pytest.approx({"least-outstanding": 1.0, "expected-wait": 1.1773761328842118,
                                    "learned": 1.1254435414322517, "expected-wait+late": 0.9243982526186858,
                                    "learned+late": 0.930722171272857}, rel=1e-9)
    late = rows["expected-wait+late"]
    assert late["metrics"]["held_share"] > 0  # bursty-code saturates its replicas: late binding holds


def timed(floors: tuple[float | None, ...], awaiting: tuple[int, ...], healthy: tuple[bool, ...] | None = None) -> ClusterView:
    healthy = healthy or (True,) * len(floors)
    return ClusterView(tuple(
        ReplicaSnapshot(f"r{i}", h, 1, a, awaiting_prompt_tokens=a, tpot_floor_s=t)
        for i, (t, a, h) in enumerate(zip(floors, awaiting, healthy))
    ))


def test_speed_scales_are_floored_ratios_of_tpot_floors_to_the_slowest_healthy_replica():
    assert speed_scales(timed((0.010, 0.012, 0.011), (0, 0, 0)), 16) == [1, 1, 1]  # uniform, noisy: unchanged
    assert speed_scales(timed((0.010, 0.070, 0.035), (0, 0, 0)), 16) == [7, 1, 2]
    assert speed_scales(timed((0.010, None), (0, 0)), 16) == [1, 1]  # one measured replica is its own slowest
    assert speed_scales(timed((None, None), (0, 0)), 16) == [1, 1]
    assert speed_scales(timed((0.001, 0.070), (0, 0)), 16) == [16, 1]  # capped
    assert speed_scales(timed((0.010, 0.070), (0, 0)), LateBindingConfig().max_speed_scale) == [2, 1]
    # an unhealthy replica's speed is no yardstick
    assert speed_scales(timed((0.010, 0.070), (0, 0), healthy=(True, False)), 16) == [1, 1]


def test_room_in_time_lets_a_fast_replica_take_more_awaiting_prefill_than_a_slow_one():
    limit = ReplicaLimit(max_outstanding=100, max_prefill_tokens=8192)
    v = timed((0.010, 0.070), (12_000, 9_000))  # both above the token limit; the fast one 7x faster, scaled by 2
    assert decide(v, [limit] * 2, 0, False, 0.0, LateBindingConfig()).candidates == (0,)
    assert decide(v, [limit] * 2, 0, False, 0.0, LateBindingConfig(room_in_time=False)).reason == "hold"
    v = timed((0.010, 0.070), (17_000, 9_000))  # beyond 2 x 8192
    assert decide(v, [limit] * 2, 0, False, 0.0, LateBindingConfig()).reason == "hold"
    v = timed((0.010, 0.070), (30_000, 9_000))  # a higher cap lets it go further
    assert decide(v, [limit] * 2, 0, False, 0.0, LateBindingConfig(max_speed_scale=7)).candidates == (0,)
    assert decide(v, [limit] * 2, 0, False, 0.0, LateBindingConfig()).reason == "hold"


def test_room_in_time_only_adds_replicas_under_their_request_limit_and_equals_tokens_on_a_uniform_fleet():
    import numpy as np

    rng = np.random.default_rng(0)
    limit = ReplicaLimit(max_outstanding=4, max_prefill_tokens=1000)
    widened = 0
    for _ in range(3000):
        n = int(rng.integers(1, 6))
        uniform = rng.random() < 0.3
        v = ClusterView(tuple(
            ReplicaSnapshot(f"r{i}", bool(rng.random() < 0.9), int(rng.integers(1, 6)), 0,
                            awaiting_prompt_tokens=int(rng.integers(0, 3000)),
                            tpot_floor_s=None if rng.random() < 0.1 else (0.01 if uniform else float(rng.uniform(0.005, 0.08))))
            for i in range(n)
        ))
        tokens = decide(v, [limit] * n, 0, False, 0.0, LateBindingConfig(room_in_time=False))
        time_ = decide(v, [limit] * n, 0, False, 0.0, LateBindingConfig())
        assert set(tokens.candidates) <= set(time_.candidates)
        assert all(v.replicas[i].healthy and v.replicas[i].outstanding < 4 for i in time_.candidates)
        if uniform:
            assert time_ == tokens
        widened += len(time_.candidates) > len(tokens.candidates)
    assert widened > 50  # the cases where speed opened room do occur
