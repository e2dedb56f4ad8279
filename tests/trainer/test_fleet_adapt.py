"""tests/bench/fleet_adapt.py end to end on a tiny scenario: a simulated decision log, `trainer finetune`, the
promotion A/B on TRAIN windows and the EVAL comparison, with the served model the one the A/B chose."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench import fleet_adapt

TINY = str(Path(__file__).resolve().parents[1] / "data" / "scenario_good.yaml")


def test_fleet_adapt_runs_and_serves_what_the_ab_promoted(tmp_path, capsys):
    args = ["--scenarios", TINY, "--seeds", "2", "--ab-seeds", "1", "--episodes", "1", "--max-requests", "200",
            "--workers", "1", "--keep", str(tmp_path), "--json"]
    assert fleet_adapt.main(args) == 0
    (s,) = json.loads(capsys.readouterr().out)
    assert s["records"] == 200 and (tmp_path / "scenario_good" / "fine-tuned.onnx").exists()
    ab = s["ab_train_p99_s"]
    assert s["promoted"] == (ab[fleet_adapt.FINETUNED] < ab[fleet_adapt.LEARNED])
    served = fleet_adapt.FINETUNED if s["promoted"] else fleet_adapt.LEARNED
    assert s["served_vs_best"] == s[served]["vs_best"]
    for name in (fleet_adapt.LEARNED, fleet_adapt.FINETUNED):
        assert s[name]["vs_best"] > 0 and 0 <= s[name]["goodput"] <= 1
