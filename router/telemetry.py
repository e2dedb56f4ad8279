"""The router's Prometheus metrics, on a registry owned by one app (never the global one).

Names are a contract with deploy/ (dashboards, alerts): change them only together.
Per-replica state gauges are computed at collection time from the replica set, so they can
never drift from the tracker and cost nothing on the request path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from routewise_vllm.router.observe.metric_batch import Batch, FlushingRegistry


def geometric_buckets(lo: float, hi: float, ratio: float) -> tuple[float, ...]:
    """Bucket bounds lo, lo*ratio, ... up to the first bound >= hi, rounded to 4 significant digits."""
    n = math.ceil(math.log(hi / lo) / math.log(ratio))
    return tuple(float(f"{lo * ratio**i:.4g}") for i in range(n + 1))


# ~20% apart: p99 is read within about 10% between 10 ms and 60 s (ITL down to 1 ms).
LATENCY_BUCKETS = geometric_buckets(0.005, 120.0, 1.2)
ITL_BUCKETS = geometric_buckets(0.001, 60.0, 1.2)
# quarter-octave (x1.19) from 6.25 us to 50 ms: 100 us and 200 us, the decision-latency targets, are bounds
DECISION_BUCKETS = geometric_buckets(6.25e-6, 0.05, 2**0.25)

UPSTREAM_ERROR_KINDS = ("connect", "timeout", "reset", "http_5xx", "stalled", "stale_model", "malformed", "other")

REPLICA_GAUGES = {
    "llm_router_outstanding_requests": "Requests the router has in flight to the replica (with shared_state, plus the "
                                       "other routers' as of the last sync).",
    "llm_router_replica_healthy": "1 if the replica receives traffic (health probe, circuit breaker, not drained).",
    "llm_router_replica_waiting_requests": "Last scraped vllm:num_requests_waiting.",
    "llm_router_replica_running_requests": "Last scraped vllm:num_requests_running.",
    "llm_router_replica_kv_cache_usage_ratio": "Last scraped vllm:kv_cache_usage_perc (0..1).",
    "llm_router_scrape_age_seconds": "Seconds since the last successful /metrics scrape of the replica.",
}


BATCH_LIMIT = "llm_router_replica_batch_limit"
BATCH_LIMIT_DOC = ("The replica's batch limit (vLLM's max_num_seqs) late binding uses, by source: operator (a setting) "
                   "or inferred (the running count its /metrics plateau at while requests wait); absent until known.")


class ReplicaStateCollector(Collector):
    """Reads `rows()` -> [(replica_id, {gauge_name: value or None})] at scrape time; BATCH_LIMIT's value is
    (limit or None, source)."""

    def __init__(self, rows: Callable[[], Iterable[tuple[str, dict[str, float | None]]]]) -> None:
        self._rows = rows

    def describe(self):
        return [GaugeMetricFamily(name, doc, labels=["replica"]) for name, doc in REPLICA_GAUGES.items()] + [
            GaugeMetricFamily(BATCH_LIMIT, BATCH_LIMIT_DOC, labels=["replica", "source"])]

    def collect(self):
        families = {name: GaugeMetricFamily(name, doc, labels=["replica"]) for name, doc in REPLICA_GAUGES.items()}
        batch = GaugeMetricFamily(BATCH_LIMIT, BATCH_LIMIT_DOC, labels=["replica", "source"])
        for rid, values in self._rows():
            for name, value in values.items():
                if name == BATCH_LIMIT:
                    if value[0] is not None:
                        batch.add_metric([rid, value[1]], value[0])
                elif value is not None:  # never scraped: no sample rather than a fake zero
                    families[name].add_metric([rid], value)
        return [*families.values(), batch]


class RouterMetrics:
    def __init__(self) -> None:
        self.batch = Batch()  # per-request observations, applied off the requests' path (router.observe.metric_batch)
        self.registry = FlushingRegistry(self.batch, auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "llm_router_requests", "Client requests by replica, policy, arm and response code class.",
            ["replica", "policy", "arm", "code_class"], registry=r,
        )
        self.ttft = Histogram(
            "llm_router_ttft_seconds", "Time to first streamed token, measured at the router.",
            ["replica", "policy", "arm"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "llm_router_inter_token_latency_seconds", "Time between streamed chunks, measured at the router.",
            ["replica", "policy", "arm"], buckets=ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "llm_router_e2e_latency_seconds", "Request latency from arrival to last byte, measured at the router.",
            ["replica", "policy", "arm"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.decision_latency = Histogram(
            "llm_router_decision_latency_seconds", "Time to pick a replica (view + policy + fallback).",
            ["policy", "arm"], buckets=DECISION_BUCKETS, registry=r,
        )
        self.fallbacks = Counter(
            "llm_router_fallbacks", "Decisions the fallback policy made instead of the primary, by reason.",
            ["policy", "arm", "reason"], registry=r,
        )
        self.upstream_errors = Counter(
            "llm_router_upstream_errors", "Failed upstream attempts by replica and kind.", ["replica", "kind"], registry=r,
        )
        self.upstream_malformed = Counter(
            "llm_router_upstream_malformed", "Replica answers refused as not well-formed HTTP (answered 502, held "
            "against the replica), by replica and reason.", ["replica", "reason"], registry=r,
        )
        self.retries = Counter("llm_router_retries", "Requests retried on another replica, by reason.", ["reason"], registry=r)
        for kind in UPSTREAM_ERROR_KINDS:
            self.retries.labels(kind)
        self.scrape_errors = Counter(
            "llm_router_scrape_errors", "Failed or incomplete /metrics scrapes by replica and kind.",
            ["replica", "kind"], registry=r,
        )
        self.ejections = Counter(
            "llm_router_replica_ejections", "Replicas taken out of rotation by the breaker or outlier detection, "
            "by reason.", ["replica", "reason"], registry=r,
        )
        self.ejections_refused = Counter(
            "llm_router_ejections_refused", "Ejections not done because of the panic threshold (max_ejected_ratio), "
            "by reason.", ["reason"], registry=r,
        )
        self.client_caused_failures = Counter(
            "llm_router_client_caused_failures", "Failed upstream attempts not held against a replica: the same request "
            "failed on another replica too, or nowhere else was tried.", ["kind"], registry=r,
        )
        self.policy_info = Gauge(
            "llm_router_policy_info", "The policy serving each arm (always 1).",
            ["arm", "name", "version", "feature_hash"], registry=r, multiprocess_mode="max",
        )
        self.held_requests = Gauge(
            "llm_router_held_requests", "Requests held in the router-side late-binding queue (summed over workers).",
            registry=r, multiprocess_mode="livesum",
        )
        self.hold_duration = Histogram(
            "llm_router_hold_duration_seconds", "Time a request spent held in the late-binding queue (held ones only).",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.late_dispatches = Counter(
            "llm_router_late_dispatches", "Requests the late-binding queue let go, by reason: room, idle, full, "
            "timeout, policy (the policy routed it at once), no_healthy, shutdown, error.", ["reason"], registry=r,
        )
        self.model_list_errors = Counter(
            "llm_router_model_list_errors", "Answers to /v1/models that were not a model list, by replica (it serves "
            "nothing until it answers sensibly).", ["replica"], registry=r,
        )
        self.model_list_refusals = Counter(
            "llm_router_model_list_refusals", "GET /v1/models answered 429: the router's model lists were asked for "
            "faster than models_list_bytes_per_s sends.", registry=r,
        )
        self.model_refusals = Counter(
            "llm_router_model_refusals", "Requests no replica could take for their model: unknown_model (404, no "
            "replica lists it) or no_replica (503, its replicas are all out of rotation).", ["reason"], registry=r,
        )
        for reason in ("unknown_model", "no_replica"):
            self.model_refusals.labels(reason)
        self.model_decisions = Counter(
            "llm_router_model_decisions", "Routing decisions by the request's model: the first metrics_max_models "
            "served models requested have a value of their own, any other model is 'other'.", ["model"], registry=r,
        )
        self.model_ttft = Histogram(
            "llm_router_model_ttft_seconds", "Time to first streamed token by the request's model (as in "
            "llm_router_model_decisions), at the router.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.slo_attainment = Counter(
            "llm_router_slo_attainment", "Requests by latency target (ttft, tpot) and result: met, missed (over it, or "
            "failed), no_target, unmeasured (a figure the router cannot see: the TTFT of a stream whose events are not "
            "tokens, the TPOT of an answer that is not a token stream); model as in llm_router_model_decisions.",
            ["model", "target", "result"], registry=r,
        )
        self.slo_header_errors = Counter(
            "llm_router_slo_header_errors", "x-slo-ttft-ms / x-slo-tpot-ms headers ignored: not a positive number of "
            "milliseconds.", ["header"], registry=r,
        )
        self.connections_refused = Counter(
            "llm_router_connections_refused", "Client connections refused with a 503 at a connection cap, by reason: "
            "global_cap, per_client_cap.", ["reason"], registry=r,
        )
        for reason in ("global_cap", "per_client_cap"):
            self.connections_refused.labels(reason)
        self.idle_connections_closed = Counter(
            "llm_router_idle_connections_closed", "Idle keep-alive client connections closed to make room for a new "
            "one at a connection cap.", registry=r,
        )
        self.replica_state: ReplicaStateCollector | None = None

    def add_replica_state(self, rows: Callable[[], Iterable[tuple[str, dict[str, float | None]]]]) -> None:
        self.replica_state = ReplicaStateCollector(rows)
        self.registry.register(self.replica_state)

    def multiprocess_registry(self) -> CollectorRegistry:
        """With several workers (PROMETHEUS_MULTIPROC_DIR set before prometheus_client was imported): every
        worker's counters and histograms summed, plus the per-replica state, which reads host-wide counts."""
        from prometheus_client import multiprocess

        registry = FlushingRegistry(self.batch)
        multiprocess.MultiProcessCollector(registry)
        if self.replica_state is not None:
            registry.register(self.replica_state)
        return registry
