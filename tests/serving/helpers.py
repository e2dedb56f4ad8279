from __future__ import annotations

import time

from routewise_vllm.router.policy import FallbackPolicy, LeastOutstanding
from routewise_vllm.router.policy.types import ClusterView, ReplicaSnapshot, RequestInfo


def make_view(outstanding: list[int], healthy: list[bool] | None = None, stats_age_s: float = 0.5) -> ClusterView:
    healthy = healthy or [True] * len(outstanding)
    return ClusterView(tuple(
        ReplicaSnapshot(
            f"r{i}", healthy=h, outstanding=o, outstanding_prompt_tokens=o * 500, outstanding_decode_tokens=o * 100,
            waiting=max(0, o - 4), running=min(o, 4), kv_cache_usage=min(1.0, o / 20), kv_capacity_tokens=65536,
            stats_age_s=stats_age_s, ttft_ema_s=0.1, tpot_ema_s=0.02,
        )
        for i, (o, h) in enumerate(zip(outstanding, healthy))
    ))


def make_request(i: int = 0, prompt: int = 600, max_tokens: int | None = 128) -> RequestInfo:
    return RequestInfo(f"req-{i}", prompt, max_tokens, (11, 12, 13))


def guarded(primary, budget_s: float = 0.0005, **kw) -> FallbackPolicy:
    """The live router's wrapping of a learned policy (routing.PolicyRunner)."""
    kw.setdefault("max_stats_age_s", 10.0)
    kw.setdefault("overload_margin", 32)
    return FallbackPolicy(primary, LeastOutstanding(seed=1), budget_s=budget_s, clock=time.perf_counter, **kw)
