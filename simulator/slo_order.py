"""Deadline-first against FIFO behind late binding, on the same arrivals: which held request a freed slot takes.

    python -m routewise_vllm.simulator.slo_order SCENARIO [--policy least-outstanding] [--seeds 3] [--split eval]

A scenario with `classes` (each request drawn into a class carrying its own TTFT / TPOT targets, the live router's
x-slo-ttft-ms / x-slo-tpot-ms) is built once per seed and run twice behind late binding, with the held requests
offered earliest deadline first (the live router's order) and oldest first. Reported per order: each class's TTFT
attainment (finished with TTFT within its class's target, over the class's requests) and the goodput (requests per
second finished within both targets of their own class, the rest judged on the scenario's `slo`).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

import numpy as np

from routewise_vllm.router.policy.served import served_policy
from routewise_vllm.simulator.late_binding import simulate_late
from routewise_vllm.simulator.metrics import Slo, request_table
from routewise_vllm.simulator.scenario import ScenarioError, load_scenario
from routewise_vllm.simulator.types import RequestRecord, SimRequest
from routewise_vllm.simulator.workload import WARMUP_TENANT

ORDERS = ("fifo", "deadline")


def class_figures(records: Sequence[RequestRecord], requests: Sequence[SimRequest],
                  targets: dict[str, Slo]) -> dict[str, float]:
    """`ttft_attainment:<class>` per class and `goodput_rps` over every scored request."""
    cls = {r.request_id: r.slo_class for r in requests}
    scored = [r for r in records if r.tenant != WARMUP_TENANT]
    t = request_table(scored)
    names = np.array([cls[r.request_id] for r in scored], dtype=object)
    ttft_t = np.array([targets[c].ttft_s for c in names])
    tpot_t = np.array([targets[c].tpot_s for c in names])
    done = ~np.isnan(t["finish_s"])
    ttft_ok = done & (t["ttft_s"] <= ttft_t)
    ok = ttft_ok & (np.nan_to_num(t["tpot_s"], nan=0.0) <= tpot_t)
    span = float(np.max(t["finish_s"][done]) - np.min(t["arrival_s"])) if done.any() else math.nan
    out = {"requests": float(len(scored)), "goodput_rps": float(ok.sum()) / span if span > 0 else math.nan}
    for c in targets:
        mask = names == c
        if mask.any():
            out[f"ttft_attainment:{c or 'rest'}"] = float(ttft_ok[mask].mean())
    return out


def run(scenario: str, policy: str = "least-outstanding", seeds: Sequence[int] = (0, 1, 2),
        split: str = "eval") -> dict[str, dict[int, dict[str, float]]]:
    """{order: {seed: class_figures}}, both orders on each seed's one set of requests."""
    sc = load_scenario(scenario, split=split)
    if not sc.spec.classes:
        raise ScenarioError(f"scenario {scenario!r} has no `classes`: nothing to order by deadline")
    targets = sc.class_targets()
    out: dict[str, dict[int, dict[str, float]]] = {o: {} for o in ORDERS}
    for seed in seeds:
        cluster, requests = sc.build(np.random.default_rng(seed))
        for order in ORDERS:
            records, _ = simulate_late(cluster, requests, served_policy(policy, seed=seed), seed=seed, hold_order=order)
            out[order][seed] = class_figures(records, requests, targets)
    return out


def render(result: dict[str, dict[int, dict[str, float]]]) -> str:
    keys = sorted({k for per in result.values() for f in per.values() for k in f if k != "requests"})
    lines = ["| order | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for order, per in result.items():
        means = {k: float(np.mean([f[k] for f in per.values()])) for k in keys}
        lines.append(f"| {order} | " + " | ".join(f"{means[k]:.4f}" for k in keys) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routewise_vllm.simulator.slo_order", description=__doc__.split("\n\n")[0])
    p.add_argument("scenario")
    p.add_argument("--policy", default="least-outstanding")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--split", default="eval", choices=("train", "eval"))
    a = p.parse_args(argv)
    try:
        result = run(a.scenario, a.policy, range(a.seeds), a.split)
    except (ScenarioError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
