"""Parse a vLLM `/metrics` page into the few numbers the router uses.

Samples are read (not TYPE lines: counters' TYPE lines carry `_total` in some versions and not
in others); values are summed over the `engine` label when a server runs several engines.
Current and legacy names are both accepted. A metric absent from the page stays None.

`vllm:lora_requests_info` (a server with --enable-lora) is an info gauge: its labels `running_lora_adapters` and
`waiting_lora_adapters` (comma-separated adapter names) and `max_lora`, its value the time vLLM set it. vLLM sets a
new label set at each stats update and never removes the old ones, so the page lists every state it has had: the
current one is the series with the largest value.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from routewise_vllm.router.policy.types import LoraState

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # current, legacy
CACHE_CONFIG = "vllm:cache_config_info"
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PREEMPTIONS = "vllm:num_preemptions_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"  # progress: a replica generating for the router's requests
LORA_INFO = "vllm:lora_requests_info"

# The metrics a scrape must carry to count as complete (flagged `missing_metric` otherwise).
REQUIRED = ("waiting", "running", "kv_cache_usage")

_WANTED = {WAITING, RUNNING, CACHE_CONFIG, PREEMPTIONS, GENERATION_TOKENS, LORA_INFO, *KV_USAGE, *PREFIX_QUERIES,
           *PREFIX_HITS}


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
    lora: LoraState | None = None  # the newest vllm:lora_requests_info series; None without LoRA

    def missing(self) -> tuple[str, ...]:
        return tuple(name for name in REQUIRED if getattr(self, name) is None)


def parse_vllm_metrics(text: str) -> VllmStats:
    """Raises MetricsParseError on a page that is not Prometheus text."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    capacity: int | None = None
    lora: tuple[float, dict[str, str]] | None = None  # (value, labels) of the newest lora_requests_info series
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
                if name == LORA_INFO:
                    if lora is None or s.value > lora[0]:
                        lora = (s.value, s.labels)
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
        lora=None if lora is None else _lora_state(lora[1]),
    )


def _names(labels: dict[str, str], key: str) -> tuple[str, ...]:
    return tuple(sorted({n for n in labels.get(key, "").split(",") if n}))


def _lora_state(labels: dict[str, str]) -> LoraState | None:
    """The adapters of one lora_requests_info series; None when its max_lora is not a positive integer."""
    slots = labels.get("max_lora", "")
    if not slots.isdigit() or int(slots) < 1:
        return None
    return LoraState(_names(labels, "running_lora_adapters"), _names(labels, "waiting_lora_adapters"), int(slots))
