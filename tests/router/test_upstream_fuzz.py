"""Replica answers mutated at random (status lines, header bytes, framing headers, chunk framing, interim heads,
byte flips, cuts), seeded:

- fed to h1client's connection in random pieces, with and without the C fast paths (router.http._fasthttp): both read
  each the same (status, headers, body, failure), no exception escapes data_received, and no head it takes holds a
  control byte in a value or a status outside 200-599;
- through the router on each transport path (lean listener or aiohttp's server side, h1client or aiohttp's
  client) to a raw keep-alive client that reads every answer by its framing: no client ever receives a CR, LF or
  NUL inside a header line, no answer leaves it waiting, and every status is 200-599."""

from __future__ import annotations

import asyncio
import random

import pytest

from routewise_vllm.router.http import client as h1client
from routewise_vllm.router.http.client import H1Connection
from tests.ci import skip_or_fail
from tests.fakes.harness import router_apps
from tests.fakes.scripted_replica import CLOSE, Pause, ScriptedReplica
from tests.router.conftest import FAST, TRANSPORTS
from tests.router.test_upstream_wellformed import assert_clean_head, read_answer

pytestmark = pytest.mark.timeout(300)

_STATUSES = [b"000", b"099", b"100", b"101", b"102", b"103", b"199", b"200", b"204", b"304", b"404", b"500", b"599",
             b"600", b"999", b"2x0", b"20", b"\xd9\xa200"]
_BAD_BYTES = b"\r\n\x00\x01\x7f: \t;\xff"


def _body(rng: random.Random, sse: bool) -> bytes:
    if sse:
        return b"".join(b'data: {"choices":[{"text":" t%d"}]}\n\n' % i for i in range(rng.randint(0, 5))) + \
            b"data: [DONE]\n\n"
    return b'{"id":"c","choices":[{"text":"%s"}]}' % (b"w" * rng.choice((0, 5, 300, 5000)))


def _chunks(rng: random.Random, body: bytes) -> bytes:
    out, pos = [], 0
    while pos < len(body):
        n = rng.choice((1, 7, 64, 4096))
        out.append(b"%x\r\n%s\r\n" % (len(body[pos:pos + n]), body[pos:pos + n]))
        pos += n
    if rng.random() < 0.15:  # chunk framing broken somewhere
        i = rng.randrange(len(out) + 1)
        out.insert(i, rng.choice([b"0x5\r\nhello\r\n", b"+5\r\nhello\r\n", b"5\r\nhelloXX", b"5\nhello\n",
                                  b"ffffffffffffffffff\r\n", b"-1\r\n", b"5;ext\r\nhello\r\n", b"5 \r\nhello\r\n"]))
    out.append(rng.choice([b"0\r\n\r\n", b"0\r\n\r\n", b"0\r\nX-T: v\r\n\r\n", b"0\r\nX-T: v\nX\r\n\r\n", b"0\r\n", b""]))
    return b"".join(out)


