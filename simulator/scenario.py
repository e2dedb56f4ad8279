"""Scenario files: a workload, a cluster, SLOs and a load level, validated (schema in SCENARIOS.md).

`load_scenario(name_or_path, split)` returns a `Scenario` whose `build(rng)` gives the cluster config and
the requests. `split="train"` draws only on the traces' training windows (trainer, tuning); `split="eval"`
only on the evaluation windows (reported figures). The split also salts the workload's generator, so even
a trace-free synthetic workload never repeats between training and evaluation for the same seed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from routewise_vllm.simulator.config import ClusterConfig, KVViewConfig, expand_names
from routewise_vllm.simulator.costmodel import load_profile
from routewise_vllm.simulator.metrics import Slo
from routewise_vllm.simulator.traces import WARMUP_TENANT, Split, TraceLibrary
from routewise_vllm.simulator.types import SimRequest
from routewise_vllm.simulator.workload import WorkloadSpec

SCENARIOS_DIR = Path(__file__).parent / "scenarios"
_SPLIT_SALT = {"train": 0x7261696E, "eval": 0x6576616C}


class ScenarioError(ValueError):
    """A scenario that does not exist or does not validate; the message names file, field and value."""


class SloSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttft_s: float = Field(gt=0, description="time-to-first-token target, seconds")
    tpot_s: float = Field(gt=0, description="time-per-output-token target, seconds")


class SloClassSpec(BaseModel):
    """A class of requests with their own latency targets (live: the x-slo-ttft-ms / x-slo-tpot-ms headers)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    share: float = Field(gt=0, le=1, description="fraction of the requests drawn into this class")
    ttft_s: float = Field(gt=0, description="its time-to-first-token target, seconds")
    tpot_s: float = Field(gt=0, description="its time-per-output-token target, seconds")


