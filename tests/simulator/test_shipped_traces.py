"""The traces ship with the project: same bytes as the published files, found from any working directory (inside
the wheel: tests/deploy/test_wheel.py), and bad copies or settings give one line naming what to fix."""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from routewise_vllm.simulator.traces import KNOWN_TRACES, SHIPPED_TRACES_DIR, TRACES_DIR_ENV, TraceError, TraceLibrary, trace_path

ROOT = Path(__file__).resolve().parents[2]
LICENSES = {
    "azure_llm_2023": "LICENSE_CC-BY-4.0.txt",
    "mooncake_fast25": "LICENSE-APACHE",
    "arxiv_summarization_lengths": "LICENSE-MIT",
}


@pytest.mark.parametrize("name", sorted(KNOWN_TRACES))
def test_shipped_copy_has_the_published_bytes(name):
    path = trace_path(name)
    assert path.parent.parent == SHIPPED_TRACES_DIR and path.suffix == ".gz"
    raw = gzip.decompress(path.read_bytes())
    assert hashlib.sha256(raw).hexdigest() == KNOWN_TRACES[name].sha256
    header = 0 if name.startswith("mooncake-") else 1
    assert sum(1 for line in raw.splitlines() if line.strip()) - header == KNOWN_TRACES[name].requests


def test_each_source_ships_its_license_and_attribution():
    readme = (SHIPPED_TRACES_DIR / "README.md").read_text()
    for folder, license_file in LICENSES.items():
        assert (SHIPPED_TRACES_DIR / folder / license_file).stat().st_size > 1000
        assert license_file in readme
    for paper in ("Splitwise", "Mooncake", "Vidur"):
        assert paper in readme


def test_an_explicit_folder_may_hold_plain_or_compressed_files(tmp_path, monkeypatch):
    plain = tmp_path / "plain" / KNOWN_TRACES["azure-code"].relative_path
    plain.parent.mkdir(parents=True)
    plain.write_bytes(gzip.decompress(trace_path("azure-code").read_bytes()))
    monkeypatch.setenv(TRACES_DIR_ENV, str(tmp_path / "plain"))
    assert trace_path("azure-code") == plain
    assert len(TraceLibrary().load("azure-code")) == 8819
    assert len(TraceLibrary(trace_path("azure-code", SHIPPED_TRACES_DIR).parents[1]).load("azure-code")) == 8819


def test_setting_a_missing_folder_names_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACES_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(TraceError, match=rf"^{TRACES_DIR_ENV}=.*nowhere: no such folder; .*leave it unset"):
        TraceLibrary().load("azure-conv")


def _copy_with(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / (KNOWN_TRACES["azure-conv"].relative_path + ".gz")
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    return tmp_path


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
        pytest.param(lambda b: b[:100] + bytes(len(b) - 100), id="corrupt"),
        pytest.param(lambda b: b"not gzip at all\n" * 10, id="not-gzip"),
    ],
)
def test_a_damaged_compressed_file_is_one_error_naming_it(tmp_path, damage):
    root = _copy_with(tmp_path, damage(trace_path("azure-conv").read_bytes()))
    with pytest.raises(TraceError, match=r"AzureLLMInferenceTrace_conv\.csv\.gz: corrupt or truncated file .*intact copy"):
        TraceLibrary(root).load("azure-conv")


def _cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, **env},
    )


def _scenario(tmp_path: Path) -> Path:
    path = tmp_path / "short-conv.yaml"
    path.write_text(
        "name: short-conv\n"
        "description: 150 requests of the Azure conversation trace on two replicas.\n"
        "workload: {kind: trace, trace: azure-conv, max_requests: 150, target_rps: 10}\n"
        "cluster: {replicas: [{profile: llama3-8b-h100, count: 2}]}\n"
        "slo: {ttft_s: 1.0, tpot_s: 0.1}\n"
    )
    return path


@pytest.mark.parametrize("how", ["flag", "env"])
def test_cli_bad_traces_setting_is_one_line(tmp_path, how):
    args = ["routewise_vllm.simulator", "run", "--scenario", str(_scenario(tmp_path)), "--policy", "round-robin"]
    if how == "flag":
        res = _cli([*args, "--traces-dir", str(tmp_path / "missing")], cwd=tmp_path)
        assert "--traces-dir" in res.stderr
    else:
        res = _cli(args, cwd=tmp_path, **{TRACES_DIR_ENV: str(tmp_path / "missing")})
        assert TRACES_DIR_ENV in res.stderr
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "missing" in res.stderr
