"""deploy/prometheus: promtool accepts the rules and the config, and the alerts' unit tests
(alerts_test.yml: synthetic series, expected firing and silence) pass."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from .queries import ALERTS, PROMETHEUS_CONFIG, alert_rules, dashboard_queries
from .tools import require_tool

HERE = Path(__file__).parent

# The router's metric contract (router/telemetry.py); dashboards and alerts may use only these.
ROUTER_METRICS = {
    "llm_router_requests_total", "llm_router_ttft_seconds", "llm_router_inter_token_latency_seconds",
    "llm_router_e2e_latency_seconds", "llm_router_outstanding_requests", "llm_router_decision_latency_seconds",
    "llm_router_fallbacks_total", "llm_router_upstream_errors_total", "llm_router_retries_total",
    "llm_router_scrape_errors_total", "llm_router_scrape_age_seconds", "llm_router_replica_healthy",
    "llm_router_replica_waiting_requests", "llm_router_replica_running_requests",
    "llm_router_replica_kv_cache_usage_ratio", "llm_router_policy_info", "llm_router_shadow_decisions_total",
    "llm_router_ab_rollback_active", "llm_router_ab_treatment_share", "llm_router_policy_promotions_total",
    "llm_router_policy_candidate_state", "llm_router_policy_candidate_mae_log_ttft",
}


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
    unknown = used - ROUTER_METRICS
    assert not unknown, f"not router metrics (typo?): {sorted(unknown)}"
    unused = ROUTER_METRICS - used
    assert not unused, f"router metrics on no panel and in no alert: {sorted(unused)}"
