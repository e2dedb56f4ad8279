"""Measured capacity of the uniform-pool scenarios (simulator/scenarios/uniform): one replica of the pool gets a
burst of the scenario's own EVAL requests (prompts, answers and shared prefixes) at t=0; its completion rate times
the replica count is the pool's capacity. Prints capacity and the load each scenario's rate_rps gives.

    .venv/bin/python tests/bench/uniform_capacity.py [--n 1500]
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.simulator.cluster import simulate
from routewise_vllm.simulator.config import ClusterConfig
from routewise_vllm.simulator.scenario import load_scenario, scenario_names


def capacity(name: str, n: int) -> tuple[float, float]:
    sc = load_scenario(name, split="eval")
    cluster, reqs = sc.build(np.random.default_rng(0))
    group = cluster.replicas[0]
    burst = [dataclasses.replace(r, arrival_s=0.0) for r in reqs[:n]]
    one = ClusterConfig(replicas=[group.model_copy(update={"count": 1})])
    records = simulate(one, burst, make_policy("round-robin"))
    per_replica = len(burst) / max(r.finish_s for r in records if not r.error)
    rate = len(reqs) / max(1e-9, reqs[-1].arrival_s - reqs[0].arrival_s)
    return per_replica * group.count, rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1500)
    args = ap.parse_args()
    for name in scenario_names("uniform"):
        cap, rate = capacity(name, args.n)
        print(f"{name:20s} capacity {cap:8.1f} req/s  rate {rate:8.1f} req/s  load {rate / cap:5.2f}")


if __name__ == "__main__":
    main()