def random_answer(rng: random.Random, sse: bool = False) -> bytes:
    """A replica's answer: a sound one, then mutations from a few kinds."""
    body = _body(rng, sse)
    status = rng.choice(_STATUSES) if rng.random() < 0.15 else b"200"
    fields = [b"Content-Type: " + (b"text/event-stream" if sse else b"application/json"), b"X-Request-Id: r-1"]
    framing = rng.choice(("length", "chunked", "close"))
    if framing == "length":
        fields.append(b"Content-Length: %d" % len(body))
        payload = body
    elif framing == "chunked":
        fields.append(b"Transfer-Encoding: chunked")
        payload = _chunks(rng, body)
    else:
        fields.append(b"Connection: close")
        payload = body
    for _ in range(rng.choice((0, 0, 0, 0, 1, 2))):  # framing headers that conflict or are not digits
        fields.insert(rng.randrange(len(fields) + 1), rng.choice([
            b"Content-Length: 3", b"Content-Length: %d" % len(body), "Content-Length: \u00b2".encode(),
            "Content-Length: \u0663".encode(), b"Content-Length: +1", b"Content-Length: 1, 1",
            b"Content-Length: " + b"9" * 40, b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked, gzip",
            b"Transfer-Encoding: Chunked", b"X-Many: " + b"v" * 9000]))
    if rng.random() < 0.03:
        fields += [b"X-N: v"] * rng.choice((101, 200))
    head = b"\r\n".join([b"HTTP/1.1 " + status + rng.choice([b" OK", b" OK", b" OK", b"", b" O\nK", b" \x00"]), *fields])
    for _ in range(rng.choice((0, 0, 0, 0, 1, 2))):  # bytes planted or flipped in the head
        i = rng.randrange(len(head))
        if rng.random() < 0.5:
            head = head[:i] + bytes([rng.choice(_BAD_BYTES)]) + head[i:]
        else:
            head = head[:i] + bytes([rng.randrange(256)]) + head[i + 1:]
    answer = head + b"\r\n\r\n" + payload
    if rng.random() < 0.1:  # interim heads first
        answer = b"".join(rng.choice([b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"])
                          for _ in range(rng.choice((1, 3, 9, 12)))) + answer
    if rng.random() < 0.05:  # a byte flipped anywhere
        i = rng.randrange(len(answer))
        answer = answer[:i] + bytes([rng.randrange(256)]) + answer[i + 1:]
    if rng.random() < 0.05:  # cut short
        answer = answer[:rng.randrange(1, len(answer))]
    return answer


# --- the connection alone, C against Python ----------------------------------------------------------------------


class _Wire:
    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _read(answer: bytes, cuts: list[int]) -> tuple:
    """What H1Connection makes of `answer` arriving in pieces: (status, headers, body, ended, failure)."""
    loop = asyncio.new_event_loop()
    try:
        conn = H1Connection(loop)
        conn.connection_made(_Wire())
        head = conn.request(b"", None)
        body, error = b"", None
        for a, b in zip([0, *cuts], [*cuts, len(answer)]):
            conn.data_received(answer[a:b])  # nothing may escape it
            if head.done() and head.exception() is not None:
                error = f"{type(head.exception()).__name__}: {head.exception()}"
                break
            if head.done():
                try:
                    body += head.result()[2].read_nowait()
                except Exception as exc:  # noqa: BLE001 - the failure is the result compared
                    error = f"{type(exc).__name__}: {exc}"
                    break
        if not head.done() or head.exception() is not None:
            return None, None, body, False, error
        status, headers, content = head.result()
        return status, list(headers.items()), body, content.at_eof(), error
    finally:
        loop.close()


def test_the_connection_reads_mutated_answers_alike_with_and_without_c_and_takes_no_control_byte(monkeypatch):
    if h1client.response_head is None or h1client.scan_chunks is None:
        skip_or_fail("the C extension router.http._fasthttp is not built (no C compiler at install)")
    rng = random.Random(50)
    compiled = h1client.response_head, h1client.scan_chunks
    kinds: dict[str, int] = {}
    for _ in range(4000):
        answer = random_answer(rng, sse=rng.random() < 0.3)
        cuts = sorted(rng.sample(range(1, len(answer)), min(len(answer) - 1, rng.choice((0, 1, 4)))))
        monkeypatch.setattr(h1client, "response_head", compiled[0])
        monkeypatch.setattr(h1client, "scan_chunks", compiled[1])
        fast = _read(answer, cuts)
        monkeypatch.setattr(h1client, "response_head", None)
        monkeypatch.setattr(h1client, "scan_chunks", None)
        slow = _read(answer, cuts)
        assert fast == slow, (answer[:300], cuts)
        status, headers, _, _, error = fast
        if status is not None:
            assert 200 <= status <= 599, answer[:300]
            for name, value in headers:
                assert not {"\r", "\n", "\x00"} & set(name + value), answer[:300]
        kind = "taken" if status is not None else (error or "waiting").split(":")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds.get("taken", 0) > 1000 and kinds.get("MalformedResponse", 0) > 500, kinds


# --- through the router ------------------------------------------------------------------------------------------


async def _exchange(port: int, names: list[tuple[str, bool]]) -> list[tuple[int, list[bytes], bytes]]:
    """Each case on a keep-alive connection (a new one after the router closes it), each answer read by its framing
    within an outer bound: a client left waiting fails the test."""
    out = []
    reader = writer = None
    try:
        for name, stream in names:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = b'{"model": "tiny", "prompt": "%s", "max_tokens": 4, "stream": %s}' % (
                name.encode(), b"true" if stream else b"false")
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            async with asyncio.timeout(20):  # an outer bound for a busy host; an answer is due in about 0.3 s
                status, lines, data = await read_answer(reader)
            out.append((status, lines, data))
            if any(line.lower() == b"connection: close" for line in lines):
                writer.close()
                reader = writer = None
    finally:
        if writer is not None:
            writer.close()
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("path", list(TRANSPORTS))
async def test_mutated_answers_through_the_router_never_reach_a_client_malformed(path):
    rng = random.Random(f"router-{path}")
    cases: dict[str, list] = {}
    order: list[tuple[str, bool]] = []
    for i in range(150):
        stream = rng.random() < 0.3
        data = random_answer(rng, sse=stream)
        steps: list = [data] if rng.random() < 0.8 else [data[:len(data) // 2], Pause(0.001), data[len(data) // 2:]]
        cases[f"c{i}"] = [*steps, CLOSE]
        order.append((f"c{i}", stream))
    replica = ScriptedReplica(cases)
    url = await replica.start()
    try:
        async with router_apps({**FAST, **TRANSPORTS[path], "max_retries": 0, "breaker_failure_threshold": 10**6,
                                "idle_timeout_s": 0.3, "first_byte_timeout_s": 2}) as start:
            client = await start([url])
            answers = await _exchange(client.port, order)
    finally:
        await replica.stop()
    statuses: dict[int, int] = {}
    for (name, _), (status, lines, _) in zip(order, answers):
        assert_clean_head(lines)
        assert 200 <= status <= 599, (name, lines)
        statuses[status] = statuses.get(status, 0) + 1
    assert len(answers) == len(order) and statuses.get(200, 0) > 20 and statuses.get(502, 0) > 20, statuses
