"""The simulated KV view: the replicas' cache changes reach each router's KVView as events, lagged, lost, replayed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from routewise_vllm.router.policy.kv_view import BlockRemoved, KeyedBlocksStored, KVView, TokenBlocks
from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.router.policy.tracking import MATCH_SOURCES
from routewise_vllm.simulator.cluster import ClusterSim, simulate
from routewise_vllm.simulator.config import ClusterConfig, FaultConfig, KVViewConfig, ReplicaGroup
from routewise_vllm.simulator.experiments import ExperimentError, compare
from routewise_vllm.simulator.kv_feed import batch_events
from routewise_vllm.simulator.types import SimRequest

PRECISE, GUESS, MIXED = (MATCH_SOURCES.index(s) for s in ("precise", "guess", "mixed"))


def workload(n: int = 240, rate: float = 12.0, prefixes: int = 40, seed: int = 0) -> list[SimRequest]:
    """Long shared prefixes (4 blocks of 512 tokens) over a small KV cache: blocks are stored and evicted."""
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1.0 / rate, n))
    out = []
    for i in range(n):
        p = int(rng.integers(prefixes))
        ids = tuple(p * 10 + k for k in range(4)) + (10_000 + i,)
        out.append(SimRequest(i, float(arr[i]), 2048 + int(rng.integers(16, 400)), int(rng.integers(1, 40)),
                              block_ids=ids, max_tokens=40))
    return out


def config(kv: KVViewConfig | None = None, count: int = 3, **kw) -> ClusterConfig:
    group = ReplicaGroup(profile="llama3-8b-a100", count=count, gpu_memory_utilization=0.25)  # ~25k tokens of KV
    return ClusterConfig(replicas=[group], kv_view=kv or KVViewConfig(), **kw)


def route(sim: ClusterSim, policy: str = "prefix-aware", check=None) -> list:
    pol = make_policy(policy, seed=0)
    while (d := sim.next_decision()) is not None:
        if check is not None:
            check(sim, *d)
        sim.dispatch(pol.choose(*d))
    return sim.finish()


def view_keys(sim: ClusterSim, i: int, router: int = 0) -> set[int]:
    return set(sim.routers[router].kv_view.replicas[sim.replica_ids[i]].own.get(None, {}))


# ---------------------------------------------------------------- the view's keyed blocks (pure)


def test_keyed_blocks_are_stored_matched_removed_and_capped():
    view = KVView(max_blocks=3)
    view.attach("a", 0.0)
    view.attach("b", 0.0)
    assert view.apply("a", 0, [KeyedBlocksStored((11, 12, 13))], 1.0) is None
    assert view.match_many(["a", "b"], TokenBlocks((11, 12, 13, 14), 512)) == [3, 0]
    view.apply("a", 1, [BlockRemoved((12,))], 2.0)
    assert view.match_many(["a"], (11, 12, 13)) == [1]
    view.apply("a", 2, [KeyedBlocksStored((12, 14))], 3.0)  # 4 blocks over a cap of 3: the oldest (11) goes
    assert view.match_many(["a"], (11,)) == [0] and view.match_many(["a"], (13,)) == [1]
    st = view.stats("a")
    assert st.dropped == 1 and st.events["BlockStored"] == 2 and st.events["BlockRemoved"] == 1
    view.attach("c", 0.0, adapters=frozenset({"x"}))
    view.apply("c", 0, [KeyedBlocksStored((5,), lora_name="y")], 4.0)  # an adapter it does not serve
    assert view.stats("c").ignored["unknown_lora"] == 1 and not view.fresh("c", 4.0)


def test_batch_events_keep_order_in_runs():
    ops = [(True, 1), (True, 2), (False, 7), (False, 8), (True, 3)]
    assert batch_events(ops) == [KeyedBlocksStored((1, 2)), BlockRemoved((7, 8)), KeyedBlocksStored((3,))]
    assert batch_events([]) == []


def test_parse_names_the_bad_text():
    assert KVViewConfig.parse("guess").mode == "guess"
    assert KVViewConfig.parse("precise") == KVViewConfig(mode="precise")
    assert KVViewConfig.parse("lagged:0.5") == KVViewConfig(mode="precise", lag_s=0.5)
    assert KVViewConfig.parse("lagged:0.5").label() == "lagged:0.5"
    for bad in ("exact", "lagged:", "lagged:-1", "lagged:x"):
        with pytest.raises(ValueError, match="kv view"):
            KVViewConfig.parse(bad)
    with pytest.raises(ExperimentError, match="lagged:SECONDS"):
        compare(["prefix-heavy"], ["least-outstanding"], 1, progress=False, kv_view="nope")


# ---------------------------------------------------------------- the simulated feed


def test_guess_is_the_default_and_keeps_the_view_off():
    assert ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100")]).kv_view.mode == "guess"
    sim = ClusterSim(config(), workload(40), seed=0)
    seen = []
    route(sim, check=lambda s, view, info: seen.append(type(info.prefix_blocks)))
    assert sim.tracker.kv_view is None and set(seen) == {tuple}
    assert sim.tracker.match_sources[GUESS] == 40


def test_precise_view_is_the_replicas_cache_at_every_decision():
    sim = ClusterSim(config(KVViewConfig(mode="precise")), workload(), seed=0)
    compared = []

    def check(s, view, info):
        assert type(info.prefix_blocks) is TokenBlocks and info.prefix_blocks.block_tokens == 512
        for i, rep in enumerate(s.replicas):
            assert view_keys(s, i) == set(rep.cache)  # delivered at once: the view is exactly the cache
            compared.append(len(rep.cache))

    route(sim, check=check)
    assert sim.tracker.match_sources == [240, 0, 0]
    stats = [sim.tracker.kv_view.stats(r) for r in sim.replica_ids]
    assert sum(st.events["BlockRemoved"] for st in stats) > 0  # the cache was under pressure: evictions were seen
    assert max(compared) > 0


def test_matches_come_from_the_view_in_prefix_blocks():
    # inflight_s 0: the view's matches alone (what was sent lately raises them otherwise: tests/kv/test_kv_view.py)
    sim = ClusterSim(config(KVViewConfig(mode="precise", inflight_s=0.0)), workload(), seed=0)
    matches = []

    def check(s, view, info):
        expect = s.tracker.kv_view.match_many(s.replica_ids, info.prefix_blocks)
        got = [r.prefix_match_blocks for r in view.replicas]
        assert got == expect
        matches.extend(got)

    route(sim, check=check)
    assert 0 < max(matches) <= 5  # counted in the requests' 512-token blocks, not in 16-token KV blocks


def test_lag_hides_what_was_stored_meanwhile():
    reqs = [SimRequest(0, 0.0, 2300, 4, block_ids=(1, 2, 3, 4), max_tokens=4),
            SimRequest(1, 3.0, 2300, 4, block_ids=(1, 2, 3, 9), max_tokens=4)]

    def second_match(lag: float) -> list[int]:
        sim = ClusterSim(config(KVViewConfig(mode="precise", lag_s=lag)), reqs, seed=0)
        seen = []
        route(sim, check=lambda s, view, info: seen.append([r.prefix_match_blocks for r in view.replicas]))
        return seen[1]

    assert max(second_match(0.0)) == 3
    assert second_match(10.0) == [0, 0, 0]  # stored 3 s before, reported 10 s late: fresh but not yet there


def test_lost_batches_make_the_view_stale_and_replays_recover_it():
    def run(replay: bool) -> ClusterSim:
        sim = ClusterSim(config(KVViewConfig(mode="precise", loss=0.2, replay=replay, stale_hold_s=5.0)),
                         workload(), seed=3)
        route(sim)
        return sim

    lossy, replayed = run(False), run(True)
    stats = [lossy.tracker.kv_view.stats(r) for r in lossy.replica_ids]
    assert lossy._kv.lost > 0 and sum(st.gaps for st in stats) > 0
    assert lossy.tracker.match_sources[GUESS] + lossy.tracker.match_sources[MIXED] > 0  # stale: the guess there
    rstats = [replayed.tracker.kv_view.stats(r) for r in replayed.replica_ids]
    assert sum(st.replays["complete"] for st in rstats) > 0 and sum(st.replays["incomplete"] for st in rstats) == 0
    assert replayed.tracker.match_sources[PRECISE] > lossy.tracker.match_sources[PRECISE]


def test_replayed_view_ends_as_the_cache():
    sim = ClusterSim(config(KVViewConfig(mode="precise", loss=0.3, replay=True)), workload(), seed=1)
    fresh_equal = []

    def check(s, view, info):
        kv = s.tracker.kv_view
        for i, rep in enumerate(s.replicas):
            r = kv.stats(s.replica_ids[i])
            if not r.replaying and kv.fresh(s.replica_ids[i], s.now_s) and s._kv.seq[i] - 1 == r.last_seq:
                fresh_equal.append(view_keys(s, i) == set(rep.cache))  # every batch published was applied

    route(sim, check=check)
    assert len(fresh_equal) > 100 and all(fresh_equal)


def test_a_failed_replica_view_is_cleared_and_stale():
    kv = KVViewConfig(mode="precise", stale_hold_s=4.0)
    sim = ClusterSim(config(kv, faults=[FaultConfig(kind="crash", replica=0, at_s=8.0, duration_s=3.0)]),
                     workload(), seed=0)
    after = []

    def check(s, view, info):
        if 10.0 <= s.now_s < 14.0:  # detected at 10 s (2 s health-check delay), stale until 14 s
            after.append((s.tracker.kv_view.fresh(s.replica_ids[0], s.now_s), view_keys(s, 0) <= set(s.replicas[0].cache)))

    route(sim, check=check)
    st = sim.tracker.kv_view.stats(sim.replica_ids[0])
    assert st.clears >= 1
    assert after and not any(fresh for fresh, _ in after) and all(sub for _, sub in after)
    assert sim.tracker.match_sources[MIXED] > 0


def test_each_router_has_its_own_view_and_losses():
    sim = ClusterSim(config(KVViewConfig(mode="precise", loss=0.2), routers=2), workload(), seed=0)
    route(sim)
    a, b = (r.kv_view for r in sim.routers)
    assert a is not b
    assert [a.stats(r).gaps for r in sim.replica_ids] != [b.stats(r).gaps for r in sim.replica_ids]


def test_the_feed_draws_apart_from_the_cluster():
    """Loss draws come from the feed's own generator: a policy blind to prefixes routes as on the guess, and a run
    repeats exactly."""
    reqs = workload()
    guess = simulate(config(), reqs, make_policy("least-outstanding", seed=0), seed=5)
    lossy = KVViewConfig(mode="precise", loss=0.3, lag_s=0.2)
    precise = simulate(config(lossy), reqs, make_policy("least-outstanding", seed=0), seed=5)
    assert [(r.replica_id, r.first_token_s) for r in guess] == [(r.replica_id, r.first_token_s) for r in precise]
    again = [simulate(config(lossy), reqs, make_policy("prefix-aware", seed=0), seed=5) for _ in range(2)]
    assert [(r.replica_id, r.finish_s) for r in again[0]] == [(r.replica_id, r.finish_s) for r in again[1]]


# ---------------------------------------------------------------- simulator compare --kv-view


def test_compare_kv_view_runs_the_same_arrivals_with_each_view(capsys):
    from pathlib import Path

    from routewise_vllm.simulator.cli import main

    scenario = Path(__file__).resolve().parents[1] / "data" / "scenario_good.yaml"
    base = ["compare", "--scenario", str(scenario), "--policies", "least-outstanding", "--seeds", "1", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--kv-view", "lagged:0.25"]) == 0
    lagged = json.loads(capsys.readouterr().out)
    assert lagged["kv_view"] == "lagged:0.25" and "kv_view" not in plain
    assert lagged["results"][0]["metrics"] == plain["results"][0]["metrics"]  # least-outstanding ignores the view
    assert main([*base, "--kv-view", "exact"]) == 2
    assert "--kv-view" in capsys.readouterr().err


def test_a_scenario_sets_its_view_and_bad_values_name_the_field():
    from pydantic import ValidationError

    group = {"profile": "llama3-8b-a100"}
    cfg = ClusterConfig.model_validate({"replicas": [group], "kv_view": {"mode": "precise", "lag_s": 0.5, "replay": True}})
    assert cfg.kv_view == KVViewConfig(mode="precise", lag_s=0.5, replay=True)
    for bad in ({"mode": "exact"}, {"loss": 1.0}, {"lag_s": -1}, {"lag": 1}):
        with pytest.raises(ValidationError, match="kv_view"):
            ClusterConfig.model_validate({"replicas": [group], "kv_view": bad})
