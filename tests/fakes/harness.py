"""Async context managers behind the router and serving tests' fixtures: fake vLLM fleets and
router apps in front of them, all on loopback, all stopped on exit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from routewise_vllm.router.app import PROXY, create_app
from routewise_vllm.router.http.connections import ListenerConfig
from routewise_vllm.router.http.listener import RouterRunner
from routewise_vllm.router.settings import RouterSettings
from tests.fakes.fake_vllm import FakeVllm


@asynccontextmanager
async def fake_fleet() -> AsyncIterator[Callable[..., Awaitable[list[FakeVllm]]]]:
    started: list[FakeVllm] = []

    async def start(n: int = 2, **kw: Any) -> list[FakeVllm]:
        out = [FakeVllm(**kw) for _ in range(n)]
        for f in out:
            await f.start()
        started.extend(out)
        return out

    try:
        yield start
    finally:
        for f in started:
            await f.stop()


class RouterTestServer(TestServer):
    """A TestServer with the router's own runner (header timeout, connection cap, OpenAI-shaped HTTP errors)."""

    def __init__(self, app: web.Application, settings: RouterSettings, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.settings = settings

    async def _make_runner(self, **kwargs: Any) -> RouterRunner:
        return RouterRunner(self.app, config=ListenerConfig.of(self.settings), proxy=self.app.get(PROXY), **kwargs)


@asynccontextmanager
async def router_apps(defaults: dict[str, Any]) -> AsyncIterator[Callable[..., Awaitable[TestClient]]]:
    clients: list[TestClient] = []

    async def start(replicas: list[str], clock: Callable[[], float] | None = None, **overrides: Any) -> TestClient:
        """A router app on loopback; `clock` replaces its monotonic clock (a test moves stats' age with it)."""
        settings = RouterSettings(replicas=replicas, **{**defaults, **overrides})
        app = create_app(settings) if clock is None else create_app(settings, clock=clock)
        client = TestClient(RouterTestServer(app, settings, host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client

    try:
        yield start
    finally:
        for c in clients:
            await c.close()


async def two_model_fleet(fakes):
    """Replicas serving alpha, beta, and both (`fakes` is the fake fleet fixture's factory)."""
    (a,) = await fakes(1, models=["alpha"])
    (b,) = await fakes(1, models=["beta"])
    (c,) = await fakes(1, models=["alpha", "beta"])
    return a, b, c


async def wait_router_ready(url: str, proc: asyncio.subprocess.Process, log: Path | None = None,
                            timeout_s: float = 60.0) -> None:
    """Poll `url`/ready until it answers 200. Fails the test when the router process exits first (with the end of
    `log`) or at `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.returncode is not None:
                tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
                pytest.fail(f"the router at {url} exited ({proc.returncode}) before it was ready: {tail}")
            try:
                async with session.get(url + "/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if loop.time() > deadline:
                pytest.fail(f"the router at {url} was not ready in {timeout_s:g} s")
            await asyncio.sleep(0.1)
