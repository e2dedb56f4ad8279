"""Random fleets: learned policies against every heuristic on many fleets that neither the suite nor the shapes hold.

Each instance is one suite scenario's traffic (its EVAL window unless `--split train`) on a random fleet drawn as
training draws them (trainer/instances.py `random_fleet`): 2-32 replicas in 1-3 groups of any profile in
simulator/profiles/, at the scenario's own load level (arrival rate scaled by measured capacity), with the training's
other randomisation on top (speed factors, scrape interval, lag and failures, prompt scale, few batch slots). The
ranges come from `--config` (trainer/configs/fleets.yaml); every instance is a random fleet (trainer/instances.py
`random_fleet_specs`, as the trainer's validation fleets, on other seeds).
Seeds start at 3,000,000, apart from every seed training and its TRAIN-window evaluation use.

    python tests/bench/random_fleets.py --fleets 20 --models learned,runs/a.onnx --workers 2
    python tests/bench/random_fleets.py --fleets 20 --split train ...   # a validation set for choosing between models
    python tests/bench/random_fleets.py --fleets 5 --late --models ...  # also every policy behind late binding
    python tests/bench/random_fleets.py --fleets 20 --late --peers --warm-up 250 --models gated
        # the peers' algorithms among the heuristics; and each figure again without each instance's first 250
        # requests (the same runs: a pool already running, where the first rows are a cold start)

Per model, over all instances: the geometric mean of its p99 TTFT over the best heuristic on that instance
(chosen with hindsight, a high bar), over the best single heuristic (the one with the lowest geometric mean
over all instances, what an operator would deploy), the share of instances at or below 1.03x the best, the
90th percentile and the worst ratio (with its instance), and the mean goodput gap to the best heuristic's.
Then both geometric means by fleet size and by speed spread (fastest over slowest replica's saturated
completion rate on the instance's own request lengths). With `--late`, every heuristic and model also runs behind
late binding (`<name>+late`, simulator/late_binding.py, the router's defaults, each replica at its simulated
max_num_seqs); each `<model>+late` row is then over the best per-request heuristic, as the plain rows, and its
`vs_best_late` over the best heuristic behind late binding on that instance.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from multiprocessing import Pool
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from routewise_vllm.router.policy.registry import COMPARED_BASELINES, PEER_BASELINES, is_learned  # noqa: E402
from routewise_vllm.router.policy.served import served_policy  # noqa: E402
from routewise_vllm.simulator.bench import saturated_rps  # noqa: E402
from routewise_vllm.simulator.cluster import simulate  # noqa: E402
from routewise_vllm.simulator.late_binding import LATE_SUFFIX, simulate_late  # noqa: E402
from routewise_vllm.simulator.metrics import summarize  # noqa: E402
from routewise_vllm.simulator.scenario import mark_warm_up  # noqa: E402
from routewise_vllm.simulator.traces import WARMUP_TENANT  # noqa: E402
from routewise_vllm.trainer.config import load_config  # noqa: E402
from routewise_vllm.trainer.instances import InstanceBuilder, InstanceSpec, random_fleet_specs  # noqa: E402

SEED_BASE = 3_000_000  # the trainer's validation fleets (run.validation_fleets) start at 2,000,000
HEURISTICS = list(COMPARED_BASELINES)  # with --peers also PEER_BASELINES (`heuristics`)
SIZE_BUCKETS = ((2, 4), (5, 12), (13, 32))
SPREAD_BUCKETS = ((1.0, 2.0), (2.0, 5.0), (5.0, math.inf))  # labelled <2x, 2-5x, >=5x
PROBE_REQUESTS = 200

_builder: InstanceBuilder | None = None


def _init(config: str, split: str) -> None:
    global _builder
    _builder = InstanceBuilder(load_config(config).env, split=split)


def speed_spread(cluster, requests) -> float:
    """Fastest over slowest replica: each group's saturated completion rate on a sample of the instance's lengths."""
    if len(cluster.replicas) < 2:
        return 1.0
    rng = np.random.default_rng(0)
    idx = rng.integers(len(requests), size=PROBE_REQUESTS)
    lengths = (np.array([requests[i].prompt_tokens for i in idx]), np.array([requests[i].output_tokens for i in idx]))
    rates = [saturated_rps(g, rng, PROBE_REQUESTS, lengths) for g in cluster.replicas]
    return max(rates) / min(rates)


def heuristics(peers: bool) -> list[str]:
    """The heuristics each model is compared with: ours, and with `peers` the peers' algorithms too."""
    return HEURISTICS + (list(PEER_BASELINES) if peers else [])


