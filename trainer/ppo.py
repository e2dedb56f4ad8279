"""PPO for the routing policy, CleanRL style: one readable file in CleanRL's fixed order.

  1. Config and run state      `TrainConfig` (trainer/config.py), `Phase`, `TrainState`, schedules
  2. Environment setup         which scenario instances are played: selection, evaluation, PPO jobs
  3. Agent                     `RoutingNet` (trainer/network.py) and its warm start
  4. Storage                   `Batch`: the episodes of one update, flattened
  5. Rollout                   every environment plays one whole episode (trainer/rollout.py workers, or Ray actors)
  6. GAE                       advantages and returns per episode
  7. Update                    epochs x minibatches of the clipped PPO objective
  8. Logging and evaluation    TensorBoard + metrics.csv; greedy TRAIN-window evaluation; `best.pt`
  9. `train`                   the loop: select -> warm start -> PPO updates, resumable at each step

Pipeline (`train`):
  1. Pick, per TRAIN scenario, the best heuristic by p99 TTFT on TRAIN windows.
  2. Warm start, which is also PPO's KL reference policy: by default the network learns to
     predict each decision's time to first token from exploration episodes (trainer/latency.py);
     or imitation of the best heuristic (trainer/imitate.py, `warm_start.target: imitate`).
  3. PPO updates. Every update each environment plays one whole episode (a sampled TRAIN
     scenario instance, load from the curriculum, domain-randomised), in worker processes.
     Rewards are paired: the best heuristic's per-decision reward on the SAME arrival sequence
     is subtracted (decision t is request t in both runs, over the same time interval), which
     removes the load-driven part of the return without changing the optimal policy.
     GAE(lambda) -> clipped surrogate + clipped value loss + decaying entropy bonus
     + decaying KL(policy || warm-start reference); target-KL early stop; gradient clipping.
  4. Greedy evaluation on TRAIN windows every few updates; the best of {warm start, PPO checkpoints}
     by TRAIN p99-TTFT ratio to the best heuristic is kept as `best.pt`. EVAL windows are never used.

Over 400 lines on purpose: the algorithm top to bottom in one file (CleanRL style).
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from routewise_vllm.router.policy.features import FEATURE_SPEC_HASH, N_FEATURES
from routewise_vllm.trainer.config import PPOConfig, TrainConfig
from routewise_vllm.trainer.instances import InstanceSpec, random_fleet_specs
from routewise_vllm.trainer.network import RoutingNet, masked_categorical
from routewise_vllm.trainer.episode import Episode, ExploreJob, HeuristicJob, HeuristicRun, LatencySamples, RolloutJob
from routewise_vllm.trainer.rollout import WorkerPool

if TYPE_CHECKING:
    from routewise_vllm.trainer.ray_backend import RayWorkerPool  # same interface as WorkerPool; imported only with run.ray


# ==============================================================================================
# 1. Config and run state
# ==============================================================================================
EVAL_SEED_BASE = 1_000_000  # TRAIN-window instances used for selection/evaluation (disjoint from the PPO seed pool)
VALIDATION_SEED_BASE = 2_000_000  # run.validation_fleets: random fleets on TRAIN windows (tests/bench/random_fleets.py: 3,000,000)
WARM_START_SEED_BASE = 500_000
WARM_START_CHECKPOINT = "warm_start.pt"
OLD_WARM_START_CHECKPOINT = "bc.pt"  # what runs before the rename wrote; read as the KL reference on --resume


class Phase(str, Enum):
    SELECT = "select"  # pick the best heuristic per scenario
    WARM_START = "warm-start"  # the warm start (a TTFT regression by default)
    PPO = "ppo"


OLD_PHASE_NAMES = {"bc": Phase.WARM_START}  # phase values in checkpoints written before the rename


@dataclass
class TrainState:
    """Where a run is; saved in every checkpoint (as a plain dict) so `--resume` continues exactly."""

    phase: Phase = Phase.SELECT
    update: int = 0
    wall_s: float = 0.0
    best: str | None = None  # label of the selected checkpoint so far
    best_key: float = math.inf
    history: list[dict] = field(default_factory=list)
    best_heuristic: dict[str, str] | None = None
    heuristic_p99_train: dict | None = None
    heuristic_runs: dict | None = None
    rng_state: dict | None = None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"phase": self.phase.value}

    @classmethod
    def from_dict(cls, doc: dict) -> TrainState:
        known = {f.name for f in fields(cls)}
        phase = OLD_PHASE_NAMES.get(doc["phase"]) or Phase(doc["phase"])
        return cls(**{k: v for k, v in doc.items() if k in known} | {"phase": phase})


@dataclass
class Coefs:
    """The scheduled coefficients of one update."""

    lr: float
    ent_coef: float
    ref_kl_coef: float


def schedule(update: int, total: int, start: float, end: float) -> float:
    frac = min(1.0, update / max(1, total - 1))
    return start + (end - start) * frac


def coefs_at(cfg: PPOConfig, update: int) -> Coefs:
    frac = update / max(1, cfg.updates)
    return Coefs(
        lr=cfg.lr * (1.0 - frac if cfg.anneal_lr else 1.0),
        ent_coef=schedule(update, cfg.updates, cfg.ent_coef_start, cfg.ent_coef_end),
        ref_kl_coef=schedule(update, cfg.updates, cfg.ref_kl_coef_start, cfg.ref_kl_coef_end),
    )


# ==============================================================================================
# 2. Environment setup: which scenario instances are played
# ==============================================================================================
def eval_specs(cfg: TrainConfig, seeds: int | None = None) -> list[InstanceSpec]:
    n = cfg.run.eval_seeds if seeds is None else seeds
    return [
        InstanceSpec(sc, EVAL_SEED_BASE + k, 1.0, randomise=False, max_requests=cfg.env.eval_max_requests)
        for sc in cfg.env.scenarios
        for k in range(n)
    ]


def validation_specs(cfg: TrainConfig) -> list[InstanceSpec]:
    """`run.validation_fleets` random fleets per scenario on TRAIN windows, the same in every evaluation of a run."""
    return random_fleet_specs(list(cfg.env.scenarios), cfg.run.validation_fleets, VALIDATION_SEED_BASE, cfg.env.eval_max_requests)


def compared_heuristics(cfg: TrainConfig) -> tuple[str, ...]:
    """The heuristics a run pairs its rewards with and measures itself against: routewise's own, and the peers'
    algorithms with `ppo.paired_with_peers`."""
    from routewise_vllm.router.policy.registry import COMPARED_BASELINES, PEER_BASELINES

    return COMPARED_BASELINES + (PEER_BASELINES if cfg.ppo.paired_with_peers else ())


def select_best_heuristics(pool: WorkerPool, cfg: TrainConfig) -> tuple[dict[str, str], dict[str, dict[str, float]], dict]:
    """Per scenario, the baseline with the lowest mean p99 TTFT on TRAIN-window instances.

    Returns (best name per scenario, mean p99 per scenario and baseline, every run's summary by
    (scenario, seed, policy) for later comparisons on the same instances).
    """
    names = compared_heuristics(cfg)
    specs = eval_specs(cfg, max(cfg.warm_start.selection_seeds, cfg.run.eval_seeds))
    jobs = [HeuristicJob(s, p) for s in specs + validation_specs(cfg) for p in names]
    results: list[HeuristicRun] = pool.run("heuristics", [{"jobs": part} for part in pool.split(jobs, key=lambda j: j.spec.seed)])
    runs = {(r.spec.scenario, r.spec.seed, r.policy): r.summary for r in results}
    best, table = {}, {}
    for sc in cfg.env.scenarios:
        p99 = {p: float(np.mean([runs[(sc, s.seed, p)]["ttft_p99_s"] for s in specs if s.scenario == sc])) for p in names}
        best[sc] = min(p99, key=p99.get)
        table[sc] = p99
    return best, table, runs


def ppo_jobs(cfg: TrainConfig, best: dict[str, str], update: int, rng: np.random.Generator, n: int) -> tuple[list[RolloutJob], float]:
    """The `n` instances of one update (scenario, seed, curriculum load) with their paired heuristic; and the mean load."""
    c = cfg.env.curriculum
    ramp = min(1.0, update / max(1.0, c.ramp_frac * cfg.ppo.updates)) if c.ramp_frac > 0 else 1.0
    lo = c.start + (c.end_lo - c.start) * ramp
    hi = c.start + (c.end_hi - c.start) * ramp
    jobs = []
    for _ in range(n):
        sc = cfg.env.scenarios[int(rng.integers(len(cfg.env.scenarios)))]
        load = round(float(rng.uniform(lo, hi)) * 20) / 20  # a 0.05 grid keeps paired heuristic runs cacheable
        spec = InstanceSpec(sc, int(rng.integers(cfg.ppo.seed_pool)), load, cfg.env.randomise, cfg.env.max_requests)
        jobs.append(RolloutJob(spec, best[sc] if cfg.ppo.paired_baseline else None))
    return jobs, (lo + hi) / 2


# ==============================================================================================
# 3. Agent: the network (trainer/network.py) and its warm start
# ==============================================================================================
def _latency_warm_start(pool: WorkerPool, cfg: TrainConfig, net: RoutingNet, rng: np.random.Generator, progress: bool) -> list[dict]:
    """Warm start by TTFT regression (trainer/latency.py): heuristic-routed exploration episodes,
    then `dagger_rounds` rounds routed by the fitted network, each followed by more fitting on all data."""
    from routewise_vllm.trainer.latency import fit_latency

    c, w = cfg.env.curriculum, cfg.warm_start

    def specs(base: int, n: int):
        for sc in cfg.env.scenarios:
            for k in range(n):
                load = round(float(rng.uniform(c.start, c.end_hi)), 2)
                yield k, InstanceSpec(sc, base + k, load, cfg.env.randomise, cfg.env.max_requests)

    jobs = [
        ExploreJob(spec, w.behaviours[k % len(w.behaviours)], w.explore_epsilon[k % len(w.explore_epsilon)])
        for k, spec in specs(WARM_START_SEED_BASE, w.episodes_per_scenario)
    ]
    data: list[LatencySamples] = pool.run("explore", [{"jobs": part} for part in pool.split(jobs, key=lambda j: j.spec.seed)])
    history: list[dict] = []
    for rnd in range(w.dagger_rounds + 1):
        feats = np.concatenate([d.features for d in data])
        if rnd == 0:  # observation statistics from the heuristic-routed data, kept fixed afterwards
            net.normaliser.update(feats, feats[..., 0])
        history += fit_latency(  # later rounds continue on all data so far, with half the epochs
            net, feats, np.concatenate([d.masks for d in data]), np.concatenate([d.actions for d in data]),
            np.concatenate([d.ttft_s for d in data]), w.epochs if rnd == 0 else max(1, w.epochs // 2),
            w.batch_size, w.lr, cfg.run.seed + rnd, progress, w.ttft_floor_s, w.quantile,
        )  # fmt: skip
        if rnd == w.dagger_rounds:
            break
        sd = {k: v.clone() for k, v in net.state_dict().items()}
        jobs = [ExploreJob(spec, None, 0.1) for _, spec in specs(WARM_START_SEED_BASE + 1000 * (rnd + 1), max(1, w.episodes_per_scenario // 2))]
        data += pool.run("explore", [{"jobs": part, "state_dict": sd} for part in pool.split(jobs, key=lambda j: j.spec.seed)])
    return history


def _imitation_warm_start(
    pool: WorkerPool, cfg: TrainConfig, net: RoutingNet, best: dict[str, str], rng: np.random.Generator, progress: bool
) -> list[dict]:
    """Warm start by imitation of the best heuristic per scenario (trainer/imitate.py)."""
    from routewise_vllm.trainer.imitate import behaviour_clone

    c, w = cfg.env.curriculum, cfg.warm_start
    jobs = []
    for sc in cfg.env.scenarios:
        for k in range(w.episodes_per_scenario):
            load = float(rng.uniform(c.start, c.end_hi))
            jobs.append(HeuristicJob(InstanceSpec(sc, WARM_START_SEED_BASE + k, round(load, 2), cfg.env.randomise, cfg.env.max_requests), best[sc]))
    data: list[HeuristicRun] = pool.run("record", [{"jobs": part} for part in pool.split(jobs, key=lambda j: j.spec.seed)])
    feats = np.concatenate([d.features for d in data])
    masks = np.concatenate([d.masks for d in data])
    acts = np.concatenate([d.actions for d in data])
    net.normaliser.update(feats, feats[..., 0])
    return behaviour_clone(net, feats, masks, acts, np.zeros(len(acts)), w.epochs, w.batch_size, w.lr, cfg.run.seed, progress)


def warm_start(
    pool: WorkerPool, cfg: TrainConfig, net: RoutingNet, best: dict[str, str], rng: np.random.Generator, progress: bool
) -> list[dict]:
    """The warm start (also the KL reference), in place: TTFT regression by default, imitation with `warm_start.target: imitate`.
    Returns per-epoch statistics."""
    if cfg.warm_start.target == "latency":
        return _latency_warm_start(pool, cfg, net, rng, progress)
    return _imitation_warm_start(pool, cfg, net, best, rng, progress)


# ==============================================================================================
# 4. Storage: the episodes of one update, flattened
# ==============================================================================================
@dataclass
class Batch:
    features: torch.Tensor  # [N, R, F] float32
    masks: torch.Tensor  # [N, R] float32
    actions: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N]
    values: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    returns: torch.Tensor  # [N]

    def __len__(self) -> int:
        return len(self.actions)


def build_batch(episodes: list[Episode], gamma: float, lam: float, reward_scale: float) -> Batch:
    """Episodes (from trainer.rollout) -> one flat PPO batch with GAE advantages."""
    advs, rets = [], []
    for ep in episodes:
        adv, ret = gae(ep.rewards * reward_scale, ep.values.astype(np.float64), float(ep.last_value), bool(ep.terminal), gamma, lam)
        advs.append(adv)
        rets.append(ret)

    def cat(name: str, dtype) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([getattr(ep, name) for ep in episodes]).astype(dtype))

    return Batch(
        features=cat("features", np.float32),
        masks=cat("masks", np.float32),
        actions=cat("actions", np.int64),
        logprobs=cat("logprobs", np.float32),
        values=cat("values", np.float32),
        advantages=torch.from_numpy(np.concatenate(advs).astype(np.float32)),
        returns=torch.from_numpy(np.concatenate(rets).astype(np.float32)),
    )


# ==============================================================================================
# 5. Rollout: each environment plays one whole episode with the current (sampling) policy
# ==============================================================================================
@contextmanager
def worker_pool(cfg: TrainConfig) -> Iterator[WorkerPool | RayWorkerPool]:
    """The rollout workers of a run: `run.workers` local processes, or as many Ray actors on the cluster at
    `run.ray` (trainer/ray_backend.py; ray is imported only then), which get the same shares and seeds."""
    if cfg.run.ray is None:
        with WorkerPool(cfg, cfg.run.workers) as pool:
            yield pool
        return
    from routewise_vllm.trainer.ray_backend import RayWorkerPool, connect

    with connect(cfg.run.ray, num_cpus=max(1, cfg.run.workers)) as ray, RayWorkerPool(ray, cfg) as pool:
        yield pool


def collect_rollout(
    pool: WorkerPool, cfg: TrainConfig, net: RoutingNet, jobs: list[RolloutJob], update: int
) -> list[Episode]:
    """Episodes of the sampling policy on `jobs`, rewards paired with the named heuristics, spread over the workers."""
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    parts = pool.split(jobs, key=lambda j: j.spec.seed)
    return pool.run(
        "rollout",
        [{"state_dict": sd, "jobs": part, "greedy": False, "seed": cfg.run.seed * 100003 + update * 7 + k} for k, part in enumerate(parts)],
    )


# ==============================================================================================
# 6. GAE
# ==============================================================================================
def gae(rewards: np.ndarray, values: np.ndarray, last_value: float, terminal: bool, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """GAE over one episode segment. Returns (advantages, returns), both shape (T,).

    `terminal` = the episode really ended after the last step (no bootstrap); otherwise the
    segment was cut and `last_value` bootstraps the tail.
    """
    t_len = len(rewards)
    adv = np.zeros(t_len, dtype=np.float64)
    next_value = 0.0 if terminal else last_value
    running = 0.0
    for t in range(t_len - 1, -1, -1):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
        next_value = values[t]
    return adv, adv + values


# ==============================================================================================
# 7. Update: epochs x minibatches of the clipped objective
# ==============================================================================================
def ppo_update(
    net: RoutingNet,
    ref_net: RoutingNet | None,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    coefs: Coefs,
    cfg: PPOConfig,
    generator: torch.Generator,
) -> dict[str, float]:
    for group in optimizer.param_groups:
        group["lr"] = coefs.lr
    n = len(batch)
    mb_size = max(1, n // cfg.minibatches)
    clipfracs: list[float] = []
    approx_kl = torch.tensor(0.0)
    epochs_done = 0
    with torch.no_grad():
        ref_logits_all = ref_net.logits(batch.features, batch.masks) if (ref_net is not None and coefs.ref_kl_coef > 0) else None
    for _epoch in range(cfg.epochs):
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n, mb_size):
            idx = perm[start : start + mb_size]
            logits, new_values = net(batch.features[idx], batch.masks[idx])
            dist = masked_categorical(logits, batch.masks[idx])
            new_logprob = dist.log_prob(batch.actions[idx])
            entropy = dist.entropy().mean()
            logratio = new_logprob - batch.logprobs[idx]
            ratio = logratio.exp()
            with torch.no_grad():
                approx_kl = ((ratio - 1) - logratio).mean()  # the k3 estimator
                clipfracs.append(((ratio - 1.0).abs() > cfg.clip_coef).float().mean().item())

            adv = batch.advantages[idx]
            if cfg.norm_adv and len(idx) > 1:
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            pg_loss = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()

            if cfg.clip_vloss:
                v_unclipped = (new_values - batch.returns[idx]) ** 2
                v_clipped = batch.values[idx] + torch.clamp(new_values - batch.values[idx], -cfg.clip_coef, cfg.clip_coef)
                v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - batch.returns[idx]) ** 2).mean()
            else:
                v_loss = 0.5 * ((new_values - batch.returns[idx]) ** 2).mean()

            ref_kl = torch.tensor(0.0)
            if ref_logits_all is not None:
                ref_dist = masked_categorical(ref_logits_all[idx], batch.masks[idx])
                ref_kl = torch.distributions.kl_divergence(dist, ref_dist).mean()

            loss = pg_loss - coefs.ent_coef * entropy + cfg.vf_coef * v_loss + coefs.ref_kl_coef * ref_kl
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), cfg.max_grad_norm)
            optimizer.step()
        epochs_done += 1
        if cfg.target_kl is not None and approx_kl.item() > cfg.target_kl:
            break

    y_pred, y_true = batch.values.numpy(), batch.returns.numpy()
    var_y = np.var(y_true)
    return {
        "losses/policy_loss": pg_loss.item(),
        "losses/value_loss": v_loss.item(),
        "losses/entropy": entropy.item(),
        "losses/approx_kl": approx_kl.item(),
        "losses/ref_kl": ref_kl.item(),
        "losses/clipfrac": float(np.mean(clipfracs)) if clipfracs else 0.0,
        "losses/explained_variance": float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y),
        "losses/epochs": float(epochs_done),
        "charts/learning_rate": coefs.lr,
        "charts/ent_coef": coefs.ent_coef,
        "charts/ref_kl_coef": coefs.ref_kl_coef,
    }


# ==============================================================================================
# 8. Logging and evaluation
# ==============================================================================================
def rollout_stats(cfg: TrainConfig, episodes: list[Episode], batch: Batch, load: float) -> dict[str, float]:
    stats = {
        "charts/load": load,
        "charts/decisions": float(len(batch)),
        "rollout/ttft_p90_s": float(np.mean([e.summary["ttft_p90_s"] for e in episodes])),
        "rollout/ttft_p99_s": float(np.mean([e.summary["ttft_p99_s"] for e in episodes])),
        "rollout/slo_attainment": float(np.mean([e.summary["goodput"] for e in episodes])),
    }
    if cfg.ppo.paired_baseline:  # > 0: the sampled policy waited less than the heuristic
        stats["rollout/paired_gain"] = float(np.mean([e.rewards.sum() for e in episodes]))
    return stats


def evaluate_on_train(pool: WorkerPool, cfg: TrainConfig, net: RoutingNet, best: dict[str, str], heuristic_runs: dict) -> dict[str, float]:
    """Greedy network vs the best heuristic on TRAIN-window instances: p99 ratio per scenario and overall."""
    validation = validation_specs(cfg)
    specs = eval_specs(cfg) + validation
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    parts = pool.split([RolloutJob(s) for s in specs], key=lambda j: j.spec.seed)
    every: list[Episode] = pool.run("rollout", [{"state_dict": sd, "jobs": part, "greedy": True, "seed": 0} for part in parts])
    eps = [e for e in every if not e.spec.random_fleet]
    out: dict[str, float] = {}
    if validation:  # p99 over the best of the heuristics on each instance (chosen with hindsight, as the bench does)
        names = compared_heuristics(cfg)
        ratios = [
            e.summary["ttft_p99_s"] / max(1e-9, min(heuristic_runs[(e.spec.scenario, e.spec.seed, n)]["ttft_p99_s"] for n in names))
            for e in every
            if e.spec.random_fleet
        ]
        out["eval/fleets_score"] = float(math.exp(np.mean(np.log(np.maximum(ratios, 1e-9)))))
    logs, goodput_gaps, ff = [], [], []
    for sc in cfg.env.scenarios:
        mine = [e.summary for e in eps if e.spec.scenario == sc]
        theirs = [heuristic_runs[(sc, e.spec.seed, best[sc])] for e in eps if e.spec.scenario == sc]
        ratio = float(np.mean([m["ttft_p99_s"] for m in mine]) / max(1e-9, np.mean([t["ttft_p99_s"] for t in theirs])))
        out[f"eval/ttft_p99_ratio/{Path(sc).stem}"] = ratio
        logs.append(math.log(max(ratio, 1e-9)))
        goodput_gaps.append(float(np.mean([m["goodput"] - t["goodput"] for m, t in zip(mine, theirs)])))
        ff.extend(e.fallback_free_share for e in eps if e.spec.scenario == sc)
    out["eval/score"] = float(math.exp(np.mean(logs)))  # geometric mean of p99 ratios (lower is better)
    out["eval/worst_ratio"] = float(math.exp(max(logs)))
    out["eval/min_goodput_gap"] = float(min(goodput_gaps))
    out["eval/fallback_free_share"] = float(np.mean(ff))
    out["eval/ttft_p99_s"] = float(np.mean([e.summary["ttft_p99_s"] for e in eps]))
    out["eval/ttft_p90_s"] = float(np.mean([e.summary["ttft_p90_s"] for e in eps]))
    out["eval/slo_attainment"] = float(np.mean([e.summary["goodput"] for e in eps]))
    return out


def selection_key(ev: dict[str, float]) -> float:
    """What `best.pt` minimises: the geometric-mean p99 ratio, with a heavy penalty for any
    scenario worse than 1.03x or any goodput loss (targets: never above 1.03x, goodput >= best);
    with `run.validation_fleets`, times the random fleets' geometric mean (docs/model-card.md)."""
    worst = ev["eval/worst_ratio"]
    key = ev["eval/score"] + 2.0 * max(0.0, worst - 1.03) + 5.0 * max(0.0, -ev["eval/min_goodput_gap"] - 0.002)
    return key * ev.get("eval/fleets_score", 1.0)


