"""The request hot path: admit, route, forward with retries before the first byte, stream back.

Streaming responses are passed through chunk by chunk as they arrive (no re-serialisation);
TTFT is taken at the first chunk carrying SSE data, inter-token latency between chunks.
Every dispatched attempt is released in the tracker exactly once (ReplicaTracker.on_complete
is idempotent per request id, and each attempt releases in a `finally`).

What the OpenAI body means is router.openai's; the probes and passthrough paths are router.observe.probes'. Retries,
streaming and the outcome accounting stay together here: each attempt's release must stay visibly paired with
its dispatch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from routewise_vllm.router.accounting import Accounts, Children, code_class
from routewise_vllm.router.auth import client_keys, unauthorized
from routewise_vllm.router.http.client import H1Client, ReaderTimeoutError
from routewise_vllm.router.http.server import LeanSent, LeanStream
from routewise_vllm.router.endpoints import ENDPOINTS, read
from routewise_vllm.router.errors import BadRequest, error_response, sse_error_event
from routewise_vllm.router.models import names_unknown_model, no_replica_response, unknown_model
from routewise_vllm.router.openai import decode, validate
from routewise_vllm.router.observe.outlier import Inflight
from routewise_vllm.router.paths import GENERATION_PATHS
from routewise_vllm.router.policy.pipeline import Held, NoneHealthy
from routewise_vllm.router.policy.types import Outcome, RequestInfo
from routewise_vllm.router.replicas import Replica, ReplicaSet
from routewise_vllm.router.routing import Route, Router
from routewise_vllm.router.settings import RouterSettings
from routewise_vllm.router.telemetry import RouterMetrics
from routewise_vllm.router.http.transport import AiohttpRequest, Downstream, UpstreamResponse, read_body, refuse, upstreams
from routewise_vllm.router.http.upstream import UpstreamError, classify, malformed, request_headers, response_headers

log = logging.getLogger("router.proxy")

# What a generation request gets: aiohttp's response to send, or the lean listener's already sent.
Answer = web.StreamResponse | LeanStream | LeanSent
# The first attempt decided before the request's task ran: its route and, when sent, the upstream response due; or
# late binding holds it; or no replica of its model is healthy.
_Started = tuple[Route, Awaitable[UpstreamResponse] | None]
_First = _Started | Held | NoneHealthy


async def _ready(answer: Answer) -> Answer:
    return answer


_DATA = b"data:"
_DONE = b"data: [DONE]"


def route_headers(route: Route, upstream_headers, replica_header: bool) -> Any:
    """The replica's response headers plus which arm (and, opted in, which replica) served it."""
    h = response_headers(upstream_headers)
    h["x-routewise-arm"] = route.runner.arm
    if replica_header:
        h["x-routewise-replica"] = route.replica.id
    return h


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


