"""Does learning from the fleet make the policy hold on fleets it was not trained on? (simulated)

For each scenario (default: the `shapes` group, fleets the training never saw), as an operator would run it:
1. the shipped policy routes the scenario's TRAIN windows (the first 40 minutes of its traces) with a share
   `--epsilon` of uniformly random healthy picks, as the A/B treatment arm explores, and the router's own
   decision log is written (`trainer.simlog.simulate_log`: the live router's encoder and format);
2. `trainer finetune` fits the shipped model's TTFT regression on that log (`trainer.finetune.finetune`, the
   defaults of the command);
3. an A/B on TRAIN windows decides which model serves: the fine-tuned one only if its p99 TTFT there is below
   the shipped one's (live, `trainer follow` hands the candidate to the router's A/B guard the same way);
4. every per-request heuristic, the shipped policy and the fine-tuned model route the scenario's EVAL windows
   (`simulator.experiments.compare`, the same arrivals for all, behind the router's guards and decision budget).

Prints per scenario the best heuristic's p99 TTFT and each learned policy's ratio to it, goodput, TPOT and E2E p99
against the best heuristic's, and the fine-tune's held-out prediction error. The fine-tuned model never sees an
EVAL window: it learns from the fleet's past and is judged on its future.

    python tests/bench/fleet_adapt.py [--scenarios shapes] [--seeds 5] [--workers 2] [--keep DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.router.policy.registry import BASELINES, DEFAULT_MODEL_PATH, LEARNED  # noqa: E402
from routewise_vllm.simulator.experiments import compare, resolve_scenarios  # noqa: E402
from routewise_vllm.trainer.finetune import FinetuneConfig, finetune  # noqa: E402
from routewise_vllm.trainer.fleet_cli import parse_quantile  # noqa: E402
from routewise_vllm.trainer.simlog import simulate_log  # noqa: E402

HEURISTICS = list(BASELINES)
FINETUNED = "fine-tuned"


def adapt(scenario: str, folder: Path, args: argparse.Namespace) -> dict:
    """Log, fine-tune and compare one scenario; the comparison rows by policy and the fine-tune's errors."""
    here = folder / Path(scenario).stem  # a scenario may be a YAML path
    log_dir = here / "log"
    simulate_log(scenario, log_dir, behaviour=LEARNED, epsilon=args.epsilon, episodes=args.episodes,
                 max_requests=args.max_requests, seed=args.log_seed)
    model = here / "fine-tuned.onnx"
    report = finetune(log_dir, DEFAULT_MODEL_PATH, model, FinetuneConfig(quantile=args.quantile, epochs=args.epochs,
                                                                           min_steps=args.min_steps))
    ab = compare([scenario], [LEARNED, str(model)], args.ab_seeds, split="train", workers=args.workers, progress=False)
    ab_p99 = {r["policy"]: r["ttft_p99_s"] for r in ab["results"]}
    doc = compare([scenario], [*HEURISTICS, LEARNED, str(model)], args.seeds, workers=args.workers, progress=False)
    rows = {r["policy"]: r for r in doc["results"]}
    rows[FINETUNED] = rows.pop(str(model))
    return {"rows": rows, "records": report.records, "mae_before": report.before["mae_log_ttft"],
            "mae_after": report.after["mae_log_ttft"], "promoted": ab_p99[str(model)] < ab_p99[LEARNED],
            "ab_train_p99_s": {LEARNED: ab_p99[LEARNED], FINETUNED: ab_p99[str(model)]}}


def summary(scenario: str, result: dict) -> dict:
    rows = result["rows"]
    best = min((rows[h] for h in HEURISTICS), key=lambda r: r["ttft_p99_s"])
    out = {"scenario": scenario, "best": best["policy"], "best_p99_s": best["ttft_p99_s"],
           "best_p99_ci95_s": best["ttft_p99_s_ci95"], "best_goodput": max(rows[h]["goodput"] for h in HEURISTICS),
           "records": result["records"], "mae_before": result["mae_before"], "mae_after": result["mae_after"],
           "promoted": result["promoted"], "ab_train_p99_s": result["ab_train_p99_s"]}
    for name in (LEARNED, FINETUNED):
        r = rows[name]
        out[name] = {"p99_s": r["ttft_p99_s"], "p99_ci95_s": r["ttft_p99_s_ci95"], "vs_best": r["ttft_p99_s"] / best["ttft_p99_s"],
                     "goodput": r["goodput"], "tpot_p99_vs_best": r["tpot_p99_s"] / best["tpot_p99_s"],
                     "e2e_p99_vs_best": r["e2e_p99_s"] / best["e2e_p99_s"], "fallback_share": r["fallback_share"]}
    out["served_vs_best"] = out[FINETUNED if out["promoted"] else LEARNED]["vs_best"]
    return out


