"""Measured capacity of a scenario's fleet and the load its workload offers (how the fleet shapes were sized).

A replica's capacity is `simulator.bench.saturated_rps`: the completion rate of one replica of the group
(same profile, speed factor, batch limits) given a burst at t=0 of `--n` requests whose (prompt, output)
lengths are drawn from the scenario's own EVAL workload (seed 0, scored requests, with replacement). The
fleet's capacity is the sum over replicas; the offered load is the scored requests' mean arrival rate
(count / arrival span, mean over `--seeds` seeds); load = offered / capacity.

Usage: python tests/bench/fleet_capacity.py [--scenarios shapes,steady-chat,heterogeneous,bursty-code] [--load 0.75]
With --load it also prints the rate that would put each fleet at that load.
"""

from __future__ import annotations

import argparse

import numpy as np

from routewise_vllm.simulator.bench import saturated_rps
from routewise_vllm.simulator.experiments import resolve_scenarios
from routewise_vllm.simulator.scenario import load_scenario


def fleet_capacity(name: str, n: int = 1500, seed: int = 0) -> tuple[float, list[tuple[str, int, float]]]:
    """(fleet capacity in req/s, [(profile, count, one replica's capacity)]) on the scenario's EVAL lengths."""
    sc = load_scenario(name, split="eval")
    _, reqs = sc.build(np.random.default_rng(seed))
    scored = [r for r in reqs if r.tenant != "warmup"]
    rng = np.random.default_rng(seed)
    idx = rng.integers(len(scored), size=n)
    lengths = (np.array([scored[i].prompt_tokens for i in idx]), np.array([scored[i].output_tokens for i in idx]))
    groups = [(g.profile, g.count, saturated_rps(g, rng, n, lengths)) for g in sc.cluster.replicas]
    return sum(count * rps for _, count, rps in groups), groups


def offered_rps(name: str, seeds: int) -> float:
    sc = load_scenario(name, split="eval")
    rates = []
    for seed in range(seeds):
        _, reqs = sc.build(np.random.default_rng(seed))
        t = [r.arrival_s for r in reqs if r.tenant != "warmup"]
        rates.append((len(t) - 1) / (max(t) - min(t)))
    return float(np.mean(rates))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="shapes,steady-chat,heterogeneous,bursty-code")
    ap.add_argument("--n", type=int, default=1500, help="requests in the saturating burst (default 1500)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds averaged for the offered rate (default 3)")
    ap.add_argument("--load", type=float, help="also print the rate giving this load")
    args = ap.parse_args(argv)
    print(f"{'scenario':18s} {'capacity':>9s} {'offered':>8s} {'load':>5s}  per replica")
    for name in resolve_scenarios(args.scenarios):
        cap, groups = fleet_capacity(name, args.n)
        offered = offered_rps(name, args.seeds)
        per = ", ".join(f"{c} x {p} {r:.2f}" for p, c, r in groups)
        extra = f"  -> {args.load:.2f} load = {args.load * cap:.1f} req/s" if args.load else ""
        print(f"{name:18s} {cap:9.2f} {offered:8.2f} {offered / cap:5.2f}  {per}{extra}")


if __name__ == "__main__":
    main()
