"""Connection limits that keep the router up (router/http/connections.py, router/http/listener.py, router/http/server.py), on
loopback: distinct 127.0.0.x source addresses are distinct clients. Idle sockets from one address do not lock out
another, idle keep-alive connections are closed to make room, /health and /ready answer at the cap, refusals are
counted and logged once per episode, heads over max_header_bytes get a 431; and `router serve` under a low
open-file limit derives its cap from it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import signal
import socket
import sys
from pathlib import Path

import pytest

import routewise_vllm.router.http.connections
from routewise_vllm import router
from routewise_vllm.router.app import METRICS
from routewise_vllm.router.settings import RouterSettings
from tests.router.conftest import wait_for
from tests.router.test_fuzz import assert_openai_error, responses

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
BODY = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
REPLICAS = ["http://127.0.0.1:1"]
LEAN = pytest.mark.parametrize("lean", [True, False], ids=["lean", "aiohttp"])


def post(extra: str = "", body: bytes = BODY) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: r\r\n{extra}\r\n".encode()


async def open_from(address: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0))


async def read_one(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    return int(lines[0].split()[1]), headers, body


async def exchange(address: str, port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request from `address` on a new connection, and its answer."""
    reader, writer = await open_from(address, port)
    try:
        writer.write(data)
        return await read_one(reader)
    finally:
        writer.close()


async def closed_by_router(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 5) == b""
    except ConnectionResetError:
        return True


def counter(client, name: str, **labels: str) -> float:
    return client.app[METRICS].registry.get_sample_value(name, labels or None) or 0.0


@LEAN
async def test_idle_keepalive_connections_are_closed_to_make_room(fakes, router_client, lean):
    """At the cap, the connection idle the longest (a kept-alive one between requests) is closed and the new
    client served; the old code refused the new one with a 503."""
    (f,) = await fakes(1)
    client = await router_client([f.url], max_client_connections=4, lean_listener=lean)
    kept = []
    for i in range(4):  # four clients, each with a kept-alive connection after one request
        reader, writer = await open_from(f"127.0.0.{10 + i}", client.port)
        writer.write(post())
        assert (await read_one(reader))[0] == 200
        kept.append((reader, writer))
    status, _, body = await exchange("127.0.0.20", client.port, post())
    assert status == 200, body
    assert await closed_by_router(kept[0][0])  # the longest idle
    for reader, writer in kept[1:]:  # the others still serve
        writer.write(post())
        assert (await read_one(reader))[0] == 200
    assert counter(client, "llm_router_idle_connections_closed_total") == 1
    assert counter(client, "llm_router_connections_refused_total", reason="global_cap") == 0
    for _, w in kept:
        w.close()


async def test_idle_sockets_from_one_address_do_not_lock_out_another(fakes, router_client):
    """One address holding every connection it can (requests under way, nothing idle) is stopped at its
    per-client cap; another address is still served."""
    (f,) = await fakes(1)
    client = await router_client([f.url], max_client_connections=20, header_timeout_s=30)
    conns = client.server.runner.conns
    held = []
    for i in range(30):
        reader, writer = await open_from("127.0.0.2", client.port)
        writer.write(b"GET /v1/mod")  # a head under way: not idle
        held.append((reader, writer))
        if i < 10:  # admitted (the per-client cap is half the cap), and busy before the next one comes
            await wait_for(lambda: conns.open == i + 1 and conns.idle_count == 0)
    status, _, body = await exchange("127.0.0.3", client.port, post())
    assert status == 200, body
    refused = 0
    for reader, _ in held[10:]:
        status, headers, body = await read_one(reader)
        assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"
        refused += 1
    assert refused == 20 == counter(client, "llm_router_connections_refused_total", reason="per_client_cap")
    for _, w in held:
        w.close()


@LEAN
async def test_health_and_ready_answer_at_the_cap(fakes, router_client, lean):
    """With every connection busy and none idle, a new one still gets /health and /ready; anything else a 503."""
    (f,) = await fakes(1)
    client = await router_client([f.url], max_client_connections=4, header_timeout_s=30, lean_listener=lean)
    conns = client.server.runner.conns
    held = []
    for i in range(4):
        reader, writer = await open_from(f"127.0.0.{30 + i}", client.port)
        writer.write(b"POST /v1/compl")
        held.append((reader, writer))
        await wait_for(lambda: conns.open == i + 1 and conns.idle_count == 0)
    for path in ("/health", "/ready"):
        status, headers, body = await exchange("127.0.0.40", client.port, get(path))
        assert status == 200, (path, body)
        assert headers.get("connection", "").lower() == "close"
    for data in (post(), get("/v1/models")):
        status, _, body = await exchange("127.0.0.40", client.port, data)
        assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections", body
    assert f.requests == 0
    assert counter(client, "llm_router_connections_refused_total", reason="global_cap") == 2
    for _, w in held:
        w.close()


