"""LoRA adapters in the replica model (vLLM's max_loras rule, GPU slots, swap cost), in views, and LoRA affinity."""

from __future__ import annotations

import numpy as np
import pytest

from routewise_vllm.router.policy.baselines import LoraAffinity
from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.router.policy.types import ClusterView, LoraState, ReplicaSnapshot, RequestInfo
from routewise_vllm.simulator.cluster import ClusterSim, simulate
from routewise_vllm.simulator.config import ClusterConfig, LoraConfig, ReplicaGroup
from routewise_vllm.simulator.costmodel import load_profile
from routewise_vllm.simulator.metrics import summarize
from routewise_vllm.simulator.replica import COMPLETE, FIRST, ReqState, Replica
from routewise_vllm.simulator.scenario import load_scenario
from routewise_vllm.simulator.types import SimRequest

H100 = load_profile("llama3-8b-h100")


def lora_group(max_loras: int = 1, max_cpu_loras: int | None = None, load_s: float = 0.1, swap_s: float = 0.01,
               **kw) -> ReplicaGroup:
    lora = LoraConfig(adapters=["a", "b", "c"], max_loras=max_loras, max_cpu_loras=max_cpu_loras, load_s=load_s,
                      swap_s=swap_s)
    return ReplicaGroup(profile="llama3-8b-h100", models=["base"], lora=lora, **kw)


