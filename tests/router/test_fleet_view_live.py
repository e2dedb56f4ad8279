"""The shared fleet view with real parts: a real redis-server on loopback (tests/fakes/redis_server.py), the
sync driven tick by tick in-process, then two `router serve` processes (no shared memory between them) in front
of fake replicas: B counts and avoids what A has in flight, A's share expires when A is SIGKILLed, and Redis
stopped under load costs no request. Skipped locally without redis-server, failed under CI."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from router.fleet_view import FleetSync
from router.policy.remote_load import ZERO, RemoteLoad
from router.policy.tracking import ClusterTracker
from router.policy.types import RequestInfo
from tests.fakes.redis_server import RedisServer, redis_server
from tests.router.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def redis():
    with redis_server() as server:
        yield server


def _sync(url: str, cluster: ClusterTracker, name: str, registry: CollectorRegistry | None = None) -> FleetSync:
    return FleetSync(url, RemoteLoad(cluster), registry or CollectorRegistry(), router_id=name, publisher=True,
                     interval_s=0.01, ttl_s=2.0, timeout_s=1.0)


def _outstanding(cluster: ClusterTracker) -> list[int]:
    return [s.outstanding for s in cluster.view(0.0, RequestInfo("probe", 1)).replicas]


@pytest.mark.timeout(120)
async def test_ticks_carry_one_routers_counts_to_the_other_and_redis_down_falls_back_to_the_local_view(redis):
    a, b = ClusterTracker(["r0:1", "r1:1"]), ClusterTracker(["r0:1", "r1:1"])
    registry = CollectorRegistry()
    sa, sb = _sync(redis.url, a, "router-a"), _sync(redis.url, b, "router-b", registry)
    try:
        a.dispatch(1, RequestInfo("qa", prompt_tokens_est=100, max_tokens=50))
        b.dispatch(0, RequestInfo("qb", prompt_tokens_est=10, max_tokens=5))
        await sa.tick()
        await sb.tick()  # B learns of A
        await sa.tick()  # A learns of B
        await sb.tick()  # B reads A
        assert _outstanding(b) == [1, 1] and _outstanding(a) == [0, 1]
        await sa.tick()  # A reads B
        assert _outstanding(b) == [1, 1] and _outstanding(a) == [1, 1]
        assert b.trackers[1].outstanding_prompt_tokens == 100 and b.trackers[1].awaiting_first_token == 1
        a.trackers[1].on_first_token("qa", 0.1)
        await sa.tick()
        await sb.tick()
        assert b.trackers[1].awaiting_first_token == 0 and b.trackers[1].outstanding == 1
        assert registry.get_sample_value("llm_router_shared_state_errors_total") == 0
        redis.stop()
        await sb.tick()  # never raises: the local view, counted
        assert _outstanding(b) == [1, 0]
        assert registry.get_sample_value("llm_router_shared_state_errors_total") == 1
        await sb.tick()
        assert registry.get_sample_value("llm_router_shared_state_errors_total") == 2
        redis.start()  # empty: it lost every hash; both republish everything on their next good tick
        for _ in range(3):
            await sa.tick()
            await sb.tick()
        assert _outstanding(b) == [1, 1] and _outstanding(a) == [1, 1]
        assert registry.get_sample_value("llm_router_shared_state_age_seconds") < 5.0
        await sa.close()  # a router that stops cleanly leaves at once
        await sb.tick()
        await sb.tick()
        assert _outstanding(b) == [1, 0]
    finally:
        await sa.close()
        await sb.close()


@pytest.mark.timeout(60)
async def test_a_slow_redis_is_a_failed_tick_within_the_timeout(redis):
    cluster = ClusterTracker(["r0:1"])
    registry = CollectorRegistry()
    sync = FleetSync(redis.url, RemoteLoad(cluster), registry, router_id="me", publisher=True, interval_s=0.01,
                     ttl_s=2.0, timeout_s=0.2)
    try:
        await sync.tick()
        os.kill(redis.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]  # up, but answering nothing
        try:
            await asyncio.wait_for(sync.tick(), 30)  # the outer bound of a busy host: the tick's own is 0.2 s
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        assert registry.get_sample_value("llm_router_shared_state_errors_total") == 1
        await sync.tick()
        assert registry.get_sample_value("llm_router_shared_state_errors_total") == 1
    finally:
        await sync.close()
