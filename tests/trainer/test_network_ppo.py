"""Network, PPO pieces, config validation and paired rewards, on random observations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from routewise_vllm.router.policy.features import N_FEATURES
from routewise_vllm.trainer.config import ConfigError, NetworkConfig, PPOConfig, config_from_dict, load_config
from routewise_vllm.trainer.network import MASKED_LOGIT, RoutingNet, masked_categorical
from routewise_vllm.trainer.ppo import Batch, Coefs, build_batch, gae, ppo_update
from routewise_vllm.trainer.episode import Episode
from routewise_vllm.trainer.rollout import paired_baseline_rewards


def _obs(rng: np.random.Generator, b: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    f = rng.random((b, r, N_FEATURES)).astype(np.float32)
    f[..., 0] = 1.0
    m = (rng.random((b, r)) > 0.2).astype(np.float32)
    m[:, 0] = 1.0
    return torch.from_numpy(f), torch.from_numpy(m)


def _net(seed: int = 0) -> RoutingNet:
    torch.manual_seed(seed)
    net = RoutingNet(N_FEATURES, NetworkConfig(hidden=32, heads=4, layers=2))
    torch.nn.init.normal_(net.policy_head[-1].weight, std=1.0)  # non-trivial logits
    return net.eval()


def test_logits_are_permutation_equivariant_and_masked():
    net = _net()
    f, m = _obs(np.random.default_rng(0), 4, 7)
    perm = torch.randperm(7)
    with torch.no_grad():
        logits, value = net(f, m)
        logits_p, value_p = net(f[:, perm], m[:, perm])
    assert torch.allclose(logits[:, perm], logits_p, atol=1e-5)
    assert torch.allclose(value, value_p, atol=1e-5)
    assert torch.all(logits[m == 0] == MASKED_LOGIT)
    assert torch.all(logits[m == 1] > -1e6)


def test_padding_does_not_change_valid_logits():
    net = _net(1)
    f, m = _obs(np.random.default_rng(1), 3, 5)
    f_pad = torch.cat([f, torch.zeros(3, 11, N_FEATURES)], 1)
    m_pad = torch.cat([m, torch.zeros(3, 11)], 1)
    with torch.no_grad():
        a, va = net(f, m)
        b, vb = net(f_pad, m_pad)
    assert torch.allclose(a, b[:, :5], atol=1e-5)
    assert torch.allclose(va, vb, atol=1e-5)


def test_masked_replica_is_never_sampled():
    net = _net(2)
    f, m = _obs(np.random.default_rng(2), 64, 6)
    with torch.no_grad():
        dist = masked_categorical(net.logits(f, m), m)
        samples = dist.sample((50,))
    assert torch.all(m.gather(1, samples.T) == 1)


def test_normaliser_tracks_present_rows_only():
    net = _net()
    rng = np.random.default_rng(3)
    x = rng.normal(2.0, 3.0, size=(200, 4, N_FEATURES))
    present = np.zeros((200, 4))
    present[:, :2] = 1
    x[:, 2:] = 1000.0  # padding rows must not leak into the statistics
    net.normaliser.update(x, present)
    assert np.allclose(net.normaliser.mean.numpy(), x[:, :2].reshape(-1, N_FEATURES).mean(0))
    assert np.allclose(net.normaliser.var.numpy(), x[:, :2].reshape(-1, N_FEATURES).var(0), rtol=1e-6)


def test_gae_matches_hand_computation():
    r = np.array([1.0, 0.0, 2.0])
    v = np.array([0.5, 0.2, 0.1])
    adv, ret = gae(r, v, last_value=0.7, terminal=False, gamma=0.9, lam=0.5)
    d2 = 2.0 + 0.9 * 0.7 - 0.1
    d1 = 0.0 + 0.9 * 0.1 - 0.2
    d0 = 1.0 + 0.9 * 0.2 - 0.5
    a2 = d2
    a1 = d1 + 0.45 * a2
    a0 = d0 + 0.45 * a1
    assert np.allclose(adv, [a0, a1, a2])
    assert np.allclose(ret, adv + v)
    adv_t, _ = gae(r, v, last_value=0.7, terminal=True, gamma=0.9, lam=0.5)
    assert adv_t[2] == pytest.approx(2.0 - 0.1)


def test_ppo_update_moves_probability_toward_advantaged_actions():
    net = _net(4).train()
    rng = np.random.default_rng(4)
    f, m = _obs(rng, 256, 5)
    m[:] = 1.0
    with torch.no_grad():
        logits, values = net(f, m)
        dist = masked_categorical(logits, m)
        actions = dist.sample()
        logp = dist.log_prob(actions)
    good = f[:, :, 5].argmax(1)  # the network is permutation-equivariant: "good" must be visible in the features
    adv = (actions == good).float() * 2.0 - 1.0
    batch = Batch(f, m, actions, logp, values, adv, values + adv)
    before = dist.probs.gather(1, good[:, None]).mean().item()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    cfg = PPOConfig(epochs=4, minibatches=4, target_kl=None, clip_coef=1.0)
    stats = ppo_update(net, None, opt, batch, Coefs(1e-2, 0.0, 0.0), cfg, torch.Generator().manual_seed(0))
    with torch.no_grad():
        after = masked_categorical(net.logits(f, m), m).probs.gather(1, good[:, None]).mean().item()
    assert after > before + 0.05
    assert stats["losses/clipfrac"] > 0


def test_reference_kl_term_holds_policy_near_reference():
    rng = np.random.default_rng(5)
    f, m = _obs(rng, 128, 4)
    m[:] = 1.0
    ref = _net(5)
    moved = []
    for coef in (0.0, 50.0):
        net = _net(5).train()
        with torch.no_grad():
            logits, values = net(f, m)
            dist = masked_categorical(logits, m)
            actions = torch.zeros(128, dtype=torch.long)
            logp = dist.log_prob(actions)
        batch = Batch(f, m, actions, logp, values, torch.ones(128), values + 1)
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        cfg = PPOConfig(epochs=3, minibatches=2, target_kl=None, clip_coef=10.0)
        ppo_update(net, ref, opt, batch, Coefs(1e-2, 0.0, coef), cfg, torch.Generator().manual_seed(0))
        with torch.no_grad():
            kl = torch.distributions.kl_divergence(
                masked_categorical(net.logits(f, m), m), masked_categorical(ref.logits(f, m), m)
            ).mean()
        moved.append(kl.item())
    assert moved[1] < moved[0] * 0.5


def test_paired_rewards_telescope_to_heuristic_return():
    h_times = np.array([0.0, 1.0, 2.0, 3.0])
    h_costs = np.array([0.0, 0.5, 2.0, 2.5])
    curve = (h_times, h_costs, 4.0)
    same = paired_baseline_rewards(h_times, curve)
    assert np.allclose(same, [-0.5, -1.5, -0.5, -1.5])
    # a policy with an extra decision (a crash retry at t=1.5) still sums to the heuristic's return
    extra = paired_baseline_rewards(np.array([0.0, 1.0, 1.5, 2.0, 3.0]), curve)
    assert extra.sum() == pytest.approx(-4.0)
    assert extra[1] == pytest.approx(-0.75)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"ppo\.gamma"):
        config_from_dict({"env": {"scenarios": ["steady-chat"]}, "ppo": {"gamma": 1.5}}, "x.yaml")
    with pytest.raises(ConfigError, match=r"ppo\.bogus"):
        config_from_dict({"env": {"scenarios": ["steady-chat"]}, "ppo": {"bogus": 1}}, "x.yaml")
    with pytest.raises(ConfigError, match=r"network.*heads"):
        config_from_dict({"env": {"scenarios": ["a"]}, "network": {"hidden": 30, "heads": 4}}, "x.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: {scenarios: [steady-chat]}\nrun: {workers: -1}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: run\.workers.*got -1"):
        load_config(bad)
    cfg = load_config("trainer/configs/suite-fleet.yaml", ["ppo.updates=3"])
    assert cfg.ppo.updates == 3


def test_train_state_round_trips_and_reads_checkpoints_written_before_it():
    from routewise_vllm.trainer.ppo import Phase, TrainState

    old = {"phase": "bc", "update": 0, "wall_s": 3.0, "best": None, "best_key": math.inf, "history": [],
           "best_heuristic": {"steady-chat": "least-outstanding"}, "heuristic_runs": {}, "rng_state": None}  # fmt: skip
    state = TrainState.from_dict(old)
    assert state.phase is Phase.WARM_START and state.best_heuristic == {"steady-chat": "least-outstanding"}
    state.phase, state.update = Phase.PPO, 4
    again = TrainState.from_dict(state.to_dict())
    assert again == state and state.to_dict()["phase"] == "ppo"
    state.phase = Phase.WARM_START
    assert TrainState.from_dict(state.to_dict()).phase is Phase.WARM_START


def test_batch_is_the_episodes_in_order_with_gae_per_episode():
    """Episodes are typed across the worker boundary (pickled as they are); GAE never runs across two of them."""
    import pickle

    rng = np.random.default_rng(3)

    def episode(t: int, terminal: bool, last_value: float) -> Episode:
        return Episode(
            features=rng.random((t, 3, N_FEATURES)).astype(np.float32), masks=np.ones((t, 3), np.float32),
            actions=rng.integers(3, size=t), logprobs=rng.random(t).astype(np.float32) - 2,
            values=rng.random(t).astype(np.float32), rewards=rng.random(t) - 0.5, times=np.arange(t, dtype=float),
            fallback_free_share=float("nan"), terminal=terminal, last_value=last_value,
        )  # fmt: skip

    eps = [pickle.loads(pickle.dumps(e)) for e in (episode(5, True, 0.0), episode(4, False, 2.0))]
    batch = build_batch(eps, gamma=0.9, lam=0.8, reward_scale=2.0)
    assert len(batch) == 9 and batch.features.shape == (9, 3, N_FEATURES)
    assert torch.equal(batch.actions, torch.from_numpy(np.concatenate([e.actions for e in eps])))
    for ep, rows in zip(eps, (slice(0, 5), slice(5, 9))):
        adv, ret = gae(ep.rewards * 2.0, ep.values.astype(np.float64), ep.last_value, ep.terminal, 0.9, 0.8)
        assert np.allclose(batch.advantages[rows].numpy(), adv, atol=1e-6)
        assert np.allclose(batch.returns[rows].numpy(), ret, atol=1e-6)
    assert not np.isclose(batch.advantages[8].item(), (eps[1].rewards[-1] * 2.0 - eps[1].values[-1]))  # bootstrapped tail
