"""How often the router's guards overrule the shipped learned policy, and what that costs in p99 TTFT.

Runs the learned policy behind the default guards (LEARNED_GUARDS), behind the same guards with
the old absolute overload rule (overload_ratio 0: more than `overload_margin` requests above the
least-loaded replica) and with the overload guard off (the staleness guard kept), on EVAL windows, and
prints per scenario the share of decisions handed to least-outstanding by each guard and the p99 TTFT.

    python tests/bench/guard_fallbacks.py --scenarios heterogeneous,slowdown --seeds 3 --workers 2
    python tests/bench/guard_fallbacks.py --scenarios shapes --seeds 5     # the fleet shapes
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.router.policy.baselines import LeastOutstanding  # noqa: E402
from routewise_vllm.router.policy.fallback import LEARNED_GUARDS, FallbackPolicy  # noqa: E402
from routewise_vllm.router.policy.registry import make_policy  # noqa: E402
from routewise_vllm.simulator.cluster import ClusterSim  # noqa: E402
from routewise_vllm.simulator.experiments import resolve_scenarios  # noqa: E402
from routewise_vllm.simulator.metrics import summarize  # noqa: E402
from routewise_vllm.simulator.scenario import load_scenario  # noqa: E402

VARIANTS = {
    "relative (default)": LEARNED_GUARDS,
    "absolute (old)": {**LEARNED_GUARDS, "overload_ratio": 0.0},
    "relative x3 (before)": {**LEARNED_GUARDS, "overload_ratio": 3.0},
    "off": {**LEARNED_GUARDS, "overload_margin": None},
}


def run(job: tuple[str, int, str]) -> tuple[str, str, float, Counter]:
    scenario, seed, variant = job
    sc = load_scenario(scenario, split="eval")
    cluster, requests = sc.build(np.random.default_rng(seed))
    sim = ClusterSim(cluster, requests, seed=seed)
    policy = FallbackPolicy(make_policy("learned", seed=seed), LeastOutstanding(seed=seed), **VARIANTS[variant])
    policy.reset(seed)
    reasons: Counter = Counter()
    while (d := sim.next_decision()) is not None:
        decision = policy.decide(*d)
        reasons[decision.fallback_reason] += 1
        sim.dispatch(decision.index)
    return scenario, variant, summarize(sim.finish(), sc.slo)["ttft_p99_s"], reasons


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="heterogeneous,slowdown,steady-chat,stale-metrics,adversarial,crash")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of: {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    scenarios = resolve_scenarios(args.scenarios)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    jobs = [(sc, k, v) for sc in scenarios for k in range(args.seeds) for v in variants]
    with get_context("spawn").Pool(args.workers) as pool:
        results = pool.map(run, jobs, chunksize=1)
    print(f"learned policy behind the guards, EVAL windows, {args.seeds} seeds: share of decisions per fallback reason, p99 TTFT")
    print(f"{'scenario':20s} {'overload rule':20s} {'overload_guard':>15s} {'stale_stats':>12s} {'p99 TTFT':>9s}")
    for sc in scenarios:
        for variant in variants:
            mine = [r for r in results if r[0] == sc and r[1] == variant]
            total = sum((r[3] for r in mine), Counter())
            n = sum(total.values())
            print(f"{sc:20s} {variant:20s} {total['overload_guard'] / n:15.1%} {total['stale_stats'] / n:12.1%} "
                  f"{np.mean([r[2] for r in mine]):8.3f}s")  # fmt: skip


if __name__ == "__main__":
    main()
