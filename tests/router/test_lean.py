"""The lean listener (router/http/server.py): plain generation requests served without aiohttp's server side, the rest of a
connection handed to aiohttp; raw sockets, so every byte on the wire is the router's.

A response written by aiohttp carries its `Server: Python/... aiohttp/...` header; the lean writer sends none, which
is how these tests tell which side answered."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from routewise_vllm.router.app import PROXY, REPLICAS
from routewise_vllm.router.http import server as lean
from routewise_vllm.router.http.server import LeanHead, parse_head, parse_plain
from tests.ci import skip_or_fail
from tests.router.conftest import wait_for

BODY = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()


def post(body: bytes = BODY, path: str = "/v1/completions", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 5))[:-2], 16)
            chunk = await asyncio.wait_for(reader.readexactly(size + 2), 5)
            if size == 0:
                return status, headers, body
            body += chunk[:-2]
    return status, headers, await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 5)


async def connect(client) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", client.server.port)


@pytest.mark.parametrize("head, plain", [
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5", True),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-A:  b \r\nContent-Length: 0", True),
    (b"GET /v1/completions HTTP/1.1\r\nContent-Length: 5", False),
    (b"POST /v1/completions HTTP/1.0\r\nContent-Length: 5", False),
    (b"POST /v1/completions?x=1 HTTP/1.1\r\nContent-Length: 5", False),
    (b"POST /v1/models HTTP/1.1\r\nContent-Length: 5", False),
    (b"POST /v1/completions HTTP/1.1", False),  # no Content-Length
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Encoding: gzip", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nConnection: Upgrade", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nBad Name: x", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\n folded", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nX: a\x00b", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nX: a\nY: b", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nX: \xc3\xa9", False),
])
def test_parse_head_takes_only_plain_generation_requests(head: bytes, plain: bool) -> None:
    parsed = parse_head(head)
    assert (parsed is not None) is plain
    if parsed is not None:
        assert parsed.chat is head.startswith(b"POST /v1/chat")
        assert parsed.content_length == int(parsed.headers["Content-Length"])


def test_parse_head_reads_connection_close_and_keeps_header_values() -> None:
    h = parse_head(b"POST /v1/completions HTTP/1.1\r\nConnection: keep-alive, Close\r\nX-User:  a b \r\nContent-Length: 2")
    assert h is not None and h.close and h.headers["x-user"] == "a b"


async def test_keepalive_requests_then_a_handover_on_the_same_connection(fakes, router_client) -> None:
    (f,) = await fakes(1)
    client = await router_client([f.url])
    reader, writer = await connect(client)
    for _ in range(2):
        writer.write(post())
        status, headers, body = await read_response(reader)
        assert status == 200 and "server" not in headers and headers["x-routewise-arm"] == "main"
        assert json.loads(body)["choices"]
    writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")  # not a generation request: aiohttp answers
    status, headers, body = await read_response(reader)
    assert status == 200 and "aiohttp" in headers["server"] and json.loads(body) == {"status": "ok"}
    writer.write(post())  # the connection stays with aiohttp, which still routes it
    status, headers, _ = await read_response(reader)
    assert status == 200 and "aiohttp" in headers["server"]
    writer.close()
    assert f.requests == 3


async def test_keepalive_timeout_runs_from_the_last_answer_not_the_first(fakes, router_client) -> None:
    """A connection busy past the keep-alive timeout in total stays open while requests keep coming; idle after
    its last answer, it is closed. (One timer per connection, moved forward: none per request.)"""
    (f,) = await fakes(1)
    client = await router_client([f.url], keepalive_timeout_s=1.0)
    reader, writer = await connect(client)
    for _ in range(5):  # 5 x 0.35 s: past the timeout counted from the first, each gap well within it (a busy host)
        writer.write(post())
        status, _, _ = await read_response(reader)
        assert status == 200
        await asyncio.sleep(0.35)
    assert not reader.at_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # idle: closed
    writer.close()
    assert f.requests == 5


@pytest.mark.parametrize("requests, limits", [(0, {"header_timeout_s": 0.3}), (1, {"keepalive_timeout_s": 0.3})])
async def test_a_connection_idle_from_its_start_or_after_one_answer_is_closed(fakes, router_client, requests,
                                                                             limits) -> None:
    """The first deadline a connection gets closes it: the head's, at its start, and the keep-alive's after its first
    answer, which comes before the head's (10 s) and so replaces its timer."""
    (f,) = await fakes(1)
    client = await router_client([f.url], **limits)
    reader, writer = await connect(client)
    for _ in range(requests):
        writer.write(post())
        status, _, _ = await read_response(reader)
        assert status == 200
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_pipelined_and_split_requests_are_answered_in_order(fakes, router_client) -> None:
    (f,) = await fakes(1)
    client = await router_client([f.url])
    reader, writer = await connect(client)
    chat = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()
    writer.write(post() + post(chat, "/v1/chat/completions"))
    first, second = await read_response(reader), await read_response(reader)
    assert first[0] == second[0] == 200
    assert json.loads(first[2])["object"] == "text_completion"
    assert json.loads(second[2])["object"] == "chat.completion"
    raw = post()
    for part in (raw[:10], raw[10:-5], raw[-5:]):  # head and body in pieces
        writer.write(part)
        await writer.drain()
        await asyncio.sleep(0.02)
    status, headers, _ = await read_response(reader)
    assert status == 200 and "server" not in headers
    writer.close()


