"""The documents hold to the code: generated references up to date, links that resolve, a runbook line per alert."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_references_are_up_to_date():
    stale = [str(path.relative_to(ROOT)) for path, text in _gen_docs().outputs().items()
             if not path.is_file() or path.read_text() != text]
    assert not stale, f"out of date: {stale}; run .venv/bin/python scripts/gen_docs.py and commit"


def test_check_mode_names_a_stale_file(tmp_path, monkeypatch, capsys):
    gen = _gen_docs()
    stale = tmp_path / "settings.md"
    stale.write_text(gen.settings_markdown().replace("ROUTEWISE_PORT", "ROUTEWISE_PORT_OLD"))
    monkeypatch.setattr(gen, "outputs", lambda: {stale: gen.settings_markdown()})
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert "settings.md" in capsys.readouterr().err


def test_settings_reference_lists_every_field_with_its_variable():
    from routewise_vllm.router.settings import RouterSettings

    text = (ROOT / "docs" / "settings.md").read_text()
    for name in RouterSettings.model_fields:
        assert f"| `{name}` |" in text and f"`ROUTEWISE_{name.upper()}`" in text, name


def test_metrics_reference_lists_every_metric_the_deploy_files_use():
    text = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(llm_router_\w+)`", text, re.M))
    used = set()
    for path in [*(ROOT / "deploy").rglob("*.yml"), *(ROOT / "deploy").rglob("*.yaml"), *(ROOT / "deploy").rglob("*.json")]:
        used |= set(re.findall(r"llm_router_\w+", path.read_text()))
    base = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    missing = sorted(n for n in base if n not in documented)
    assert not missing, f"deploy/ reads metrics the reference lacks: {missing}"


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold commands, not links
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in _links(doc):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # web addresses and anchors within the page
        if not (doc.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {broken}"


def _alerts() -> set[str]:
    names: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("alert"), str):
                names.add(node["alert"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for path in [*(ROOT / "deploy").rglob("*.yml"), *(ROOT / "deploy").rglob("*.yaml")]:
        for doc in yaml.safe_load_all(path.read_text()):
            walk(doc)
    return names


def test_every_alert_has_a_runbook_line():
    alerts = _alerts()
    assert alerts, "no alert rules found under deploy/"
    text = (ROOT / "docs" / "alerts.md").read_text()
    runbook = {m for m in re.findall(r"^\| `(\w+)` \|", text, re.M)}
    assert not sorted(alerts - runbook), f"alerts without a runbook line in docs/alerts.md: {sorted(alerts - runbook)}"
    assert not sorted(runbook - alerts), f"docs/alerts.md describes alerts no rule file has: {sorted(runbook - alerts)}"


def test_readme_is_a_short_users_document():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; details belong in docs/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_speak_of_the_product_not_its_history(doc):
    hits = re.findall(r"(?i)\b(?:session|issue)\s+[0-9]+", doc.read_text())
    assert not hits, f"{doc.relative_to(ROOT)} mentions {hits}: history belongs in git"


def test_results_picture_takes_the_best_heuristic_per_scenario(tmp_path):
    spec = importlib.util.spec_from_file_location("plot_results", ROOT / "scripts" / "plot_results.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    row = lambda sc, p, s: {"scenario": sc, "policy": p, "ttft_p99_s": s}  # noqa: E731
    heuristics = tmp_path / "h.json"
    heuristics.write_text(json.dumps({"results": [
        row("crash", "least-outstanding", 0.8), row("crash", "expected-wait", 0.5), row("crash", "random", None),
        row("crash", "least-outstanding+late", 0.6), row("crash", "expected-wait+late", 0.45),
        row("shape-conv-2", "expected-wait", 0.3),  # no +late rows and no model row: left out
    ]}))
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"results": [row("crash", "m.onnx+late", 0.4)]}))
    assert plot.rows_from_compare([heuristics, model], "m.onnx+late") == [{
        "scenario": "crash", "group": "suite", "best_per_request_heuristic": "expected-wait",
        "best_per_request_p99_ms": 500, "best_late_heuristic": "expected-wait", "best_late_p99_ms": 450,
        "model_late_p99_ratio": 0.8,
    }]
    with pytest.raises(SystemExit, match="no scenario"):
        plot.rows_from_compare([heuristics], "m.onnx+late")
