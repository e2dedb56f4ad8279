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
