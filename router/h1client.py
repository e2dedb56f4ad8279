"""A lean keep-alive HTTP/1.1 client for the proxy's hot path (plain-http replicas only).

`aiohttp.ClientSession.post` builds a ClientRequest, payload, cookie set, timer and tasks per
call: about 40% of the router's CPU per proxied request. This pool writes the request bytes
itself and reuses aiohttp's own response protocol (`ResponseHandler`: the C parser, chunked
decoding, the per-read idle timeout, the same ClientPayloadError/ServerDisconnectedError/
ServerTimeoutError exceptions), so `upstream.classify` and the proxy's error handling are unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import time

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.streams import StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

KEEPALIVE_S = 15.0  # idle connections older than this are closed, as aiohttp's connector does


class UpstreamConnectError(aiohttp.ClientConnectionError):
    """The TCP connection to the replica could not be opened (classified as `connect`)."""


class H1Response:
    """Status, headers and the body stream of one upstream response; `release()` or `close()` it once."""

    __slots__ = ("status", "headers", "content", "_pool", "_proto")

    def __init__(self, status: int, headers: CIMultiDictProxy[str], content: StreamReader,
                 pool: H1Pool, proto: ResponseHandler) -> None:
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

    def __init__(self, host: str, port: int, host_header: str, *, limit: asyncio.Semaphore | None, connect_timeout_s: float | None,
                 read_timeout_s: float | None) -> None:
        self.host = host
        self.port = port
        self._host_header = host_header.encode("idna" if not host_header.isascii() else "ascii")
        self._idle: collections.deque[tuple[ResponseHandler, float]] = collections.deque()
        self._sem = limit
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s
        self.closed = False

    async def _connect(self) -> ResponseHandler:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, proto = await loop.create_connection(lambda: ResponseHandler(loop), self.host, self.port)
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(f"connection to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return proto

    def _take_idle(self) -> ResponseHandler | None:
        now = time.monotonic()
        while self._idle:
            proto, since = self._idle.pop()
            if proto.is_connected() and now - since < KEEPALIVE_S and not proto.should_close:
                return proto
            proto.close()
        return None

    def _put(self, proto: ResponseHandler, reusable: bool) -> None:
        if reusable and not self.closed and proto.is_connected():
            self._idle.append((proto, time.monotonic()))
        else:
            proto.close()
        if self._sem is not None:
            self._sem.release()

    async def post(self, path: str, body: bytes, headers: CIMultiDict[str]) -> H1Response:
        """Send the request and wait for the status line and headers. The body is read by the caller."""
        if self._sem is not None:
            await self._sem.acquire()
        proto = None
        try:
            proto = self._take_idle()
            if proto is None:  # not `or`: a ResponseHandler is a queue, falsy when empty
                proto = await self._connect()
            proto.set_response_params(read_until_eof=False, auto_decompress=False, read_timeout=self._read_timeout,
                                      max_field_size=65536)
            head = [b"POST ", path.encode("utf-8", "surrogateescape"), b" HTTP/1.1\r\nHost: ", self._host_header,
                    b"\r\n"]
            accept = False
            for k, v in headers.items():
                accept = accept or k.lower() == "accept"
                head += (k.encode("utf-8", "surrogateescape"), b": ", v.encode("utf-8", "surrogateescape"), b"\r\n")
            if not accept:  # what aiohttp's client adds by default
                head.append(b"Accept: */*\r\n")
            head += (b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body)
            proto.transport.write(b"".join(head))
            proto.start_timeout()
            while True:
                message, payload = await proto.read()
                if not 100 <= message.code <= 199 or message.code == 101:
                    break  # skip interim 1xx answers
            if message.should_close:
                proto.force_close()
            return H1Response(message.code, message.headers, payload, self, proto)
        except BaseException:
            if proto is not None:
                proto.close()
            if self._sem is not None:
                self._sem.release()
            raise

    def close(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop()[0].close()


class H1Client:
    """One pool per replica origin; `limit` connections in use at once over all of them (0 = unlimited)."""

    def __init__(self, *, limit: int, connect_timeout_s: float | None, read_timeout_s: float | None) -> None:
        self._pools: dict[URL, H1Pool] = {}
        self._limit = asyncio.Semaphore(limit) if limit else None
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
