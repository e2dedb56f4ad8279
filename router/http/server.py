"""The generation endpoints' server side without aiohttp: a plain asyncio protocol per client connection.

aiohttp's server side (its request parser, Request and StreamResponse objects, payload writer) cost about as
much CPU per proxied request as the router's own work. A connection starts here. Each request whose
head is plain, `POST /v1/completions` or `POST /v1/chat/completions` over HTTP/1.1 with a Content-Length body
within max_body_bytes, goes straight to the Proxy. The first request that is anything else (another path or
method, HTTP/1.0, a chunked, compressed or oversized body, Expect, Upgrade, a head this parser does not take for
plain) hands the connection, with every byte not yet consumed, to aiohttp's GuardedHandler for good, so every
unusual request keeps aiohttp's handling and error shapes. The proxy's start (parse, decide, and on an idle
kept-alive connection the send upstream) runs inside data_received; the request's task, which waits for the
answer, runs after it. Limits are the router's: header_timeout_s, max_header_bytes (a 431), body_timeout_s (a 408),
keepalive_timeout_s, the listener's connection caps (router.http.connections: a connection it does not admit as is goes to
aiohttp at once, which refuses it or serves it a probe slot); a client that disconnects cancels its request (as
aiohttp's handler_cancellation); the drain waits for a request in progress like aiohttp's does.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from http import HTTPStatus
from email.utils import formatdate
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from routewise_vllm.router.http.connections import ADMITTED, peer_address
from routewise_vllm.router.errors import BadRequest, error_response

try:  # the head's common case in C (router/http/fasthttp_c); without a C compiler, parse_plain alone
    from routewise_vllm.router.http._fasthttp import request_head
except ImportError:
    request_head = None

log = logging.getLogger("router.lean")

_PATHS = {b"/v1/completions": False, b"/v1/chat/completions": True}
# A header name is a token (RFC 9110); a value is tab and visible ASCII. Checked with bytes.translate, not a regex:
# on a router idle between requests the regex engine's code is cold (with the two regexes, parsing a head took
# 45 us at 50 req/s, 5.5 us in a loop).
_TOKEN_CHARS = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_VALUE_CHARS = bytes([0x09, *range(0x20, 0x7f)])
_HAND_OVER = frozenset({b"transfer-encoding", b"content-encoding", b"expect", b"upgrade"})
MAX_HEADERS = 100
# Response headers the lean writer sets itself.
_OWN = frozenset({"content-length", "transfer-encoding", "connection", "date", "server", "keep-alive"})
# Statuses whose answer has no body, no Content-Length and no Transfer-Encoding (RFC 9110 8.6, 6.4.1; as aiohttp).
_NO_BODY = frozenset({204, 304, *range(100, 200)})


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        except OSError:
            pass


class LeanHead:
    """A parsed plain request head."""

    __slots__ = ("chat", "headers", "content_length", "close")

    def __init__(self, chat: bool, headers: CIMultiDict[str], content_length: int, close: bool) -> None:
        self.chat = chat
        self.headers = headers
        self.content_length = content_length
        self.close = close


def parse_head(head: bytes) -> LeanHead | None:
    """The head (request line and header lines, without the blank line) of a plain generation request, or None
    for anything this parser leaves to aiohttp. The common case is read in C (router.http._fasthttp.request_head, when
    built); `parse_plain` defines every case."""
    fast = request_head(head) if request_head is not None else None
    if fast is not None:
        chat, pairs, length, close = fast
        return LeanHead(chat, CIMultiDict(pairs), length, close)
    return parse_plain(head)


def parse_plain(head: bytes) -> LeanHead | None:
    """parse_head in Python: the reference."""
    lines = head.split(b"\r\n")
    if len(lines) > MAX_HEADERS + 1:
        return None
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
        return None
    chat = _PATHS.get(parts[1])
    if chat is None:
        return None
    headers: CIMultiDict[str] = CIMultiDict()
    length: int | None = None
    close = False
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name.translate(None, _TOKEN_CHARS) or value.translate(None, _VALUE_CHARS):
            return None
        value = value.strip(b" \t")
        lname = name.lower()
        if lname in _HAND_OVER:
            return None
        if lname == b"content-length":
            if length is not None or not value.isdigit() or len(value) > 15:
                return None
            length = int(value)
        elif lname == b"connection":
            tokens = {t.strip() for t in value.lower().split(b",")}
            if b"upgrade" in tokens:
                return None
            close = close or b"close" in tokens
        headers.add(name.decode("ascii"), value.decode("ascii"))
    if length is None:
        return None
    return LeanHead(chat, headers, length, close)




@functools.lru_cache(maxsize=64)
def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


@functools.lru_cache(maxsize=1)
def _date_of(second: int) -> bytes:
    return formatdate(second, usegmt=True).encode()


def http_date() -> bytes:
    """The Date header's value, formatted once per second."""
    return _date_of(int(time.time()))


