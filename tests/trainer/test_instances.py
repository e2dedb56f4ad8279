"""Training instances: deterministic per spec, randomised within bounds, windows and faults."""

from __future__ import annotations

import re

import numpy as np

from routewise_vllm.simulator.config import ClusterConfig, FaultConfig, ReplicaGroup
from routewise_vllm.simulator.types import SimRequest
from routewise_vllm.trainer.config import EnvConfig
from routewise_vllm.trainer.instances import InstanceBuilder, InstanceSpec, perturb, retime_faults, window


def _requests(n: int, tenant: str = "") -> list[SimRequest]:
    return [SimRequest(i, i * 0.5, 100 + i, 10, tenant=tenant) for i in range(n)]


def test_same_spec_same_instance_and_different_seed_differs():
    b = InstanceBuilder(EnvConfig(scenarios=["steady-chat"]))
    spec = InstanceSpec("steady-chat", 5, 1.1, True, 200)
    c1, r1 = b.build(spec)
    c2, r2 = b.build(spec)
    assert c1 == c2 and r1 == r2 and len(r1) == 200
    _, r3 = b.build(InstanceSpec("steady-chat", 6, 1.1, True, 200))
    assert [q.arrival_s for q in r3] != [q.arrival_s for q in r1]


def test_perturb_scales_load_and_respects_max_replicas():
    cfg = EnvConfig(scenarios=["x"], max_replicas=5)
    cluster = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-h100", count=4)])
    reqs = _requests(10)
    c, out = perturb(cluster, reqs, cfg, np.random.default_rng(0), load=2.0, randomise=False)
    assert c == cluster
    assert np.allclose([q.arrival_s for q in out], [q.arrival_s / 2.0 for q in reqs])
    for seed in range(20):
        c, out = perturb(cluster, reqs, cfg, np.random.default_rng(seed), load=1.0, randomise=True)
        assert 1 <= c.replica_count() <= 5
        lo, hi = cfg.randomisation.speed_factor
        assert all(lo <= g.speed_factor <= hi for g in c.replicas)
        # more replicas => proportionally more traffic (arrivals compressed by the capacity ratio)
        ratio = c.replica_count() / 4
        assert np.isclose(out[-1].arrival_s, reqs[-1].arrival_s / ratio)


def test_window_rebases_times_and_scores_warmup():
    reqs = _requests(50, tenant="warmup")
    part = window(reqs, 20, np.random.default_rng(1))
    assert len(part) == 20 and part[0].arrival_s == 0.0
    assert [q.request_id for q in part] == list(range(20))
    assert all(q.tenant == "" for q in part)
    assert window(reqs, 100, np.random.default_rng(1)) is reqs


def test_faults_after_the_window_are_moved_into_it():
    cluster = ClusterConfig(
        replicas=[ReplicaGroup(profile="llama3-8b-h100", count=4)],
        faults=[FaultConfig(kind="crash", replica=1, at_s=60.0, duration_s=60.0), FaultConfig(kind="slowdown", replica=0, at_s=1.0)],
    )
    reqs = _requests(41)  # spans 20 s
    out = retime_faults(cluster, reqs, np.random.default_rng(0))
    crash, slow = out.faults
    assert 4.0 <= crash.at_s <= 10.0 and crash.duration_s <= 8.0
    assert slow.at_s == 1.0  # already inside the window: untouched


