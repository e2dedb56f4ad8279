"""The routing environment training uses (DecisionEnv): the reward's meaning; its Gymnasium adapter (RoutingEnv):
conformance (check_env), determinism, masked actions."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from routewise_vllm.router.policy.features import N_FEATURES
from routewise_vllm.simulator.config import ClusterConfig, FaultConfig, ReplicaGroup
from routewise_vllm.simulator.env import DecisionEnv
from routewise_vllm.simulator.metrics import Slo, summarize
from routewise_vllm.simulator.gym_env import RoutingEnv
from routewise_vllm.simulator.types import SimRequest


def factory(rng: np.random.Generator, crash: bool = False):
    n = int(rng.integers(80, 150))
    arr = np.cumsum(rng.exponential(1 / 25.0, n))
    reqs = [SimRequest(i, float(arr[i]), int(rng.integers(50, 2000)), int(rng.integers(1, 300))) for i in range(n)]
    faults = [FaultConfig(kind="crash", replica=1, at_s=1.0)] if crash else []
    count = int(rng.integers(2, 5))
    return ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=count)], faults=faults), reqs


def rollout(env: RoutingEnv, seed: int, pick=lambda mask, rng: int(np.flatnonzero(mask)[0])):
    rng = np.random.default_rng(seed)
    obs, info = env.reset(seed=seed)
    obs_list, rewards = [obs], []
    done = False
    while not done:
        obs, r, done, trunc, info = env.step(pick(info["action_mask"], rng))
        assert not trunc
        obs_list.append(obs)
        rewards.append(r)
    return np.array(obs_list), np.array(rewards), info


def random_valid(mask, rng):
    return int(rng.choice(np.flatnonzero(mask)))


def strict_check_env(env: gym.Env) -> None:
    """Gymnasium's check_env with every warning it reports raised as an error (most of its checks only warn),
    except the one about alternative render modes, which it cannot test on an env made without gym.make."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*Not able to test alternative render modes")
        check_env(env)


def test_check_env_passes():
    strict_check_env(RoutingEnv(factory, max_replicas=8))


class _OutOfSpace(RoutingEnv):
    """Planted defect: step() returns float64 observations of 1e30 (declared: float32 in [0, 1000])."""

    def step(self, action):
        obs, reward, done, trunc, info = super().step(action)
        return np.full(obs.shape, 1e30, dtype=np.float64), reward, done, trunc, info


def test_check_env_fails_on_observations_outside_the_space():
    with pytest.raises(UserWarning, match="float32|not within the observation space"):
        strict_check_env(_OutOfSpace(factory, max_replicas=8))


def test_spaces_and_info():
    env = RoutingEnv(factory, max_replicas=8)
    obs, info = env.reset(seed=0)
    assert obs.shape == (8, N_FEATURES) and obs.dtype == np.float32
    assert env.observation_space.contains(obs)
    n = info["n_replicas"]
    assert info["action_mask"].dtype == np.int8
    assert info["action_mask"].tolist() == [1] * n + [0] * (8 - n)
    assert np.all(obs[n:] == 0)


def test_same_seed_identical_episodes():
    env = RoutingEnv(factory, max_replicas=8)
    o1, r1, _ = rollout(env, 5, random_valid)
    o2, r2, _ = rollout(env, 5, random_valid)
    o3, r3, _ = rollout(env, 6, random_valid)
    assert np.array_equal(o1, o2) and np.array_equal(r1, r2)
    assert o1.shape != o3.shape or not np.array_equal(o1, o3)


def decision_rollout(env: DecisionEnv, seed: int, ttft_slo_s: float = 2.0, crash: bool = False,
                     tpot_slo_s: float = 0.0):
    """An episode of the env training uses, random healthy actions; (rewards, records)."""
    rng = np.random.default_rng(seed)
    cluster, requests = factory(rng, crash=crash)
    _obs, mask, _ = env.reset(cluster, requests, seed, ttft_slo_s, tpot_slo_s=tpot_slo_s)
    rewards, done = [], False
    while not done:
        _obs, mask_next, r, done, info = env.step(random_valid(mask, rng))
        assert info["cost"] == env.cost
        rewards.append(r)
        mask = mask_next
    return np.array(rewards), env.records()


