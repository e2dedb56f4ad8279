"""Training scenario instances: TRAIN-split scenarios, cut to episode length, domain-randomised.

An `InstanceSpec` fully determines an instance (arrival sequence, cluster, scrape settings), so
the policy and the paired heuristic see identical arrivals, and workers can rebuild it locally.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from routewise_vllm.simulator.bench import saturated_rps
from routewise_vllm.simulator.config import ClusterConfig, KVViewConfig, ReplicaGroup
from routewise_vllm.simulator.costmodel import known_profiles, load_profile
from routewise_vllm.simulator.traces import WARMUP_TENANT
from routewise_vllm.simulator.types import SimRequest
from routewise_vllm.trainer.config import EnvConfig, RandomisationConfig


@dataclass(frozen=True)
class InstanceSpec:
    scenario: str  # name or path, loaded with split="train"
    seed: int
    load: float = 1.0  # arrival-rate multiplier (curriculum)
    randomise: bool = True
    max_requests: int | None = None  # None = the whole instance (evaluation)
    random_fleet: bool = False  # always on a random fleet (with `randomise`), whatever randomisation.fleet_prob says

    def key(self) -> tuple:
        return (self.scenario, self.seed, round(self.load, 3), self.randomise, self.max_requests, self.random_fleet)


def random_fleet_specs(scenarios: list[str], per_scenario: int, seed_base: int, max_requests: int | None) -> list[InstanceSpec]:
    """Each scenario's traffic on `per_scenario` random fleets at its own load level: a validation set (the trainer's
    `run.validation_fleets`) or a test (tests/bench/random_fleets.py), told apart by `seed_base`. Each scenario has
    its own block of seeds, so no two scenarios share a fleet."""
    return [
        InstanceSpec(sc, seed_base + 1000 * i + k, 1.0, randomise=True, max_requests=max_requests, random_fleet=True)
        for i, sc in enumerate(scenarios)
        for k in range(per_scenario)
    ]


def _scale_counts(cluster: ClusterConfig, rng: np.random.Generator, lo: float, hi: float, max_replicas: int) -> tuple[ClusterConfig, float]:
    """Scale every group's count by U(lo, hi), keeping at least two replicas where the scenario has two (one replica
    leaves no decision to learn from); returns the new config and the capacity ratio."""
    groups = [g.model_copy() for g in cluster.replicas]
    before = sum(g.count for g in groups)
    for g in groups:
        g.count = max(1, int(round(g.count * rng.uniform(lo, hi))))
    if sum(g.count for g in groups) < min(2, before):
        groups[0].count += 1
    while sum(g.count for g in groups) > max_replicas:
        biggest = max(groups, key=lambda g: g.count)
        biggest.count -= 1
    faults = [f for f in cluster.faults if f.replica < sum(g.count for g in groups)]
    after = sum(g.count for g in groups)
    return cluster.model_copy(update={"replicas": groups, "faults": faults}), after / before


# Requests in the burst that measures a group's capacity for a random fleet (simulator.bench.saturated_rps).
CAPACITY_PROBE_REQUESTS = 200


def _capacity(groups: list[ReplicaGroup], lengths: tuple[np.ndarray, np.ndarray], rng: np.random.Generator) -> float:
    """Completions per second of a fleet on these (prompt, output) lengths: the sum of its replicas' saturated rates."""
    return sum(g.count * saturated_rps(g, rng, len(lengths[0]), lengths) for g in groups)


def random_fleet(
    cluster: ClusterConfig, requests: list[SimRequest], lo: int, hi: int, rng: np.random.Generator
) -> tuple[ClusterConfig, float]:
    """A fleet operators run but the scenario does not: n ~ log-uniform [lo, hi] replicas in 1-3 groups, each of a
    profile drawn from every profile in simulator/profiles/ (speeds up to ~10x apart), keeping the scenario's
    batching limits. Returns the fleet and its capacity / the scenario fleet's capacity, both measured on this
    instance's own request lengths, so the caller can keep the scenario's load level. Faults on replicas the new
    fleet lacks are dropped."""
    n = int(round(np.exp(rng.uniform(np.log(lo), np.log(hi)))))
    n_groups = int(min(n, rng.integers(1, 4)))
    cuts = np.sort(rng.choice(np.arange(1, n), size=n_groups - 1, replace=False)) if n_groups > 1 else np.array([], int)
    counts = np.diff(np.concatenate([[0], cuts, [n]]))
    profiles = known_profiles()
    template = cluster.replicas[0]
    groups = []
    for c in counts:
        profile = str(rng.choice(profiles))
        # the scenario's memory share, or just enough for a bigger model's weights plus some KV cache
        prof = load_profile(profile)
        util = max(template.gpu_memory_utilization, min(0.95, (prof.weight_bytes + prof.activation_reserve_bytes) / prof.memory_bytes + 0.05))
        groups.append(template.model_copy(update={"profile": profile, "count": int(c), "speed_factor": 1.0,
                                                  "gpu_memory_utilization": util}))
    ratio = _capacity_ratio(groups, list(cluster.replicas), requests, rng)
    faults = [f for f in cluster.faults if f.replica < n]
    return cluster.model_copy(update={"replicas": groups, "faults": faults}), ratio


