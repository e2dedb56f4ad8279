"""The settings files the project shows operators say what the code does: each loads, names only real settings, and
every value it sets is the settings' default unless it is one of the choices the file exists to show."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from routewise_vllm.router.settings import RouterSettings, build_settings, fleet_problem

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy/examples/router.yaml"
CONFIGMAP = ROOT / "deploy/k8s/base/router-configmap.yaml"
# What each file sets on purpose, away from the defaults: where the fleet is, and how it is reached.
CHOSEN = {
    EXAMPLE: {"replicas", "ops_port", "late_binding"},  # late_binding: the default (on for learned) spelled out
    CONFIGMAP: {"discover", "shared_state"},
}


def _settings_file(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    return yaml.safe_load(data["data"]["router.yaml"]) if data.get("kind") == "ConfigMap" else data


@pytest.mark.parametrize("path", list(CHOSEN), ids=lambda p: p.name)
def test_the_file_loads_and_agrees_with_the_defaults(path, tmp_path, monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("ROUTEWISE_"):
            monkeypatch.delenv(name)
    data = _settings_file(path)
    assert set(data) <= set(RouterSettings.model_fields), set(data) - set(RouterSettings.model_fields)
    copy = tmp_path / "router.yaml"
    copy.write_text(yaml.safe_dump(data))
    settings = build_settings(copy)
    assert fleet_problem(settings) is None
    differs = {k for k, v in data.items() if RouterSettings.model_fields[k].default != v}
    assert differs == CHOSEN[path], f"{path.name} sets {sorted(differs - CHOSEN[path])} away from the default"
    assert settings.policy == "gated" and settings.late_binding is True  # the recommended configuration


def test_the_docs_point_at_the_example():
    assert "deploy/examples/router.yaml" in (ROOT / "README.md").read_text()
    assert "deploy/examples/router.yaml" in (ROOT / "docs/settings.md").read_text()
