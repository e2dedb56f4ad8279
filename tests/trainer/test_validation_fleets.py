"""run.validation_fleets: random fleets in every TRAIN evaluation, and `best.pt` selected on them too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from routewise_vllm.trainer.checkpoint import read_checkpoint
from routewise_vllm.trainer.config import load_config
from routewise_vllm.trainer.ppo import VALIDATION_SEED_BASE, selection_key, train, validation_specs

ROOT = Path(__file__).resolve().parents[2]
SUITE = {"eval/score": 0.9, "eval/worst_ratio": 1.0, "eval/min_goodput_gap": 0.0}


def test_the_key_is_the_suite_key_times_the_random_fleets_score():
    assert selection_key(SUITE) == pytest.approx(0.9)
    assert selection_key(SUITE | {"eval/fleets_score": 0.8}) == pytest.approx(0.72)
    # the suite's penalties stay: a scenario at 1.13x adds 0.2 before the product
    assert selection_key(SUITE | {"eval/worst_ratio": 1.13, "eval/fleets_score": 0.5}) == pytest.approx(0.55)


def test_validation_specs_are_random_fleets_on_their_own_seeds():
    cfg = load_config(ROOT / "trainer/configs/smoke.yaml", ["run.validation_fleets=2"])
    specs = validation_specs(cfg)
    assert len(specs) == 4 and all(s.random_fleet and s.randomise for s in specs)
    assert min(s.seed for s in specs) >= VALIDATION_SEED_BASE
    assert validation_specs(load_config(ROOT / "trainer/configs/smoke.yaml")) == []


@pytest.fixture(scope="module")
def runs(smoke_run: Path, tmp_path_factory) -> tuple[Path, Path]:
    """The smoke run as shipped (no validation fleets, tests/trainer/conftest.py) and the same with one."""
    assert load_config(ROOT / "trainer/configs/smoke.yaml").run.validation_fleets == 0
    run_dir = tmp_path_factory.mktemp("fleets1")
    train(load_config(ROOT / "trainer/configs/smoke.yaml", [f"run.run_dir={run_dir}", "run.validation_fleets=1"]),
          progress=False)
    return smoke_run, run_dir


@pytest.mark.slow  # over 5 s on 2 cores: outside the fast loop
def test_each_evaluation_scores_the_random_fleets_and_selects_on_them(runs):
    plain, validated = runs
    history = read_checkpoint(validated / "last.pt")["progress"]["history"]
    assert [h["label"] for h in history] == ["warm-start", "ppo-2"]
    for h in history:
        assert h["eval/fleets_score"] > 0
        assert h["key"] == pytest.approx(selection_key(h))
    best = read_checkpoint(validated / "best.pt")["extra"]["selected"]
    assert best == min(history, key=lambda h: h["key"])["label"]
    assert "eval/fleets_score" in (validated / "metrics.csv").read_text().splitlines()[0]
    assert "eval/fleets_score" not in (plain / "metrics.csv").read_text().splitlines()[0]
    assert all("eval/fleets_score" not in h for h in read_checkpoint(plain / "last.pt")["progress"]["history"])


def test_the_validation_fleets_leave_training_itself_unchanged(runs):
    """The extra evaluation episodes draw from no generator that training uses: the same weights at the end."""
    plain, validated = (read_checkpoint(r / "last.pt")["model"] for r in runs)
    assert plain.keys() == validated.keys()
    for k in plain:
        assert torch.equal(plain[k], validated[k]), k
