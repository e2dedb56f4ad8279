"""Gymnasium adapter over `simulator.env.DecisionEnv` (the environment training uses).

Observation: the env's `build_features` rows. Action: the replica index. `info["action_mask"]` (int8)
marks the healthy replicas; agents must sample within it. Reward: the env's, divided by `reward_scale`,
so the undiscounted return is -(sum of TTFT + slo_penalty * sum of TTFT beyond the SLO) / reward_scale.

A masked action (unhealthy or padding replica): with `invalid_action="fallback"` (default, so
Gymnasium's env checker, which samples unmasked actions, passes) the request goes to the
least-outstanding healthy replica and `info["masked_action"]` is True; with
`invalid_action="raise"` it raises ValueError.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import gymnasium as gym
import numpy as np

from routewise_vllm.router.policy.features import N_FEATURES
from routewise_vllm.simulator.config import ClusterConfig
from routewise_vllm.simulator.env import DecisionEnv
from routewise_vllm.simulator.types import SimRequest

ScenarioFactory = Callable[[np.random.Generator], tuple[ClusterConfig, list[SimRequest]]]
OBS_HIGH = 1e3


class RoutingEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(
        self,
        scenario_factory: ScenarioFactory,
        max_replicas: int = 16,
        ttft_slo_s: float = 2.0,
        slo_penalty: float = 1.0,
        reward_scale: float = 1.0,
        invalid_action: Literal["fallback", "raise"] = "fallback",
    ) -> None:
        if reward_scale <= 0:
            raise ValueError(f"reward_scale must be positive, got {reward_scale}")
        if invalid_action not in ("fallback", "raise"):
            raise ValueError(f"invalid_action must be 'fallback' or 'raise', got {invalid_action!r}")
        self.scenario_factory = scenario_factory
        self.max_replicas = max_replicas
        self.ttft_slo_s = ttft_slo_s
        self.reward_scale = reward_scale
        self.invalid_action = invalid_action
        self.observation_space = gym.spaces.Box(0.0, OBS_HIGH, shape=(max_replicas, N_FEATURES), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(max_replicas)
        self.env = DecisionEnv(max_replicas, slo_penalty)
        self._started = False
        self._obs = np.zeros((max_replicas, N_FEATURES), dtype=np.float32)

    def _info(self, mask: np.ndarray) -> dict[str, Any]:
        return {"action_mask": mask.astype(np.int8), "n_replicas": self.env.n_replicas, "now_s": self.env.now_s}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        config, requests = self.scenario_factory(self.np_random)
        sim_seed = int(self.np_random.integers(2**63 - 1)) if requests else 0
        self._obs, mask, _ = self.env.reset(config, requests, sim_seed, self.ttft_slo_s)
        self._started = True
        return self._obs, self._info(mask)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if not self._started:
            raise RuntimeError("call reset() before step()")
        view, _ = self.env.decision()
        a = int(action)
        masked = not (0 <= a < len(view.replicas) and view.replicas[a].healthy)
        if masked:
            if self.invalid_action == "raise":
                raise ValueError(f"action {a} is masked (unhealthy or padding replica); valid: {view.healthy_indices()}")
            healthy = view.healthy_indices()
            a = min(healthy, key=lambda i: (view.replicas[i].outstanding, i))
        obs, mask, reward, done, _ = self.env.step(a)
        info = self._info(mask) | {"masked_action": masked}
        if done:
            self._started = False
            records = self.env.records()
            info |= {"episode_ttft": np.array([r.ttft_s for r in records]), "episode_records": records}
            return self._obs, float(reward / self.reward_scale), True, False, info
        self._obs = obs
        return obs, float(reward / self.reward_scale), False, False, info