class Watched(Replica):
    """Records the distinct adapters running at each iteration."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.distinct: list[int] = []

    def _start_iteration(self, now: float) -> None:
        super()._start_iteration(now)
        self.distinct.append(len({st.lora for st in self.running if st.lora}))


def run(rep: Replica, reqs: list[SimRequest]) -> dict[int, ReqState]:
    """One replica alone; arrivals straight to it, events in time order."""
    states, pending, i, done = {}, sorted(reqs, key=lambda r: r.arrival_s), 0, 0
    while done < len(reqs):
        t = rep.event_s
        if i < len(pending) and (t is None or pending[i].arrival_s < t):
            r = pending[i]
            states[r.request_id] = st = ReqState(r, r.request_id, r.arrival_s)
            rep.add(st, r.arrival_s)
            i += 1
            continue
        rep.on_event(t)
        done += sum(1 for kind, _, _ in rep.take_outputs() if kind == COMPLETE)
    return states


def test_a_batch_never_holds_more_adapters_than_max_loras_and_those_behind_are_admitted():
    rep = Watched("r0", lora_group(max_loras=2), H100)
    # a, b take the two slots; c waits although the batch has room; the a and base requests behind c go in
    reqs = [SimRequest(0, 0.0, 200, 300, model="a"), SimRequest(1, 0.0, 200, 300, model="b"),
            SimRequest(2, 0.001, 200, 50, model="c"), SimRequest(3, 0.002, 200, 50, model="a"),
            SimRequest(4, 0.003, 200, 50, model="base")]
    states = run(rep, reqs)
    assert max(rep.distinct) == 2
    first = {k: st.first_token_s for k, st in states.items()}
    assert first[3] < first[2] and first[4] < first[2]  # skipped past, as vLLM's scheduler does
    assert first[2] >= min(states[0].finish_s, states[1].finish_s)  # c runs once a or b is done
    assert all(st.g == st.output for st in states.values())
    assert rep.lora_running == {}


def test_loading_an_adapter_stalls_the_iteration_by_its_load_and_swap_time():
    def ttft(first: str, second: str, **kw) -> float:
        rep = Replica("r0", lora_group(**kw), H100)
        states = run(rep, [SimRequest(0, 0.0, 500, 2, model=first), SimRequest(1, 10.0, 500, 2, model=second)])
        return states[1].first_token_s - 10.0

    base = ttft("base", "base")
    assert ttft("a", "a") == pytest.approx(base)  # still in its GPU slot: free
    assert ttft("a", "b", max_cpu_loras=2) == pytest.approx(base + 0.1 + 0.01)  # read from disk, copied to the GPU
    rep = Replica("r0", lora_group(max_loras=1, max_cpu_loras=2), H100)
    states = run(rep, [SimRequest(0, 0.0, 500, 2, model="a"), SimRequest(1, 5.0, 500, 2, model="b"),
                       SimRequest(2, 10.0, 500, 2, model="a")])
    assert states[2].first_token_s - 10.0 == pytest.approx(base + 0.01)  # a left the GPU slot, still in host memory
    assert (rep.n_lora_loads, rep.n_lora_swaps) == (2, 3)


def test_without_lora_the_replica_and_its_views_are_as_before():
    rep = Replica("r0", ReplicaGroup(profile="llama3-8b-h100", models=["a"]), H100)
    assert rep.lora_sample() is None and rep.lora_running is None
    config = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-h100", count=2)])
    sim = ClusterSim(config, [SimRequest(i, 0.5 * i, 100, 20) for i in range(20)], seed=0)
    while (d := sim.next_decision()) is not None:
        assert all(s.lora is None for s in d[0].replicas)
        sim.dispatch(0)


@pytest.mark.parametrize("max_loras", [1, 3])
def test_closed_form_jumps_match_one_iteration_at_a_time_with_adapters(max_loras):
    rng = np.random.default_rng(3)
    arr = np.cumsum(rng.exponential(1 / 40.0, 400))
    names = ["base", "a", "b", "c"]
    reqs = [SimRequest(i, float(arr[i]), int(rng.integers(20, 1500)), int(rng.integers(1, 300)),
                       model=names[int(rng.integers(4))]) for i in range(400)]
    config = ClusterConfig(replicas=[lora_group(max_loras=max_loras).model_copy(update={"count": 2})])
    out = {}
    for closed in (True, False):
        sim = ClusterSim(config, reqs, seed=1, closed_form=closed)
        policy = make_policy("least-outstanding", seed=2)
        while (d := sim.next_decision()) is not None:
            sim.dispatch(policy.choose(*d))
        out[closed] = (sim.finish(), sum(r.n_iterations for r in sim.replicas), sum(r.n_jumps for r in sim.replicas))
    assert out[True][2] > 20 and out[False][2] == 0 and out[True][1] == out[False][1]
    for a, b in zip(out[True][0], out[False][0]):
        assert a.first_token_s == pytest.approx(b.first_token_s, rel=1e-9, abs=1e-9)
        assert a.finish_s == pytest.approx(b.finish_s, rel=1e-9, abs=1e-9)


def test_scrapes_carry_the_adapters_running_and_waiting_into_the_view():
    config = ClusterConfig(replicas=[lora_group(max_loras=1)])
    reqs = [SimRequest(0, 0.0, 100, 2000, model="a"), SimRequest(1, 0.01, 100, 20, model="b"),
            SimRequest(2, 5.0, 100, 20, model="base")]
    sim = ClusterSim(config, reqs, seed=0)
    views = []
    while (d := sim.next_decision()) is not None:
        views.append(d[0].replicas[0].lora)
        sim.dispatch(0)
    assert views[2] == LoraState(running=("a",), waiting=("b",), max_loras=1)


def snap(i: int, outstanding: int, lora: LoraState | None) -> ReplicaSnapshot:
    return ReplicaSnapshot(f"r{i}", True, outstanding, 0, lora=lora)


def test_affinity_prefers_the_replica_with_the_adapter_then_one_with_room_then_the_least_loaded():
    full = LoraState(("x", "y"), (), 2)
    has_a = LoraState(("a", "y"), (), 2)
    room = LoraState(("y",), (), 2)
    p = LoraAffinity(seed=0)
    view = ClusterView((snap(0, 1, full), snap(1, 5, has_a), snap(2, 3, room)))
    assert p.choose(view, RequestInfo("q", 10, model="a")) == 1  # has it, though busier
    assert p.choose(view, RequestInfo("q", 10, model="base")) == 0  # a base model: least loaded
    view = ClusterView((snap(0, 1, full), snap(1, 5, room), snap(2, 3, full)))
    assert p.choose(view, RequestInfo("q", 10, model="a")) == 1  # nobody has it now: a free slot
    view = ClusterView((snap(0, 1, full), snap(1, 12, has_a), snap(2, 3, room)))
    assert p.choose(view, RequestInfo("q", 10, model="a")) == 0  # too busy (12 > 1 + 8 and > 1.5 x 1)
    p.reset(0)
    view = ClusterView((snap(0, 1, full), snap(1, 5, room)))
    assert p.choose(view, RequestInfo("q", 10, model="a")) == 0  # never seen as an adapter: least loaded


def test_affinity_beats_least_outstanding_p99_ttft_on_the_adapter_scenario():
    sc = load_scenario("models-lora", split="eval")
    cluster, reqs = sc.build(np.random.default_rng(0))
    p99 = {}
    for name in ("least-outstanding", "lora-affinity"):
        records = simulate(cluster, reqs[:2500], make_policy(name, seed=0), seed=0)
        p99[name] = summarize(records, sc.slo)["ttft_p99_s"]
    assert p99["lora-affinity"] < 0.5 * p99["least-outstanding"], p99