async def test_refusals_are_counted_and_logged_once_per_episode(fakes, router_client, caplog, monkeypatch):
    """A burst of refusals is one line when it starts and one when it ends (EPISODE_QUIET_S without a refusal),
    whatever its size; each refusal is counted."""
    monkeypatch.setattr(router.http.connections, "EPISODE_QUIET_S", 5.0)
    (f,) = await fakes(1)
    client = await router_client([f.url], max_client_connections=4, header_timeout_s=30)
    conns = client.server.runner.conns
    caplog.set_level(logging.INFO, logger="router")
    starts = lambda: [r for r in caplog.records if "refusing new ones" in r.getMessage()]  # noqa: E731
    ends = lambda: [r for r in caplog.records if "refused (" in r.getMessage()]  # noqa: E731
    held = []
    for i in range(2):  # 127.0.0.50 at its per-client cap, with requests under way
        reader, writer = await open_from("127.0.0.50", client.port)
        writer.write(b"GET /v1/mod")
        held.append(writer)
        await wait_for(lambda: conns.open == i + 1 and conns.idle_count == 0)
    for _ in range(12):
        status, _, _ = await exchange("127.0.0.50", client.port, get("/health"))
        assert status == 503
    assert counter(client, "llm_router_connections_refused_total", reason="per_client_cap") == 12
    assert len(starts()) == 1 and "127.0.0.50" in starts()[0].getMessage() and not ends()
    await wait_for(lambda: len(ends()) == 1, timeout=20)  # the episode ends after a quiet spell
    assert "12 refused (per_client_cap, first from 127.0.0.50)" in ends()[0].getMessage()
    for _ in range(3):  # the next refusal starts a new episode
        assert (await exchange("127.0.0.50", client.port, get("/health")))[0] == 503
    assert len(starts()) == 2 and len(ends()) == 1
    assert counter(client, "llm_router_connections_refused_total", reason="per_client_cap") == 15
    assert not [r for r in caplog.records if r.exc_info]
    for w in held:
        w.close()


@LEAN
@pytest.mark.parametrize("kind", ["one-header", "many-headers", "unfinished", "second-on-keepalive"])
async def test_heads_over_max_header_bytes_get_431(fakes, router_client, lean, kind):
    (f,) = await fakes(1)
    client = await router_client([f.url], max_header_bytes=4096, lean_listener=lean)
    big = "X-Big: " + "a" * 5000 + "\r\n"
    many = "".join(f"X-H{i}: {'b' * 60}\r\n" for i in range(80))  # 80 lines of 70 bytes: each within any limit
    reader, writer = await open_from("127.0.0.1", client.port)
    if kind == "second-on-keepalive":
        writer.write(post())
        assert (await read_one(reader))[0] == 200
        writer.write(get("/v1/models", big))
    elif kind == "unfinished":  # no end of head in sight
        writer.write(b"POST /v1/completions HTTP/1.1\r\nX-Big: " + b"a" * 6000)
    else:
        writer.write(post(big if kind == "one-header" else many))
    status, headers, body = await read_one(reader)
    assert status == 431
    err = assert_openai_error(status, headers, body)
    assert err["code"] == "request_header_fields_too_large" and "4096" in err["message"]
    assert await closed_by_router(reader)
    writer.close()
    assert f.requests == (1 if kind == "second-on-keepalive" else 0)
    # a head just within the limit is served, as before
    status, _, _ = await exchange("127.0.0.1", client.port, post("X-Fits: " + "c" * 3800 + "\r\n"))
    assert status == 200


