"""Rollouts: episodes of the torch policy or a heuristic, in 1-2 worker processes.

Each worker process owns its environments (one per lockstep slot, plus one for heuristic
runs) and a cache of the best heuristic's per-decision rewards by instance, used for paired
rewards (same arrival sequence => decision t is request t over the same time interval in both
runs). Workers are started with the `spawn` method and talk over pipes; with `run.ray` set they are Ray
actors instead (trainer/ray_backend.py), given the same shares and seeds.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import numpy as np
import torch

from routewise_vllm.router.policy.base import Policy
from routewise_vllm.router.policy.fallback import FallbackPolicy
from routewise_vllm.router.policy.registry import LEARNED
from routewise_vllm.router.policy.served import served_policy
from routewise_vllm.router.policy.features import N_FEATURES, action_mask, build_features
from routewise_vllm.router.policy.late_binding import LateBindingConfig
from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.router.policy.types import ClusterView, RequestInfo
from routewise_vllm.simulator.env import DecisionEnv
from routewise_vllm.trainer.config import TrainConfig
from routewise_vllm.trainer.episode import Episode, ExploreJob, HeuristicJob, HeuristicRun, LatencySamples, RolloutJob
from routewise_vllm.trainer.instances import InstanceBuilder, InstanceSpec
from routewise_vllm.trainer.latency import explore_episode
from routewise_vllm.trainer.network import RoutingNet, masked_categorical


class TorchPolicy(Policy):
    """The torch network as a router Policy (greedy by default), fed exactly `build_features`."""

    name = "learned-torch"

    def __init__(self, net: RoutingNet, seed: int | None = None, greedy: bool = True) -> None:
        super().__init__(seed)
        self.net = net.eval()
        self.greedy = greedy

    def scores(self, view: ClusterView, request: RequestInfo) -> np.ndarray:
        f = torch.from_numpy(build_features(view, request)[None])
        m = torch.from_numpy(action_mask(view).astype(np.float32)[None])
        with torch.no_grad():
            return self.net.logits(f, m)[0].numpy()

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        logits = self.scores(view, request).astype(np.float64)
        logits = np.where(action_mask(view).astype(bool), logits, -np.inf)
        if self.greedy:
            return int(np.argmax(logits))
        p = np.exp(logits - logits.max())
        return int(self.rng.choice(len(p), p=p / p.sum()))


class _FixedScores(Policy):
    """A primary whose scores were computed outside (batched): lets FallbackPolicy judge them."""

    name = "fixed-scores"
    logits: np.ndarray = np.zeros(0)

    def scores(self, view: ClusterView, request: RequestInfo) -> np.ndarray:
        return self.logits

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        return int(np.argmax(np.where(action_mask(view).astype(bool), self.logits, -np.inf)))


def router_guard() -> FallbackPolicy:
    """The served learned policy's guards and budget (router.policy.served), its primary replaced by
    scores computed outside (batched)."""
    return served_policy(LEARNED, primary=_FixedScores())


# ----------------------------------------------------------------------------------------------
# Environments
# ----------------------------------------------------------------------------------------------
class SpecEnv(DecisionEnv):
    """The simulator's routing environment (`simulator.env.DecisionEnv`) on instances named by InstanceSpec."""

    def __init__(self, cfg: TrainConfig, builder: InstanceBuilder) -> None:
        super().__init__(cfg.env.max_replicas, cfg.env.slo_penalty,
                         LateBindingConfig() if cfg.env.late_binding else None, cfg.env.tpot_penalty,
                         cfg.env.miss_penalty)
        self.builder = builder

    def reset_to(self, spec: InstanceSpec) -> tuple[np.ndarray, np.ndarray, dict]:
        cluster, requests = self.builder.build(spec)
        slo = self.builder.scenario(spec.scenario).slo
        return self.reset(cluster, requests, spec.seed, slo.ttft_s, name=f"{spec.scenario} (seed {spec.seed})",
                          tpot_slo_s=slo.tpot_s)


def heuristic_episode(env: SpecEnv, spec: InstanceSpec, policy_name: str, record: bool) -> dict:
    """One whole episode driven by a baseline.

    Always returns the cost curve used for pairing (`times`: decision times, `costs`: cumulative
    cost at each decision, `final_cost`), observations only if `record`.
    """
    policy = make_policy(policy_name, seed=spec.seed)
    obs, mask, info = env.reset_to(spec)
    feats, masks, acts, times, costs = [], [], [], [], []
    done = False
    cost = 0.0
    while not done:
        view, request = env.decision()
        a = policy.choose(view, request)
        times.append(env.now_s)
        costs.append(env.cost)
        if record:
            feats.append(obs)
            masks.append(mask)
            acts.append(a)
        obs, mask, _r, done, info = env.step(a)
        cost = info["cost"]
    out = {
        "curve": (np.asarray(times), np.asarray(costs), float(cost)),
        "records": env.records(),
    }
    if record:
        out |= {"features": np.stack(feats), "masks": np.stack(masks), "actions": np.asarray(acts, dtype=np.int64)}
    return out


