"""The client side of the listener: what aiohttp does not bound or shape by itself.

- `RouterRunner` (use it instead of `web.AppRunner`) makes every connection a `GuardedHandler`:
  request line and headers must arrive within header_timeout_s (slow-loris), at most
  max_client_connections are open at once (more get a 503 and are closed), and malformed HTTP gets a
  400 in the OpenAI error shape with one log line (aiohttp logs a traceback and answers in plain text).
- With a Proxy given and settings.lean_listener on, every connection starts on the lean listener
  (router.lean: the generation endpoints without aiohttp's server side) and is handed to a GuardedHandler
  at its first request that is not a plain generation request.
- `openai_errors` (a middleware) turns aiohttp's own HTTP errors (404, 405, 413, ...) into the same shape.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from router.errors import error_body, error_response
from router.lean import LeanConnection
from router.settings import RouterSettings

if TYPE_CHECKING:
    from router.proxy import Proxy

log = logging.getLogger("router.listener")

_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n")


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
    __slots__ = ("_limits", "_head_timer")

    def __init__(self, manager: web.Server, *, limits: tuple[float, int], **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits  # (header_timeout_s, max_client_connections)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if len(self._manager.connections) >= self._limits[1]:  # type: ignore[union-attr]
            body = error_body("too many client connections", "server_error", code="too_many_connections")
            transport.write(_REFUSED % len(body) + body)  # type: ignore[attr-defined]
            transport.close()
            self._manager = None  # connection_lost then has nothing to undo
            return
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self._loop.call_later(self._limits[0], self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self._request_in_progress and not self._messages and self.transport is not None:
            log.info("closing a connection that sent no complete request head in %g s", self._limits[0])
            self.force_close()  # closes the transport

    def data_received(self, data: bytes) -> None:
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:  # a request head was parsed
            self._disarm()
        elif not self._request_in_progress and not self._messages:  # the start of the next head
            self._arm()

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
        else:  # malformed HTTP: one line, no traceback (any client can send it)
            text = " ".join((message or str(exc or "") or "bad request").split())[:300]
            log.info("bad HTTP request from %s: %s", request.remote, text)
            resp = error_response(status, f"malformed HTTP request: {text}", code="bad_http_request")
        resp.force_close()
        return resp


class GuardedServer(web.Server):
    def __init__(self, *args: Any, limits: tuple[float, int], lean: tuple[Proxy, RouterSettings] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._lean = lean

    def guarded(self) -> RequestHandler:
        return GuardedHandler(self, loop=self._loop, limits=self._limits, **self._kwargs)

    def __call__(self) -> asyncio.Protocol:
        if self._lean is None:
            return self.guarded()
        proxy, s = self._lean
        return LeanConnection(self, proxy.generate, (s.header_timeout_s, s.body_timeout_s, s.keepalive_timeout_s,
                                            s.max_client_connections), self.guarded, s.max_body_bytes)


class RouterRunner(web.AppRunner):
    """An AppRunner whose connections are GuardedHandlers, limited by the settings' header_timeout_s and
    max_client_connections; with `proxy` (and settings.lean_listener on, settings.access_log off: the lean
    listener writes no access log) they start on the lean listener."""

    def __init__(self, app: web.Application, *, settings: RouterSettings, proxy: Proxy | None = None,
                 **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._limits = (settings.header_timeout_s, settings.max_client_connections)
        self._lean = (proxy, settings) if proxy is not None and settings.lean_listener and not settings.access_log else None

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        guarded = GuardedServer(server.request_handler, request_factory=server.request_factory,
                                handler_cancellation=server.handler_cancellation, loop=server._loop,
                                limits=self._limits, lean=self._lean, **server._kwargs)
        return guarded