class Proxy:
    def __init__(
        self, settings: RouterSettings, replicas: ReplicaSet, router: Router, metrics: RouterMetrics,
        session_getter: Callable[[], aiohttp.ClientSession], h1_getter: Callable[[], H1Client],
    ) -> None:
        self.settings = settings
        self.replicas = replicas
        self.router = router
        self.metrics = metrics
        self._upstreams = upstreams(settings.lean_client, h1_getter, session_getter, settings.idle_timeout_s)  # by scheme
        self.draining = False
        self.inflight = 0
        self.accounts = Accounts(metrics)
        self._first_byte_timeout = settings.first_byte_timeout_s
        self._replica_header = settings.replica_header
        self.api_keys = client_keys(settings)  # checked here for the lean listener, in a middleware for aiohttp

    # --- OpenAI generation endpoints ---------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> Answer:
        """A generation request through aiohttp's server side: its body read, then as from the lean listener."""
        try:
            raw = b"" if self.draining else await self.read_body(request)
        except BadRequest as exc:
            return refuse(exc.response(), request)
        return await self.generate(AiohttpRequest(request, raw), chat)

    def generate(self, request: Downstream, chat: bool) -> Awaitable[Answer]:
        """A completion or chat completion whose body is in hand (router.http.transport.Downstream): an awaitable of
        the response to send, or for a stream of the one already sent.

        Its start runs now, before the caller's task first runs: parsing, the decision and, on an idle
        kept-alive connection, the send upstream (on the lean listener the event loop's turn before the task
        starts was 30-40 us of each request's wait at low load). The awaitable must be run, or what the start
        took stays taken: router.http.server cancels a request only after its task's first step."""
        t0 = time.perf_counter()
        admitted = self._admit(request, chat)
        if not isinstance(admitted, tuple):
            return _ready(admitted)
        body, info = admitted
        raw = request.body
        path = GENERATION_PATHS[chat]
        headers = request_headers(request.headers, request.remote)
        first = self._start_now(info, raw, headers, path)
        self.inflight += 1
        return self._run(request, raw, info, headers, body.get("stream") is True, t0, path, first)

    def _admit(self, request: Downstream, chat: bool) -> tuple[dict[str, Any], RequestInfo] | web.Response:
        """(the body, what routing reads of it), or the refusal: draining, not JSON, invalid, an unknown model."""
        if self.api_keys is not None and not self.api_keys.allows(request.headers):
            return request.refuse(unauthorized("API key", "invalid_api_key"))
        if self.draining:
            return error_response(503, "router is shutting down", "server_error", code="draining",
                                  headers={"Connection": "close"})
        try:
            body = validate(decode(request.body), chat, self.settings.max_tokens_limit)
            if (refused := unknown_model(self.replicas, body["model"])) is not None:
                raise refused
            return body, self.router.request_info(body, chat, request.headers)
        except BadRequest as exc:
            return request.refuse(exc.response())

    def _start_now(self, info: RequestInfo, raw: bytes, headers, path: str) -> _First:
        """The first attempt's decision and, on an idle kept-alive connection with room under the limit, its
        send; or Held (the task waits for room) or NoneHealthy (the task answers)."""
        route = self.router.first(info)
        if type(route) is not Route:
            return route  # type: ignore[return-value]
        try:
            url = route.replica.url
            return route, self._upstreams[url.scheme].send_now(url, path, raw, headers)
        except BaseException:
            self.router.release(route)
            raise

    async def _run(self, request: Downstream, raw: bytes, info: RequestInfo, headers, stream: bool,
                   t0: float, path: str, first: _First) -> Answer:
        try:
            return await self._forward(request, raw, info, headers, stream, t0, path, first)
        finally:
            self.inflight -= 1

    async def _forward(self, request: Downstream, raw: bytes, info: RequestInfo, headers,
                       stream: bool, t0: float, path: str, first: _First) -> Answer:
        tried: set[str] = set()
        last: UpstreamError | None = None
        suspects: list[tuple[Replica, str]] = []  # failed before the first byte; blamed if another replica serves
        for attempt in range(self.settings.max_retries + 1):
            if attempt:
                got = self.router.decide(info, tried)
            else:  # late binding holds it: asked again, room may have come since the start
                got = await self.router.when_room(info) if type(first) is Held else first
            if type(got) is NoneHealthy:
                break
            route, sent = got if type(got) is tuple else (got, None)
            rep = route.replica
            retry = tried if attempt < self.settings.max_retries else None  # None: the last try
            try:
                out = await self._attempt(request, route, raw, headers, stream, t0, retry, path, sent)
            except UpstreamError as exc:
                last = exc
                tried.add(rep.id)
                self.metrics.upstream_errors.labels(rep.id, exc.kind).inc()
                if exc.kind in ("connect", "malformed"):  # nothing the request carries can cause these
                    self.replicas.record_failure(rep, stream)
                elif exc.kind != "stale_model":  # a list read again, not the replica's health
                    suspects.append((rep, exc.kind))
                if retry is None or not self.router.can_retry(rep, tried, info.model):
                    break
                self.metrics.retries.labels(exc.kind).inc()
            else:
                self._settle(suspects, route.status is not None and route.status < 500, stream)
                self.router.targets.done(info, route.outcome, stream, route.tpot_s, self.replicas.known_models)
                return out
        self._settle(suspects, False, stream)
        self.router.targets.done(info, None, stream, None, self.replicas.known_models)
        if last is None:
            return no_replica_response(self.replicas, info.model)
        return error_response(last.status, f"upstream failed: {last}", "server_error", code=f"upstream_{last.kind}")

    def _settle(self, suspects: list[tuple[Replica, str]], served: bool, stream: bool) -> None:
        """Failures before the first byte count against a replica only if another replica then served the same
        request; if it failed everywhere it was tried, the request is to blame (a client can send one that
        makes vLLM answer 500), and no replica's health suffers. One log line per request at most."""
        if suspects:
            log.info("%s after failures before the first byte on %s", "served" if served else "failed everywhere",
                     ", ".join(f"{rep.id} ({kind})" for rep, kind in suspects))
        for rep, kind in suspects:
            if served:
                self.replicas.record_failure(rep, stream)
            else:
                self.metrics.client_caused_failures.labels(kind).inc()

    async def _attempt(
        self, request: Downstream, route: Route, raw: bytes, headers, stream: bool, t0: float, retry: set[str] | None,
        path: str, sent: Awaitable[UpstreamResponse] | None = None,
    ) -> Answer:
        """One upstream attempt (`sent`: the request already on its way, from _start_now; `retry`: the replicas
        tried so far, None on the last try). Raises UpstreamError only while nothing has reached the client."""
        rep = route.replica
        route.stream = stream
        ch = self.accounts.of(route)
        resp: UpstreamResponse | None = None
        clean = False  # the upstream body was read to its end: the connection may be reused
        outlier = rep.outlier
        inflight: Inflight | None = None
        try:
            try:
                if sent is not None:
                    post = sent
                else:
                    url = rep.url
                    post = self._upstreams[url.scheme].post(url, path, raw, headers)
                if stream:  # the first byte is due within first_byte_timeout_s
                    async with asyncio.timeout(self._first_byte_timeout) as cm:
                        inflight = Inflight(cm, None)
                        outlier.inflight.add(inflight)
                        resp = await post
                        first = await resp.content.readany() if resp.status < 300 else await resp.read()
                else:  # the first byte comes at the end: only the idle timeout, or a stall (inflight.abort())
                    inflight = Inflight(None, asyncio.current_task())
                    outlier.inflight.add(inflight)
                    resp = await post
                    first = await resp.read()
                outlier.last_progress = now = time.perf_counter()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                route.outcome = Outcome(False, None, None)
                kind = "stalled" if inflight is not None and inflight.aborted else classify(exc)
                if kind == "malformed":  # the replica's bytes go to the log, not to the client
                    exc = malformed(self.metrics.upstream_malformed, rep.id, exc)
                raise UpstreamError(kind, f"{rep.id}: {type(exc).__name__}: {exc}") from None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if inflight is None or not inflight.aborted or task is None or task.uncancel() > 0:
                    raise  # the client went away (or the router stops)
                route.outcome = Outcome(False, None, None)
                raise UpstreamError("stalled", f"{rep.id}: stalled, aborted") from None
            status = route.status = resp.status
            if names_unknown_model(status, first, route.request.model):  # its list is stale: read it again
                self.replicas.refresh_models_of(rep)
                # and try a replica that serves the model, before the first byte as for a 5xx
                if retry is not None and self.router.can_retry(rep, retry, route.request.model):
                    route.outcome = Outcome(False, None, None)
                    raise UpstreamError("stale_model", f"{rep.id}: does not serve `{route.request.model}`")
            if status >= 500 and retry is not None and self.router.can_retry(rep, retry, route.request.model):
                route.outcome = Outcome(False, None, None)
                raise UpstreamError("http_5xx", f"{rep.id}: HTTP {status}")
            if not stream or status >= 300:
                clean = True
                e2e = now - t0
                route.outcome = Outcome(status < 300, None, e2e)
                answer_headers = route_headers(route, resp.headers, self._replica_header)
                try:  # the lean listener sends it now: the accounting below is off the client's wait
                    out = request.respond(status, answer_headers, first)
                except ConnectionError as exc:
                    raise _ClientGone() from exc
                self._judge(rep, status, stream, now - t0 if stream and route.found_idle else None)
                ch.e2e.observe(e2e)
                ch.codes[code_class(status)].inc()
                return out
            tokens = path in GENERATION_PATHS  # a token per SSE event: TTFT and ITL recorded
            self._judge(rep, status, stream, now - t0 if tokens and route.found_idle else None)
            inflight.response = resp
            inflight.timeout = None
            return await self._stream(request, route, resp, first, t0, ch, inflight, tokens)
        except _ClientGone:
            ch.codes["error"].inc()
            return web.Response(status=499)  # nobody reads it; aiohttp needs a return value
        except asyncio.CancelledError:  # the client disconnected while we waited on the replica
            ch.codes["error"].inc()
            raise
        finally:
            if inflight is not None:
                outlier.inflight.discard(inflight)
            if resp is not None:
                if clean or (route.outcome is not None and route.outcome.ok):
                    resp.release()
                else:
                    resp.close()  # abort: vLLM sees the disconnect and frees the sequence
            self.router.release(route, route.outcome, route.tpot_s)

    def _judge(self, rep: Replica, status: int, stream: bool, idle_ttfb_s: float | None) -> None:
        """A replica that answered: a success for its health, unless a 5xx on the last try (see _settle)."""
        if status >= 500:
            self.metrics.upstream_errors.labels(rep.id, "http_5xx").inc()
        else:
            self.replicas.record_success(rep, stream, idle_ttfb_s)

    async def _stream(
        self, request: Downstream, route: Route, resp: UpstreamResponse, first: bytes, t0: float,
        ch: Children, inflight: Inflight, tokens: bool = True,
    ) -> Answer:
        """Passes the replica's stream on chunk by chunk. `tokens`: each SSE event is a token (completions, chat):
        the first one's time is the TTFT; other endpoints' events (a response's lifecycle, a transcription's
        deltas) record none."""
        rep = route.replica
        headers = route_headers(route, resp.headers, self._replica_header)
        outlier = rep.outlier
        ttft: float | None = None
        events = 0
        done = False
        last_t = 0.0
        chunk = first
        try:
            out = request.stream(resp.status, headers)
        except ConnectionError as exc:
            raise _ClientGone() from exc
        content = resp.content
        while chunk:
            data = _DATA in chunk
            if data:
                outlier.last_progress = inflight.last = now = time.perf_counter()
            end = content.at_eof()  # the replica's response ended with this chunk: it goes out with the end
            if not end:
                try:
                    await out.write(chunk)  # first: the accounting below is off the client's wait
                except ConnectionError as exc:
                    raise _ClientGone() from exc
            if data:
                n = chunk.count(_DATA)
                if _DONE in chunk:
                    n -= 1
                    done = True
                if n > 0:
                    if tokens and ttft is None:
                        ttft = now - t0
                        ch.ttft.observe(ttft)
                        self.router.on_first_token(route, ttft)
                    elif tokens:  # events that arrived together share the gap since the previous read
                        ch.itl.observe((now - last_t) / n)
                    last_t = now
                    events += n
            if end:
                break
            try:
                chunk = await content.readany()
                if chunk:
                    more = content.read_nowait()  # coalesce what already arrived: fewer writes, no added wait
                    if more:
                        chunk += more
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                kind = classify(exc)
                if kind == "malformed":
                    malformed(self.metrics.upstream_malformed, rep.id, exc)
                if isinstance(exc, ReaderTimeoutError):  # the client stopped reading: not the replica's fault
                    log.info("stream from %s cut after %d events: the client read nothing for %s s", rep.id, events,
                             self.settings.idle_timeout_s)
                else:
                    self.metrics.upstream_errors.labels(rep.id, kind).inc()
                    self.replicas.record_failure(rep, True)
                    log.info("stream from %s broke after %d events: %s", rep.id, events, exc)
                ch.codes["error"].inc()
                route.outcome = Outcome(False, ttft, time.perf_counter() - t0, events)
                try:
                    await out.write(sse_error_event(f"upstream {rep.id} failed mid-stream ({kind})"))
                    await out.write_eof()
                except ConnectionError:
                    pass
                return out
        e2e = time.perf_counter() - t0
        ch.e2e.observe(e2e)
        ch.codes["2xx" if done or events else "error"].inc()
        route.tpot_s = (e2e - ttft) / (events - 1) if ttft is not None and events > 1 else None
        route.outcome = Outcome(True, ttft, e2e, events if tokens else 0)
        try:
            await out.write_eof(chunk)  # the last chunk, or b"" when the replica's end came alone
        except ConnectionError as exc:
            raise _ClientGone() from exc
        return out

    # --- vLLM's other client endpoints (router.endpoints) ---------------------------------------

    async def endpoint(self, request: web.Request) -> web.StreamResponse:
        """Embeddings, responses, tokenizer, score, rerank, pooling, audio: routed by model and load like
        generation (the same view, policy, late binding and retries), no TTFT recorded."""
        t0 = time.perf_counter()
        ep = ENDPOINTS.get(request.path)
        if ep is None:
            return error_response(404, f"unknown path {request.path[:200]!r}", code="not_found")
        if self.draining:
            return error_response(503, "router is shutting down", "server_error", code="draining",
                                  headers={"Connection": "close"})
        try:
            raw = await self.read_body(request)
            parsed = read(ep, raw, request.headers.get("Content-Type", ""), self.replicas,
                          self.settings.max_tokens_limit)
        except BadRequest as exc:
            return refuse(exc.response(), request)
        info = self.router.endpoint_info(parsed, request.headers)
        headers = request_headers(request.headers, request.remote)
        out = self.router.first(info) if ep.engine else self.router.decide(info)  # the tokenizer is never held
        first = (out, None) if type(out) is Route else out
        self.inflight += 1
        return await self._run(AiohttpRequest(request, raw), raw, info, headers, parsed.stream, t0, ep.path, first)

    def read_body(self, request: web.Request) -> Awaitable[bytes]:
        """An aiohttp request's whole body within max_body_bytes and body_timeout_s, or BadRequest."""
        return read_body(request, self.settings.max_body_bytes, self.settings.body_timeout_s)
