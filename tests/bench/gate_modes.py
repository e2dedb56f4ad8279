r"""The gated policy's modes per instance: the speed spread it measured, its cache share, and how many decisions each
mode made, behind late binding as the gate is served (router/policy/gated.py). An instance whose decisions were all
`learned` was routed exactly as `learned` routes it (the gate hands every decision to the same model).

    python tests/bench/gate_modes.py --scenario uniform,all,shapes --seeds 1
    # the random fleets' instances (tests/bench/random_fleets.py) of two scenarios:
    python tests/bench/gate_modes.py --random-fleets 20 --scenario prefix-heavy,prefix-synthetic
    # and, where the heuristic made decisions, p99 TTFT of `gated` and `learned`, both behind late binding:
    python tests/bench/gate_modes.py --random-fleets 20 --scenario prefix-heavy,prefix-synthetic --vs-learned
    # the gate with other settings against the shipped one (p99 TTFT per instance, mean per scenario, geomean):
    python tests/bench/gate_modes.py --scenario uniform --seeds 3 --set mixed_min_spread=inf --vs-default
    python tests/bench/gate_modes.py --scenario uniform --seeds 3 --set mixed_min_spread=inf --set cache_on=0 \
        --set cache_off=0 --vs-default          # the heuristic on every decision, routed at once
    # another model inside the gate (a candidate from `trainer export`), and the model alone (the gate never hands over):
    python tests/bench/gate_modes.py --scenario uniform --seeds 3 --model new.onnx --vs-default
    python tests/bench/gate_modes.py --scenario uniform --seeds 3 --model new.onnx --set cache_on=inf --vs-default
    # where each instance's p99 TTFT comes from: how early its slowest 1 % arrive, p99 over its first 400 and the rest
    python tests/bench/gate_modes.py --scenario uniform --seeds 3 --tail
    # a pool already running: each instance's first 500 requests served but not scored (simulator compare --warm-up)
    python tests/bench/gate_modes.py --scenario uniform --seeds 3 --set max_load_ratio=inf --vs-default --warm-up 500
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
from routewise_vllm.simulator.metrics import request_table, summarize  # noqa: E402
from routewise_vllm.simulator.traces import WARMUP_TENANT  # noqa: E402
from routewise_vllm.simulator.scenario import load_scenario, mark_warm_up  # noqa: E402


# --set NAME=VALUE: GatedPolicy's keyword arguments, as the attribute each one sets
SETTINGS = {"mixed_min_spread": "mixed_min_spread", "evidence": "max_evidence", "dwell": "dwell",
            "cache_on": "cache_on", "cache_off": "cache_off", "cache_window": "cache_window",
            "max_load_ratio": "max_load_ratio"}


def gate(seed: int, settings: dict[str, float], model: Path | None = None):
    """The gate as it is served, around `model` (an .onnx file: `gated:MODEL`) instead of the shipped model when given."""
    policy = served_policy("gated" if model is None else f"gated:{model}", seed=seed)
    for name, value in settings.items():
        setattr(policy.primary, SETTINGS[name], int(value) if name in ("evidence", "dwell", "cache_window") else value)
    return policy


def tail(records, first: int = 400) -> str:
    """Where a run's p99 TTFT comes from: how many of its scored requests are at or above it and the latest arrival
    index among them, and p99 TTFT over its first `first` arrivals and over the rest."""
    t = request_table(r for r in records if r.tenant != WARMUP_TENANT)
    ttft = t["ttft_s"][np.argsort(t["arrival_s"], kind="stable")]
    p99 = np.nanpercentile(ttft, 99)
    slow = np.flatnonzero(ttft >= p99)
    return (f"  slowest 1 %: {len(slow)} among the first {int(slow.max()) + 1} of {len(ttft)}; p99 TTFT first {first} "
            f"{np.nanpercentile(ttft[:first], 99):.3f} s, rest {np.nanpercentile(ttft[first:], 99):.3f} s")


def report(label: str, cluster, requests, seed: int, slo=None, vs_learned: bool = False,
           settings: dict[str, float] | None = None, ratios: list[float] | None = None,
           p99s: dict[str, list[float]] | None = None, model: Path | None = None, show_tail: bool = False) -> None:
    policy = gate(seed, settings or {}, model)
    records, _ = simulate_late(cluster, requests, policy, seed=seed)
    g = policy.primary
    lo, hi = g.spread_range
    last = float("nan") if g.spread is None else g.spread
    line = (f"{label:40} {lo:>10.2f} {hi:>6.2f} {last:>6.2f} {g.cache_share:>6.2f} {g.decisions['learned']:>8} "
            f"{g.decisions['heuristic']:>9} {g.switches:>8}")
    if vs_learned and g.decisions["heuristic"]:
        gated_p99 = summarize(records, slo)["ttft_p99_s"]
        alone = served_policy("learned" if model is None else str(model), seed=seed)
        learned_p99 = summarize(simulate_late(cluster, requests, alone, seed=seed)[0], slo)["ttft_p99_s"]
        line += f"  p99 TTFT gated {gated_p99:.3f} s, learned {learned_p99:.3f} s: {gated_p99 / learned_p99:.3f}x"
    if ratios is not None:
        p99 = summarize(records, slo)["ttft_p99_s"]
        default = summarize(simulate_late(cluster, requests, gate(seed, {}), seed=seed)[0], slo)["ttft_p99_s"]
        ratios.append(p99 / default)
        p99s.setdefault(label.split(" seed ")[0], []).append(p99)
        line += f"  p99 TTFT {p99:.3f} s, the shipped gate {default:.3f} s: {p99 / default:.3f}x"
    if show_tail:
        line += tail(records)
    print(line, flush=True)


def parse_setting(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    if name not in SETTINGS:
        raise argparse.ArgumentTypeError(f"--set {text}: not one of {', '.join(SETTINGS)}")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--set {text}: the value must be a number (inf allowed)") from None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="uniform,all,shapes")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--split", default="eval")
    ap.add_argument("--vs-learned", action="store_true",
                    help="where the heuristic decided: p99 TTFT of gated and of learned, both behind late binding")
    ap.add_argument("--random-fleets", type=int, default=0, metavar="N",
                    help="instead: N random fleets per scenario, the instances of tests/bench/random_fleets.py")
    ap.add_argument("--set", type=parse_setting, action="append", default=[], metavar="NAME=VALUE",
                    help=f"the gate with this setting instead of the shipped one ({', '.join(SETTINGS)}; repeatable)")
    ap.add_argument("--model", type=Path, metavar="ONNX",
                    help="the gate around this model instead of the shipped one (--vs-default still compares with the "
                    "shipped gate)")
    ap.add_argument("--vs-default", action="store_true",
                    help="p99 TTFT per instance against the shipped gate's, the mean per scenario and the geomean")
    ap.add_argument("--tail", action="store_true",
                    help="where each instance's p99 TTFT comes from: how early its slowest 1 %% of requests arrive, and "
                    "p99 TTFT over its first 400 requests and over the rest")
    ap.add_argument("--warm-up", type=int, default=0, metavar="N",
                    help="each instance's first N requests served but not scored: a pool already running (default 0: "
                    "the figures include the cold start)")
    args = ap.parse_args(argv)
    if args.warm_up < 0:
        ap.error(f"--warm-up must be >= 0 requests, got {args.warm_up}")
    settings = dict(args.set)
    ratios: list[float] | None = [] if args.vs_default else None
    p99s: dict[str, list[float]] = {}
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
            label = f"{spec.scenario} seed {spec.seed} ({n} replicas)"
            report(label, cluster, mark_warm_up(requests, args.warm_up, label), spec.seed,
                   builder.scenario(spec.scenario).slo, args.vs_learned, settings, ratios, p99s, args.model, args.tail)
        summary(ratios, {})
        return
    for name in resolve_scenarios(args.scenario):
        sc = load_scenario(name, split=args.split)
        for seed in range(args.seeds):
            cluster, requests = sc.build(np.random.default_rng(seed))
            label = f"{name} seed {seed}"
            report(label, cluster, mark_warm_up(requests, args.warm_up, label), seed, sc.slo, args.vs_learned,
                   settings, ratios, p99s, args.model, args.tail)
    summary(ratios, p99s)


def summary(ratios: list[float] | None, p99s: dict[str, list[float]]) -> None:
    if not ratios:
        return
    for name, values in p99s.items():
        print(f"{name}: mean p99 TTFT {np.mean(values):.3f} s over {len(values)} seeds")
    logs = np.log(ratios)
    print(f"over the shipped gate: geomean {np.exp(logs.mean()):.4f}x, worst {np.exp(logs.max()):.3f}x, best "
          f"{np.exp(logs.min()):.3f}x, {int(np.sum(np.abs(logs) > 1e-9))} of {len(ratios)} instances differ")


if __name__ == "__main__":
    main()
