"""Admission like vLLM's server: prompts at or over max_model_len are refused (HTTP 400), outputs that
would cross it stop at it. Before, such a request made Replica.add raise and killed the run."""

from __future__ import annotations

import math

import numpy as np

from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.router.policy.types import Outcome
from routewise_vllm.simulator.cluster import REJECTED_PROMPT_TOO_LONG, ClusterSim, simulate
from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup
from routewise_vllm.simulator.costmodel import load_profile
from routewise_vllm.simulator.gym_env import RoutingEnv
from routewise_vllm.simulator.metrics import Slo, summarize
from routewise_vllm.simulator.types import SimRequest

A100 = "llama3-8b-a100"


def config(profile: str = A100, count: int = 2, **group) -> ClusterConfig:
    return ClusterConfig(replicas=[ReplicaGroup(profile=profile, count=count, **group)])


def small_requests(n: int, start_id: int = 0, t0: float = 0.0) -> list[SimRequest]:
    rng = np.random.default_rng(start_id)
    return [SimRequest(start_id + i, t0 + 0.05 * i, int(rng.integers(100, 1500)), int(rng.integers(5, 200))) for i in range(n)]


def test_prompt_at_or_over_max_model_len_is_rejected_not_crashing():
    limit = load_profile(A100).max_model_len
    reqs = small_requests(40) + [
        SimRequest(100, 0.51, limit, 10),  # prompt == limit: no room for one output token
        SimRequest(101, 0.52, limit + 3000, 50),
    ]
    sim = ClusterSim(config(), reqs, seed=0)
    outcomes: list[tuple[str, Outcome]] = []
    sim.on_complete_hook = lambda rid, info, outcome: outcomes.append((info.request_id, outcome))
    policy = make_policy("least-outstanding", seed=0)
    while (d := sim.next_decision()) is not None:
        sim.dispatch(policy.choose(*d))
    records = {r.request_id: r for r in sim.finish()}

    for rid in (100, 101):
        rec = records[rid]
        assert rec.error == REJECTED_PROMPT_TOO_LONG
        assert math.isnan(rec.first_token_s) and math.isnan(rec.finish_s)
        assert rec.replica_id  # it was routed; the replica refused it
    served = [r for r in records.values() if r.request_id < 100]
    assert all(r.error == "" and math.isfinite(r.finish_s) for r in served)
    # the router released the refused requests: nothing stays outstanding
    assert all(t.outstanding == 0 and t.outstanding_prompt_tokens == 0 for t in sim.tracker.trackers)
    failed = {rid: o for rid, o in outcomes if not o.ok}
    assert set(failed) == {"100", "101"} and all(o.ttft_s is None and o.output_tokens == 0 for o in failed.values())
    assert sum(o.ok for _, o in outcomes) == len(served)
    # reward integral: a refused request stops waiting for a first token when it is refused
    assert sim.waiting_for_first_token() == 0

    # metrics: out of the latency percentiles, a miss in goodput
    summary = summarize(list(records.values()), Slo(ttft_s=100.0, tpot_s=100.0))
    assert summary["unfinished"] == 2.0
    assert summary["goodput"] == len(served) / len(records)
    assert math.isfinite(summary["ttft_p99_s"])


def test_output_crossing_max_model_len_stops_at_the_limit():
    limit = load_profile(A100).max_model_len
    long_prompt = limit - 100
    reqs = [SimRequest(0, 0.0, long_prompt, 900), SimRequest(1, 0.0, 500, 900)]
    records = simulate(config(count=1), reqs, make_policy("round-robin"), seed=0)
    cut, whole = records
    assert cut.error == "" and cut.output_tokens == 100 and cut.prompt_tokens + cut.output_tokens == limit
    assert whole.output_tokens == 900
    # the cut request ends well before the one generating 900 tokens next to it
    assert cut.finish_s < whole.finish_s
    assert cut.tpot_s > 0


def test_kv_cache_smaller_than_max_model_len_lowers_the_limit():
    profile = load_profile("llama3-8b-l4")
    # the smallest memory share that still leaves some KV cache: capacity well under max_model_len
    util = next(u / 1000 for u in range(1, 1000) if _capacity(profile, u / 1000) >= 2048)
    capacity = _capacity(profile, util)
    assert capacity < profile.max_model_len
    reqs = [
        SimRequest(0, 0.0, capacity + 10, 5),  # fits max_model_len but not the KV cache: refused
        SimRequest(1, 0.1, capacity - 50, 400),  # output cut at the KV capacity
        SimRequest(2, 0.2, 300, 20),
    ]
    records = simulate(config("llama3-8b-l4", count=1, gpu_memory_utilization=util), reqs, make_policy("round-robin"), seed=0)
    assert records[0].error == REJECTED_PROMPT_TOO_LONG
    assert records[1].error == "" and records[1].prompt_tokens + records[1].output_tokens == capacity
    assert records[2].error == "" and records[2].output_tokens == 20


def _capacity(profile, util: float) -> int:
    try:
        return profile.num_kv_blocks(16, util) * 16
    except ValueError:  # no KV cache at all at this share
        return 0


def test_env_episode_with_a_refused_request_runs_to_the_end():
    limit = load_profile(A100).max_model_len

    def factory(rng: np.random.Generator):
        reqs = small_requests(30)
        reqs.insert(10, SimRequest(500, reqs[10].arrival_s, limit + 1, 20))
        return config(), reqs

    env = RoutingEnv(factory, max_replicas=4)
    obs, info = env.reset(seed=0)
    done, rewards = False, []
    while not done:
        obs, reward, done, _, info = env.step(int(np.flatnonzero(info["action_mask"])[0]))
        rewards.append(reward)
    assert np.all(np.isfinite(rewards))
    errors = {r.request_id: r.error for r in info["episode_records"]}
    assert errors[500] == REJECTED_PROMPT_TOO_LONG and sum(bool(e) for e in errors.values()) == 1
    assert np.isnan(info["episode_ttft"]).sum() == 1
