"""Admin routes of the serving layer (mounted by router/admin.py behind its bearer token).

GET  /admin/ab              A/B split and rollback guard state (windows, p99s, error rates, reason)
POST /admin/ab/reset        re-enable the treatment after a rollback (empty windows)
POST /admin/policy/reload   {"path": "new.onnx"?, "arm": "main|control|treatment|shadow"?}: 200 when the
                            new policy serves, 422 (old policy kept) with the reason when refused
GET  /admin/serving         shadow, decision log and reload state
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from aiohttp import web

from routewise_vllm.router.errors import error_response
from routewise_vllm.router.serving.layer import ServingLayer

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def serving_routes(layer: ServingLayer, default_arm: str, guarded: Callable[[Handler], Handler]) -> list[web.RouteDef]:
    async def ab(request: web.Request) -> web.Response:
        return web.json_response(layer.describe_ab())

    async def ab_reset(request: web.Request) -> web.Response:
        if layer.ab is None:
            return error_response(409, "A/B is not enabled (start the router with --ab-treatment)", code="ab_disabled")
        return web.json_response(layer.reset_ab())

    async def reload(request: web.Request) -> web.Response:
        body: dict = {}
        if request.can_read_body:
            try:
                body = json.loads(await request.read() or b"{}")
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                return error_response(400, f"body is not valid JSON: {exc}")
            except RecursionError:
                return error_response(400, "body is nested too deeply")
            if not isinstance(body, dict):
                return error_response(400, "body must be a JSON object: {\"path\": ..., \"arm\": ...}")
        arm = body.get("arm", default_arm)
        path = body.get("path")
        if not isinstance(arm, str):
            return error_response(400, f"'arm' must be a string, got {type(arm).__name__}", param="arm")
        if path is not None and not isinstance(path, str):
            return error_response(400, "'path' must be a string", param="path")
        reloader = layer.reloaders.get(arm)
        if reloader is None:
            known = ", ".join(layer.reloaders) or "none (no learned policy is configured)"
            return error_response(400, f"no reloadable policy for arm {arm!r}; reloadable: {known}", param="arm")
        res = await reloader.reload(path)
        return web.json_response({"arm": arm, **res.as_dict()}, status=200 if res.ok else 422)

    async def serving(request: web.Request) -> web.Response:
        return web.json_response(layer.describe())

    return [
        web.get("/admin/ab", guarded(ab)),
        web.post("/admin/ab/reset", guarded(ab_reset)),
        web.post("/admin/policy/reload", guarded(reload)),
        web.get("/admin/serving", guarded(serving)),
    ]
