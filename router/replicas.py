"""The replica set: static or DNS-discovered vLLM replicas, their health and circuit breakers.

Router-side load state lives in `router.policy.tracking.ClusterTracker` (the same code the
simulator runs); this module only decides each replica's `healthy` flag in it:
routable = health probe passing AND breaker not open AND not drained.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

import aiohttp
from yarl import URL

from routewise_vllm.router.batch_limit import BatchLimitInference
from routewise_vllm.router.logsafe import safe
from routewise_vllm.router.models import fetch_models
from routewise_vllm.router.observe.outlier import EjectionConfig, OutlierState, stalled, stalled_streams, ttfb_outliers
from routewise_vllm.router.policy.model_routing import members
from routewise_vllm.router.policy.tracking import ClusterTracker, ReplicaTracker
from routewise_vllm.router.scale.shared import SharedClusterTracker
from routewise_vllm.router.telemetry import RouterMetrics

log = logging.getLogger("router.replicas")


def replica_id(url: str | URL) -> str:
    """The bounded metric label of a replica: its host:port."""
    u = URL(url) if isinstance(url, str) else url
    return f"{u.host}:{u.port}"


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """What the replica set reads: membership, health probes, model lists, batch caps and ejection; the
    settings of the same names (RouterSettings.replica_config builds it)."""

    replicas: tuple[str, ...]  # base URLs, validated
    discover: str | None  # host:port of a headless service
    discover_interval_s: float
    health_interval_s: float
    health_timeout_s: float
    health_failure_threshold: int
    health_success_threshold: int
    models_refresh_interval_s: float
    models_timeout_s: float
    models_list_bytes_per_s: int
    prefix_capacity_blocks: int
    late_binding_max_num_seqs: int | None
    late_binding_replica_max_num_seqs: Mapping[str, int]  # by replica id, read-only
    ejection: EjectionConfig


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class Breaker:
    """Opens after `threshold` consecutive request failures; after `cooldown_s` a passing health
    probe moves it to half-open, where the next request's result closes or re-opens it."""

    threshold: int
    cooldown_s: float
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    opened_at: float | None = None
    trips: int = 0
    reason: str | None = None  # why it last opened (outlier.EJECTION_REASONS)

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.state = BreakerState.CLOSED
        self.opened_at = None

    def record_failure(self) -> str | None:
        """Counts a failure; the reason to open now, if any (the caller decides whether it may)."""
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN or self.consecutive_failures >= self.threshold:
            return "consecutive_failures"
        return None

    def open(self, now: float, reason: str) -> None:
        if self.state is not BreakerState.OPEN:
            self.trips += 1
        self.state = BreakerState.OPEN
        self.opened_at = now
        self.reason = reason

    def cooled_down(self, now: float) -> bool:
        return self.state is BreakerState.OPEN and self.opened_at is not None and now - self.opened_at >= self.cooldown_s


@dataclass(slots=True)
class Replica:
    id: str  # host:port, the metric label
    url: URL  # origin, e.g. http://10.0.0.5:8000
    tracker: ReplicaTracker
    breaker: Breaker
    probe_ok: bool = False
    probe_failures: int = 0
    probe_successes: int = 0
    draining: bool = False
    last_probe_error: str | None = None
    models: frozenset[str] = field(default_factory=frozenset)  # ids in its /v1/models (router.models)
    models_known: bool = False  # its /v1/models was read (garbage counts: it serves nothing)
    model_entries: tuple[dict, ...] = ()  # the /v1/models entries themselves, for the router's union
    scrape: object | None = None  # last VllmStats, for the admin API
    scrape_error: str | None = None
    outlier: OutlierState = field(default_factory=lambda: OutlierState(20))
    batch: BatchLimitInference = field(default_factory=BatchLimitInference)  # its max_num_seqs, from its /metrics

    @property
    def routable(self) -> bool:
        return self.probe_ok and not self.draining and self.breaker.state is not BreakerState.OPEN

    def sync(self) -> None:
        self.tracker.healthy = self.routable

    def state(self) -> str:
        if self.draining:
            return "draining"
        if not self.probe_ok:
            return "unhealthy"
        if self.breaker.state is BreakerState.OPEN:
            return "ejected"
        return "healthy"