def test_random_fleets_span_the_configured_counts_and_profiles_and_keep_the_load():
    """fleet_prob 1: every instance runs on a random fleet within fleet_replicas (capped at max_replicas), drawn
    from every profile, with arrivals rescaled by the measured capacity ratio (twice the capacity, twice the rate)."""
    from routewise_vllm.simulator.cluster import ClusterSim
    from routewise_vllm.simulator.costmodel import known_profiles
    from routewise_vllm.trainer.instances import _capacity, random_fleet

    cfg = EnvConfig(scenarios=["x"], max_replicas=12,
                    randomisation={"fleet_prob": 1.0, "fleet_replicas": (2, 32), "speed_factor": (1.0, 1.0),
                                   "swap_profile_prob": 1.0})
    cluster = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=4, gpu_memory_utilization=0.3)],
                            faults=[FaultConfig(kind="crash", replica=3, at_s=1.0)])
    reqs = _requests(40)
    counts, profiles = set(), set()
    for seed in range(40):
        c, out = perturb(cluster, reqs, cfg, np.random.default_rng(seed), load=1.0, randomise=True)
        n = c.replica_count()
        assert 2 <= n <= 12
        counts.add(n)
        profiles |= {g.profile for g in c.replicas}
        assert all(f.replica < n for f in c.faults)
        assert all(g.gpu_memory_utilization >= 0.3 for g in c.replicas)
        ClusterSim(c, out[:2], seed=0)  # every group has room for its model's weights and a KV cache, swapped or not
        # the scenario's load level: arrivals compressed by exactly the fleet's measured capacity ratio
        replay = np.random.default_rng(seed)
        replay.random()  # perturb's fleet_prob draw
        again, ratio = random_fleet(cluster, reqs, 2, 12, replay)
        assert [g.count for g in again.replicas] == [g.count for g in c.replicas]
        assert np.isclose(out[-1].arrival_s, reqs[-1].arrival_s / ratio)
    assert len(counts) >= 6 and profiles == set(known_profiles())
    # the load level: the ratio is the new fleet's measured capacity over the old one's, on the instance's lengths
    old = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=1)])
    fleet, ratio = random_fleet(old, reqs, 4, 4, np.random.default_rng(3))
    lengths = (np.array([q.prompt_tokens for q in reqs]), np.array([q.output_tokens for q in reqs]))
    a100 = ReplicaGroup(profile="llama3-8b-a100", count=1)
    assert np.isclose(_capacity([a100.model_copy(update={"count": 2})], lengths, np.random.default_rng(0)),
                      2 * _capacity([a100], lengths, np.random.default_rng(0)))
    assert fleet.replica_count() == 4 and ratio > 0


def test_fleet_prob_zero_draws_nothing_new():
    """The default (fleet_prob 0) consumes no random numbers for it: earlier configs build the same instances."""
    cluster = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-h100", count=4)])
    reqs = _requests(10)
    a = perturb(cluster, reqs, EnvConfig(scenarios=["x"]), np.random.default_rng(1), load=1.0, randomise=True)
    b = perturb(cluster, reqs, EnvConfig(scenarios=["x"], randomisation={"fleet_prob": 0.0}), np.random.default_rng(1),
                load=1.0, randomise=True)
    assert a == b


def test_few_batch_slots_bound_max_num_seqs_and_keep_the_load():
    """batch_slots_prob 1: every instance's replicas share one max_num_seqs within batch_slots, never above the
    scenario's own, and arrivals are stretched by exactly the measured capacity ratio (fewer slots, less traffic)."""
    from routewise_vllm.trainer.instances import few_batch_slots

    cfg = EnvConfig(scenarios=["x"], randomisation={"batch_slots_prob": 1.0, "batch_slots": (2, 16), "speed_factor": (1.0, 1.0),
                                                    "replica_count_scale": (1.0, 1.0), "prompt_scale": (1.0, 1.0)})
    cluster = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-h100", count=2),
                                      ReplicaGroup(profile="llama3-8b-a100", count=2, max_num_seqs=12)])
    reqs = [SimRequest(i, i * 0.01, 500, 200) for i in range(60)]
    seen = set()
    for seed in range(12):
        c, out = perturb(cluster, reqs, cfg, np.random.default_rng(seed), load=1.0, randomise=True)
        h100, a100 = c.replicas
        assert 2 <= h100.max_num_seqs <= 16 and a100.max_num_seqs == min(12, h100.max_num_seqs)
        seen.add(h100.max_num_seqs)
        replay = np.random.default_rng(seed)
        scrape_settings = perturb(cluster, reqs, cfg.model_copy(update={"randomisation": cfg.randomisation.model_copy(
            update={"batch_slots_prob": 0.0})}), replay, load=1.0, randomise=True)[0]
        assert scrape_settings.scrape == c.scrape  # everything before the slots draw is unchanged
        replay.random()  # perturb's batch_slots_prob draw
        again, ratio = few_batch_slots(scrape_settings, reqs, 2, 16, replay)
        assert again == c and 0 < ratio <= 1.0
        assert np.isclose(out[-1].arrival_s, reqs[-1].arrival_s / ratio)
    assert len(seen) >= 5
    # two slots on 200-token outputs serve far fewer requests per second than 256
    _, ratio = few_batch_slots(ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-h100", count=1)]), reqs, 2, 2,
                               np.random.default_rng(0))
    assert ratio < 0.2


