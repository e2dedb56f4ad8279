"""A lean keep-alive HTTP/1.1 client for the proxy's hot path (plain-http replicas only).

One long module because a connection's protocol callbacks, its response parser and its body are one state machine:
split apart, each part would reach into the others' state on every chunk.

`aiohttp.ClientSession.post` builds a ClientRequest, payload, cookie set, timer and tasks per call, and its
response protocol a parser, payload and StreamReader per response. This pool writes the request bytes itself and
reads the response with `H1Connection`: the status line and headers, then a body delimited by Content-Length,
chunked encoding or the connection's end, fed to a `Body` that reads like aiohttp's StreamReader (`readany`,
`read_nowait`, `read`, `at_eof`, `is_eof`). Failures raise aiohttp's own exceptions (ServerDisconnectedError,
ClientPayloadError, ServerTimeoutError for the per-read idle timeout), so `upstream.classify` and the proxy's
error handling are unchanged. An answer that is not well-formed raises MalformedResponse (kind `malformed`) and
nothing of it is handed on: a status outside 200-599 other than an interim 100 or 103 (at most MAX_INTERIM of
those), a head over MAX_HEAD_BYTES or MAX_RESPONSE_HEADERS lines, a header name that is not a token, a value or
reason holding a control byte (CR, LF and NUL included: relayed, they would split the client's answer), a
Content-Length that is not one run of ASCII digits or comes twice, a Transfer-Encoding other than `chunked` or one
beside a Content-Length, a chunk size that is not hex digits. The head is due within the read timeout of the
request, in total: interim heads do not extend it.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Iterable

import aiohttp
from multidict import CIMultiDict
from yarl import URL

try:  # the chunked-body loop's and the head's common case in C (router/http/fasthttp_c); without a C compiler, Python alone
    from routewise_vllm.router.http._fasthttp import response_head, scan_chunks
except ImportError:
    response_head = scan_chunks = None

KEEPALIVE_S = 15.0  # idle connections older than this are closed, as aiohttp's connector does
MAX_HEAD_BYTES = 65536  # of one head, and of a chunked body's trailer section
MAX_RESPONSE_HEADERS = 100  # header lines of one head (vLLM sends about five)
MAX_INTERIM = 8  # 100 Continue and 103 Early Hints heads before the final one
MALFORMED_REASONS = {  # the reason label of a malformed answer, and what the client's 502 says of it
    "status": "a status outside 200-599, other than an interim 100 or 103",
    "interim": f"more than {MAX_INTERIM} interim heads",
    "header": "a header line that is not a token, a colon and a value free of control bytes",
    "head_too_large": f"a head over {MAX_HEAD_BYTES} bytes",
    "too_many_headers": f"more than {MAX_RESPONSE_HEADERS} header lines",
    "content_length": "a Content-Length that is not one run of ASCII digits, or more than one",
    "transfer_encoding": "a Transfer-Encoding other than chunked, or one beside a Content-Length",
    "chunk": "chunked framing that is not well-formed",
    "other": "an answer that could not be read",
}
_TOKEN_BYTES = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_TEXT_BYTES = bytes([0x09, *range(0x20, 0x7f), *range(0x80, 0x100)])  # a value or reason: no control byte
_HEX_BYTES = b"0123456789abcdefABCDEF"
HIGH_WATER = 1 << 18  # bytes of body waiting to be read above which the replica's connection stops being read


class UpstreamConnectError(aiohttp.ClientConnectionError):
    """The TCP connection to the replica could not be opened (classified as `connect`)."""


class MalformedResponse(aiohttp.ClientError):
    """The replica's answer is not well-formed HTTP/1.x (classified as `malformed`); `reason` is a key of
    MALFORMED_REASONS, a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ReaderTimeoutError(aiohttp.ServerTimeoutError):
    """The router did not take a paused response's data within the read timeout: its reader (say, a client that
    stopped reading a stream) is to blame, not the replica."""


