"""`simulator` command line: run, compare, bench, calibrate (+ subcommands other modules register).

Each subcommand is one row of COMMANDS: its help line and two "module:function" targets, one adding its
arguments to an argparse parser and one running it (`run(args) -> exit code`). Targets are imported only
for the subcommand being run, so `import simulator.cli` pulls in neither aiohttp nor the engine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

ALL = "all"
EXIT_USAGE = 2


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: str  # "module:function(parser)"
    run: str  # "module:function(args) -> int"


COMMANDS: dict[str, Command] = {
    "run": Command("simulate one scenario with one policy and one seed", "simulator.cli:_run_arguments", "simulator.cli:_run"),
    "compare": Command(
        "compare policies on scenarios over seeds (same arrivals for every policy)",
        "simulator.cli:_compare_arguments",
        "simulator.cli:_compare",
    ),
    "bench": Command("simulated requests per CPU-second of the engine", "simulator.cli:_bench_arguments", "simulator.cli:_bench"),
    "calibrate": Command(
        "fit a cost-model profile to measurements of a real vLLM server",
        "simulator.cli:_calibrate_arguments",
        "simulator.cli:_calibrate",
    ),
    "scenarios": Command("list the built-in scenarios", "simulator.cli:_no_arguments", "simulator.cli:_scenarios"),
    # `replay` registers below; the live-fleet tools (emulate, loadgen, demo) are the `fleet` command.
}


class UsageError(Exception):
    """A bad value on the command line (exit code 2, one line)."""


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="simulator",
        description="Discrete-event simulator of vLLM replica fleets: scenarios, policy comparisons, benchmarks.",
        epilog="Run `simulator <command> --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if name == command:  # only the chosen subcommand's module is imported
            _resolve(cmd.add_arguments)(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    try:
        return int(_resolve(COMMANDS[args.command].run)(args) or 0)
    except UsageError as e:
        print(f"simulator {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


# ---------------------------------------------------------------- name resolution (cheap, no engine)


def resolve_scenarios(text: str) -> list[str]:
    """Scenario names/paths from a comma list or `all`; each is parsed now, so a bad one fails before any run."""
    from simulator.scenario import ScenarioError, load_scenario, scenario_names

    names = scenario_names() if text == ALL else [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise UsageError("no scenario given")
    for name in names:
        try:
            load_scenario(name)
        except ScenarioError as e:
            raise UsageError(str(e)) from None
    return names


def resolve_policies(text: str) -> list[str]:
    from router.policy.registry import BASELINES, DEFAULT_MODEL_PATH, LEARNED, policy_names

    if text == ALL:
        return list(BASELINES) + ([LEARNED] if DEFAULT_MODEL_PATH.is_file() else [])
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise UsageError("no policy given")
    for name in names:
        if name in BASELINES:
            continue
        if name == LEARNED and not DEFAULT_MODEL_PATH.is_file():
            raise UsageError(f"policy 'learned': no shipped model at {DEFAULT_MODEL_PATH} (train and export one first)")
        if name.endswith(".onnx"):
            from pathlib import Path

            if not Path(name).is_file():
                raise UsageError(f"policy model file {name!r} not found")
            continue
        if name != LEARNED:
            raise UsageError(f"unknown policy {name!r}; known: {', '.join(policy_names())} or a path to an .onnx file")
    return names


def _is_heuristic(policy: str) -> bool:
    from router.policy.registry import BASELINES

    return policy in BASELINES


# ---------------------------------------------------------------- running and comparing


def run_once(scenario: str, policy: str, seed: int, split: str = "eval", library=None) -> dict[str, float]:
    """Simulate one (scenario, policy, seed) and summarise it (see simulator.metrics.summarize)."""
    return _run_policies(scenario, [policy], seed, split, library)[policy]


def _run_policies(scenario: str, policies: Sequence[str], seed: int, split: str, library=None) -> dict[str, dict]:
    """All `policies` on the same requests of (scenario, seed): built once, simulated once per policy."""
    import numpy as np

    from router.policy.registry import make_served_policy
    from simulator.cluster import simulate
    from simulator.metrics import summarize
    from simulator.scenario import load_scenario

    sc = load_scenario(scenario, split=split, library=library)
    cluster, requests = sc.build(np.random.default_rng(seed))
    out = {}
    for name in policies:
        records = simulate(cluster, requests, make_served_policy(name, seed=seed), seed=seed)
        out[name] = summarize(records, sc.slo, replica_ids=_replica_ids(cluster))
    return out


def _replica_ids(cluster) -> list[str]:
    """Every replica's id, so that one that got no request still counts in the load imbalance."""
    from simulator.cluster import ClusterSim

    return list(ClusterSim(cluster, [], seed=0).replica_ids)


def _task(args: tuple[str, tuple[str, ...], int, str]) -> tuple[str, int, dict[str, dict]]:
    scenario, policies, seed, split = args
    return scenario, seed, _run_policies(scenario, policies, seed, split)


