"""`create_app(settings)`: the aiohttp application of the live router.

All state hangs off the app (typed AppKeys); every long-lived resource (client session,
health prober, discovery, scraper) is opened and closed by a cleanup context.
"""

from __future__ import annotations

import asyncio
import gc
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from routewise_vllm.router.scale import fleet_view
from routewise_vllm.router.admin import admin_routes
from routewise_vllm.router.auth import client_key_middleware, client_keys
from routewise_vllm.router.endpoints import ENDPOINTS
from routewise_vllm.router.http.connections import ListenerConfig
from routewise_vllm.router.http.listener import openai_errors
from routewise_vllm.router.logsafe import safe
from routewise_vllm.router.models import models_handler
from routewise_vllm.router.observe.probes import Probes
from routewise_vllm.router.proxy import Proxy
from routewise_vllm.router.replicas import ReplicaSet
from routewise_vllm.router.routing import Router
from routewise_vllm.router.observe.scraper import Scraper
from routewise_vllm.router.settings import RouterSettings
from routewise_vllm.router.scale.shared import SharedClusterTracker, SharedLoad
from routewise_vllm.router.scale.worker_sync import WorkerSync
from routewise_vllm.router.telemetry import BATCH_LIMIT, RouterMetrics
from routewise_vllm.router.http.client import H1Client
from routewise_vllm.router.http.upstream import make_h1_client, make_session

log = logging.getLogger("router.app")

SETTINGS = web.AppKey("settings", RouterSettings)
METRICS = web.AppKey("metrics", RouterMetrics)
REPLICAS = web.AppKey("replicas", ReplicaSet)
ROUTER = web.AppKey("router", Router)
PROXY = web.AppKey("proxy", Proxy)
SCRAPER = web.AppKey("scraper", Scraper)
SESSION = web.AppKey("session", aiohttp.ClientSession)
H1 = web.AppKey("h1", H1Client)
OPS_APP = web.AppKey("ops_app", web.Application)


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def replica_rows(replicas: ReplicaSet):
    """Per-replica gauge values for the collector, read at scrape time."""

    def rows():
        now = replicas.clock()
        if isinstance(replicas.cluster, SharedClusterTracker):
            replicas.cluster.refresh()  # host-wide in-flight counts
        for rep in replicas.ordered:
            t = rep.tracker
            yield rep.id, {
                "llm_router_outstanding_requests": t.outstanding,
                "llm_router_replica_healthy": 1.0 if rep.routable else 0.0,
                "llm_router_replica_waiting_requests": t.waiting,
                "llm_router_replica_running_requests": t.running,
                "llm_router_replica_kv_cache_usage_ratio": t.kv_cache_usage,
                "llm_router_scrape_age_seconds": None if t.last_scrape_s is None else now - t.last_scrape_s,
                BATCH_LIMIT: replicas.batch_limit(rep.id),
            }

    return rows


def handler_args(settings: RouterSettings) -> dict[str, Any]:
    """aiohttp's connection limits, for an app served without a RouterRunner (which applies them itself)."""
    return ListenerConfig.of(settings).handler_args()


def fleet_sync(config: fleet_view.FleetViewConfig, replicas: ReplicaSet, metrics: RouterMetrics,
               shared: tuple[SharedLoad, int] | None) -> fleet_view.FleetSync:
    """The shared fleet view's sync loop (settings.shared_state): a single process publishes its own counts; with
    --workers N, worker 0 publishes the host's."""
    return fleet_view.FleetSync(
        config, fleet_view.load_source(replicas.cluster), metrics.registry,  # type: ignore[arg-type]
        router_id=fleet_view.router_id(worker=shared is not None), publisher=shared is None or shared[1] == 0,
        on_change=replicas.notify)


