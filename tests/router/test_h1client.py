"""The proxy's lean HTTP/1.1 client: keep-alive reuse, the shared connection limit, chunked bodies,
and failures classified like aiohttp's (connect / reset / timeout)."""

from __future__ import annotations

import asyncio
import random
import socket

import pytest
from multidict import CIMultiDict
from yarl import URL

from routewise_vllm.router.http import client as h1client
from routewise_vllm.router.http.client import ConnectionLimit, H1Client, H1Connection
from routewise_vllm.router.http.upstream import classify
from tests.ci import skip_or_fail

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


async def test_an_idle_kept_alive_connection_outlives_the_read_timeout_and_still_times_a_slow_answer():
    """The read timer stays with the connection between responses: idle in the pool past read_timeout, the
    connection is reused; a later answer slower than read_timeout still fails as a timeout."""
    slow = {"on": False}

    def answer(h, b, t):
        asyncio.get_running_loop().call_later(3.0 if slow["on"] else 0, echo, h, b, t)

    # bounds a busy host cannot blur: an immediate answer well within the read timeout, idle and slow well past it
    server, url, stats = await serve(answer)
    client = H1Client(limit=0, connect_timeout_s=2, read_timeout_s=0.6)
    pool = client.pool(url)
    for i in range(2):
        r = await pool.post("/v1/completions", b"req%d" % i, CIMultiDict())
        assert await r.read() == b"req%d" % i
        r.release()
        await asyncio.sleep(1.0)  # idle past the read timeout
    assert stats["connections"] == 1
    slow["on"] = True
    with pytest.raises(Exception) as info:
        r = await pool.post("/v1/completions", b"late", CIMultiDict())
        await r.read()
    assert classify(info.value) == "timeout"
    assert stats["connections"] == 1  # the same connection timed out
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
    client = H1Client(limit=1, connect_timeout_s=2, read_timeout_s=1.0)  # a reset comes well before it
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


async def _one(raw_answer, read_timeout_s: float = 2.0, split: int | None = None, close: bool = False):
    """Posts once to a server that answers `raw_answer` (in pieces of `split` bytes, then closes the connection if
    `close`); returns (response, body or the exception, stats, client, server)."""
    async def answer(t):
        for i in range(0, len(raw_answer), split or len(raw_answer)):
            t.write(raw_answer[i:i + (split or len(raw_answer))])
            if split:
                await asyncio.sleep(0.001)
        if close:
            t.close()

    server, url, stats = await serve(lambda h, b, t: asyncio.ensure_future(answer(t)))
    client = H1Client(limit=0, connect_timeout_s=2, read_timeout_s=read_timeout_s)
    r = await client.pool(url).post("/x", b"{}", CIMultiDict())
    try:
        body = await r.read()
    except Exception as exc:  # noqa: BLE001 - the caller checks which
        body = exc
    return r, body, stats, client, server


@pytest.mark.parametrize("split", [None, 1, 7])
async def test_bodies_arrive_whole_however_the_bytes_are_cut(split):
    chunked = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n"
               b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\n")
    r, body, _, client, server = await _one(chunked, split=split)
    assert (r.status, body, r.headers["x-a"]) == (200, b"hello world", "b")
    r.release()
    sized = b"HTTP/1.1 201 Created\r\nContent-Length: 11\r\n\r\nhello world"
    r2, body2, _, client2, server2 = await _one(sized, split=split)
    assert (r2.status, body2) == (201, b"hello world")
    for c, s in ((client, server), (client2, server2)):
        c.close()
        s.close()