RESULT_FIELDS = ("ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "e2e_p99_s", "goodput", "throughput_rps")


def compare(
    scenarios: Sequence[str],
    policies: Sequence[str],
    seeds: int | Sequence[int],
    split: str = "eval",
    workers: int = 1,
    progress: bool = True,
) -> dict:
    """Every policy on every scenario for each seed; seeds fix the arrivals, so policies see the same requests.

    Returns `{"results": [{scenario, policy, seeds, ttft_p50_s, ttft_p99_s, tpot_p99_s, e2e_p99_s, goodput,
    throughput_rps, <each>_ci95, ttft_p99_vs_best_heuristic, metrics: {all aggregated figures}}, ...]}`,
    one record per (scenario, policy), averaged over seeds with 95 % t-interval half-widths.
    """
    from tqdm import tqdm

    from simulator.metrics import aggregate

    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    tasks = [(s, tuple(policies), seed, split) for s in scenarios for seed in seed_list]
    runs: dict[tuple[str, str], list[dict]] = {(s, p): [] for s in scenarios for p in policies}
    bar = tqdm(total=len(tasks) * len(policies), desc="simulating", unit="run", disable=not progress, file=sys.stderr)
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=workers) as pool:
            done = list(_progress(pool.map(_task, tasks), bar, len(policies)))
    else:
        done = list(_progress(map(_task, tasks), bar, len(policies)))
    bar.close()
    for scenario, _seed, per_policy in sorted(done, key=lambda d: (d[0], d[1])):
        for policy, summary in per_policy.items():
            runs[(scenario, policy)].append(summary)

    results = []
    for scenario in scenarios:
        rows = []
        for policy in policies:
            agg = aggregate(runs[(scenario, policy)])
            row = {"scenario": scenario, "policy": policy, "seeds": len(seed_list)}
            row |= {k: agg[k] for k in RESULT_FIELDS}
            row |= {f"{k}_ci95": agg[f"{k}_ci95"] for k in RESULT_FIELDS}
            row["metrics"] = agg
            rows.append(row)
        heuristic = [r["ttft_p99_s"] for r in rows if _is_heuristic(r["policy"]) and not math.isnan(r["ttft_p99_s"])]
        best = min(heuristic) if heuristic else math.nan
        for r in rows:
            r["ttft_p99_vs_best_heuristic"] = r["ttft_p99_s"] / best if best and best > 0 else math.nan
        results.extend(rows)
    return {"split": split, "seeds": seed_list, "results": results}


def _progress(iterable, bar, step: int):
    for item in iterable:
        bar.update(step)
        yield item


def format_table(doc: dict) -> str:
    from simulator.metrics import render_table

    head = ("scenario", "policy", "TTFT p50", "TTFT p99", "TPOT p99", "E2E p99", "goodput", "req/s", "p99/best")
    rows = [head]
    for r in doc["results"]:
        rows.append(
            (
                r["scenario"],
                r["policy"],
                _ms(r["ttft_p50_s"]),
                _ms(r["ttft_p99_s"]),
                _ms(r["tpot_p99_s"]),
                f"{r['e2e_p99_s']:.2f}s",
                f"{r['goodput']:.3f}",
                f"{r['throughput_rps']:.2f}",
                f"{r['ttft_p99_vs_best_heuristic']:.2f}",
            )
        )
    return render_table(rows)


def _ms(seconds: float) -> str:
    return "nan" if math.isnan(seconds) else f"{seconds * 1000:.0f}ms"


def _json(doc) -> str:
    """JSON with NaN written as null (strict JSON)."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(doc), indent=2)


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
        print(_json({"scenario": scenario, "policy": policy, "seed": args.seed, "split": args.split, **summary}))
    else:
        print(f"{scenario} / {policy} / seed {args.seed} ({args.split} split, {wall:.1f}s wall)")
        for k, v in summary.items():
            print(f"  {k:24s} {v:.6g}")
    return 0


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", "--scenarios", dest="scenario", default=ALL,
                   help="comma-separated scenario names or YAML paths, or `all` (default)")
    p.add_argument("--policies", default=ALL,
                   help="comma-separated policy names / .onnx paths, or `all` = every baseline + `learned` if shipped")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds 0..N-1, the same for every policy (default 3)")
    p.add_argument("--workers", type=int, default=1, help="worker processes, one (scenario, seed) per task (default 1)")
    p.add_argument("--json", action="store_true", help="print the comparison document as JSON instead of a table")
    _split_argument(p)  # fmt: skip


def _compare(args: argparse.Namespace) -> int:
    if args.seeds < 1:
        raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    scenarios = resolve_scenarios(args.scenario)
    policies = resolve_policies(args.policies)
    start = time.perf_counter()
    doc = compare(scenarios, policies, args.seeds, split=args.split, workers=args.workers)
    wall = time.perf_counter() - start
    if args.json:
        print(_json(doc))
    else:
        print(format_table(doc))
        print(
            f"\n{len(scenarios)} scenario(s) x {len(policies)} policies x {args.seeds} seed(s), {args.split} split, "
            f"means over seeds; p99/best = p99 TTFT / best heuristic's p99 TTFT; {wall:.1f}s wall"
        )
    return 0


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=20000, help="simulated requests (default 20000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON only")


def _bench(args: argparse.Namespace) -> int:
    from simulator.bench import run_bench

    result = run_bench(n_requests=args.requests, seed=args.seed)
    if args.json:
        print(_json(result))
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
    import csv
    from pathlib import Path

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
    from pathlib import Path

    import yaml

    from simulator import costmodel

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
    from simulator.scenario import load_scenario, scenario_names

    for name in scenario_names():
        print(f"{name:20s} {load_scenario(name).spec.description.splitlines()[0]}")
    return 0


# ---------------------------------------------------------------- decision-log replay

COMMANDS["replay"] = Command(
    "a live router's decision log as a workload: summary, replay scenario YAML, simulated policies",
    "simulator.replay:add_arguments",
    "simulator.replay:run",
)


if __name__ == "__main__":
    raise SystemExit(main())
