"""Admin API under /admin/*, behind a bearer token (not mounted at all without one: 404)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from aiohttp import web

from routewise_vllm.router.auth import BearerTokens, unauthorized
from routewise_vllm.router.errors import error_response
from routewise_vllm.router.proxy import Proxy
from routewise_vllm.router.replicas import Replica
from routewise_vllm.router.serving.admin_api import serving_routes

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 6)


def replica_info(rep: Replica, now: float) -> dict[str, Any]:
    t = rep.tracker
    return {
        "id": rep.id,
        "url": str(rep.url),
        "state": rep.state(),
        "routable": rep.routable,
        "draining": rep.draining,
        "probe_ok": rep.probe_ok,
        "last_probe_error": rep.last_probe_error,
        "breaker": {"state": rep.breaker.state.value, "consecutive_failures": rep.breaker.consecutive_failures,
                    "trips": rep.breaker.trips, "reason": rep.breaker.reason},
        "ejections": dict(rep.outlier.ejections),
        "outstanding": t.outstanding,
        "outstanding_prompt_tokens": t.outstanding_prompt_tokens,
        "scrape": {
            "waiting": t.waiting, "running": t.running, "kv_cache_usage": t.kv_cache_usage,
            "kv_capacity_tokens": t.kv_capacity_tokens,
            "age_s": None if t.last_scrape_s is None else _finite(now - t.last_scrape_s),
            "error": rep.scrape_error,
            "last": None if rep.scrape is None else asdict(rep.scrape),  # type: ignore[call-overload]
        },
        "ttft_ema_s": _finite(t.ttft_ema_s),
        "tpot_ema_s": _finite(t.tpot_ema_s),
        "tpot_floor_s": _finite(t.tpot_floor_s),
        "models": sorted(rep.models),
    }


def admin_routes(proxy: Proxy, token: str, started_at: float,
                 on_reload: Callable[[str, str], None] | None = None) -> list[web.RouteDef]:
    """`on_reload(arm, path)` after a successful POST /admin/policy/reload (router.scale.worker_sync: the other
    workers repeat it)."""
    admin = BearerTokens([token])

    def guarded(handler: Handler) -> Handler:
        async def wrapper(request: web.Request) -> web.StreamResponse:
            if not admin.allows(request.headers):
                return unauthorized("admin bearer token")
            return await handler(request)
        return wrapper

    replicas = proxy.replicas

    def lookup(request: web.Request) -> Replica | web.Response:
        rid = request.match_info["id"]
        rep = replicas.by_id.get(rid)
        if rep is None:
            return error_response(404, f"unknown replica {rid!r}; known: {', '.join(replicas.by_id)}", param="id")
        return rep

    async def status(request: web.Request) -> web.Response:
        return web.json_response({
            "uptime_s": round(time.monotonic() - started_at, 3),
            "pid": os.getpid(),  # which worker answered (router serve --workers N)
            "draining": proxy.draining,
            "inflight": proxy.inflight,
            "held": None if proxy.router.holds is None else len(proxy.router.holds),  # late binding's queue; null: off
            "replicas": {"total": len(replicas.ordered), "routable": sum(r.routable for r in replicas.ordered)},
            "known_models": sorted(replicas.known_models),
            "policy": proxy.router.main.name,
        })

    async def list_replicas(request: web.Request) -> web.Response:
        now = replicas.clock()
        return web.json_response({"replicas": [replica_info(r, now) for r in replicas.ordered]})

    async def policy(request: web.Request) -> web.Response:
        return web.json_response({"arms": proxy.router.describe()})

    async def drain(request: web.Request) -> web.Response:
        rep = lookup(request)
        if isinstance(rep, web.Response):
            return rep
        replicas.drain(rep.id)
        return web.json_response(replica_info(rep, replicas.clock()))

    async def restore(request: web.Request) -> web.Response:
        rep = lookup(request)
        if isinstance(rep, web.Response):
            return rep
        replicas.restore(rep.id)
        return web.json_response(replica_info(rep, replicas.clock()))

    served = serving_routes(proxy.router.serving, proxy.router.main.arm, guarded)
    if on_reload is not None:
        served = [_after_reload(r, on_reload) if r.path == "/admin/policy/reload" else r for r in served]
    return served + [
        web.get("/admin/status", guarded(status)),
        web.get("/admin/replicas", guarded(list_replicas)),
        web.get("/admin/policy", guarded(policy)),
        web.post("/admin/replicas/{id}/drain", guarded(drain)),
        web.post("/admin/replicas/{id}/restore", guarded(restore)),
    ]


def _after_reload(route: web.RouteDef, on_reload: Callable[[str, str], None]) -> web.RouteDef:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await route.handler(request)
        if resp.status == 200 and isinstance(resp, web.Response) and resp.body is not None:
            done = json.loads(resp.body)
            on_reload(done["arm"], done["path"])
        return resp

    return web.route(route.method, route.path, handler)
