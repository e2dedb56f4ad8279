"""`router serve` at startup: a config file or a policy that does not load is one line naming the cause and a
non-zero exit, whatever the worker count; starting on the fallback is an opt-in; --print-config; every setting by
flag, environment or file; shipped models by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from routewise_vllm.router.cli import _parser
from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH, MODELS_DIR, RECOMMENDED_MODEL, make_policy, shipped_models
from routewise_vllm.router.settings import RouterSettings, build_settings

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
REPLICA = "http://127.0.0.1:9"  # nothing listens there; nothing here gets that far


def serve(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "routewise_vllm.router", "serve", "--replica", REPLICA, "--host", "127.0.0.1",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode != 0, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("router: ")
    return lines[0]


@pytest.fixture
def broken_model(tmp_path: Path) -> Path:
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(DEFAULT_MODEL_PATH.read_bytes()[:4000])
    return bad


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_policy_that_does_not_load_is_one_line_and_exit_2(broken_model, workers):
    line = one_line(serve("--policy", str(broken_model), "--workers", workers))
    assert f"policy '{broken_model}' does not load" in line and "not a loadable ONNX model" in line
    assert "allow_fallback_start" in line


def test_a_treatment_or_shadow_that_does_not_load_is_named(broken_model):
    line = one_line(serve("--policy", "least-outstanding", "--ab-treatment", str(broken_model), "--ab-share", "0.1"))
    assert line.startswith(f"router: ab_treatment '{broken_model}' does not load")
    line = one_line(serve("--policy", "least-outstanding", "--shadow-policy", str(broken_model)))
    assert line.startswith(f"router: shadow_policy '{broken_model}' does not load")


def test_allow_fallback_start_serves_least_outstanding(broken_model):
    proc = subprocess.Popen([sys.executable, "-m", "routewise_vllm.router", "serve", "--replica", REPLICA, "--host", "127.0.0.1",
                             "--port", "0", "--policy", str(broken_model), "--allow-fallback-start"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "routewise router on" in line:
                break
        text = "".join(lines)
        assert "starting on the fallback, least-outstanding" in text
        assert "routewise router on" in text, text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.mark.parametrize("content, suffix, cause", [
    (None, ".yaml", "not found"),
    ("port: [1,\n", ".yaml", "not valid YAML"),
    ("{\"port\": ", ".json", "not valid JSON"),
    ("- a\n- b\n", ".yaml", "expected a mapping of settings"),
    ("prot: 80\n", ".yaml", "unknown setting(s) prot"),
    (b"\xff\xfe\x00bad", ".yaml", "not text"),
    ("port: 99999\nlate_binding_timeout_s: -1\n", ".yaml", "invalid router settings: port:"),
])
def test_a_config_file_that_cannot_be_used_is_one_line_and_exit_2(tmp_path, content, suffix, cause):
    cfg = tmp_path / f"router{suffix}"
    if isinstance(content, bytes):
        cfg.write_bytes(content)
    elif content is not None:
        cfg.write_text(content)
    for workers in ("1", "2"):
        line = one_line(serve("--config", str(cfg), "--workers", workers))
        assert cause in line
        assert str(cfg) in line or cause.startswith("invalid router settings")


def test_a_directory_or_unreadable_config_file_is_named(tmp_path):
    assert "is a directory" in one_line(serve("--config", str(tmp_path)))
    locked = tmp_path / "locked.yaml"
    locked.write_text("port: 8000\n")
    locked.chmod(0)
    if os.access(locked, os.R_OK):
        pytest.skip("running as root: a file without read permission is still readable")
    assert "cannot read it: Permission denied" in one_line(serve("--config", str(locked)))


def test_an_environment_variable_that_cannot_be_decoded_is_one_line():
    line = one_line(serve(env={"ROUTEWISE_PORT": "eighty"}))
    assert "port" in line and "'eighty'" in line


def test_print_config_prints_the_effective_settings_with_the_token_redacted(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("scrape_interval_s: 0.5\nworkers: 3\n")
    p = serve("--config", str(cfg), "--workers", "2", "--print-config",
              env={"ROUTEWISE_ADMIN_TOKEN": "s3cret-token", "ROUTEWISE_MAX_RETRIES": "5"})
    assert p.returncode == 0, p.stderr
    assert "s3cret-token" not in p.stdout
    data = json.loads(p.stdout)
    assert data["admin_token"] == "<redacted>"
    assert (data["scrape_interval_s"], data["workers"], data["max_retries"]) == (0.5, 2, 5)  # file, flag over file, env
    # the recommended configuration: the gated model behind late binding, batch limits inferred, no fallback start
    assert (data["policy"], data["late_binding"], data["late_binding_max_num_seqs"], data["allow_fallback_start"]) == (
        "gated", True, None, False)
    assert set(data) == set(RouterSettings.model_fields)
    del data["admin_token"]
    again = tmp_path / "printed.json"  # what it prints is a config file that gives the same settings back
    again.write_text(json.dumps(data))
    assert build_settings(again).model_dump(mode="json", exclude={"admin_token"}) == data


def test_every_setting_has_a_flag_an_environment_variable_and_a_file_key(tmp_path, monkeypatch):
    serve_parser = next(a for a in _parser()._actions if a.dest == "command").choices["serve"]
    dests = {a.dest for a in serve_parser._actions}
    assert set(RouterSettings.model_fields) - dests == set()
    # the environment (ROUTEWISE_<FIELD>, 'none' for None) and the file take the same names
    monkeypatch.setenv("ROUTEWISE_DECISION_BUDGET_S", "none")
    monkeypatch.setenv("ROUTEWISE_OUTLIER_WINDOW", "9")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stall_timeout_s: 12\nlean_listener: false\n")
    s = build_settings(cfg, replicas=[REPLICA])
    assert (s.decision_budget_s, s.outlier_window, s.stall_timeout_s, s.lean_listener) == (None, 9, 12.0, False)


def test_main_generated_flags_reach_the_settings(capsys):
    from routewise_vllm.router.cli import main

    assert main(["serve", "--replica", REPLICA, "--outlier-window", "7", "--decision-budget-s", "none",
                 "--no-lean-listener", "--print-config"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["outlier_window"], data["decision_budget_s"], data["lean_listener"]) == (7, None, False)


def test_every_shipped_model_is_a_policy_name_and_learned_is_the_recommended_one():
    names = set(shipped_models())
    assert {"late-fleet", "any-fleet", "suite-fleet"} <= names
    assert DEFAULT_MODEL_PATH == MODELS_DIR / f"{RECOMMENDED_MODEL}.onnx" == shipped_models()["any-fleet"]
    for name in names:
        s = build_settings(replicas=[REPLICA], policy=name)
        assert s.policy == name and s.late_binding is True  # every learned policy: late binding on unless said off
        policy = make_policy(name)
        assert Path(policy.describe()["path"]) == MODELS_DIR / f"{name}.onnx"
        assert policy.describe()["load_error"] is None
    assert make_policy("learned").describe()["version"] == make_policy("any-fleet").describe()["version"]
    assert make_policy("learned").describe()["version"].startswith("any-fleet")


def test_late_binding_is_on_for_a_learned_policy_and_off_for_a_baseline_unless_set(tmp_path):
    copy = tmp_path / "policy.onnx"  # deploy/ copies the shipped model onto a volume
    copy.write_bytes(DEFAULT_MODEL_PATH.read_bytes())
    assert build_settings(replicas=[REPLICA], policy=str(copy)).late_binding is True
    assert build_settings(replicas=[REPLICA], policy="expected-wait").late_binding is False
    assert build_settings(replicas=[REPLICA], policy="expected-wait", late_binding=True).late_binding is True
    assert build_settings(replicas=[REPLICA], late_binding=False).late_binding is False


def test_the_models_ship_in_the_package():
    """Names resolve beside router/policy/registry.py (the wheel test installs the package data)."""
    assert MODELS_DIR == Path(sys.modules["routewise_vllm.router.policy.registry"].__file__).parent / "models"