def test_bad_batch_slots_name_the_field_and_value():
    import pytest
    from pydantic import ValidationError

    for bad, words in (((8, 4), "batch_slots: need 0 <= lo <= hi, got (8, 4)"), ((0, 4), "batch_slots: need at least 1 slot, got (0, 4)")):
        with pytest.raises(ValidationError, match=re.escape(words)):
            EnvConfig(scenarios=["x"], randomisation={"batch_slots": bad})
    with pytest.raises(ValidationError, match="batch_slots_prob"):
        EnvConfig(scenarios=["x"], randomisation={"batch_slots_prob": 1.5})


def test_kv_events_instances_see_the_caches_through_lagged_lossy_events():
    """kv_events_prob 1: every instance's router gets the precise view with a lag and a loss drawn within their
    ranges, replay on some and off on others; everything drawn before it is the same as without it, and
    kv_events_prob 0 never touches the scenario's view."""
    cfg = EnvConfig(scenarios=["x"], randomisation={"kv_events_prob": 1.0, "kv_events_lag_s": (0.1, 0.3),
                                                    "kv_events_loss": (0.0, 0.05)})
    off = cfg.model_copy(update={"randomisation": cfg.randomisation.model_copy(update={"kv_events_prob": 0.0})})
    cluster = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-h100", count=4)])
    reqs = _requests(10)
    replays = set()
    for seed in range(16):
        c, out = perturb(cluster, reqs, cfg, np.random.default_rng(seed), load=1.0, randomise=True)
        v = c.kv_view
        assert v.mode == "precise" and 0.1 <= v.lag_s <= 0.3 and 0.0 <= v.loss <= 0.05
        replays.add(v.replay)
        plain, plain_out = perturb(cluster, reqs, off, np.random.default_rng(seed), load=1.0, randomise=True)
        assert plain.kv_view == cluster.kv_view and plain.kv_view.mode == "guess"
        assert plain.model_copy(update={"kv_view": v}) == c and plain_out == out
    assert replays == {True, False}


def test_bad_kv_events_ranges_name_the_field():
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=re.escape("kv_events_lag_s: need 0 <= lo <= hi, got (0.5, 0.1)")):
        EnvConfig(scenarios=["x"], randomisation={"kv_events_lag_s": (0.5, 0.1)})
    with pytest.raises(ValidationError, match=re.escape("kv_events_loss: a loss below 1 is needed, got (0.0, 1.0)")):
        EnvConfig(scenarios=["x"], randomisation={"kv_events_loss": (0.0, 1.0)})
    with pytest.raises(ValidationError, match="kv_events_prob"):
        EnvConfig(scenarios=["x"], randomisation={"kv_events_prob": 2.0})


def test_a_two_replica_pool_never_shrinks_to_one():
    """A uniform pool of two scaled by U(0.5, 1.5) keeps two replicas on the draws that round to one: a fleet of
    one leaves the environment no decision (simulator.env's 'no routing decision')."""
    cfg = EnvConfig(scenarios=["x"], randomisation={"replica_count_scale": (0.5, 0.6)})
    cluster = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-h100", count=2)])
    for seed in range(8):
        c, _ = perturb(cluster, _requests(10), cfg, np.random.default_rng(seed), load=1.0, randomise=True)
        assert c.replica_count() == 2
