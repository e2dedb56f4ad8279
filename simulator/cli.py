"""`simulator` command line: run, compare, bench, calibrate, scenarios, replay - a thin layer over the library.

Each subcommand is one row of COMMANDS: its help line, a function adding its arguments to an argparse parser
and one running it (`run(args) -> exit code`). The work is in simulator.experiments and the other modules.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from routewise_vllm.router.policy.late_binding import LateBindingConfig
from routewise_vllm.simulator import commands, costmodel
from routewise_vllm.simulator.bench import run_bench
from routewise_vllm.simulator.commands import Command
from routewise_vllm.simulator.config import KVViewConfig
from routewise_vllm.simulator.experiments import (
    ALL,
    ExperimentError,
    compare,
    format_table,
    resolve_policies,
    resolve_scenarios,
    run_once,
    to_json,
)
from routewise_vllm.simulator.replay import DecisionLogError, read_decision_log, summarize_log
from routewise_vllm.simulator.scenario import SCENARIO_GROUPS, load_scenario, replay_scenario, scenario_names



class UsageError(Exception):
    """A bad value on the command line (exit code 2, one line)."""


# ---------------------------------------------------------------- subcommands


def _no_arguments(p: argparse.ArgumentParser) -> None:
    return None


def _split_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--split",
        choices=("eval", "train"),
        default="eval",
        help="which trace windows to draw from: eval (held-out, for reported figures; default) or train",
    )


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", required=True, help="built-in scenario name (see `simulator scenarios`) or a YAML path")
    p.add_argument("--policy", required=True, help="baseline name, `learned`, or a path to an .onnx model")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload, the engine and the policy (default 0)")
    p.add_argument("--json", action="store_true", help="print the run's figures as JSON")
    _split_argument(p)


def _run(args: argparse.Namespace) -> int:
    scenario = resolve_scenarios(args.scenario)[0]
    policy = resolve_policies(args.policy)[0]
    start = time.perf_counter()
    summary = run_once(scenario, policy, args.seed, args.split)
    wall = time.perf_counter() - start
    if args.json:
        print(to_json({"scenario": scenario, "policy": policy, "seed": args.seed, "split": args.split, **summary}))
    else:
        print(f"{scenario} / {policy} / seed {args.seed} ({args.split} split, {wall:.1f}s wall)")
        for k, v in summary.items():
            print(f"  {k:24s} {v:.6g}")
    return 0


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", "--scenarios", dest="scenario", default=ALL,
                   help="comma-separated scenario names, group names (`shapes`) or YAML paths, or `all` (default: the suite)")
    p.add_argument("--policies", default=ALL,
                   help="comma-separated policy names / .onnx paths, or `all` = every baseline + `learned` if shipped")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds 0..N-1, the same for every policy (default 3)")
    p.add_argument("--workers", type=int, default=1, help="worker processes, one (scenario, seed) per task (default 1)")
    p.add_argument("--json", action="store_true", help="print the comparison document as JSON instead of a table")
    p.add_argument("--late-binding", action="store_true",
                   help="also run every policy, heuristic or learned, behind heuristic late binding (rows `<name>+late`, simulator.late_binding)")
    p.add_argument("--late-timeout", type=float, metavar="S",
                   help="with --late-binding: a held request waits at most S seconds (the router's "
                   "--late-binding-timeout; default 2)")
    p.add_argument("--late-room", choices=["time", "tokens"],
                   help="with --late-binding: the awaiting-prefill limit in time (each replica's scaled by its speed, "
                   "the router's default late_binding_room_in_time) or in tokens (the same for every replica)")
    p.add_argument("--swap-profile", action="append", default=[], metavar="OLD=NEW",
                   help="run the replicas of profile OLD on profile NEW (a name or a YAML path, e.g. one measured on your "
                        "GPU): the same arrivals on other hardware; repeatable")
    p.add_argument("--kv-view", metavar="VIEW",
                   help="the router's picture of the replicas' prefix caches in every scenario: guess (its own index), "
                   "precise (the replicas' KV events) or lagged:S (events S seconds late); default: each scenario's "
                   "cluster.kv_view (guess unless it says)")
    p.add_argument("--warm-up", type=int, default=0, metavar="N",
                   help="serve each instance's first N requests (by arrival) as the others but leave them out of the "
                   "figures: a pool already running, its caches warm and queues settled (default 0: every replica "
                   "starts empty and idle, and the first second's burst counts)")
    _split_argument(p)  # fmt: skip


def _profile_swap(items: list[str]) -> dict[str, str]:
    swap = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise UsageError(f"--swap-profile takes OLD=NEW, got {item!r}")
        try:
            costmodel.load_profile(new)
        except (OSError, ValueError) as e:
            raise UsageError(f"--swap-profile {item}: {e}") from None
        swap[old] = str(Path(new).resolve()) if new.endswith((".yaml", ".yml")) else new
    return swap


def _compare(args: argparse.Namespace) -> int:
    if args.seeds < 1:
        raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    scenarios = resolve_scenarios(args.scenario)
    policies = resolve_policies(args.policies)
    swap = _profile_swap(args.swap_profile)
    used = {g.profile for name in scenarios for g in load_scenario(name).cluster.replicas}
    for old in swap:
        if old not in used:
            raise UsageError(f"--swap-profile {old}=...: no chosen scenario has replicas on profile {old!r} "
                             f"(they use: {', '.join(sorted(used))})")
    if args.kv_view is not None:
        try:
            KVViewConfig.parse(args.kv_view)
        except ValueError as e:
            raise UsageError(f"--kv-view: {e}") from None
    if args.warm_up < 0:
        raise UsageError(f"--warm-up must be >= 0 requests, got {args.warm_up}")
    late: bool | LateBindingConfig = args.late_binding
    for flag, value in (("--late-timeout", args.late_timeout), ("--late-room", args.late_room)):
        if value is not None and not args.late_binding:
            raise UsageError(f"{flag} applies to --late-binding runs: add --late-binding")
    if args.late_timeout is not None and not args.late_timeout >= 0:
        raise UsageError(f"--late-timeout must be >= 0 seconds, got {args.late_timeout}")
    if args.late_timeout is not None or args.late_room is not None:
        default = LateBindingConfig()
        late = LateBindingConfig(timeout_s=default.timeout_s if args.late_timeout is None else args.late_timeout,
                                 room_in_time=args.late_room != "tokens")
    start = time.perf_counter()
    doc = compare(scenarios, policies, args.seeds, split=args.split, workers=args.workers, late_binding=late,
                  profile_swap=swap, kv_view=args.kv_view, warm_up=args.warm_up)
    wall = time.perf_counter() - start
    if args.json:
        print(to_json(doc))
    else:
        print(format_table(doc))
        print(
            f"\n{len(scenarios)} scenario(s) x {len(policies)} policies x {args.seeds} seed(s), {args.split} split, "
            f"means over seeds; p99/best = p99 TTFT / best heuristic's p99 TTFT; {wall:.1f}s wall"
        )
        for old, new in swap.items():
            print(f"replicas on {old} ran on {new}")
        if args.kv_view is not None:
            print(f"the routers' view of the prefix caches: {doc['kv_view']}")
        if args.warm_up:
            print(f"each instance's first {args.warm_up} requests were served but not scored (--warm-up)")
    return 0


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=20000, help="simulated requests (default 20000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON only")


def _bench(args: argparse.Namespace) -> int:
    result = run_bench(n_requests=args.requests, seed=args.seed)
    if args.json:
        print(to_json(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0


CALIBRATION_COLUMNS = ("prefill_tokens", "decode_seqs", "context_tokens", "seconds")


def _calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--measurements",
        required=True,
        help="CSV of single-iteration timings of a real vLLM server, header " + ",".join(CALIBRATION_COLUMNS),
    )
    p.add_argument("--profile", required=True, help="profile to start from: a name in simulator/profiles/ or a YAML path")
    p.add_argument("-o", "--output", required=True, help="where to write the fitted profile YAML")
    p.add_argument("--name", help="name of the fitted profile (default: <profile>-calibrated)")


def read_measurements(path: str) -> list[tuple[float, float, float, float]]:
    """Rows of CALIBRATION_COLUMNS; a bad row raises UsageError naming file, line, field and value."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"measurements file {path!r} not found")
    rows = []
    with file.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in CALIBRATION_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise UsageError(f"{file.name}:1: missing column(s) {', '.join(missing)}; header must name " + ",".join(CALIBRATION_COLUMNS))
        for row in reader:
            values = []
            for col in CALIBRATION_COLUMNS:
                try:
                    v = float(row[col])
                except (TypeError, ValueError):
                    v = math.nan
                if not math.isfinite(v) or v < 0:
                    raise UsageError(f"{file.name}:{reader.line_num}: field {col!r}: expected a non-negative number, got {row[col]!r}")
                values.append(v)
            rows.append(tuple(values))
    return rows


