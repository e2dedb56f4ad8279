"""Training scenario instances: TRAIN-split scenarios, cut to episode length, domain-randomised.

An `InstanceSpec` fully determines an instance (arrival sequence, cluster, scrape settings), so
the policy and the paired heuristic see identical arrivals, and workers can rebuild it locally.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from simulator.config import ClusterConfig
from simulator.traces import WARMUP_TENANT
from simulator.types import SimRequest
from trainer.config import EnvConfig


@dataclass(frozen=True)
class InstanceSpec:
    scenario: str  # name or path, loaded with split="train"
    seed: int
    load: float = 1.0  # arrival-rate multiplier (curriculum)
    randomise: bool = True
    max_requests: int | None = None  # None = the whole instance (evaluation)

    def key(self) -> tuple:
        return (self.scenario, self.seed, round(self.load, 3), self.randomise, self.max_requests)


def _scale_counts(cluster: ClusterConfig, rng: np.random.Generator, lo: float, hi: float, max_replicas: int) -> tuple[ClusterConfig, float]:
    """Scale every group's count by U(lo, hi); returns the new config and the capacity ratio."""
    groups = [g.model_copy() for g in cluster.replicas]
    before = sum(g.count for g in groups)
    for g in groups:
        g.count = max(1, int(round(g.count * rng.uniform(lo, hi))))
    while sum(g.count for g in groups) > max_replicas:
        biggest = max(groups, key=lambda g: g.count)
        biggest.count -= 1
    faults = [f for f in cluster.faults if f.replica < sum(g.count for g in groups)]
    after = sum(g.count for g in groups)
    return cluster.model_copy(update={"replicas": groups, "faults": faults}), after / before


def perturb(
    cluster: ClusterConfig, requests: list[SimRequest], env_cfg: EnvConfig, rng: np.random.Generator, load: float, randomise: bool
) -> tuple[ClusterConfig, list[SimRequest]]:
    """Domain randomisation over replica count, GPU mix/speed, scrape staleness and workload."""
    capacity_ratio = 1.0
    prompt_scale = 1.0
    if randomise:
        r = env_cfg.randomisation
        cluster, capacity_ratio = _scale_counts(cluster, rng, *r.replica_count_scale, env_cfg.max_replicas)
        groups = [g.model_copy(update={"speed_factor": g.speed_factor * rng.uniform(*r.speed_factor)}) for g in cluster.replicas]
        if len(groups) > 1 and rng.random() < r.swap_profile_prob:
            a, b = rng.choice(len(groups), size=2, replace=False)
            pa, pb = groups[a].profile, groups[b].profile
            groups[a] = groups[a].model_copy(update={"profile": pb})
            groups[b] = groups[b].model_copy(update={"profile": pa})
        scrape = cluster.scrape.model_copy(
            update={
                "interval_s": float(rng.uniform(*r.scrape_interval_s)),
                "lag_s": float(rng.uniform(*r.scrape_lag_s)),
                "failure_prob": float(min(0.95, rng.uniform(*r.scrape_failure_prob))),
            }
        )
        if rng.random() < 0.5:  # keep the scenario's own scrape settings half of the time
            scrape = cluster.scrape
        cluster = cluster.model_copy(update={"replicas": groups, "scrape": scrape})
        prompt_scale = float(rng.uniform(*r.prompt_scale))
    rate = load * capacity_ratio  # more replicas get proportionally more traffic
    out = []
    for q in requests:
        p = q.prompt_tokens if prompt_scale == 1.0 else max(1, int(q.prompt_tokens * prompt_scale))
        out.append(dataclasses.replace(q, arrival_s=q.arrival_s / rate, prompt_tokens=p))
    return cluster, out


def window(requests: list[SimRequest], max_requests: int | None, rng: np.random.Generator) -> list[SimRequest]:
    """A random contiguous window of at most `max_requests` requests, re-timed to start at 0."""
    if max_requests is None or len(requests) <= max_requests:
        return requests
    first = int(rng.integers(len(requests) - max_requests + 1))
    part = requests[first : first + max_requests]
    t0 = part[0].arrival_s
    # a cut window has no preceding scored segment: its cache warm-up requests are scored like the rest
    return [
        dataclasses.replace(q, request_id=k, arrival_s=q.arrival_s - t0, tenant="" if q.tenant == WARMUP_TENANT else q.tenant)
        for k, q in enumerate(part)
    ]


class InstanceBuilder:
    """Builds instances from specs; keeps loaded scenarios (per process)."""

    def __init__(self, env_cfg: EnvConfig) -> None:
        self.env_cfg = env_cfg
        self._scenarios: dict[str, object] = {}

    def scenario(self, name: str):
        if name not in self._scenarios:
            from simulator.scenario import load_scenario

            self._scenarios[name] = load_scenario(name, split="train")
        return self._scenarios[name]

    def build(self, spec: InstanceSpec) -> tuple[ClusterConfig, list[SimRequest]]:
        sc = self.scenario(spec.scenario)
        cluster, requests = sc.build(np.random.default_rng(spec.seed))
        rng = np.random.default_rng([spec.seed, 0x5EED])
        requests = window(requests, spec.max_requests, rng)
        cluster, requests = perturb(cluster, requests, self.env_cfg, rng, spec.load, spec.randomise)
        if spec.max_requests is not None:
            cluster = retime_faults(cluster, requests, rng)
        return cluster, requests


def retime_faults(cluster: ClusterConfig, requests: list[SimRequest], rng: np.random.Generator) -> ClusterConfig:
    """Move each fault that would start after the window's last arrival to 20-50 % into the window
    (a short training window would otherwise never see the scenario's crash or slow-down)."""
    if not cluster.faults or not requests:
        return cluster
    span = requests[-1].arrival_s
    faults = []
    for f in cluster.faults:
        if f.at_s >= span:
            at = float(rng.uniform(0.2, 0.5)) * span
            dur = None if f.duration_s is None else min(f.duration_s, max(1.0, 0.4 * span))
            f = f.model_copy(update={"at_s": at, "duration_s": dur})
        faults.append(f)
    return cluster.model_copy(update={"faults": faults})
