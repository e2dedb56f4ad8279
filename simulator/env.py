"""Gymnasium environment: one step = one routing decision on a simulated cluster.

Observation: `build_features(view, request, pad_to=max_replicas)` (rows past the cluster's
replica count are zero padding). Action: the replica index. `info["action_mask"]` (int8) marks
the healthy replicas; agents must sample within it.

Reward between two decisions, in seconds divided by `reward_scale`:

    -(increase of the integral of requests waiting for their first token)
    - slo_penalty * (increase of the integral of requests waiting longer than ttft_slo_s)

Requests are never dropped. At the end of the episode the cluster runs to completion and the
rest of both integrals is added to the last reward, so the undiscounted return is exactly
-(sum of TTFT + slo_penalty * sum of TTFT beyond the SLO) / reward_scale (Little's law).

A masked action (unhealthy or padding replica): with `invalid_action="fallback"` (default, so
Gymnasium's env checker, which samples unmasked actions, passes) the request goes to the
least-outstanding healthy replica and `info["masked_action"]` is True; with
`invalid_action="raise"` it raises ValueError.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import gymnasium as gym
import numpy as np

from router.policy.features import N_FEATURES, action_mask, build_features
from router.policy.types import ClusterView, RequestInfo
from simulator.cluster import ClusterSim
from simulator.config import ClusterConfig
from simulator.types import SimRequest

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
        self.slo_penalty = slo_penalty
        self.reward_scale = reward_scale
        self.invalid_action = invalid_action
        self.observation_space = gym.spaces.Box(0.0, OBS_HIGH, shape=(max_replicas, N_FEATURES), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(max_replicas)
        self.sim: ClusterSim | None = None
        self._view: ClusterView | None = None
        self._request: RequestInfo | None = None
        self._cost = 0.0
        self._obs = np.zeros((max_replicas, N_FEATURES), dtype=np.float32)

    def _total_cost(self) -> float:
        sim = self.sim
        assert sim is not None
        cost = sim.first_token_wait_integral()
        if self.slo_penalty:
            cost += self.slo_penalty * sim.slo_excess_integral(self.ttft_slo_s)
        return cost

    def _observe(self) -> tuple[np.ndarray, dict[str, Any]]:
        assert self._view is not None and self._request is not None and self.sim is not None
        self._obs = build_features(self._view, self._request, pad_to=self.max_replicas)
        info = {
            "action_mask": action_mask(self._view, pad_to=self.max_replicas),
            "n_replicas": len(self.sim.replica_ids),
            "now_s": self.sim.now_s,
        }
        return self._obs, info

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        config, requests = self.scenario_factory(self.np_random)
        if config.replica_count() > self.max_replicas:
            raise ValueError(f"scenario has {config.replica_count()} replicas, more than max_replicas={self.max_replicas}")
        if not requests:
            raise ValueError("scenario produced no requests")
        self.sim = ClusterSim(config, requests, seed=int(self.np_random.integers(2**63 - 1)))
        d = self.sim.next_decision()
        assert d is not None
        self._view, self._request = d
        self._cost = self._total_cost()
        return self._observe()

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.sim is None or self._view is None:
            raise RuntimeError("call reset() before step()")
        sim, view = self.sim, self._view
        a = int(action)
        masked = not (0 <= a < len(view.replicas) and view.replicas[a].healthy)
        if masked:
            if self.invalid_action == "raise":
                raise ValueError(f"action {a} is masked (unhealthy or padding replica); valid: {view.healthy_indices()}")
            healthy = view.healthy_indices()
            a = min(healthy, key=lambda i: (view.replicas[i].outstanding, i))
        sim.dispatch(a)
        d = sim.next_decision()
        if d is None:
            records = sim.finish()
            cost = self._total_cost()
            reward = -(cost - self._cost) / self.reward_scale
            self._cost = cost
            self._view = None
            info = {
                "action_mask": np.zeros(self.max_replicas, dtype=np.int8),
                "n_replicas": len(sim.replica_ids),
                "now_s": sim.now_s,
                "masked_action": masked,
                "episode_ttft": np.array([r.ttft_s for r in records]),
                "episode_records": records,
            }
            return self._obs, float(reward), True, False, info
        self._view, self._request = d
        cost = self._total_cost()
        reward = -(cost - self._cost) / self.reward_scale
        self._cost = cost
        obs, info = self._observe()
        info["masked_action"] = masked
        return obs, float(reward), False, False, info
