"""The proxy's two sides, one interface each, so `Proxy` reads the same code whichever transport carries a request.

Downstream, a generation request whose body is in hand (`Downstream`): the lean listener's `LeanRequest`
(router/http/server.py) or `AiohttpRequest` here, around aiohttp's web.Request. Each answers with `respond` (a whole
answer), `stream` (a chunked one, written with `write` / `write_eof`) or `refuse` (a 4xx from the router).

Upstream, a replica's answer (`UpstreamResponse`): the lean client's H1Response or aiohttp's ClientResponse, which
already read alike (status, headers, a body read with readany / read_nowait / at_eof, read, release, close). An
`Upstream` sends a request: `H1Upstream` with the lean client (plain http only), `SessionUpstream` with aiohttp's.
`upstreams` picks one per URL scheme from the settings, so a request costs a dict lookup, no branch.

`lean_listener: false` and `lean_client: false` force aiohttp's side (the library path) on each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from aiohttp.http import HttpProcessingError
from multidict import CIMultiDict
from yarl import URL

from routewise_vllm.router.errors import BadRequest
from routewise_vllm.router.http.client import H1Client, MalformedResponse, ReaderTimeoutError, check_fields, check_status


class StreamOut(Protocol):
    """A chunked answer to the client. Writes to a client that is gone raise ConnectionError."""

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self, data: bytes = b"") -> None: ...


class Downstream(Protocol):
    """A generation request with its whole body, and how to answer it."""

    headers: Mapping[str, str]
    remote: str | None
    body: bytes

    def respond(self, status: int, headers: Any, body: bytes) -> Any:
        """A whole answer: what the request's handler returns (sent now on the lean listener). May raise
        ConnectionError when the client is gone."""

    def stream(self, status: int, headers: Any) -> StreamOut:
        """A chunked answer; its head goes out with the first write. May raise ConnectionError."""

    def refuse(self, resp: web.Response) -> web.Response:
        """The router's own 4xx or 503, ready to return."""


class UpstreamBody(Protocol):
    async def readany(self) -> bytes: ...

    def read_nowait(self) -> bytes: ...

    def at_eof(self) -> bool: ...


class UpstreamResponse(Protocol):
    status: int
    headers: Mapping[str, str]
    content: UpstreamBody

    async def read(self) -> bytes: ...

    def release(self) -> Any: ...

    def close(self) -> None: ...


class Upstream(Protocol):
    def send_now(self, url: URL, path: str, raw: bytes, headers: CIMultiDict[str]) -> Awaitable[UpstreamResponse] | None:
        """The request sent now (an idle kept-alive connection with room under the limit), its response due from
        the awaitable (await it once); None: nothing sent, call `post`."""

    def post(self, url: URL, path: str, raw: bytes, headers: CIMultiDict[str]) -> Awaitable[UpstreamResponse]:
        """Sends the request; the awaitable gives the response once its head arrived (the body is read after)."""


class H1Upstream:
    """router.http.client's pools (plain http only)."""

    __slots__ = ("_client",)

    def __init__(self, client: Callable[[], H1Client]) -> None:
        self._client = client  # the client exists once the app starts

    def send_now(self, url: URL, path: str, raw: bytes, headers: CIMultiDict[str]) -> Awaitable[UpstreamResponse] | None:
        return self._client().pool(url).send_now(path, raw, headers)

    def post(self, url: URL, path: str, raw: bytes, headers: CIMultiDict[str]) -> Awaitable[UpstreamResponse]:
        return self._client().pool(url).post(path, raw, headers)


class SessionUpstream:
    """aiohttp's ClientSession (http and https). Each head is held to the lean client's rules (`_checked`: aiohttp's lax
    parser takes statuses 000-999, 101, control bytes in values, any Transfer-Encoding) and due within
    idle_timeout_s in total (aiohttp's read timeout restarts at each interim head), and each response is watched
    while the router does not take its data (`_Watched`)."""

    __slots__ = ("_session", "_idle_timeout_s")

    def __init__(self, session: Callable[[], aiohttp.ClientSession], idle_timeout_s: float | None = None) -> None:
        self._session = session
        self._idle_timeout_s = idle_timeout_s

    def send_now(self, url: URL, path: str, raw: bytes, headers: CIMultiDict[str]) -> None:
        return None  # aiohttp's client sends once awaited

    def post(self, url: URL, path: str, raw: bytes, headers: CIMultiDict[str]) -> Awaitable[UpstreamResponse]:
        return _checked(self._session().post(url.with_path(path), data=raw, headers=headers), self._idle_timeout_s)


async def _checked(sent: Awaitable[aiohttp.ClientResponse], idle_timeout_s: float | None) -> UpstreamResponse:
    async with asyncio.timeout(idle_timeout_s):
        resp = await sent
    try:
        check_status(resp.status)  # aiohttp skips the 1xx heads but 101 itself
        check_fields(resp.raw_headers)
    except MalformedResponse:
        resp.close()
        raise
    return resp if idle_timeout_s is None else _Watched(resp, idle_timeout_s)  # type: ignore[return-value]