def _calibrate(args: argparse.Namespace) -> int:
    try:
        base = costmodel.load_profile(args.profile)
    except ValueError as e:
        raise UsageError(str(e)) from None
    rows = read_measurements(args.measurements)
    try:
        fitted = costmodel.fit(base, rows)
    except ValueError as e:
        raise UsageError(f"{args.measurements}: {e}") from None
    source = Path(args.profile) if args.profile.endswith((".yaml", ".yml")) else costmodel.PROFILES_DIR / f"{args.profile}.yaml"
    doc = yaml.safe_load(source.read_text())
    doc["name"] = args.name or f"{base.name}-calibrated"
    doc["overhead_s"] = round(fitted.overhead_s, 6)
    doc["efficiency"] = {"prefill_mfu": round(fitted.prefill_mfu, 4), "decode_bw_util": round(fitted.decode_bw_util, 4)}
    doc["calibrated_from"] = {"measurements": str(args.measurements), "rows": len(rows), "base_profile": base.name}
    Path(args.output).write_text(yaml.safe_dump(doc, sort_keys=False))
    print(
        f"wrote {args.output}: overhead {fitted.overhead_s * 1e3:.2f} ms (was {base.overhead_s * 1e3:.2f}), "
        f"prefill MFU {fitted.prefill_mfu:.3f} (was {base.prefill_mfu:.3f}), "
        f"decode bandwidth utilisation {fitted.decode_bw_util:.3f} (was {base.decode_bw_util:.3f}) from {len(rows)} rows"
    )
    return 0


