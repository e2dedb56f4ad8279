"""`trainer`: train, evaluate and export the learned routing policy.

  trainer train    --config trainer/configs/suite-fleet.yaml [--set ppo.updates=80] [--resume]
  trainer evaluate --policy runs/suite-fleet/best.pt [--scenario all] [--seeds 3] [--json]
  trainer export   --checkpoint runs/suite-fleet/best.pt --out router/policy/models/suite-fleet.onnx
  trainer finetune --decision-log DIR --init router/policy/models/suite-fleet.onnx -o new.onnx
  trainer follow   --decision-log DIR --models DIR [--router URL]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from routewise_vllm.simulator.commands import DISTRIBUTION, DefaultsFormatter, OneLineParser, add_version
from routewise_vllm.simulator.traces import TRACES_DIR_HELP, TraceError, use_traces_dir

ALL = "all"
READS_TRACES = {"train", "evaluate"}


class UsageError(Exception):
    pass


# ---------------------------------------------------------------- train
def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML training config (see trainer/configs/suite-fleet.yaml; unknown keys are errors)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one config value, dotted key + YAML value, e.g. --set ppo.updates=80 (repeatable)",
    )  # fmt: skip
    p.add_argument("--run-dir", help="override run.run_dir: where checkpoints, TensorBoard logs and metrics.csv go")
    p.add_argument(
        "--resume", nargs="?", const="auto", default=None, metavar="CHECKPOINT",
        help="continue from a checkpoint (default: <run dir>/last.pt); progress, optimiser, RNG and normaliser are restored",
    )  # fmt: skip
    _ray_argument(p, "rollouts, heuristic runs and TRAIN-window evaluations run as run.workers Ray actors there "
                  "(set --set run.workers=N to the cluster's CPUs); the same seed and run.workers give the same result as locally")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _ray_argument(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
        help=f"run on a Ray cluster instead of local worker processes: {what}. ADDRESS: auto (default; RAY_ADDRESS if set, "
        "else the cluster `ray start` began on this machine), ray://HOST:10001, HOST:6379, or local (a private instance "
        "on this machine). Needs the extra: pip install 'routewise-vllm[ray]'",
    )  # fmt: skip


def _train(args: argparse.Namespace) -> int:
    from routewise_vllm.trainer.checkpoint import checkpoint_config, read_checkpoint
    from routewise_vllm.trainer.config import load_config
    from routewise_vllm.trainer.ppo import train

    overrides = list(args.overrides) + ([f"run.run_dir={args.run_dir}"] if args.run_dir else [])
    overrides += [f"run.ray={json.dumps(args.ray)}"] if args.ray else []
    cfg = load_config(args.config, overrides)
    resume = None
    if args.resume is not None:
        resume = Path(cfg.run.run_dir) / "last.pt" if args.resume == "auto" else Path(args.resume)
        saved = checkpoint_config(resume, read_checkpoint(resume))
        if saved.network != cfg.network:
            raise UsageError(f"{resume}: its network {saved.network} differs from {args.config}'s {cfg.network}")
    summary = train(cfg, resume=resume, progress=not args.no_progress)
    print(f"run dir: {summary['run_dir']}")
    where = f"Ray actor(s) on {summary['ray']}" if summary.get("ray") else "rollout worker process(es)"
    print(f"wall time: {summary['wall_s']:.0f}s with {summary['workers']} {where}")
    print(f"best heuristic per scenario (TRAIN windows): {json.dumps(summary['best_heuristic'])}")
    print(f"selected checkpoint: {summary['selected']} -> {Path(summary['run_dir']) / 'best.pt'}")
    for h in summary["history"]:
        fleets = f", random fleets {h['eval/fleets_score']:.3f}" if "eval/fleets_score" in h else ""
        print(f"  {h['label']:>8s}: p99 ratio geomean {h['eval/score']:.3f}, worst {h['eval/worst_ratio']:.3f}, "
              f"min goodput gap {h['eval/min_goodput_gap']:+.3f}{fleets}, key {h['key']:.3f}")  # fmt: skip
    return 0


# ---------------------------------------------------------------- evaluate
def _evaluate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", help="the learned policy: `learned` (the shipped model), a checkpoint (.pt, exported to "
                   "ONNX first) or an .onnx file; omit for baselines only")  # fmt: skip
    p.add_argument("--scenario", "--scenarios", dest="scenarios", default=ALL,
                   help="comma-separated scenario names / YAML paths, or `all` (default)")  # fmt: skip
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, the same arrivals for every policy (default 3)")
    p.add_argument("--baselines", default=ALL, help="comma-separated baseline names, or `all` (default)")
    p.add_argument("--split", choices=("eval", "train"), default="eval", help="trace windows: eval (held out; default) or train")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="simulation worker processes (default: the machine's cores)")
    p.add_argument("--out", default="runs/evaluate", help="where plots and the exported ONNX go (default runs/evaluate)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (they re-simulate the first seed)")
    p.add_argument("--json", action="store_true", help="print the same JSON document as `simulator compare --json`")
    p.add_argument("--card", help="also merge the evaluation table into this model-card JSON (e.g. router/policy/models/suite-fleet.json)")
    p.add_argument("--late-binding", action="store_true",
                   help="also run every policy behind the router's late binding (rows NAME+late, default settings) and "
                   "report the learned policy behind it against the best heuristic behind it and the best per request")
    _ray_argument(p, "each (scenario, seed) is a Ray task (--workers is then ignored)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _evaluate(args: argparse.Namespace) -> int:
    from routewise_vllm.router.policy.registry import BASELINES, DEFAULT_MODEL_PATH, LEARNED
    from routewise_vllm.simulator.experiments import ExperimentError, resolve_scenarios, to_json
    from routewise_vllm.trainer import evaluate as ev

    if args.seeds < 1:
        raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    try:
        scenarios = resolve_scenarios(args.scenarios)
    except ExperimentError as exc:  # names the scenario
        raise UsageError(str(exc)) from None
    baselines = list(BASELINES) if args.baselines == ALL else [b.strip() for b in args.baselines.split(",") if b.strip()]
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise UsageError(f"unknown baseline(s) {unknown}; known: {', '.join(BASELINES)}")
    out_dir = Path(args.out)
    policy = str(DEFAULT_MODEL_PATH) if args.policy == LEARNED else args.policy  # the same model router/simulator serve
    onnx_path = ev.learned_onnx(policy, out_dir) if policy else None
    seeds = list(range(args.seeds))
    start = time.perf_counter()
    doc = ev.run_comparison(onnx_path, scenarios, seeds, baselines, args.split, args.workers, not args.no_progress,
                            ray=args.ray, late_binding=args.late_binding)
    wall = time.perf_counter() - start
    if args.json:
        print(to_json(doc))
    else:
        print(ev.format_table(doc, onnx_path))
        print(
            f"\n{len(scenarios)} scenario(s), {args.split} split, seeds {seeds}; mean ± 95% CI half-width over seeds; "
            f"p99/best = p99 TTFT / best heuristic's p99 TTFT; {wall:.0f}s wall"
        )
        if onnx_path is not None:
            print("\nlearned vs best heuristic per scenario:")
            for s in ev.learned_summary(doc, onnx_path):
                print(ev.summary_line(s))
    if not args.no_plots:
        files = ev.plot(doc, onnx_path, scenarios, seeds[0], args.split, out_dir, not args.no_progress)
        print("plots: " + ", ".join(str(f) for f in files), file=sys.stderr if args.json else sys.stdout)
    if args.card:
        if onnx_path is None:
            raise UsageError("--card needs --policy")
        card_path = Path(args.card)
        card = json.loads(card_path.read_text()) if card_path.is_file() else {}
        card["evaluation"] = {
            "command": "trainer evaluate " + " ".join(sys.argv[2:]),
            "split": args.split,
            "seeds": seeds,
            "late_binding": doc.get("late_binding"),
            "wall_s": round(wall, 1),
            "vs_best_heuristic": ev.learned_summary(doc, onnx_path),
            "results": [
                {k: v for k, v in r.items() if k != "metrics"} | {"policy": ev.label(r["policy"], onnx_path)} for r in doc["results"]
            ],
        }
        card_path.write_text(to_json(card) + "\n")
    return 0


# ---------------------------------------------------------------- export
def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a training checkpoint (e.g. runs/suite-fleet/best.pt)")
    p.add_argument("--out", required=True, help="the ONNX file to write (e.g. router/policy/models/suite-fleet.onnx)")
    p.add_argument("--policy-version", help="the model's version string (default: <run dir name>-<checkpoint label>)")
    p.add_argument("--parity-observations", type=int, default=4096, help="simulator observations for the torch/ONNX parity check (default 4096)")
    p.add_argument("--card", help="also write a model card JSON (training budget, wall time, cores, scenarios)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _export(args: argparse.Namespace) -> int:
    from routewise_vllm.trainer.checkpoint import load_network
    from routewise_vllm.trainer.export import export_onnx, model_size_bytes, parity_check
    from routewise_vllm.trainer.observations import simulator_observations

    ckpt = Path(args.checkpoint)
    net, cfg, doc = load_network(ckpt)
    selected = (doc.get("extra") or {}).get("selected", ckpt.stem)
    version = args.policy_version or f"{Path(cfg.run.run_dir).name}-{selected}"
    out = export_onnx(net, args.out, version, cfg.model_dump(mode="json"))
    size = model_size_bytes(out)
    print(f"wrote {out} ({size / 1024:.0f} KiB, opset 17, policy_version {version})")
    if args.parity_observations < 1:
        raise UsageError(f"--parity-observations must be >= 1, got {args.parity_observations}")
    feats, masks = simulator_observations(net, cfg, args.parity_observations, progress=not args.no_progress)
    report = parity_check(net, out, feats, masks)
    print(report)
    if args.card:
        _write_card(Path(args.card), ckpt, cfg, doc, version, size, report)
        print(f"wrote {args.card}")
    if not report.ok:
        print(f"error: {out}: parity check failed ({report})", file=sys.stderr)
        return 1
    return 0


def _write_card(path: Path, ckpt: Path, cfg, doc: dict, version: str, size: int, report) -> None:
    from routewise_vllm.router.policy.features import FEATURE_SPEC_HASH, FEATURE_VERSION
    from routewise_vllm.trainer.checkpoint import load_network
    from routewise_vllm.trainer.network import parameter_count

    summary_path = ckpt.parent / "summary.json"
    run = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    prog = doc.get("progress", {})
    card = json.loads(path.read_text()) if path.is_file() else {}
    card |= {
        "policy_version": version,
        "feature_spec_hash": FEATURE_SPEC_HASH,
        "feature_version": FEATURE_VERSION,
        "onnx_bytes": size,
        "training": {
            "config": cfg.model_dump(mode="json"),
            "scenarios_train_split": cfg.env.scenarios,
            "selected_checkpoint": (doc.get("extra") or {}).get("selected"),
            "selection_on_train_windows": (doc.get("extra") or {}).get("eval_train"),
            "best_heuristic_per_scenario_train": run.get("best_heuristic") or prog.get("best_heuristic"),
            "ppo_updates": run.get("updates", prog.get("update")),
            "decisions_per_update": cfg.ppo.envs_per_worker * max(1, cfg.run.workers) * cfg.env.max_requests,
            "wall_s": run.get("wall_s", prog.get("wall_s")),
            "cores": os.cpu_count(),
            "rollout_workers": cfg.run.workers,
            "history": run.get("history"),
        },
        "parity": {
            "observations": report.n_observations,
            "max_abs_logit_diff": report.max_abs_diff,
            "argmax_agreement": report.argmax_agreement,
        },
        "network": {"parameters": parameter_count(load_network(ckpt, doc)[0]), **cfg.network.model_dump()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(card, indent=2, default=float) + "\n")


# ---------------------------------------------------------------- main
COMMANDS = {
    "train": ("train a policy: heuristic selection, warm start (TTFT regression or behaviour cloning), PPO (resumable)", _train_arguments, _train),
    "evaluate": ("the learned policy and every baseline on the same seeds: table with 95%% CIs, plots", _evaluate_arguments, _evaluate),
    "export": ("export a checkpoint to ONNX (normalisation folded in) and check parity with torch", _export_arguments, _export),
}
from routewise_vllm.trainer.fleet_cli import FLEET_COMMANDS  # noqa: E402 - finetune/follow live in their own module

COMMANDS |= FLEET_COMMANDS


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="trainer", description=__doc__, formatter_class=_HelpFormatter)
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=DefaultsFormatter)
        add_args(p)
        if name in READS_TRACES:
            p.add_argument("--traces-dir", metavar="DIR", help=TRACES_DIR_HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # --help and --version work without the [train] extra
    try:
        from routewise_vllm.trainer.checkpoint import CheckpointError
        from routewise_vllm.trainer.config import ConfigError
        from routewise_vllm.trainer.export import ExportError
        from routewise_vllm.trainer.finetune import FinetuneError
        from routewise_vllm.trainer.fleet_log import FleetLogError
        from routewise_vllm.trainer.ray_backend import RayBackendError
    except ModuleNotFoundError as exc:
        print(f"trainer {args.command}: error: {exc.name} is not installed; the trainer needs the extra: "
              f"pip install '{DISTRIBUTION}[train]'", file=sys.stderr)
        return 2
    try:
        if getattr(args, "traces_dir", None):
            use_traces_dir(args.traces_dir)
        return COMMANDS[args.command][2](args)
    except (UsageError, ConfigError, CheckpointError, ExportError, FinetuneError, FleetLogError, TraceError, RayBackendError) as exc:
        print(f"trainer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"trainer {args.command}: interrupted (resume with --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
