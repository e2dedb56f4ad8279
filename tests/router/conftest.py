"""Fixtures: fake vLLM replicas and a router app in front of them, all on loopback."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for tests.fakes

from tests.fakes.fake_vllm import FakeVllm  # noqa: E402
from tests.fakes.harness import fake_fleet, router_apps  # noqa: E402

# Quick probes, but timeouts a busy host does not trip: a health probe (whose one failure ejects) waits seconds,
# and a scrape (whose failure is only counted) as long as its interval (the settings' default, so a test that
# sets a shorter interval gets the same shorter timeout). Fakes fail health with a 500 or a refused
# connection, never by silence, so the ejection tests do not wait on the timeout.
FAST = dict(
    policy="least-outstanding",
    health_interval_s=0.05,
    health_timeout_s=5.0,
    health_failure_threshold=1,
    scrape_interval_s=0.2,
    breaker_failure_threshold=2,
    breaker_cooldown_s=0.2,
    first_byte_timeout_s=0.5,
    connect_timeout_s=0.5,
    models_refresh_interval_s=0.1,
)


# Each side's transport: the lean listener or aiohttp's server side downstream, h1client or aiohttp's client
# upstream (plain-http replicas). The ids read downstream-upstream.
TRANSPORTS = {
    "lean-h1": dict(lean_listener=True, lean_client=True),
    "lean-aiohttp": dict(lean_listener=True, lean_client=False),
    "aiohttp-h1": dict(lean_listener=False, lean_client=True),
    "aiohttp-aiohttp": dict(lean_listener=False, lean_client=False),
}


async def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll until `cond()`; the timeout is an outer bound for a busy host, never what a test asserts."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[Callable[..., Awaitable[list[FakeVllm]]]]:
    async with fake_fleet() as start:
        yield start


@pytest_asyncio.fixture
async def router_client() -> AsyncIterator[Callable[..., Awaitable[TestClient]]]:
    async with router_apps(FAST) as start:
        yield start


@pytest_asyncio.fixture(params=list(TRANSPORTS))
async def router_paths(request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., Awaitable[TestClient]]]:
    """router_client on each of the four transport paths (a test that uses it runs four times)."""
    async with router_apps({**FAST, **TRANSPORTS[request.param]}) as start:
        yield start
