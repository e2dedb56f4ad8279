"""aiohttp's connection handler under the listener's guards (router.http.listener): a head within header_timeout_s
(slow-loris) and max_header_bytes (else a 431), connections admitted by the listener's ClientConnections (refused
with a 503, or a probe slot that answers /health and /ready only), idle ones reported so that they can be closed to
make room, and malformed HTTP answered with a 400 in the OpenAI error shape and one log line (aiohttp logs a
traceback and answers in plain text). It overrides public methods of `web.RequestHandler` only; where requests begin
and end it reads itself (router.http.framing).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http import HttpProcessingError

from routewise_vllm.router.errors import error_body, error_response
from routewise_vllm.router.http.connections import (ADMITTED, GLOBAL_CAP, PER_CLIENT_CAP, PROBE, PROBE_HEADER_TIMEOUT_S,
                                                    PROBE_PATHS, PROBE_SLOTS, head_too_large, peer_address)
from routewise_vllm.router.http.framing import RequestFraming
from routewise_vllm.router.logsafe import safe

if TYPE_CHECKING:
    from routewise_vllm.router.http.listener import Listener

log = logging.getLogger("router.listener")

LINGER_S = 1.0  # after a refusal or a 431: how long what the client still sends is read and dropped


def _raw(status: int, reason: str, body: bytes) -> bytes:
    """A whole response, written before (or instead of) aiohttp's handling of the connection."""
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
            % (status, reason.encode(), len(body)) + body)


def _too_many(reason: str) -> bytes:
    who = "from this address" if reason == PER_CLIENT_CAP else "to the router"
    return error_body(f"too many client connections {who}", "server_error", code="too_many_connections")


def _probe_request(line: bytes) -> bool:
    """Whether a request line asks for /health or /ready (GET or HEAD): what a probe slot answers."""
    method, _, rest = line.partition(b" ")
    path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
    return method in (b"GET", b"HEAD") and path.decode("latin-1") in PROBE_PATHS


class GuardedHandler(web.RequestHandler):
    """aiohttp's connection handler under the listener's guards (the module's docstring). It overrides public methods
    only (the asyncio protocol's, finish_response, handle_error, log_exception) and reads the connection's state
    from its own RequestFraming."""

    __slots__ = ("_listener", "_conns", "_admission", "_address", "_probe", "_header_timeout", "_max_head",
                 "_head_timer", "_framing", "_dropping", "_refused")

    def __init__(self, listener: Listener, admission: str | None = None) -> None:
        super().__init__(listener.aiohttp_server, loop=asyncio.get_running_loop(), **listener.handler_kwargs)
        self._listener = listener
        self._conns = listener.conns
        self._admission = admission  # decided by the lean listener before it handed the connection over
        self._address: str | None = None
        self._probe = False
        self._header_timeout = listener.config.header_timeout_s
        self._max_head = listener.config.max_header_bytes
        self._head_timer: asyncio.TimerHandle | None = None
        self._framing = RequestFraming()
        self._dropping = False  # what arrives is dropped (a refusal, a 431, a probe slot's rest)
        self._refused = False  # never handed to aiohttp

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._address = address = peer_address(transport)
        verdict = self._admission or self._conns.admit(address)
        if verdict not in (ADMITTED, PROBE):
            self._refused = self._dropping = True
            self._answer_and_close(transport, _raw(503, "Service Unavailable", _too_many(verdict)))  # type: ignore
            return
        self._conns.register(self, address, probe=verdict == PROBE)
        if verdict == PROBE:
            self._probe = True
            self._header_timeout = min(self._header_timeout, PROBE_HEADER_TIMEOUT_S)
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._dropping or not data:
            return
        self._conns.busy(self)
        framing = self._framing
        if framing.lost:
            super().data_received(data)
            return
        # Measured here: aiohttp's parser bounds a line (max_field_size) and the header count, not the head. A head
        # that begins with every earlier request answered is measured whole; one pipelined behind an unanswered
        # request meets aiohttp's own limits, answered 431 as well (handle_error).
        under_way = framing.head_bytes
        if (under_way + len(data) > self._max_head and (under_way and framing.measured or framing.between)
                and self._head_over(data)):
            return
        heads = framing.heads
        framing.feed(data)
        if self._probe and framing.heads:
            if not _probe_request(framing.first_line):
                self._dropping = True
                self._conns.refused(GLOBAL_CAP, self._address)
                self._disarm()
                self._answer_and_close(self.transport, _raw(503, "Service Unavailable", _too_many(GLOBAL_CAP)))
                return
            self._dropping = True  # one request on a probe slot: the rest is not read
        super().data_received(data)
        if framing.heads != heads:
            self._disarm()
        if framing.head_bytes and framing.measured:  # a head under way, not behind an unanswered request
            self._arm()

    def _head_over(self, data: bytes) -> bool:
        """Whether the head under way is over max_header_bytes (then answered with a 431 and closed)."""
        end = self._framing.head_end(data)
        if end >= 0 and self._framing.head_bytes + end <= self._max_head:
            return False
        log.info("refusing a request head over %d bytes from %s", self._max_head, self._address)
        self._disarm()
        self._dropping = True  # no request is read from it
        if self.transport is not None:
            body = head_too_large(self._max_head).response().body
            self._answer_and_close(self.transport, _raw(431, "Request Header Fields Too Large", body))  # type: ignore
        return True

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        if self._probe:
            resp.force_close()
        resp, reset = await super().finish_response(request, resp, start_time)
        framing = self._framing
        framing.answered += 1
        if not reset and resp.keep_alive and framing.between:
            self._conns.idle(self)  # waits for the next request: closable to make room
        return resp, reset

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = asyncio.get_running_loop().call_later(self._header_timeout, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        framing = self._framing
        if not framing.unanswered and not framing.lost and self.transport is not None:
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

        asyncio.get_running_loop().call_later(LINGER_S, close)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._refused:
            return
        self._conns.release(self)
        super().connection_lost(exc)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, (web.RequestPayloadError, HttpProcessingError)):  # the rest of a bad body, after our 400
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
        elif isinstance(exc, HttpProcessingError) and (  # a pipelined head: a line too long, or too many
                exc.args[1:2] == (self._max_head,) or "Too many headers" in exc.message):
            log.info("refusing a request head over %d bytes (or too many headers) from %s", self._max_head,
                     request.remote)
            resp = head_too_large(self._max_head).response()
        else:  # malformed HTTP: one line, no traceback (any client can send it)
            text = " ".join((message or str(exc or "") or "bad request").split())[:300]
            log.info("bad HTTP request from %s: %s", request.remote, safe(text))
            resp = error_response(status, f"malformed HTTP request: {text}", code="bad_http_request")
        resp.force_close()
        return resp