def _scenarios(args: argparse.Namespace) -> int:
    for name in scenario_names():
        print(f"{name:20s} {load_scenario(name).spec.description.splitlines()[0]}")
    for group, about in SCENARIO_GROUPS.items():
        print(f"\ngroup `{group}` (not in `all`; select with --scenario {group}): {about}")
        for name in scenario_names(group):
            print(f"{name:20s} {load_scenario(name).spec.description.splitlines()[0]}")
    return 0


# ---------------------------------------------------------------- `simulator replay`


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Read a live router's decision log (router serve --decision-log DIR) as a workload: print its "
                     "summary, write a scenario YAML replaying it (--out), and optionally simulate policies on it.")
    p.add_argument("log", help="decision log directory or one decisions-NNNNNN.jsonl file")
    p.add_argument("--cluster", default="steady-chat", help="scenario whose cluster, SLOs and seeds to use (default steady-chat)")
    p.add_argument("--out", help="write the replay scenario YAML here (use it with simulator run/compare, trainer evaluate)")
    p.add_argument("--policy", action="append", default=[], help="also simulate this policy on the log (repeatable)")
    p.add_argument("--split", choices=["train", "eval"], default="eval", help="split to simulate with --policy")
    p.add_argument("--seed", type=int, default=0)


def _replay(args: argparse.Namespace) -> int:
    try:
        logged = read_decision_log(args.log)
    except DecisionLogError as exc:
        raise UsageError(str(exc)) from None
    print(json.dumps({"log": str(args.log), **summarize_log(logged)}, indent=2))
    doc = replay_scenario(args.log, args.cluster)
    path = args.out
    if path:
        Path(path).write_text(yaml.safe_dump(doc, sort_keys=False))
        print(f"wrote scenario {path}")
    if args.policy:
        with tempfile.TemporaryDirectory() as tmp:
            scenario = path or str(Path(tmp) / "replay.yaml")
            if not path:
                Path(scenario).write_text(yaml.safe_dump(doc, sort_keys=False))
            for policy in args.policy:
                summary = run_once(scenario, policy, args.seed, split=args.split)
                print(json.dumps({"policy": policy, **{k: summary.get(k) for k in (
                    "requests", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s", "goodput", "throughput_rps")}}))
    return 0


COMMANDS: dict[str, Command] = {
    "run": Command("simulate one scenario with one policy and one seed", _run_arguments, _run, reads_traces=True),
    "compare": Command(
        "compare policies on scenarios over seeds (same arrivals for every policy)", _compare_arguments, _compare,
        reads_traces=True,
    ),
    "bench": Command("simulated requests per CPU-second of the engine", _bench_arguments, _bench),
    "calibrate": Command(
        "fit a cost-model profile to measurements of a real vLLM server", _calibrate_arguments, _calibrate
    ),
    "scenarios": Command("list the built-in scenarios", _no_arguments, _scenarios),
    "replay": Command(
        "a live router's decision log as a workload: summary, replay scenario YAML, simulated policies",
        _replay_arguments,
        _replay,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    return commands.build_parser(
        "simulator", "Discrete-event simulator of vLLM replica fleets: scenarios, policy comparisons, benchmarks.", COMMANDS
    )


def main(argv: Sequence[str] | None = None) -> int:
    return commands.run_command(build_parser(), COMMANDS, argv, (UsageError, ExperimentError))


if __name__ == "__main__":
    raise SystemExit(main())
