"""The models a fleet serves: each replica's /v1/models, the refusals of a request no replica can take, and the
router's own /v1/models (the union of the replicas' lists).

A replica's list is read at start-up, every `models_refresh_interval_s`, as soon as a replica turns healthy, and
when a replica answers that it does not know a model it was sent (vLLM: 404 naming the model). A 200 whose body is
not vLLM's list is counted (llm_router_model_list_errors_total) and leaves the replica serving nothing until it
answers sensibly; a replica that cannot be reached or answers an HTTP error keeps its last list (its health probe
takes it out instead). A replica whose list was never read takes no request while others' lists are known; until
some replica's list is known, requests go to any replica (a fleet of servers without /v1/models).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from routewise_vllm.router.errors import BadRequest, error_response

# The replica set and its replicas (router.replicas) are typed Any here: router.replicas imports this module.
ReplicaSet = Any
Replica = Any

log = logging.getLogger("router.models")

_LISTED = 20  # models named in a 404 (a fleet of many adapters lists the first ones, then the count)


def parse_model_list(data: Any) -> tuple[dict[str, Any], ...]:
    """The entries of a /v1/models answer ({"object": "list", "data": [{"id": ..., "parent": ...}, ...]}), or
    ValueError naming what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ValueError("not an object with a 'data' array")
    out = []
    for i, m in enumerate(data["data"]):
        if not isinstance(m, dict) or not isinstance(m.get("id"), str) or not m["id"]:
            raise ValueError(f"data[{i}] is not an object with a non-empty string 'id'")
        out.append(m)
    return tuple(out)


async def fetch_models(replicas: ReplicaSet, rep: Replica) -> None:
    """Reads `rep`'s /v1/models into rep.models / rep.model_entries (see the module docstring)."""
    timeout = aiohttp.ClientTimeout(total=replicas.settings.health_timeout_s)
    try:
        async with replicas._session().get(rep.url / "v1" / "models", timeout=timeout) as resp:
            raw = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        log.debug("models of %s: %s", rep.id, exc)
        return
    if status != 200:  # no answer about its models (a server without /v1/models included): nothing learned
        log.debug("models of %s: HTTP %d", rep.id, status)
        return
    try:
        entries = parse_model_list(json.loads(raw))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        if rep.models_known and rep.models:
            log.warning("replica %s: unusable /v1/models (%s): it serves nothing until it answers sensibly", rep.id, exc)
        if replicas.metrics is not None:
            replicas.metrics.model_list_errors.labels(rep.id).inc()
        entries = ()
    models = frozenset(m["id"] for m in entries)
    if models != rep.models or not rep.models_known:
        log.info("replica %s serves %s", rep.id, ", ".join(sorted(models)) or "nothing")
    rep.models, rep.model_entries, rep.models_known = models, entries, True


def names_unknown_model(status: int, body: bytes, model: str | None) -> bool:
    """A replica's answer saying it does not know `model` (vLLM: 404, an error naming the model)."""
    return status == 404 and model is not None and model.encode() in body


def unknown_model(replicas: ReplicaSet, model: str) -> BadRequest | None:
    """The OpenAI-shaped 404 for a model no replica lists, naming the models that are served (counted); None when
    some replica lists it, or no replica's list is known yet."""
    if not replicas.models_known or model in replicas.known_models:
        return None
    if replicas.metrics is not None:
        replicas.metrics.model_refusals.labels("unknown_model").inc()
    names = sorted(replicas.known_models)
    listed = ", ".join(names[:_LISTED]) + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")
    return BadRequest(f"The model `{model}` does not exist. Available models: {listed or 'none'}.", param="model",
                      status=404, code="model_not_found")


def no_replica_message(model: str | None) -> str:
    return "no healthy replica available" if model is None else f"no healthy replica serves model `{model}`"


def models_handler(replicas: ReplicaSet) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET /v1/models: every model some replica lists, in replica order (the first listing's entry)."""

    async def handler(request: web.Request) -> web.Response:
        seen: dict[str, dict[str, Any]] = {}
        for rep in replicas.ordered:
            for m in rep.model_entries:
                seen.setdefault(m["id"], m)
        return web.json_response({"object": "list", "data": list(seen.values())})

    return handler


def no_replica_response(replicas: ReplicaSet, model: str | None) -> web.Response:
    """The 503 of a request whose model's replicas (or all replicas) are out of rotation, naming the model."""
    if replicas.metrics is not None:
        replicas.metrics.model_refusals.labels("no_replica").inc()
    return error_response(503, no_replica_message(model), "server_error", param=None if model is None else "model",
                          code="no_healthy_replica")