class ReplicaSet:
    def __init__(
        self, config: ReplicaConfig, session_getter: Callable[[], aiohttp.ClientSession],
        clock: Callable[[], float] = time.monotonic, metrics: RouterMetrics | None = None,
        cluster: ClusterTracker | None = None,
    ) -> None:
        self.config = config
        self._session = session_getter
        self.clock = clock
        self.metrics = metrics
        # a SharedClusterTracker with `router serve --workers N`: in-flight load and draining host-wide
        self.cluster = cluster or ClusterTracker([], prefix_capacity_blocks=config.prefix_capacity_blocks)
        self.by_id: dict[str, Replica] = {}
        self.ordered: list[Replica] = []  # aligned with self.cluster.trackers (view indices)
        self.known_models: frozenset[str] = frozenset()
        self.models_known = False  # some replica's model list was read: requests go to replicas of their model
        self._members: dict[str, tuple[int, ...] | None] = {}  # by model, cleared when lists or membership change
        self._model_fetches: dict[str, asyncio.Task] = {}
        # called after anything that can change where requests may go (health, drain, membership, scrape):
        # the late-binding queue's wake-up (router.hold_queue)
        self.listeners: list[Callable[[], None]] = []
        for url in config.replicas:
            self.add(url)

    # membership
    def add(self, url: str) -> Replica:
        rid = replica_id(url)
        if rid in self.by_id:
            return self.by_id[rid]
        e = self.config.ejection
        rep = Replica(rid, URL(url), self.cluster.add(rid), Breaker(e.breaker_failure_threshold, e.breaker_cooldown_s),
                      outlier=OutlierState(e.outlier_window))
        rep.sync()
        self.by_id[rid] = rep
        self._reorder()
        log.info("replica %s added", rid)
        self.notify()
        return rep

    def remove(self, rid: str) -> None:
        if self.by_id.pop(rid, None) is not None:
            self.cluster.remove(rid)  # in-flight requests keep their own tracker reference
            self._reorder()
            log.info("replica %s removed", rid)
            self.notify()

    def notify(self) -> None:
        for listener in self.listeners:
            listener()

    def _reorder(self) -> None:
        self.ordered = [self.by_id[t.replica_id] for t in self.cluster.trackers]
        self.update_models()

    # models (router.models)
    def members(self, model: str | None) -> tuple[int, ...] | None:
        """View indices of the replicas serving `model`; None when any replica may take it."""
        try:
            return self._members[model]  # type: ignore[index]
        except KeyError:
            pass
        if not self.models_known:
            return None
        out = self._members[model] = members(model, [r.models if r.models_known else frozenset() for r in self.ordered])  # type: ignore[index]
        return out

    def update_models(self) -> None:
        """After a replica's model list changed: the fleet's models and the candidates by model afresh."""
        self._members.clear()
        self.known_models = frozenset().union(*(r.models for r in self.ordered))
        self.models_known = any(r.models_known for r in self.ordered)

    def refresh_models_of(self, rep: Replica) -> None:
        """Reads `rep`'s model list again soon (it answered that it does not know a model it was sent)."""
        if rep.id not in self._model_fetches:
            self._model_fetches[rep.id] = task = asyncio.get_running_loop().create_task(self._fetch_models(rep))
            task.add_done_callback(lambda _: self._model_fetches.pop(rep.id, None))

    async def _fetch_models(self, rep: Replica) -> None:
        await fetch_models(self, rep)
        self.update_models()
        self.notify()


    def batch_limit(self, rid: str) -> tuple[int | None, str | None]:
        """A replica's batch limit (vLLM's max_num_seqs) and its source: the operator's (for this replica, else for
        every replica), else inferred from its /metrics (router.batch_limit), else (None, None): not known yet."""
        c = self.config
        n = c.late_binding_replica_max_num_seqs.get(rid, c.late_binding_max_num_seqs)
        if n is not None:
            return n, "operator"
        rep = self.by_id.get(rid)
        if rep is not None and rep.batch.limit is not None:
            return rep.batch.limit, "inferred"
        return None, None

    def batch_cap(self, rid: str) -> int | None:
        """The count late binding holds a replica to: the operator's limit, else the inferred one (one more while
        the inference probes above it, router.batch_limit), else None: no count limit yet."""
        n, source = self.batch_limit(rid)
        return self.by_id[rid].batch.cap if source == "inferred" else n

    def any_routable(self) -> bool:
        return any(r.routable for r in self.ordered)

    # request outcomes (circuit breaker and outlier detection)
    def record_success(self, rep: Replica, stream: bool = False, ttfb_s: float | None = None) -> None:
        rep.outlier.record(stream, False, ttfb_s)
        if rep.breaker.state is BreakerState.OPEN:
            return  # a request sent before the ejection: only the cool-down and a trial request re-admit
        if rep.breaker.state is BreakerState.HALF_OPEN or rep.breaker.consecutive_failures:
            if rep.breaker.state is BreakerState.HALF_OPEN:
                rep.outlier.clear_windows()  # re-admitted: judged afresh
                log.info("replica %s re-admitted after a successful trial request", rep.id)
            rep.breaker.record_success()
            rep.sync()

    def record_failure(self, rep: Replica, stream: bool = False) -> None:
        """A failure blamed on the replica (never one the request itself caused)."""
        rep.outlier.record(stream, True)
        e = self.config.ejection
        reason = rep.breaker.record_failure() or rep.outlier.failure_reason(e.outlier_min_requests,
                                                                          e.outlier_failure_ratio)
        if reason is not None:
            self.eject(rep, reason)

    def eject(self, rep: Replica, reason: str) -> bool:
        """Takes `rep` out of rotation for a cool-down, unless that would pass the panic threshold: more than
        max_ejected_ratio of the replicas out of rotation (ejected, unhealthy or draining: as Envoy's panic
        threshold, what counts is how much of the fleet is left), or none routable left. True if ejected (or
        already)."""
        if rep.breaker.state is BreakerState.OPEN:
            return True
        out = sum(1 for r in self.ordered if r is not rep and not r.routable)
        others_routable = any(r.routable for r in self.ordered if r is not rep)
        if not others_routable or out + 1 > self.config.ejection.max_ejected_ratio * len(self.ordered):
            if self.metrics is not None:
                self.metrics.ejections_refused.labels(reason).inc()
            log.debug("replica %s not ejected (%s): panic threshold", rep.id, reason)
            return False
        rep.breaker.open(self.clock(), reason)
        rep.outlier.ejections[reason] = rep.outlier.ejections.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.ejections.labels(rep.id, reason).inc()
        log.warning("replica %s ejected: %s", rep.id, reason)
        rep.sync()
        if reason == "stalled":  # its waiting requests go elsewhere, its streams end with an error event
            for a in list(rep.outlier.inflight):
                a.abort()
        return True

    def check_outliers(self, now: float) -> None:
        """The periodic part of outlier detection: stalled replicas and slow first bytes."""
        e = self.config.ejection
        for rep in self.ordered:  # a stream that stopped mid-way ends with an error event (and counts as a failure)
            for a in stalled_streams(rep.outlier, now, e.stall_timeout_s):
                log.info("aborting a stream from %s silent for %.1f s", rep.id, now - a.last)
                a.abort()
        states = {r.id: r.outlier for r in self.ordered}
        routable = {r.id: r.routable for r in self.ordered}
        for rid in stalled(states, now, e.stall_timeout_s, routable.__getitem__):
            if self.by_id[rid].breaker.state is not BreakerState.OPEN:
                self.eject(self.by_id[rid], "stalled")
        live = {rid: st for rid, st in states.items() if routable[rid]}
        for rid in ttfb_outliers(live, e.outlier_min_requests, e.outlier_ttfb_ratio, e.outlier_ttfb_min_s):
            if self.eject(self.by_id[rid], "slow_first_byte"):
                self.by_id[rid].outlier.ttfb.clear()

    # admin
    def drain(self, rid: str) -> Replica:
        return self._set_draining(rid, True)

    def restore(self, rid: str) -> Replica:
        return self._set_draining(rid, False)

    def _set_draining(self, rid: str, draining: bool) -> Replica:
        rep = self.by_id[rid]
        rep.draining = draining
        rep.sync()
        if isinstance(self.cluster, SharedClusterTracker):
            self.cluster.publish_draining(rid, draining)
        self.notify()
        return rep

    def follow_shared_draining(self) -> None:
        """Applies drain/restore done through another worker's admin API (--workers N)."""
        if isinstance(self.cluster, SharedClusterTracker):
            for rep in self.ordered:
                flag = self.cluster.draining_of(rep.id)
                if flag is not None and flag != rep.draining:
                    log.info("replica %s %s by another worker", rep.id, "drained" if flag else "restored")
                    rep.draining = flag
                    rep.sync()
            self.notify()  # also: other workers' completions, read through the shared counts

    # health probes
    async def probe(self, rep: Replica) -> bool:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with self._session().get(rep.url / "health", timeout=timeout) as resp:
                await resp.read()
                ok = resp.status == 200
                rep.last_probe_error = None if ok else f"HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok = False
            rep.last_probe_error = f"{type(exc).__name__}: {exc}"
        self._apply_probe(rep, ok)
        return ok

    def _apply_probe(self, rep: Replica, ok: bool) -> None:
        c = self.config
        if ok:
            rep.probe_failures = 0
            rep.probe_successes += 1
            if not rep.probe_ok and rep.probe_successes >= c.health_success_threshold:
                rep.probe_ok = True
                log.info("replica %s healthy", rep.id)
            if rep.breaker.cooled_down(self.clock()):
                rep.breaker.state = BreakerState.HALF_OPEN  # the next request is the trial
                log.info("replica %s half-open after cool-down", rep.id)
        else:
            rep.probe_successes = 0
            rep.probe_failures += 1
            if rep.probe_ok and rep.probe_failures >= c.health_failure_threshold:
                rep.probe_ok = False
                log.warning("replica %s unhealthy: %s", rep.id, safe(rep.last_probe_error))
        rep.sync()
        self.notify()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in list(self.ordered)))

    async def refresh_models(self, only_unknown: bool = False) -> None:
        """Models served by healthy replicas, from their /v1/models (router.models); `only_unknown`: those whose
        list was never read (a replica that just turned healthy)."""
        reps = [r for r in list(self.ordered) if r.probe_ok and not (only_unknown and r.models_known)]
        if reps:
            await asyncio.gather(*(fetch_models(self, r) for r in reps))
            self.update_models()
            self.notify()

    async def run_prober(self) -> None:
        next_models = 0.0
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            self.check_outliers(time.perf_counter())
            await self.probe_all()
            if self.clock() >= next_models:
                await self.refresh_models()
                next_models = self.clock() + self.config.models_refresh_interval_s
            else:
                await self.refresh_models(only_unknown=True)

    # DNS discovery of a headless service
    async def discover_once(self) -> None:
        host, _, port = self.config.discover.rpartition(":")  # type: ignore[union-attr]
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("discovery of %s failed: %s (keeping %d replicas)", self.config.discover, exc, len(self.ordered))
            return
        found = {f"http://{info[4][0]}:{port}" for info in infos}
        static = {replica_id(u) for u in self.config.replicas}
        wanted = {replica_id(u) for u in found} | static
        for url in sorted(found):
            if replica_id(url) not in self.by_id:
                rep = self.add(url)
                await self.probe(rep)
        for rid in list(self.by_id):
            if rid not in wanted:
                self.remove(rid)

    async def run_discovery(self) -> None:
        while True:
            await asyncio.sleep(self.config.discover_interval_s)
            await self.discover_once()
