"""The bind topology end to end (loopback, in-process, no vLLM): the router binds one socket (`kv_events_bind`), each
emulated replica connects to it and publishes on a topic of its own, and each replica's blocks land in its own view."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from routewise_vllm.fleet.emulator import EmulatorSettings, make_app
from routewise_vllm.router.app import ROUTER, create_app
from routewise_vllm.router.settings import RouterSettings
from tests.kv.test_kv_live import SYSTEM, free_port, metrics, stored, wait_for

pytestmark = pytest.mark.timeout(120)


async def start_emulator(http_port: int, endpoint: str, topic: str) -> TestServer:
    settings = EmulatorSettings(speed=20.0, block_size=16, kv_blocks=2048, kv_events=endpoint, kv_events_topic=topic)
    server = TestServer(make_app(settings), host="127.0.0.1", port=http_port)
    await server.start_server()
    return server


async def test_replicas_that_connect_to_the_routers_socket_are_told_apart_by_topic():
    bind = f"tcp://127.0.0.1:{free_port()}"
    ports = [free_port(), free_port()]
    emus = [await start_emulator(ports[0], bind, "kv-a"), await start_emulator(ports[1], bind, "kv-b")]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    rids = [f"127.0.0.1:{p}" for p in ports]
    settings = RouterSettings(replicas=urls, policy="prefix-aware", health_interval_s=0.1, health_timeout_s=2.0,
                              scrape_interval_s=0.2, kv_events_refresh_s=0.2, kv_events_bind=bind)
    app = create_app(settings)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    emu_clients = [TestClient(e) for e in emus]
    try:
        router = app[ROUTER]
        kv = router.replicas.cluster.kv_view

        async def both_followed() -> bool:
            return all(kv.fresh(rid, router.clock()) for rid in rids)

        await wait_for(both_followed)
        await asyncio.sleep(0.3)  # the replicas' PUB sockets connect to the router's (ZMQ drops what comes before)
        # each replica gets a system prompt of its own, straight from the test (not through the router)
        for i, emu in enumerate(emu_clients):
            for q in range(2):
                r = await emu.post("/v1/completions", json={"model": "tiny", "prompt": SYSTEM[i] + f" q{q}",
                                                            "max_tokens": 2})
                assert r.status == 200, await r.text()

        async def both_published() -> bool:
            m = await metrics(client)
            return all(stored(m, rid) > 0 for rid in rids)

        await wait_for(both_published)
        for i in range(2):
            body = {"model": "tiny", "prompt": SYSTEM[i] + " q9"}
            router.prompt_blocks.of(body, chat=False)  # a replica's /tokenize, in the background

            async def tokenized() -> bool:
                return router.prompt_blocks.of(body, chat=False) is not None

            await wait_for(tokenized)
            blocks = router.prompt_blocks.of(body, chat=False)
            own, other = kv.match_many([rids[i], rids[1 - i]], blocks)
            assert own >= len(blocks) - 1 and other == 0, (i, own, other, len(blocks))
        m = await metrics(client)
        assert m[("llm_router_kv_events_unknown_topic_total",)] == 0
    finally:
        await client.close()
        for e in emus:
            await e.close()
