"""The gated policy's modes per instance: the speed spread it measured, its cache share, and how many decisions each
mode made, behind late binding as the gate is served (router/policy/gated.py). An instance whose decisions were all
`learned` was routed exactly as `learned` routes it (the gate hands every decision to the same model).

    python tests/bench/gate_modes.py --scenario uniform,all,shapes --seeds 1
    # the random fleets' instances (tests/bench/random_fleets.py) of two scenarios:
    python tests/bench/gate_modes.py --random-fleets 20 --scenario prefix-heavy,prefix-synthetic
    # and, where the heuristic made decisions, p99 TTFT of `gated` and `learned`, both behind late binding:
    python tests/bench/gate_modes.py --random-fleets 20 --scenario prefix-heavy,prefix-synthetic --vs-learned
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from routewise_vllm.router.policy.served import served_policy  # noqa: E402
from routewise_vllm.simulator.experiments import resolve_scenarios  # noqa: E402
from routewise_vllm.simulator.late_binding import simulate_late  # noqa: E402
from routewise_vllm.simulator.metrics import summarize  # noqa: E402
from routewise_vllm.simulator.scenario import load_scenario  # noqa: E402


def report(label: str, cluster, requests, seed: int, slo=None, vs_learned: bool = False) -> None:
    policy = served_policy("gated", seed=seed)
    records, _ = simulate_late(cluster, requests, policy, seed=seed)
    g = policy.primary
    lo, hi = g.spread_range
    last = float("nan") if g.spread is None else g.spread
    line = (f"{label:40} {lo:>10.2f} {hi:>6.2f} {last:>6.2f} {g.cache_share:>6.2f} {g.decisions['learned']:>8} "
            f"{g.decisions['heuristic']:>9} {g.switches:>8}")
    if vs_learned and g.decisions["heuristic"]:
        gated_p99 = summarize(records, slo)["ttft_p99_s"]
        learned_p99 = summarize(simulate_late(cluster, requests, served_policy("learned", seed=seed), seed=seed)[0], slo)["ttft_p99_s"]
        line += f"  p99 TTFT gated {gated_p99:.3f} s, learned {learned_p99:.3f} s: {gated_p99 / learned_p99:.3f}x"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="uniform,all,shapes")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--split", default="eval")
    ap.add_argument("--vs-learned", action="store_true",
                    help="where the heuristic decided: p99 TTFT of gated and of learned, both behind late binding")
    ap.add_argument("--random-fleets", type=int, default=0, metavar="N",
                    help="instead: N random fleets per scenario, the instances of tests/bench/random_fleets.py")
    args = ap.parse_args()
    print(f"{'instance':40} {'spread min':>10} {'max':>6} {'last':>6} {'cache':>6} {'learned':>8} {'heuristic':>9} "
          f"{'switches':>8}")
    if args.random_fleets:
        from tests.bench.random_fleets import SEED_BASE
        from routewise_vllm.trainer.config import load_config
        from routewise_vllm.trainer.instances import InstanceBuilder, random_fleet_specs

        env = load_config(ROOT / "trainer/configs/fleets.yaml").env
        builder = InstanceBuilder(env, split=args.split)
        for spec in random_fleet_specs(args.scenario.split(","), args.random_fleets, SEED_BASE, env.eval_max_requests):
            cluster, requests = builder.build(spec)
            n = sum(g.count for g in cluster.replicas)
            report(f"{spec.scenario} seed {spec.seed} ({n} replicas)", cluster, requests, spec.seed,
                   builder.scenario(spec.scenario).slo, args.vs_learned)
        return
    for name in resolve_scenarios(args.scenario):
        sc = load_scenario(name, split=args.split)
        for seed in range(args.seeds):
            cluster, requests = sc.build(np.random.default_rng(seed))
            report(f"{name} seed {seed}", cluster, requests, seed, sc.slo, args.vs_learned)


if __name__ == "__main__":
    main()
