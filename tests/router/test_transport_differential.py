"""One corpus of requests and replica answers through each of the four transport paths (lean listener or aiohttp's
server side, times h1client or aiohttp's client): every path must give the client the same status, headers and
body, byte for byte, and account each request the same way (requests by code class, upstream errors by kind).

The replica writes exact bytes (tests/fakes/scripted_replica.py): sizes from 0 to 1 MB, Content-Length, chunked
in uneven chunks and until-close framing, a compressed body, hop-by-hop headers, 4xx and 5xx statuses, a replica
that resets before its head, cuts a body or a chunk short or sends a head no client can read or one that is not
well-formed (a status outside 200-599, a control byte in a value, a bad Content-Length: a 502 `upstream_malformed`
on every path, counted by the same reason), interim heads before the answer, and streams whose
SSE events are split across reads (mid-`data:`, between the two newlines) or cut mid-stream.

What is not compared, and why:
- Date and Server: each server side writes its own (the time, and aiohttp names itself; the lean listener does
  not), neither comes from the replica (the router drops the replica's).
- The text of the router's own 502 message after a failed attempt: it quotes the client library's exception
  (`ClientPayloadError: Response payload is not completed` and aiohttp's wording of the same failure differ); its
  status, type and code (`upstream_reset`, ...) are compared, and so is the Content-Length of every other answer.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import aiohttp
import pytest

from routewise_vllm.router.app import H1, METRICS
from tests.fakes.scripted_replica import CLOSE, ScriptedReplica, chunked, head, sized, until_close
from tests.router.conftest import FAST, TRANSPORTS
from tests.fakes.harness import router_apps

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

KB, MB = 1 << 10, 1 << 20
JSON = [("Content-Type", "application/json")]
SSE = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")]


def completion(n: int) -> bytes:
    """A completion answer of about n bytes."""
    words = " ".join(f"w{i}" for i in range(max(1, n // 7)))
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "tiny",
                       "choices": [{"index": 0, "text": words, "finish_reason": "length"}]}).encode()


def events(k: int) -> bytes:
    out = b"".join(b'data: {"id":"c","choices":[{"index":0,"text":" tok%d"}]}\n\n' % i for i in range(k))
    return out + b"data: [DONE]\n\n"


def cut(data: bytes, at: list[int]) -> list[bytes]:
    edges = [0, *at, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:]) if b > a]


def uneven(data: bytes) -> list[bytes]:
    sizes, out, pos = (1, 7, 4093, 65536, 100_003), [], 0
    while pos < len(data):
        n = sizes[len(out) % len(sizes)]
        out.append(data[pos:pos + n])
        pos += n
    return out


def error(status: int, message: str) -> bytes:
    return json.dumps({"object": "error", "message": message, "type": "BadRequestError", "param": None,
                       "code": status}).encode()


_SSE6 = events(6)
# the answers the client must get as the replica wrote them
OWN = {"ok-small": completion(100), "ok-empty": b"", "ok-1kb-chunked": completion(KB),
       "ok-300kb-until-close": completion(300 * KB), "ok-1mb-sized": completion(MB), "ok-1mb-chunked": completion(MB),
       "gzip": gzip.compress(completion(2000), mtime=0), "400": error(400, "bad max_tokens"),
       "404": error(404, "no such route"), "429": error(429, "slow down"), "500": error(500, "engine dead"),
       "503-chunked": error(503, "overloaded"), "sse-split": _SSE6, "sse-one-chunk": events(3), "sse-sized": events(4),
       "sse-until-close": events(4), "sse-empty": b""}
_SPLIT = [3, 20, 57, 58, 59, 120, 121, 200, len(_SSE6) - 15, len(_SSE6) - 1]  # mid-"data:", between "\n\n", ...

# name -> (streamed request, the replica's steps)
CORPUS: dict[str, tuple[bool, list]] = {
    "ok-small": (False, sized(200, completion(100), [*JSON, ("X-Request-Id", "r-1"), ("Set-Cookie", "a=b; Path=/"),
                                                     ("Cache-Control", "no-store")])),
    "ok-empty": (False, sized(200, b"")),
    "ok-1kb-chunked": (False, chunked(200, uneven(completion(KB)), JSON)),
    "ok-300kb-until-close": (False, until_close(200, completion(300 * KB), JSON)),
    "ok-1mb-sized": (False, sized(200, completion(MB), JSON)),
    "ok-1mb-chunked": (False, chunked(200, uneven(completion(MB)), JSON)),
    "gzip": (False, sized(200, OWN["gzip"], [*JSON, ("Content-Encoding", "gzip"),
                                                                  ("Vary", "Accept-Encoding")])),
    "hop-by-hop": (False, sized(200, completion(50), [*JSON, ("Connection", "keep-alive, X-Hop"), ("X-Hop", "1"),
                                                      ("Keep-Alive", "timeout=5"), ("Proxy-Authenticate", "Basic"),
                                                      ("X-Kept", "yes")])),
    "204": (False, [head(204, [("X-A", "b")])]),
    "ok-no-type": (False, sized(200, b"plain")),
    "400": (False, sized(400, error(400, "bad max_tokens"), JSON)),
    "404": (False, sized(404, error(404, "no such route"), JSON)),
    "429": (False, sized(429, error(429, "slow down"), [*JSON, ("Retry-After", "3")])),
    "500": (False, sized(500, error(500, "engine dead"), JSON)),
    "503-chunked": (False, chunked(503, cut(error(503, "overloaded"), [5, 9]), JSON)),
    "reset-before-head": (False, [CLOSE]),
    "cut-mid-body": (False, [head(200, [*JSON, ("Content-Length", 1000)]) + b"x" * 500, CLOSE]),
    "cut-mid-chunk": (False, [head(200, [*JSON, ("Transfer-Encoding", "chunked")]) + b"100\r\n" + b"y" * 50, CLOSE]),
    "malformed-head": (False, [b"HTTP/1.1 2x0 OK\r\n\r\n", CLOSE]),
    # refused by h1client's parse, by aiohttp's, or by the check of what aiohttp's lax parser took: alike
    "status-600": (False, [head(600, [*JSON, ("Content-Length", 2), ("Connection", "close")]) + b"{}", CLOSE]),
    "status-101": (False, [head(101, [("Upgrade", "h2c"), ("Connection", "upgrade")]), CLOSE]),
    "control-byte-in-value": (False, sized(200, b"{}", [("X-A", "b\x01c"), ("Connection", "close")]) + [CLOSE]),
    "nul-in-value": (False, sized(200, b"{}", [("X-A", "b\x00c"), ("Connection", "close")]) + [CLOSE]),
    "content-length-twice": (False, [head(200, [("Content-Length", 2), ("Content-Length", 20)]) + b"{}", CLOSE]),
    "content-length-superscript": (False, [head(200, [("Content-Length", "\u00b2")]) + b"{}", CLOSE]),
    "transfer-encoding-gzip": (False, [head(200, [("Transfer-Encoding", "gzip"), ("Connection", "close")]) + b"{}",
                                       CLOSE]),
    "200-headers": (False, sized(200, b"{}", [("X-N", "v")] * 200 + [("Connection", "close")]) + [CLOSE]),
    "continue-then-ok": (False, [head(100, reason="Continue"), head(103, [("Link", "</a>")], reason="Early Hints"),
                                 *sized(200, b"{}", JSON)]),
    "sse-status-999": (True, [head(999, [*SSE, ("Content-Length", 2), ("Connection", "close")]) + b"{}", CLOSE]),
    "sse-split": (True, chunked(200, cut(_SSE6, _SPLIT), SSE, pause=0.01)),
    "sse-one-chunk": (True, chunked(200, [events(3)], SSE)),
    "sse-sized": (True, sized(200, events(4), SSE)),
    "sse-until-close": (True, until_close(200, events(4), SSE)),
    "sse-empty": (True, chunked(200, [], SSE)),
    "sse-cut": (True, chunked(200, cut(events(5), [60, 120]), SSE, pause=0.01)[:-3] + [b"40\r\ndata: {", CLOSE]),
    "sse-no-type": (True, chunked(200, [events(2)])),
    "sse-204": (True, [head(204, [("X-A", "b")])]),
    "sse-400": (True, sized(400, error(400, "bad stream"), JSON)),
    "sse-500": (True, sized(500, error(500, "engine dead"), JSON)),
    "sse-reset-before-head": (True, [CLOSE]),
}
SKIP_HEADERS = {"date", "server"}
COUNTED = ("llm_router_requests_total", "llm_router_upstream_errors_total", "llm_router_upstream_malformed_total")


def counts(client) -> dict[tuple, float]:
    out = {}
    for metric in client.app[METRICS].registry.collect():
        for s in metric.samples:
            if s.name in COUNTED:
                out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica")))] = s.value
    return out


def seen(status: int, headers: list[tuple[str, str]], body: bytes) -> dict[str, Any]:
    """What the client got, less what differs by design (the module docstring)."""
    # sorted by name, in order within a name: only the order of fields of one name carries meaning (RFC 9110 5.3)
    hs = sorted(((k.lower(), v) for k, v in headers if k.lower() not in SKIP_HEADERS), key=lambda kv: kv[0])
    if status == 502 and body.startswith(b'{"error"'):
        err = json.loads(body)["error"]
        assert err["message"].startswith("upstream failed: "), err
        err["message"] = "upstream failed: <the client library's exception>"
        hs = [(k, v) for k, v in hs if k != "content-length"]
        return {"status": status, "headers": hs, "error": err}
    return {"status": status, "headers": hs, "body": body}


async def run_corpus(start, url: str) -> dict[str, dict[str, Any]]:
    client = await start([url])
    out: dict[str, dict[str, Any]] = {}
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        for name, (stream, _) in CORPUS.items():
            before = counts(client)
            async with session.post(client.make_url("/v1/completions"), json={
                    "model": "tiny", "prompt": name, "max_tokens": 4, "stream": stream}) as resp:
                body = await resp.read()
                got = seen(resp.status, list(resp.headers.items()), body)
            after = counts(client)
            got["counted"] = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
            out[name] = got
    out["_h1_pools"] = {"used": bool(client.app[H1]._pools)}  # which upstream client carried the requests
    return out


@pytest.mark.slow  # over 5 s on 2 cores: outside the fast loop
async def test_every_path_answers_the_corpus_the_same():
    replica = ScriptedReplica({name: steps for name, (_, steps) in CORPUS.items()})
    url = await replica.start()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        for path, forced in TRANSPORTS.items():
            async with router_apps({**FAST, **forced, "first_byte_timeout_s": 10, "breaker_failure_threshold": 1000,
                                    "max_retries": 0}) as start:
                results[path] = await run_corpus(start, url)
    finally:
        await replica.stop()
    assert replica.requests == list(CORPUS) * len(TRANSPORTS)  # each request reached the replica once, in order
    assert [r["_h1_pools"]["used"] for r in results.values()] == [f["lean_client"] for f in TRANSPORTS.values()]
    ref_path, ref = next(iter(results.items()))

    # the reference itself is right where the answer is the replica's own
    for name, expected in OWN.items():
        assert ref[name]["body"] == expected, name
    assert ref["sse-cut"]["body"].startswith(events(5)[:120]) and b'"error"' in ref["sse-cut"]["body"]
    assert ("x-kept", "yes") in ref["hop-by-hop"]["headers"]
    assert not {"x-hop", "keep-alive", "proxy-authenticate"} & {k for k, _ in ref["hop-by-hop"]["headers"]}
    assert ("retry-after", "3") in ref["429"]["headers"] and ("content-encoding", "gzip") in ref["gzip"]["headers"]
    for name in ("reset-before-head", "cut-mid-body", "cut-mid-chunk", "sse-reset-before-head"):
        assert (ref[name]["status"], ref[name]["error"]["code"]) == (502, "upstream_reset"), name
    for name in ("malformed-head", "status-600", "status-101", "control-byte-in-value", "nul-in-value",
                 "content-length-twice", "content-length-superscript", "transfer-encoding-gzip", "200-headers",
                 "sse-status-999"):
        assert (ref[name]["status"], ref[name]["error"]["code"]) == (502, "upstream_malformed"), name
    assert (ref["continue-then-ok"]["status"], ref["continue-then-ok"]["body"]) == (200, b"{}")

    differences = [f"{name} via {path}: {k}: {got[k]!r:.300} != {ref[name][k]!r:.300} via {ref_path}"
                   for path, answers in results.items() for name, got in answers.items() if not name.startswith("_")
                   for k in sorted(set(got) | set(ref[name])) if got.get(k) != ref[name].get(k)]
    assert not differences, "\n".join(differences)