async def test_stream_is_chunked_and_complete(fakes, router_client) -> None:
    (f,) = await fakes(1, tokens=5)
    client = await router_client([f.url])
    reader, writer = await connect(client)
    writer.write(post(json.dumps({"model": "tiny", "prompt": "hi", "stream": True}).encode()))
    status, headers, body = await read_response(reader)
    assert status == 200 and headers["transfer-encoding"] == "chunked" and "server" not in headers
    events = [e for e in body.split(b"\n\n") if e.startswith(b"data:")]
    assert len(events) == 6 and events[-1] == b"data: [DONE]"
    writer.close()


async def test_refusals_keep_the_router_error_shape(fakes, router_client) -> None:
    (f,) = await fakes(1)
    client = await router_client([f.url], max_body_bytes=4096)
    reader, writer = await connect(client)
    writer.write(post(b"{not json"))
    status, headers, body = await read_response(reader)
    assert status == 400 and "server" not in headers  # the lean side refused it
    assert "not valid JSON" in json.loads(body)["error"]["message"]
    writer.write(post(b"x" * 5000))  # over max_body_bytes: aiohttp refuses it, as before
    status, headers, body = await read_response(reader)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    writer.close()
    assert f.requests == 0


async def test_connection_close_is_honoured(fakes, router_client) -> None:
    (f,) = await fakes(1)
    client = await router_client([f.url])
    reader, writer = await connect(client)
    writer.write(post(extra="Connection: close\r\n"))
    status, headers, _ = await read_response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the router closed it
    writer.close()


async def test_slow_body_gets_408_and_slow_head_is_closed(fakes, router_client) -> None:
    (f,) = await fakes(1)
    client = await router_client([f.url], body_timeout_s=0.2, header_timeout_s=0.2)
    reader, writer = await connect(client)
    writer.write(post()[:-3])  # the body never completes
    status, _, body = await read_response(reader)
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    reader, writer = await connect(client)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost:")  # the head never completes
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    assert f.requests == 0


async def test_client_gone_mid_stream_releases_the_replica(fakes, router_client) -> None:
    (f,) = await fakes(1, tokens=200, token_delay_s=0.02)
    f.mode = "slow"
    client = await router_client([f.url])
    reader, writer = await connect(client)
    writer.write(post(json.dumps({"model": "tiny", "prompt": "hi", "stream": True}).encode()))
    await asyncio.wait_for(reader.readuntil(b"data:"), 5)
    tracker = client.app[REPLICAS].ordered[0].tracker
    assert tracker.outstanding == 1
    writer.close()
    await wait_for(lambda: tracker.outstanding == 0 and f.cancelled == 1)


async def test_lean_off_answers_the_same_through_aiohttp(fakes, router_client) -> None:
    (f,) = await fakes(1)
    client = await router_client([f.url], lean_listener=False)
    reader, writer = await connect(client)
    writer.write(post())
    status, headers, body = await read_response(reader)
    assert status == 200 and "aiohttp" in headers["server"] and json.loads(body)["choices"]
    writer.close()


async def test_drain_finishes_a_request_in_progress(fakes, router_client) -> None:
    (f,) = await fakes(1, tokens=10, token_delay_s=0.05)
    f.mode = "slow"
    client = await router_client([f.url])
    reader, writer = await connect(client)
    writer.write(post())
    await wait_for(lambda: f.active == 1)
    closing = asyncio.create_task(client.server.runner.cleanup())  # what SIGTERM runs (router.cli.serve)
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["choices"]
    await asyncio.wait_for(closing, 5)
    writer.close()


async def test_client_gone_while_waiting_cancels_the_request(fakes, router_client) -> None:
    (f,) = await fakes(1, token_delay_s=0.02)
    f.mode = "slow"
    f.hold("hello")  # the answer never completes: only the cancellation can end it
    client = await router_client([f.url])
    reader, writer = await connect(client)
    writer.write(post())
    await wait_for(lambda: f.active == 1)
    tracker = client.app[REPLICAS].ordered[0].tracker
    writer.close()
    await wait_for(lambda: tracker.outstanding == 0 and f.cancelled == 1)
    assert f.completed == 0