def create_app(settings: RouterSettings, *, clock: Callable[[], float] = time.monotonic,
               shared: tuple[SharedLoad, int] | None = None) -> web.Application:
    """The public app. With settings.ops_port, /metrics and /admin/* live on app[OPS_APP] instead (serve it
    on its own listener); /health and /ready are on both. `shared` = (segment, worker slot) makes it one
    worker of several (router.scale.workers): decisions see the host's in-flight load, drain/restore are host-wide
    and /metrics aggregates all workers (prometheus_client multiprocess mode)."""
    keys = client_keys(settings)
    app = web.Application(client_max_size=settings.max_body_bytes, handler_args=handler_args(settings),
                          middlewares=[openai_errors] + ([] if keys is None else [client_key_middleware(keys)]))
    metrics = RouterMetrics()
    session_getter = lambda: app[SESSION]  # noqa: E731 - the session exists once the app starts
    tracker_cls = SharedClusterTracker if settings.shared_state is None else fleet_view.FleetSharedClusterTracker
    cluster = None if shared is None else tracker_cls(shared[0], shared[1], prefix_capacity_blocks=settings.prefix_capacity_blocks)
    replicas = ReplicaSet(settings.replica_config(), session_getter, clock, metrics, cluster)
    fleet_config = settings.fleet_view_config()
    fleet = None if fleet_config is None else fleet_sync(fleet_config, replicas, metrics, shared)
    router = Router(settings, replicas, metrics, clock)
    sync = None if shared is None else WorkerSync(shared[0], replicas, router.serving.reloaders)
    proxy = Proxy(settings, replicas, router, metrics, session_getter, lambda: app[H1])
    scraper = Scraper(settings.scrape_config(), replicas, session_getter, metrics)
    metrics.add_replica_state(replica_rows(replicas))
    if settings.kv_events == "on":  # the replicas' own reports of their caches (router/kv/events.py)
        from routewise_vllm.router.kv.events import KVEvents  # pyzmq loads only with KV events on

        kv = KVEvents(settings, replicas, metrics.registry, session_getter, clock)
        kv.install(router)
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[REPLICAS] = replicas
    app[ROUTER] = router
    app[PROXY] = proxy
    app[SCRAPER] = scraper

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = make_session(settings)
        app[H1] = make_h1_client(settings)
        yield
        app[H1].close()
        await app[SESSION].close()

    async def replicas_ctx(app: web.Application) -> AsyncIterator[None]:
        if settings.discover:
            await replicas.discover_once()
        await replicas.probe_all()
        await replicas.refresh_models()
        tasks = [asyncio.create_task(replicas.run_prober(), name="health-prober")]
        if settings.discover:
            tasks.append(asyncio.create_task(replicas.run_discovery(), name="dns-discovery"))
        if sync is not None:
            tasks.append(asyncio.create_task(sync.run(), name="worker-sync"))
        log.info("%d replicas, %d healthy", len(replicas.ordered), sum(r.routable for r in replicas.ordered))
        for rep in replicas.ordered:  # a mistyped URL is named at start, not found later in a count
            if not rep.routable:
                log.warning("replica %s (%s) is not healthy at start: %s", rep.id, rep.url,
                            safe(rep.last_probe_error or "no answer yet"))
        yield
        for t in tasks:
            await _cancel(t)

    async def scraper_ctx(app: web.Application) -> AsyncIterator[None]:
        await scraper.scrape_all()
        task = asyncio.create_task(scraper.run(), name="metrics-scraper")
        yield
        await _cancel(task)

    async def heap_ctx(app: web.Application) -> AsyncIterator[None]:
        # What start-up built lives as long as the process: keep it out of the cyclic GC, whose full collections
        # of it took ~30 ms of CPU on the router's heap (62k objects) at random requests: that request's latency,
        # and a decision timed over the budget (51 in 100 cool a policy down for 1,000 decisions)
        gc.collect()
        gc.freeze()
        yield
        gc.unfreeze()  # collectable again once this app is gone (tests build many apps in one process)

    async def on_shutdown(app: web.Application) -> None:
        proxy.draining = True
        if router.holds is not None:
            router.holds.close()  # held requests are dispatched now, within the drain

    async def fleet_ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(fleet.run(), name="fleet-view")  # type: ignore[union-attr]
        yield
        await _cancel(task)
        await fleet.close()  # type: ignore[union-attr]

    async def kv_events_ctx(app: web.Application) -> AsyncIterator[None]:
        await kv.refresh()
        task = asyncio.create_task(kv.run(), name="kv-events")
        yield
        await _cancel(task)
        await kv.close()

    app.cleanup_ctx.extend([session_ctx, replicas_ctx, scraper_ctx, router.serving.cleanup_ctx, heap_ctx])
    if settings.kv_events == "on":
        app.cleanup_ctx.insert(3, kv_events_ctx)  # after the replicas are known, before the first request
    if fleet is not None:
        app.cleanup_ctx.insert(2, fleet_ctx)  # after the replicas are known, before the first request
    app.on_shutdown.append(on_shutdown)

    exposed = metrics.registry if shared is None else metrics.multiprocess_registry()
    if shared is not None and settings.kv_events == "on":
        kv.expose(exposed)  # the KV view's figures under --workers N (router/kv/events.py)

    async def metrics_handler(request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(exposed))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    own = Probes(settings.passthrough_config(), proxy, session_getter)
    probes = [web.get("/health", own.health), web.get("/ready", own.ready)]
    app.add_routes([
        web.post("/v1/completions", proxy.completions),
        web.post("/v1/chat/completions", proxy.chat_completions),
        web.get("/v1/models", models_handler(replicas)),  # the union of the replicas' lists
        *(web.post(path, proxy.endpoint) for path in ENDPOINTS),  # vLLM's other client endpoints, routed
        web.route("*", "/v1/{tail:.*}", own.passthrough),  # allow-listed paths only (Probes.passthrough)
        *probes,
    ])
    ops = app
    if settings.ops_port is not None:
        ops = app[OPS_APP] = web.Application(handler_args=handler_args(settings), middlewares=[openai_errors])
        ops.add_routes(probes)
    ops.add_routes([web.get("/metrics", metrics_handler)])
    if settings.admin_token is not None:
        ops.add_routes(admin_routes(proxy, settings.admin_token.get_secret_value(), time.monotonic(),
                                    on_reload=None if sync is None else sync.published_reload))
    return app