@LEAN
@pytest.mark.parametrize("second", ["long-line", "too-many"])
async def test_a_pipelined_head_over_the_limits_gets_431_from_aiohttps_parser(fakes, router_client, lean, second):
    """A head read in one chunk behind another request is not measured by the router: it meets aiohttp's own limits
    (a line of max_header_bytes, 128 headers), whose 400 becomes the router's 431."""
    (f,) = await fakes(1)
    client = await router_client([f.url], max_header_bytes=4096, lean_listener=lean)
    extra = "X-Big: " + "a" * 5000 + "\r\n" if second == "long-line" else "".join(f"X-{i}: v\r\n" for i in range(200))
    got = responses(await _send_all(client.port, get("/v1/models") + get("/v1/models", extra)))
    # aiohttp answers an error in a read for the whole read: the request before it may go unanswered
    assert [s for s, _, _ in got] in ([200, 431], [431])
    assert assert_openai_error(*got[-1])["code"] == "request_header_fields_too_large"


async def test_default_max_header_bytes_refuses_the_64k_heads_the_router_passed_on(fakes, router_client):
    (f,) = await fakes(1)
    client = await router_client([f.url])
    got = responses(await _send_all(client.port, post("X-Big: " + "a" * 60_000 + "\r\nConnection: close\r\n")))
    assert [s for s, _, _ in got] == [431] and f.requests == 0
    assert_openai_error(*got[0])


async def _send_all(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = b""
    try:
        async with asyncio.timeout(10):
            while chunk := await reader.read(65536):
                out += chunk
    finally:
        writer.close()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _low_nofile(soft: int, hard: int):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return limit


@pytest.mark.timeout(120)
async def test_router_serve_under_a_low_open_file_limit(fakes, tmp_path):
    """`router serve` started with a soft limit of 128 and a hard one of 256: the soft limit is raised, the cap
    derived (an explicit max_client_connections above it is lowered with one warning), and 400 idle sockets from
    one address (more than the limit) neither starve it of file descriptors nor lock out another address."""
    (f,) = await fakes(1)
    port = _free_port()
    log_path = tmp_path / "router.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ROUTEWISE_MAX_CLIENT_CONNECTIONS": "5000"}
    with open(log_path, "wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port", str(port), "--replica", f.url,
            "--policy", "least-outstanding", "--log-level", "info", env=env, cwd=ROOT, stdout=log_file,
            stderr=log_file, start_new_session=True, preexec_fn=_low_nofile(128, 256))
    idle: list[asyncio.StreamWriter] = []
    try:
        for _ in range(300):
            try:
                if (await exchange("127.0.0.1", port, get("/ready")))[0] == 200:
                    break
            except OSError:
                pass
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"router did not become ready: {log_path.read_text()[-2000:]}")
        text = log_path.read_text()
        assert "max_client_connections=5000 is more than the open-file limit of 256" in text
        assert "open-file limit 256 (raised from 128): up to 88 client connections, 44 per client address" in text
        for _ in range(400):
            idle.append((await open_from("127.0.0.2", port))[1])
        for path_data in (post(), get("/ready"), get("/health")):
            status, _, body = await exchange("127.0.0.3", port, path_data)
            assert status == 200, body
        assert "Too many open files" not in log_path.read_text()
    finally:
        for w in idle:
            w.close()
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


@pytest.mark.parametrize("fields, nofile, caps", [
    ({}, 1024, (472, 236)),  # (1024 - 64 reserved - 16 probe slots) / 2: the other half for replica connections
    ({"ops_port": 9100}, 1024, (432, 216)),  # the ops listener's 64 connections and its probe slots reserved too
    ({"max_connections": 100}, 1024, (844, 422)),  # a bounded upstream pool leaves the rest to clients
    ({"max_client_connections": 100}, 1024, (100, 50)),  # a setting within the limit wins
    ({"max_client_connections": 100, "max_connections_per_client": 500}, 1024, (100, 100)),
    ({}, 1 << 20, (65536, 32768)),  # the derived cap's ceiling
    ({}, 50, (1, 1)),
])
def test_caps_derived_from_the_open_file_limit(fields, nofile, caps):
    config = router.http.connections.ListenerConfig.of(RouterSettings(replicas=REPLICAS, **fields))
    assert router.http.connections.connection_caps(config, nofile) == caps


def test_a_cap_above_the_open_file_limit_is_lowered_with_one_warning(caplog):
    caplog.set_level(logging.WARNING, logger="router.connections")
    settings = RouterSettings(replicas=REPLICAS, max_client_connections=5000)
    config = router.http.connections.ListenerConfig.of(settings)
    assert router.http.connections.connection_caps(config, 1024) == (472, 236)
    assert [r.getMessage() for r in caplog.records] == [
        "max_client_connections=5000 is more than the open-file limit of 1024 leaves for client connections: using 472"]
