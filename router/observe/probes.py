"""The router's own probes (/health, /ready) and the allow-listed passthrough paths (/v1/models by default),
which go to one routable replica without the policy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from aiohttp import web

from routewise_vllm.router.endpoints import ENDPOINTS
from routewise_vllm.router.errors import BadRequest, error_response
from routewise_vllm.router.paths import (GENERATION_PATHS, PASSTHROUGH_METHODS, PassthroughConfig, PathAllowList,
                                         encode_path, normalise_path)
from routewise_vllm.router.proxy import Proxy
from routewise_vllm.router.http.transport import refuse
from routewise_vllm.router.http.upstream import classify, request_headers, response_headers

POST_ONLY = frozenset((*GENERATION_PATHS, *ENDPOINTS))  # the paths the router routes: POST only, as on vLLM


class Probes:
    def __init__(self, config: PassthroughConfig, proxy: Proxy, session: Callable[[], aiohttp.ClientSession]) -> None:
        self._proxy = proxy  # its draining flag, body reader, replicas and arms
        self._session = session
        self._allowed = PathAllowList(config.passthrough_paths)
        self._max_retries = config.max_retries

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """An allow-listed path (passthrough_paths: /v1/models by default), GET or POST: forwarded to one
        routable replica, not routed by the policy. Any other path is 404, whatever it decodes to."""
        proxy = self._proxy
        path = normalise_path(request.rel_url.raw_path)
        if path in POST_ONLY:  # another method on a routed endpoint: what vLLM answers, not "unknown path"
            return error_response(405, f"method {request.method} not allowed on {path}", code="method_not_allowed",
                                  headers={"Allow": "POST"})
        if path is None or not self._allowed.allows(path):
            return error_response(404, f"unknown path {request.rel_url.raw_path[:200]!r}", code="not_found")
        if request.method not in PASSTHROUGH_METHODS:
            return error_response(405, f"method {request.method} not allowed on {path}", code="method_not_allowed",
                                  headers={"Allow": "GET, POST"})
        if proxy.draining:
            return error_response(503, "router is shutting down", "server_error", code="draining")
        try:
            raw = await proxy.read_body(request) if request.can_read_body else None
        except BadRequest as exc:
            return refuse(exc.response(), request)
        upstream_path = encode_path(path)
        tried: set[str] = set()
        for _ in range(self._max_retries + 1):
            candidates = [r for r in proxy.replicas.ordered if r.routable and r.id not in tried]
            if not candidates:
                break
            rep = min(candidates, key=lambda r: r.tracker.outstanding)
            url = rep.url.with_path(upstream_path, encoded=True).with_query(request.query)
            try:
                async with self._session().request(request.method, url, data=raw,
                                                   headers=request_headers(request.headers, request.remote)) as resp:
                    body = await resp.read()
                    return web.Response(status=resp.status, body=body, headers=response_headers(resp.headers))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                tried.add(rep.id)
                proxy.metrics.upstream_errors.labels(rep.id, classify(exc)).inc()
        return error_response(503, "no healthy replica available", "server_error", code="no_healthy_replica")

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "draining" if self._proxy.draining else "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Ready: not draining, a routable replica, and every arm served by the policy it was configured with
        (a learned model that did not load leaves the fallback serving: not ready, so a rollout stops)."""
        proxy = self._proxy
        n = sum(1 for r in proxy.replicas.ordered if r.routable)
        arms = proxy.router.arms
        degraded = {name: runner.load_error for name, runner in arms.items() if runner.load_error}
        ok = n > 0 and not proxy.draining and not degraded
        return web.json_response({
            "ready": ok, "healthy_replicas": n, "replicas": len(proxy.replicas.ordered),
            "policies": {name: {"serving": runner.serving, "error": runner.load_error} for name, runner in arms.items()},
        }, status=200 if ok else 503)
