"""tests/bench/random_fleets.py: learned policies against every heuristic on random fleets."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.bench import random_fleets
from routewise_vllm.router.policy.registry import PEER_BASELINES
from routewise_vllm.trainer.config import load_config
from routewise_vllm.trainer.instances import InstanceBuilder, InstanceSpec, random_fleet_specs


def _row(scenario: str, seed: int, replicas: int, spread: float, p99: dict[str, float], goodput: float = 1.0) -> dict:
    heur = {h: 10.0 for h in random_fleets.HEURISTICS}
    return {"scenario": scenario, "seed": seed, "replicas": replicas, "profiles": ["x"], "spread": spread,
            "p99": heur | p99, "goodput": {k: goodput for k in heur | p99}}  # fmt: skip


def test_summary_divides_by_the_best_heuristic_per_instance_and_by_the_best_single_one():
    rows = [
        _row("a", 1, 3, 1.5, {"least-outstanding": 2.0, "expected-wait": 4.0, "m": 2.0}),  # best here: least-outstanding
        _row("a", 2, 8, 3.0, {"least-outstanding": 8.0, "expected-wait": 4.0, "m": 2.0}),  # best here: expected-wait
        _row("b", 3, 20, 9.0, {"least-outstanding": 4.0, "expected-wait": 1.0, "m": 2.0}),
    ]
    doc = random_fleets.summarise(rows, ["m"])
    s = doc["models"]["m"]
    # ratios to the best per instance: 1.0, 0.5, 2.0
    assert s["vs_best_per_instance"] == pytest.approx(1.0)
    assert s["share_within_1_03"] == pytest.approx(2 / 3)
    assert s["worst"] == pytest.approx(2.0) and s["worst_instance"].startswith("b seed 3")
    # expected-wait's ratios 2, 1, 1 (geomean 1.26) beat least-outstanding's 1, 2, 4 (2.0)
    assert doc["best_single_heuristic"] == "expected-wait"
    assert s["vs_best_single"] == pytest.approx(math.exp((math.log(0.5) + math.log(0.5) + math.log(2.0)) / 3))
    assert s["by_size"] == pytest.approx({"2-4": 1.0, "5-12": 0.5, "13-32": 2.0})
    assert s["by_spread_vs_single"] == pytest.approx({"<2x": 0.5, "2-5x": 0.5, ">=5x": 2.0})
    assert doc["counts"]["by_spread"] == {"<2x": 1, "2-5x": 1, ">=5x": 1}
    assert s["goodput_gap"] == pytest.approx(0.0)
    text = random_fleets.format_summary(doc)
    assert "| m | 1.000 |" in text and "| m | 1.000 / 0.500 | 0.500 / 0.500 | 2.000 / 2.000 |" in text


def test_late_rows_are_over_the_best_per_request_heuristic_and_over_the_best_late_one():
    """--late: `<model>+late` over the best per-request heuristic (as the plain rows) and, as vs_best_late, over the
    best heuristic behind late binding on the same instance."""
    late = {h + "+late": 20.0 for h in random_fleets.HEURISTICS}
    rows = [
        _row("a", 1, 3, 1.5, late | {"least-outstanding": 2.0, "expected-wait+late": 1.0, "m": 2.0, "m+late": 1.0}),
        _row("a", 2, 8, 3.0, late | {"least-outstanding": 4.0, "expected-wait+late": 8.0, "m": 2.0, "m+late": 2.0}),
    ]
    doc = random_fleets.summarise(rows, ["m"])
    assert set(doc["models"]) == {"m", "m+late"}
    assert doc["models"]["m"]["vs_best_late"] == pytest.approx(math.sqrt(2.0 / 1.0 * 2.0 / 8.0))
    s = doc["models"]["m+late"]
    assert s["vs_best_per_instance"] == pytest.approx(math.sqrt(1.0 / 2.0 * 2.0 / 4.0))  # 0.5 each
    assert s["vs_best_late"] == pytest.approx(math.sqrt(1.0 / 1.0 * 2.0 / 8.0))
    assert "over the best late heuristic 0.500 |" in random_fleets.format_summary(doc)


def test_scenarios_get_disjoint_seed_blocks_apart_from_training_and_validation_seeds():
    specs = random_fleet_specs(["a", "b"], 3, random_fleets.SEED_BASE, 100)
    seeds = [s.seed for s in specs]
    assert len(set(seeds)) == 6 and min(seeds) >= random_fleets.SEED_BASE
    assert all(s.random_fleet and s.randomise for s in specs)
    from routewise_vllm.trainer.ppo import EVAL_SEED_BASE, VALIDATION_SEED_BASE, WARM_START_SEED_BASE

    assert random_fleets.SEED_BASE >= VALIDATION_SEED_BASE + 1_000_000 > max(EVAL_SEED_BASE, WARM_START_SEED_BASE) + 1_000_000


def test_a_forced_random_fleet_draws_as_fleet_prob_one_does():
    """`random_fleet=True` gives the fleet that fleet_prob 1 gives, and leaves other specs as they were."""
    base = load_config(random_fleets.ROOT / "trainer/configs/fleets.yaml")
    always = load_config(random_fleets.ROOT / "trainer/configs/fleets.yaml", ["env.randomisation.fleet_prob=1.0"])
    (spec,) = random_fleet_specs(["steady-chat"], 1, random_fleets.SEED_BASE, 50)
    forced, drawn = InstanceBuilder(base.env).build(spec)[0], InstanceBuilder(always.env).build(spec)[0]
    assert forced == drawn
    # also under a config that draws no random fleets at all (default.yaml: fleet_prob 0)
    default = load_config(random_fleets.ROOT / "trainer/configs/suite-fleet.yaml")
    cluster = InstanceBuilder(default.env).build(spec)[0]
    own = InstanceBuilder(default.env).scenario("steady-chat").build(np.random.default_rng(spec.seed))[0]
    assert [(g.profile, g.count) for g in cluster.replicas] != [(g.profile, g.count) for g in own.replicas]


def test_the_builder_reads_the_split_it_is_given():
    env = load_config(random_fleets.ROOT / "trainer/configs/fleets.yaml", ["env.randomisation.fleet_prob=1.0"]).env
    spec = InstanceSpec("steady-chat", random_fleets.SEED_BASE, 1.0, True, 50)
    train = InstanceBuilder(env).build(spec)[1]
    held_out = InstanceBuilder(env, split="eval").build(spec)[1]
    assert [q.prompt_tokens for q in train] != [q.prompt_tokens for q in held_out]


def test_one_instance_end_to_end_writes_every_policy(tmp_path, capsys):
    """--peers puts the peers' algorithms among the heuristics; --warm-up scores the same runs again without the
    instance's first requests."""
    out = tmp_path / "rf.json"
    assert random_fleets.main(["--fleets", "1", "--scenarios", "steady-chat", "--workers", "1", "--no-progress",
                               "--models", "learned,gated", "--peers", "--warm-up", "1000", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    (row,) = doc["instances"]
    names = set(random_fleets.HEURISTICS) | set(PEER_BASELINES) | {"learned", "gated"}
    assert set(row["p99"]) == set(row["p99_warm"]) == names
    assert 2 <= row["replicas"] <= 32 and row["spread"] >= 1.0
    # the warm figures are the last ~500 of 1,500 requests: a p99 over other requests than the cold one's
    assert row["p99_warm"] != row["p99"]
    warm = doc["summary_warm"]["models"]["gated"]
    best = min(row["p99_warm"][h] for h in names - {"learned", "gated"})
    assert warm["vs_best_per_instance"] == pytest.approx(row["p99_warm"]["gated"] / best)
    text = capsys.readouterr().out
    assert "learned" in text and "without each instance's first 1000 requests" in text


def test_the_peers_are_compared_only_when_asked():
    rows = [_row("a", 1, 3, 1.5, {"least-outstanding": 2.0, "m": 2.0})]
    for p in PEER_BASELINES:
        rows[0]["p99"][p] = rows[0]["goodput"][p] = 1.0
    assert random_fleets.summarise(rows, ["m"])["models"]["m"]["vs_best_per_instance"] == pytest.approx(1.0)
    assert random_fleets.summarise(rows, ["m"], peers=True)["models"]["m"]["vs_best_per_instance"] == pytest.approx(2.0)


def test_a_missing_model_file_or_unknown_model_is_named(capsys):
    with pytest.raises(SystemExit):
        random_fleets.main(["--models", "learned,nope.onnx", "--fleets", "1"])
    assert "nope.onnx" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        random_fleets.main(["--models", "least-outstanding", "--fleets", "1"])
    assert "'least-outstanding' is neither a learned policy's name" in capsys.readouterr().err
