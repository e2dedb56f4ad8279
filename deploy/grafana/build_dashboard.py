"""Writes deploy/grafana/dashboards/routewise.json, the provisioned routewise dashboard.

The JSON is committed; edit this file and re-run it (`python deploy/grafana/build_dashboard.py`)
rather than editing the JSON by hand. tests/deploy/test_dashboard.py checks the two agree and
tests/deploy/test_observability.py runs every query against a real Prometheus.
"""

from __future__ import annotations

import json
from pathlib import Path

OUTPUT = Path(__file__).parent / "dashboards" / "routewise.json"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}  # provisioned in provisioning/datasources
RATE = "$__rate_interval"
REPLICA = 'replica=~"$replica"'
QUANTILES = (0.5, 0.9, 0.99)
LATENCIES = (
    ("TTFT", "llm_router_ttft_seconds"),
    ("Inter-token latency", "llm_router_inter_token_latency_seconds"),
    ("E2E latency", "llm_router_e2e_latency_seconds"),
)


def quantile(q: float, metric: str, by: str, selector: str = REPLICA) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{selector}}}[{RATE}])))"


def ab_ratio(metric: str, q: float = 0.99) -> str:
    arm = "histogram_quantile({q}, sum by (le) (rate({m}_bucket{{arm=\"{a}\"}}[{r}])))"
    return f"{arm.format(q=q, m=metric, a='treatment', r=RATE)} / {arm.format(q=q, m=metric, a='control', r=RATE)}"


