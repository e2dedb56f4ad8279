"""Validated configuration of a simulated cluster (part of a scenario file)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from routewise_vllm.router.policy.kv_view import DEFAULT_INFLIGHT_S

_RANGE = re.compile(r"^(.*)\{(\d+)\.\.(\d+)\}(.*)$")


def expand_names(names: list[str]) -> list[str]:
    """Model names with `PREFIX{A..B}SUFFIX` ranges written out (`sql-{0..2}`: sql-0, sql-1, sql-2), so a fleet of
    many LoRA adapters fits a line; ValueError for an empty or reversed range."""
    out = []
    for name in names:
        m = _RANGE.match(name)
        if m is None:
            out.append(name)
            continue
        lo, hi = int(m[2]), int(m[3])
        if hi < lo:
            raise ValueError(f"{name!r}: the range {lo}..{hi} is empty")
        out.extend(f"{m[1]}{k}{m[4]}" for k in range(lo, hi + 1))
    return out


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoraConfig(_Strict):
    """vLLM's --enable-lora on a replica group: the adapters it lists, its adapter slots and what loading one costs.

    A batch holds requests of at most `max_loras` distinct adapters (vLLM's scheduler skips a waiting request whose
    adapter would be one too many); an adapter a batch needs is copied into one of `max_loras` GPU slots (`swap_s`),
    after being read from disk when it is not among the `max_cpu_loras` kept in host memory (`load_s`); either stalls
    the iteration that needs it. The costs are assumptions of the order vLLM's adapter manager takes for a rank-16
    adapter of an 8B model, not measurements."""

    adapters: list[str] = Field(min_length=1, description="adapter names it lists (`name-{0..31}` for 32)")
    max_loras: int = Field(1, ge=1, description="vLLM --max-loras: distinct adapters in one batch (its GPU slots)")
    max_cpu_loras: int | None = Field(None, ge=1, description="vLLM --max-cpu-loras (None = max_loras)")
    load_s: float = Field(0.1, ge=0, description="reading an adapter that is not in host memory")
    swap_s: float = Field(0.01, ge=0, description="copying an adapter into a GPU slot")

    @field_validator("adapters")
    @classmethod
    def _expand(cls, v: list[str]) -> list[str]:
        return expand_names(v)

    @model_validator(mode="after")
    def _cpu_holds_gpu(self) -> LoraConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras = {self.max_cpu_loras} is less than max_loras = {self.max_loras} "
                             "(vLLM refuses it too)")
        return self


class ReplicaGroup(_Strict):
    """`count` identical replicas of one hardware/model profile (see simulator/profiles/)."""

    profile: str = Field(description="profile name, e.g. llama3-8b-a100")
    count: int = Field(1, ge=1, le=512)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=16)
    block_size: int = Field(16, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enable_prefix_caching: bool = True
    speed_factor: float = Field(1.0, gt=0, description="multiplies iteration time (>1 = slower)")
    max_model_len: int | None = Field(
        None, ge=16, description="vLLM --max-model-len; None = the profile's (long-context variants, e.g. Llama-3.1 at 128k)"
    )
    models: list[str] = Field(
        [], description="the models (and LoRA adapters) its /v1/models lists: a request for a model goes only to the "
        "replicas listing it; empty = any model (a fleet of one model); `name-{0..31}` lists 32 names"
    )

    lora: LoraConfig | None = Field(None, description="LoRA adapters served besides `models` (vLLM --enable-lora)")

    @field_validator("models")
    @classmethod
    def _expand(cls, v: list[str]) -> list[str]:
        return expand_names(v)

    def served(self) -> frozenset[str]:
        """Every name its /v1/models lists (models and adapters); empty = any model."""
        return frozenset(self.models) | frozenset(self.lora.adapters if self.lora is not None else ())


class ScrapeConfig(_Strict):
    """How the router's view of vLLM /metrics lags the truth."""

    interval_s: float = Field(1.0, gt=0)
    jitter_s: float = Field(0.1, ge=0)
    lag_s: float = Field(0.0, ge=0, description="age of the values a scrape returns")
    failure_prob: float = Field(0.0, ge=0, lt=1)