class _Logger:
    """TensorBoard scalars + one CSV row per logged step, both in the run dir."""

    def __init__(self, run_dir: Path, fields: list[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"))
        self.path = run_dir / "metrics.csv"
        self.fields = ["phase", "update", "wall_s"] + fields
        new = not self.path.exists()
        self._fh = self.path.open("a", newline="")
        self._csv = csv.DictWriter(self._fh, fieldnames=self.fields, extrasaction="ignore")
        if new:
            self._csv.writeheader()

    def log(self, phase: str, step: int, wall_s: float, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self._csv.writerow({"phase": phase, "update": step, "wall_s": round(wall_s, 2)} | scalars)
        self._fh.flush()

    def close(self) -> None:
        self.writer.close()
        self._fh.close()


def _csv_fields(cfg: TrainConfig) -> list[str]:
    base = [
        "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl", "losses/ref_kl",
        "losses/clipfrac", "losses/explained_variance", "losses/epochs", "charts/learning_rate", "charts/ent_coef",
        "charts/ref_kl_coef", "charts/load", "charts/decisions", "rollout/ttft_p90_s", "rollout/ttft_p99_s",
        "rollout/slo_attainment", "rollout/paired_gain", "imitate/loss", "imitate/accuracy", "warm/huber", "warm/pinball",
        "warm/rmse_log_ttft", "eval/score", "eval/worst_ratio", "eval/min_goodput_gap", "eval/fallback_free_share",
        "eval/ttft_p90_s", "eval/ttft_p99_s", "eval/slo_attainment",
    ]  # fmt: skip
    fleets = ["eval/fleets_score"] if cfg.run.validation_fleets else []  # kept out of older runs' CSV header
    return base + fleets + [f"eval/ttft_p99_ratio/{Path(s).stem}" for s in cfg.env.scenarios]


# ==============================================================================================
# 9. The loop
# ==============================================================================================
@dataclass
class _Run:
    """One training run's moving parts: what every phase reads and the checkpointing they share."""

    cfg: TrainConfig
    run_dir: Path
    net: RoutingNet
    optimizer: torch.optim.Optimizer
    state: TrainState
    rng: np.random.Generator
    logger: _Logger
    wall0: float

    def elapsed(self) -> float:
        return time.time() - self.wall0

    def checkpoint(self, name: str, extra: dict | None = None) -> Path:
        from routewise_vllm.trainer.checkpoint import save_checkpoint

        self.state.wall_s = self.elapsed()
        self.state.rng_state = self.rng.bit_generator.state
        return save_checkpoint(self.run_dir / name, self.net, self.cfg, self.state.to_dict(), self.optimizer, extra)

    def consider(self, ev: dict[str, float], label: str) -> None:
        """Keep the network as `best.pt` if its TRAIN evaluation is the best so far."""
        key = selection_key(ev)
        self.state.history.append({"label": label, "key": key} | ev)
        if key < self.state.best_key:
            self.state.best_key, self.state.best = key, label
            self.checkpoint("best.pt", {"selected": label, "eval_train": ev})


def _start(cfg: TrainConfig, run_dir: Path, resume: str | Path | None) -> tuple[RoutingNet, torch.optim.Optimizer, TrainState, np.random.Generator]:
    """A fresh network, optimiser, state and generator, or those of the checkpoint `resume`."""
    from routewise_vllm.trainer.checkpoint import load_network, read_checkpoint

    torch.set_num_threads(cfg.run.torch_threads)
    torch.manual_seed(cfg.run.seed)
    net = RoutingNet(N_FEATURES, cfg.network)
    optimizer = torch.optim.Adam(net.parameters(), lr=cfg.ppo.lr, eps=1e-5)
    state = TrainState()
    if resume is not None:
        doc = read_checkpoint(resume)
        net, _, doc = load_network(resume, doc)
        optimizer = torch.optim.Adam(net.parameters(), lr=cfg.ppo.lr, eps=1e-5)
        if doc.get("optimizer"):
            optimizer.load_state_dict(doc["optimizer"])
        state = TrainState.from_dict(doc["progress"])
    elif cfg.run.init is not None:  # a fine-tune: the checkpoint's network, a fresh run around it
        if Path(cfg.run.init).resolve().parent == run_dir.resolve():
            raise ValueError(f"run.init {cfg.run.init} is inside the run directory {run_dir}, whose checkpoints this "
                             "run writes: give the fine-tune its own run.run_dir (--run-dir)")
        net, init_cfg, _ = load_network(cfg.run.init)
        if init_cfg.network != cfg.network:
            raise ValueError(f"run.init {cfg.run.init}: its network {init_cfg.network} differs from this run's {cfg.network}")
        optimizer = torch.optim.Adam(net.parameters(), lr=cfg.ppo.lr, eps=1e-5)
    rng = np.random.default_rng(cfg.run.seed)
    if state.rng_state is not None:
        rng.bit_generator.state = state.rng_state
    return net, optimizer, state, rng


def _select_phase(run: _Run, pool: WorkerPool) -> None:
    t0 = time.time()
    best, table, runs = select_best_heuristics(pool, run.cfg)
    print(f"best heuristic per scenario (TRAIN windows, {time.time() - t0:.0f}s): {best}", flush=True)
    run.state.best_heuristic, run.state.heuristic_p99_train, run.state.heuristic_runs = best, table, runs
    run.state.phase = Phase.WARM_START
    run.checkpoint("last.pt")


def _warm_start_phase(run: _Run, pool: WorkerPool, progress: bool) -> None:
    cfg, state = run.cfg, run.state
    t0 = time.time()
    if cfg.warm_start.episodes_per_scenario and cfg.warm_start.epochs and cfg.run.init is None:
        for i, st in enumerate(warm_start(pool, cfg, run.net, state.best_heuristic, run.rng, progress)):
            run.logger.log("warm-start", i, run.elapsed(), st)
    ev = evaluate_on_train(pool, cfg, run.net, state.best_heuristic, state.heuristic_runs)
    run.logger.log("warm-start-eval", 0, run.elapsed(), ev)
    print(f"warm start ({'run.init ' + cfg.run.init if cfg.run.init else cfg.warm_start.target}) done in {time.time() - t0:.0f}s; TRAIN p99 ratio geomean {ev['eval/score']:.3f}, "
          f"worst {ev['eval/worst_ratio']:.3f}", flush=True)  # fmt: skip
    state.phase = Phase.PPO
    run.consider(ev, "warm-start")
    run.checkpoint(WARM_START_CHECKPOINT)
    run.checkpoint("last.pt")


def _reference_net(run: _Run) -> RoutingNet | None:
    """The warm-start network, PPO's KL reference (None when the KL term is off or there is no warm start)."""
    from routewise_vllm.trainer.checkpoint import load_network

    if run.cfg.ppo.ref_kl_coef_start <= 0:
        return None
    for name in (WARM_START_CHECKPOINT, OLD_WARM_START_CHECKPOINT):
        if (run.run_dir / name).exists():
            return load_network(run.run_dir / name)[0]
    return None


def _ppo_phase(run: _Run, pool: WorkerPool, progress: bool) -> None:
    from tqdm import tqdm

    cfg, state, net = run.cfg, run.state, run.net
    best = state.best_heuristic
    ref_net = _reference_net(run)
    gen = torch.Generator().manual_seed(cfg.run.seed + state.update)
    n_envs = pool.size * cfg.ppo.envs_per_worker
    bar = tqdm(total=cfg.ppo.updates, initial=state.update, desc="PPO", unit="update", disable=not progress)
    while state.update < cfg.ppo.updates:
        u = state.update
        # rollout
        jobs, load = ppo_jobs(cfg, best, u, run.rng, n_envs)
        episodes = collect_rollout(pool, cfg, net, jobs, u)
        if cfg.ppo.update_normaliser:
            for ep in episodes:
                net.normaliser.update(ep.features, ep.features[..., 0])
        # storage + GAE
        batch = build_batch(episodes, cfg.ppo.gamma, cfg.ppo.gae_lambda, cfg.ppo.reward_scale)
        # update
        net.train()
        stats = ppo_update(net, ref_net, run.optimizer, batch, coefs_at(cfg.ppo, u), cfg.ppo, gen)
        net.eval()
        # logging, evaluation, checkpoints
        stats |= rollout_stats(cfg, episodes, batch, load)
        state.update = u + 1
        if (u + 1) % cfg.run.eval_every == 0 or u + 1 == cfg.ppo.updates:
            ev = evaluate_on_train(pool, cfg, net, best, state.heuristic_runs)
            stats |= ev
            run.consider(ev, f"ppo-{u + 1}")
        run.logger.log("ppo", u + 1, run.elapsed(), stats)
        bar.update(1)
        bar.set_postfix(p99=f"{stats['rollout/ttft_p99_s']:.2f}s", kl=f"{stats['losses/approx_kl']:.3f}")
        if (u + 1) % cfg.run.checkpoint_every == 0 or u + 1 == cfg.ppo.updates:
            run.checkpoint("last.pt")
    bar.close()


def train(cfg: TrainConfig, resume: str | Path | None = None, progress: bool = True) -> dict:
    """Run (or resume) a training run; returns the run summary (also written to run_dir/summary.json)."""
    run_dir = Path(cfg.run.run_dir)
    net, optimizer, state, rng = _start(cfg, run_dir, resume)
    wall0 = time.time() - state.wall_s
    with worker_pool(cfg) as pool:  # before the run dir is written: an unreachable Ray cluster leaves nothing behind
        run_dir.mkdir(parents=True, exist_ok=True)
        run = _Run(cfg, run_dir, net, optimizer, state, rng, _Logger(run_dir, _csv_fields(cfg)), wall0)
        try:
            if state.phase == Phase.SELECT:
                _select_phase(run, pool)
            if state.phase == Phase.WARM_START:
                _warm_start_phase(run, pool, progress)
            _ppo_phase(run, pool, progress)
        finally:
            run.logger.close()
    state.wall_s = run.elapsed()
    summary = {
        "run_dir": str(run_dir),
        "wall_s": state.wall_s,
        "workers": cfg.run.workers,
        "ray": cfg.run.ray,
        "cores": os.cpu_count(),
        "updates": state.update,
        "selected": state.best,
        "best_heuristic": state.best_heuristic,
        "heuristic_p99_train": state.heuristic_p99_train,
        "history": state.history,
        "feature_spec_hash": FEATURE_SPEC_HASH,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return summary
