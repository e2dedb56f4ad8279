"""Prometheus metrics of the serving layer, registered on the app's own registry.

Names are a contract with deploy/ (dashboards, alerts). Counters are named without `_total`
(prometheus_client appends it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Outstanding-count difference (shadow's pick minus the actual pick) when they disagree.
LOAD_DELTA_BUCKETS = (-64.0, -32.0, -16.0, -8.0, -4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
RELOAD_RESULTS = ("ok", "unavailable", "spec_mismatch", "nan", "exception", "not_reloadable")


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.shadow_decisions = Counter(
            "llm_router_shadow_decisions", "Shadow-policy decisions, by whether they agree with the replica actually picked.",
            ["policy", "shadow_policy", "agreement"], registry=r,
        )
        self.shadow_load_delta = Histogram(
            "llm_router_shadow_disagreement_load_delta",
            "On disagreement: outstanding requests on the shadow's pick minus on the actual pick.",
            ["policy", "shadow_policy"], buckets=LOAD_DELTA_BUCKETS, registry=r,
        )
        self.shadow_fallbacks = Counter(
            "llm_router_shadow_fallbacks", "Shadow decisions its fallback (LOR) made instead of the shadow policy, by reason.",
            ["shadow_policy", "reason"], registry=r,
        )
        self.ab_rollback_active = Gauge(
            "llm_router_ab_rollback_active", "1 while the A/B rollback guard sends all traffic to control.", registry=r,
        )
        self.ab_treatment_share = Gauge(
            "llm_router_ab_treatment_share", "Share of request keys routed by the treatment arm now (0 after a rollback).",
            registry=r,
        )
        self.ab_configured_share = Gauge(
            "llm_router_ab_configured_share", "Treatment share as configured (--ab-share).", registry=r,
        )
        self.ab_rollbacks = Counter("llm_router_ab_rollbacks", "Times the rollback guard tripped, by cause.", ["cause"], registry=r)
        self.ab_window_ttft_p99 = Gauge(
            "llm_router_ab_window_ttft_p99_seconds", "p99 time to first byte over the guard's sliding window, per arm.",
            ["arm"], registry=r,
        )
        self.ab_window_error_ratio = Gauge(
            "llm_router_ab_window_error_ratio", "Failed requests / requests over the guard's sliding window, per arm.",
            ["arm"], registry=r,
        )
        self.decision_log_records = Counter(
            "llm_router_decision_log_records", "Decision records written to the decision log.", registry=r,
        )
        self.decision_log_dropped = Counter(
            "llm_router_decision_log_dropped", "Decision records not written, by reason (queue_full, not_running, encode_error, no_space, "
            "write_error); requests never wait.",
            ["reason"], registry=r,
        )
        self.policy_reloads = Counter(
            "llm_router_policy_reload", "Policy reload attempts by result (ok, or why the new file was refused).",
            ["result"], registry=r,
        )
        # candidate promotion (promotion.py); exported from the start so dashboards and alerts see zeros
        self.promotions = Counter(
            "llm_router_policy_promotions", "Candidate models promoted to primary or rolled back by the A/B guard.",
            ["result"], registry=r,
        )
        self.candidate_state = Gauge(
            "llm_router_policy_candidate_state", "1 for the promotion controller's current state (idle without auto-promotion).",
            ["state"], registry=r,
        )
        self.candidate_error = Gauge(
            "llm_router_policy_candidate_mae_log_ttft",
            "The current candidate's held-out mean absolute error of log TTFT from its model card, before (the model "
            "it started from) and after fine-tuning.", ["stage"], registry=r,
        )
        self.explorations = Counter(
            "llm_router_exploration_decisions", "Treatment-arm decisions sent to a random healthy replica (ab_explore_share).",
            registry=r,
        )
        for result in ("promoted", "rolled_back"):
            self.promotions.labels(result)
        for state in ("idle", "evaluating", "promoted", "rolled_back"):
            self.candidate_state.labels(state).set(1 if state == "idle" else 0)
