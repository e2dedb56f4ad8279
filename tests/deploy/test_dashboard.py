"""The Grafana dashboard and provisioning: generated file up to date, provisionable, and covering
what the design asks for. (Its queries run against Prometheus in test_observability.py.)"""

from __future__ import annotations

import importlib.util
import json
import re

import yaml

from .queries import DASHBOARD, REPO

GRAFANA = REPO / "deploy" / "grafana"
LATENCY_METRICS = ("llm_router_ttft_seconds", "llm_router_inter_token_latency_seconds", "llm_router_e2e_latency_seconds")


def load_builder():
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def targets(dash: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in dash["panels"] for t in p.get("targets", [])]


def test_committed_json_is_the_generators_output() -> None:
    assert DASHBOARD.read_text() == load_builder().render(), "run: python deploy/grafana/build_dashboard.py"


def test_provisioned_datasource_is_the_one_the_dashboard_uses() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == "prometheus"
    dash = dashboard()
    used = {json.dumps(p["datasource"], sort_keys=True) for p in dash["panels"] if "datasource" in p}
    used |= {json.dumps(t["datasource"], sort_keys=True) for _, t in targets(dash)}
    used |= {json.dumps(v["datasource"], sort_keys=True) for v in dash["templating"]["list"]}
    assert used == {json.dumps({"type": "prometheus", "uid": "prometheus"}, sort_keys=True)}


def test_dashboard_provider_points_at_the_mounted_json() -> None:
    prov = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "routewise.yaml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    for compose_file in ("docker-compose.yml", "docker-compose.cpu.yml"):
        grafana = yaml.safe_load((REPO / "deploy" / "compose" / compose_file).read_text())["services"]["grafana"]
        assert f"../grafana/dashboards:{path}:ro" in grafana["volumes"], compose_file


def test_dashboard_schema_basics() -> None:
    dash = dashboard()
    assert dash["uid"] == "routewise" and re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", dash["uid"])
    assert dash["title"] and isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] != "row":
            assert p["targets"], p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), p["title"]


def test_latency_quantiles_per_arm_and_per_replica() -> None:
    exprs = [t["expr"] for _, t in targets(dashboard())]
    for metric in LATENCY_METRICS:
        for by in ("arm", "replica"):
            for q in ("0.5", "0.9", "0.99"):
                pattern = (rf"histogram_quantile\({q}, sum by \(le, {by}\) "
                           rf"\(rate\({metric}_bucket\{{[^}}]*\}}\[\$__rate_interval\]\)\)\)")
                assert any(re.search(pattern, e) for e in exprs), f"no p{q} of {metric} by {by}"


def test_required_panels_exist() -> None:
    titles = {p["title"] for p in dashboard()["panels"]}
    for needed in ("Requests by code class", "Fallbacks by reason", "Decision latency p99", "Shadow agreement rate",
                   "Rollback guard", "Treatment share", "Treatment / control p99 ratio", "Outstanding requests (router-side)",
                   "Waiting requests (scraped)", "Running requests (scraped)", "KV cache usage (scraped)", "Scrape age",
                   "Scrape errors by kind"):
        assert needed in titles, needed
    ratio = next(p for p in dashboard()["panels"] if p["title"] == "Treatment / control p99 ratio")
    ttft = ratio["targets"][0]["expr"]
    assert ttft.index('arm="treatment"') < ttft.index(" / ") < ttft.index('arm="control"')
