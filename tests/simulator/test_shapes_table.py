"""tests/bench/shapes_table.py: the side-by-side view of several learned models over compare documents."""

from __future__ import annotations

import json
import math

import pytest

from tests.bench import shapes_table


def _row(scenario: str, policy: str, p99: float) -> dict:
    return {"scenario": scenario, "policy": policy, "ttft_p99_s": p99, "ttft_p99_s_ci95": 0.0, "goodput": 0.9,
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
    with pytest.raises(SystemExit, match="no scenario has a row for every one of learned, x.onnx"):
        shapes_table.main([*map(str, paths), "--models", "learned,x.onnx"])
