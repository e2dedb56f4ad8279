"""Whole answers of every size and framing through both upstream clients (the lean h1client and aiohttp's
ClientSession, as the router configures them), a read timeout that stays armed while the router holds data it
has not taken, and a 1 MB non-streamed answer through the running router without an ejection.

A raw asyncio server on loopback writes the exact bytes: the answer's size, framing (Content-Length, chunked in
uneven chunks, or delimited by the connection's end) and whether it keeps the connection are in the path. Each
case asks twice on one client, the size under test then 1 KB, so a body read past its end or short of it shows as
a wrong second answer, and the connection count shows reuse exactly when the replica keeps the connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from multidict import CIMultiDict
from yarl import URL

from routewise_vllm.router.app import METRICS, REPLICAS
from routewise_vllm.router.http.client import HIGH_WATER, H1Client
from routewise_vllm.router.settings import RouterSettings
from routewise_vllm.router.http.upstream import classify, make_h1_client, make_session
from tests.fakes.scripted_replica import ScriptedReplica, chunked
from tests.router.conftest import wait_for

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

KB, MB = 1 << 10, 1 << 20
SIZES = [0, KB, 300 * KB, MB, 8 * MB, 64 * MB]
FRAMINGS = [("length", "keep"), ("length", "close"), ("chunked", "keep"), ("chunked", "close"), ("eof", "close")]
BLOCK = 1 << 16
_BASE = bytes(range(256)) * (BLOCK // 256)
CHUNK_SIZES = (1, 7, 4093, BLOCK, 100_003, MB)  # chunked answers cycle through these


def block(i: int) -> bytes:
    """Block i of every answer: its index first, so a lost, repeated or misplaced block shows."""
    return i.to_bytes(8, "big") + _BASE[8:]


def pieces(n: int) -> list[bytes]:
    """The first n bytes of the answer pattern, cut in CHUNK_SIZES (cycled; capped at 1 MB)."""
    out, pos, k = [], 0, 0
    while pos < n:
        size = min(CHUNK_SIZES[k % len(CHUNK_SIZES)], n - pos)
        k += 1
        first, last = pos // BLOCK, (pos + size - 1) // BLOCK
        data = b"".join(block(i) for i in range(first, last + 1))
        off = pos - first * BLOCK
        out.append(data[off:off + size])
        pos += size
    return out


def check(body: bytes, n: int) -> None:
    assert len(body) == n, f"{len(body)} bytes, expected {n}"
    for i in range(0, n // BLOCK):
        assert body.startswith(block(i), i * BLOCK), f"block {i} differs"
    rest = n % BLOCK
    if rest:
        assert body.startswith(block(n // BLOCK)[:rest], n - rest), "the last block differs"


class RawReplica:
    """Answers `POST /<size>/<length|chunked|eof>/<keep|close>` with exactly those bytes."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.url = URL()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = URL(f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                length = next(int(v) for k, _, v in (h.partition(":") for h in lines[1:]) if k.lower() == "content-length")
                await reader.readexactly(length)
                _, size, framing, keep = lines[0].split(" ")[1].split("/")
                n = int(size)
                hdr = [b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nX-Size: %d\r\n" % n]
                if framing == "length":
                    hdr.append(b"Content-Length: %d\r\n" % n)
                elif framing == "chunked":
                    hdr.append(b"Transfer-Encoding: chunked\r\n")
                if keep == "close":
                    hdr.append(b"Connection: close\r\n")
                writer.write(b"".join(hdr) + b"\r\n")
                for piece in pieces(n):
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if framing == "chunked" else piece)
                    await writer.drain()
                if framing == "chunked":
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
                if keep == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@contextlib.asynccontextmanager
async def replica() -> AsyncIterator[RawReplica]:
    r = RawReplica()
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


Post = Callable[[str], Awaitable[bytes]]


@contextlib.asynccontextmanager
async def upstream_client(kind: str, url: URL) -> AsyncIterator[Post]:
    """The router's own upstream client of that kind, configured from RouterSettings."""
    settings = RouterSettings(replicas=[str(url)], idle_timeout_s=10)
    if kind == "h1":
        client = make_h1_client(settings)
        pool = client.pool(url)

        async def post(path: str) -> bytes:
            r = await pool.post(path, b"{}", CIMultiDict({"Content-Type": "application/json"}))
            try:
                body = await r.read()
            except BaseException:
                r.close()
                raise
            r.release()
            return body
        try:
            yield post
        finally:
            client.close()
    else:
        session = make_session(settings)

        async def post(path: str) -> bytes:
            async with session.post(url.with_path(path), data=b"{}") as r:
                return await r.read()
        try:
            yield post
        finally:
            await session.close()


@pytest.mark.parametrize("client", ["h1", "aiohttp"])
@pytest.mark.parametrize("framing,keep", FRAMINGS)
@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"{n}B")
async def test_answers_arrive_whole_through_both_clients(client, framing, keep, size):
    async with replica() as rep, upstream_client(client, rep.url) as post:
        async with asyncio.timeout(60):  # the old h1client paused above 256 KB and hung here for ever
            body = await post(f"/{size}/{framing}/{keep}")
            check(body, size)
            del body
            check(await post(f"/{KB}/{framing}/{keep}"), KB)  # the connection is still in step
        assert rep.connections == (1 if keep == "keep" else 2)


