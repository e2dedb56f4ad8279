"""The client side of the listener: what aiohttp does not bound or shape by itself.

- `RouterRunner` (use it instead of `web.AppRunner`) makes every connection a `GuardedHandler`:
  request line and headers must arrive within header_timeout_s (slow-loris) and fit in max_header_bytes (else a
  431), connections are admitted by the listener's `ClientConnections` (router.http.connections: a cap derived from
  the open-file limit, a per-client cap, idle ones closed first, probe slots for /health and /ready at the cap),
  and malformed HTTP gets a 400 in the OpenAI error shape with one log line (aiohttp logs a traceback and
  answers in plain text).
- With a Proxy given and settings.lean_listener on, every connection starts on the lean listener
  (router.http.server: the generation endpoints without aiohttp's server side) and is handed to a GuardedHandler
  at its first request that is not a plain generation request.
- `openai_errors` (a middleware) turns aiohttp's own HTTP errors (404, 405, 413, ...) into the same shape.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from routewise_vllm.router.http.connections import (ADMITTED, GLOBAL_CAP, OPS_CAP, PER_CLIENT_CAP, PROBE, PROBE_HEADER_TIMEOUT_S,
                                PROBE_PATHS, PROBE_SLOTS, ClientConnections, connection_caps, head_too_large,
                                peer_address, raise_open_file_limit)
from routewise_vllm.router.errors import error_body, error_response
from routewise_vllm.router.http.server import LeanConnection
from routewise_vllm.router.logsafe import safe
from routewise_vllm.router.settings import RouterSettings

if TYPE_CHECKING:
    from routewise_vllm.router.proxy import Proxy
    from routewise_vllm.router.telemetry import RouterMetrics

log = logging.getLogger("router.listener")

LINGER_S = 1.0  # after a refusal or a 431: how long what the client still sends is read and dropped


def _raw(status: int, reason: str, body: bytes) -> bytes:
    """A whole response, written before (or instead of) aiohttp's handling of the connection."""
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
            % (status, reason.encode(), len(body)) + body)


def _too_many(reason: str) -> bytes:
    who = "from this address" if reason == PER_CLIENT_CAP else "to the router"
    return error_body(f"too many client connections {who}", "server_error", code="too_many_connections")


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "www-authenticate")}
        return error_response(exc.status, exc.reason if exc.status != 404 else f"unknown path {request.path[:200]!r}",
                              code=code, headers=headers or None)


