"""`trainer finetune` and `trainer follow`: learn from the fleet's decision log."""

from __future__ import annotations

import argparse
import json
import sys


def _finetune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decision-log", required=True, help="the router's decision log directory (router serve --decision-log DIR)")
    p.add_argument("--init", required=True, help="the model to start from: an .onnx from `trainer export` (e.g. the shipped "
                   "router/policy/models/suite-fleet.onnx) or a training checkpoint (.pt)")
    p.add_argument("-o", "--out", required=True, help="the .onnx to write (atomically), with its model card beside it (.json)")
    p.add_argument("--holdout", type=float, default=0.2, help="newest share of the log held out for validation (default 0.2)")
    p.add_argument("--epochs", type=int, default=4, help="passes over the log (default 4; raised by --min-steps)")
    p.add_argument("--min-steps", type=int, default=120,
                   help="at least this many optimiser steps: a small log gets more epochs (default 120; 0 = off)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--anchor", type=float, default=0.1,
                   help="pull of unchosen replicas' predictions towards the initial model's (bandit feedback; default 0.1)")
    p.add_argument("--early-stop", type=float, default=0.15,
                   help="newest share of the training part scored each epoch; the best epoch is kept (0 = off; default 0.15)")
    p.add_argument("--max-records", type=int, help="use only the newest N usable records")
    _quantile_argument(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def parse_quantile(text: str) -> float | None:
    """A `--quantile` value: a number, or `none` for the middle (Huber) fit."""
    return None if text.strip().lower() == "none" else float(text)


def _quantile_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantile", type=parse_quantile, default=0.9,
                   help="fit this quantile of each replica's log TTFT (pinball loss; default 0.9: the policy routes by "
                        "the replicas' tail); 'none' fits the middle (Huber), which favours a replica that is fast alone "
                        "but queues in bursts")


def _finetune(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from routewise_vllm.trainer.finetune import FinetuneConfig, finetune

    cfg = FinetuneConfig(holdout=args.holdout, epochs=args.epochs, min_steps=args.min_steps, lr=args.lr, anchor=args.anchor,
                         max_records=args.max_records, early_stop=args.early_stop, quantile=args.quantile)
    report = finetune(args.decision_log, args.init, args.out, cfg)
    print(json.dumps(asdict(report), indent=2) if args.json else report.summary())
    return 0


def _follow_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decision-log", required=True, help="the router's decision log directory")
    p.add_argument("--models", required=True, help="where candidates (candidate-NNNNNN.onnx + .json) are written")
    p.add_argument("--init", default=None, help="the first model to start from (default: the shipped model)")
    p.add_argument("--router", default=None, help="the router's base URL: each candidate is handed over as the A/B treatment "
                   "(POST /admin/policy/reload); the router needs --ab-treatment and ab_auto_promote")
    p.add_argument("--admin-token", default=None, help="bearer token of the router's admin API (else ROUTEWISE_ADMIN_TOKEN)")
    p.add_argument("--every-records", type=int, default=5000, help="fine-tune again after this many new log records (default 5000)")
    p.add_argument("--interval-s", type=float, default=30.0, help="how often to look at the log (default 30 s)")
    p.add_argument("--min-improvement", type=float, default=0.0,
                   help="hand over only candidates whose held-out error (MAE of log TTFT; with --quantile, the pinball "
                        "loss) beats the starting model's by this much")
    p.add_argument("--max-records", type=int, default=50_000, help="fit on the newest N usable records (default 50000)")
    _quantile_argument(p)
    p.add_argument("--once", action="store_true", help="one round (if due), then exit")


def _follow(args: argparse.Namespace) -> int:
    import os

    from routewise_vllm.trainer.finetune import FinetuneConfig
    from routewise_vllm.trainer.follow import Follower

    token = args.admin_token or os.environ.get("ROUTEWISE_ADMIN_TOKEN")
    follower = Follower(args.decision_log, args.models, init=args.init, router=args.router, admin_token=token,
                        every_records=args.every_records, min_improvement=args.min_improvement,
                        config=FinetuneConfig(max_records=args.max_records, quantile=args.quantile))
    if args.once:
        print(json.dumps(follower.step(), indent=2))
        return 0
    try:
        follower.run(args.interval_s)
    except KeyboardInterrupt:
        print("trainer follow: stopped", file=sys.stderr)
    return 0


FLEET_COMMANDS = {
    "finetune": ("fine-tune a model's TTFT regression on the router's decision log; export with a model card",
                 _finetune_arguments, _finetune),
    "follow": ("keep fine-tuning as the decision log grows; hand each candidate to the router as the A/B treatment",
               _follow_arguments, _follow),
}
