"""The routing environment: one step = one routing decision on a simulated cluster.

The environment PPO trains on (trainer.rollout drives it directly, so heuristics can read each decision's
ClusterView and paired rewards the simulated clock); `simulator.gym_env.RoutingEnv` is a Gymnasium adapter
over it. Plain numpy: no gymnasium, no torch.

Observation: `build_features(view, request, pad_to=max_replicas)` (rows past the cluster's replica count
are zero padding); mask: `action_mask` as float32 (1 = healthy replica). Reward between two decisions, in
seconds:

    -(increase of the integral of requests waiting for their first token)
    - slo_penalty * (increase of the integral of requests waiting longer than ttft_slo_s)
    - tpot_penalty * (seconds of decoding beyond the TPOT SLO's pace of the requests completed in between)
    - miss_penalty * (requests that became certain SLO misses in between, as goodput counts them)

Requests are never dropped. The last step runs the cluster to completion and adds the rest of both
integrals, so the undiscounted return is exactly -(sum of TTFT + slo_penalty * sum of TTFT beyond the
SLO) (Little's law), minus tpot_penalty * the sum over requests of max(0, decode time - (output tokens - 1) *
tpot_slo_s): the decode a request spent beyond its TPOT SLO, charged when it completes, and minus miss_penalty *
the requests goodput misses, each charged once, when its wait passes the TTFT SLO or it completes too slowly
(both off by default).

With `late_binding` (a LateBindingConfig) the cluster runs behind the router's late-binding rule
(the decision pipeline's room stage, router.policy.pipeline, as simulator.late_binding.simulate_late and the live
hold queue run it): requests the rule holds are held, and a request it lets go to a single replica is dispatched
there, without a step. A step is a dispatch with a choice: the observation is still the whole fleet (a scoring policy behind
late binding scores the fleet, router.policy.fallback), the mask only the replicas the rule allows, and
`decision()` gives the view restricted to them, which is what a heuristic decides on behind late binding.
Holding time counts in TTFT, so the reward is the same integral.
"""

from __future__ import annotations

import numpy as np

from routewise_vllm.router.policy.features import N_FEATURES, action_mask, build_features
from routewise_vllm.router.policy.late_binding import LateBindingConfig
from routewise_vllm.router.policy.types import ClusterView, RequestInfo
from routewise_vllm.simulator.cluster import ClusterSim
from routewise_vllm.simulator.config import ClusterConfig
from routewise_vllm.simulator.late_binding import next_choice, sim_limits
from routewise_vllm.simulator.types import RequestRecord, SimRequest


