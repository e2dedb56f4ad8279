"""The simulator against queueing theory, and the orderings of baselines that theory predicts."""

from __future__ import annotations

import numpy as np
import pytest

from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.simulator.bench import azure_conv_like_lengths
from routewise_vllm.simulator.cluster import simulate
from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup
from routewise_vllm.simulator.types import RequestRecord, SimRequest


def poisson(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, n))


def azure_like(n: int, rate: float, seed: int) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    prompt, output = azure_conv_like_lengths(n, rng)
    arr = poisson(n, rate, rng)
    return [SimRequest(i, float(arr[i]), int(prompt[i]), int(output[i])) for i in range(n)]


def ttft(records: list[RequestRecord]) -> np.ndarray:
    return np.array([r.ttft_s for r in records])


def test_single_sequence_replica_is_md1_and_matches_pollaczek_khinchine():
    config = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", max_num_seqs=1)])
    service = simulate(config, [SimRequest(0, 0.0, 200, 50)], make_policy("round-robin"))[0].finish_s
    rho = 0.5
    arr = poisson(20000, rho / service, np.random.default_rng(1))
    reqs = [SimRequest(i, float(a), 200, 50) for i, a in enumerate(arr)]
    records = simulate(config, reqs, make_policy("round-robin"), seed=0)
    # every request's service time is the same deterministic S ...
    services = np.array([r.finish_s - r.arrival_s - r.queue_delay_s for r in records])
    assert np.allclose(services, service, rtol=1e-9)
    # ... and the mean wait is Pollaczek-Khinchine's for M/D/1
    wait = np.mean([r.queue_delay_s for r in records])
    assert wait == pytest.approx(rho * service / (2 * (1 - rho)), rel=0.03)


def test_load_aware_policies_beat_oblivious_ones_at_p99_ttft():
    config = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=4)])
    reqs = azure_like(3000, rate=0.9 * 4 * 7.5, seed=0)  # ~90% of 4 replicas' capacity (~7.5 req/s each)
    p99 = {p: np.percentile(ttft(simulate(config, reqs, make_policy(p), seed=0)), 99) for p in
           ("round-robin", "random", "least-outstanding", "power-of-two")}  # fmt: skip
    worst_aware = max(p99["least-outstanding"], p99["power-of-two"])
    best_oblivious = min(p99["round-robin"], p99["random"])
    assert worst_aware < 0.95 * best_oblivious, p99


def test_speed_aware_beats_least_outstanding_on_a_heterogeneous_cluster():
    config = ClusterConfig(
        replicas=[ReplicaGroup(profile="llama3-8b-h100", count=2), ReplicaGroup(profile="llama3-8b-a10g", count=2)]
    )
    reqs = azure_like(3000, rate=26.0, seed=1)
    lor = ttft(simulate(config, reqs, make_policy("least-outstanding"), seed=0))
    speed = ttft(simulate(config, reqs, make_policy("speed-aware"), seed=0))
    assert np.percentile(speed, 99) < 0.5 * np.percentile(lor, 99)
    assert speed.mean() < lor.mean()


def test_prefix_aware_beats_least_outstanding_on_shared_prefix_traffic():
    # 16 system prompts of 4096 tokens; each replica's cache holds ~40k tokens: all 16 prefixes
    # do not fit on every replica (LOR spreads them), a quarter of them do (prefix affinity)
    rng = np.random.default_rng(3)
    n = 1500
    arr = poisson(n, 6.0, rng)
    groups = rng.integers(16, size=n)
    reqs = [
        SimRequest(
            i, float(arr[i]), 4096 + 256, 64,
            block_ids=tuple(int(groups[i]) * 100 + j for j in range(8)) + (10_000 + i,), block_tokens=512,
        )
        for i in range(n)
    ]  # fmt: skip
    config = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=4, gpu_memory_utilization=0.273)])
    lor = simulate(config, reqs, make_policy("least-outstanding"), seed=0)
    pa = simulate(config, reqs, make_policy("prefix-aware"), seed=0)
    hit = lambda recs: np.mean([r.prefix_hit_tokens for r in recs])  # noqa: E731
    assert hit(pa) > 1.5 * hit(lor)
    assert ttft(pa).mean() < 0.8 * ttft(lor).mean()
    assert np.percentile(ttft(pa), 99) < np.percentile(ttft(lor), 99)
