"""Each component takes a small frozen config of the settings it reads, built by RouterSettings (the edge); the
components never import router/settings.py, and the flat names users know stay the settings' names."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Mapping
from pathlib import Path

import pytest

from routewise_vllm.router.observe.outlier import EjectionConfig
from routewise_vllm.router.observe.scraper import ScrapeConfig
from routewise_vllm.router.paths import PassthroughConfig
from routewise_vllm.router.replicas import BreakerState, ReplicaConfig, ReplicaSet
from routewise_vllm.router.scale.fleet_view import FleetViewConfig
from routewise_vllm.router.scale.workers import WorkersConfig
from routewise_vllm.router.settings import RouterSettings, build_settings

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ["router/replicas.py", "router/models.py", "router/paths.py", *(f"router/observe/{m}.py" for m in (
    "outlier", "probes", "scraper", "vllm_metrics", "metric_batch")),
    *(f"router/scale/{m}.py" for m in ("fleet_view", "worker_sync", "workers"))]

# every setting a config carries, set away from its default (each flag, variable and file key of that name)
NOT_DEFAULT = {
    "replicas": ["http://10.0.0.5:8000", "http://10.0.0.6:8000"], "discover": "vllm.svc:8000",
    "discover_interval_s": 7.0, "health_interval_s": 3.0, "health_timeout_s": 0.7, "health_failure_threshold": 4,
    "health_success_threshold": 2, "models_refresh_interval_s": 11.0, "models_timeout_s": 6.0,
    "models_list_bytes_per_s": 1000, "prefix_capacity_blocks": 99, "late_binding_max_num_seqs": 7,
    "late_binding_replica_max_num_seqs": {"10.0.0.5:8000": 3},
    "breaker_failure_threshold": 9, "breaker_cooldown_s": 4.0, "max_ejected_ratio": 0.25, "outlier_window": 30,
    "outlier_min_requests": 6, "outlier_failure_ratio": 0.4, "outlier_ttfb_ratio": 5.0, "outlier_ttfb_min_s": 1.5,
    "stall_timeout_s": 12.0, "scrape_interval_s": 2.0, "scrape_timeout_s": 1.5,
    "passthrough_paths": ["/v1/models", "/v1/extra/*"], "max_retries": 4,
    "shared_state": "redis://127.0.0.1:6379/0", "shared_state_interval_s": 0.05, "shared_state_ttl_s": 3.0,
    "shared_state_timeout_s": 0.3, "host": "127.0.0.1", "port": 8100, "ops_host": "127.0.0.2", "ops_port": 9100,
    "workers": 3, "drain_timeout_s": 12.0,
}


def _configs(s: RouterSettings) -> list[object]:
    rc = s.replica_config()
    return [rc, rc.ejection, s.scrape_config(), s.passthrough_config(), s.fleet_view_config(), s.workers_config()]


def _plain(v: object) -> object:
    return dict(v) if isinstance(v, Mapping) else list(v) if isinstance(v, tuple) else v


def test_each_config_field_is_the_setting_of_the_same_name():
    s = build_settings(**NOT_DEFAULT)
    seen = set()
    for cfg in _configs(s):
        for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
            if f.name == "ejection":
                continue
            assert f.name in RouterSettings.model_fields, f"{type(cfg).__name__}.{f.name} is no setting's name"
            assert _plain(getattr(cfg, f.name)) == getattr(s, f.name), (type(cfg).__name__, f.name)
            seen.add(f.name)
    assert seen == set(NOT_DEFAULT)  # every field was set away from its default: none is wired to another


def test_the_environment_and_a_config_file_reach_the_configs(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUTEWISE_OUTLIER_WINDOW", "33")
    monkeypatch.setenv("ROUTEWISE_SCRAPE_INTERVAL_S", "3")
    (tmp_path / "r.yaml").write_text("replicas: [http://10.0.0.7:8000]\nshared_state_ttl_s: 4\nworkers: 2\n")
    s = build_settings(tmp_path / "r.yaml", shared_state="redis://h:1/0")
    assert s.replica_config().ejection.outlier_window == 33
    assert s.replica_config().replicas == ("http://10.0.0.7:8000",)
    assert s.scrape_config() == ScrapeConfig(3.0, 0.8)
    assert s.fleet_view_config() == FleetViewConfig("redis://h:1/0", 0.01, 4.0, 0.2)
    assert s.workers_config().workers == 2


def test_configs_are_frozen_and_slotted_and_need_every_field():
    s = build_settings(**NOT_DEFAULT)
    for cfg in _configs(s):
        assert dataclasses.is_dataclass(cfg) and not hasattr(cfg, "__dict__"), type(cfg).__name__
        name = dataclasses.fields(cfg)[0].name  # type: ignore[arg-type]
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, name, None)
        with pytest.raises(TypeError):  # no defaults of their own: RouterSettings holds the only ones
            type(cfg)()
    with pytest.raises(TypeError):
        s.replica_config().late_binding_replica_max_num_seqs["10.0.0.5:8000"] = 1  # type: ignore[index]


def test_no_shared_state_no_fleet_view_config():
    assert RouterSettings().fleet_view_config() is None


@pytest.mark.parametrize("path", COMPONENTS)
def test_components_do_not_import_the_settings(path: str):
    tree = ast.parse((ROOT / path).read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in names if m.endswith("router.settings")}, path


def test_a_replica_set_runs_on_its_config_alone():
    """Built from a config, no RouterSettings in sight: the breaker's threshold and the panic ratio are the
    config's."""
    base = build_settings(replicas=["http://10.0.0.5:8000", "http://10.0.0.6:8000", "http://10.0.0.7:8000"])
    cfg = base.replica_config()
    cfg = dataclasses.replace(cfg, ejection=dataclasses.replace(cfg.ejection, breaker_failure_threshold=2,
                                                                  max_ejected_ratio=0.4))
    reps = ReplicaSet(cfg, lambda: None)
    assert not hasattr(reps, "settings")
    for r in reps.ordered:
        r.probe_ok = True
        r.sync()
    a, b = reps.ordered[0], reps.ordered[1]
    reps.record_failure(a)
    assert a.breaker.state is BreakerState.CLOSED
    reps.record_failure(a)  # the config's threshold, 2 (the setting's default is 5)
    assert a.breaker.state is BreakerState.OPEN
    reps.record_failure(b)
    reps.record_failure(b)  # a second one out would be 2/3 > 0.4 of the fleet: refused
    assert b.breaker.state is BreakerState.CLOSED


def test_config_types_are_the_components_own():
    s = build_settings(**NOT_DEFAULT)
    assert [type(c) for c in _configs(s)] == [ReplicaConfig, EjectionConfig, ScrapeConfig, PassthroughConfig,
                                              FleetViewConfig, WorkersConfig]
