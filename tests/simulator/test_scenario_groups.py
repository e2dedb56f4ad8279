"""Scenario groups: the fleet shapes load by name and by group, and stay out of the suite `all`."""

from __future__ import annotations

import numpy as np
import pytest

from routewise_vllm.simulator.cli import main
from routewise_vllm.simulator.costmodel import load_profile
from routewise_vllm.simulator.experiments import ALL, ExperimentError, resolve_scenarios
from routewise_vllm.simulator.scenario import SCENARIO_GROUPS, SCENARIOS_DIR, ScenarioError, load_scenario, scenario_names

SUITE = {
    "adversarial", "bursty-code", "crash", "heterogeneous", "kv-pressure", "prefix-heavy", "prefix-synthetic",
    "slowdown", "stale-metrics", "steady-chat",
}  # fmt: skip


def test_the_default_suite_is_still_the_ten_scenarios():
    assert set(scenario_names()) == SUITE
    assert resolve_scenarios(ALL) == scenario_names()


def test_shapes_are_a_group_outside_the_suite():
    shapes = scenario_names("shapes")
    assert {"shape-conv-2", "shape-conv-8", "shape-conv-32", "shape-conv-mix2x", "shape-code-mix8x"} <= set(shapes)
    assert not set(shapes) & SUITE
    assert resolve_scenarios("shapes") == shapes
    assert resolve_scenarios("shapes,steady-chat") == [*shapes, "steady-chat"]
    # the suite and a group in one list (a model card's evaluation), each scenario once
    assert resolve_scenarios("all,shapes") == [*scenario_names(), *shapes]
    assert resolve_scenarios("steady-chat,all") == ["steady-chat", *(n for n in scenario_names() if n != "steady-chat")]
    assert all((SCENARIOS_DIR / "shapes" / f"{n}.yaml").is_file() for n in shapes)


def test_group_names_do_not_shadow_scenarios():
    every = set(scenario_names()).union(*(scenario_names(g) for g in SCENARIO_GROUPS))
    assert not set(SCENARIO_GROUPS) & every
    assert len(every) == len(scenario_names()) + sum(len(scenario_names(g)) for g in SCENARIO_GROUPS)


def test_unknown_group_and_unknown_name_are_clear_errors():
    with pytest.raises(ScenarioError, match="unknown scenario group 'shape'; known: shapes"):
        scenario_names("shape")
    with pytest.raises(ExperimentError, match=r"unknown scenario 'shape-conv-3'; known: .*the groups shapes"):
        resolve_scenarios("shape-conv-3")


def _speed_ratio(fast: str, slow: str) -> tuple[float, float]:
    """(prefill 8k tokens, decode batch 1 at 1k context) iteration time of `slow` over `fast`."""
    f, s = load_profile(fast), load_profile(slow)
    return s.iteration_time(8192, 0, 0) / f.iteration_time(8192, 0, 0), s.iteration_time(0, 1, 1000) / f.iteration_time(0, 1, 1000)


def test_shapes_cover_the_replica_counts_and_speed_mixes_issue_16_asks_for():
    specs = {n: load_scenario(n).spec for n in scenario_names("shapes")}
    counts = {n: s.cluster.replica_count() for n, s in specs.items()}
    assert {2, 8, 32} <= set(counts.values())
    ratios = {}
    for name, spec in specs.items():
        profiles = [g.profile for g in spec.cluster.replicas]
        assert all(g.speed_factor == 1.0 for g in spec.cluster.replicas)  # the speed comes from the profiles
        ratios[name] = _speed_ratio(profiles[0], profiles[-1]) if len(profiles) > 1 else (1.0, 1.0)
    assert ratios["shape-conv-8"] == (1.0, 1.0)
    assert all(1.4 < r < 3 for r in ratios["shape-conv-mix2x"])
    assert all(6 < r < 10 for r in ratios["shape-code-mix8x"])
    assert specs["shape-code-mix8x"].workload.trace == "azure-code"
    assert [g.count for g in specs["shape-code-mix8x"].cluster.replicas] == [2, 6]
    # few batch slots (the CPU demo's 8): heterogeneous's fleet and trace, every replica queueing its ninth request
    slots8 = specs["shape-conv-slots8"]
    assert [(g.profile, g.count, g.max_num_seqs) for g in slots8.cluster.replicas] == [
        ("llama3-8b-h100", 2, 8), ("llama3-8b-a100", 3, 8)]
    assert slots8.workload.trace == "azure-conv"


def test_every_shape_builds_on_the_eval_split():
    for name in scenario_names("shapes"):
        cluster, reqs = load_scenario(name, split="eval").build(np.random.default_rng(0))
        assert len(reqs) >= 400, name
        assert all(x.arrival_s <= y.arrival_s for x, y in zip(reqs, reqs[1:]))


def test_the_scenarios_command_lists_the_group_apart(capsys):
    assert main(["scenarios"]) == 0
    out = capsys.readouterr().out
    suite_part, group_part = out.split("group `shapes`")
    assert "steady-chat" in suite_part and "shape-conv-2" not in suite_part
    assert "shape-conv-32" in group_part
