"""Shared helpers for the serving tests: views and ONNX model files built per test."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for tests.* imports

from collections.abc import AsyncIterator, Awaitable, Callable  # noqa: E402

import pytest_asyncio  # noqa: E402
from aiohttp.test_utils import TestClient  # noqa: E402

from tests.fakes.fake_vllm import FakeVllm  # noqa: E402
from tests.fakes.harness import fake_fleet, router_apps  # noqa: E402

TOKEN = "serving-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAST = dict(
    health_interval_s=0.05, health_timeout_s=0.5, health_failure_threshold=1, scrape_interval_s=0.05,
    scrape_timeout_s=0.05, breaker_failure_threshold=2, breaker_cooldown_s=0.2, first_byte_timeout_s=2.0,
    connect_timeout_s=0.5, models_refresh_interval_s=0.1, admin_token=TOKEN, max_stats_age_s=30.0,
    replica_header=True,  # the tests read which replica served each request
    late_binding=False,  # per-request routing (on by default for a learned policy); tests/router covers late binding
)


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[Callable[..., Awaitable[list[FakeVllm]]]]:
    async with fake_fleet() as start:
        yield start


@pytest_asyncio.fixture
async def router_client() -> AsyncIterator[Callable[..., Awaitable[TestClient]]]:
    async with router_apps(FAST) as start:
        yield start
