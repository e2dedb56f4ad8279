"""Simulated routers sharing their in-flight counts (ClusterConfig.shared_state_lag_s): at lag 0 each router's
view counts every router's requests, at a lag longer than the run only its own, in between some of both."""

from __future__ import annotations

import math

import pytest

from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.simulator.cluster import ClusterSim
from tests.simulator.test_cluster import config, workload


def _run(lag: float | None, routers: int = 2):
    """(decisions whose view counts exactly the router's own requests, those counting every router's, records,
    the simulation)."""
    sim = ClusterSim(config(count=3, routers=routers, shared_state_lag_s=lag), workload(n=300, rate=40.0), seed=3)
    policy = make_policy("least-outstanding", seed=0)
    own_only = everyone = 0
    while (d := sim.next_decision()) is not None:
        view, info = d
        mine = sim.routers[int(info.request_id) % routers]
        seen = [r.outstanding for r in view.replicas]
        own = [len(tr._inflight) for tr in mine.trackers]  # the requests it routed, in flight
        total = [sum(len(r.trackers[i]._inflight) for r in sim.routers) for i in range(3)]
        own_only += seen == own
        everyone += seen == total
        assert all(o <= s for o, s in zip(own, seen))  # its own count always, the others' on top
        sim.dispatch(policy.choose(view, info))
    records = sim.finish()
    assert all(math.isfinite(r.finish_s) for r in records) and len(records) == 300
    assert all(tr.outstanding == 0 for router in sim.routers for tr in router.trackers)
    return own_only, everyone


def test_at_lag_zero_every_view_counts_every_routers_requests():
    own_only, everyone = _run(0.0)
    assert everyone == 300
    assert own_only < 300


def test_without_sharing_and_at_a_lag_longer_than_the_run_each_router_sees_only_its_own():
    for lag in (None, 1e6):
        own_only, everyone = _run(lag)
        assert own_only == 300 and everyone < 300


def test_at_a_lag_between_the_views_are_neither_own_only_nor_always_exact():
    own_only, everyone = _run(0.2)
    assert 0 < everyone < 300 and own_only < 300


@pytest.mark.parametrize("routers", [1, 4])
def test_one_router_or_four_run_to_completion_with_a_lag(routers):
    _run(0.005, routers)