class DecisionEnv:
    def __init__(self, max_replicas: int = 16, slo_penalty: float = 1.0,
                 late_binding: LateBindingConfig | None = None, tpot_penalty: float = 0.0,
                 miss_penalty: float = 0.0) -> None:
        self.max_replicas = max_replicas
        self.slo_penalty = slo_penalty
        self.tpot_penalty = tpot_penalty
        self.miss_penalty = miss_penalty
        self.tpot_slo_s = 0.0
        self.late_binding = late_binding
        self._limits: list = []
        self._candidates: tuple[int, ...] | None = None  # behind late binding: the replicas the rule allows now
        self._allowed: ClusterView | None = None  # behind late binding: the view restricted to them
        self.ttft_slo_s = 0.0
        self.sim: ClusterSim | None = None
        self._decision: tuple[ClusterView, RequestInfo] | None = None
        self._records: list[RequestRecord] | None = None
        self.cost = 0.0  # the cumulative cost at the current decision (or at the end)

    def _total_cost(self) -> float:
        sim = self.sim
        assert sim is not None
        cost = sim.first_token_wait_integral()
        if self.slo_penalty:
            cost += self.slo_penalty * sim.slo_excess_integral(self.ttft_slo_s)
        if self.tpot_penalty:
            cost += self.tpot_penalty * sim.decode_excess(self.tpot_slo_s)
        if self.miss_penalty:
            cost += self.miss_penalty * sim.slo_misses(self.ttft_slo_s, self.tpot_slo_s)
        return cost

    def _observe(self) -> tuple[np.ndarray, np.ndarray]:
        assert self._decision is not None
        view, request = self._decision
        mask = action_mask(view, self.max_replicas).astype(np.float32)
        if self._candidates is not None:
            allowed = np.zeros_like(mask)
            allowed[list(self._candidates)] = 1.0
            mask *= allowed
        return build_features(view, request, pad_to=self.max_replicas), mask

    def _next_decision(self) -> tuple[ClusterView, RequestInfo] | None:
        """The next decision; behind late binding the next with a choice (holds and single-replica dispatches run)."""
        assert self.sim is not None
        if self.late_binding is None:
            return self.sim.next_decision()
        d = next_choice(self.sim, self._limits, self.late_binding)
        if d is None:
            return None
        choice, request = d  # the pipeline's health and room stages ran (router.policy.pipeline); the agent picks
        self._candidates, self._allowed = choice.candidates, choice.view
        return choice.context, request  # type: ignore[return-value]

    def reset(
        self, cluster: ClusterConfig, requests: list[SimRequest], seed: int, ttft_slo_s: float, name: str = "scenario",
        tpot_slo_s: float = 0.0,
    ) -> tuple[np.ndarray, np.ndarray, dict]:
        """Start an episode on (cluster, requests); `name` labels the errors. `tpot_slo_s` is needed (> 0) only
        with a tpot_penalty or a miss_penalty."""
        for term in ("tpot_penalty", "miss_penalty"):
            if getattr(self, term) and tpot_slo_s <= 0:
                raise ValueError(f"{name}: {term}={getattr(self, term)} needs a TPOT SLO > 0, got {tpot_slo_s}")
        if cluster.replica_count() > self.max_replicas:
            raise ValueError(f"{name}: {cluster.replica_count()} replicas exceed max_replicas={self.max_replicas}")
        if not requests:
            raise ValueError(f"{name}: no requests")
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self.sim = ClusterSim(cluster, requests, seed=seed)
        self._records = None
        self._candidates = self._allowed = None
        if self.late_binding is not None:
            self._limits = sim_limits(self.sim, self.late_binding)
        self._decision = self._next_decision()
        if self._decision is None:
            raise ValueError(f"{name}: no routing decision")
        self.cost = self._total_cost()
        obs, mask = self._observe()
        return obs, mask, {"time_s": self.sim.now_s}

    def step(self, action: int) -> tuple[np.ndarray, np.ndarray, float, bool, dict]:
        """Route the current request to replica `action`; the next decision's (obs, mask), reward, done, info."""
        if self.sim is None or self._decision is None:
            raise RuntimeError("call reset() before step()")
        if self._candidates is not None and int(action) not in self._candidates:
            raise ValueError(f"action {action}: late binding allows only replicas {list(self._candidates)} now")
        self.sim.dispatch(int(action))
        self._decision = self._next_decision()
        if self._decision is None:
            self._records = self.sim.finish()
            cost = self._total_cost()
            obs = np.zeros((self.max_replicas, N_FEATURES), np.float32)
            mask = np.zeros(self.max_replicas, np.float32)
            done = True
        else:
            cost = self._total_cost()
            obs, mask = self._observe()
            done = False
        reward = -(cost - self.cost)
        self.cost = cost
        return obs, mask, reward, done, {"time_s": self.sim.now_s, "cost": cost}

    @property
    def now_s(self) -> float:
        assert self.sim is not None
        return self.sim.now_s

    @property
    def n_replicas(self) -> int:
        assert self.sim is not None
        return len(self.sim.replica_ids)

    def decision(self) -> tuple[ClusterView, RequestInfo]:
        """The pending decision's cluster view and request; behind late binding the view is restricted to the
        replicas the rule allows (a heuristic picks among them)."""
        assert self._decision is not None
        if self._allowed is not None:
            return self._allowed, self._decision[1]
        return self._decision

    def records(self) -> list[RequestRecord] | None:
        """Every request's record once the episode is done (None before)."""
        return self._records