class Layout:
    """Hands out gridPos left to right, two or three panels per row, 24 columns wide."""

    def __init__(self) -> None:
        self.y = 0
        self.x = 0
        self.row_height = 0
        self.next_id = 1

    def place(self, w: int, h: int) -> dict:
        if self.x + w > 24:
            self.y += self.row_height
            self.x, self.row_height = 0, 0
        pos = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.x += w
        self.row_height = max(self.row_height, h)
        return pos

    def row(self, title: str) -> dict:
        if self.x:
            self.y += self.row_height
        self.x, self.row_height = 0, 0
        panel = {"type": "row", "title": title, "id": self.take_id(), "collapsed": False,
                 "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}, "panels": []}
        self.y += 1
        return panel

    def take_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def panel(layout: Layout, title: str, targets: list[tuple[str, str]], unit: str, *, kind: str = "timeseries",
          w: int = 8, h: int = 8, description: str = "", max_value: float | None = None) -> dict:
    defaults: dict = {"unit": unit}
    if max_value is not None:
        defaults.update(min=0, max=max_value)
    return {
        "type": kind,
        "title": title,
        "id": layout.take_id(),
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": layout.place(w, h),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}} if kind == "timeseries" else {},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": True}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def build() -> dict:
    layout = Layout()
    panels: list[dict] = []

    panels.append(layout.row("Tail latency per arm"))
    for label, metric in LATENCIES:
        panels.append(panel(layout, f"{label} p50/p90/p99 by arm",
                            [(quantile(q, metric, "arm"), f"{{{{arm}}}} p{int(q * 100)}") for q in QUANTILES], "s",
                            description=f"Router-measured {label}, quantiles of {metric} over the rate window."))

    panels.append(layout.row("Tail latency per replica"))
    for label, metric in LATENCIES:
        panels.append(panel(layout, f"{label} p50/p90/p99 by replica",
                            [(quantile(q, metric, "replica"), f"{{{{replica}}}} p{int(q * 100)}") for q in QUANTILES],
                            "s"))

    panels.append(layout.row("Traffic, errors and fallbacks"))
    panels.append(panel(layout, "Requests by code class", [
        (f"sum by (code_class) (rate(llm_router_requests_total{{{REPLICA}}}[{RATE}]))", "{{code_class}}")],
        "reqps", description="code_class: 2xx, 4xx, 5xx, or error (transport failure / client gone)."))
    panels.append(panel(layout, "Requests by arm and replica", [
        (f"sum by (arm, replica) (rate(llm_router_requests_total{{{REPLICA}}}[{RATE}]))", "{{arm}} {{replica}}")],
        "reqps"))
    panels.append(panel(layout, "Error ratio (5xx + transport errors)", [
        (f'sum(rate(llm_router_requests_total{{code_class=~"5xx|error"}}[{RATE}]) '
         f"or rate(llm_router_requests_total[{RATE}]) * 0) / sum(rate(llm_router_requests_total[{RATE}]))",
         "error ratio")],
        "percentunit", max_value=1))
    panels.append(panel(layout, "Upstream errors by kind", [
        (f"sum by (replica, kind) (rate(llm_router_upstream_errors_total{{{REPLICA}}}[{RATE}]))",
         "{{replica}} {{kind}}")], "reqps"))
    panels.append(panel(layout, "Retries by reason", [
        (f"sum by (reason) (rate(llm_router_retries_total[{RATE}]))", "{{reason}}")], "reqps"))
    panels.append(panel(layout, "Fallbacks by reason", [
        (f"sum by (policy, reason) (rate(llm_router_fallbacks_total[{RATE}]))", "{{policy}} {{reason}}")], "reqps",
        description="Decisions where the policy's pick was replaced by least-outstanding, by why."))
    panels.append(panel(layout, "Fallback share by policy", [
        (f"sum by (policy) (rate(llm_router_fallbacks_total[{RATE}])) "
         f"/ sum by (policy) (rate(llm_router_requests_total[{RATE}]))", "{{policy}}")], "percentunit",
        max_value=1))

    panels.append(layout.row("Policy"))
    panels.append(panel(layout, "Decision latency p99", [
        (f"histogram_quantile(0.99, sum by (le, policy) (rate(llm_router_decision_latency_seconds_bucket[{RATE}])))",
         "{{policy}} p99"),
        (f"histogram_quantile(0.5, sum by (le, policy) (rate(llm_router_decision_latency_seconds_bucket[{RATE}])))",
         "{{policy}} p50")], "s"))
    panels.append(panel(layout, "Shadow agreement rate", [
        (f'sum by (policy, shadow_policy) (rate(llm_router_shadow_decisions_total{{agreement="agree"}}[{RATE}]) '
         f"or rate(llm_router_shadow_decisions_total[{RATE}]) * 0) "
         f"/ sum by (policy, shadow_policy) (rate(llm_router_shadow_decisions_total[{RATE}]))",
         "{{policy}} vs shadow {{shadow_policy}}")], "percentunit", max_value=1,
        description="Share of requests where the shadow policy would have picked the same replica."))
    panels.append(panel(layout, "Policy in service", [
        ("max by (arm, name, version, feature_hash) (llm_router_policy_info)",
         "{{arm}}: {{name}} {{version}} ({{feature_hash}})")], "none", kind="table"))

    panels.append(layout.row("Late binding (router-side queue)"))
    panels.append(panel(layout, "Held requests", [("sum(llm_router_held_requests)", "held")], "none",
                        description="Requests waiting in the router's late-binding queue (router serve --late-binding) "
                                    "for a replica with room; summed over workers. Always 0 with late binding off."))
    panels.append(panel(layout, "Hold time p50/p99", [
        (f"histogram_quantile({q}, sum by (le) (rate(llm_router_hold_duration_seconds_bucket[{RATE}])))",
         f"p{int(q * 100)}") for q in (0.5, 0.99)], "s",
        description="Time held requests waited in the router's queue; it is part of their TTFT."))
    panels.append(panel(layout, "Late-binding dispatches by reason", [
        (f"sum by (reason) (rate(llm_router_late_dispatches_total[{RATE}]))", "{{reason}}")], "reqps",
        description="Why the queue let requests go: room (a replica had room), idle, full (queue full), timeout "
                    "(held late_binding_timeout_s, sent to the policy's pick of any healthy replica), no_healthy, shutdown, error."))

    panels.append(layout.row("A/B rollout"))
    panels.append(panel(layout, "Treatment / control p99 ratio", [
        (ab_ratio("llm_router_ttft_seconds"), "TTFT p99 ratio"),
        (ab_ratio("llm_router_e2e_latency_seconds"), "E2E p99 ratio"),
        (ab_ratio("llm_router_inter_token_latency_seconds"), "ITL p99 ratio")], "none",
        description="Above 1: treatment is slower than control at the tail. The rollback guard acts on TTFT."))
    panels.append(panel(layout, "Rollback guard", [
        ("max(llm_router_ab_rollback_active)", "rollback active")], "none", kind="stat", w=4))
    panels.append(panel(layout, "Treatment share", [
        ("max(llm_router_ab_treatment_share)", "treatment share")], "percentunit", kind="stat", w=4, max_value=1))
    panels.append(panel(layout, "Requests by arm", [
        (f"sum by (arm) (rate(llm_router_requests_total[{RATE}]))", "{{arm}}")], "reqps"))

    panels.append(layout.row("Learning from the fleet"))
    panels.append(panel(layout, "Candidate prediction error (held-out MAE of log TTFT)", [
        ('max by (stage) (llm_router_policy_candidate_mae_log_ttft)', "{{stage}} fine-tuning")], "none",
        description="From the current candidate's model card (trainer finetune/follow): the error of the model it "
                    "started from and its own, on the newest part of the decision log it was not fitted on."))
    panels.append(panel(layout, "Candidate promotions and rollbacks", [
        (f"sum by (result) (increase(llm_router_policy_promotions_total[{RATE}]))", "{{result}}")], "none",
        description="A candidate is promoted to primary when its A/B window is no worse than the primary's, "
                    "rolled back when the guard trips. Reasons: router log and GET /admin/ab."))
    panels.append(panel(layout, "Candidate state", [
        ('max by (state) (llm_router_policy_candidate_state) == 1', "{{state}}")], "none", kind="table", w=4))

    panels.append(layout.row("Replicas"))
    for title, metric, unit in (
        ("Outstanding requests (router-side)", "llm_router_outstanding_requests", "none"),
        ("Waiting requests (scraped)", "llm_router_replica_waiting_requests", "none"),
        ("Running requests (scraped)", "llm_router_replica_running_requests", "none"),
        ("KV cache usage (scraped)", "llm_router_replica_kv_cache_usage_ratio", "percentunit"),
        ("Healthy", "llm_router_replica_healthy", "none"),
        ("Scrape age", "llm_router_scrape_age_seconds", "s"),
    ):
        panels.append(panel(layout, title, [(f"max by (replica) ({metric}{{{REPLICA}}})", "{{replica}}")], unit))
    panels.append(panel(layout, "Ejections by reason", [
        (f"sum by (replica, reason) (increase(llm_router_replica_ejections_total{{{REPLICA}}}[{RATE}]))",
         "{{replica}} {{reason}}"),
        (f"sum by (reason) (increase(llm_router_ejections_refused_total[{RATE}]))", "refused: {{reason}}")], "none",
        description="Replicas taken out of rotation by the circuit breaker or outlier detection, and ejections the "
                    "panic threshold (max_ejected_ratio) refused because too much of the fleet was already out."))
    panels.append(panel(layout, "Client-caused failures by kind", [
        (f"sum by (kind) (rate(llm_router_client_caused_failures_total[{RATE}]))", "{{kind}}")], "reqps",
        description="Failed upstream attempts not held against a replica: the same request failed everywhere."))
    panels.append(panel(layout, "Scrape errors by kind", [
        (f"sum by (replica, kind) (rate(llm_router_scrape_errors_total{{{REPLICA}}}[{RATE}]))",
         "{{replica}} {{kind}}")], "reqps"))

    panels.append(layout.row("Models, latency targets and client connections"))
    panels.append(panel(layout, "Decisions by model", [
        (f"sum by (model) (rate(llm_router_model_decisions_total[{RATE}]))", "{{model}}")], "reqps",
        description="Routing decisions by the request's model (a model the fleet does not serve is labelled other)."))
    panels.append(panel(layout, "TTFT p99 by model", [
        (f"histogram_quantile(0.99, sum by (le, model) (rate(llm_router_model_ttft_seconds_bucket[{RATE}])))",
         "{{model}} p99")], "s"))
    panels.append(panel(layout, "Model refusals by reason", [
        (f"sum by (reason) (rate(llm_router_model_refusals_total[{RATE}]))", "{{reason}}")], "reqps",
        description="Requests refused before routing: unknown_model (a 404 listing the models served) or no_replica "
                    "(a 503: every replica of the model is out of rotation)."))
    panels.append(panel(layout, "Latency-target attainment", [
        (f"sum by (target, result) (rate(llm_router_slo_attainment_total[{RATE}]))", "{{target}} {{result}}")],
        "reqps", description="Requests by latency target (x-slo-ttft-ms / x-slo-tpot-ms, or a per-model default) and "
                             "result: met, missed, no_target, unmeasured."))
    panels.append(panel(layout, "Client connections refused and idle ones closed", [
        (f"sum by (reason) (rate(llm_router_connections_refused_total[{RATE}]))", "refused: {{reason}}"),
        (f"sum(rate(llm_router_idle_connections_closed_total[{RATE}]))", "idle closed")], "cps",
        description="Connections refused with a 503 at a cap (global, or one client address's share) and idle "
                    "keep-alive connections closed to make room; the cap follows the open-file limit."))

    return {
        "uid": "routewise",
        "title": "routewise router",
        "description": "Tail latency per arm and replica, fallbacks, decision latency, shadow agreement, "
                       "A/B rollout and per-replica queue and KV for the routewise LLM router.",
        "tags": ["routewise", "llm", "vllm"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [{
            "name": "replica",
            "label": "Replica",
            "type": "query",
            "datasource": DATASOURCE,
            "query": {"query": "label_values(llm_router_outstanding_requests, replica)", "refId": "replicas"},
            "definition": "label_values(llm_router_outstanding_requests, replica)",
            "refresh": 2,
            "multi": True,
            "includeAll": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
        }]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