class GuardedHandler(RequestHandler):
    __slots__ = ("_conns", "_admission", "_header_timeout", "_max_head", "_head_timer", "_head_bytes", "_head_tail")

    def __init__(self, manager: GuardedServer, *, admission: str | None = None, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._conns = manager.conns
        self._admission = admission  # decided by the lean listener before it handed the connection over
        self._header_timeout = manager.header_timeout
        self._max_head = manager.max_header_bytes
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # of the request head being received (when at a head's start)
        self._head_tail = b""  # its last 3 bytes: the blank line may straddle two reads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        address = peer_address(transport)
        verdict = self._admission or self._conns.admit(address)
        if verdict not in (ADMITTED, PROBE):
            self._manager = None  # connection_lost then has nothing to undo
            self._close = True  # what arrives is dropped
            self._answer_and_close(transport, _raw(503, "Service Unavailable", _too_many(verdict)))  # type: ignore
            return
        self._conns.register(self, address, probe=verdict == PROBE)
        if verdict == PROBE:
            self._header_timeout = min(self._header_timeout, PROBE_HEADER_TIMEOUT_S)
            self._request_handler = functools.partial(self._probes_only, self._request_handler)
        super().connection_made(transport)
        self._arm()

    async def _probes_only(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
                           request: web.BaseRequest) -> web.StreamResponse:
        """A probe slot's one request: /health and /ready answered, anything else a 503."""
        if request.method in ("GET", "HEAD") and request.path in PROBE_PATHS:
            resp = await handler(request)
        else:
            self._conns.refused(GLOBAL_CAP, request.remote)
            resp = web.Response(status=503, body=_too_many(GLOBAL_CAP), content_type="application/json")
        resp.force_close()
        return resp

    async def _handle_request(self, request: Any, start_time: Any, request_handler: Any) -> tuple[Any, bool]:
        resp, reset = await super()._handle_request(request, start_time, request_handler)
        if not reset and resp.keep_alive and not self._messages:
            self._conns.idle(self)  # waits for the next request: closable to make room
        return resp, reset

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self._loop.call_later(self._header_timeout, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self._request_in_progress and not self._messages and self.transport is not None:
            log.info("closing a connection that sent no complete request head in %g s", self._header_timeout)
            self.force_close()  # closes the transport

    def _answer_and_close(self, transport: asyncio.Transport, answer: bytes) -> None:
        """Writes `answer` and ends the connection. Closing at once would reset a connection whose client is still
        sending, and lose the answer: so what arrives is dropped until the client closes its side or LINGER_S
        pass, while at most PROBE_SLOTS connections linger (the rest are closed at once)."""
        transport.write(answer)
        lingering = self._conns.lingering
        if len(lingering) >= PROBE_SLOTS or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        lingering.add(transport)

        def close() -> None:
            lingering.discard(transport)
            transport.close()

        self._loop.call_later(LINGER_S, close)

    def data_received(self, data: bytes) -> None:
        if self._close or self._force_close:
            return
        # Measured here: aiohttp's parser bounds a line (max_field_size) and the header count, not the head. At a
        # head's start (the first request, or a kept-alive connection waiting for the next) the head is measured
        # whole; one pipelined behind a body meets aiohttp's own limits, answered 431 as well (handle_error).
        at_head = data and not self._messages and not self._request_in_progress and (
            self._request_count == 0 or (self._waiter is not None and not self._waiter.done()))
        if data:
            self._conns.busy(self)
            if at_head and self._head_bytes + len(data) > self._max_head and self._head_over(data):
                return
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:  # a request head was parsed
            self._head_bytes, self._head_tail = 0, b""
            self._disarm()
        else:
            if at_head:
                self._head_bytes += len(data)
                self._head_tail = (self._head_tail + data)[-3:]
            if not self._request_in_progress and not self._messages:  # the start of the next head
                self._arm()

    def _head_over(self, data: bytes) -> bool:
        """Whether the head being received is over max_header_bytes (then answered with a 431 and closed)."""
        window = self._head_tail + data
        end = window.find(b"\r\n\r\n")
        if end >= 0 and self._head_bytes - len(self._head_tail) + end + 4 <= self._max_head:
            return False
        log.info("refusing a request head over %d bytes from %s", self._max_head, self.peername)
        self._disarm()
        self._close = True  # no request is read from it
        if self.transport is not None:
            body = head_too_large(self._max_head).response().body
            self._answer_and_close(self.transport, _raw(431, "Request Header Fields Too Large", body))  # type: ignore
        return True

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, (RequestPayloadError, HttpProcessingError)):  # the rest of a bad body, after our 400
            log.debug("discarding the rest of a malformed request body: %s", exc)
            return
        super().log_exception(*args, **kw)

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("response already started")
        if status >= 500:
            log.error("error handling %s %s: %r", request.method, request.path[:200], exc, exc_info=exc)
            resp = error_response(status, "internal router error", "server_error")
        elif (isinstance(exc, LineTooLong) and exc.args[1:2] == (self._max_head,)) or (
                isinstance(exc, BadHttpMessage) and "Too many headers" in exc.message):  # a pipelined head
            log.info("refusing a request head over %d bytes (or too many headers) from %s", self._max_head,
                     request.remote)
            resp = head_too_large(self._max_head).response()
        else:  # malformed HTTP: one line, no traceback (any client can send it)
            text = " ".join((message or str(exc or "") or "bad request").split())[:300]
            log.info("bad HTTP request from %s: %s", request.remote, safe(text))
            resp = error_response(status, f"malformed HTTP request: {text}", code="bad_http_request")
        resp.force_close()
        return resp


class GuardedServer(web.Server):
    """aiohttp's Server with the listener's connection table (`conns`), shared by its lean and aiohttp
    connections, and the head limits."""

    def __init__(self, *args: Any, conns: ClientConnections, settings: RouterSettings,
                 lean: Proxy | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conns = conns
        self.header_timeout = settings.header_timeout_s
        self.max_header_bytes = settings.max_header_bytes
        self._settings = settings
        self._lean = lean

    def guarded(self, admission: str | None = None) -> RequestHandler:
        return GuardedHandler(self, admission=admission, loop=self._loop, **self._kwargs)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        self.conns.release(handler)
        super().connection_lost(handler, exc)

    def __call__(self) -> asyncio.Protocol:
        if self._lean is None:
            return self.guarded()
        s = self._settings
        return LeanConnection(self, self._lean.generate, (s.header_timeout_s, s.body_timeout_s, s.keepalive_timeout_s),
                              self.guarded, s.max_body_bytes)


class RouterRunner(web.AppRunner):
    """An AppRunner whose connections are GuardedHandlers, limited by the settings' header_timeout_s,
    max_header_bytes and connection caps; with `proxy` (and settings.lean_listener on, settings.access_log off:
    the lean listener writes no access log) they start on the lean listener. Its construction raises the soft
    open-file limit to the hard one and derives the caps from it (router.http.connections); without a proxy (the ops
    listener) the cap is OPS_CAP. Refusals are counted in `metrics` (default: the proxy's)."""

    def __init__(self, app: web.Application, *, settings: RouterSettings, proxy: Proxy | None = None,
                 metrics: RouterMetrics | None = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        before, nofile = raise_open_file_limit()
        cap, per_client = connection_caps(settings, nofile)
        if proxy is None:
            cap, per_client = min(cap, OPS_CAP), min(per_client, OPS_CAP)
        else:
            log.info("open-file limit %d%s: up to %d client connections, %d per client address", nofile,
                     f" (raised from {before})" if nofile > before else "", cap, per_client)
        metrics = metrics if metrics is not None or proxy is None else proxy.metrics
        self.conns = ClientConnections(
            cap, per_client, name="client" if proxy is not None else "ops listener",
            refused=None if metrics is None else metrics.connections_refused,
            idle_closed=None if metrics is None else metrics.idle_connections_closed)
        self._settings = settings
        self._lean = proxy if proxy is not None and settings.lean_listener and not settings.access_log else None

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        guarded = GuardedServer(server.request_handler, request_factory=server.request_factory,
                                handler_cancellation=server.handler_cancellation, loop=server._loop,
                                conns=self.conns, settings=self._settings, lean=self._lean, **server._kwargs)
        return guarded
