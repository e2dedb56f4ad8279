"""Shared state that cannot steer the fleet: whatever someone else writes under the fleet's keys in Redis (counts
huge, negative, of 400 digits, not numbers, another type of key, a hash of 200,000 fields, a set of 2,000
routers) is ignored and counted, never folded into a router's view; `/metrics` stays 200 and a router's routing
share does not move. Redis with a password and over TLS works as redis-py's URLs say, the password never logged.
A real redis-server on loopback (tests/fakes/redis_server.py); skipped locally without it, failed under CI."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from routewise_vllm.router.scale.fleet_view import (MAX_FIELDS, MAX_IN_FLIGHT, MAX_ROUTERS, MAX_TOKENS, ROUTERS_KEY,
                                              FleetSync, FleetViewConfig, encode, load_key, parse_counts)
from routewise_vllm.router.policy.remote_load import RemoteLoad
from routewise_vllm.router.policy.tracking import ClusterTracker
from routewise_vllm.router.policy.types import RequestInfo
from routewise_vllm.router.settings import RouterSettings, redact_url, redacted
from tests.fakes.redis_server import redis_server, require_redis
from tests.router.conftest import wait_for
from tests.router.test_fleet_view_live import _rid, _stream, routers

REPLICAS = ["r0:1", "r1:1"]
TLS = Path(__file__).resolve().parents[1] / "data" / "tls"


@pytest.fixture
def redis():
    with redis_server() as server:
        yield server


def _sync(url: str, cluster: ClusterTracker, name: str, registry: CollectorRegistry | None = None,
          timeout_s: float = 2.0) -> FleetSync:
    return FleetSync(FleetViewConfig(url, 0.01, 5.0, timeout_s), RemoteLoad(cluster), registry or CollectorRegistry(),
                     router_id=name, publisher=True)


def _counts(cluster: ClusterTracker) -> list[tuple[int, ...]]:
    return [(t.outstanding, t.outstanding_prompt_tokens, t.outstanding_decode_tokens, t.awaiting_first_token,
             t.awaiting_prompt_tokens) for t in cluster.trackers]


def _rejected(registry: CollectorRegistry) -> dict[str, float]:
    return {s.labels["reason"]: s.value for m in registry.collect() if m.name == "llm_router_shared_state_rejected"
            for s in m.samples if s.name.endswith("_total") and s.value}


ROGUE_VALUES = {
    "huge": f"{MAX_IN_FLIGHT + 1} 0 0 0 0",
    "huge_tokens": f"1 {MAX_TOKENS + 1} 0 0 0",
    "negative": "-1000000 0 0 0 0",
    "400_digits": f"{10**400} 0 0 0 0",
    "5000_digits": "9" * 5000 + " 0 0 0 0",
    "float": "1.5 0 0 0 0",
    "exponent": "1e9 0 0 0 0",
    "underscore": "1_000 0 0 0 0",
    "arabic_digits": "\u0661\u0662 0 0 0 0",
    "plus": "+5 0 0 0 0",
    "tabs": "5\t0 0 0 0",
    "four": "1 2 3 4",
    "six": "1 2 3 4 5 6",
    "words": "many",
    "empty": "",
}


def test_a_value_is_five_ascii_decimal_integers_within_what_one_router_could_hold():
    assert parse_counts(encode((3, 300, 150, 1, 100))) == (3, 300, 150, 1, 100)
    assert parse_counts(encode((MAX_IN_FLIGHT, MAX_TOKENS, MAX_TOKENS, MAX_IN_FLIGHT, MAX_TOKENS))) is not None
    expected = {"huge": "out_of_range", "huge_tokens": "out_of_range", "negative": "negative",
                "400_digits": "out_of_range", "5000_digits": "out_of_range"}
    for name, value in ROGUE_VALUES.items():
        assert parse_counts(value) == expected.get(name, "malformed"), name
    assert parse_counts(None) == "malformed" and parse_counts(b"1 2 3 4 5") == "malformed"
    # the sum of every router's largest counts stays an exact float and an int64: no view or metric overflows
    assert MAX_ROUTERS * MAX_TOKENS < 2**53 and MAX_ROUTERS * MAX_IN_FLIGHT < 2**31


def _plant(url: str) -> None:
    """Rogue records beside the real routers: bad values for the replicas both know and under other names, keys
    of another type, a hash too wide to read, and bytes that are not UTF-8."""
    import redis as redis_py

    r = redis_py.Redis.from_url(url)
    r.sadd(ROUTERS_KEY, "rogue", "rogue-str", "rogue-list", "rogue-wide", "rogue-bytes")
    fields = {"_hb": "1", "r0:1": ROGUE_VALUES["negative"], "r1:1": ROGUE_VALUES["400_digits"]}
    fields |= {f"{REPLICAS[i % 2]}#{name}": v for i, (name, v) in enumerate(ROGUE_VALUES.items())}
    r.hset(load_key("rogue"), mapping=fields)
    r.set(load_key("rogue-str"), "5 5 5 5 5")
    r.rpush(load_key("rogue-list"), "r0:1", "5 5 5 5 5")
    wide = {f"r{i}:1": "1000 0 0 0 0" for i in range(200_000)}
    for start in range(0, len(wide), 20_000):
        r.hset(load_key("rogue-wide"), mapping=dict(list(wide.items())[start:start + 20_000]))
    r.hset(load_key("rogue-bytes"), mapping={"_hb": "1", "r0:1": b"\xff\xfe 0 0 0 0", b"r1:1\xff": "7 7 7 7 7"})
    r.close()


@pytest.mark.timeout(120)
async def test_rogue_records_change_no_routers_view_and_are_counted_by_reason(redis, caplog):
    caplog.set_level(logging.INFO, logger="router.fleet_view")
    a, b = ClusterTracker(REPLICAS), ClusterTracker(REPLICAS)
    registry = CollectorRegistry()
    sa, sb = _sync(redis.url, a, "router-a"), _sync(redis.url, b, "router-b", registry)
    try:
        a.dispatch(0, RequestInfo("qa", prompt_tokens_est=100, max_tokens=50))
        a.dispatch(1, RequestInfo("qa2", prompt_tokens_est=10, max_tokens=5))
        await sa.tick()
        await sb.tick()
        honest = _counts(b)
        assert honest == [(1, 100, 50, 1, 100), (1, 10, 5, 1, 10)]
        _plant(redis.url)
        for _ in range(3):
            await sa.tick()
            await sb.tick()
            assert _counts(b) == honest  # A's counts, nothing of the rogue records
            assert [t.outstanding for t in a.trackers] == [1, 1]  # A has only its own (B has none in flight)
        assert registry.get_sample_value("llm_router_shared_state_errors_total") == 0  # ticks went through
        got = _rejected(registry)
        # per tick: 2 + 15 bad values in "rogue" (10 of them not numbers), 2 keys of another type, the wide
        # hash, the value that is not UTF-8 (its neighbour, a valid value under a replica id no router has, counts)
        assert got == {"negative": 3 * 2, "out_of_range": 3 * 5, "malformed": 3 * 11, "wrong_type": 3 * 2,
                       "too_many_fields": 3 * 1}, got
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 2, warnings  # A's and B's, each once for the episode, however many ticks
        assert all("first under router id 'rogue" in w for w in warnings), warnings
        import redis as redis_py

        r = redis_py.Redis.from_url(redis.url)
        r.delete(*(load_key(p) for p in ("rogue", "rogue-str", "rogue-list", "rogue-wide", "rogue-bytes")))
        r.close()
        await sb.tick()
        assert _counts(b) == honest
        assert any("no record ignored any more" in r.getMessage() for r in caplog.records)
    finally:
        await sa.close()
        await sb.close()


@pytest.mark.timeout(120)
async def test_a_set_of_more_routers_than_a_fleet_has_is_not_read_and_the_router_decides_alone(redis):
    import redis as redis_py

    a, b = ClusterTracker(REPLICAS), ClusterTracker(REPLICAS)
    registry = CollectorRegistry()
    sa, sb = _sync(redis.url, a, "router-a"), _sync(redis.url, b, "router-b", registry)
    try:
        a.dispatch(0, RequestInfo("qa", prompt_tokens_est=100, max_tokens=50))
        await sa.tick()
        r = redis_py.Redis.from_url(redis.url)
        r.sadd(ROUTERS_KEY, *(f"ghost-{i}" for i in range(2 * MAX_ROUTERS)))
        for i in range(2 * MAX_ROUTERS):
            r.hset(load_key(f"ghost-{i}"), "r1:1", "9 9 9 9 9")
        r.close()
        await sb.tick()
        assert _counts(b) == [(0, 0, 0, 0, 0)] * 2  # neither the ghosts nor A: this router's own counts
        assert _rejected(registry) == {"too_many_routers": 1}
        assert registry.get_sample_value("llm_router_shared_state_errors_total") == 0
    finally:
        await sa.close()
        await sb.close()


def _plant_for(url: str, r0: str, r1: str) -> None:
    import redis as redis_py

    r = redis_py.Redis.from_url(url)
    r.sadd(ROUTERS_KEY, "rogue", "rogue-neg")
    r.hset(load_key("rogue"), mapping={"_hb": "1", r0: f"{10**400} 0 0 0 0", r1: f"{10**15} 0 0 0 0"})
    r.hset(load_key("rogue-neg"), mapping={"_hb": "1", r1: "-1000000 0 0 0 0"})
    r.close()


@pytest.mark.timeout(180)
async def test_a_router_with_rogue_records_in_redis_answers_metrics_and_keeps_its_share(redis, fakes, tmp_path):
    reps = await fakes(2)
    gates = [rep.hold("held") for rep in reps]
    r0, r1 = _rid(reps[0].url), _rid(reps[1].url)
    _plant_for(redis.url, r0, r1)
    spec = ["--replica", reps[0].url, "--replica", reps[1].url]
    async with routers(tmp_path, [spec], redis.url) as (b,):
        async with aiohttp.ClientSession() as session:
            for _ in range(600):  # its syncs have read the rogue records
                async with session.get(b.url + "/metrics") as resp:
                    text = await resp.text()
                    assert resp.status == 200, text[:500]
                if await b.metric("llm_router_shared_state_rejected_total") >= 6:
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the router never counted the rogue records")
            assert await b.metric("llm_router_outstanding_requests", r0) == 0
            assert await b.metric("llm_router_outstanding_requests", r1) == 0
            streams = []
            for n in range(1, 7):  # least-outstanding on its own counts: 3 and 3
                streams.append(asyncio.create_task(_stream(session, b.url, "held")))
                await wait_for(lambda: reps[0].active + reps[1].active == n, 60)
            assert (reps[0].active, reps[1].active) == (3, 3)
            async with session.get(b.url + "/metrics") as resp:
                assert resp.status == 200
            for g in gates:
                g.set()
            for t in streams:
                assert (await asyncio.wait_for(t, 60)).rstrip().endswith("data: [DONE]")
    log = b.log.read_text()
    assert log.count("ignoring records that cannot be another router's counts") == 1, log[-3000:]


# --- AUTH and TLS -----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """redis-server with extra arguments (a password, TLS), in its own process group, stopped on exit."""

    def __init__(self, *args: str) -> None:
        self.port = _free_port()
        tls = "--tls-port" in args
        port_args = ["--port", "0", "--tls-port", str(self.port)] if tls else ["--port", str(self.port)]
        self.proc = subprocess.Popen(
            [require_redis(), *port_args, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--loglevel", "warning", *(a for a in args if a != "--tls-port")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    pytest.fail(f"redis-server {' '.join(args)} exited with {self.proc.returncode}")
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail("redis-server did not listen within 20 s")
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


async def _ticks_ok(url: str, caplog) -> tuple[CollectorRegistry, list[str]]:
    a, b = ClusterTracker(REPLICAS), ClusterTracker(REPLICAS)
    registry = CollectorRegistry()
    sa, sb = _sync(url, a, "router-a", timeout_s=5.0), _sync(url, b, "router-b", registry, timeout_s=5.0)
    try:
        a.dispatch(1, RequestInfo("qa", prompt_tokens_est=100, max_tokens=50))
        await sa.tick()
        await sb.tick()
        if registry.get_sample_value("llm_router_shared_state_errors_total") == 0:
            assert _counts(b)[1] == (1, 100, 50, 1, 100)
    finally:
        await sa.close()
        await sb.close()
    return registry, [r.getMessage() for r in caplog.records if r.name == "router.fleet_view"]


@pytest.mark.timeout(120)
async def test_a_password_in_the_url_authenticates_and_is_never_logged(caplog):
    caplog.set_level(logging.INFO, logger="router.fleet_view")
    server = _Server("--requirepass", "s3cret-pw")
    try:
        for url in (f"redis://:s3cret-pw@127.0.0.1:{server.port}/0",
                    f"redis://default:s3cret-pw@127.0.0.1:{server.port}/0",
                    f"redis://127.0.0.1:{server.port}/0?password=s3cret-pw"):
            registry, lines = await _ticks_ok(url, caplog)
            assert registry.get_sample_value("llm_router_shared_state_errors_total") == 0, (url, lines)
            settings = RouterSettings(replicas=["http://127.0.0.1:9"], shared_state=url)
            assert "s3cret-pw" not in str(redacted(settings)) and "s3cret-pw" not in redact_url(url), url
        wrong = f"redis://:wrong-pw@127.0.0.1:{server.port}/0"
        registry, lines = await _ticks_ok(wrong, caplog)
        assert registry.get_sample_value("llm_router_shared_state_errors_total") == 1
        assert lines and all("wrong-pw" not in line and "s3cret-pw" not in line for line in lines), lines
    finally:
        server.stop()


@pytest.mark.timeout(120)
async def test_rediss_with_the_servers_ca_syncs(caplog):
    cert, key = TLS / "loopback-cert.pem", TLS / "loopback-key.pem"  # self-signed for 127.0.0.1 (tests/data/README.md)
    server = _Server("--tls-port", "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
                     str(cert), "--tls-auth-clients", "no", "--requirepass", "s3cret-pw")
    try:
        url = f"rediss://:s3cret-pw@127.0.0.1:{server.port}/0?ssl_ca_certs={cert}"
        registry, lines = await _ticks_ok(url, caplog)
        assert registry.get_sample_value("llm_router_shared_state_errors_total") == 0, lines
        # without the CA the certificate is refused: a failed tick, counted, the local view
        registry, lines = await _ticks_ok(f"rediss://:s3cret-pw@127.0.0.1:{server.port}/0", caplog)
        assert registry.get_sample_value("llm_router_shared_state_errors_total") == 1
        assert all("s3cret-pw" not in line for line in lines), lines
    finally:
        server.stop()
