"""tests/bench/shapes_table.py: the side-by-side view of several learned models over compare documents."""

from __future__ import annotations

import json
import math

import pytest

from tests.bench import shapes_table


def _row(scenario: str, policy: str, p99: float, goodput: float = 0.9) -> dict:
    return {"scenario": scenario, "policy": policy, "ttft_p99_s": p99, "ttft_p99_s_ci95": 0.0, "goodput": goodput,
            "fallback_share": 0.0}


def test_side_by_side_divides_by_the_best_heuristic_per_scenario_and_summarises(tmp_path, capsys):
    suite = {"seeds": 5, "split": "eval", "results": [
        _row("a", "least-outstanding", 2.0), _row("a", "expected-wait", 1.0), _row("a", "learned", 1.2),
        _row("a", "m.onnx", 0.8),
        _row("b", "expected-wait", 4.0), _row("b", "learned", 2.0), _row("b", "m.onnx", 6.0),
    ]}
    shapes = {"seeds": 5, "split": "eval", "results": [
        _row("c", "round-robin", 1.0), _row("c", "learned", 1.0),  # m.onnx did not run here: left out
    ]}
    paths = []
    for name, doc in (("suite", suite), ("shapes", shapes)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    shapes_table.main([*map(str, paths), "--models", "learned,m.onnx"])
    out = capsys.readouterr().out
    assert "| a | 1.20 | 0.80 |" in out and "| b | 0.50 | 1.50 |" in out and "| c |" not in out
    assert f"| geometric mean (2) | {math.sqrt(0.6):.3f} | {math.sqrt(1.2):.3f} |" in out
    assert "| worst | 1.20 | 1.50 |" in out
    assert "| largest goodput deficit to the best heuristic row | 0.000 (a) | 0.000 (a) |" in out
    with pytest.raises(SystemExit, match="no scenario has a row for every one of learned, x.onnx"):
        shapes_table.main([*map(str, paths), "--models", "learned,x.onnx"])


def test_late_side_by_side_merges_a_model_only_document_and_counts_the_075_scenarios(tmp_path, capsys):
    """--late: a model behind late binding over the best heuristic behind it; the heuristics' rows may come from
    another document of the same seeds and split; documents of other seeds are refused."""
    heuristics = {"seeds": [0, 1], "split": "eval", "results": [
        _row("a", "expected-wait", 2.0), _row("a", "expected-wait+late", 1.6),
        _row("a", "least-token-load", 3.0, goodput=0.95), _row("a", "least-token-load+late", 1.0),
        _row("b", "expected-wait", 1.0), _row("b", "expected-wait+late", 1.0, goodput=0.97),
    ]}
    models = {"seeds": [0, 1], "split": "eval", "results": [
        _row("a", "m.onnx", 2.2), _row("a", "m.onnx+late", 1.5, goodput=0.92), _row("b", "m.onnx", 1.0),
        _row("b", "m.onnx+late", 1.1, goodput=0.92),
    ]}
    paths = []
    for name, doc in (("h", heuristics), ("m", models)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    shapes_table.main([*map(str, paths), "--models", "m.onnx", "--late"])
    out = capsys.readouterr().out
    assert "| a | 1.50 |" in out and "| b | 1.10 |" in out  # over least-token-load+late's 1.0 and expected-wait+late's
    assert f"| geometric mean (2) | {math.sqrt(1.5 * 1.1):.3f} |" in out and "| worst | 1.50 |" in out
    assert "| at or below 0.75x the best per request | 1 |" in out  # a: 1.5 <= 0.75 x 2.0; b: 1.1 > 0.75
    # goodput: the model's late row against the best of every heuristic row, per request (a: 0.95) or late (b: 0.97)
    assert "| largest goodput deficit to the best heuristic row | 0.050 (b) |" in out
    other = tmp_path / "other.json"
    other.write_text(json.dumps(models | {"seeds": [0, 1, 2]}))
    with pytest.raises(SystemExit, match="documents differ"):
        shapes_table.main([str(paths[0]), str(other), "--models", "m.onnx", "--late"])