class Body:
    """One response body as it arrives: the part of aiohttp's StreamReader the proxy reads. As there, a failure
    is raised by the next read even if data is waiting (the stream is broken either way)."""

    __slots__ = ("_conn", "_chunks", "_size", "_eof", "_exc", "_waiter")

    def __init__(self, conn: H1Connection) -> None:
        self._conn = conn
        self._chunks: list[bytes] = []
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def end(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        if not self._eof:
            self._exc = exc
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _take(self) -> bytes:
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks = []
        self._size = 0
        self._conn.resume()
        return data

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def readany(self) -> bytes:
        """What has arrived (waits for something), b"" at the end."""
        while True:
            if self._exc is not None:
                raise self._exc
            if self._chunks:
                return self._take()
            if self._eof:
                return b""
            await self._wait()

    def read_nowait(self) -> bytes:
        if self._exc is not None:
            raise self._exc
        return self._take() if self._chunks else b""

    async def read(self) -> bytes:
        """The whole body. Each piece is taken as it arrives, so a paused connection resumes (a body above
        HIGH_WATER read by waiting for its end with the data left in the buffer would pause for ever)."""
        parts: list[bytes] = []
        while True:
            if self._exc is not None:
                raise self._exc
            if self._chunks:
                parts.append(self._take())
            if self._eof:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await self._wait()

    def is_eof(self) -> bool:
        return self._eof

    def at_eof(self) -> bool:
        return self._eof and not self._chunks


_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_CLOSE, _IDLE = range(8)


class H1Connection(asyncio.Protocol):
    """One keep-alive connection to a replica and the response being read on it (one at a time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.should_close = False
        self._state = _IDLE
        self._buf = bytearray()
        self._left = 0  # body bytes still due: of the Content-Length, or of the current chunk
        self._head: asyncio.Future | None = None
        self._body: Body | None = None
        self._read_timeout: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._paused = False
        self._interim = 0  # interim heads of the response being read

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._state == _IDLE:  # nothing was asked: a replica that talks out of turn is not reused
            self.should_close = True
            return
        self._buf += data
        if self._state != _HEAD:  # the head's deadline runs from the request: interim heads do not move it
            self._arm()
        try:
            self._parse()
        except MalformedResponse as exc:
            self._fail(exc)
        except Exception as exc:  # noqa: BLE001 - nothing may escape a protocol callback: the request fails instead
            self._fail(MalformedResponse("other", f"unreadable answer: {type(exc).__name__}: {exc}"))

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self.should_close = True
        self._disarm()
        if self._state == _UNTIL_CLOSE:
            self._finish()
        elif self._state == _HEAD:
            self._fail(aiohttp.ServerDisconnectedError())
        elif self._state != _IDLE:
            self._fail(aiohttp.ClientPayloadError("Response payload is not completed"))

    # --- what the pool and Body call ------------------------------------------------------------

    def is_connected(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def request(self, data: bytes, read_timeout: float | None) -> asyncio.Future:
        """Sends a request; the future resolves to (status, headers, Body) once the final head has arrived."""
        self._state = _HEAD
        self._buf.clear()
        self._interim = 0
        self._read_timeout = read_timeout
        self._head = self.loop.create_future()
        self.transport.write(data)  # type: ignore[union-attr]
        self._arm()
        return self._head

    def close(self) -> None:
        self.should_close = True
        self._disarm()
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        """Stops reading the replica while the router holds HIGH_WATER bytes it has not taken. The read timer
        stays armed: no byte arrives while paused, so the deadline the last arrival set (the moment of the pause)
        becomes the reader's, who must take within read_timeout (`resume` then restarts it for the replica). A
        reader that never takes is cut with ServerTimeoutError; the timer is never off while data is unread."""
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
            if self._state != _IDLE:
                self._arm()

    # --- the response ---------------------------------------------------------------------------

    def _arm(self) -> None:
        """The replica must send something within read_timeout of now. One timer per connection, not per read or
        response: a read or a new request only moves the deadline, and the timer, when it fires early, waits out
        the rest; one that fires between responses finds nothing due and is dropped (a timer made and cancelled
        per response was a measurable share of a proxied request's CPU)."""
        if self._read_timeout is not None:
            self._deadline = self.loop.time() + self._read_timeout
            if self._timer is None:
                self._timer = self.loop.call_at(self._deadline, self._check_deadline)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_deadline(self) -> None:
        self._timer = None
        if self._state == _IDLE:
            return
        if self.loop.time() < self._deadline:
            self._timer = self.loop.call_at(self._deadline, self._check_deadline)
            return
        self._fail(ReaderTimeoutError(f"response body not taken by the router within {self._read_timeout:g} s")
                   if self._paused else aiohttp.ServerTimeoutError("Timeout on reading data from socket"))

    def _fail(self, exc: BaseException) -> None:
        state, self._state = self._state, _IDLE
        self.should_close = True
        self._disarm()
        if state == _HEAD and self._head is not None and not self._head.done():
            self._head.set_exception(exc)
        elif self._body is not None:
            self._body.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def _finish(self) -> None:
        self._state = _IDLE  # the timer stays for the next response (`_arm`)
        if self._buf:  # bytes beyond the response: the connection is out of step
            self.should_close = True
        if self._body is not None:
            self._body.end()
            self._body = None

    def _parse(self) -> None:
        buf = self._buf
        while True:
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
                if end < 0:
                    if len(buf) >= MAX_HEAD_BYTES + 4:
                        raise MalformedResponse("head_too_large", f"response head over {MAX_HEAD_BYTES} bytes")
                    return
                head = bytes(buf[:end])
                del buf[:end + 4]
                self._start_body(head)
            elif state == _LENGTH:
                if not buf:
                    return
                n = min(self._left, len(buf))
                self._body.feed(bytes(buf[:n]))  # type: ignore[union-attr]
                del buf[:n]
                self._left -= n
                if self._left == 0:
                    self._finish()
            elif state in (_CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END):
                if not self._chunks():
                    return
            elif state == _TRAILER:  # _left counts the trailer section's bytes
                end = buf.find(b"\r\n")
                if (len(buf) if end < 0 else end + 2) + self._left > MAX_HEAD_BYTES:
                    raise MalformedResponse("chunk", f"trailer section over {MAX_HEAD_BYTES} bytes")
                if end < 0:
                    return
                self._left += end + 2
                del buf[:end + 2]
                if end == 0:
                    self._finish()
            elif state == _UNTIL_CLOSE:
                if buf:
                    self._body.feed(bytes(buf))  # type: ignore[union-attr]
                    buf.clear()
                return
            else:
                return

    def _chunks(self) -> bool:
        """Decodes the chunks that have arrived, fed to the body as one piece; False while more bytes are due.
        It reads a bytes copy of the buffer, whose slices are the data. At each size line, `scan_chunks` (C) takes
        the complete chunks of the canonical form that follow; this loop decodes the rest, and defines every case."""
        buf, pos, state, left = self._buf, 0, self._state, self._left
        data = bytes(buf)
        n = len(data)
        out: list[bytes] = []
        scan = scan_chunks  # None: the Python loop alone (tests compare the two)
        try:
            while True:
                if scan is not None and state == _CHUNK_SIZE:
                    pos, piece = scan(data, pos)
                    if piece:
                        out.append(piece)
                if state == _CHUNK_DATA:
                    end = pos + left
                    if end > n:  # the chunk's rest is due
                        if pos < n:
                            out.append(data[pos:])
                            left, pos = end - n, n
                        return False
                    out.append(data[pos:end])
                    pos, left, state = end, 0, _CHUNK_END
                if state == _CHUNK_END:
                    if n - pos < 2:
                        return False
                    if not data.startswith(b"\r\n", pos):
                        raise MalformedResponse("chunk", "chunk not followed by CRLF")
                    pos += 2
                    state = _CHUNK_SIZE
                end = data.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > 1024:
                        raise MalformedResponse("chunk", "chunk size line too long")
                    return False
                # hex digits (a chunk extension after `;` ignored): not int()'s `0x`, sign, `_` or other digits
                size = data[pos:end].split(b";", 1)[0].strip(b" \t")
                if not 0 < len(size) <= 16 or size.translate(None, _HEX_BYTES):
                    raise MalformedResponse("chunk", f"bad chunk size {size[:20]!r}")
                left = int(size, 16)
                pos = end + 2
                if left == 0:
                    state = _TRAILER
                    return True
                state = _CHUNK_DATA
        finally:
            del buf[:pos]
            self._state, self._left = state, left
            if out:
                self._body.feed(out[0] if len(out) == 1 else b"".join(out))  # type: ignore[union-attr]

    def _start_body(self, head: bytes) -> None:
        fast = response_head(head) if response_head is not None else None
        if fast is None:
            status, http10, headers = parse_response_head(head)
        else:
            status, http10, pairs = fast
            headers = CIMultiDict(pairs)
        if status < 200:  # 100 or 103 (the parse refuses other 1xx): the final head follows (state stays _HEAD)
            self._interim += 1
            if self._interim > MAX_INTERIM:
                raise MalformedResponse("interim", f"more than {MAX_INTERIM} interim ({status}) heads")
            return
        length = body_length(status, headers)
        conn = headers.get("Connection", "").lower()
        if http10 and "keep-alive" not in conn or "close" in conn:
            self.should_close = True
        body = self._body = Body(self)
        if length is None:
            self._state = _UNTIL_CLOSE
            self.should_close = True
        elif length < 0:
            self._state = _CHUNK_SIZE
        else:
            self._state, self._left = _LENGTH, length
        self._arm()  # the body's reads are timed from the head's arrival
        head_future, self._head = self._head, None
        if head_future is not None and not head_future.done():
            head_future.set_result((status, headers, body))
        if self._state == _LENGTH and self._left == 0:
            self._finish()


def parse_response_head(head: bytes) -> tuple[int, bool, CIMultiDict[str]]:
    """(status, HTTP/1.0, headers) of a response head without its blank line; raises MalformedResponse. The common
    case is read in C (router.http._fasthttp.response_head, when built); this defines every case."""
    lines = head.split(b"\r\n")
    if len(lines) > MAX_RESPONSE_HEADERS + 1:
        raise MalformedResponse("too_many_headers", f"more than {MAX_RESPONSE_HEADERS} header lines")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or len(parts[1]) != 3 or not parts[1].isdigit() \
            or len(parts) == 3 and parts[2].translate(None, _TEXT_BYTES):
        raise MalformedResponse("status", f"bad status line {lines[0][:60]!r}")
    status = int(parts[1])
    check_status(status)
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name.translate(None, _TOKEN_BYTES) or value.translate(None, _TEXT_BYTES):
            raise MalformedResponse("header", f"bad header line {line[:60]!r}")
        headers.add(name.decode("ascii"), value.strip(b" \t").decode("utf-8", "surrogateescape"))
    return status, parts[0] == b"HTTP/1.0", headers


def check_status(status: int) -> None:
    """A final status of 200-599, or an interim 100 Continue or 103 Early Hints (skipped, as vLLM's clients do);
    anything else (101 Switching Protocols too: the router asked for no upgrade) raises MalformedResponse."""
    if not (200 <= status <= 599 or status == 100 or status == 103):
        raise MalformedResponse("status", f"status {status} is not a final 200-599, nor 100 or 103")


def check_fields(fields: Iterable[tuple[bytes, bytes]]) -> None:
    """The header fields of a head another parser read (aiohttp's): at most MAX_RESPONSE_HEADERS of them and
    MAX_HEAD_BYTES in all, each name a token and each value free of control bytes, and framing as body_length
    takes it; raises MalformedResponse as this client's parse would."""
    size = 0
    te: list[str] = []
    cl: list[str] = []
    for i, (name, value) in enumerate(fields):
        size += len(name) + len(value) + 4
        if i >= MAX_RESPONSE_HEADERS:
            raise MalformedResponse("too_many_headers", f"more than {MAX_RESPONSE_HEADERS} header lines")
        if size > MAX_HEAD_BYTES:
            raise MalformedResponse("head_too_large", f"response head over {MAX_HEAD_BYTES} bytes")
        if not name or name.translate(None, _TOKEN_BYTES) or value.translate(None, _TEXT_BYTES):
            raise MalformedResponse("header", f"bad header line {name[:30]!r}: {value[:30]!r}")
        lname = name.lower()
        if lname == b"transfer-encoding":
            te.append(value.strip(b" \t").decode("latin-1"))
        elif lname == b"content-length":
            cl.append(value.strip(b" \t").decode("latin-1"))
    _check_framing(te or None, cl or None)


def _check_framing(te: list[str] | None, cl: list[str] | None) -> None:
    if te is not None:
        if cl is not None:
            raise MalformedResponse("transfer_encoding", "both Transfer-Encoding and Content-Length")
        if [c.strip().lower() for v in te for c in v.split(",")] != ["chunked"]:
            raise MalformedResponse("transfer_encoding", f"Transfer-Encoding {', '.join(te)[:40]!r}: only chunked "
                                    "is read")
    if cl is not None:
        if len(cl) > 1:
            raise MalformedResponse("content_length", f"{len(cl)} Content-Length headers")
        if not _digits(cl[0]):
            raise MalformedResponse("content_length", f"bad Content-Length {cl[0][:20]!r}")


def _digits(value: str) -> bool:
    """1 to 18 ASCII digits (str.isdigit alone takes '²' and other scripts' digits, which int() then refuses)."""
    return 0 < len(value) <= 18 and value.isascii() and value.isdigit()


def body_length(status: int, headers: CIMultiDict[str]) -> int | None:
    """How a final answer's body is framed: its length, -1 for chunked, None for until the connection's end.
    Raises MalformedResponse on framing a reader could take two ways (RFC 9112 6.3)."""
    te = headers.getall("Transfer-Encoding", None)
    cl = headers.getall("Content-Length", None)
    _check_framing(te, cl)
    if status in (204, 304):
        return 0
    if te is not None:
        return -1
    return None if cl is None else int(cl[0])


class ConnectionLimit:
    """At most `n` connections in use at once over every pool (aiohttp's TCPConnector(limit=)). `try_take` takes
    one without waiting (the synchronous send); `take` waits its turn, in order; `give` hands a slot straight to
    the longest waiter."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    def try_take(self) -> bool:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        return False

    async def take(self) -> None:
        if self.try_take():
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():  # handed a slot just as it was cancelled: pass it on
                self.give()
            raise

    def give(self) -> None:
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1


class H1Response:
    """Status, headers and the body stream of one upstream response; `release()` or `close()` it once."""

    __slots__ = ("status", "headers", "content", "_pool", "_proto")

    def __init__(self, status: int, headers: CIMultiDict[str], content: Body, pool: H1Pool,
                 proto: H1Connection) -> None:
        self.status = status
        self.headers = headers
        self.content = content
        self._pool = pool
        self._proto = proto

    async def read(self) -> bytes:
        return await self.content.read()

    def release(self) -> None:
        """Back to the pool if the body was read to its end and the replica keeps the connection."""
        proto, self._proto = self._proto, None
        if proto is not None:
            self._pool._put(proto, reusable=self.content.is_eof() and not proto.should_close)

    def close(self) -> None:
        """Drop the connection (the replica sees the disconnect)."""
        proto, self._proto = self._proto, None
        if proto is not None:
            self._pool._put(proto, reusable=False)


class H1Pool:
    """Keep-alive connections to one `host:port`; `limit` (shared by all pools, None = unlimited) bounds
    the connections in use at once, like aiohttp's TCPConnector(limit=)."""

    def __init__(self, host: str, port: int, host_header: str, *, limit: ConnectionLimit | None, connect_timeout_s: float | None,
                 read_timeout_s: float | None) -> None:
        self.host = host
        self.port = port
        self._host_header = host_header.encode("idna" if not host_header.isascii() else "ascii")
        self._idle: collections.deque[tuple[H1Connection, float]] = collections.deque()
        self._limit = limit
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s
        self.closed = False

    async def _connect(self) -> H1Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, proto = await loop.create_connection(lambda: H1Connection(loop), self.host, self.port)
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(f"connection to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return proto

    def _take_idle(self) -> H1Connection | None:
        now = time.monotonic()
        while self._idle:
            proto, since = self._idle.pop()
            if proto.is_connected() and now - since < KEEPALIVE_S and not proto.should_close:
                return proto
            proto.close()
        return None

    def _put(self, proto: H1Connection, reusable: bool) -> None:
        if reusable and not self.closed and proto.is_connected():
            self._idle.append((proto, time.monotonic()))
        else:
            proto.close()
        self._give()

    def _give(self) -> None:
        if self._limit is not None:
            self._limit.give()

    def _request(self, path: str, body: bytes, headers: CIMultiDict[str]) -> bytes:
        head = [b"POST ", path.encode("utf-8", "surrogateescape"), b" HTTP/1.1\r\nHost: ", self._host_header, b"\r\n"]
        accept = False
        for k, v in headers.items():
            accept = accept or k.lower() == "accept"
            head += (k.encode("utf-8", "surrogateescape"), b": ", v.encode("utf-8", "surrogateescape"), b"\r\n")
        if not accept:  # what aiohttp's client adds by default
            head.append(b"Accept: */*\r\n")
        head += (b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body)
        return b"".join(head)

    def send_now(self, path: str, body: bytes, headers: CIMultiDict[str]) -> Awaitable[H1Response] | None:
        """Sends the request now if a kept-alive connection is idle and the limit has room (the awaitable then
        gives the response as `post` does; await it once), else None and nothing is sent."""
        if self._limit is not None and not self._limit.try_take():
            return None
        proto = self._take_idle()
        if proto is None:
            self._give()
            return None
        return self._response(proto, self._send(proto, path, body, headers))

    async def post(self, path: str, body: bytes, headers: CIMultiDict[str]) -> H1Response:
        """Send the request and wait for the status line and headers. The body is read by the caller."""
        if self._limit is not None:
            await self._limit.take()
        try:
            proto = self._take_idle() or await self._connect()
        except BaseException:
            self._give()
            raise
        return await self._response(proto, self._send(proto, path, body, headers))

    def _send(self, proto: H1Connection, path: str, body: bytes, headers: CIMultiDict[str]) -> asyncio.Future:
        try:
            return proto.request(self._request(path, body, headers), self._read_timeout)
        except BaseException:
            self._drop(proto)
            raise

    def _drop(self, proto: H1Connection) -> None:
        proto.close()
        self._give()

    async def _response(self, proto: H1Connection, head: asyncio.Future) -> H1Response:
        try:
            status, rheaders, payload = await head
        except BaseException:
            self._drop(proto)
            raise
        return H1Response(status, rheaders, payload, self, proto)

    def close(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop()[0].close()


class H1Client:
    """One pool per replica origin; `limit` connections in use at once over all of them (0 = unlimited)."""

    def __init__(self, *, limit: int, connect_timeout_s: float | None, read_timeout_s: float | None) -> None:
        self._pools: dict[URL, H1Pool] = {}
        self._limit = ConnectionLimit(limit) if limit else None
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s

    def pool(self, origin: URL) -> H1Pool:
        """The pool of an http:// origin."""
        p = self._pools.get(origin)
        if p is None:
            p = self._pools[origin] = H1Pool(origin.raw_host, origin.port, origin.host_port_subcomponent,
                                             limit=self._limit, connect_timeout_s=self._connect_timeout,
                                             read_timeout_s=self._read_timeout)
        return p

    def close(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()
