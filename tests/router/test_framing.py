"""Where requests begin and end in a client's byte stream (router/http/framing.py), as the aiohttp side's guards
read it: heads, Content-Length and chunked bodies, pipelining, any split of the bytes, and what it gives up on."""

from __future__ import annotations

import random

import pytest

from routewise_vllm.router.http.framing import RequestFraming

GET = b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n"
POST = b"POST /v1/embeddings HTTP/1.1\r\nHost: r\r\nContent-Length: 5\r\n\r\nhello"
CHUNKED = (b"POST /v1/embeddings HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5;ext=1\r\nhello\r\n3\r\n\r\n\r\r\n0\r\nX-Trailer: t\r\n\r\n")  # a chunk holding CRLF bytes
CODED = (b"POST /v1/embeddings HTTP/1.1\r\nTransfer-Encoding: gzip\r\ntransfer-encoding:  Chunked \r\n"
         b"Content-Length: 99\r\n\r\n2\r\nhi\r\n0\r\n\r\n")  # the last coding chunked: Content-Length ignored
STREAM = [GET, POST, CHUNKED, b"\r\n" + GET, CODED, POST]


def fed(parts: list[bytes]) -> RequestFraming:
    framing = RequestFraming()
    for part in parts:
        framing.feed(part)
    return framing


def test_heads_are_counted_through_bodies_of_either_kind():
    framing = fed([b"".join(STREAM)])
    assert framing.heads == len(STREAM) and not framing.lost and not framing.head_bytes
    assert framing.first_line == b"GET /v1/models HTTP/1.1"
    assert not framing.between  # heads unanswered
    framing.answered = len(STREAM)
    assert framing.between


@pytest.mark.parametrize("seed", range(20))
def test_any_split_of_the_bytes_reads_the_same(seed):
    rng = random.Random(seed)
    data = b"".join(STREAM) + b"GET /v1/mo"
    cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 40)))
    framing = fed([data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])])
    assert (framing.heads, framing.head_bytes, framing.lost) == (len(STREAM), 10, False)


def test_a_head_pipelined_behind_an_unanswered_request_is_not_measured():
    framing = RequestFraming()
    framing.feed(GET + b"GET /a")
    assert framing.heads == 1 and framing.head_bytes == 6 and not framing.measured
    framing.answered = 1
    framing.feed(b" HTTP/1.1\r\n\r\n")
    framing.answered = 2
    framing.feed(b"GET /b")  # begun with every request answered
    assert framing.measured and framing.head_bytes == 6


def test_the_end_of_a_head_across_two_reads():
    framing = RequestFraming()
    framing.feed(b"GET / HTTP/1.1\r\nHost: r\r\n\r")
    assert framing.head_end(b"\nrest") == 1 and framing.head_end(b"rest") == -1


@pytest.mark.parametrize("head", [
    b"GET /ws HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    b"CONNECT r:443 HTTP/1.1\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n",
])
def test_what_it_cannot_follow_is_left_to_aiohttp(head):
    framing = fed([head, GET])
    assert framing.lost and framing.heads == 1


def _random_request(rng: random.Random) -> bytes:
    """A well-formed request h11 also reads: no body, a Content-Length body, or a chunked body with extensions
    and trailers (h11 takes no transfer coding but chunked alone, so CODED is not among them)."""
    kind = rng.randrange(3)
    if kind == 0:
        return b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n"
    body = bytes(rng.choice(b"ab\r\n0;") for _ in range(rng.randrange(0, 40)))
    if kind == 1:
        return b"POST /v1/embeddings HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    chunks = b""
    while body:
        n = rng.randrange(1, len(body) + 1)
        ext = b";x=1" if rng.random() < 0.3 else b""
        chunks += b"%x%s\r\n%s\r\n" % (n, ext, body[:n])
        body = body[n:]
    trailer = b"X-T: t\r\n" if rng.random() < 0.5 else b""
    return b"POST /v1/embeddings HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n" + trailer + b"\r\n"


def _h11_heads_after_each_byte(stream: bytes) -> list[int]:
    """h11's count of complete request heads after each byte, answering each request so pipelining goes on."""
    h11 = pytest.importorskip("h11")
    conn, heads, counts = h11.Connection(h11.SERVER), 0, []
    for i in range(len(stream)):
        conn.receive_data(stream[i:i + 1])
        while True:
            event = conn.next_event()
            if event in (h11.NEED_DATA, h11.PAUSED):
                break
            if isinstance(event, h11.Request):
                heads += 1
            elif isinstance(event, h11.EndOfMessage):
                conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
                conn.send(h11.EndOfMessage())
                conn.start_next_cycle()
        counts.append(heads)
    return counts


@pytest.mark.parametrize("seed", range(20))
def test_heads_end_where_h11_reads_them_end(seed):
    """Held to h11 (a library's HTTP/1.1 parser) on the same bytes: after every byte of a pipelined stream, the
    framing has counted as many complete heads as h11 has read requests, so every body length and chunk it read
    ended where h11's did."""
    rng = random.Random(seed)
    stream = b"".join(_random_request(rng) for _ in range(rng.randrange(1, 8)))
    framing, ours = RequestFraming(), []
    for i in range(len(stream)):
        framing.feed(stream[i:i + 1])
        ours.append(framing.heads)
    assert not framing.lost
    assert ours == _h11_heads_after_each_byte(stream)
