"""ClusterSim.hold(): a router-side FIFO queue; held requests come back as decisions at first tokens and completions."""

from __future__ import annotations

import math

import pytest

from routewise_vllm.simulator.cluster import ClusterSim
from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup
from routewise_vllm.simulator.types import SimRequest


def one_slot_cluster() -> ClusterConfig:
    return ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=2, max_num_seqs=1)])


def burst(n: int) -> list[SimRequest]:
    return [SimRequest(i, 0.001 * i, 500, 50) for i in range(n)]  # all arrive within n ms


def route_with_a_queue(sim: ClusterSim) -> list[int]:
    """Hold while every replica has a request in flight (router-side counts); returns the dispatch order."""
    order = []
    while (d := sim.next_decision()) is not None:
        view, info = d
        free = [i for i, r in enumerate(view.replicas) if r.outstanding == 0]
        if not free:
            sim.hold()
            continue
        order.append(int(info.request_id))
        sim.dispatch(free[0])
    return order


def test_held_requests_are_routed_first_in_first_out_and_all_complete():
    sim = ClusterSim(one_slot_cluster(), burst(8), seed=0)
    order = route_with_a_queue(sim)
    records = sim.finish()
    assert order == list(range(8))  # FIFO: the queue's head goes first, new arrivals queue behind
    assert sim.n_holds >= 6 and sim.held == 0
    assert all(math.isfinite(r.finish_s) for r in records)
    # holding time counts in TTFT: the last request waited for three rounds of service on both replicas
    service = records[0].e2e_s
    assert records[7].ttft_s > 3 * service
    ttfts = [r.ttft_s for r in records]
    assert ttfts[2] > ttfts[0] and ttfts[4] > ttfts[2] and ttfts[6] > ttfts[4]


def test_without_holds_the_same_requests_queue_inside_the_replicas():
    sim = ClusterSim(one_slot_cluster(), burst(8), seed=0)
    while (d := sim.next_decision()) is not None:
        sim.dispatch(int(d[1].request_id) % 2)
    records = sim.finish()
    assert sim.n_holds == 0
    assert all(math.isfinite(r.finish_s) for r in records)


def test_holding_with_nothing_in_flight_is_refused():
    sim = ClusterSim(one_slot_cluster(), burst(2), seed=0)
    assert sim.next_decision() is not None
    with pytest.raises(RuntimeError, match="nothing in flight"):
        sim.hold()