def print_table(summaries: list[dict], args: argparse.Namespace) -> None:
    print(f"\nEVAL windows, {args.seeds} seeds; p99 TTFT over the best per-request heuristic's (of {len(HEURISTICS)}); "
          f"fine-tuned on a log of {args.episodes} x {args.max_requests} TRAIN-window requests, epsilon {args.epsilon}")
    head = (f"{'scenario':22} {'best heuristic':30} {'shipped':>8} {'fine-tuned':>10} {'after A/B':>10} "
            f"{'goodput shipped / ft / best':>28} "
            f"{'TPOT p99 ft/best':>16} {'E2E p99 ft/best':>15} {'log MAE before -> after':>24}")
    print(head)
    for s in summaries:
        ft, sh = s[FINETUNED], s[LEARNED]
        best = f"{s['best']} {s['best_p99_s'] * 1e3:.0f}±{s['best_p99_ci95_s'] * 1e3:.0f} ms"
        served = f"{s['served_vs_best']:.2f} " + ("ft" if s["promoted"] else "sh")
        print(f"{s['scenario']:22} {best:30} {sh['vs_best']:8.2f} {ft['vs_best']:10.2f} {served:>10} "
              f"{sh['goodput']:>10.3f} / {ft['goodput']:.3f} / {s['best_goodput']:.3f} {ft['tpot_p99_vs_best']:16.2f} "
              f"{ft['e2e_p99_vs_best']:15.2f} {s['mae_before']:12.3f} -> {s['mae_after']:.3f}")
    shipped, tuned = (max(s[k]["vs_best"] for s in summaries) for k in (LEARNED, FINETUNED))
    served = max(s["served_vs_best"] for s in summaries)
    print(f"worst ratio: shipped {shipped:.2f}, fine-tuned {tuned:.2f}, after A/B {served:.2f} "
          f"(A/B on TRAIN windows, {args.ab_seeds} seeds: fine-tuned promoted where its p99 was below the shipped one's)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="shapes", help="scenario names, groups or YAML paths (default: shapes)")
    ap.add_argument("--seeds", type=int, default=5, help="EVAL seeds per comparison (default 5)")
    ap.add_argument("--workers", type=int, default=2, help="simulation processes (default 2)")
    ap.add_argument("--epsilon", type=float, default=0.1, help="exploration share while logging (default 0.1)")
    ap.add_argument("--episodes", type=int, default=6, help="logged TRAIN episodes per scenario (default 6)")
    ap.add_argument("--max-requests", type=int, default=1000, help="requests per logged episode (default 1000)")
    ap.add_argument("--log-seed", type=int, default=1, help="seed of the logged episodes and exploration")
    ap.add_argument("--ab-seeds", type=int, default=3, help="TRAIN-window seeds of the promotion A/B (default 3)")
    ap.add_argument("--quantile", type=parse_quantile, default=0.9,
                    help="trainer finetune --quantile: a quantile of log TTFT, or none for the middle (default 0.9)")
    ap.add_argument("--epochs", type=int, default=FinetuneConfig.epochs,
                    help=f"trainer finetune --epochs (default {FinetuneConfig.epochs})")
    ap.add_argument("--min-steps", type=int, default=FinetuneConfig.min_steps,
                    help=f"trainer finetune --min-steps (default {FinetuneConfig.min_steps}; 0: --epochs exactly)")
    ap.add_argument("--keep", type=Path, help="keep the logs and fine-tuned models here")
    ap.add_argument("--json", action="store_true", help="print the summaries as JSON")
    args = ap.parse_args(argv)
    scenarios = resolve_scenarios(args.scenarios)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="fleet-adapt-"))
    summaries = []
    for i, sc in enumerate(scenarios, 1):
        t = time.perf_counter()
        summaries.append(summary(sc, adapt(sc, folder, args)))
        s = summaries[-1]
        print(f"[{i}/{len(scenarios)}] {sc}: shipped {s[LEARNED]['vs_best']:.2f}x, fine-tuned {s[FINETUNED]['vs_best']:.2f}x "
              f"the best heuristic, {'promoted' if s['promoted'] else 'not promoted'} ({time.perf_counter() - t:.0f} s)",
              file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(summaries, indent=2))
    else:
        print_table(summaries, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
