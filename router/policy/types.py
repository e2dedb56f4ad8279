"""The view types every policy sees: what the router can really know, live or simulated."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable


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


class _SnapshotTwin:
    __slots__ = ReplicaSnapshot.__slots__

    def __init__(
        self, replica_id, healthy, outstanding, outstanding_prompt_tokens, outstanding_decode_tokens, waiting,
        running, kv_cache_usage, kv_capacity_tokens, stats_age_s, dispatched_since_scrape, prefix_match_blocks,
        ttft_ema_s, tpot_ema_s, awaiting_first_token, awaiting_prompt_tokens, tpot_floor_s=None,
    ) -> None:  # fmt: skip
        self.replica_id = replica_id
        self.healthy = healthy
        self.outstanding = outstanding
        self.outstanding_prompt_tokens = outstanding_prompt_tokens
        self.outstanding_decode_tokens = outstanding_decode_tokens
        self.waiting = waiting
        self.running = running
        self.kv_cache_usage = kv_cache_usage
        self.kv_capacity_tokens = kv_capacity_tokens
        self.stats_age_s = stats_age_s
        self.dispatched_since_scrape = dispatched_since_scrape
        self.prefix_match_blocks = prefix_match_blocks
        self.ttft_ema_s = ttft_ema_s
        self.tpot_ema_s = tpot_ema_s
        self.awaiting_first_token = awaiting_first_token
        self.awaiting_prompt_tokens = awaiting_prompt_tokens
        self.tpot_floor_s = tpot_floor_s
        self.__class__ = ReplicaSnapshot  # type: ignore[assignment]


class _ViewTwin:
    __slots__ = ClusterView.__slots__

    def __init__(self, replicas) -> None:
        self.replicas = replicas
        self.__class__ = ClusterView  # type: ignore[assignment]


class _RequestInfoTwin:
    __slots__ = RequestInfo.__slots__

    def __init__(self, request_id, prompt_tokens_est, max_tokens, prefix_blocks, key, model=None, ttft_target_s=None,
                 tpot_target_s=None) -> None:
        self.request_id = request_id
        self.prompt_tokens_est = prompt_tokens_est
        self.max_tokens = max_tokens
        self.prefix_blocks = prefix_blocks
        self.key = key
        self.model = model
        self.ttft_target_s = ttft_target_s
        self.tpot_target_s = tpot_target_s
        self.__class__ = RequestInfo  # type: ignore[assignment]


def _check_twin(twin: type, frozen: type) -> None:
    names = tuple(f.name for f in dataclasses.fields(frozen))
    if twin.__slots__ != names or frozen.__slots__ != names:  # type: ignore[attr-defined]
        raise TypeError(f"{twin.__name__} is out of sync with the fields of {frozen.__name__}")  # pragma: no cover


for _twin, _frozen in ((_SnapshotTwin, ReplicaSnapshot), (_ViewTwin, ClusterView), (_RequestInfoTwin, RequestInfo)):
    _check_twin(_twin, _frozen)

#: ReplicaSnapshot(...) with its fields positional, in field order (the last, tpot_floor_s, optional).
make_snapshot: Callable[..., ReplicaSnapshot] = _SnapshotTwin  # type: ignore[assignment]
#: ClusterView(replicas).
make_view: Callable[[tuple[ReplicaSnapshot, ...]], ClusterView] = _ViewTwin  # type: ignore[assignment]
#: RequestInfo(request_id, prompt_tokens_est, max_tokens, prefix_blocks, key[, model, ttft_target_s, tpot_target_s]),
#: all positional.
make_request_info: Callable[..., RequestInfo] = _RequestInfoTwin  # type: ignore[assignment]