def test_return_is_minus_total_ttft_without_slo_penalty():
    rewards, records = decision_rollout(DecisionEnv(max_replicas=8, slo_penalty=0.0), 1)
    assert rewards.sum() == pytest.approx(-sum(r.ttft_s for r in records), rel=1e-9)
    assert np.all(rewards <= 0)


def test_slo_penalty_adds_the_excess_beyond_the_slo():
    slo, pen = 0.05, 2.0
    rewards, records = decision_rollout(DecisionEnv(max_replicas=8, slo_penalty=pen), 2, ttft_slo_s=slo)
    ttft = np.array([r.ttft_s for r in records])
    expected = -(ttft.sum() + pen * np.maximum(ttft - slo, 0).sum())
    assert rewards.sum() == pytest.approx(expected, rel=1e-9)


def test_tpot_penalty_adds_the_decode_beyond_the_tpot_slo():
    slo, tpot_slo, pen = 0.05, 0.02, 0.5
    env = DecisionEnv(max_replicas=8, slo_penalty=1.0, tpot_penalty=pen)
    rewards, records = decision_rollout(env, 2, ttft_slo_s=slo, tpot_slo_s=tpot_slo)
    ttft = np.array([r.ttft_s for r in records])
    decode_over = np.array([
        max(0.0, r.finish_s - r.first_token_s - (r.output_tokens - 1) * tpot_slo) for r in records if r.output_tokens > 1
    ])
    assert (decode_over > 0).sum() > 5  # the term is exercised: some requests decode slower than the SLO
    expected = -(ttft.sum() + np.maximum(ttft - slo, 0).sum() + pen * decode_over.sum())
    assert rewards.sum() == pytest.approx(expected, rel=1e-9)
    # the same episode without the term differs by exactly that sum
    plain, _ = decision_rollout(DecisionEnv(max_replicas=8, slo_penalty=1.0), 2, ttft_slo_s=slo)
    assert rewards.sum() - plain.sum() == pytest.approx(-pen * decode_over.sum(), rel=1e-9)
    with pytest.raises(ValueError, match="tpot_penalty=0.5 needs a TPOT SLO > 0, got 0"):
        decision_rollout(env, 2, ttft_slo_s=slo)


def test_miss_penalty_charges_each_request_goodput_misses_once():
    slo, tpot_slo, pen = 0.05, 0.02, 3.0
    env = DecisionEnv(max_replicas=8, slo_penalty=0.0, miss_penalty=pen)
    rewards, records = decision_rollout(env, 3, ttft_slo_s=slo, tpot_slo_s=tpot_slo)
    ttft = np.array([r.ttft_s for r in records])
    tpot = np.array([r.tpot_s for r in records])
    misses = int(((ttft > slo) | (tpot > tpot_slo)).sum())
    assert 5 < misses < len(records)  # both kinds of request are in the episode
    summary = summarize(records, Slo(ttft_s=slo, tpot_s=tpot_slo))
    assert misses == round((1 - summary["goodput"]) * len(records))  # the count goodput scores
    assert rewards.sum() == pytest.approx(-(ttft.sum() + pen * misses), rel=1e-9)
    assert np.all(rewards <= 0)


def test_the_gymnasium_adapter_scales_the_same_rewards():
    env = RoutingEnv(factory, max_replicas=8, slo_penalty=0.0, reward_scale=10.0)
    _, rewards, info = rollout(env, 1, random_valid)
    assert rewards.sum() == pytest.approx(-info["episode_ttft"].sum() / 10.0, rel=1e-9)