async def test_a_pipelined_request_that_is_not_plain_is_handed_over_after_the_lean_one(fakes, router_client) -> None:
    (f,) = await fakes(1)
    client = await router_client([f.url])
    reader, writer = await connect(client)
    writer.write(post() + b"GET /ready HTTP/1.1\r\nHost: r\r\n\r\n" + post())
    statuses = []
    for served_by_aiohttp in (False, True, True):
        status, headers, _ = await read_response(reader)
        statuses.append(status)
        assert ("aiohttp" in headers.get("server", "")) is served_by_aiohttp
    assert statuses == [200, 200, 200] and f.requests == 2
    writer.close()


class _Transport(asyncio.Transport):
    """Enough of a client's transport to drive a LeanConnection by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name, default=None):
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def test_the_start_runs_in_data_received_and_a_client_gone_at_once_leaves_nothing_taken(fakes, router_client):
    """A plain request is decided and sent upstream inside data_received (on an idle kept-alive connection), before
    its task first runs. A client gone before that first step: the cancel waits for it, so the task releases the
    replica, the in-flight count and the upstream connection (a task cancelled earlier never runs its coroutine)."""
    (f,) = await fakes(1, tokens=20, token_delay_s=0.05)
    client = await router_client([f.url])
    reader, writer = await connect(client)
    writer.write(post())
    assert (await read_response(reader))[0] == 200  # leaves a kept-alive connection to the replica in the pool
    writer.close()
    f.mode = "slow"
    f.hold("hello")  # from now on an answer never completes: only the cancellation can end it
    tracker, proxy = client.app[REPLICAS].ordered[0].tracker, client.app[PROXY]
    conn, transport = client.server.runner.server(), _Transport()
    conn.connection_made(transport)
    conn.data_received(post())
    assert tracker.outstanding == 1 and proxy.inflight == 1  # decided with no await in between
    conn.connection_lost(None)
    await wait_for(lambda: f.active == 1 or f.cancelled == 1)  # the request reached the replica
    await wait_for(lambda: tracker.outstanding == 0 and proxy.inflight == 0 and f.cancelled == 1)
    assert f.completed == 1  # the first request only
    assert transport.out == b""


def _random_head(rng: random.Random) -> bytes:
    line = rng.choice([b"POST /v1/completions HTTP/1.1", b"POST /v1/chat/completions HTTP/1.1", b"GET /health HTTP/1.1",
                       b"POST /v1/completions HTTP/1.0", b"POST  /v1/completions HTTP/1.1", b"POST /v1/completions?x HTTP/1.1"]
                      if rng.random() < 0.2 else [b"POST /v1/completions HTTP/1.1", b"POST /v1/chat/completions HTTP/1.1"])
    names = [b"Host", b"Content-Type", b"content-length", b"Content-Length", b"Connection", b"connection", b"X-User",
             b"Authorization", b"Transfer-Encoding", b"Expect", b"Upgrade", b"Content-Encoding", b"x-slo-ttft-ms",
             b"Bad Name", b"", b"X\x7f", b"\xc3\xa9", b"A" * 30]
    values = [b"127.0.0.1:8000", b"application/json", b"12", b" 12 ", b"007", b"", b"1" * 16, b"12a", b"keep-alive",
              b"close", b"Keep-Alive, Close", b"upgrade", b"keep-alive,  UPGRADE ", b"\tx y\t", b"a:b", b"\xc3\xa9",
              b"a\x00b", b"a\nb", b"a\rb", b"v" * 40]
    lines = [line]
    for _ in range(rng.choice((0, 1, 3, 8, 20))):
        lines.append(rng.choice(names) + rng.choice([b":", b": ", b":\t", b" :", b""]) + rng.choice(values))
    if rng.random() < 0.7:
        lines.insert(rng.randint(1, len(lines)), b"Content-Length: %d" % rng.choice((0, 5, 120)))
    head = b"\r\n".join(lines)
    if rng.random() < 0.1:
        head += rng.choice([b"\r\n", b"\n", b" "])
    if rng.random() < 0.1:
        i = rng.randrange(len(head))
        head = head[:i] + bytes([rng.randrange(256)]) + head[i + 1:]
    return head


def _parsed(head: LeanHead | None):
    return None if head is None else (head.chat, list(head.headers.items()), head.content_length, head.close)


def test_compiled_head_parser_takes_only_what_the_python_one_takes_and_reads_it_the_same() -> None:
    """router.http._fasthttp.request_head reads the common case; whatever it takes, parse_plain reads the same (chat,
    headers in order, length, close), and it takes nothing parse_plain refuses; parse_head agrees with parse_plain
    on every head."""
    if lean.request_head is None:
        skip_or_fail("the C extension router.http._fasthttp is not built (no C compiler at install)")
    rng = random.Random(11)
    taken = 0
    for _ in range(20000):
        head = _random_head(rng)
        fast, plain = lean.request_head(head), _parsed(parse_plain(head))
        if fast is not None:
            taken += 1
            assert (fast[0], fast[1], fast[2], fast[3]) == plain, head
        assert _parsed(parse_head(head)) == plain, head
    assert taken > 2000  # the comparison covered many heads the C code took (2,515 of the 2,515 plain ones)
