"""A replica's answer reaches the client only when it is well-formed, through each upstream client (h1client and
aiohttp's) and each server side: a control byte in a header value (CR, LF and NUL would split the client's
answer), a status outside 200-599 other than an interim 100 or 103, a head over the limit or with too many
headers, a Content-Length that is not one run of ASCII digits, a Transfer-Encoding other than chunked: each is a
502 `upstream_malformed` holding nothing of the replica's answer, counted by reason, and a failure of the replica.
A non-streamed request's head is due within idle_timeout_s in total, however the replica spins it out."""

from __future__ import annotations

import asyncio
import logging

import pytest
from multidict import CIMultiDict

from routewise_vllm.router.http import client as h1client
from routewise_vllm.router.app import METRICS, REPLICAS
from routewise_vllm.router.http.client import H1Connection, MalformedResponse, parse_response_head
from routewise_vllm.router.http.upstream import classify
from tests.fakes.harness import router_apps
from tests.fakes.scripted_replica import CLOSE, Pause, ScriptedReplica
from tests.router.conftest import FAST, TRANSPORTS

pytestmark = [pytest.mark.timeout(90)]

EVIL = b"EVIL"  # in every refused answer: none of it may reach the client


def answer(status_line: bytes, *fields: bytes, body: bytes = EVIL + b"-BODY") -> bytes:
    return b"\r\n".join([status_line, *fields]) + b"\r\n\r\n" + body


def last(status_line: bytes, *fields: bytes, body: bytes = EVIL + b"-BODY") -> bytes:
    """An answer after which the replica closes: no client pools its connection to race the close."""
    return answer(status_line, *fields, b"Connection: close", body=body)