def _capacity_ratio(new: list[ReplicaGroup], old: list[ReplicaGroup], requests: list[SimRequest], rng: np.random.Generator) -> float:
    """Capacity of fleet `new` / capacity of fleet `old`, both measured on a sample of this instance's own
    (scored) request lengths drawn from `rng`."""
    scored = [q for q in requests if q.tenant != WARMUP_TENANT] or requests
    idx = rng.integers(len(scored), size=CAPACITY_PROBE_REQUESTS)
    lengths = (np.array([scored[i].prompt_tokens for i in idx]), np.array([scored[i].output_tokens for i in idx]))
    probe = np.random.default_rng(0)
    return _capacity(new, lengths, probe) / _capacity(old, lengths, probe)


def few_batch_slots(
    cluster: ClusterConfig, requests: list[SimRequest], lo: int, hi: int, rng: np.random.Generator
) -> tuple[ClusterConfig, float]:
    """The same fleet run with few batch slots: every replica's max_num_seqs ~ log-uniform [lo, hi] (one value for
    the fleet, as one vLLM configuration is deployed everywhere). A replica with 8 slots queues its ninth request
    where the scenarios' replicas batch 256, so waiting time depends on slots as much as on speed. Returns the
    fleet and its capacity / the fleet's capacity before, so the caller can keep the scenario's load level."""
    slots = int(round(np.exp(rng.uniform(np.log(lo), np.log(hi)))))
    groups = [g.model_copy(update={"max_num_seqs": min(g.max_num_seqs, slots)}) for g in cluster.replicas]
    ratio = _capacity_ratio(groups, list(cluster.replicas), requests, rng)
    return cluster.model_copy(update={"replicas": groups}), ratio


def with_kv_events(cluster: ClusterConfig, r: RandomisationConfig, rng: np.random.Generator) -> ClusterConfig:
    """The instance's router sees the caches through the replicas' KV events, delivered late and lossy by amounts
    drawn from `r` (the precise view, degraded as a live subscription can be)."""
    view = KVViewConfig(mode="precise", lag_s=float(rng.uniform(*r.kv_events_lag_s)),
                        loss=float(rng.uniform(*r.kv_events_loss)), replay=bool(rng.random() < 0.5))
    return cluster.model_copy(update={"kv_view": view})


def perturb(
    cluster: ClusterConfig,
    requests: list[SimRequest],
    env_cfg: EnvConfig,
    rng: np.random.Generator,
    load: float,
    randomise: bool,
    force_fleet: bool = False,
) -> tuple[ClusterConfig, list[SimRequest]]:
    """Domain randomisation over replica count, GPU mix/speed, batch slots, scrape staleness, the router's view of
    the caches and workload;
    `force_fleet`: a random fleet whatever randomisation.fleet_prob says (the generator advances as with fleet_prob 1)."""
    capacity_ratio = 1.0
    prompt_scale = 1.0
    if randomise:
        r = env_cfg.randomisation
        random = (r.fleet_prob > 0 or force_fleet) and (rng.random() < r.fleet_prob or force_fleet)
        if random:
            hi = min(r.fleet_replicas[1], env_cfg.max_replicas)
            cluster, capacity_ratio = random_fleet(cluster, requests, min(r.fleet_replicas[0], hi), hi, rng)
        else:
            cluster, capacity_ratio = _scale_counts(cluster, rng, *r.replica_count_scale, env_cfg.max_replicas)
        groups = [g.model_copy(update={"speed_factor": g.speed_factor * rng.uniform(*r.speed_factor)}) for g in cluster.replicas]
        if len(groups) > 1 and rng.random() < r.swap_profile_prob:
            a, b = rng.choice(len(groups), size=2, replace=False)
            # a random fleet's memory share belongs to its profile (a bigger model needs more for its weights)
            carried = ("profile", "gpu_memory_utilization") if random else ("profile",)
            ga, gb = groups[a], groups[b]
            groups[a] = ga.model_copy(update={k: getattr(gb, k) for k in carried})
            groups[b] = gb.model_copy(update={k: getattr(ga, k) for k in carried})
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
        if r.batch_slots_prob > 0 and rng.random() < r.batch_slots_prob:
            cluster, slots_ratio = few_batch_slots(cluster, requests, *r.batch_slots, rng)
            capacity_ratio *= slots_ratio
        if r.kv_events_prob > 0 and rng.random() < r.kv_events_prob:
            cluster = with_kv_events(cluster, r, rng)
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
    """Builds instances from specs; keeps loaded scenarios (per process). Training reads the TRAIN windows;
    `split="eval"` builds the same kind of instance on the EVAL windows (tests/bench/random_fleets.py)."""

    def __init__(self, env_cfg: EnvConfig, split: str = "train") -> None:
        self.env_cfg = env_cfg
        self.split = split
        self._scenarios: dict[str, object] = {}

    def scenario(self, name: str):
        if name not in self._scenarios:
            from routewise_vllm.simulator.scenario import load_scenario

            self._scenarios[name] = load_scenario(name, split=self.split)
        return self._scenarios[name]

    def build(self, spec: InstanceSpec) -> tuple[ClusterConfig, list[SimRequest]]:
        sc = self.scenario(spec.scenario)
        cluster, requests = sc.build(np.random.default_rng(spec.seed))
        rng = np.random.default_rng([spec.seed, 0x5EED])
        requests = window(requests, spec.max_requests, rng)
        cluster, requests = perturb(cluster, requests, self.env_cfg, rng, spec.load, spec.randomise, spec.random_fleet)
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
