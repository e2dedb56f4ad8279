"""The models a fleet serves: each replica's /v1/models, the refusals of a request no replica can take, and the
router's own /v1/models (the union of the replicas' lists).

A replica's list is read at start-up, every `models_refresh_interval_s`, as soon as a replica turns healthy, and
when a replica answers that it does not know a model it was sent (vLLM: 404 naming the model). vLLM lists every
LoRA adapter, so a list may hold 100,000 names: a list read again with the same bytes is not parsed again, what
the router answers about the lists is built once per change (router.model_index), never per request, and a
list's change is logged as a count and a digest, never as the names. The router's own /v1/models bodies are sent
at most `models_list_bytes_per_s` (beyond it a 429 with Retry-After): a flood of them cannot take the CPU of the
requests, the health probes and the scrapes. A 200 whose body is not vLLM's list is counted
(llm_router_model_list_errors_total) and leaves the replica serving nothing until it answers sensibly; a replica that cannot be reached or answers an HTTP error keeps its last list (its health probe
takes it out instead). A replica whose list was never read takes no request while others' lists are known; until
some replica's list is known, requests go to any replica (a fleet of servers without /v1/models).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from routewise_vllm.router.errors import BadRequest, error_response
from routewise_vllm.router.model_index import SendBudget, accepts_gzip, etag_matches, model_index, names_digest

# The replica set and its replicas (router.replicas) are typed Any here: router.replicas imports this module.
ReplicaSet = Any
Replica = Any

log = logging.getLogger("router.models")

_SHED_LOG_S = 60.0  # a shedding episode is logged once: when it starts after this long without a 429


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
    timeout = aiohttp.ClientTimeout(total=replicas.config.models_timeout_s)
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
    index = model_index(replicas)
    digest = hashlib.sha256(raw).digest()
    if rep.models_known and index.answered(rep, digest):
        return  # the same bytes as last time: nothing to parse (100,000 entries take ~0.3 s of the event loop)
    try:
        entries = parse_model_list(json.loads(raw))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        if rep.models_known and rep.models:
            log.warning("replica %s: unusable /v1/models (%s): it serves nothing until it answers sensibly", rep.id, exc)
        if replicas.metrics is not None:
            replicas.metrics.model_list_errors.labels(rep.id).inc()
        entries = ()
        digest = b""  # garbage is counted at each read: never skipped as already seen
    index.remember(rep, digest)
    models = frozenset(m["id"] for m in entries)
    if rep.models_known and models == rep.models and entries == rep.model_entries:
        return  # unchanged: the same objects stay, so what ModelIndex built of them stays valid
    if models != rep.models or not rep.models_known:
        log.info("replica %s serves %d models (digest %s)", rep.id, len(models), names_digest(models))
    rep.models, rep.model_entries, rep.models_known = models, entries, True


def names_unknown_model(status: int, body: bytes, model: str | None) -> bool:
    """A replica's answer saying it does not know `model` (vLLM: 404, an error naming the model)."""
    return status == 404 and model is not None and model.encode() in body


def unknown_model(replicas: ReplicaSet, model: str) -> BadRequest | None:
    """The OpenAI-shaped 404 for a model no replica lists, naming the first served models and the count (counted);
    None when some replica lists it, or no replica's list is known yet."""
    if not replicas.models_known or model in replicas.known_models:
        return None
    if replicas.metrics is not None:
        replicas.metrics.model_refusals.labels("unknown_model").inc()
    listed = model_index(replicas).listed(replicas.known_models)
    return BadRequest(f"The model `{model}` does not exist. Available models: {listed or 'none'}.", param="model",
                      status=404, code="model_not_found")


def no_replica_message(model: str | None) -> str:
    return "no healthy replica available" if model is None else f"no healthy replica serves model `{model}`"


def models_handler(replicas: ReplicaSet) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET /v1/models: every model some replica lists, in replica order (the first listing's entry). The body is
    built once per list change (router.model_index), gzipped for a client that takes it, 304 to a matching
    If-None-Match, and a 429 when the bodies sent exceed models_list_bytes_per_s (counted, logged once an episode)."""
    budget = SendBudget(replicas.config.models_list_bytes_per_s)
    last_shed = -_SHED_LOG_S

    async def handler(request: web.Request) -> web.Response:
        nonlocal last_shed
        body = await model_index(replicas).body(tuple(r.model_entries for r in replicas.ordered))
        zipped = accepts_gzip(request.headers.get("Accept-Encoding", ""))
        headers = {"ETag": body.gzip_etag if zipped else body.etag, "Vary": "Accept-Encoding"}
        if etag_matches(request.headers.get("If-None-Match", ""), (body.etag, body.gzip_etag)):
            return web.Response(status=304, headers=headers)
        raw = body.gzipped if zipped else body.raw
        wait = budget.take(len(raw))
        if wait:
            now = time.monotonic()
            if now - last_shed >= _SHED_LOG_S:
                log.warning("GET /v1/models asked for more than models_list_bytes_per_s=%d: answering 429 until it "
                            "is not", budget.rate)
            last_shed = now
            if replicas.metrics is not None:
                replicas.metrics.model_list_refusals.inc()
            return error_response(429, "the model list is asked for too often: retry later (If-None-Match with its "
                                  "ETag answers 304 for free)", "rate_limit_error", code="rate_limit_exceeded",
                                  headers={"Retry-After": SendBudget.retry_after(wait)})
        if zipped:
            headers["Content-Encoding"] = "gzip"
        return web.Response(body=raw, content_type="application/json", headers=headers)

    return handler


def no_replica_response(replicas: ReplicaSet, model: str | None) -> web.Response:
    """The 503 of a request whose model's replicas (or all replicas) are out of rotation, naming the model."""
    if replicas.metrics is not None:
        replicas.metrics.model_refusals.labels("no_replica").inc()
    return error_response(503, no_replica_message(model), "server_error", param=None if model is None else "model",
                          code="no_healthy_replica")
