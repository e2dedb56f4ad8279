"""tests/bench/gpu_roofline.py (holds a GPU profile against a measured GPU): its model and report on the CPU with
a tiny shape, and the measured H100 profile it wrote (simulator/profiles/measured/)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml

from routewise_vllm.simulator.costmodel import PROFILES_DIR, fit, known_profiles, load_profile, profile_from_file
from tests.bench import gpu_roofline

MEASURED = PROFILES_DIR / "measured" / "llama3-8b-h100-measured.yaml"


def test_tiny_run_reports_every_probe(tmp_path):
    assert gpu_roofline.main(["--device", "cpu", "--tiny", "--reps", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "roofline.json").read_text())
    assert [r["probe"] for r in doc["rows"]] == [p.label for p in gpu_roofline.tiny_probes()]
    assert all(r["measured_ms"] > 0 for r in doc["rows"])
    assert not (tmp_path / "llama3-8b-h100-measured.yaml").exists()  # a tiny shape refits no profile


def test_self_check_catches_wrong_grouping(monkeypatch):
    assert gpu_roofline.self_check(torch, "cpu", torch.float32) < 1e-5

    def wrong(F, q, k, v):  # query heads grouped by the wrong axis
        B, KV, G, D = q.shape
        return F.scaled_dot_product_attention(q.transpose(1, 2).reshape(B, KV, G, D), k, v)

    monkeypatch.setattr(gpu_roofline, "decode_attention", wrong)
    assert gpu_roofline.self_check(torch, "cpu", torch.float32) > 1e-2


def test_probes_pass_the_simulators_arguments():
    p = gpu_roofline.Probe(prefill=512, decodes=64, context=1024)
    assert p.simulator_args() == (512, 64, 64 * 1025 + 512, 512 * 256.0, 1)
    assert gpu_roofline.Probe(0, 8, 100).simulator_args() == (0, 8, 808, 0.0, 0)


def test_measured_profile_is_the_refit_of_its_own_timings():
    """The shipped measured profile loads by path and its efficiencies are what `fit` makes of the iterations it
    records, so neither can be edited without the other."""
    measured = profile_from_file(MEASURED)
    doc = yaml.safe_load(MEASURED.read_text())
    rows = [  # (prefill, decodes, context tokens, attention pairs, seconds)
        (it["prefill"], it["decodes"], *gpu_roofline.Probe(it["prefill"], it["decodes"], it["context"]).simulator_args()[2:4],
         it["ms"] / 1e3)
        for it in doc["measured"]["iterations"]
    ]
    refit = fit(load_profile("llama3-8b-h100"), rows)
    assert measured.prefill_mfu == pytest.approx(refit.prefill_mfu, abs=1e-3)
    assert measured.decode_bw_util == pytest.approx(refit.decode_bw_util, abs=1e-3)
    assert measured.overhead_s == pytest.approx(refit.overhead_s, abs=1e-5)
    assert MEASURED.stem not in known_profiles()  # not in the pool training draws from


def test_write_profile_round_trips(tmp_path):
    base = load_profile("llama3-8b-h100")
    fitted = dataclasses.replace(base, prefill_mfu=0.6, overhead_s=0.003)
    summary = dict(device="test", date="2026-11-27", ceilings={}, median_abs_error=0.2, refit_median_abs_error=0.05,
                   refit_max_abs_error=0.1, rows=[dict(prefill=128, decodes=0, context=0, measured_ms=8.7)])
    out = tmp_path / "p.yaml"
    gpu_roofline.write_profile(out, "llama3-8b-h100", fitted, summary)
    loaded = profile_from_file(out)
    assert (loaded.name, loaded.prefill_mfu, loaded.overhead_s) == ("llama3-8b-h100-measured", 0.6, 0.003)
    assert loaded.iteration_time(8192, 0, 8192) < base.iteration_time(8192, 0, 8192)


def test_report_from_the_recorded_h100_iterations(tmp_path):
    """--report needs no GPU: it refits the iterations the measured profile records. On the H100 the refit beats
    the estimate and the roofline beats fleet calibrate's linear form (which wins on the CPU servers)."""
    assert gpu_roofline.main(["--report", str(MEASURED), "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "roofline.json").read_text())
    assert doc["device"].startswith("NVIDIA H100") and len(doc["rows"]) == 20
    assert doc["refit_median_abs_error"] < doc["median_abs_error"] / 2
    assert doc["held_out_rms_relative_error"]["roofline"] < doc["held_out_rms_relative_error"]["linear"]
    rewritten = profile_from_file(tmp_path / "llama3-8b-h100-measured.yaml")
    assert rewritten.prefill_mfu == pytest.approx(profile_from_file(MEASURED).prefill_mfu, abs=1e-4)