class ModelShareSpec(BaseModel):
    """The requests' share that names a model (a base model or a LoRA adapter: the request's `model`)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, description="a model name, or `PREFIX{A..B}` for several (e.g. adapters)")
    share: float = Field(gt=0, le=1, description="fraction of the requests naming it (a range: all its names)")
    zipf_s: float = Field(0.0, ge=0, description="a range's popularity: name k gets weight 1 / (k+1)^zipf_s")


class ScenarioSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    description: str
    workload: WorkloadSpec
    cluster: ClusterConfig
    slo: SloSpec
    time_scale: float = Field(1.0, gt=0, description="load level: synthetic rates x this, trace times / this")
    seeds: int = Field(3, ge=1, description="default number of seeds for comparisons")
    classes: list[SloClassSpec] = Field(
        default_factory=list, description="latency-target classes drawn per request by share (the rest: `slo`, no "
        "target of their own); the arrivals are the same with or without them")

    models: list[ModelShareSpec] = Field(
        default_factory=list, description="the models requests name, by share (summing to 1), drawn per request "
        "after the workload (the same arrivals); none: requests name no model")

    @model_validator(mode="after")
    def _models_served(self) -> ScenarioSpec:
        if not self.models:
            return self
        total = sum(m.share for m in self.models)
        if abs(total - 1) > 1e-6:
            raise ValueError(f"models: the shares sum to {total:g}, not 1")
        names = model_names(self.models)
        if len(set(names)) != len(names):
            raise ValueError("models: a model is named twice")
        if not any(not g.served() for g in self.cluster.replicas):  # a group serving any model serves them all
            served = set().union(*(g.served() for g in self.cluster.replicas))
            if missing := [n for n in names if n not in served]:
                raise ValueError(f"models: no replica group serves {missing[0]!r} (cluster.replicas' models)")
        return self

    @model_validator(mode="after")
    def _classes_sum(self) -> ScenarioSpec:
        total = sum(c.share for c in self.classes)
        if total > 1 + 1e-9:
            raise ValueError(f"classes: the shares sum to {total:g}, more than 1")
        if len({c.name for c in self.classes}) != len(self.classes):
            raise ValueError("classes: two classes share a name")
        return self

    @model_validator(mode="after")
    def _faults_in_range(self) -> ScenarioSpec:
        n = self.cluster.replica_count()
        for i, fault in enumerate(self.cluster.faults):
            if fault.replica >= n:
                raise ValueError(f"cluster.faults[{i}].replica = {fault.replica} but the cluster has {n} replicas")
        return self


@dataclass
class Scenario:
    """A validated scenario bound to a split and a trace library."""

    spec: ScenarioSpec
    split: Split
    source: Path
    library: TraceLibrary = field(default_factory=TraceLibrary, repr=False)
    warm_up: int = 0  # the first requests served but not scored (`with_warm_up`)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def slo(self) -> Slo:
        return Slo(ttft_s=self.spec.slo.ttft_s, tpot_s=self.spec.slo.tpot_s)

    @property
    def cluster(self) -> ClusterConfig:
        return self.spec.cluster

    def with_profiles(self, swap: Mapping[str, str]) -> Scenario:
        """The same scenario with every replica group on profile OLD moved to profile NEW (`swap` = {OLD: NEW}, NEW
        a name or a YAML path): the same arrivals and fleet shape on other hardware, e.g. a profile measured on
        your own GPU. Groups on other profiles stay; a NEW that does not load fails naming the field."""
        groups = [g.model_copy(update={"profile": swap.get(g.profile, g.profile)}) for g in self.spec.cluster.replicas]
        spec = self.spec.model_copy(update={"cluster": self.spec.cluster.model_copy(update={"replicas": groups})})
        _check_profiles(self.source, spec)
        return dataclasses.replace(self, spec=spec)

    def with_kv_view(self, kv_view: KVViewConfig) -> Scenario:
        """The same scenario with the router's picture of the caches replaced (`ClusterConfig.kv_view`): the same
        arrivals routed on the guess, the precise view or a lagged one."""
        spec = self.spec.model_copy(update={"cluster": self.spec.cluster.model_copy(update={"kv_view": kv_view})})
        return dataclasses.replace(self, spec=spec)

    def with_warm_up(self, requests: int) -> Scenario:
        """The same scenario with its first `requests` arrivals served and routed as the others but not scored (tenant
        `warmup`, as a trace's warm-up replay): the figures of a pool already running, its caches warm and its
        queues settled, where the scenario as written starts every replica empty and idle."""
        if requests < 0:
            raise ValueError(f"warm-up must be >= 0 requests, got {requests}")
        return dataclasses.replace(self, warm_up=requests)

    def build(self, rng: np.random.Generator) -> tuple[ClusterConfig, list[SimRequest]]:
        workload_rng = np.random.default_rng([int(rng.integers(2**63)), _SPLIT_SALT[self.split]])
        requests = self.spec.workload.build(workload_rng, self.split, self.library, self.spec.time_scale)
        if self.spec.models:  # drawn after the workload: the same arrivals as without models
            requests = assign_models(requests, self.spec.models, np.random.default_rng(int(rng.integers(2**63))))
        if self.spec.classes:  # drawn after the workload: the same arrivals as without classes
            requests = assign_classes(requests, self.spec.classes, np.random.default_rng(int(rng.integers(2**63))))
        if self.warm_up:
            requests = mark_warm_up(requests, self.warm_up, self.name)
        return self.spec.cluster.model_copy(deep=True), requests

    def class_targets(self) -> dict[str, Slo]:
        """Each request class's targets ("" = the requests in no class: the scenario's `slo`)."""
        return {"": self.slo, **{c.name: Slo(ttft_s=c.ttft_s, tpot_s=c.tpot_s) for c in self.spec.classes}}


def mark_warm_up(requests: list[SimRequest], n: int, scenario: str) -> list[SimRequest]:
    """`requests` with the first `n` by arrival (after any warm-up of their own) marked as warm-up (`scenario` names
    the instance in the error when none would be left to score)."""
    scored = [i for i, r in enumerate(requests) if r.tenant != WARMUP_TENANT]
    if n >= len(scored):
        raise ValueError(f"scenario {scenario!r}: a warm-up of {n} requests leaves none of its {len(scored)} to score")
    out = list(requests)
    for i in sorted(scored, key=lambda i: (requests[i].arrival_s, i))[:n]:
        out[i] = dataclasses.replace(requests[i], tenant=WARMUP_TENANT)
    return out


def model_names(models: list[ModelShareSpec]) -> list[str]:
    return [n for m in models for n in expand_names([m.name])]


def model_weights(models: list[ModelShareSpec]) -> tuple[list[str], np.ndarray]:
    """Every model name and the probability that a request names it."""
    names, weights = [], []
    for m in models:
        expanded = expand_names([m.name])
        w = 1.0 / np.arange(1, len(expanded) + 1) ** m.zipf_s
        names += expanded
        weights += list(m.share * w / w.sum())
    p = np.asarray(weights)
    return names, p / p.sum()


def assign_models(
    requests: list[SimRequest], models: list[ModelShareSpec], rng: np.random.Generator
) -> list[SimRequest]:
    """Each request names a model drawn by share (a range's names by their Zipf popularity)."""
    names, p = model_weights(models)
    picks = rng.choice(len(names), size=len(requests), p=p)
    return [dataclasses.replace(req, model=names[k]) for req, k in zip(requests, picks)]


def assign_classes(requests: list[SimRequest], classes: list[SloClassSpec], rng: np.random.Generator) -> list[SimRequest]:
    """Each request drawn into a class by share (or none), carrying that class's TTFT target."""
    edges = np.cumsum([c.share for c in classes])
    draws = rng.random(len(requests))
    out = []
    for req, u in zip(requests, draws):
        k = int(np.searchsorted(edges, u, side="right"))
        if k < len(classes):
            req = dataclasses.replace(req, slo_class=classes[k].name, ttft_target_s=classes[k].ttft_s)
        out.append(req)
    return out


# Named groups of built-in scenarios kept out of the default suite (`all`, `scenario_names()`): each is a
# subdirectory of SCENARIOS_DIR; its scenarios load by name like the suite's and the group name selects them all.
SCENARIO_GROUPS: dict[str, str] = {
    "shapes": "fleet shapes the suite lacks: 2, 8 and 32 replicas, and GPU speed mixes up to ~8x",
    "models": "fleets of several models: two base models on disjoint and on overlapping replicas, LoRA adapters",
    "slo": "latency-target classes (a scenario's `classes`): deadline-first against FIFO behind late binding",
    "uniform": "uniform pools (one GPU kind) where the cache decides: tenants' system prompts, multi-turn chat, RAG",
}


def scenario_names(group: str | None = None) -> list[str]:
    """The default suite's scenario names, or those of one of SCENARIO_GROUPS."""
    if group is not None and group not in SCENARIO_GROUPS:
        raise ScenarioError(f"unknown scenario group {group!r}; known: {', '.join(SCENARIO_GROUPS)}")
    folder = SCENARIOS_DIR if group is None else SCENARIOS_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _resolve_path(name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    if text.endswith((".yaml", ".yml")) or "/" in text:
        path = Path(text)
        if not path.is_file():
            raise ScenarioError(f"scenario file {text!r} not found")
        return path
    for folder in (SCENARIOS_DIR, *(SCENARIOS_DIR / g for g in SCENARIO_GROUPS)):
        path = folder / f"{text}.yaml"
        if path.is_file():
            return path
    raise ScenarioError(
        f"unknown scenario {text!r}; known: {', '.join(scenario_names())}, the groups {', '.join(SCENARIO_GROUPS)} "
        "or a path to a .yaml file"
    )


def _format_validation(path: Path, err: ValidationError, data: object) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "(top level)"
        got = e.get("input")
        shown = "missing" if e["type"] == "missing" else f"got {got!r}"
        lines.append(f"{path.name}: field {where!r}: {e['msg']} ({shown})")
    return "\n".join(lines)


def parse_scenario(path: Path) -> ScenarioSpec:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ScenarioError(f"{path.name}{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path.name}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        spec = ScenarioSpec.model_validate(data)
    except ValidationError as e:
        raise ScenarioError(_format_validation(path, e, data)) from None
    _check_profiles(path, spec)
    return spec


def _check_profiles(path: Path, spec: ScenarioSpec) -> None:
    """Unknown hardware profiles fail here, naming the field."""
    for i, group in enumerate(spec.cluster.replicas):
        try:
            load_profile(group.profile)
        except Exception as e:  # the cost model's own message names the known profiles
            raise ScenarioError(f"{path.name}: field 'cluster.replicas.{i}.profile': {e}") from None


def load_scenario(
    name_or_path: str | Path, split: Split = "eval", library: TraceLibrary | None = None
) -> Scenario:
    """A built-in scenario by name (the suite's, `scenario_names()`, or a group's) or a YAML file, bound to `split`."""
    if split not in ("train", "eval"):
        raise ScenarioError(f"unknown split {split!r}; known: train, eval")
    path = _resolve_path(name_or_path)
    spec = parse_scenario(path)
    return Scenario(spec=spec, split=split, source=path, library=library if library is not None else TraceLibrary())


def replay_scenario(log: str | Path, cluster_from: str, name: str | None = None) -> dict:
    """A scenario replaying `log` on the cluster, SLOs and load of scenario `cluster_from`."""
    base = load_scenario(cluster_from).spec
    return {
        "name": name or f"replay-{re.sub(r'[^a-z0-9-]+', '-', Path(log).stem.lower()).strip('-') or 'log'}",
        "description": f"Replay of the decision log {log} on the cluster of scenario {base.name}.",
        "workload": {"kind": "decision_log", "path": str(Path(log).resolve())},
        "cluster": base.cluster.model_dump(mode="json", exclude_defaults=True),
        "slo": base.slo.model_dump(mode="json"),
        "time_scale": 1.0,
        "seeds": base.seeds,
    }
