"""The view types every policy sees: what the router can really know, live or simulated."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True, slots=True)
class LoraState:
    """A replica's LoRA adapters as vLLM's `vllm:lora_requests_info` reports them: those its running requests use,
    those its waiting requests ask for (names sorted: a few, and plain JSON for the admin API), and how many one batch
    may hold (`--max-loras`)."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_loras: int

    def has(self, adapter: str | None) -> bool:
        """The adapter is loaded or about to be: a request for it joins a batch without taking a new slot."""
        return adapter in self.running or adapter in self.waiting

    @property
    def room(self) -> bool:
        """An adapter neither running nor waiting here would find a free slot."""
        return len(set(self.running).union(self.waiting)) < self.max_loras


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """One replica as the router sees it at decision time.

    Scraped fields (`waiting`, `running`, `kv_cache_usage`, `kv_capacity_tokens`) are the
    values of the last successful scrape and are `None` until one succeeded; they are never
    read as zero. Router-side counters (`outstanding*`) are exact and instant.
    """

    replica_id: str
    healthy: bool
    outstanding: int
    outstanding_prompt_tokens: int
    outstanding_decode_tokens: int = 0  # expected decode tokens of in-flight requests
    waiting: int | None = None  # vllm:num_requests_waiting
    running: int | None = None  # vllm:num_requests_running
    kv_cache_usage: float | None = None  # vllm:kv_cache_usage_perc, 0..1
    kv_capacity_tokens: int | None = None  # num_gpu_blocks * block_size from vllm:cache_config_info
    stats_age_s: float = float("inf")  # now - time of the last successful scrape
    dispatched_since_scrape: int = 0  # requests routed here after the last successful scrape
    prefix_match_blocks: int = 0  # this request's leading prefix blocks in the router's index
    ttft_ema_s: float | None = None  # router-measured EMA of time to first token
    tpot_ema_s: float | None = None  # router-measured EMA of time per output token
    awaiting_first_token: int = 0  # in-flight requests whose first token has not come back yet
    awaiting_prompt_tokens: int = 0  # their prompt tokens: the prefill work still queued ahead
    tpot_floor_s: float | None = None  # router-measured low percentile of TPOT: the replica's speed more than its load
    lora: LoraState | None = None  # vllm:lora_requests_info of the last scrape (None: not exported, LoRA off)

    @property
    def has_stats(self) -> bool:
        return self.waiting is not None and self.running is not None and self.kv_cache_usage is not None


@dataclass(frozen=True, slots=True)
class ClusterView:
    """All replicas, in a fixed order; a policy returns an index into `replicas`."""

    replicas: tuple[ReplicaSnapshot, ...]

    def __len__(self) -> int:
        return len(self.replicas)

    def healthy_indices(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.healthy]


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str
    prompt_tokens_est: int  # from the shared TokenEstimator, live and simulated
    max_tokens: int | None = None
    prefix_blocks: tuple[int, ...] = field(default=())  # chained prefix-block hashes
    key: str | None = None  # stable routing key (user / session) for A/B splits
    model: str | None = None  # the request's `model`: only replicas serving it are candidates (None = any)
    ttft_target_s: float | None = None  # latency targets (x-slo-ttft-ms / x-slo-tpot-ms or the model's default)
    tpot_target_s: float | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the router learns when a request completes (passed to `Policy.on_complete`)."""

    ok: bool
    ttft_s: float | None
    e2e_s: float | None
    output_tokens: int = 0


class NoHealthyReplica(RuntimeError):
    """Raised when a view has no healthy replica to route to."""


# ---- fast constructors for the per-decision hot path ------------------------------------------
# A frozen dataclass's __init__ sets each field through object.__setattr__, several times slower
# than plain slot stores; the router and the simulator build 1 + n_replicas of these per
# decision. Each twin below has the same slots, in the same order, as its frozen class, stores
# them plainly, then becomes an instance of the frozen class (same layout, so Python allows the
# __class__ assignment). The result equals what the dataclass constructor gives (tested).


def slot_builder(frozen: type, params: tuple[str, ...] | None = None, values: dict[str, str] | None = None,
                 namespace: dict | None = None) -> type:
    """A class whose `__init__(self, *params)` stores every field of the frozen slotted dataclass `frozen` plainly
    and then makes the instance a `frozen`. By default the parameters are the fields, with the dataclass's defaults;
    `values` gives the expression (over `params` and `namespace`) that fills a field, else the parameter of its name.
    The code is generated from the fields, as dataclasses generates its own __init__: a field added to the class is
    built here too, and the constructor stays plain slot stores."""
    fields = dataclasses.fields(frozen)
    if frozen.__slots__ != tuple(f.name for f in fields):  # type: ignore[attr-defined]
        raise TypeError(f"{frozen.__name__}'s slots are not its fields")  # pragma: no cover
    if any(f.default_factory is not dataclasses.MISSING for f in fields):  # pragma: no cover - none of ours
        raise TypeError(f"{frozen.__name__}: slot_builder does not take default factories")
    env = dict(namespace or {}, _frozen=frozen)
    if params is None:
        params = tuple(f.name if f.default is dataclasses.MISSING else f"{f.name}=_default_{f.name}" for f in fields)
        env.update({f"_default_{f.name}": f.default for f in fields if f.default is not dataclasses.MISSING})
    values = values or {}
    body = [f"    self.{f.name} = {values.get(f.name, f.name)}" for f in fields]
    src = "\n".join([f"def __init__(self, {', '.join(params)}) -> None:", *body, "    self.__class__ = _frozen"])
    exec(compile(src, f"<{frozen.__name__} builder>", "exec"), env)  # noqa: S102 - generated from the fields
    return type(f"_{frozen.__name__}Builder", (), {"__slots__": frozen.__slots__, "__init__": env["__init__"]})


#: ReplicaSnapshot(...) with its fields positional, in field order.
make_snapshot: Callable[..., ReplicaSnapshot] = slot_builder(ReplicaSnapshot)  # type: ignore[assignment]
#: ClusterView(replicas).
make_view: Callable[[tuple[ReplicaSnapshot, ...]], ClusterView] = slot_builder(ClusterView)  # type: ignore[assignment]
#: dataclasses.replace(snapshot, healthy=False): a replica a decision may not pick (late binding's restriction, a
#: model's other replicas, a retry's exclusions), built as plainly as make_snapshot.
unhealthy: Callable[[ReplicaSnapshot], ReplicaSnapshot] = slot_builder(  # type: ignore[assignment]
    ReplicaSnapshot, ("r",), {f.name: "False" if f.name == "healthy" else f"r.{f.name}"
                              for f in dataclasses.fields(ReplicaSnapshot)})
#: RequestInfo(...) with its fields positional, in field order.
make_request_info: Callable[..., RequestInfo] = slot_builder(RequestInfo)  # type: ignore[assignment]
