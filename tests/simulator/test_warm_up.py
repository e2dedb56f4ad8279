"""`--warm-up N` (Scenario.with_warm_up): an instance's first N arrivals are served and routed as the others but left
out of the figures, so a comparison can measure a pool already running rather than its cold start."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from routewise_vllm.simulator.cli import main
from routewise_vllm.simulator.experiments import ExperimentError, compare
from routewise_vllm.simulator.scenario import load_scenario
from routewise_vllm.simulator.traces import WARMUP_TENANT

SCENARIO = "steady-chat"


def test_the_first_arrivals_are_marked_and_nothing_else_changes():
    sc = load_scenario(SCENARIO, split="eval")
    _, cold = sc.build(np.random.default_rng(3))
    _, warm = sc.with_warm_up(100).build(np.random.default_rng(3))
    assert len(warm) == len(cold)
    marked = [r for r in warm if r.tenant == WARMUP_TENANT]
    assert len(marked) == 100
    # the 100 earliest arrivals, and every request otherwise the same (the same arrivals, prompts and blocks)
    assert max(r.arrival_s for r in marked) <= min(r.arrival_s for r in warm if r.tenant != WARMUP_TENANT)
    assert [dataclasses.replace(r, tenant="") for r in warm] == cold


def test_compare_scores_only_the_requests_after_the_warm_up():
    cold = compare([SCENARIO], ["least-outstanding"], 1, progress=False)
    warm = compare([SCENARIO], ["least-outstanding"], 1, progress=False, warm_up=500)
    n_cold = cold["results"][0]["metrics"]["requests"]
    assert warm["results"][0]["metrics"]["requests"] == n_cold - 500
    assert warm["warm_up_requests"] == 500 and "warm_up_requests" not in cold


def test_a_warm_up_that_leaves_nothing_to_score_is_an_error_naming_the_scenario():
    with pytest.raises(ExperimentError, match=f"scenario '{SCENARIO}': a warm-up of 100000 requests leaves none"):
        compare([SCENARIO], ["least-outstanding"], 1, progress=False, warm_up=100_000)
    with pytest.raises(ExperimentError, match="warm-up must be >= 0"):
        compare([SCENARIO], ["least-outstanding"], 1, progress=False, warm_up=-1)


def test_cli_rejects_a_negative_warm_up_in_one_line(capsys):
    assert main(["compare", "--scenario", SCENARIO, "--policies", "least-outstanding", "--warm-up", "-5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--warm-up must be >= 0 requests, got -5" in err and len(err.splitlines()) == 1