def run_instance(args: tuple[InstanceSpec, tuple[str, ...], bool, bool, int]) -> dict:
    """Every heuristic and model on one instance (with `late`, also behind late binding as `<name>+late`): p99
    TTFT and goodput each, with the fleet's size and spread. With `warm_up` N, also both without the instance's
    first N requests (`p99_warm`, `goodput_warm`: the same runs scored as a pool already running)."""
    spec, models, late, peers, warm_up = args
    scenario, seed = spec.scenario, spec.seed
    assert _builder is not None
    cluster, requests = _builder.build(spec)
    slo = _builder.scenario(scenario).slo
    warm = {r.request_id for r in mark_warm_up(requests, warm_up, f"{scenario} seed {seed}")
            if r.tenant == WARMUP_TENANT} if warm_up else set()
    row = {
        "scenario": scenario, "seed": seed, "replicas": sum(g.count for g in cluster.replicas),
        "profiles": sorted({g.profile for g in cluster.replicas}), "spread": speed_spread(cluster, requests),
        "p99": {}, "goodput": {}, **({"p99_warm": {}, "goodput_warm": {}} if warm_up else {}),
    }  # fmt: skip

    def score(name: str, records) -> None:
        summary = summarize(records, slo)
        row["p99"][name], row["goodput"][name] = summary["ttft_p99_s"], summary["goodput"]
        if warm_up:
            summary = summarize([r for r in records if r.request_id not in warm], slo)
            row["p99_warm"][name], row["goodput_warm"][name] = summary["ttft_p99_s"], summary["goodput"]

    for name in (*heuristics(peers), *models):
        score(name, simulate(cluster, requests, served_policy(name, seed=seed), seed=seed))
        if late:
            score(name + LATE_SUFFIX, simulate_late(cluster, requests, served_policy(name, seed=seed), seed=seed)[0])
    return row


def _spread_label(lo: float, hi: float) -> str:
    return f"<{hi:g}x" if lo <= 1.0 else f">={lo:g}x" if math.isinf(hi) else f"{lo:g}-{hi:g}x"


def _geomean(values: Sequence[float]) -> float:
    return math.exp(float(np.mean(np.log(values)))) if len(values) else math.nan


def _by_bucket(rows: list[dict], ratio: np.ndarray, suffix: str) -> dict[str, dict[str, float]]:
    """Geometric means of `ratio` by fleet size and by speed spread, under keys by_size<suffix>, by_spread<suffix>."""
    size = {f"{lo}-{hi}": _geomean(ratio[[lo <= r["replicas"] <= hi for r in rows]]) for lo, hi in SIZE_BUCKETS}
    spread = {_spread_label(lo, hi): _geomean(ratio[[lo <= r["spread"] < hi for r in rows]]) for lo, hi in SPREAD_BUCKETS}
    return {"by_size" + suffix: size, "by_spread" + suffix: spread}


def summarise(rows: list[dict], models: Sequence[str], peers: bool = False) -> dict:
    """Per model, the ratios of its p99 TTFT to the best heuristic per instance and to the best single heuristic
    (with `peers`, the peers' algorithms among the heuristics)."""
    compared = heuristics(peers)
    best_p99 = [min(r["p99"][h] for h in compared) for r in rows]
    best_goodput = [max(r["goodput"][h] for h in compared) for r in rows]
    single = min(compared, key=lambda h: _geomean([r["p99"][h] / b for r, b in zip(rows, best_p99)]))
    out = {"instances": len(rows), "best_single_heuristic": single, "models": {}}
    late = compared[0] + LATE_SUFFIX in rows[0]["p99"] if rows else False
    best_late = [min(r["p99"][h + LATE_SUFFIX] for h in compared) for r in rows] if late else []
    for m in (*models, *(m + LATE_SUFFIX for m in models if late)):
        ratio = np.array([r["p99"][m] / b for r, b in zip(rows, best_p99)])
        vs_single = np.array([r["p99"][m] / r["p99"][single] for r in rows])
        worst = int(np.argmax(ratio))
        out["models"][m] = {
            "vs_best_per_instance": _geomean(ratio),
            "vs_best_single": _geomean(vs_single),
            "share_within_1_03": float(np.mean(ratio <= 1.03)),
            "p90": float(np.quantile(ratio, 0.9)),
            "worst": float(ratio[worst]),
            "worst_instance": f"{rows[worst]['scenario']} seed {rows[worst]['seed']} ({rows[worst]['replicas']} replicas)",
            "goodput_gap": float(np.mean([r["goodput"][m] - g for r, g in zip(rows, best_goodput)])),
            **_by_bucket(rows, ratio, ""),
            **_by_bucket(rows, vs_single, "_vs_single"),
        }
        if late:
            out["models"][m]["vs_best_late"] = _geomean([r["p99"][m] / b for r, b in zip(rows, best_late)])
    out["counts"] = {
        "by_size": {f"{lo}-{hi}": sum(lo <= r["replicas"] <= hi for r in rows) for lo, hi in SIZE_BUCKETS},
        "by_spread": {_spread_label(lo, hi): sum(lo <= r["spread"] < hi for r in rows) for lo, hi in SPREAD_BUCKETS},
    }
    return out


