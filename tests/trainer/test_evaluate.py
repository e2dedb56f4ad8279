"""`trainer evaluate --json` is `simulator compare --json` (same function, same document)."""

from __future__ import annotations

import json
import math

import pytest

from routewise_vllm.simulator.cli import main as simulator_main
from routewise_vllm.trainer.cli import main as trainer_main


def _nan_equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_nan_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_nan_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def test_evaluate_json_matches_simulator_compare(capsys, tmp_path):
    args = ["--scenarios", "steady-chat", "--seeds", "2"]
    rc = trainer_main(["evaluate", *args, "--baselines", "least-outstanding,round-robin", "--json", "--no-plots",
                       "--workers", "1", "--no-progress", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    ours = json.loads(capsys.readouterr().out)
    rc = simulator_main(["compare", "--scenario", "steady-chat", "--seeds", "2", "--policies", "least-outstanding,round-robin", "--json"])
    assert rc == 0
    theirs = json.loads(capsys.readouterr().out)
    assert _nan_equal(ours, theirs)
    assert {r["policy"] for r in ours["results"]} == {"least-outstanding", "round-robin"}
    assert all("ttft_p99_s_ci95" in r for r in ours["results"])


def test_evaluate_rejects_unknown_names(capsys):
    assert trainer_main(["evaluate", "--baselines", "nope", "--no-plots"]) == 2
    assert "unknown baseline(s) ['nope']" in capsys.readouterr().err
    assert trainer_main(["evaluate", "--policy", "missing.onnx", "--scenarios", "steady-chat", "--no-plots"]) == 2
    assert "missing.onnx" in capsys.readouterr().err


def test_evaluate_policy_learned_is_the_shipped_model_simulator_compare_serves(capsys, tmp_path):
    from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH

    rc = trainer_main(["evaluate", "--policy", "learned", "--scenario", "steady-chat", "--seeds", "1", "--baselines",
                       "least-outstanding", "--json", "--no-plots", "--workers", "1", "--no-progress", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    ours = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert simulator_main(["compare", "--scenario", "steady-chat", "--seeds", "1", "--policies", "learned", "--json"]) == 0
    theirs = json.loads(capsys.readouterr().out)["results"][0]
    assert _nan_equal(ours[str(DEFAULT_MODEL_PATH)]["metrics"], theirs["metrics"])


def test_workers_are_not_capped_at_this_machines_cores():
    import os

    from routewise_vllm.trainer.config import RunConfig

    assert RunConfig().workers == os.cpu_count()
    assert RunConfig(workers=64, torch_threads=8).workers == 64


def test_evaluate_late_binding_compares_like_with_like_and_writes_the_card(capsys, tmp_path):
    """--late-binding: every policy also behind late binding; the summary puts the learned policy behind it
    against the best heuristic behind it and against the best per request, and the card records the rule."""
    from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH

    card = tmp_path / "card.json"
    rc = trainer_main(["evaluate", "--policy", "learned", "--scenario", "shape-conv-slots8", "--seeds", "1", "--baselines",
                       "least-outstanding,expected-wait", "--late-binding", "--no-plots", "--workers", "1", "--no-progress",
                       "--out", str(tmp_path), "--card", str(card)])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "learned+late" in out and "of the best late heuristic" in out
    doc = json.loads(card.read_text())["evaluation"]
    assert doc["late_binding"]["timeout_s"] == 2.0
    rows = {r["policy"]: r for r in doc["results"]}
    assert {"least-outstanding+late", "expected-wait+late", "learned", "learned+late"} <= rows.keys()
    [s] = doc["vs_best_heuristic"]
    # Pinned (one seed, deterministic; recompute when the simulator's behaviour is meant to change): the rows'
    # p99s and goodputs, and the summary's choices and ratios worked out from these numbers by hand
    p99 = {"least-outstanding": 0.9889648820512993, "expected-wait": 1.1763243143881414, "learned": 1.3645531351686444,
           "least-outstanding+late": 0.8469881930953411, "expected-wait+late": 0.5684976945819276,
           "learned+late": 0.6417333268440748}
    assert {p: rows[p]["ttft_p99_s"] for p in p99} == pytest.approx(p99, rel=1e-9)
    assert rows["learned+late"]["goodput"] == pytest.approx(0.9993333333333333) and rows["expected-wait+late"]["goodput"] == 1.0
    assert s["best_late_heuristic"] == "expected-wait+late" and s["best_heuristic"] == "least-outstanding"
    assert s["late_ttft_p99_ratio"] == pytest.approx(1.1288230945527487, rel=1e-9)  # 0.6417 / 0.5685
    assert s["late_vs_best_per_request"] == pytest.approx(0.6488939480975291, rel=1e-9)  # 0.6417 / 0.9890
    assert s["ttft_p99_ratio"] == pytest.approx(1.379779160952919, rel=1e-9)  # 1.3646 / 0.9890
    assert s["late_goodput_minus_best"] == pytest.approx(0.9993333333333333 - 1.0)  # against expected-wait+late's 1.0
    assert str(DEFAULT_MODEL_PATH) not in rows  # labelled "learned" in the card
