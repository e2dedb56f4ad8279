"""The view types every policy sees: what the router can really know, live or simulated."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the router learns when a request completes (passed to `Policy.on_complete`)."""

    ok: bool
    ttft_s: float | None
    e2e_s: float | None
    output_tokens: int = 0


class NoHealthyReplica(RuntimeError):
    """Raised when a view has no healthy replica to route to."""