def format_summary(doc: dict) -> str:
    single = doc["best_single_heuristic"]
    lines = [
        f"{doc['instances']} instances; best single heuristic: {single}",
        "",
        f"| model | p99 / best per instance | p99 / {single} | within 1.03x | p90 | worst | goodput gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, s in doc["models"].items():
        lines.append(
            f"| {m} | {s['vs_best_per_instance']:.3f} | {s['vs_best_single']:.3f} | {s['share_within_1_03'] * 100:.0f} % | "
            f"{s['p90']:.2f} | {s['worst']:.2f} ({s['worst_instance']}) | {s['goodput_gap']:+.3f} |"
            + (f" over the best late heuristic {s['vs_best_late']:.3f} |" if "vs_best_late" in s else "")
        )
    for key, title in (("by_size", "replicas"), ("by_spread", "speed spread")):
        buckets = list(doc["counts"][key])
        lines += ["", f"| model, by {title}: p99 / best per instance, / {single} | "
                  + " | ".join(f"{b} ({doc['counts'][key][b]})" for b in buckets) + " |"]  # fmt: skip
        lines.append("|---" * (len(buckets) + 1) + "|")
        for m, s in doc["models"].items():
            cells = [f"{s[key][b]:.3f} / {s[key + '_vs_single'][b]:.3f}" for b in buckets]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="learned", help="comma-separated: `learned` (the shipped model) and/or .onnx paths")
    ap.add_argument("--fleets", type=int, default=20, help="random fleets per scenario (default 20)")
    ap.add_argument("--scenarios", default=None, help="comma-separated suite scenarios (default: the config's training scenarios)")
    ap.add_argument("--split", choices=["eval", "train"], default="eval", help="the traces' EVAL windows (a test) or TRAIN windows (validation)")
    ap.add_argument("--config", default=str(ROOT / "trainer/configs/fleets.yaml"), help="training config whose randomisation ranges draw the fleets")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", metavar="FILE", help="also write every instance's figures and the summary here")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--late", action="store_true", help="also every heuristic and model behind late binding (<name>+late)")
    ap.add_argument("--peers", action="store_true",
                    help=f"the peers' algorithms ({', '.join(PEER_BASELINES)}) among the heuristics each model is "
                    "compared with (default: routewise's own, as the model cards' figures were measured)")
    ap.add_argument("--warm-up", type=int, default=0, metavar="N",
                    help="also every figure without each instance's first N requests (the same runs: a pool already "
                    "running, where the default figures include the cold start)")
    args = ap.parse_args(argv)
    models = tuple(m for m in args.models.split(",") if m)
    for m in models:
        if not is_learned(m) or (m.endswith(".onnx") and not Path(m).is_file()):
            ap.error(f"--models: {m!r} is neither a learned policy's name (learned, gated, gated:MODEL, a shipped "
                     "model) nor an existing .onnx file")
    if args.warm_up < 0:
        ap.error(f"--warm-up must be >= 0 requests, got {args.warm_up}")
    cfg = load_config(args.config)
    scenarios = args.scenarios.split(",") if args.scenarios else list(cfg.env.scenarios)
    jobs = [(spec, models, args.late, args.peers, args.warm_up)
            for spec in random_fleet_specs(scenarios, args.fleets, SEED_BASE, cfg.env.eval_max_requests)]
    from tqdm import tqdm

    with Pool(args.workers, initializer=_init, initargs=(args.config, args.split)) as pool:
        rows = list(tqdm(pool.imap(run_instance, jobs), total=len(jobs), desc="instances", disable=args.no_progress))
    doc = summarise(rows, models, args.peers)
    print(format_summary(doc))
    out = {"summary": doc, "instances": rows}
    if args.warm_up:
        warm = summarise([r | {"p99": r["p99_warm"], "goodput": r["goodput_warm"]} for r in rows], models, args.peers)
        print(f"\nwithout each instance's first {args.warm_up} requests (--warm-up):\n" + format_summary(warm))
        out["summary_warm"] = warm
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
