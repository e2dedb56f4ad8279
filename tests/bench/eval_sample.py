"""Effective sample of each scenario's EVAL workload: scored requests per seed and overlap between seeds.

Prints, per scenario, the scored (non-warm-up) requests per seed, the distinct trace rows over all seeds,
and the mean share of one seed's rows that another seed also replays (pairwise). Synthetic workloads draw
fresh requests per seed (overlap 0 by construction; lengths sampled from a trace can still repeat rows).
Usage: python tests/bench/eval_sample.py [--seeds 5] [--scenarios all|shapes|NAME,...]
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

from routewise_vllm.simulator.experiments import resolve_scenarios
from routewise_vllm.simulator.scenario import load_scenario
from routewise_vllm.simulator.workload import TraceWorkload


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--scenarios", default="all", help="`all` (the suite, default), a group (`shapes`) or names")
    args = ap.parse_args(argv)
    print(f"{'scenario':18s} {'kind':9s} {'per seed':>8s} {'distinct':>8s} {'overlap':>8s}")
    for name in resolve_scenarios(args.scenarios):
        sc = load_scenario(name, split="eval")
        rows = []
        for seed in range(args.seeds):
            _, reqs = sc.build(np.random.default_rng(seed))
            # a trace row is identified by its lengths and prefix blocks (request ids are renumbered per build)
            rows.append({(r.prompt_tokens, r.output_tokens, r.block_ids) for r in reqs if r.tenant != "warmup"})
        kind = "trace" if isinstance(sc.spec.workload, TraceWorkload) else "synthetic"
        pairs = [len(a & b) / len(a) for a, b in itertools.permutations(rows, 2)]
        per_seed = np.mean([len(r) for r in rows])
        print(f"{name:18s} {kind:9s} {per_seed:8.0f} {len(set().union(*rows)):8d} {np.mean(pairs):8.0%}")


if __name__ == "__main__":
    main()