class FaultConfig(_Strict):
    kind: Literal["slowdown", "crash"]
    replica: int = Field(ge=0, description="index into the flattened replica list")
    at_s: float = Field(ge=0)
    duration_s: float | None = Field(None, gt=0, description="None = until the end of the run")
    factor: float = Field(3.0, gt=0, description="slow-down factor on iteration time")


class KVViewConfig(_Strict):
    """What the router knows of the replicas' prefix caches. `guess`: its own approximate index of what it sent where
    (the router without KV events). `precise`: each router's KV view (router.policy.kv_view, the live one) fed with
    the replicas' cache changes as vLLM's KV events, each engine step's changes one batch, delivered `lag_s` after
    they happen, each batch lost with probability `loss` (a sequence gap: the view is stale until a replay brings
    the missed batches when the replicas have a `replay` endpoint, else for `stale_hold_s`); a replica's view is
    cleared when the router sees it fail (as the live router does). Where the view is stale the guess is used."""

    mode: Literal["guess", "precise"] = "guess"
    lag_s: float = Field(0.0, ge=0, description="from a cache change on the replica to the router applying it")
    loss: float = Field(0.0, ge=0, lt=1, description="probability that a batch of events never reaches a router")
    replay: bool = Field(False, description="the replicas have a replay endpoint (vLLM's replay_endpoint)")
    stale_hold_s: float = Field(30.0, gt=0, description="the router's kv_events_stale_hold_s")
    inflight_s: float = Field(DEFAULT_INFLIGHT_S, ge=0, description="the router's kv_events_inflight_s")
    max_blocks: int = Field(1 << 20, ge=1, description="blocks each router keeps per replica (kv_events_max_blocks)")

    @classmethod
    def parse(cls, text: str) -> KVViewConfig:
        """`guess`, `precise`, or `lagged:SECONDS` (precise, delivered that late); ValueError naming the text."""
        t = text.strip()
        if t in ("guess", "precise"):
            return cls(mode=t)  # type: ignore[arg-type]
        if t.startswith("lagged:"):
            try:
                lag = float(t[len("lagged:"):])
            except ValueError:
                lag = -1.0
            if lag >= 0 and lag != float("inf"):
                return cls(mode="precise", lag_s=lag)
        raise ValueError(f"kv view {text!r}: expected guess, precise or lagged:SECONDS (e.g. lagged:0.5)")

    def label(self) -> str:
        if self.mode == "guess":
            return "guess"
        return "precise" if not self.lag_s else f"lagged:{self.lag_s:g}"


class ClusterConfig(_Strict):
    replicas: list[ReplicaGroup] = Field(min_length=1)
    scrape: ScrapeConfig = ScrapeConfig()
    faults: list[FaultConfig] = []
    estimator_sigma: float = Field(0.15, ge=0, description="log-normal error of the prompt-token estimator")
    estimator_scale: float = Field(
        1.0, gt=0, description="systematic bias of the router's prompt-token estimate (its chars/4 rule against the "
        "real tokenizer: measured chars per token / 4, from `fleet calibrate --server`)"
    )
    health_check_delay_s: float = Field(2.0, ge=0, description="time for the router to notice a crash")
    routers: int = Field(
        1, ge=1, le=64,
        description="router instances sharing the traffic round-robin (several pods behind a Service): each keeps "
        "its own router-side state (in-flight counts, first tokens, prefix index); scraped stats reach all of them",
    )
    shared_state_lag_s: float | None = Field(
        None, ge=0, description="routers > 1 sharing their in-flight counts (the live router's --shared-state): each "
        "sees the others' as of this many seconds ago (its sync interval plus a round trip); None = not shared",
    )

    kv_view: KVViewConfig = Field(
        KVViewConfig(), description="the router's picture of the replicas' prefix caches: its guess, or their KV "
        "events (precise, optionally lagged and lossy)",
    )

    def replica_count(self) -> int:
        return sum(g.count for g in self.replicas)
