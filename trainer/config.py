"""The trainer's configuration: one YAML file, validated by pydantic (unknown keys are errors).

`load_config(path)` raises ConfigError naming the file and the offending field, e.g.
`trainer/configs/suite-fleet.yaml: ppo.gamma: Input should be less than or equal to 1 (got 1.5)`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RandomisationConfig(_Strict):
    """Domain randomisation applied to every sampled TRAIN scenario instance."""

    replica_count_scale: tuple[float, float] = Field(
        (0.5, 1.5), description="multiply each replica group's count by U(lo, hi) (at least 1, at most max_replicas)"
    )
    speed_factor: tuple[float, float] = Field(
        (0.8, 1.25), description="per-group multiplier on iteration time (GPU mix / straggler heterogeneity)"
    )
    swap_profile_prob: float = Field(0.2, ge=0, le=1, description="chance that one group's profile is swapped with another's")
    scrape_interval_s: tuple[float, float] = Field((0.25, 4.0), description="U(lo, hi) scrape interval (staleness)")
    scrape_lag_s: tuple[float, float] = Field((0.0, 1.5), description="U(lo, hi) age of the scraped values")
    scrape_failure_prob: tuple[float, float] = Field((0.0, 0.1), description="U(lo, hi) chance a scrape fails")
    prompt_scale: tuple[float, float] = Field((0.7, 1.4), description="multiply prompt lengths by U(lo, hi)")
    fleet_prob: float = Field(
        0.0, ge=0, le=1,
        description="chance that an instance's fleet is replaced by a random one (trainer/instances.py random_fleet: "
        "`fleet_replicas` replicas in 1-3 groups of any profile in simulator/profiles/, arrivals rescaled to keep the "
        "scenario's load on the new fleet's capacity); 0 keeps every scenario's own fleet",
    )
    fleet_replicas: tuple[int, int] = Field(
        (2, 32), description="replica count of a random fleet, log-uniform in [lo, hi] (at most max_replicas)"
    )
    batch_slots_prob: float = Field(
        0.0, ge=0, le=1,
        description="chance that an instance's replicas run with few batch slots (trainer/instances.py few_batch_slots: "
        "max_num_seqs log-uniform in `batch_slots`, arrivals rescaled to keep the scenario's load on the smaller "
        "capacity); 0 keeps every scenario's own max_num_seqs (256)",
    )
    batch_slots: tuple[int, int] = Field((4, 64), description="max_num_seqs of a few-slots instance, log-uniform in [lo, hi]")
    kv_events_prob: float = Field(
        0.0, ge=0, le=1,
        description="chance that an instance's router sees the replicas' caches through their KV events (the simulator's "
        "precise view, simulator.config.KVViewConfig) instead of its own guess, as the live router does where the replicas "
        "publish them; 0 keeps every scenario's own view",
    )
    kv_events_lag_s: tuple[float, float] = Field(
        (0.0, 0.5), description="U(lo, hi) delay from a cache change to the router applying it, on a KV-events instance"
    )
    kv_events_loss: tuple[float, float] = Field(
        (0.0, 0.02), description="U(lo, hi) chance that a batch of KV events is lost, on a KV-events instance (half of "
        "them with a replay endpoint; without one the router falls back to its guess for the replica until the hold ends)"
    )

    @model_validator(mode="after")
    def _ordered(self) -> "RandomisationConfig":
        for name in ("replica_count_scale", "speed_factor", "scrape_interval_s", "scrape_lag_s", "scrape_failure_prob", "prompt_scale",
                     "fleet_replicas", "batch_slots", "kv_events_lag_s", "kv_events_loss"):
            lo, hi = getattr(self, name)
            if lo > hi or lo < 0:
                raise ValueError(f"{name}: need 0 <= lo <= hi, got ({lo}, {hi})")
        if self.fleet_replicas[0] < 1:
            raise ValueError(f"fleet_replicas: need at least 1 replica, got {self.fleet_replicas}")
        if self.batch_slots[0] < 1:
            raise ValueError(f"batch_slots: need at least 1 slot, got {self.batch_slots}")
        if self.kv_events_loss[1] >= 1:
            raise ValueError(f"kv_events_loss: a loss below 1 is needed, got {self.kv_events_loss}")
        return self


class CurriculumConfig(_Strict):
    """Load (arrival-rate multiplier) ramps linearly from `start` to U(`end_lo`, `end_hi`) over `ramp_frac` of training."""

    start: float = Field(0.6, gt=0, description="load multiplier at the start of PPO")
    end_lo: float = Field(0.8, gt=0, description="lower bound of the load multiplier after the ramp")
    end_hi: float = Field(1.3, gt=0, description="upper bound of the load multiplier after the ramp")
    ramp_frac: float = Field(0.5, ge=0, le=1, description="fraction of PPO updates over which the load ramps up")


class EnvConfig(_Strict):
    scenarios: list[str] = Field(min_length=1, description="scenario names or YAML paths; sampled from their TRAIN split")
    max_replicas: int = Field(16, ge=2, le=256, description="observation padding width (replicas per decision)")
    max_requests: int = Field(600, ge=10, description="requests per training episode (longer scenario instances are cut)")
    eval_max_requests: int | None = Field(
        1500, ge=10, description="requests per TRAIN-window instance used to pick heuristics and checkpoints (null = whole)"
    )
    slo_penalty: float = Field(1.0, ge=0, description="weight of the SLO-excess integral in the reward")
    tpot_penalty: float = Field(
        0.0, ge=0, description="weight of the decode time beyond the scenario's TPOT SLO (seconds per request, "
        "charged at completion) in the reward; 0 = the reward sees TTFT only (trainer/REWARD.md)",
    )
    miss_penalty: float = Field(
        0.0, ge=0, description="seconds charged per request that misses its SLO as goodput counts it (TTFT or TPOT), "
        "when the miss becomes certain; 0 = off (trainer/REWARD.md)",
    )
    late_binding: bool = Field(
        False, description="train behind the router's late binding (router.policy.late_binding, default settings): "
        "held requests wait in the router-side queue and a step is a dispatch among the replicas the rule allows "
        "(simulator.env); heuristic baselines and checkpoint selection run behind it too, so like is compared with like",
    )
    randomise: bool = Field(True, description="apply domain randomisation (see `randomisation`)")
    randomisation: RandomisationConfig = RandomisationConfig()
    curriculum: CurriculumConfig = CurriculumConfig()


class NetworkConfig(_Strict):
    hidden: int = Field(64, ge=8, le=512, description="width of the per-replica embedding")
    heads: int = Field(4, ge=1, le=16, description="attention heads (must divide hidden)")
    layers: int = Field(2, ge=0, le=6, description="cross-replica self-attention blocks")
    relative_inputs: bool = Field(
        True, description="add cross-replica relative inputs (difference to min/mean/max, token load) to the encoder"
    )
    wait_prior: bool = Field(
        False, description="add -w x the expected-wait score to each logit (w learnable, starts at 100): the untrained network "
        "ranks replicas like the expected-wait heuristic and the layers learn corrections (needs relative_inputs)"
    )
    gru: bool = Field(False, description="recurrent state over time (ablation only; not supported by export)")

    @model_validator(mode="after")
    def _heads_divide(self) -> "NetworkConfig":
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        if self.wait_prior and not self.relative_inputs:
            raise ValueError("wait_prior needs relative_inputs: true (the expected-wait score is one of the relative inputs)")
        if self.gru:
            raise ValueError("gru: the recurrent variant is not implemented in this release; set gru: false")
        return self


class WarmStartConfig(_Strict):
    """The warm start before PPO, which is also PPO's KL reference policy (config key `warm_start`;
    the old key `bc` is still read, with a deprecation warning)."""

    target: Literal["latency", "imitate"] = Field(
        "latency",
        description="latency: regress each decision's time to first token on the chosen replica (trainer/latency.py); "
        "imitate: cross-entropy on the best heuristic's choices (trainer/imitate.py)",
    )
    episodes_per_scenario: int = Field(6, ge=0, description="episodes recorded per scenario (0 = no warm start)")
    epochs: int = Field(8, ge=0)
    batch_size: int = Field(256, ge=8)
    lr: float = Field(2e-3, gt=0)
    selection_seeds: int = Field(2, ge=1, description="TRAIN seeds per scenario used to pick the best heuristic (p99 TTFT)")
    behaviours: list[str] = Field(
        ["expected-wait", "least-token-load", "weighted-scorer", "least-outstanding", "kv-aware", "prefix-aware"],
        min_length=1,
        description="latency target: heuristics that route the exploration episodes (in turn)",
    )
    explore_epsilon: list[float] = Field(
        [0.05, 0.2, 0.5], min_length=1, description="latency target: chance of a uniformly random healthy replica per decision (in turn)"
    )
    ttft_floor_s: float = Field(
        0.0, ge=0, description="latency target: regress log(TTFT + this), weighting the slow tail over small differences"
    )
    quantile: float | None = Field(
        None, gt=0, lt=1,
        description="latency target: fit this quantile of log TTFT (pinball loss), so the greedy pick is the replica "
        "whose tail is lowest; null: the middle (Huber loss)",
    )
    dagger_rounds: int = Field(
        2, ge=0, description="latency target: rounds of episodes routed by the fitted network (epsilon 0.1), each followed by epochs/2 more epochs on all data"
    )

    @field_validator("behaviours")
    @classmethod
    def _known_behaviours(cls, names: list[str]) -> list[str]:
        from routewise_vllm.router.policy.registry import BASELINES

        for name in names:
            if name not in BASELINES:
                raise ValueError(f"unknown heuristic {name!r} (known: {', '.join(BASELINES)})")
        return names

    @field_validator("explore_epsilon")
    @classmethod
    def _probabilities(cls, eps: list[float]) -> list[float]:
        for e in eps:
            if not 0.0 <= e <= 1.0:
                raise ValueError(f"epsilon {e} is not a probability in [0, 1]")
        return eps


class PPOConfig(_Strict):
    updates: int = Field(40, ge=0, description="PPO updates (each = one rollout phase + optimisation)")
    steps_per_env: int = Field(256, ge=8, description="decisions per environment per update")
    envs_per_worker: int = Field(4, ge=1, description="environments each rollout worker steps in lockstep")
    lr: float = Field(3e-4, gt=0)
    anneal_lr: bool = True
    gamma: float = Field(0.99, gt=0, le=1, description="discount per decision")
    gae_lambda: float = Field(0.95, ge=0, le=1)
    epochs: int = Field(4, ge=1, description="optimisation passes over each rollout batch")
    minibatches: int = Field(4, ge=1)
    clip_coef: float = Field(0.2, gt=0)
    clip_vloss: bool = True
    norm_adv: bool = True
    ent_coef_start: float = Field(0.01, ge=0)
    ent_coef_end: float = Field(0.0, ge=0)
    vf_coef: float = Field(0.5, ge=0)
    max_grad_norm: float = Field(0.5, gt=0)
    target_kl: float | None = Field(0.02, gt=0, description="stop the epoch loop when approx KL exceeds this (null = never)")
    ref_kl_coef_start: float = Field(1.0, ge=0, description="weight of KL(policy || warm-start reference) at the start")
    ref_kl_coef_end: float = Field(0.02, ge=0, description="... decayed linearly to this")
    paired_baseline: bool = Field(
        True, description="subtract the best heuristic's per-decision reward on the same arrival sequence (variance cut)"
    )
    paired_with_peers: bool = Field(
        False, description="choose the paired (and selection's) best heuristic among the peers' algorithms too "
        "(llm-d, llm-d-blend, dynamo-kv), not only routewise's own",
    )
    relative_paired: bool = Field(
        True, description="divide paired rewards by the heuristic's mean cost per decision (balances light and overloaded episodes)"
    )
    reward_scale: float = Field(1.0, gt=0, description="multiplier on rewards before GAE (seconds of waiting -> units)")
    seed_pool: int = Field(64, ge=1, description="distinct arrival sequences per scenario used in PPO (heuristic runs cached)")
    update_normaliser: bool = Field(False, description="keep updating observation statistics during PPO")


class RunConfig(_Strict):
    seed: int = 0
    workers: int = Field(
        default_factory=lambda: os.cpu_count() or 1,
        ge=0,
        description="rollout worker processes (default: the machine's cores); 0 = roll out in the main process",
    )
    run_dir: str = Field("runs/suite-fleet", description="where checkpoints, TensorBoard logs and metrics.csv go")
    checkpoint_every: int = Field(5, ge=1, description="PPO updates between checkpoints")
    eval_every: int = Field(10, ge=1, description="PPO updates between greedy TRAIN-window evaluations")
    eval_seeds: int = Field(2, ge=1, description="TRAIN seeds per scenario in periodic/selection evaluations")
    validation_fleets: int = Field(
        0,
        ge=0,
        description="random fleets per scenario (TRAIN windows, seeds from 2,000,000) added to every periodic/selection "
        "evaluation: `best.pt` then minimises the suite's key times the geometric mean of p99 TTFT over the best heuristic "
        "on each of those instances; 0 = off (the suite's own fleets only)",
    )
    torch_threads: int = Field(1, ge=1, description="torch threads per process (1: the workers use the cores)")
    init: str | None = Field(
        None,
        description="a fine-tune: start from this training checkpoint's network (e.g. runs/any-fleet/best.pt; the same "
        "`network` settings) instead of a warm start, which is skipped; it is also PPO's KL reference. Heuristics are "
        "chosen and checkpoints selected afresh under this configuration (e.g. env.late_binding)",
    )
    ray: str | None = Field(
        None,
        description="run rollouts and evaluation episodes as `workers` Ray actors on this cluster instead of local processes: "
        "auto (RAY_ADDRESS, else the cluster `ray start` began here), ray://HOST:10001, HOST:6379, or local (a private "
        "instance); needs the [ray] extra. Same seed and workers => the same result as locally",
    )

    @field_validator("ray")
    @classmethod
    def _ray_address(cls, address: str | None) -> str | None:
        if address is not None:
            parse_ray_address(address)
        return address


RAY_LOCAL, RAY_AUTO = "local", "auto"  # a private instance on this machine; RAY_ADDRESS or the `ray start` cluster here


def parse_ray_address(address: str) -> tuple[str, int] | None:
    """(host, port) of an explicit Ray address (`ray://HOST:PORT` or `HOST:PORT`); None for `auto` and `local`.
    Anything else is a ValueError naming it."""
    if address in (RAY_LOCAL, RAY_AUTO):
        return None
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"ray address {address!r}: expected local, auto, ray://HOST:PORT or HOST:PORT")
    return host.strip("[]"), int(port)


class EvalConfig(_Strict):
    seeds: list[int] = Field([0, 1, 2], min_length=1, description="EVAL-window seeds for `trainer evaluate`")
    policies: list[str] | None = Field(None, description="baselines to compare (null = all)")


DEPRECATED_KEYS = {"bc": "warm_start"}  # old top-level key -> new one (configs and checkpoints in the wild)


def _deprecated_key_warning(old: str, new: str) -> None:
    warnings.warn(f"trainer config: key '{old}' is deprecated, use '{new}'", FutureWarning, stacklevel=3)


def rename_deprecated_keys(data: dict) -> dict:
    """`data` with deprecated top-level keys renamed (one warning each); both old and new given is an error."""
    for old, new in DEPRECATED_KEYS.items():
        if old in data:
            if new in data:
                raise ValueError(f"both '{old}' (deprecated) and '{new}' are given; keep only '{new}'")
            _deprecated_key_warning(old, new)
            data = {(new if k == old else k): v for k, v in data.items()}
    return data


class TrainConfig(_Strict):
    env: EnvConfig
    network: NetworkConfig = NetworkConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    ppo: PPOConfig = PPOConfig()
    run: RunConfig = RunConfig()
    eval: EvalConfig = EvalConfig()

    @model_validator(mode="before")
    @classmethod
    def _rename_deprecated(cls, data: object) -> object:
        return rename_deprecated_keys(data) if isinstance(data, dict) else data


class ConfigError(ValueError):
    pass


def _format_errors(source: str, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        got = err.get("input")
        got_s = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{source}: {loc}: {err['msg']}{got_s}")
    return "\n".join(lines)


def config_from_dict(data: dict, source: str = "<config>") -> TrainConfig:
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(source, exc)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Parse and validate a YAML config. `overrides` are `dotted.key=yaml_value` strings."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    try:
        data = rename_deprecated_keys(data)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.split(".")
        if parts[0] in DEPRECATED_KEYS:
            _deprecated_key_warning(parts[0], DEPRECATED_KEYS[parts[0]])
            parts[0] = DEPRECATED_KEYS[parts[0]]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {p} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return config_from_dict(data, str(path))