async def _answering(n: int) -> tuple[asyncio.Server, URL, asyncio.Event]:
    """A replica that sends an n-byte answer as fast as it is read; the event is set when the client drops it."""
    dropped = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n)
        try:
            for piece in pieces(n):
                writer.write(piece)
                await writer.drain()
            await reader.read()  # hold the connection until the client drops it
        except ConnectionError:
            pass
        dropped.set()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, URL(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"), dropped


async def test_a_reader_that_never_takes_is_cut_not_left_hanging():
    """Paused at HIGH_WATER with nobody taking: the read timer is still armed and cuts the response with a
    timeout, and the replica sees the disconnect (the old client switched the timer off while paused: the
    connection stayed open for ever)."""
    server, url, dropped = await _answering(HIGH_WATER * 4)
    client = H1Client(limit=0, connect_timeout_s=2, read_timeout_s=0.3)
    r = await client.pool(url).post("/x", b"{}", CIMultiDict())
    async with asyncio.timeout(20):
        await dropped.wait()  # taking nothing meanwhile
    with pytest.raises(aiohttp.ServerTimeoutError) as exc:
        await r.content.readany()
    assert classify(exc.value) == "timeout"
    r.close()
    client.close()
    server.close()


async def test_a_reader_that_takes_in_time_gets_everything_however_long_it_takes():
    """Each take comes within the read timeout, the whole answer takes several timeouts: nothing is cut."""
    n = HIGH_WATER * 6
    server, url, _ = await _answering(n)
    client = H1Client(limit=0, connect_timeout_s=2, read_timeout_s=0.3)
    r = await client.pool(url).post("/x", b"{}", CIMultiDict())
    got = []
    async with asyncio.timeout(30):
        while chunk := await r.content.readany():
            got.append(chunk)
            await asyncio.sleep(0.1)  # a slow reader, within the timeout each time
    check(b"".join(got), n)
    assert len(got) >= 4  # several pauses and resumes: over 0.3 s in all
    r.release()
    client.close()
    server.close()


async def test_a_1mb_answer_through_the_router_returns_whole_and_ejects_nobody(fakes, router_paths):
    """Through the running router with a peer to retry on: the old client hung on such an answer until the stall
    detector (here 2 s) ejected the healthy replica and ran the request again on the next one."""
    a, b = await fakes(2)
    client = await router_paths([a.url, b.url], admin_token="t", stall_timeout_s=2)
    n = 120_000  # about 1.1 MB of " tok<i>"
    async with asyncio.timeout(60):
        for _ in range(2):
            resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": n})
            body = await resp.read()
            assert resp.status == 200, body[:300]
    assert len(body) > MB
    assert json.loads(body)["choices"][0]["text"] == "".join(f" tok{i}" for i in range(n))
    assert a.requests + b.requests == 2  # nothing ran twice
    listed = await (await client.get("/admin/replicas", headers={"Authorization": "Bearer t"})).json()
    assert [(r["ejections"], r["routable"], r["breaker"]["trips"]) for r in listed["replicas"]] == [({}, True, 0)] * 2


@pytest.mark.parametrize("lean_client", [True, False], ids=["h1client", "aiohttp-client"])
@pytest.mark.parametrize("lean_listener", [True, False], ids=["lean", "aiohttp"])
async def test_a_client_that_stops_reading_a_stream_is_not_the_replicas_fault(fakes, router_client, lean_listener,
                                                                            lean_client):
    """A stream the client stops reading: the router stops reading the replica (its buffer full), and once
    idle_timeout_s passes without the router taking, the upstream client drops the replica's connection (the
    replica is freed): h1client by its own read timer, aiohttp's client (which stops its read timer while paused)
    through router/http/transport.py's watch. The client, reading again, gets what came before and an error event; the
    replica is not blamed."""
    event = b"data: " + b"x" * (MB - 8) + b"\n\n"
    replica = ScriptedReplica({"big": chunked(200, [event] * 16, [("Content-Type", "text/event-stream")])})
    url = await replica.start()
    try:
        client = await router_client([url], idle_timeout_s=0.5, first_byte_timeout_s=10, lean_listener=lean_listener,
                                     lean_client=lean_client)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the client's kernel holds little
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (client.host, client.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
        body = json.dumps({"model": "tiny", "prompt": "big", "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        async with asyncio.timeout(60):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            await wait_for(lambda: replica.drops == 1, timeout=50)  # reading nothing meanwhile
            rest = await reader.read()  # to the end: the router closes the connection
        writer.close()
    finally:
        await replica.stop()
    assert b'"error"' in rest[-300:] and b"upstream" in rest[-300:]
    assert rest.count(b"x" * 1000) < 16 * (MB // 1000)  # cut: not all 16 MB came
    rid = url.removeprefix("http://")
    assert client.app[METRICS].registry.get_sample_value(
        "llm_router_upstream_errors_total", {"replica": rid, "kind": "timeout"}) is None
    rep = client.app[REPLICAS].by_id[rid]
    assert rep.breaker.consecutive_failures == 0 and rep.routable
