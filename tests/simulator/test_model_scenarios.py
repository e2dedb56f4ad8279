"""Scenarios whose requests name models: the `models` field, name ranges, and the multi-model group."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.simulator.cluster import ClusterSim, simulate
from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup, expand_names
from routewise_vllm.simulator.experiments import ALL, resolve_scenarios
from routewise_vllm.simulator.scenario import ScenarioSpec, load_scenario, scenario_names


def test_name_ranges_expand_and_a_reversed_range_is_named():
    assert expand_names(["base", "sql-{0..2}", "x{9..10}y"]) == ["base", "sql-0", "sql-1", "sql-2", "x9y", "x10y"]
    with pytest.raises(ValueError, match=r"'a-\{3..1\}': the range 3..1 is empty"):
        expand_names(["a-{3..1}"])
    group = ReplicaGroup(profile="llama3-8b-a100", models=["base"], lora={"adapters": ["ad-{0..3}"], "max_loras": 2})
    assert group.served() == {"base", "ad-0", "ad-1", "ad-2", "ad-3"}


def test_the_models_group_is_outside_the_suite():
    group = scenario_names("models")
    assert {"models-disjoint", "models-overlap", "models-lora"} <= set(group)
    assert not set(group) & set(resolve_scenarios(ALL))


@pytest.mark.parametrize("name", ["models-disjoint", "models-overlap", "models-lora"])
def test_models_are_drawn_by_share_on_the_same_arrivals(name):
    sc = load_scenario(name, split="eval")
    _, reqs = sc.build(np.random.default_rng(0))
    plain = dataclasses.replace(sc, spec=sc.spec.model_copy(update={"models": []}))
    _, without = plain.build(np.random.default_rng(0))
    assert [(r.arrival_s, r.prompt_tokens) for r in reqs] == [(r.arrival_s, r.prompt_tokens) for r in without]
    assert all(r.model is None for r in without) and all(r.model is not None for r in reqs)
    counts = collections.Counter(r.model for r in reqs)
    for m in sc.spec.models:
        if "{" not in m.name:
            assert abs(counts[m.name] / len(reqs) - m.share) < 0.03, (m.name, counts[m.name])


def test_a_range_of_adapters_is_drawn_by_zipf_popularity():
    sc = load_scenario("models-lora", split="eval")
    _, reqs = sc.build(np.random.default_rng(1))
    counts = collections.Counter(r.model for r in reqs if r.model.startswith("adapter-"))
    assert len(counts) > 20  # many adapters appear
    assert counts["adapter-0"] > 3 * counts["adapter-9"] > 0  # the head is much more popular than the tail


def test_scenario_models_must_sum_to_one_and_be_served():
    data = load_scenario("models-overlap").spec.model_dump()
    data["models"] = [{"name": "chat-8b", "share": 0.5}, {"name": "code-8b", "share": 0.3}]
    with pytest.raises(ValueError, match="models: the shares sum to 0.8, not 1"):
        ScenarioSpec.model_validate(data)
    data["models"] = [{"name": "chat-8b", "share": 0.5}, {"name": "llama-3-70b", "share": 0.5}]
    with pytest.raises(ValueError, match="models: no replica group serves 'llama-3-70b'"):
        ScenarioSpec.model_validate(data)
    data["models"] = [{"name": "chat-8b", "share": 0.5}, {"name": "chat-8b", "share": 0.5}]
    with pytest.raises(ValueError, match="a model is named twice"):
        ScenarioSpec.model_validate(data)


@pytest.mark.parametrize("name", ["models-disjoint", "models-overlap"])
def test_every_request_of_a_multi_model_scenario_lands_on_a_replica_of_its_model(name):
    sc = load_scenario(name, split="eval")
    cluster, reqs = sc.build(np.random.default_rng(0))
    reqs = reqs[:800]
    served = {rid: g.served() for rid, g in zip(ClusterSim(cluster, []).replica_ids,
                                                 [g for g in cluster.replicas for _ in range(g.count)])}
    records = simulate(cluster, reqs, make_policy("least-outstanding", seed=0), seed=0)
    assert all(req.model in served[rec.replica_id] for req, rec in zip(reqs, records))
    assert len({rec.replica_id for rec in records}) == cluster.replica_count()
