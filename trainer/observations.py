"""Real simulator observations (build_features rows + masks) for parity checks and tests."""

from __future__ import annotations

import numpy as np

from routewise_vllm.trainer.config import TrainConfig
from routewise_vllm.trainer.instances import InstanceBuilder, InstanceSpec
from routewise_vllm.trainer.network import RoutingNet
from routewise_vllm.trainer.rollout import SpecEnv, policy_episodes


def simulator_observations(net: RoutingNet, cfg: TrainConfig, n: int, seed: int = 7, progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """At least `n` decisions of the greedy network on domain-randomised TRAIN instances of every
    configured scenario (round-robin over scenarios), cut to exactly `n`."""
    from tqdm import tqdm

    builder = InstanceBuilder(cfg.env)
    env = SpecEnv(cfg, builder)
    feats, masks = [], []
    got = 0
    k = 0
    per_episode = min(cfg.env.max_requests, max(50, n // max(1, len(cfg.env.scenarios))))
    bar = tqdm(total=n, desc="parity observations", unit="obs", disable=not progress)
    while got < n:
        sc = cfg.env.scenarios[k % len(cfg.env.scenarios)]
        spec = InstanceSpec(sc, seed + k, 1.0, True, per_episode)
        ep = policy_episodes([env], [spec], net, greedy=True)[0]
        feats.append(ep.features)
        masks.append(ep.masks)
        got += len(ep.actions)
        bar.update(len(ep.actions))
        k += 1
    bar.close()
    return np.concatenate(feats)[:n], np.concatenate(masks)[:n]