def paired_baseline_rewards(times: np.ndarray, curve: tuple[np.ndarray, np.ndarray, float]) -> np.ndarray:
    """The heuristic's reward over each of the policy's decision intervals on the same arrivals.

    The heuristic's cumulative cost is read at the policy's decision times (linear interpolation
    between the heuristic's own decision times; exact where both decide, i.e. at every arrival).
    The last interval runs to the end of the episode, so the sum is the heuristic's whole return.
    """
    h_times, h_costs, h_final = curve
    at = np.interp(times, h_times, h_costs)
    ends = np.append(at[1:], h_final)
    return -(ends - at)


def policy_episodes(
    envs: list[SpecEnv], specs: list[InstanceSpec], net: RoutingNet, greedy: bool, guard: FallbackPolicy | None = None
) -> list[Episode]:
    """Whole episodes of the network on `specs`, stepped in lockstep with batched forward passes.

    Sampling uses torch's global generator: seed it per task (`torch.manual_seed`).
    With a `guard` (a FallbackPolicy around `_FixedScores`), each decision is also checked
    against the live router's guardrails and the fallback-free decisions are counted.
    """
    n = len(specs)
    state = [env.reset_to(spec) for env, spec in zip(envs, specs)]
    obs = [s[0] for s in state]
    masks = [s[1] for s in state]
    bufs = [{"features": [], "masks": [], "actions": [], "logprobs": [], "values": [], "rewards": [], "times": []} for _ in range(n)]
    active = list(range(n))
    net.eval()
    while active:
        f = torch.from_numpy(np.stack([obs[i] for i in active]))
        m = torch.from_numpy(np.stack([masks[i] for i in active]))
        with torch.no_grad():
            logits, values = net(f, m)
            dist = masked_categorical(logits, m)
            actions = logits.argmax(1) if greedy else dist.sample()
            logprobs = dist.log_prob(actions)
        still = []
        for k, i in enumerate(active):
            b = bufs[i]
            if guard is not None:
                view, request = envs[i].decision()
                guard.primary.logits = logits[k, : len(view.replicas)].numpy()
                b["fallback_free"] = b.get("fallback_free", 0) + int(guard.decide(view, request).fallback_reason is None)
            b["features"].append(obs[i])
            b["masks"].append(masks[i])
            b["actions"].append(int(actions[k]))
            b["logprobs"].append(float(logprobs[k]))
            b["values"].append(float(values[k]))
            b["times"].append(envs[i].now_s)
            obs[i], masks[i], r, done, _ = envs[i].step(int(actions[k]))
            b["rewards"].append(r)
            if not done:
                still.append(i)
        active = still
    episodes = []
    for i, b in enumerate(bufs):
        episodes.append(
            Episode(
                features=np.stack(b["features"]).astype(np.float32),
                masks=np.stack(b["masks"]).astype(np.float32),
                actions=np.asarray(b["actions"], dtype=np.int64),
                logprobs=np.asarray(b["logprobs"], dtype=np.float32),
                values=np.asarray(b["values"], dtype=np.float32),
                rewards=np.asarray(b["rewards"], dtype=np.float64),
                times=np.asarray(b["times"], dtype=np.float64),
                fallback_free_share=b.get("fallback_free", 0) / max(1, len(b["actions"])) if guard is not None else float("nan"),
                spec=specs[i],
                records=envs[i].records(),
            )
        )
    return episodes


# ----------------------------------------------------------------------------------------------
# Worker processes
# ----------------------------------------------------------------------------------------------
def summarise_records(records, slo) -> dict[str, float]:
    from routewise_vllm.simulator.metrics import summarize

    return summarize(records, slo)


