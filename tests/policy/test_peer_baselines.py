"""The peers' algorithms (router/policy/peers), each held to a case computed by hand from its source."""

from __future__ import annotations

import json
import math

import pytest

from routewise_vllm.router.policy import ClusterView, ReplicaSnapshot, RequestInfo, make_policy
from routewise_vllm.router.policy.peers import DynamoKv, LlmD, LlmDBlend
from routewise_vllm.router.policy.registry import COMPARED_BASELINES, PEER_BASELINES, check_policy_name
from routewise_vllm.router.policy.served import served_policy

PEERS = ("llm-d", "llm-d-blend", "dynamo-kv")
BLOCKS = tuple(range(1, 11))  # 10 prefix blocks
REQ = RequestInfo("q", 1000, 64, BLOCKS)


def snap(i: int, match: int = 0, awaiting: int = 0, awaiting_n: int = 0, outstanding: int = 0, prompt_total: int = 0,
         **kw) -> ReplicaSnapshot:
    return ReplicaSnapshot(f"r{i}", True, outstanding, prompt_total, prefix_match_blocks=match,
                           awaiting_first_token=awaiting_n, awaiting_prompt_tokens=awaiting, **kw)


# ---------------------------------------------------------------- llm-d: sticky until saturated


def test_llmd_narrows_to_sticky_replicas_then_picks_the_least_token_load():
    # affinity = match / 10: r0 0.9 and r1 0.8 are sticky (>= 0.8), r2 0.0 is not.
    # gate: best sticky TTFT = 3000 tok / 15928 tok/s = 188 ms, best non-sticky 0 ms: 188 ms <= 18000 ms, stay sticky.
    # token load = in flight + this request's uncached tokens: r0 3000 + 1000 x 0.1 = 3100, r1 5000 + 200 = 5200
    # (r2, filtered out, would have 0 + 1000 = 1000, the highest score); score = 1 - load / 4194304, highest wins: r0.
    view = ClusterView((snap(0, 9, 3000, 1), snap(1, 8, 5000, 1), snap(2, 0)))
    assert LlmD(seed=0).choose(view, REQ) == 0
    assert LlmD(seed=0, affinity_threshold=0.0).choose(view, REQ) == 2  # no filter: the lightest load


@pytest.mark.parametrize("in_flight, expected", [(286_000, 0), (300_000, 1)])
def test_llmd_breaks_stickiness_past_its_saturation_limit(in_flight, expected):
    # r0 holds the whole prefix, r1 nothing. Gate: 286,000 / 15928 x 1000 = 17,956 ms <= 18,000: stay on r0;
    # 300,000 / 15928 x 1000 = 18,835 ms > 18,000: every replica passes, and r1's load 0 + 1000 beats r0's 300,000.
    view = ClusterView((snap(0, 10, in_flight, 40), snap(1, 0)))
    assert LlmD(seed=0).choose(view, REQ) == expected


def test_llmd_counts_only_the_uncached_part_of_requests_in_prefill():
    pol = LlmD(seed=0)
    # the first request goes to r0 (sticky, 0.9): 100 of its 1000 prompt tokens are uncached there
    assert pol.choose(ClusterView((snap(0, 9), snap(1, 0))), REQ) == 0
    # next, a request without prefix blocks (no filter). r0 has that request in prefill (1000 prompt tokens, 100
    # uncached): load 100 + 300 = 400; r1 has 500 prompt tokens of a request this policy did not send: 500 + 300.
    # Counting whole prompts, as the snapshot does, r1 (800) would beat r0 (1300).
    view = ClusterView((snap(0, 0, 1000, 1), snap(1, 0, 500, 1)))
    assert pol.ledger.uncached_in_prefill(view.replicas[0]) == pytest.approx(100.0)
    assert pol.choose(view, RequestInfo("q2", 300, 64)) == 0
    # once r0 has sent its first token (awaiting 0), nothing of it is counted; on completion it is forgotten
    pol.ledger.sync(snap(0, 0, 0, 0))
    assert pol.ledger.uncached_in_prefill(snap(0, 0, 0, 0)) == 0.0
    pol.on_complete("r0", REQ, None)
    pol.reset(0)
    assert pol.ledger.uncached_in_prefill(snap(0, 0, 700, 1)) == 700.0  # no record: the whole prompt


# ---------------------------------------------------------------- llm-d's legacy blend


def test_llmd_blend_weighs_prefix_queue_kv_and_lru_as_shipped():
    # 4-block request; warm (a replica has a match), so no-hit-lru gives 0.5 everywhere (x2 = 1.0).
    # prefix x3: r0 4/4 -> 3.0, r1 0 -> 0.0, r2 2/4 -> 1.5
    # queue x2 (waiting 6, 0, 2; max 6, min 0): r0 0 -> 0.0, r1 1 -> 2.0, r2 4/6 -> 1.333
    # kv x2 (usage 0.9, 0.2, 0.5): r0 0.2, r1 1.6, r2 1.0
    # totals: r0 4.2, r1 4.6, r2 4.833: r2 wins.
    req = RequestInfo("q", 400, 64, (1, 2, 3, 4))
    view = ClusterView((snap(0, 4, waiting=6, running=1, kv_cache_usage=0.9), snap(1, 0, waiting=0, running=1,
                        kv_cache_usage=0.2), snap(2, 2, waiting=2, running=1, kv_cache_usage=0.5)))
    assert LlmDBlend(seed=0).choose(view, req) == 2