OK_LENGTH = b"Content-Length: 9"
# name -> (the replica's answer, the reason counted): a 502 through every path
REFUSED = {
    "cr-in-value": (last(b"HTTP/1.1 200 OK", b"X-A: b\rX-EVIL: 1", OK_LENGTH), "header"),
    "nul-in-value": (last(b"HTTP/1.1 200 OK", b"X-A: b\x00EVIL", OK_LENGTH), "header"),
    "ctl-in-value": (last(b"HTTP/1.1 200 OK", b"X-A: b\x01EVIL", OK_LENGTH), "header"),
    "del-in-value": (last(b"HTTP/1.1 200 OK", b"X-A: b\x7fEVIL", OK_LENGTH), "header"),
    "status-000": (last(b"HTTP/1.1 000 X", OK_LENGTH), "status"),
    "status-099": (last(b"HTTP/1.1 099 X", OK_LENGTH), "status"),
    "status-101": (last(b"HTTP/1.1 101 Switching Protocols", b"Upgrade: evil", b"Connection: upgrade"), "status"),
    "status-600": (last(b"HTTP/1.1 600 X", OK_LENGTH), "status"),
    "status-999": (last(b"HTTP/1.1 999 X", OK_LENGTH), "status"),
    "5000-headers": (last(b"HTTP/1.1 200 OK", *[b"X: EVIL"] * 5000, OK_LENGTH),
                     "too_many_headers"),
    "70kb-head": (last(b"HTTP/1.1 200 OK", *(b"X-%d: %s" % (i, EVIL * 1750) for i in range(10)), OK_LENGTH),
                  "head_too_large"),
    "content-length-conflict": (last(b"HTTP/1.1 200 OK", b"Content-Length: 2", b"Content-Length: 9"),
                                "content_length"),
    "content-length-twice": (last(b"HTTP/1.1 200 OK", OK_LENGTH, OK_LENGTH), "content_length"),
    "content-length-superscript": (last(b"HTTP/1.1 200 OK", "Content-Length: \u00b2".encode()), "content_length"),
    "content-length-arabic-indic": (last(b"HTTP/1.1 200 OK", "Content-Length: \u0669".encode()), "content_length"),
    "content-length-sign": (last(b"HTTP/1.1 200 OK", b"Content-Length: +9"), "content_length"),
    "content-length-and-chunked": (last(b"HTTP/1.1 200 OK", OK_LENGTH, b"Transfer-Encoding: chunked",
                                          body=b"9\r\nEVIL-BODY\r\n0\r\n\r\n"), "transfer_encoding"),
    "transfer-encoding-gzip": (last(b"HTTP/1.1 200 OK", b"Transfer-Encoding: gzip"), "transfer_encoding"),
}
# h1client refuses a bare LF in a value, and every 1xx but 100 and 103; aiohttp's lax parser takes a bare LF for a
# line's end (the client gets two fields, neither holding the byte) and skips every 1xx but 101
H1_REFUSED = {
    "lf-in-value": (last(b"HTTP/1.1 200 OK", b"X-A: b\nX-EVIL: 1", OK_LENGTH), "header"),
    "lf-ends-value": (last(b"HTTP/1.1 200 OK", b"X-A: b\n", OK_LENGTH), "header"),
    "status-102": (answer(b"HTTP/1.1 102 Processing", body=b"") + last(b"HTTP/1.1 200 OK", OK_LENGTH), "status"),
}
ALLOWED = {  # interim heads skipped, as vLLM's clients do
    "continue-then-200": answer(b"HTTP/1.1 100 Continue", body=b"") * 3 + answer(b"HTTP/1.1 200 OK", b"Content-Length: 2",
                                                                                     body=b"ok"),
    "early-hints-then-200": answer(b"HTTP/1.1 103 Early Hints", b"Link: </a>", body=b"")
    + answer(b"HTTP/1.1 200 OK", b"Content-Length: 2", body=b"ok"),
}


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, list[bytes], bytes]:
    """One HTTP/1.1 answer from the router, read by its framing: (status, head lines, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    if status in (204, 304) or status < 200:
        return status, lines, b""
    if b"content-length" in fields:
        return status, lines, await reader.readexactly(int(fields[b"content-length"]))
    assert fields.get(b"transfer-encoding") == b"chunked", lines
    body = b""
    while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
        body += (await reader.readexactly(size + 2))[:-2]
    while await reader.readuntil(b"\r\n") != b"\r\n":  # the trailer section, up to its blank line
        pass
    return status, lines, body


def assert_clean_head(lines: list[bytes]) -> None:
    """No CR, LF or NUL inside a line of the head (each line was cut at CRLF)."""
    for line in lines:
        assert not {0x0D, 0x0A, 0x00} & set(line), lines


async def ask(port: int, prompt: str, stream: bool = False) -> tuple[int, list[bytes], bytes]:
    body = b'{"model": "tiny", "prompt": "%s", "max_tokens": 4, "stream": %s}' % (
        prompt.encode(), b"true" if stream else b"false")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        return await read_answer(reader)
    finally:
        writer.close()


def malformed(client, reason: str) -> float:
    rid = client.app[REPLICAS].ordered[0].id
    return client.app[METRICS].registry.get_sample_value("llm_router_upstream_malformed_total",
                                                         {"replica": rid, "reason": reason}) or 0.0


# --- the parse, without a network -------------------------------------------------------------------------------


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nX-A: b\nX-B: c", b"HTTP/1.1 200 OK\r\nX-A: b\rc", b"HTTP/1.1 200 OK\r\nX-A: b\x00",
    b"HTTP/1.1 200 OK\r\nX A: b", b"HTTP/1.1 200 O\nK", b"HTTP/1.1 000 X", b"HTTP/1.1 101 X", b"HTTP/1.1 102 X",
    b"HTTP/1.1 199 X", b"HTTP/1.1 600 X", b"HTTP/1.1 200 OK" + b"\r\nX: y" * 101])
def test_the_parse_refuses_control_bytes_odd_statuses_and_too_many_headers(head: bytes) -> None:
    with pytest.raises(MalformedResponse):
        parse_response_head(head)
    if h1client.response_head is not None:
        assert h1client.response_head(head) is None  # the C fast path leaves it to the parse


class _Wire:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


@pytest.mark.parametrize("value", ["\u00b2", "\u0662", "+2", "-2", "2, 2", "0x2", "1" * 5000, ""])
def test_a_bad_content_length_fails_the_request_and_raises_nothing_out_of_data_received(value: str) -> None:
    loop = asyncio.new_event_loop()
    try:
        conn = H1Connection(loop)
        conn.connection_made(_Wire())
        head = conn.request(b"", None)
        conn.data_received(f"HTTP/1.1 200 OK\r\nContent-Length: {value}\r\n\r\nok".encode())  # raises nothing
        assert head.done() and isinstance(head.exception(), MalformedResponse)
        assert head.exception().reason == "content_length" and classify(head.exception()) == "malformed"
    finally:
        loop.close()


@pytest.mark.parametrize("chunk", [b"0x2", b"+2", b"1_0", b" -0", b"2\n"])
def test_a_chunk_size_is_hex_digits_only(chunk: bytes) -> None:
    loop = asyncio.new_event_loop()
    try:
        conn = H1Connection(loop)
        conn.connection_made(_Wire())
        head = conn.request(b"", None)
        conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk + b"\r\nok\r\n0\r\n\r\n")
        with pytest.raises(MalformedResponse):
            head.result()[2].read_nowait()
    finally:
        loop.close()


def test_a_head_over_the_limit_is_refused_even_when_its_end_arrives_with_it() -> None:
    loop = asyncio.new_event_loop()
    try:
        conn = H1Connection(loop)
        conn.connection_made(_Wire())
        head = conn.request(b"", None)
        conn.data_received(answer(b"HTTP/1.1 200 OK", b"X: " + b"v" * 70_000, OK_LENGTH))
        assert isinstance(head.exception(), MalformedResponse) and head.exception().reason == "head_too_large"
        conn = H1Connection(loop)  # an endless trailer section is cut the same way
        conn.connection_made(_Wire())
        head = conn.request(b"", None)
        conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n")
        for _ in range(100):
            conn.data_received(b"X-Trailer: " + b"v" * 1000 + b"\r\n")
        with pytest.raises(MalformedResponse):
            head.result()[2].read_nowait()
    finally:
        loop.close()


# --- through the router -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(TRANSPORTS))
@pytest.mark.asyncio
async def test_malformed_answers_are_a_502_with_nothing_of_the_replica_and_count_against_it(path, caplog):
    lean_client = TRANSPORTS[path]["lean_client"]
    refused = {**REFUSED, **(H1_REFUSED if lean_client else {})}
    scripts = {name: [data, CLOSE] for name, (data, _) in {**REFUSED, **H1_REFUSED}.items()}
    scripts.update({name: [data] for name, data in ALLOWED.items()})
    replica = ScriptedReplica(scripts)
    url = await replica.start()
    caplog.set_level(logging.WARNING)
    try:
        async with router_apps({**FAST, **TRANSPORTS[path], "max_retries": 0, "breaker_failure_threshold": 1000,
                                "first_byte_timeout_s": 10}) as start:
            client = await start([url])
            rep = client.app[REPLICAS].ordered[0]
            for name, (_, reason) in refused.items():
                before, failures = malformed(client, reason), rep.breaker.consecutive_failures
                status, lines, body = await ask(client.port, name)
                assert_clean_head(lines)
                assert (status, EVIL in b"\r\n".join(lines) + body) == (502, False), (name, lines, body)
                assert b'"code":"upstream_malformed"' in body.replace(b" ", b""), (name, body)
                assert malformed(client, reason) == before + 1, name
                assert rep.breaker.consecutive_failures == failures + 1, name  # held against the replica
            for name in ALLOWED:
                status, lines, body = await ask(client.port, name)
                assert (status, body) == (200, b"ok"), name
            if not lean_client:  # aiohttp's parser reads a bare LF as a line's end: two fields, no LF
                for name in H1_REFUSED:
                    status, lines, body = await ask(client.port, name)
                    assert_clean_head(lines)
    finally:
        await replica.stop()
    assert not [r for r in caplog.records if "Fatal error" in r.getMessage() or r.exc_info], "a traceback was logged"
    # one line per episode: the first malformed answer of the replica is logged, the rest only counted
    assert len([r for r in caplog.records if "malformed answer" in r.getMessage()]) <= 1


@pytest.mark.parametrize("path", list(TRANSPORTS))
@pytest.mark.parametrize("script", ["endless-continue", "trickled-head"])
@pytest.mark.asyncio
async def test_a_non_streamed_head_is_due_within_the_read_timeout_in_total(path, script):
    """A replica that keeps sending interim heads, or its head a byte at a time, each within idle_timeout_s of the
    last, used to hold the request for as long as it liked (25.9 s with 6 s timeouts)."""
    final = answer(b"HTTP/1.1 200 OK", b"Content-Length: 2", body=b"ok")
    steps = {"endless-continue": [b"HTTP/1.1 100 Continue\r\n\r\n", Pause(0.05)] * 200 + [final],
             "trickled-head": [s for b in final for s in (bytes([b]), Pause(0.1))]}
    replica = ScriptedReplica({script: steps[script]})
    url = await replica.start()
    try:
        async with router_apps({**FAST, **TRANSPORTS[path], "max_retries": 0, "breaker_failure_threshold": 1000,
                                "idle_timeout_s": 0.5, "first_byte_timeout_s": 30}) as start:
            client = await start([url])
            status, lines, body = await ask(client.port, script)
    finally:
        await replica.stop()
    # h1client stops at its MAX_INTERIM'th interim head (502); otherwise the deadline answers (504)
    assert status == (502 if script == "endless-continue" and TRANSPORTS[path]["lean_client"] else 504), body


@pytest.mark.asyncio
async def test_the_session_path_checks_what_aiohttps_parser_took():
    """SessionUpstream alone: a status and a control byte aiohttp's lax parser takes are refused, the response is
    closed (its connection not reused), and a sound answer passes."""
    import aiohttp
    from yarl import URL

    from routewise_vllm.router.http.transport import SessionUpstream

    replica = ScriptedReplica({"a": [last(b"HTTP/1.1 600 X", OK_LENGTH), CLOSE],
                               "b": [last(b"HTTP/1.1 200 OK", b"X: \x01", OK_LENGTH), CLOSE],
                               "c": [answer(b"HTTP/1.1 200 OK", b"Content-Length: 2", body=b"ok")]})
    url = URL(await replica.start())
    async with aiohttp.ClientSession() as session:
        up = SessionUpstream(lambda: session, idle_timeout_s=5)
        try:
            for name in "ab":
                with pytest.raises(MalformedResponse):
                    await up.post(url, "/v1/completions", b'{"prompt": "%s"}' % name.encode(), CIMultiDict())
            resp = await up.post(url, "/v1/completions", b'{"prompt": "c"}', CIMultiDict())
            assert (resp.status, await resp.read()) == (200, b"ok")
            resp.release()
        finally:
            await replica.stop()
