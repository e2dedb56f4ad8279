"""deploy/prometheus: promtool accepts the rules and the config, and the alerts' unit tests
(alerts_test.yml: synthetic series, expected firing and silence) pass."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from routewise_vllm.router.app import METRICS, create_app
from routewise_vllm.router.settings import RouterSettings

from .queries import ALERTS, PROMETHEUS_CONFIG, alert_rules, dashboard_queries
from .tools import require_tool

HERE = Path(__file__).parent

# Router metrics deliberately on no panel and in no alert, with why. Every other metric the router
# registers (read from a live app with every feature on) must be used by the dashboard or an alert.
NOT_ON_DASHBOARD = {
    "llm_router_ab_configured_share": "the share the operator set; the panel shows the effective one",
    "llm_router_ab_rollbacks_total": "the rollback guard panel shows whether a rollback is active",
    "llm_router_ab_window_error_ratio": "the guard's input, for debugging a rollback (GET /admin/ab explains it)",
    "llm_router_ab_window_ttft_p99_seconds": "the guard's input; the treatment/control ratio panel shows the same",
    "llm_router_decision_log_records_total": "a log writer's throughput, for debugging the decision log",
    "llm_router_decision_log_dropped_total": "only with a decision log configured (trainer follow setups)",
    "llm_router_exploration_decisions_total": "only with ab_explore_share > 0 (learning from the fleet)",
    "llm_router_policy_reload_total": "reloads are admin actions; their result is in the admin API answer",
    "llm_router_shadow_disagreement_load_delta": "for offline analysis of a shadow policy",
    "llm_router_shadow_fallbacks_total": "the shadow's own fallbacks; the agreement panel covers the shadow",
    "llm_router_model_list_errors_total": "a replica's unreadable /v1/models (it then serves nothing); GET /admin/replicas "
                                          "names its models, and the model refusal panel shows the effect",
    "llm_router_slo_header_errors_total": "clients' malformed latency-target headers (ignored, the request is served)",
    "llm_router_replica_batch_limit": "known per replica only once given or inferred; GET /admin/replicas shows it with "
                                      "its source",
    "llm_router_upstream_malformed_total": "a replica's malformed answers by rule; each is also a failure held against "
                                           "the replica, which the error and ejection panels show",
    "llm_router_model_list_refusals_total": "GET /v1/models refused over models_list_bytes_per_s: a client flood, "
                                            "logged once per episode",
    # the KV-cache view (docs/kv-events.md): its alert reads llm_router_kv_view_fresh, the rest explain it
    **{name: "the KV view's detail behind RoutewiseKVViewStale (docs/kv-events.md)" for name in (
        "llm_router_kv_events_total", "llm_router_kv_events_ignored_total", "llm_router_kv_event_gaps_total",
        "llm_router_kv_event_replays_total", "llm_router_kv_view_dropped_blocks_total", "llm_router_kv_view_blocks",
        "llm_router_kv_view_age_seconds", "llm_router_kv_events_unknown_topic_total",
        "llm_router_prefix_match_source_total", "llm_router_tokenize_seconds", "llm_router_prompt_blocks_total")},
}


def router_metrics() -> set[str]:
    """Every metric a router with A/B and a shadow registers, as Prometheus names them."""
    app = create_app(RouterSettings(replicas=["http://127.0.0.1:9"], ab_treatment="power-of-two",
                                    shadow_policy="round-robin"))
    return {f.name + ("_total" if f.type == "counter" else "") for f in app[METRICS].registry.collect()}



def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([require_tool("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_promtool_check_rules() -> None:
    r = promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in r.stdout


def test_alert_unit_tests() -> None:
    r = promtool("test", "rules", "alerts_test.yml", cwd=HERE)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_a_unit_test() -> None:
    tested = {t["alertname"] for case in yaml.safe_load((HERE / "alerts_test.yml").read_text())["tests"]
              for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert tested == {r["alert"] for r in alert_rules()}


def test_promtool_check_config(tmp_path: Path) -> None:
    """The compose Prometheus config, with its in-container rule path pointed at the repo's file."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    config["rule_files"] = [str(ALERTS)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    r = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    jobs = {j["job_name"] for j in config["scrape_configs"]}
    assert "routewise-router" in jobs


def test_alerts_have_severity_and_summary() -> None:
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule.get("for"), f"{rule['alert']}: no `for`, it would page on one bad evaluation"


def metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b(llm_router_[a-z0-9_]+)", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def test_queries_use_only_router_metrics() -> None:
    used: set[str] = set()
    for q in dashboard_queries():
        used |= metric_names(q.expr)
    for rule in alert_rules():
        used |= metric_names(rule["expr"])
    registered = router_metrics()
    unknown = used - registered
    assert not unknown, f"not router metrics (typo?): {sorted(unknown)}"
    assert set(NOT_ON_DASHBOARD) <= registered, f"gone from the router: {sorted(set(NOT_ON_DASHBOARD) - registered)}"
    unused = registered - used - set(NOT_ON_DASHBOARD)
    assert not unused, f"router metrics on no panel, in no alert and not in NOT_ON_DASHBOARD: {sorted(unused)}"
    assert not used & set(NOT_ON_DASHBOARD), f"used, so not NOT_ON_DASHBOARD: {sorted(used & set(NOT_ON_DASHBOARD))}"
