"""Simulator speed benchmark: simulated requests per wall-second on the standard workload.

Standard workload: Azure-2023-conversation-like lengths (log-normal prompts, mean ~1155 tokens;
log-normal outputs, mean ~211), Poisson arrivals at 85% of the cluster's capacity, 4
llama3-8b-a100 replicas, least-outstanding routing. Capacity is measured, not assumed: one
replica is saturated with a burst of the same lengths and its completion rate is taken.

    python -m routewise_vllm.simulator.bench [--n-requests N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.simulator.cluster import simulate
from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup
from routewise_vllm.simulator.types import SimRequest

PROMPT_MEAN, PROMPT_SIGMA = 1155.0, 1.0
OUTPUT_MEAN, OUTPUT_SIGMA = 211.0, 0.8
MAX_PROMPT, MAX_OUTPUT = 8000, 2000


def azure_conv_like_lengths(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Log-normal prompt and output lengths with the Azure 2023 conversation trace's means."""
    prompt = rng.lognormal(np.log(PROMPT_MEAN) - PROMPT_SIGMA**2 / 2, PROMPT_SIGMA, n)
    output = rng.lognormal(np.log(OUTPUT_MEAN) - OUTPUT_SIGMA**2 / 2, OUTPUT_SIGMA, n)
    return np.clip(prompt, 8, MAX_PROMPT).astype(int), np.clip(output, 1, MAX_OUTPUT).astype(int)


def saturated_rps(
    group: ReplicaGroup, rng: np.random.Generator, n: int = 1500, lengths: tuple[np.ndarray, np.ndarray] | None = None
) -> float:
    """Completion rate of one replica given a burst of `n` requests at t=0: `lengths` (prompt and output
    tokens, n each), else the Azure-conversation-like log-normal lengths drawn from `rng`."""
    prompt, output = lengths if lengths is not None else azure_conv_like_lengths(n, rng)
    reqs = [SimRequest(i, 0.0, int(p), int(o)) for i, (p, o) in enumerate(zip(prompt, output))]
    records = simulate(ClusterConfig(replicas=[group.model_copy(update={"count": 1})]), reqs, make_policy("round-robin"))
    return len(prompt) / max(r.finish_s for r in records if not r.error)


def standard_workload(
    n_requests: int, seed: int, load: float = 0.85, replicas: int = 4, profile: str = "llama3-8b-a100"
) -> tuple[ClusterConfig, list[SimRequest], float]:
    rng = np.random.default_rng(seed)
    group = ReplicaGroup(profile=profile, count=replicas)
    rate = load * replicas * saturated_rps(group, rng)
    prompt, output = azure_conv_like_lengths(n_requests, rng)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n_requests))
    reqs = [SimRequest(i, float(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(arrivals, prompt, output))]
    return ClusterConfig(replicas=[group]), reqs, rate


def run_bench(n_requests: int = 20000, seed: int = 0) -> dict:
    config, reqs, rate = standard_workload(n_requests, seed)
    t0, c0 = time.perf_counter(), time.process_time()
    records = simulate(config, reqs, make_policy("least-outstanding"), seed=seed)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    served = [r for r in records if not r.error]
    ttft = np.array([r.ttft_s for r in served])
    return {
        "sim_requests_per_s": n_requests / wall,
        "n_requests": n_requests,
        "wall_s": wall,
        "sim_requests_per_cpu_s": n_requests / cpu,  # steadier than wall time on a shared machine
        "cpu_s": cpu,
        "arrival_rate_per_s": rate,
        "simulated_s": max(r.finish_s for r in served),
        "rejected": len(records) - len(served),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-requests", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(json.dumps(run_bench(args.n_requests, args.seed), indent=2))


if __name__ == "__main__":
    main()
