"""vLLM 0.32's Prometheus families for the emulator, in a registry of their own (no process-global state)."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class EngineState(Protocol):
    """What the gauges read (the engine, fleet.emulator.engine.WallClockEngine)."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def lora_state(self) -> tuple[tuple[str, ...], tuple[str, ...], int] | None: ...

# vLLM's own histogram buckets (vllm/v1/metrics/loggers.py), so dashboards read the emulator like vLLM.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class VllmMetrics:
    """vLLM's Prometheus families in a registry of their own (no process-global state)."""

    def __init__(self, model_name: str, block_size: int, num_gpu_blocks: int, enable_prefix_caching: bool) -> None:
        self.registry = CollectorRegistry()
        labels = ("engine", "model_name")
        values = ("0", model_name)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + extra, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ("engine", "block_size", "num_gpu_blocks", "enable_prefix_caching"),
            registry=r,
        )
        info.labels("0", str(block_size), str(num_gpu_blocks), str(enable_prefix_caching)).set(1)
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.").labels(*values)
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.").labels(*values)
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.").labels(*values)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*values)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(*values)
        self._success = counter("vllm:request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.success_length = self._success.labels(*values, "length")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", E2E_BUCKETS)
        self._values = values
        # vLLM's LoRA info gauge (with --enable-lora): a new label set per update, valued at the time it was set, the
        # earlier ones left on the page
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                               ("max_lora", "waiting_lora_adapters", "running_lora_adapters"), registry=r)
        self._driver: EngineState | None = None

    def bind_state(self, driver: EngineState) -> None:
        """Gauges read the model's state when scraped (no per-iteration bookkeeping)."""
        self.running.labels(*self._values).set_function(lambda: driver.num_running)
        self.waiting.labels(*self._values).set_function(lambda: driver.num_waiting)
        self.kv_usage.labels(*self._values).set_function(lambda: driver.kv_usage)
        self._driver = driver

    def render(self) -> bytes:
        state = self._driver.lora_state if self._driver is not None else None
        if state is not None:  # vLLM updates it with its stats; here when scraped
            running, waiting, max_loras = state
            series = self.lora_info.labels(str(max_loras), ",".join(waiting), ",".join(running))
            series.set_to_current_time()
        return generate_latest(self.registry)
