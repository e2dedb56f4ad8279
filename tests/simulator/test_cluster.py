"""ClusterSim: what the router sees, scrapes, crashes, determinism."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from routewise_vllm.router.policy.estimate import id_prefix_blocks
from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.simulator.cluster import ClusterSim, simulate
from routewise_vllm.simulator.config import ClusterConfig, FaultConfig, ReplicaGroup, ScrapeConfig
from routewise_vllm.simulator.types import SimRequest


def workload(n: int = 400, rate: float = 20.0, seed: int = 0, prefix: bool = False) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1.0 / rate, n))
    return [
        SimRequest(
            i, float(arr[i]), int(rng.integers(50, 2000)), int(rng.integers(1, 300)),
            block_ids=(int(rng.integers(4)), 1000 + i) if prefix else (), max_tokens=300,
        )
        for i in range(n)
    ]  # fmt: skip


def config(count: int = 3, **kw) -> ClusterConfig:
    return ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=count)], **kw)


def run_views(sim: ClusterSim, policy_name: str = "least-outstanding"):
    """Route everything; yields (now, view, info) per decision."""
    policy = make_policy(policy_name, seed=0)
    out = []
    while (d := sim.next_decision()) is not None:
        view, info = d
        out.append((sim.now_s, view, info))
        sim.dispatch(policy.choose(view, info))
    return out


def test_router_view_changes_only_at_scrapes():
    sim = ClusterSim(config(scrape=ScrapeConfig(interval_s=0.5, jitter_s=0.05)), workload(), seed=1)
    decisions = run_views(sim)
    changed = 0
    for (t0, v0, _), (t1, v1, _) in zip(decisions, decisions[1:]):
        for a, b in zip(v0.replicas, v1.replicas):
            same_scrape = math.isclose(t1 - b.stats_age_s, t0 - a.stats_age_s, abs_tol=1e-9)
            if same_scrape:
                assert (a.waiting, a.running, a.kv_cache_usage) == (b.waiting, b.running, b.kv_cache_usage)
                assert b.stats_age_s >= a.stats_age_s
            elif (a.waiting, a.running, a.kv_cache_usage) != (b.waiting, b.running, b.kv_cache_usage):
                changed += 1
    assert changed > 10  # scrapes do bring new values
    # the router-side count is instant: it changes between scrapes
    assert len({v.replicas[0].outstanding for _, v, _ in decisions}) > 3
    cap = decisions[-1][1].replicas[0].kv_capacity_tokens
    assert cap == sim.replicas[0].num_blocks * sim.replicas[0].bs


def test_failed_scrapes_keep_old_values_and_age_grows():
    ok = ClusterSim(config(scrape=ScrapeConfig(interval_s=0.5, jitter_s=0.0)), workload(seed=2), seed=3)
    flaky = ClusterSim(config(scrape=ScrapeConfig(interval_s=0.5, jitter_s=0.0, failure_prob=0.7)), workload(seed=2), seed=3)
    ages_ok = [r.stats_age_s for _, v, _ in run_views(ok) for r in v.replicas if math.isfinite(r.stats_age_s)]
    ages_flaky = [r.stats_age_s for _, v, _ in run_views(flaky) for r in v.replicas if math.isfinite(r.stats_age_s)]
    assert max(ages_ok) <= 0.5 + 1e-9
    assert max(ages_flaky) > 1.5  # several failures in a row: old values, growing age
    assert np.mean(ages_flaky) > 1.5 * np.mean(ages_ok)


def test_scrape_lag_reports_older_state():
    reqs = workload(n=300, rate=25.0, seed=4)
    lagged = ClusterSim(config(scrape=ScrapeConfig(interval_s=0.5, jitter_s=0.0, lag_s=0.3)), reqs, seed=5)
    seen = []
    orig = lagged._on_sample

    def spy(i, t, scrape_t):
        seen.append(scrape_t - t)
        orig(i, t, scrape_t)

    lagged._on_sample = spy  # type: ignore[method-assign]
    run_views(lagged)
    assert seen and all(d == pytest.approx(0.3) for d in seen[len(lagged.replicas) :])


def test_crash_redispatches_inflight_requests_and_loses_none():
    faults = [FaultConfig(kind="crash", replica=0, at_s=5.0)]
    reqs = workload(n=400, rate=20.0, seed=6)
    sim = ClusterSim(config(faults=faults, health_check_delay_s=2.0), reqs, seed=7)
    decisions = run_views(sim)
    records = sim.finish()
    assert len(records) == len(reqs)
    assert all(math.isfinite(r.finish_s) and math.isfinite(r.first_token_s) for r in records)
    assert sim.n_dispatches > len(reqs)  # some requests were routed twice
    # the router notices the crash only after the health-check delay
    for t, view, _ in decisions:
        assert view.replicas[0].healthy == (t < 7.0)
    # nothing finishes on the dead replica after the crash
    assert all(r.finish_s < 5.0 for r in records if r.replica_id == sim.replica_ids[0])
    assert sim.tracker.trackers[0].outstanding == 0


def test_crash_with_recovery_brings_the_replica_back():
    faults = [FaultConfig(kind="crash", replica=1, at_s=3.0, duration_s=4.0)]
    records = simulate(config(faults=faults, health_check_delay_s=1.0), workload(n=400, seed=8), make_policy("round-robin"), seed=1)
    late_on_r1 = [r for r in records if r.replica_id.startswith("r1-") and r.arrival_s > 7.5]
    assert late_on_r1  # routed to again after recovery
    assert all(math.isfinite(r.finish_s) for r in records)


def test_slowdown_fault_slows_the_replica():
    reqs = workload(n=150, rate=3.0, seed=9)
    base = simulate(config(count=1), reqs, make_policy("round-robin"), seed=0)
    slow_cfg = config(count=1, faults=[FaultConfig(kind="slowdown", replica=0, at_s=5.0, duration_s=30.0, factor=3.0)])
    slow = simulate(slow_cfg, reqs, make_policy("round-robin"), seed=0)
    window = lambda recs: np.mean([r.tpot_s for r in recs if 6 < r.arrival_s < 30 and r.output_tokens > 1])  # noqa: E731
    after = lambda recs: [r.finish_s for r in recs if r.arrival_s < 4.0]  # noqa: E731
    assert window(slow) > 2.5 * window(base)
    # requests finished before the slow-down are untouched
    early = [(a, b) for a, b in zip(base, slow) if b.finish_s < 5.0]
    assert early and all(a.finish_s == b.finish_s for a, b in early)
    assert len(after(base)) == len(after(slow))


def test_same_seed_same_records_and_router_inputs():
    reqs = workload(n=300, seed=10, prefix=True)
    cfg = config(scrape=ScrapeConfig(failure_prob=0.2), estimator_sigma=0.3)
    a = [dataclasses.astuple(r) for r in simulate(cfg, reqs, make_policy("power-of-two"), seed=11)]
    b = [dataclasses.astuple(r) for r in simulate(cfg, reqs, make_policy("power-of-two"), seed=11)]
    c = [dataclasses.astuple(r) for r in simulate(cfg, reqs, make_policy("power-of-two"), seed=12)]
    assert a == b
    assert a != c


def test_request_info_uses_the_shared_estimator_and_prefix_hashes():
    reqs = workload(n=50, seed=12, prefix=True)
    sim = ClusterSim(config(estimator_sigma=0.0), reqs, seed=0)
    for _, _, info in run_views(sim):
        req = reqs[int(info.request_id)]
        assert info.prompt_tokens_est == req.prompt_tokens
        assert info.prefix_blocks == id_prefix_blocks(req.block_ids)
        assert info.max_tokens == req.max_tokens
    noisy = ClusterSim(config(estimator_sigma=0.3), reqs, seed=0)
    ests = [(info.prompt_tokens_est, reqs[int(info.request_id)].prompt_tokens) for _, _, info in run_views(noisy)]
    assert any(e != t for e, t in ests)


def test_dispatch_to_unhealthy_replica_is_refused():
    faults = [FaultConfig(kind="crash", replica=0, at_s=0.5)]
    sim = ClusterSim(config(faults=faults, health_check_delay_s=0.1), workload(n=100, seed=13), seed=0)
    while (d := sim.next_decision()) is not None:
        view, _ = d
        if not view.replicas[0].healthy:
            with pytest.raises(ValueError, match="unhealthy"):
                sim.dispatch(0)
            return
        sim.dispatch(0)
    pytest.fail("the crash was never noticed")


def test_reward_integrals_follow_littles_law():
    sim = ClusterSim(config(), workload(n=300, rate=30.0, seed=14), seed=0)
    run_views(sim)
    records = sim.finish()
    total_ttft = sum(r.ttft_s for r in records)
    assert sim.first_token_wait_integral() == pytest.approx(total_ttft, rel=1e-9)
    assert sim.waiting_for_first_token() == 0
    slo = 0.2
    assert sim.slo_excess_integral(slo) == pytest.approx(sum(max(0.0, r.ttft_s - slo) for r in records), rel=1e-9)


def test_several_routers_each_see_only_their_own_requests_but_share_scrapes():
    cfg = config(count=3, routers=2, scrape=ScrapeConfig(interval_s=0.2, jitter_s=0.0))
    sim = ClusterSim(cfg, workload(n=300, rate=40.0), seed=3)
    policy = make_policy("least-outstanding", seed=0)
    own_counts_differ = 0
    while (d := sim.next_decision()) is not None:
        view, info = d
        idx = int(info.request_id)
        mine, other = sim.routers[idx % 2], sim.routers[(idx + 1) % 2]
        assert [r.outstanding for r in view.replicas] == [tr.outstanding for tr in mine.trackers]
        if [tr.outstanding for tr in mine.trackers] != [tr.outstanding for tr in other.trackers]:
            own_counts_differ += 1
        assert [tr.waiting for tr in mine.trackers] == [tr.waiting for tr in other.trackers]  # the same scrapes
        sim.dispatch(policy.choose(view, info))
    records = sim.finish()
    assert own_counts_differ > 50
    assert all(math.isfinite(r.finish_s) for r in records)
    assert all(tr.outstanding == 0 for router in sim.routers for tr in router.trackers)
    assert sum(1 for r in records) == 300


def test_one_router_is_the_default_and_unchanged():
    sim = ClusterSim(config(count=2), workload(n=50), seed=0)
    assert len(sim.routers) == 1 and sim.tracker is sim.routers[0]