async def test_a_connection_the_replica_closes_is_not_reused():
    for answer in (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
                   b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"):
        server, url, stats = await serve(lambda h, b, t, a=answer: t.write(a))
        client = H1Client(limit=0, connect_timeout_s=2, read_timeout_s=2)
        for _ in range(2):
            r = await client.pool(url).post("/x", b"{}", CIMultiDict())
            assert await r.read() == b"ok"
            r.release()
        assert stats["connections"] == 2
        client.close()
        server.close()


async def test_body_until_close_and_no_body_on_204():
    r, body, _, client, server = await _one(b"HTTP/1.1 200 OK\r\n\r\nall of it", close=True)
    assert body == b"all of it"
    r.release()
    r, body, stats, client2, server2 = await _one(b"HTTP/1.1 204 No Content\r\n\r\n")
    assert (r.status, body) == (204, b"")
    r.release()
    r = await client2.pool(next(iter(client2._pools))).post("/x", b"{}", CIMultiDict())  # reused after a 204
    assert stats["connections"] == 1
    for c, s in ((client, server), (client2, server2)):
        c.close()
        s.close()


async def test_broken_answers_are_classified():
    r, body, _, client, server = await _one(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\npartial", read_timeout_s=1.0)
    assert classify(body) == "timeout"  # the replica went silent mid-body
    client.close()
    server.close()

    r, body, _, client, server = await _one(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel", close=True)
    assert classify(body) == "reset"  # cut mid-chunk
    r.close()
    for bad in (b"HTTP/1.1 2x0 OK\r\n\r\n", b"SPDY/3 200 OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n"):
        server2, url2, _ = await serve(lambda h, b, t, a=bad: t.write(a))
        with pytest.raises(Exception) as exc:
            await client.pool(url2).post("/x", b"{}", CIMultiDict())
        assert classify(exc.value) == "malformed", bad
        server2.close()
    client.close()
    server.close()


async def test_a_body_nobody_reads_pauses_the_replica_and_resumes():
    from routewise_vllm.router.http.client import HIGH_WATER

    big = b"x" * (HIGH_WATER * 3)
    server, url, _ = await serve(lambda h, b, t: t.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big)))
    client = H1Client(limit=0, connect_timeout_s=2, read_timeout_s=5.0)
    r = await client.pool(url).post("/x", b"{}", CIMultiDict())
    await asyncio.sleep(0.3)  # paused, within the read timeout (a reader that never takes is cut: test_large_answers)
    got = b""
    while chunk := await r.content.readany():
        got += chunk
    assert got == big
    r.release()
    client.close()
    server.close()


async def test_send_now_needs_an_idle_connection_and_room_under_the_limit():
    server, url, stats = await serve(echo)
    client = H1Client(limit=1, connect_timeout_s=2, read_timeout_s=5)
    pool = client.pool(url)
    headers = CIMultiDict({"Content-Type": "application/json"})
    assert pool.send_now("/v1/completions", b"a", headers) is None  # no connection yet: nothing sent, limit kept
    r = await pool.post("/v1/completions", b"b", headers)
    assert await r.read() == b"b"
    assert pool.send_now("/v1/completions", b"c", headers) is None  # the one connection is in use: the limit is full
    r.release()
    sent = pool.send_now("/v1/completions", b"d", headers)
    assert sent is not None and stats["requests"] == 1  # written now; the replica reads it on the next loop turn
    r = await sent
    assert await r.read() == b"d" and stats == {**stats, "connections": 1, "requests": 2}
    r.release()
    client.close()
    server.close()


async def test_connection_limit_serves_waiters_in_order_and_a_cancelled_one_passes_its_slot_on():
    limit = ConnectionLimit(1)
    assert limit.try_take() and not limit.try_take()
    order: list[str] = []

    async def waiter(name: str) -> None:
        await limit.take()
        order.append(name)

    a, b, c = (asyncio.create_task(waiter(n)) for n in "abc")
    await asyncio.sleep(0)
    limit.give()  # handed to a
    b.cancel()  # b never got one: c is next
    await asyncio.gather(a, return_exceptions=True)
    limit.give()
    await c
    assert order == ["a", "c"] and not limit.try_take()
    handed = asyncio.create_task(waiter("d"))
    await asyncio.sleep(0)
    limit.give()  # handed to d, cancelled before it runs: the slot is passed on, not lost
    handed.cancel()
    await asyncio.gather(handed, return_exceptions=True)
    assert order == ["a", "c"] and limit.try_take()


class _Wire:
    """A transport that takes what the connection writes and nothing else."""

    def write(self, data): pass
    def is_closing(self): return False
    def close(self): pass
    def pause_reading(self): pass
    def resume_reading(self): pass


def _decode(answer: bytes, cuts: list[int]) -> tuple:
    """What H1Connection makes of `answer` arriving in the pieces `cuts` marks: the body, whether it ended, the
    failure, the bytes left over and whether the connection is kept."""
    loop = asyncio.new_event_loop()
    try:
        conn = H1Connection(loop)
        conn.connection_made(_Wire())
        head = conn.request(b"", None)
        body, error = b"", None
        for a, b in zip([0, *cuts], [*cuts, len(answer)]):
            conn.data_received(answer[a:b])
            if head.done() and head.exception() is None:
                try:
                    body += head.result()[2].read_nowait()
                except Exception as exc:  # noqa: BLE001 - the failure is the result compared
                    error = f"{type(exc).__name__}: {exc}"
                    break
            elif head.done():
                error = f"{type(head.exception()).__name__}: {head.exception()}"
                break
        ended = head.done() and head.exception() is None and head.result()[2].at_eof()
        return body, ended, error, bytes(conn._buf), conn.should_close
    finally:
        loop.close()


def _random_chunked(rng: random.Random) -> bytes:
    out = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"]
    for _ in range(rng.randint(0, 12)):
        data = bytes(rng.choice(b"ab\r\n:;0 ") for _ in range(rng.choice((1, 2, 7, 60, 300))))
        size = rng.choice(["%x", "%X", "%04x", "%x;name=v", "%x ", " %x", "0x%x", "+%x", "%x\t"]) % len(data)
        if rng.random() < 0.03:
            size = rng.choice(["zz", "", "1_0", "-1", "%x" % (len(data) + 1), "f" * 17])
        end = b"\r\n" if rng.random() > 0.03 else rng.choice([b"\n", b"xy", b""])
        out.append(size.encode() + b"\r\n" + data + end)
    out.append(rng.choice([b"0\r\n\r\n", b"000\r\n\r\n", b"0;x\r\nTrailer: v\r\n\r\n", b"0\r\n", b""]))
    if rng.random() < 0.1:
        out.append(b"HTTP/1.1 200 OK\r\n")  # bytes beyond the answer
    return b"".join(out)


def test_compiled_chunk_scanner_decodes_every_body_as_the_python_loop_does(monkeypatch):
    """router.http._fasthttp.scan_chunks takes the common case only: with and without it, each body (canonical or not,
    broken or not) cut anywhere decodes to the same bytes, end, failure, leftover and keep-alive."""
    if h1client.scan_chunks is None:
        skip_or_fail("the C extension router.http._fasthttp is not built (no C compiler at install)")
    rng = random.Random(7)
    compiled = h1client.scan_chunks
    differ = 0
    for _ in range(3000):
        answer = _random_chunked(rng)
        cuts = sorted(rng.sample(range(1, len(answer)), min(len(answer) - 1, rng.choice((0, 1, 3, 12)))))
        monkeypatch.setattr(h1client, "scan_chunks", compiled)
        fast = _decode(answer, cuts)
        monkeypatch.setattr(h1client, "scan_chunks", None)
        slow = _decode(answer, cuts)
        assert fast == slow, (answer, cuts)
        differ += fast[0] != b""
    assert differ > 1000  # most bodies had data to compare


def test_scan_chunks_takes_canonical_chunks_and_stops_at_anything_else():
    if h1client.scan_chunks is None:
        skip_or_fail("the C extension router.http._fasthttp is not built (no C compiler at install)")
    scan = h1client.scan_chunks
    assert scan(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", 0) == (21, b"hello world")  # stops at the last chunk
    assert scan(b"xx5\r\nhello\r\n", 2) == (12, b"hello")
    assert scan(b"5\r\nhel", 0) == (0, b"")  # not whole yet
    assert scan(b"5;ext\r\nhello\r\n", 0) == (0, b"")  # an extension: the Python loop's
    assert scan(b"5\r\nhelloXY", 0) == (0, b"")  # no CRLF after the data
    assert scan(b"A\r\n0123456789\r\n", 0) == (15, b"0123456789")
    assert scan(b"f" * 16 + b"\r\n", 0) == (0, b"")  # more digits than it takes
    with pytest.raises(ValueError):
        scan(b"abc", 4)


def _random_response_head(rng: random.Random) -> bytes:
    line = rng.choice([b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK", b"HTTP/1.1 404", b"HTTP/1.1 503 Service Unavailable",
                       b"HTTP/1.1 100 Continue", b"HTTP/1.1 2000 OK", b"HTTP/2 200 OK", b"HTTP/1.1  200 OK",
                       b"HTTP/1.1 20x OK", b"HTTP/1.1 200\tOK", b"ICY 200 OK", b"", b"HTTP/1.1 200 ", b"HTTP/1.2 200 OK",
                       b"HTTP/1.1 200 OK "])
    names = [b"content-type", b"Content-Length", b"date", b"server", b"Connection", b"Transfer-Encoding",
             b"x-request-id", b"X Spaced", b" lead", b"", b"\xc3\xa9t\xc3\xa9"]
    values = [b"application/json", b"42", b" 42\t", b"", b"close", b"keep-alive", b"chunked", b"uvicorn",
              b"Sun, 29 Nov 2026 07:00:00 GMT", b"\xc3\xa9", b"a\x00b", b"a:b"]
    lines = [line] + [rng.choice(names) + rng.choice([b":", b": ", b" :", b""]) + rng.choice(values)
                      for _ in range(rng.choice((0, 1, 4, 9)))]
    head = b"\r\n".join(lines)
    if rng.random() < 0.1:
        i = rng.randrange(len(head) or 1)
        head = head[:i] + bytes([rng.randrange(256)]) + head[i + 1:]
    return head


def test_compiled_response_head_reads_what_it_takes_as_the_python_parse_does():
    """router.http._fasthttp.response_head takes the common case: whatever it takes, parse_response_head reads the same
    (status, HTTP/1.0, headers in order); what it leaves, the Python parse decides (reads or raises)."""
    if h1client.response_head is None:
        skip_or_fail("the C extension router.http._fasthttp is not built (no C compiler at install)")
    rng = random.Random(5)
    taken = 0
    for _ in range(20000):
        head = _random_response_head(rng)
        fast = h1client.response_head(head)
        try:
            status, http10, headers = h1client.parse_response_head(head)
            ref = (status, http10, list(headers.items()))
        except h1client.MalformedResponse:
            ref = None
        if fast is not None:
            taken += 1
            assert fast == ref, head
    assert taken > 2000  # the comparison covered many heads the C code took (2,805 of the 3,287 the parse reads)
