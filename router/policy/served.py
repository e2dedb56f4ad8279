"""The served policy: a named policy behind FallbackPolicy(least-outstanding) with its guards and
decision budget. The one builder used by the router (every arm and the shadow), the simulator and
the trainer, so every figure describes the policy the router runs.

Guards default per policy, not per router: a learned policy gets LEARNED_GUARDS, a baseline none;
an explicit setting (`guards`) applies to every arm. The budget is judged on a wall clock live
(`clock`) and on a deterministic cost model offline (`DecisionCost`), so simulations stay
reproducible on any machine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from routewise_vllm.router.policy.base import Policy
from routewise_vllm.router.policy.baselines import LeastOutstanding
from routewise_vllm.router.policy.fallback import LEARNED_GUARDS, FallbackPolicy
from routewise_vllm.router.policy.registry import is_learned, make_policy
from routewise_vllm.router.policy.types import ClusterView

GUARD_FIELDS = ("max_stats_age_s", "overload_margin", "overload_ratio", "min_confidence")
DEFAULT_BUDGET_S = 0.0005  # router/settings.py decision_budget_s


@dataclass(frozen=True, slots=True)
class DecisionCost:
    """Deterministic decision time for simulations: `base_s + per_replica_s x replicas`.

    The learned figures fit the decide p99s of tests/bench/decision_latency_learned.py on the compiled fast
    path (router/policy/fastnet.py: compiled feature rows, vectorised network, one call to the pick;
    16.0 / 57.1 / 175.8 / 324.9 us at 4 / 16 / 64 / 128 replicas, least squares, the 2-core development
    machine, 2026-11-27): the p99, because that is what the live rule judges (FallbackPolicy's rolling
    window), so a simulation falls back where the router would. A live router's decisions run on colder
    caches than this loop's (README, "The decision budget"), so at the largest fleets it may fall back
    earlier than a simulation says. Without the C extension onnxruntime and numpy decide, 3-4x slower (p99 ~600 us at 16
    replicas), and the router falls back more often than simulations say."""

    base_s: float
    per_replica_s: float

    def __call__(self, view: ClusterView) -> float:
        return self.base_s + self.per_replica_s * len(view.replicas)


LEARNED_COST = DecisionCost(13e-6, 2.46e-6)  # over a 0.5 ms budget from 198 replicas on
BASELINE_COST = DecisionCost(20e-6, 0.7e-6)


def guard_settings(name: str, explicit: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The guards `name` runs with: its kind's defaults, overridden by `explicit` (None = guard off)."""
    guards: dict[str, Any] = dict.fromkeys(GUARD_FIELDS)
    if is_learned(name):
        guards.update(LEARNED_GUARDS)
    for key, value in (explicit or {}).items():
        if key not in GUARD_FIELDS:
            raise ValueError(f"unknown guard {key!r}; known: {', '.join(GUARD_FIELDS)}")
        guards[key] = value
    return guards


def served_policy(
    name: str,
    *,
    seed: int | None = None,
    guards: Mapping[str, Any] | None = None,
    budget_s: float | None = DEFAULT_BUDGET_S,
    clock: Callable[[], float] | None = None,
    cost: Callable[[ClusterView], float] | None = None,
    primary: Policy | None = None,
) -> FallbackPolicy:
    """`name` (a baseline, `learned`, a shipped model's name or an .onnx path) as it is served.

    Live: pass `clock` (time.perf_counter). Offline: leave it out and the deterministic cost model
    for the policy's kind (LEARNED_COST / BASELINE_COST, or `cost`) times each decision.
    `primary` stands in for the policy `name` would load (the trainer's batched scores).
    """
    g = guard_settings(name, guards)
    if clock is None and cost is None:
        cost = LEARNED_COST if is_learned(name) else BASELINE_COST
    return FallbackPolicy(
        make_policy(name, seed=seed) if primary is None else primary,
        LeastOutstanding(seed=None if seed is None else seed + 1),
        budget_s=budget_s,
        clock=clock,
        cost=cost,
        max_stats_age_s=g["max_stats_age_s"],
        min_confidence=g["min_confidence"],
        overload_margin=g["overload_margin"],
        overload_ratio=g["overload_ratio"] or 0.0,
    )
