"""The proxy's lean HTTP/1.1 client: keep-alive reuse, the shared connection limit, chunked bodies,
and failures classified like aiohttp's (connect / reset / timeout)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from multidict import CIMultiDict
from yarl import URL

from router.h1client import H1Client
from router.upstream import classify

CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"


async def serve(behaviour):
    """A raw server; `behaviour(head, body, transport)` answers each request. Returns (server, url, stats)."""
    stats = {"connections": 0, "requests": 0, "heads": []}

    class P(asyncio.Protocol):
        def connection_made(self, t):
            stats["connections"] += 1
            self.t, self.buf = t, b""

        def data_received(self, data):
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                head = self.buf[:end].decode()
                n = int(next(line.split(":")[1] for line in head.split("\r\n") if line.lower().startswith("content-length")))
                if len(self.buf) < end + 4 + n:
                    return
                body, self.buf = self.buf[end + 4:end + 4 + n], self.buf[end + 4 + n:]
                stats["requests"] += 1
                stats["heads"].append(head)
                behaviour(head, body, self.t)

    server = await asyncio.get_running_loop().create_server(P, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, URL(f"http://127.0.0.1:{port}"), stats


def echo(head, body, t):
    t.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


async def test_reuses_connections_within_the_limit():
    server, url, stats = await serve(lambda h, b, t: asyncio.get_running_loop().call_later(0.005, echo, h, b, t))
    client = H1Client(limit=4, connect_timeout_s=2, read_timeout_s=5)
    pool = client.pool(url)

    async def one(i: int) -> bytes:
        r = await pool.post("/v1/completions", b"req%d" % i, CIMultiDict({"Content-Type": "application/json"}))
        body = await r.read()
        r.release()
        return body

    for i in range(5):
        assert await one(i) == b"req%d" % i
    assert stats["connections"] == 1
    assert await asyncio.gather(*(one(i) for i in range(40))) == [b"req%d" % i for i in range(40)]
    assert stats["connections"] <= 4 and stats["requests"] == 45
    head = stats["heads"][0]
    assert head.startswith("POST /v1/completions HTTP/1.1\r\n")
    assert f"Host: {url.host}:{url.port}" in head and "Content-Type: application/json" in head
    client.close()
    server.close()


async def test_chunked_body_and_close_drops_the_connection():
    server, url, stats = await serve(lambda h, b, t: t.write(CHUNKED))
    client = H1Client(limit=0, connect_timeout_s=2, read_timeout_s=5)
    pool = client.pool(url)
    r = await pool.post("/x", b"{}", CIMultiDict())
    assert r.status == 200 and await r.read() == b"hello world"
    r.close()  # e.g. the client went away: never reused
    r = await pool.post("/x", b"{}", CIMultiDict())
    chunks = []
    while chunk := await r.content.readany():
        chunks.append(chunk)
    assert b"".join(chunks) == b"hello world"
    r.release()
    assert stats["connections"] == 2
    client.close()
    server.close()


async def test_failures_are_classified_like_aiohttp():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = URL(f"http://127.0.0.1:{s.getsockname()[1]}")
    client = H1Client(limit=1, connect_timeout_s=2, read_timeout_s=0.2)
    with pytest.raises(Exception) as exc:
        await client.pool(dead).post("/x", b"", CIMultiDict())
    assert classify(exc.value) == "connect"

    server, url, _ = await serve(lambda h, b, t: t.close())
    with pytest.raises(Exception) as exc:
        await client.pool(url).post("/x", b"", CIMultiDict())
    assert classify(exc.value) == "reset"
    server.close()

    server, url, _ = await serve(lambda h, b, t: None)  # never answers
    with pytest.raises(Exception) as exc:
        await client.pool(url).post("/x", b"", CIMultiDict())
    assert classify(exc.value) == "timeout"
    # the limit of 1 was given back after each failure, or the third post would have hung
    server.close()
    client.close()
