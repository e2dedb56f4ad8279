from pathlib import Path

import numpy as np
import pytest

from routewise_vllm.simulator.scenario import SCENARIOS_DIR, ScenarioError, load_scenario, scenario_names
from routewise_vllm.simulator.traces import TraceLibrary

DATA = Path(__file__).resolve().parent.parent / "data"

REQUIRED_SUITE = {
    "steady-chat", "bursty-code", "prefix-heavy", "prefix-synthetic", "heterogeneous", "kv-pressure",
    "adversarial", "stale-metrics", "slowdown",
}  # fmt: skip


def test_suite_is_complete_and_names_match_files():
    names = scenario_names()
    assert REQUIRED_SUITE <= set(names)
    for name in names:
        spec = load_scenario(name).spec
        assert spec.name == name
        assert spec.description.strip()


def test_unknown_scenario_lists_the_known_ones():
    with pytest.raises(ScenarioError, match=r"unknown scenario 'steady'; known: .*steady-chat"):
        load_scenario("steady")
    with pytest.raises(ScenarioError, match="not found"):
        load_scenario("nowhere/x.yaml")


def test_invalid_field_names_file_field_and_value():
    with pytest.raises(ScenarioError) as err:
        load_scenario(DATA / "scenario_bad_field.yaml")
    msg = str(err.value)
    assert "scenario_bad_field.yaml" in msg
    assert "workload.synthetic.n_requests" in msg
    assert "got -5" in msg


def test_misspelt_field_is_rejected():
    with pytest.raises(ScenarioError, match=r"scenario_extra_field\.yaml: field 'slo.tpot_p99': Extra inputs"):
        load_scenario(DATA / "scenario_extra_field.yaml")


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ndescription: [unclosed\nslo: {}\n")
    with pytest.raises(ScenarioError, match=r"broken\.yaml:\d+: not valid YAML"):
        load_scenario(path)


def test_unknown_profile_and_fault_out_of_range(tmp_path):
    text = (DATA / "scenario_good.yaml").read_text()
    bad_profile = tmp_path / "p.yaml"
    bad_profile.write_text(text.replace("llama3-8b-h100", "llama9-h900"))
    with pytest.raises(ScenarioError, match=r"p\.yaml: field 'cluster.replicas.0.profile':.*llama9-h900"):
        load_scenario(bad_profile)
    bad_fault = tmp_path / "f.yaml"
    bad_fault.write_text(text.replace("slo:", "  faults: [{kind: crash, replica: 2, at_s: 1}]\nslo:"))
    with pytest.raises(ScenarioError, match=r"faults\[0\].replica = 2 but the cluster has 2 replicas"):
        load_scenario(bad_fault)


def test_unknown_split_is_rejected():
    with pytest.raises(ScenarioError, match="unknown split 'test'"):
        load_scenario("steady-chat", split="test")


def test_build_is_deterministic_and_salted_by_split():
    train = load_scenario(DATA / "scenario_good.yaml", split="train", library=TraceLibrary(DATA))
    evals = load_scenario(DATA / "scenario_good.yaml", split="eval", library=TraceLibrary(DATA))
    cfg, a = train.build(np.random.default_rng(3))
    _, b = train.build(np.random.default_rng(3))
    _, c = evals.build(np.random.default_rng(3))
    assert a == b
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    assert cfg.replica_count() == 2 and len(a) == 200
    assert train.slo.ttft_s == 1.0 and train.slo.tpot_s == 0.1


def test_every_builtin_scenario_builds_in_both_splits():
    library = TraceLibrary()
    for name in scenario_names():
        for split in ("train", "eval"):
            cfg, reqs = load_scenario(name, split=split, library=library).build(np.random.default_rng(0))
            scored = [r for r in reqs if r.tenant != "warmup"]
            assert 500 <= len(scored) <= 6000, (name, split, len(scored))
            assert all(x.arrival_s <= y.arrival_s for x, y in zip(reqs, reqs[1:]))


def test_builtin_files_live_in_the_package():
    assert all((SCENARIOS_DIR / f"{n}.yaml").is_file() for n in scenario_names())


def test_with_profiles_moves_only_the_named_profile():
    sc = load_scenario("heterogeneous")
    swapped = sc.with_profiles({"llama3-8b-h100": "llama3-8b-l4"})
    assert [(g.profile, g.count) for g in swapped.cluster.replicas] == [("llama3-8b-l4", 2), ("llama3-8b-a100", 3)]
    assert [g.profile for g in sc.cluster.replicas] == ["llama3-8b-h100", "llama3-8b-a100"]  # the original is untouched
    with pytest.raises(ScenarioError, match=r"cluster\.replicas\.0\.profile.*no-such-gpu"):
        sc.with_profiles({"llama3-8b-h100": "no-such-gpu"})