class WorkerState:
    """Everything one worker process owns: its environments and its heuristic-reward cache."""

    def __init__(self, cfg: TrainConfig, torch_threads: int = 1) -> None:
        torch.set_num_threads(torch_threads)
        self.cfg = cfg
        self.builder = InstanceBuilder(cfg.env)
        self.envs: list[SpecEnv] = []
        self.heuristic_env: SpecEnv | None = None
        self.net = RoutingNet(N_FEATURES, cfg.network)
        self.heuristic_curves: dict[tuple, tuple] = {}

    def _envs(self, n: int) -> list[SpecEnv]:
        while len(self.envs) < n:
            self.envs.append(SpecEnv(self.cfg, self.builder))
        return self.envs[:n]

    def _henv(self) -> SpecEnv:
        if self.heuristic_env is None:
            self.heuristic_env = SpecEnv(self.cfg, self.builder)
        return self.heuristic_env

    def _slo(self, spec: InstanceSpec):
        return self.builder.scenario(spec.scenario).slo

    def heuristic(self, spec: InstanceSpec, policy: str, record: bool = False) -> dict:
        ep = heuristic_episode(self._henv(), spec, policy, record)
        self.heuristic_curves[(policy, *spec.key())] = ep.pop("curve")
        if len(self.heuristic_curves) > 4096:  # bound memory: drop the oldest entries
            for k in list(self.heuristic_curves)[:1024]:
                del self.heuristic_curves[k]
        ep["summary"] = summarise_records(ep.pop("records"), self._slo(spec))
        return ep

    def paired_curve(self, spec: InstanceSpec, policy: str) -> tuple:
        key = (policy, *spec.key())
        if key not in self.heuristic_curves:
            self.heuristic(spec, policy)
        return self.heuristic_curves[key]

    # --- commands ---------------------------------------------------------------------------
    def cmd_heuristics(self, jobs: list[HeuristicJob]) -> list[HeuristicRun]:
        """Summaries of baseline episodes (their cost curves are cached for pairing)."""
        return [HeuristicRun(job.spec, job.policy, self.heuristic(job.spec, job.policy)["summary"]) for job in jobs]

    def cmd_record(self, jobs: list[HeuristicJob]) -> list[HeuristicRun]:
        """Heuristic episodes with observations (imitation data)."""
        out = []
        for job in jobs:
            ep = self.heuristic(job.spec, job.policy, record=True)
            out.append(HeuristicRun(job.spec, job.policy, ep["summary"], ep["features"], ep["masks"], ep["actions"]))
        return out

    def cmd_explore(self, jobs: list[ExploreJob], state_dict: dict | None = None) -> list[LatencySamples]:
        """Exploration episodes for the latency warm start (trainer/latency.py)."""
        net = None
        if state_dict is not None:
            self.net.load_state_dict(state_dict)
            net = self.net.eval()
        return [explore_episode(self._henv(), job, net) for job in jobs]

    def cmd_rollout(self, state_dict: dict, jobs: list[RolloutJob], greedy: bool, seed: int) -> list[Episode]:
        """Network episodes; where a paired heuristic is named, rewards become (policy - heuristic)."""
        self.net.load_state_dict(state_dict)
        torch.manual_seed(seed)
        specs = [job.spec for job in jobs]
        episodes = policy_episodes(self._envs(len(specs)), specs, self.net, greedy, router_guard() if greedy else None)
        for ep, (spec, paired) in zip(episodes, ((job.spec, job.paired) for job in jobs)):
            ep.raw_return = float(ep.rewards.sum())
            ep.summary = summarise_records(ep.records, self._slo(spec))
            ep.records = None
            if paired is not None:
                curve = self.paired_curve(spec, paired)
                base = paired_baseline_rewards(ep.times, curve)
                ep.paired_return = float(base.sum())
                ep.rewards = ep.rewards - base
                if self.cfg.ppo.relative_paired:  # in units of the heuristic's mean cost per decision
                    ep.rewards = ep.rewards / max(1e-6, curve[2] / max(1, len(curve[0])))
        return episodes


def _worker_main(conn, cfg_json: str, torch_threads: int) -> None:
    from routewise_vllm.trainer.config import TrainConfig

    state = WorkerState(TrainConfig.model_validate_json(cfg_json), torch_threads)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        name, kwargs = msg
        try:
            conn.send(("ok", getattr(state, f"cmd_{name}")(**kwargs)))
        except Exception:  # noqa: BLE001 - sent back to the parent, which raises it
            conn.send(("error", traceback.format_exc()))
    conn.close()


class WorkerError(RuntimeError):
    pass


def split_items(items: list, n: int, key=None) -> list[list]:
    """Items partitioned over `n` workers (by `key(item) % n` when given, so caches stay warm).
    Local processes and Ray actors split alike: worker k gets the same share, and so the same results."""
    parts: list[list] = [[] for _ in range(n)]
    for i, item in enumerate(items):
        parts[(key(item) if key else i) % n].append(item)
    return parts


class WorkerPool:
    """`n` spawned worker processes (n=0: run in this process, for tests and debugging)."""

    def __init__(self, cfg: TrainConfig, n: int) -> None:
        self.cfg = cfg
        self.n = n
        self._local = WorkerState(cfg, cfg.run.torch_threads) if n == 0 else None
        self._procs = []
        self._conns = []
        if n:
            ctx = mp.get_context("spawn")
            for _ in range(n):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, args=(child, cfg.model_dump_json(), 1), daemon=True)
                p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)

    @property
    def size(self) -> int:
        return max(1, self.n)

    def run(self, name: str, per_worker_kwargs: list[dict]) -> list:
        """Run command `name` with per_worker_kwargs[k] on worker k; results concatenated in worker order."""
        if self._local is not None:
            out = []
            for kw in per_worker_kwargs:
                out.extend(getattr(self._local, f"cmd_{name}")(**kw))
            return out
        for conn, kw in zip(self._conns, per_worker_kwargs):
            conn.send((name, kw))
        out, errors = [], []
        for conn, _ in zip(self._conns, per_worker_kwargs):
            status, payload = conn.recv()
            if status == "ok":
                out.extend(payload)
            else:
                errors.append(payload)
        if errors:
            raise WorkerError("a rollout worker failed:\n" + "\n".join(errors))
        return out

    def split(self, items: list, key=None) -> list[list]:
        return split_items(items, self.size, key)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
        self._conns, self._procs = [], []

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