class _Watched:
    """aiohttp's ClientResponse, with the lean client's rule for a reader that stops taking (a client that stopped reading
    a stream): data waits untaken for idle_timeout_s, the replica's connection is dropped (the replica is freed)
    and the next read raises ReaderTimeoutError, which does not blame the replica. aiohttp's own read timeout
    cannot do it: its protocol stops that timer while its buffer is full and reading is paused. One timer per
    response, re-armed only when it fires, cancelled when the response is released or closed."""

    __slots__ = ("_resp", "_idle", "_taken_bytes", "_taken_at", "_timer", "_cut", "status", "headers", "content")

    def __init__(self, resp: aiohttp.ClientResponse, idle_timeout_s: float) -> None:
        self._resp = resp
        self.status, self.headers, self.content = resp.status, resp.headers, self
        self._idle = idle_timeout_s
        self._taken_bytes = 0
        loop = asyncio.get_running_loop()
        self._taken_at = loop.time()
        self._cut = False
        self._timer: asyncio.TimerHandle | None = loop.call_later(idle_timeout_s, self._check)

    def _check(self) -> None:
        self._timer = None
        content = self._resp.content
        if content.at_eof() or self._resp.closed:
            return
        loop = asyncio.get_running_loop()
        if content.total_bytes > self._taken_bytes and loop.time() - self._taken_at >= self._idle:
            self._cut = True
            self._resp.close()
            return
        due = self._taken_at + self._idle if content.total_bytes > self._taken_bytes else loop.time() + self._idle
        self._timer = loop.call_at(due, self._check)

    def _took(self, data: bytes) -> bytes:
        if self._cut:
            raise ReaderTimeoutError(f"response body not taken by the router within {self._idle:g} s")
        self._taken_bytes += len(data)
        self._taken_at = asyncio.get_running_loop().time()
        return data

    # the body, as UpstreamBody
    async def readany(self) -> bytes:
        if self._cut:
            raise ReaderTimeoutError(f"response body not taken by the router within {self._idle:g} s")
        return self._took(await self._resp.content.readany())

    def read_nowait(self) -> bytes:
        return self._took(self._resp.content.read_nowait())

    def at_eof(self) -> bool:
        return self._resp.content.at_eof()

    # the response, as UpstreamResponse
    async def read(self) -> bytes:
        return self._took(await self._resp.read())

    def _stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def release(self) -> Any:
        self._stop()
        return self._resp.release()

    def close(self) -> None:
        self._stop()
        self._resp.close()


def upstreams(lean_client: bool, h1: Callable[[], H1Client], session: Callable[[], aiohttp.ClientSession],
              idle_timeout_s: float | None = None) -> dict[str, Upstream]:
    """The Upstream of each replica URL scheme."""
    library = SessionUpstream(session, idle_timeout_s)
    return {"http": H1Upstream(h1) if lean_client else library, "https": library}


class _LazyStream(web.StreamResponse):
    """aiohttp's StreamResponse, prepared by its first write (the lean listener's stream sends its head with its
    first chunk too): `stream` stays synchronous on both sides."""

    __slots__ = ("_request",)

    def __init__(self, request: web.Request, status: int, headers: Any) -> None:
        super().__init__(status=status, headers=headers)
        self._request = request

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.prepared:
            await self.prepare(self._request)
        await super().write(data)

    async def write_eof(self, data: bytes = b"") -> None:
        if not self.prepared:
            await self.prepare(self._request)
        await super().write_eof(data)


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """An aiohttp request's whole body: at most `limit` bytes (413), within `timeout_s` (408), else BadRequest."""
    if request.content_length is not None and request.content_length > limit:
        raise BadRequest(f"request body of {request.content_length} bytes exceeds the limit of {limit} bytes",
                         status=413, code="request_too_large")
    try:
        if request.content.is_eof():  # all of it arrived with the head (the usual case): no timer needed
            raw = await request.read()
        else:
            async with asyncio.timeout(timeout_s):
                raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"request body exceeds the limit of {limit} bytes", status=413,
                         code="request_too_large") from None
    except TimeoutError:
        raise BadRequest(f"request body not received within {timeout_s:g} s", status=408,
                         code="request_timeout") from None
    except (HttpProcessingError, web.RequestPayloadError, ValueError) as exc:  # bad gzip, bad chunking
        raise BadRequest(f"request body could not be read: {type(exc).__name__}: {exc}") from None
    if len(raw) > limit:
        raise BadRequest(f"request body exceeds the limit of {limit} bytes", status=413, code="request_too_large")
    return raw


class AiohttpRequest:
    """A generation request that came through aiohttp's server side, its body read (read_body)."""

    __slots__ = ("_request", "headers", "remote", "body")

    def __init__(self, request: web.Request, body: bytes) -> None:
        self._request = request
        self.headers = request.headers
        self.remote = request.remote
        self.body = body

    def respond(self, status: int, headers: Any, body: bytes) -> web.Response:
        return web.Response(status=status, body=body, headers=headers)

    def stream(self, status: int, headers: Any) -> web.StreamResponse:
        return _LazyStream(self._request, status, headers)

    def refuse(self, resp: web.Response) -> web.Response:
        return refuse(resp, self._request)


def refuse(resp: web.Response, request: web.BaseRequest) -> web.Response:
    """A refusal of an aiohttp request closes its connection if its body was not read to the end (a slow, broken
    or oversized body is not worth draining)."""
    if request.body_exists and not request.content.is_eof():
        resp.force_close()
    return resp
