"""Experiments on the simulator: one run, a policy comparison over scenarios and seeds, its table and JSON.

The library behind `simulator run|compare` and `trainer evaluate`; names are checked up front
(`resolve_scenarios`, `resolve_policies`) so a bad one fails before any run, with an `ExperimentError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from routewise_vllm.router.policy.registry import (BASELINES, DEFAULT_MODEL_PATH, GATED, GATED_PREFIX, LEARNED,
                                                    check_policy_name, policy_names)
from routewise_vllm.router.policy.served import served_policy
from routewise_vllm.router.policy.late_binding import LateBindingConfig
from routewise_vllm.simulator.cluster import ClusterSim, simulate
from routewise_vllm.simulator.config import KVViewConfig
from routewise_vllm.simulator.late_binding import LATE_SUFFIX, simulate_late
from routewise_vllm.simulator.metrics import aggregate, render_table, summarize
from routewise_vllm.simulator.scenario import SCENARIO_GROUPS, ScenarioError, load_scenario, scenario_names

ALL = "all"


class ExperimentError(ValueError):
    """A bad scenario or policy name (the CLIs print it as a one-line usage error)."""


# ---------------------------------------------------------------- name resolution (cheap, no engine)


def resolve_scenarios(text: str) -> list[str]:
    """Scenario names/paths from a comma list, `all` (the default suite) or a group name of SCENARIO_GROUPS
    (its scenarios; items may mix, e.g. `shapes,steady-chat` or `all,shapes`); each is parsed now, so a bad one fails
    before any run."""
    names: list[str] = []
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        group = scenario_names() if item == ALL else scenario_names(item) if item in SCENARIO_GROUPS else [item]
        names.extend(n for n in group if n not in names)
    if not names:
        raise ExperimentError("no scenario given")
    for name in names:
        try:
            load_scenario(name)
        except ScenarioError as e:
            raise ExperimentError(str(e)) from None
    return names


def resolve_policies(text: str) -> list[str]:
    if text == ALL:
        return list(BASELINES) + ([LEARNED] if DEFAULT_MODEL_PATH.is_file() else [])
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ExperimentError("no policy given")
    for name in names:
        if name in BASELINES:
            continue
        if name.startswith(GATED_PREFIX):
            try:
                check_policy_name(name, "policy")
            except ValueError as e:
                raise ExperimentError(str(e)) from None
            continue
        if name == LEARNED and not DEFAULT_MODEL_PATH.is_file():
            raise ExperimentError(f"policy 'learned': no shipped model at {DEFAULT_MODEL_PATH} (train and export one first)")
        if name.endswith(".onnx"):
            if not Path(name).is_file():
                raise ExperimentError(f"policy model file {name!r} not found")
            continue
        if name not in (LEARNED, GATED):
            raise ExperimentError(f"unknown policy {name!r}; known: {', '.join(policy_names())} or a path to an .onnx file")
    return names


# ---------------------------------------------------------------- running and comparing


def run_once(scenario: str, policy: str, seed: int, split: str = "eval", library=None) -> dict[str, float]:
    """Simulate one (scenario, policy, seed) and summarise it (see simulator.metrics.summarize)."""
    return run_policies(scenario, [policy], seed, split, library)[policy]


def run_policies(
    scenario: str,
    policies: Sequence[str],
    seed: int,
    split: str,
    library=None,
    late_binding: bool | LateBindingConfig = False,
    profile_swap: Mapping[str, str] | None = None,
    kv_view: str | None = None,
    warm_up: int = 0,
) -> dict[str, dict]:
    """All `policies` on the same requests of (scenario, seed): built once, simulated once per policy.
    With `late_binding` (True: the router's defaults, or a LateBindingConfig), every policy (heuristic or learned)
    also runs behind late binding, as `<name>+late`; with `profile_swap`
    ({OLD: NEW}) the scenario's replicas on profile OLD run on NEW (`Scenario.with_profiles`); with `kv_view`
    (`guess`, `precise`, `lagged:S`) the router's picture of the caches is that one (`Scenario.with_kv_view`); with
    `warm_up` the first that many requests are served but not scored (`Scenario.with_warm_up`)."""
    sc = load_scenario(scenario, split=split, library=library)
    if profile_swap:
        sc = sc.with_profiles(profile_swap)
    if kv_view is not None:
        sc = sc.with_kv_view(KVViewConfig.parse(kv_view))
    try:
        cluster, requests = sc.with_warm_up(warm_up).build(np.random.default_rng(seed))
    except ValueError as e:  # the warm-up leaves nothing to score
        raise ExperimentError(str(e)) from None
    out = {}
    for name in policies:
        policy = served_policy(name, seed=seed)  # guards + deterministic decision-cost budget, as the router serves it
        records = simulate(cluster, requests, policy, seed=seed)
        out[name] = summarize(records, sc.slo, replica_ids=_replica_ids(cluster)) | {"fallback_share": policy.fallback_share}
        if late_binding:
            policy = served_policy(name, seed=seed)
            config = late_binding if isinstance(late_binding, LateBindingConfig) else None
            records, reasons = simulate_late(cluster, requests, policy, seed=seed, late=config)
            n = max(1, len(requests))
            out[name + LATE_SUFFIX] = summarize(records, sc.slo, replica_ids=_replica_ids(cluster)) | {
                "fallback_share": policy.fallback_share,
                "held_share": reasons["held_requests"] / n,
                "timeout_share": reasons["timeout"] / n,
                "full_share": reasons["full"] / n,
            }
    return out


def _replica_ids(cluster) -> list[str]:
    """Every replica's id, so that one that got no request still counts in the load imbalance."""
    return list(ClusterSim(cluster, [], seed=0).replica_ids)


def _task(args: tuple) -> tuple[str, int, dict[str, dict]]:
    scenario, policies, seed, split, late_binding, profile_swap, kv_view, warm_up = args
    return scenario, seed, run_policies(scenario, policies, seed, split, late_binding=late_binding,
                                        profile_swap=dict(profile_swap), kv_view=kv_view, warm_up=warm_up)


RESULT_FIELDS = ("ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "e2e_p99_s", "goodput", "throughput_rps")


def compare(
    scenarios: Sequence[str],
    policies: Sequence[str],
    seeds: int | Sequence[int],
    split: str = "eval",
    workers: int = 1,
    progress: bool = True,
    late_binding: bool | LateBindingConfig = False,
    executor: Executor | None = None,
    profile_swap: Mapping[str, str] | None = None,
    kv_view: str | None = None,
    warm_up: int = 0,
) -> dict:
    """Every policy on every scenario for each seed; seeds fix the arrivals, so policies see the same requests.

    The (scenario, seed) tasks run in `workers` local processes, or through `executor.map` when given
    (e.g. trainer.ray_backend.RayExecutor: Ray tasks); the result does not depend on where they ran.

    Returns `{"results": [{scenario, policy, seeds, ttft_p50_s, ttft_p99_s, tpot_p99_s, e2e_p99_s, goodput,
    throughput_rps, <each>_ci95, ttft_p99_vs_best_heuristic, metrics: {all aggregated figures}}, ...]}`,
    one record per (scenario, policy), averaged over seeds with 95 % t-interval half-widths. With
    `profile_swap` ({OLD: NEW}) every scenario runs with its OLD replicas on profile NEW (the document says so);
    with `kv_view` (`guess`, `precise`, `lagged:S`) every scenario's router sees the caches so (the document says so);
    with `warm_up` every instance's first that many requests are served but not scored (the document says so).
    """
    if warm_up < 0:
        raise ExperimentError(f"warm-up must be >= 0 requests, got {warm_up}")
    if kv_view is not None:
        try:
            KVViewConfig.parse(kv_view)
        except ValueError as e:
            raise ExperimentError(str(e)) from None
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    swap = tuple(sorted((profile_swap or {}).items()))
    tasks = [(s, tuple(policies), seed, split, late_binding, swap, kv_view, warm_up) for s in scenarios
             for seed in seed_list]
    if late_binding:
        policies = list(policies) + [p + LATE_SUFFIX for p in policies]
    runs: dict[tuple[str, str], list[dict]] = {(s, p): [] for s in scenarios for p in policies}
    bar = tqdm(total=len(tasks) * len(policies), desc="simulating", unit="run", disable=not progress, file=sys.stderr)
    if executor is not None:
        done = list(_progress(executor.map(_task, tasks), bar, len(policies)))
    elif workers > 1:
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
            row["fallback_share"] = agg["fallback_share"]
            row["metrics"] = agg
            rows.append(row)
        heuristic = [r["ttft_p99_s"] for r in rows if r["policy"] in BASELINES and not math.isnan(r["ttft_p99_s"])]
        best = min(heuristic) if heuristic else math.nan
        for r in rows:
            r["ttft_p99_vs_best_heuristic"] = r["ttft_p99_s"] / best if best and best > 0 else math.nan
        results.extend(rows)
    doc = {"split": split, "seeds": seed_list, "results": results}
    if late_binding:  # the rule's settings the `+late` rows ran under
        doc["late_binding"] = dataclasses.asdict(late_binding if isinstance(late_binding, LateBindingConfig)
                                                 else LateBindingConfig())
    if swap:
        doc["profile_swap"] = dict(swap)
    if kv_view is not None:
        doc["kv_view"] = KVViewConfig.parse(kv_view).label()
    if warm_up:
        doc["warm_up_requests"] = warm_up
    return doc


def _progress(iterable, bar, step: int):
    for item in iterable:
        bar.update(step)
        yield item


def format_table(doc: dict) -> str:
    """One row per (scenario, policy); with late-binding rows, a `held` column: the share of requests the router
    held, and of those that left at the queue timeout (`-` for per-request rows)."""
    late = any("held_share" in r["metrics"] for r in doc["results"])
    head = ("scenario", "policy", "TTFT p50", "TTFT p99", "TPOT p99", "E2E p99", "goodput", "req/s", "p99/best", "fallback")
    rows = [head + (("held / timed out",) if late else ())]
    for r in doc["results"]:
        m = r["metrics"]
        held = (f"{m['held_share']:.0%} / {m['timeout_share']:.0%}" if "held_share" in m else "-",) if late else ()
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
                f"{r['fallback_share']:.1%}",
            )
            + held
        )
    return render_table(rows)


def _ms(seconds: float) -> str:
    return "nan" if math.isnan(seconds) else f"{seconds * 1000:.0f}ms"


def to_json(doc) -> str:
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
