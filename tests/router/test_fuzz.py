"""Hostile input against a live router on loopback (3 fake replicas): raw sockets where a user could send
anything, the official openai client where a user would. Whatever arrives: no 5xx, every answer in the OpenAI
error shape, at most one log line and no traceback per bad request, nothing a client sends takes a healthy
replica out of rotation, and the router's outstanding counters return to 0."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging

import openai
import pytest
from pydantic import ValidationError

from routewise_vllm.router.app import METRICS, PROXY, REPLICAS
from routewise_vllm.router.settings import RouterSettings
from tests.router.conftest import wait_for

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

TOKEN = "fuzz-admin-token"


async def raw_exchange(port: int, data: bytes, timeout: float = 3.0) -> bytes:
    """Send `data` on a fresh connection and read until the router closes it (or `timeout`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        try:
            async with asyncio.timeout(timeout):
                while chunk := await reader.read(65536):
                    out += chunk
        except TimeoutError:
            pass
        return out
    finally:
        writer.close()


def responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP/1.1 responses in `raw` (Content-Length framed, as the router answers errors)."""
    out = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, f"truncated response: {raw[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        if "content-length" in headers:
            n = int(headers["content-length"])
            body, raw = rest[:n], rest[n:]
        elif headers.get("transfer-encoding") == "chunked":
            body, raw = _dechunk(rest)
        else:
            body, raw = rest, b""
        out.append((status, headers, body))
    return out


def _dechunk(data: bytes) -> tuple[bytes, bytes]:
    body = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        n = int(size_line.split(b";")[0], 16)
        if n == 0:
            return body, data.partition(b"\r\n")[2]
        body, data = body + data[:n], data[n + 2:]


def assert_openai_error(status: int, headers: dict[str, str], body: bytes) -> dict:
    assert 400 <= status < 500, (status, body[:300])
    assert headers.get("content-type", "").startswith("application/json"), (headers, body[:300])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def req(method: str, path: str, body: bytes = b"", headers: str = "", version: str = "1.1") -> bytes:
    h = f"{method} {path} HTTP/{version}\r\nHost: router\r\n{headers}"
    if body and "content-length" not in headers.lower() and "transfer-encoding" not in headers.lower():
        h += f"Content-Length: {len(body)}\r\n"
    return h.encode() + b"\r\n" + body


COMPLETION = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
CLOSE = "Connection: close\r\nContent-Type: application/json\r\n"

# (name, raw request): each must get only 4xx OpenAI-shaped errors (or a 200 for a well-formed request)
HOSTILE = [
    ("deep-json", req("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, CLOSE)),
    ("deep-json-object", req("POST", "/v1/chat/completions", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, CLOSE)),
    ("bogus-gzip", req("POST", "/v1/completions", b"\x1f\x8bnot gzip at all", CLOSE + "Content-Encoding: gzip\r\n")),
    ("absurd-max-tokens", req("POST", "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 10**12}).encode(), CLOSE)),
    ("absurd-n", req("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "x", "n": 10**9}).encode(),
                     CLOSE)),
    ("unknown-path", req("GET", "/v2/whatever", headers=CLOSE)),
    ("root", req("GET", "/", headers=CLOSE)),
    ("wrong-method", req("GET", "/v1/completions", headers=CLOSE)),
    ("delete-v1", req("DELETE", "/v1/anything", headers=CLOSE)),
    ("escape", req("POST", "/v1/%2e%2e/reset_prefix_cache", b"{}", CLOSE)),
    ("escape-sleep", req("POST", "/v1/%2e%2e/sleep?level=1", b"{}", CLOSE)),
    ("cl-and-te", req("POST", "/v1/completions", b"5\r\nhello\r\n0\r\n\r\n",
                      CLOSE + "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n")),
    ("duplicate-cl", req("POST", "/v1/completions", COMPLETION,
                         CLOSE + f"Content-Length: {len(COMPLETION)}\r\nContent-Length: 3\r\n")),
    ("te-obfuscated", req("POST", "/v1/completions", COMPLETION, CLOSE + "Transfer-Encoding: xchunked\r\n")),
    ("bad-chunk-size", req("POST", "/v1/completions", b"zz\r\nhello\r\n0\r\n\r\n",
                           CLOSE + "Transfer-Encoding: chunked\r\n")),
    ("huge-header", req("GET", "/v1/models", headers=CLOSE + "X-Big: " + "a" * 200_000 + "\r\n")),
    ("many-headers", req("GET", "/v1/models", headers=CLOSE + "".join(f"X-{i}: v\r\n" for i in range(20_000)))),
    ("garbage-line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http\r\n\r\n"),
    ("bad-version", b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n"),
    ("header-no-colon", b"GET /v1/models HTTP/1.1\r\nHost x\r\n\r\n"),
    ("nul-in-path", b"GET /v1/mo\x00dels HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    ("body-too-large", req("POST", "/v1/completions", b"", CLOSE + "Content-Length: 999999999999\r\n")),
    ("not-json", req("POST", "/v1/completions", b"\xff\xfe\x00garbage", CLOSE)),
    ("admin-no-token", req("POST", "/admin/policy/reload", b'{"arm": ["x"]}', CLOSE)),
]


@pytest.fixture
async def fleet(fakes, router_client):
    replicas = await fakes(3)
    client = await router_client([f.url for f in replicas], admin_token=TOKEN, header_timeout_s=0.5,
                                 body_timeout_s=0.5, breaker_failure_threshold=2)
    await wait_for(lambda: all(r.routable for r in client.app[REPLICAS].ordered) and client.app[REPLICAS].known_models)
    return replicas, client


def settled(client) -> bool:
    return client.app[PROXY].inflight == 0 and all(r.tracker.outstanding == 0 for r in client.app[REPLICAS].ordered)


def all_routable(client) -> bool:
    return all(r.routable for r in client.app[REPLICAS].ordered)


@pytest.mark.parametrize("name,data", HOSTILE, ids=[n for n, _ in HOSTILE])
async def test_hostile_requests_get_one_openai_4xx_and_one_log_line(fleet, caplog, name, data):
    replicas, client = fleet
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    caplog.set_level(logging.INFO, logger="router")
    got = responses(await raw_exchange(client.port, data))
    assert got, f"{name}: no answer"
    for status, headers, body in got:
        assert_openai_error(status, headers, body)
    noisy = [r for r in caplog.records if r.levelno >= logging.INFO and r.name.startswith(("aiohttp", "router"))
             and r.name != "aiohttp.access"]  # the access log is off unless access_log is set
    assert len(noisy) <= 1, [r.getMessage()[:200] for r in noisy]
    assert not any(r.exc_info for r in noisy), name
    assert sum(f.requests for f in replicas) == 0, f"{name} reached a replica"
    await wait_for(lambda: settled(client))
    assert all_routable(client)


async def test_admin_reload_with_a_bad_body_is_400(fleet):
    _, client = fleet
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for body in (b'{"arm": ["x"]}', b'{"arm": {"a": 1}}', b'{"path": 3}', b"[" * 100_000, b"\xff"):
        resp = await client.post("/admin/policy/reload", data=body, headers=auth)
        assert 400 <= resp.status < 500, (body[:20], resp.status)
        assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}


async def test_gzip_request_is_served_and_never_ejects_a_replica(fleet):
    """The router used to forward a decompressed body still labelled gzip: every replica answered 500 and
    five requests emptied the fleet."""
    replicas, client = fleet
    for _ in range(10):
        resp = await client.post("/v1/completions", data=gzip.compress(COMPLETION),
                                 headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
        assert resp.status == 200, await resp.text()
    assert all("Content-Encoding" not in h for f in replicas for h in f.headers)
    assert all_routable(client)


async def test_requests_that_make_every_replica_fail_do_not_eject_them(fleet, caplog):
    """vLLM answers some malformed input with a 500: a client repeating it must not take healthy replicas out
    (nor write more than a line per request)."""
    replicas, client = fleet
    caplog.set_level(logging.INFO, logger="router")
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0, timeout=5)
    for i in range(20):
        with pytest.raises(openai.InternalServerError):
            await api.completions.create(model="tiny", prompt=f"POISON {i}", max_tokens=2, stream=bool(i % 2))
    assert all_routable(client)
    assert all(r.breaker.trips == 0 for r in client.app[REPLICAS].ordered)
    assert client.app[METRICS].registry.get_sample_value("llm_router_client_caused_failures_total",
                                                         {"kind": "http_5xx"}) >= 20
    lines = [r for r in caplog.records if r.name.startswith("router") and r.levelno >= logging.INFO]
    assert len(lines) <= 20, [r.getMessage() for r in lines[:5]]
    r = await api.completions.create(model="tiny", prompt="fine", max_tokens=2)
    assert r.choices[0].text == " tok0 tok1"
    await wait_for(lambda: settled(client))


async def test_pipelined_and_http10_requests(fleet):
    replicas, client = fleet
    one = req("POST", "/v1/completions", COMPLETION, "Content-Type: application/json\r\n")
    bad = req("POST", "/v1/completions", b"{", "Content-Type: application/json\r\n")
    last = req("GET", "/v1/models", headers="Connection: close\r\n")
    got = responses(await raw_exchange(client.port, one + bad + one + last))
    assert [s for s, _, _ in got] == [200, 400, 200, 200]
    assert_openai_error(*got[1])
    got = responses(await raw_exchange(client.port, req("POST", "/v1/completions", COMPLETION,
                                                        "Content-Type: application/json\r\n", version="1.0")))
    assert [s for s, _, _ in got] == [200]
    assert json.loads(got[0][2])["choices"][0]["text"] == " tok0 tok1"
    await wait_for(lambda: settled(client))


async def test_slow_headers_and_slow_bodies_are_timed_out(fleet):
    _, client = fleet
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(b"GET /v1/mod")  # then nothing: a slow-loris client
    assert await asyncio.wait_for(reader.read(), 60) == b""  # closed by the router (its header timeout), not by us
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(req("POST", "/v1/completions", b"", "Content-Length: 100\r\n") + b'{"model"')
    got = responses(await asyncio.wait_for(reader.read(), 5))
    writer.close()
    assert got[0][0] == 408 and assert_openai_error(*got[0])["code"] == "request_timeout"
    await wait_for(lambda: settled(client))


async def test_connection_cap(fakes, router_client):
    (a,) = await fakes(1)
    client = await router_client([a.url], max_client_connections=3, max_connections_per_client=3, header_timeout_s=5)
    held = [await asyncio.open_connection("127.0.0.1", client.port) for _ in range(3)]
    for _, w in held:
        w.write(b"GET /v1/mod")  # a request under way: not idle, so not closed to make room
    await wait_for(lambda: client.server.runner.conns.idle_count == 0)
    got = responses(await raw_exchange(client.port, req("GET", "/v1/models"), timeout=2))
    assert got[0][0] == 503 and json.loads(got[0][2])["error"]["code"] == "too_many_connections"
    for _, w in held:
        w.close()
    await asyncio.sleep(0.05)
    got = responses(await raw_exchange(client.port, req("GET", "/v1/models", headers="Connection: close\r\n")))
    assert got[0][0] == 200


async def test_exposure_defaults(fleet):
    replicas, client = fleet
    resp = await client.post("/v1/completions", data=COMPLETION, headers={
        "Content-Type": "application/json", "X-Forwarded-For": "6.6.6.6"})
    assert resp.status == 200
    assert "x-routewise-replica" not in resp.headers and resp.headers["x-routewise-arm"] == "main"
    sent = [h for f in replicas for h in f.headers][-1]
    assert sent["X-Forwarded-For"] == "6.6.6.6, 127.0.0.1"  # appended, not passed on as the client wrote it


async def test_empty_admin_token_is_refused(tmp_path):
    for bad in ("", "   "):
        with pytest.raises(ValidationError, match="admin_token is empty"):
            RouterSettings(replicas=["http://127.0.0.1:1"], admin_token=bad)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValidationError, match="the file is empty"):
        RouterSettings(replicas=["http://127.0.0.1:1"], admin_token_file=tmp_path / "empty")
    (tmp_path / "tok").write_text("s3cret\n")
    s = RouterSettings(replicas=["http://127.0.0.1:1"], admin_token_file=tmp_path / "tok")
    assert s.admin_token.get_secret_value() == "s3cret"


async def test_ops_listener_takes_metrics_and_admin_off_the_public_port(fakes, router_client):
    from aiohttp.test_utils import TestClient

    from routewise_vllm.router.app import OPS_APP
    from tests.fakes.harness import RouterTestServer

    (a,) = await fakes(1)
    client = await router_client([a.url], admin_token=TOKEN, ops_port=0)
    for path in ("/metrics", "/admin/status"):
        resp = await client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
    ops = TestClient(RouterTestServer(client.app[OPS_APP], client.server.settings, host="127.0.0.1"))
    await ops.start_server()
    try:
        assert (await ops.get("/metrics")).status == 200
        assert (await ops.get("/admin/status", headers={"Authorization": f"Bearer {TOKEN}"})).status == 200
        assert (await ops.get("/ready")).status == 200
    finally:
        await ops.close()