def test_env_refuses_more_replicas_than_rows_and_empty_episodes():
    cluster, requests = factory(np.random.default_rng(0))
    with pytest.raises(ValueError, match="exceed max_replicas=1"):
        DecisionEnv(max_replicas=1).reset(cluster, requests, 0, 2.0)
    with pytest.raises(ValueError, match="no requests"):
        DecisionEnv(max_replicas=8).reset(cluster, [], 0, 2.0)
    with pytest.raises(RuntimeError, match="reset"):
        DecisionEnv().step(0)


def test_masked_action_falls_back_or_raises():
    env = RoutingEnv(factory, max_replicas=8)
    _, info = env.reset(seed=0)
    _, _, _, _, info = env.step(7)  # a padding row
    assert info["masked_action"] is True
    strict = RoutingEnv(factory, max_replicas=8, invalid_action="raise")
    strict.reset(seed=0)
    with pytest.raises(ValueError, match="masked"):
        strict.step(7)


def test_crash_requests_come_back_as_decisions_and_all_finish():
    env = RoutingEnv(lambda rng: factory(rng, crash=True), max_replicas=8)
    obs, rewards, info = rollout(env, 3, random_valid)
    records = info["episode_records"]
    assert len(rewards) > len(records)  # more decisions than requests: re-dispatches
    assert np.all(np.isfinite(info["episode_ttft"]))


def few_slots_factory(rng: np.random.Generator):
    """A fleet with 4 batch slots per replica under a burst: late binding holds and dispatches."""
    n = 160
    arr = np.cumsum(rng.exponential(1 / 60.0, n))
    reqs = [SimRequest(i, float(arr[i]), int(rng.integers(200, 3000)), int(rng.integers(20, 200))) for i in range(n)]
    return ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-h100", count=1, max_num_seqs=4),
                                   ReplicaGroup(profile="llama3-8b-a100", count=2, max_num_seqs=4)]), reqs


def test_behind_late_binding_the_env_runs_the_routers_rule():
    """Stepped by a heuristic on the view `decision()` gives, the env behind late binding serves every request
    as simulate_late does (the rule the live hold queue runs); a step is a dispatch with a choice, its mask the
    replicas the rule allows, the observation still the whole fleet; the return is still minus the total TTFT."""
    from routewise_vllm.router.policy.late_binding import LateBindingConfig
    from routewise_vllm.router.policy.registry import make_policy
    from routewise_vllm.simulator.late_binding import simulate_late

    cluster, requests = few_slots_factory(np.random.default_rng(4))
    late = LateBindingConfig()
    env = DecisionEnv(max_replicas=8, slo_penalty=0.0, late_binding=late)
    obs, mask, _ = env.reset(cluster, requests, 0, 2.0)
    policy = make_policy("expected-wait", seed=0)
    rewards, narrowed, done = [], 0, False
    while not done:
        view, request = env.decision()
        allowed = [i for i, r in enumerate(view.replicas) if r.healthy]
        assert np.flatnonzero(mask).tolist() == allowed and len(allowed) > 1
        narrowed += len(allowed) < 3
        assert np.count_nonzero(obs.any(axis=1)) == 3  # features of the whole fleet, not only the allowed
        refused = next((i for i in range(3) if i not in allowed), 7)  # a replica without room, or a padding row
        with pytest.raises(ValueError, match="late binding allows only"):
            env.step(refused)
        obs, mask, r, done, _ = env.step(policy.choose(view, request))
        rewards.append(r)
    records, reasons = simulate_late(cluster, requests, make_policy("expected-wait", seed=0), seed=0, late=late)
    assert reasons["held_requests"] > 0 and narrowed > 0
    assert len(rewards) < len(requests)  # dispatches without a choice are not steps
    got = sorted((r.request_id, r.replica_id, r.first_token_s) for r in env.records())
    assert got == sorted((r.request_id, r.replica_id, r.first_token_s) for r in records)
    assert sum(rewards) == pytest.approx(-sum(r.ttft_s for r in records), rel=1e-9)
