"""Shadow evaluation: a second policy decides on every request without acting.

The shadow is wrapped in its own FallbackPolicy (same budget and guards as a live policy),
so what it "chooses" is what it would really route if promoted, and a broken shadow model
costs one fallback count, never a request. Call `observe` after the real decision with the
same (immutable) view; the router schedules it after the request has been sent upstream.
"""

from __future__ import annotations

from dataclasses import dataclass

from routewise_vllm.router.policy.fallback import FallbackPolicy
from routewise_vllm.router.policy.types import ClusterView, Outcome, RequestInfo


@dataclass(frozen=True, slots=True)
class ShadowResult:
    index: int
    replica_id: str
    agree: bool
    load_delta: int  # outstanding on the shadow's pick minus on the actual pick
    fallback_reason: str | None
    elapsed_s: float | None

    def as_log(self) -> dict:
        return {"index": self.index, "replica": self.replica_id, "agree": self.agree, "fallback": self.fallback_reason}


class ShadowEvaluator:
    def __init__(self, policy: FallbackPolicy, label: str, metrics=None) -> None:
        self.policy = policy
        self.label = label
        self.metrics = metrics  # router.serving.metrics.ServingMetrics or None
        self.decisions = 0
        self.agreements = 0
        self.fallbacks: dict[str, int] = {}
        self.last_error: str | None = None

    def observe(self, view: ClusterView, request: RequestInfo, actual_index: int, actual_policy: str) -> ShadowResult | None:
        """The shadow's choice on `view`, compared with the replica actually picked. Never raises."""
        try:
            d = self.policy.decide(view, request)
        except Exception as exc:  # noqa: BLE001 - even the fallback failing (no healthy replica) must not hurt the request
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None
        reps = view.replicas
        agree = d.index == actual_index
        delta = reps[d.index].outstanding - reps[actual_index].outstanding
        self.decisions += 1
        self.agreements += agree
        if d.fallback_reason is not None:
            self.fallbacks[d.fallback_reason] = self.fallbacks.get(d.fallback_reason, 0) + 1
            if d.error:
                self.last_error = d.error
        m = self.metrics
        if m is not None:
            m.shadow_decisions.labels(actual_policy, self.label, "agree" if agree else "disagree").inc()
            if not agree:
                m.shadow_load_delta.labels(actual_policy, self.label).observe(delta)
            if d.fallback_reason is not None:
                m.shadow_fallbacks.labels(self.label, d.fallback_reason).inc()
        return ShadowResult(d.index, reps[d.index].replica_id, agree, delta, d.fallback_reason, d.elapsed_s)

    def on_complete(self, replica_id: str, request: RequestInfo, outcome: Outcome) -> None:
        try:
            self.policy.on_complete(replica_id, request, outcome)
        except Exception as exc:  # noqa: BLE001
            self.last_error = f"{type(exc).__name__}: {exc}"

    def describe(self) -> dict:
        return {
            "policy": self.label,
            "describe": self.policy.describe(),
            "decisions": self.decisions,
            "agreement_rate": self.agreements / self.decisions if self.decisions else None,
            "fallbacks": dict(self.fallbacks),
            "last_error": self.last_error,
        }
