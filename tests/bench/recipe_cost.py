"""What a training recipe's scenarios cost to simulate: one training episode (the TRAIN window, cut at the recipe's
`max_requests`) per scenario, decided by the shipped model behind late binding when the recipe trains behind it, in
CPU seconds of this process; then the mean per scenario of the recipe against a reference recipe's, which scales a
measured training run's wall time to an estimate for the recipe.

    python tests/bench/recipe_cost.py trainer/configs/cache-fleet.yaml --reference trainer/configs/late-fleet.yaml
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from routewise_vllm.router.policy.served import served_policy
from routewise_vllm.simulator.cluster import simulate
from routewise_vllm.simulator.late_binding import simulate_late
from routewise_vllm.simulator.scenario import load_scenario
from routewise_vllm.trainer.config import load_config


def episode_cpu_s(name: str, max_requests: int, late: bool, seed: int = 0) -> tuple[float, int]:
    sc = load_scenario(name, split="train")
    cluster, requests = sc.build(np.random.default_rng(seed))
    requests = requests[:max_requests]
    policy = served_policy("learned", seed=seed)
    t0 = time.process_time()
    if late:
        simulate_late(cluster, requests, policy, seed=seed)
    else:
        simulate(cluster, requests, policy, seed=seed)
    return time.process_time() - t0, len(requests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--reference", help="a recipe whose training wall time is known (its model card's training.wall_s)")
    args = ap.parse_args()
    costs: dict[str, float] = {}
    means = []
    for path in [args.config] + ([args.reference] if args.reference else []):
        cfg = load_config(path)
        per = []
        for name in cfg.env.scenarios:
            if name not in costs:
                costs[name], n = episode_cpu_s(name, cfg.env.max_requests, cfg.env.late_binding)
                print(f"{name:24} {n:5} requests {costs[name]:7.2f} CPU s", flush=True)
            per.append(costs[name])
        means.append(sum(per) / len(per))
        print(f"{path}: {len(per)} scenarios, {means[-1]:.2f} CPU s per episode on the mean", flush=True)
    if args.reference:
        print(f"ratio {means[0] / means[1]:.2f}: the recipe's episodes cost that many times the reference's")


if __name__ == "__main__":
    main()
