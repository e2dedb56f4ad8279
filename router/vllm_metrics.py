"""Parse a vLLM `/metrics` page into the few numbers the router uses.

Samples are read (not TYPE lines: counters' TYPE lines carry `_total` in some versions and not
in others); values are summed over the `engine` label when a server runs several engines.
Current and legacy names are both accepted. A metric absent from the page stays None.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # current, legacy
CACHE_CONFIG = "vllm:cache_config_info"
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PREEMPTIONS = "vllm:num_preemptions_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"  # progress: a replica generating for the router's requests

# The metrics a scrape must carry to count as complete (flagged `missing_metric` otherwise).
REQUIRED = ("waiting", "running", "kv_cache_usage")

_WANTED = {WAITING, RUNNING, CACHE_CONFIG, PREEMPTIONS, GENERATION_TOKENS, *KV_USAGE, *PREFIX_QUERIES, *PREFIX_HITS}


class MetricsParseError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class VllmStats:
    waiting: int | None = None
    running: int | None = None
    kv_cache_usage: float | None = None  # 0..1, mean over engines
    kv_capacity_tokens: int | None = None  # num_gpu_blocks * block_size, summed over engines
    prefix_cache_queries: float | None = None  # tokens, counter
    prefix_cache_hits: float | None = None  # tokens, counter
    preemptions: float | None = None  # counter
    generation_tokens: float | None = None  # counter

    def missing(self) -> tuple[str, ...]:
        return tuple(name for name in REQUIRED if getattr(self, name) is None)


def parse_vllm_metrics(text: str) -> VllmStats:
    """Raises MetricsParseError on a page that is not Prometheus text."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    capacity: int | None = None
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                name = s.name
                if name not in _WANTED:
                    continue
                if name == CACHE_CONFIG:
                    blocks, size = s.labels.get("num_gpu_blocks"), s.labels.get("block_size")
                    if blocks and size and blocks.isdigit() and size.isdigit():
                        capacity = (capacity or 0) + int(blocks) * int(size)
                    continue
                sums[name] = sums.get(name, 0.0) + s.value
                counts[name] = counts.get(name, 0) + 1
    except ValueError as exc:
        raise MetricsParseError(str(exc)) from exc

    def first(*names: str) -> float | None:
        for n in names:
            if n in sums:
                return sums[n]
        return None

    kv_name = next((n for n in KV_USAGE if n in sums), None)
    kv = None if kv_name is None else sums[kv_name] / counts[kv_name]  # a ratio: mean over engines
    waiting, running = first(WAITING), first(RUNNING)
    return VllmStats(
        waiting=None if waiting is None else int(round(waiting)),
        running=None if running is None else int(round(running)),
        kv_cache_usage=kv,
        kv_capacity_tokens=capacity,
        prefix_cache_queries=first(*PREFIX_QUERIES),
        prefix_cache_hits=first(*PREFIX_HITS),
        preemptions=first(PREEMPTIONS),
        generation_tokens=first(GENERATION_TOKENS),
    )