def _header_bytes(headers: Any) -> list[bytes]:
    """Header lines of a response, without those the lean writer sets itself."""
    return [b"%s: %s\r\n" % (k.encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape"))
            for k, v in headers.items() if k.lower() not in _OWN]


class LeanRequest:
    """What the Proxy reads of a request served here: its headers, the client's address and the whole body, and
    how to answer it (router.http.transport.Downstream)."""

    __slots__ = ("headers", "remote", "body", "_conn")

    def __init__(self, headers: CIMultiDict[str], remote: str | None, body: bytes, conn: LeanConnection) -> None:
        self.headers = headers
        self.remote = remote
        self.body = body
        self._conn = conn

    def respond(self, status: int, headers: Any, body: bytes) -> LeanSent:
        """A whole response, written now (the proxy's bookkeeping after it is off the client's wait). Raises
        ConnectionResetError when the client is gone."""
        self._conn.send(status, _reason(status), headers, body)
        return LeanSent(status)

    def stream(self, status: int, headers: Any) -> LeanStream:
        """A chunked response; its head goes out with the first write (one send, as aiohttp's writer does).
        Content-Type defaults as aiohttp's does; a status without a body gets its head alone."""
        conn = self._conn
        if conn.transport is None or conn.transport.is_closing():
            raise ConnectionResetError("client disconnected")
        if status in _NO_BODY:
            return _LeanHeadOnly(conn, b"".join([b"HTTP/1.1 %d %s\r\n" % (status, _reason(status)),
                                                 *_header_bytes(headers), b"Date: ", http_date(), _end(conn.close_after)]))
        return LeanStream(conn, b"".join([
            b"HTTP/1.1 %d %s\r\n" % (status, _reason(status)), *_header_bytes(headers),
            b"" if "Content-Type" in headers else b"Content-Type: application/octet-stream\r\n",
            b"Transfer-Encoding: chunked\r\nDate: ", http_date(), _end(conn.close_after)]))

    def refuse(self, resp: web.Response) -> web.Response:
        """The router's refusal, as is: the connection writes it (the body was read whole)."""
        return resp


def _end(close: bool) -> bytes:
    """The rest of the Date line and the head's end."""
    return b"\r\nConnection: close\r\n\r\n" if close else b"\r\n\r\n"


class LeanSent:
    """A whole response that `LeanRequest.respond` has written."""

    __slots__ = ("status",)

    def __init__(self, status: int) -> None:
        self.status = status


class LeanStream:
    """The body of a chunked response: `write` each chunk, then `write_eof` (with the last one, or none). Writes to
    a client that is gone raise ConnectionResetError (as aiohttp's StreamResponse does); a client that reads slowly
    is waited for."""

    __slots__ = ("_conn", "_head")

    def __init__(self, conn: LeanConnection, head: bytes) -> None:
        self._conn = conn
        self._head = head

    async def write(self, data: bytes) -> None:
        if data:
            head, self._head = self._head, b""
            self._conn.write(b"%s%x\r\n%s\r\n" % (head, len(data), data))
            await self._conn.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        head, self._head = self._head, b""
        self._conn.write(b"%s%x\r\n%s\r\n0\r\n\r\n" % (head, len(data), data) if data else head + b"0\r\n\r\n")
        await self._conn.drain()


class _LeanHeadOnly(LeanStream):
    """The answer of a status without a body (204, 304): its head, whatever is written."""

    __slots__ = ()

    async def write(self, data: bytes) -> None:
        pass

    async def write_eof(self, data: bytes = b"") -> None:
        head, self._head = self._head, b""
        self._conn.write(head)
        await self._conn.drain()


class LeanConnection(asyncio.Protocol):
    """One client connection: plain generation requests served here, one at a time in order; the rest of the
    connection handed to aiohttp (`hand_over`) at the first request that is not plain."""

    def __init__(self, listener: Any, generate: Callable[[LeanRequest, bool], Awaitable[web.StreamResponse]],
                 limits: tuple[float, float, float], aiohttp_handler: Callable[[str], asyncio.Protocol],
                 max_body: int) -> None:
        self._listener = listener  # router.http.listener.Listener: connections are registered there (drain, caps)
        self._conns = listener.conns  # the listener's ClientConnections
        self._max_head = listener.max_header_bytes
        self._admission = ADMITTED
        self._generate = generate  # Proxy.generate
        self._header_timeout, self._body_timeout, self._keepalive_timeout = limits
        self._aiohttp_handler = aiohttp_handler
        self._max_body = max_body
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._remote: str | None = None
        self._buf = bytearray()
        self._head: LeanHead | None = None
        self._need = 0  # bytes of buffer the current request occupies, head and body, once its head is parsed
        self._body_at = 0
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # when the timer runs
        self._timer_kind = ""  # what the connection waits for ("" nothing), until _deadline
        self._deadline = 0.0
        self._writable: asyncio.Future | None = None
        self._paused = False
        self._closing = False  # no further request is read (drain, Connection: close, error)
        self.close_after = False  # the request in progress asked for Connection: close

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._remote = peer_address(transport)
        self._admission = self._conns.admit(self._remote)
        if self._admission != ADMITTED:
            self.hand_over()  # aiohttp's GuardedHandler refuses it with the router's 503, or serves it a probe slot
            return
        self._conns.register(self, self._remote)
        _nodelay(transport)  # streamed events go out as written (as aiohttp's handler sets it)
        self._listener.opened(self)
        self._arm("head", self._header_timeout)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        self._conns.busy(self)
        if self._task is None:
            self._advance()
        elif not self._paused and len(self._buf) > self._max_head + self._max_body:  # pipelined beyond reason
            self._paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def eof_received(self) -> bool:
        return False  # close: a half-closed client gets no answer (as aiohttp)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_timer()
        self._closing = True
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)  # a writer waiting for room finds the transport gone
        if self._task is not None:
            # the proxy releases what the request held, in the task: cancelled before its first step, a task
            # never runs its coroutine, so the cancel waits for that step (FIFO), which is already scheduled
            self._loop.call_soon(self._task.cancel)
        else:
            self._listener.closed(self)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # --- what the listener calls on a drain ---------------------------------------------------------

    def close(self) -> None:
        """No further request on this connection; an idle one closes now."""
        self._closing = True
        if self._task is None and self.transport is not None:
            self.transport.close()

    async def shutdown(self, timeout: float | None) -> None:
        """Waits up to `timeout` for the request in progress, then cancels it and closes."""
        self._closing = True
        task = self._task
        if task is not None:
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
        if self.transport is not None:
            self.transport.close()

    # --- writing ---------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("client disconnected")
        t.write(data)

    async def drain(self) -> None:
        w = self._writable
        if w is not None and not w.done():
            await w
            t = self.transport
            if t is None or t.is_closing():
                raise ConnectionResetError("client disconnected")

    def _respond(self, resp: web.Response) -> None:
        body = resp.body if isinstance(resp.body, (bytes, bytearray)) else b""
        self.send(resp.status, resp.reason.encode("latin-1"), resp.headers, body)

    def send(self, status: int, reason: bytes, headers: Any, body: bytes) -> None:
        """A whole response with a Content-Length body (none for 204, 304, 1xx). Content-Type defaults to
        application/octet-stream on a body that is not empty (RFC 9110 8.3, as aiohttp)."""
        close = self.close_after or self._closing or "close" in headers.get("Connection", "").lower()
        parts = [b"HTTP/1.1 %d %s\r\n" % (status, reason), *_header_bytes(headers)]
        if status in _NO_BODY:
            body = b""
            parts.append(b"Date: ")
        else:
            if body and "Content-Type" not in headers:
                parts.append(b"Content-Type: application/octet-stream\r\n")
            parts.append(b"Content-Length: %d\r\nDate: " % len(body))
        parts += (http_date(), _end(close), body)
        self.write(b"".join(parts))
        self.close_after = close

    # --- requests ----------------------------------------------------------------------------------

    def _advance(self) -> None:
        """Starts the next request whose head and body have arrived; arms the timer for what is awaited."""
        if self._closing or self.transport is None:
            return
        if self._head is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0 and len(self._buf) <= self._max_head:
                if self._buf and self._timer_kind != "head":
                    self._arm("head", self._header_timeout)
                return
            if end < 0 or end + 4 > self._max_head:
                self.hand_over()  # the GuardedHandler answers it with a 431
                return
            head = parse_head(bytes(self._buf[:end]))
            if head is None or head.content_length > self._max_body:
                self.hand_over()
                return
            self._head, self._body_at = head, end + 4
            self._need = self._body_at + head.content_length
        if len(self._buf) < self._need:
            if self._timer_kind != "body":
                self._arm("body", self._body_timeout)
            return
        self._disarm()
        head, self._head = self._head, None
        body = bytes(self._buf[self._body_at:self._need])
        del self._buf[:self._need]
        self.close_after = head.close
        request = LeanRequest(head.headers, self._remote, body, self)
        try:
            answer: Awaitable[Any] | Exception = self._generate(request, head.chat)  # its start runs now
        except Exception as exc:
            answer = exc
        self._task = self._loop.create_task(self._serve(answer, head.chat))
        self._task.add_done_callback(self._served)

    async def _serve(self, answer: Awaitable[Any] | Exception, chat: bool) -> None:
        try:
            if isinstance(answer, Exception):
                raise answer
            resp = await answer
        except Exception as exc:  # a router bug: the client still gets an answer, as under aiohttp
            log.error("error handling POST %s: %r", "/v1/chat/completions" if chat else "/v1/completions", exc,
                      exc_info=exc)
            resp = error_response(500, "internal router error", "server_error")
            self.close_after = True
        if isinstance(resp, web.Response) and resp.status != 499:
            self._respond(resp)

    def _served(self, task: asyncio.Task) -> None:
        self._task = None
        if not task.cancelled() and task.exception() is not None:  # the answer could not be written
            self.close_after = True
        t = self.transport
        if t is None or t.is_closing():
            self._listener.closed(self)
            return
        if self.close_after or self._closing:
            t.close()
            return
        if self._paused:
            self._paused = False
            t.resume_reading()
        if self._buf:
            self._advance()
        else:
            self._arm("keepalive", self._keepalive_timeout)
            self._conns.idle(self)  # closable to make room at a connection cap

    # --- timers and the hand-over ---------------------------------------------------------------------

    def _arm(self, kind: str, delay: float) -> None:
        """What the connection waits for (`kind`) and its deadline. One timer per connection, not per request: it
        is replaced only when the new deadline comes before it; one that fires before the deadline waits out the
        rest, and one that finds nothing armed is dropped (a timer made and cancelled per request was a
        measurable share of a proxied request's CPU)."""
        deadline = self._loop.time() + delay
        if self._timer is None or deadline < self._timer_at:
            self._stop_timer()
            self._timer_at = deadline
            self._timer = self._loop.call_at(deadline, self._expired)
        self._timer_kind, self._deadline = kind, deadline

    def _disarm(self) -> None:
        self._timer_kind = ""

    def _stop_timer(self) -> None:
        self._timer_kind = ""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        kind = self._timer_kind
        if not kind:
            return
        if self._loop.time() < self._deadline:
            self._timer_at = self._deadline
            self._timer = self._loop.call_at(self._deadline, self._expired)
            return
        self._timer_kind = ""
        if self._task is not None or self.transport is None or self.transport.is_closing():
            return
        if kind == "body":
            exc = BadRequest(f"request body not received within {self._body_timeout:g} s", status=408,
                             code="request_timeout")
            self._closing = True
            self._respond(exc.response())
        elif kind == "head":
            log.info("closing a connection that sent no complete request head in %g s", self._header_timeout)
        self.transport.close()

    def hand_over(self) -> None:
        """The rest of this connection goes to aiohttp, starting with the bytes not yet consumed."""
        self._stop_timer()
        transport, self.transport = self.transport, None
        self._closing = True
        if transport is None:
            return
        self._listener.closed(self)  # the handler registers itself (a no-op if never registered)
        handler = self._aiohttp_handler(self._admission)
        transport.set_protocol(handler)  # type: ignore[attr-defined]
        handler.connection_made(transport)
        if self._buf and not transport.is_closing():
            data, self._buf = bytes(self._buf), bytearray()
            handler.data_received(data)