def test_llmd_blend_spreads_cold_requests_least_recently_used_first():
    # cold (no match anywhere), all else equal: never-used replicas score 1 - k / (n - 1) in order (1, 0.5, 0),
    # used ones rank after them by LRU position; each pick becomes the most recent: r0, r1, r2, r0, ...
    pol = LlmDBlend(seed=0)
    view = ClusterView(tuple(snap(i, waiting=0, running=0, kv_cache_usage=0.0) for i in range(3)))
    cold = RequestInfo("c", 400, 64, (7, 8))
    assert [pol.choose(view, cold) for _ in range(4)] == [0, 1, 2, 0]
    # second pick's scores: r1 1 - 0/2 = 1.0, r2 1 - 1/2 = 0.5, r0 (used, rank 2 + 0) 0.0
    pol.reset(0)
    pol.choose(view, cold)
    assert pol.lru_scores(view, [0, 1, 2]) == [0.0, 1.0, 0.5]


# ---------------------------------------------------------------- Dynamo's KV router


def test_dynamo_takes_the_lowest_prefill_plus_decode_cost():
    # cost (tokens) = active prefill + prompt - cached + active decode + new decode; prompt 1000, no ledger yet
    # r0: cached 1000; 2000 + 1000 - 1000 = 2000 prefill; 6000 + 1000 decode -> 9000
    # r1: cached 0; 0 + 1000 = 1000; 3000 + 1000 -> 5000
    # r2: cached 500; 1000 + 1000 - 500 = 1500; 2000 + 1000 -> 4500: r2 wins
    view = ClusterView((snap(0, 10, 2000, 2, 6, 6000), snap(1, 0, 0, 0, 3, 3000), snap(2, 5, 1000, 1, 2, 2000)))
    pol = DynamoKv(seed=0)
    assert pol.costs(view, REQ, [0, 1, 2]) == pytest.approx([9000.0, 5000.0, 4500.0])
    assert pol.choose(view, REQ) == 2


def test_dynamo_counts_blocks_shared_by_active_requests_once():
    pol = DynamoKv(seed=0)
    for rid in ("a", "b"):  # what choose records when it sends them to r0
        pol.ledger.record("r0", RequestInfo(rid, 1000, 64, BLOCKS), 1000.0)
    # r0: two in-flight requests, 2000 prompt tokens of the same 10 blocks: 1000 distinct tokens; both past prefill.
    # A third with the same blocks adds no new decode blocks: cost = 0 + 1000 - 1000 (cached) + 1000 + 0 = 1000.
    # r1, empty and cold: 1000 + 0 + 1000 = 2000.
    view = ClusterView((snap(0, 10, 0, 0, 2, 2000), snap(1, 0)))
    assert pol.costs(view, REQ, [0, 1]) == pytest.approx([1000.0, 2000.0])


def test_dynamo_samples_by_softmax_above_zero_temperature():
    # costs 0 and 10 at T = 1: p(r0) = 1 / (1 + e^-1) = 0.731 (costs scaled by their range, as Dynamo's softmax)
    pol = DynamoKv(seed=3, router_temperature=1.0)
    picks = [pol.sample([0.0, 10.0], [0, 1]) for _ in range(4000)]
    assert picks.count(0) / 4000 == pytest.approx(1 / (1 + math.exp(-1)), abs=0.03)
    assert pol.sample([5.0, 5.0], [0, 1]) in (0, 1)


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="affinity_threshold"):
        LlmD(affinity_threshold=1.5)
    with pytest.raises(ValueError, match="router_temperature"):
        DynamoKv(router_temperature=-1)
    with pytest.raises(ValueError, match="lru_size"):
        LlmDBlend(lru_size=0)


# ---------------------------------------------------------------- registry, live and simulated


@pytest.mark.parametrize("name", PEERS)
def test_peers_are_constructible_as_the_router_serves_them(name):
    assert check_policy_name(name, "policy") == name
    assert make_policy(name, seed=0).name == name
    served = served_policy(name, seed=0)
    view = ClusterView((snap(0, 10, 100, 1), snap(1, 0)))
    assert served.decide(view, REQ).index in (0, 1)


def test_peers_are_compared_with_but_not_trained_against():
    assert PEER_BASELINES == PEERS
    assert not set(PEERS) & set(COMPARED_BASELINES)


def test_peers_run_in_simulator_compare(tmp_path, capsys):
    from routewise_vllm.simulator.cli import main

    scenario = tmp_path / "tenants.yaml"
    scenario.write_text(
        "name: tenants\ndescription: tenants with system prompts\nworkload:\n  kind: synthetic\n  n_requests: 300\n  rate_rps: 6.0\n"
        "  lengths: {dist: fixed, prompt: 512, output: 16}\n"
        "  prefix: {kind: groups, groups: 6, prefix_tokens: 2048, zipf_s: 1.0}\n"
        "cluster:\n  replicas:\n    - {profile: llama3-8b-h100, count: 3}\nslo: {ttft_s: 1.0, tpot_s: 0.1}\n")
    assert main(["compare", "--scenario", str(scenario), "--policies", ",".join(PEERS), "--seeds", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["policy"] for r in rows] == list(PEERS)
    for r in rows:
        assert r["metrics"]["requests"] == 300 and 0 < r["ttft_p99_s"] < 60
        assert r["metrics"]["prefix_hit_fraction"] > 0.5  # each keeps tenants on the replicas that hold their prompt
