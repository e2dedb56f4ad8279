"""The emulator's KV events driving the router's view end to end (loopback, in-process, no vLLM)."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.fleet.emulator import EmulatorSettings, make_app  # noqa: E402
from routewise_vllm.router.app import ROUTER, create_app  # noqa: E402
from routewise_vllm.router.settings import RouterSettings  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SYSTEM = [" ".join(f"word{i}x{j}" for j in range(120)) for i in range(4)]  # ~1,300 characters each


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_emulator(http_port: int, kv_port: int) -> TestServer:
    settings = EmulatorSettings(speed=20.0, block_size=16, kv_blocks=2048, kv_events=f"tcp://*:{kv_port}")
    server = TestServer(make_app(settings), host="127.0.0.1", port=http_port)
    await server.start_server()
    return server


async def metrics(client: TestClient) -> dict[tuple, float]:
    text = await (await client.get("/metrics")).text()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def stored(m: dict, rid: str) -> float:
    return m.get(("llm_router_kv_events_total", ("kind", "BlockStored"), ("replica", rid)), 0.0)


async def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_emulator_events_drive_the_view_and_a_restart_clears_it():
    ports = [free_port() for _ in range(4)]
    emus = [await start_emulator(ports[0], ports[1]), await start_emulator(ports[2], ports[3])]
    urls = [f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[2]}"]
    rids = [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[2]}"]
    settings = RouterSettings(replicas=urls, policy="prefix-aware", health_interval_s=0.1, health_timeout_s=2.0,
                              health_failure_threshold=1, scrape_interval_s=0.2, kv_events_refresh_s=0.2,
                              kv_events_stale_hold_s=0.5)
    app = create_app(settings)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        router = app[ROUTER]
        cluster = router.replicas.cluster
        # requests sharing system prompts, a few at a time: the first of each tokenized by a replica meanwhile
        for rnd in range(3):
            async def one(i: int) -> None:
                body = {"model": "tiny", "prompt": SYSTEM[i % 4] + f" question {rnd} {i}", "max_tokens": 2}
                r = await client.post("/v1/completions", json=body)
                assert r.status == 200, await r.text()
            await asyncio.gather(*(one(i) for i in range(8)))
            await asyncio.sleep(0.3)

        async def both_published() -> bool:
            m = await metrics(client)
            return all(stored(m, rid) > 0 for rid in rids)

        await wait_for(both_published)
        assert cluster.match_sources[0] > 0, cluster.match_sources  # decisions took the precise match
        view = cluster.kv_view
        held = [len(view.stats(rid).blocks) for rid in rids]
        assert all(h > 0 for h in held), held
        # each system prompt's blocks are where the view says: a request for it matches there in full
        blocks = router.prompt_blocks.of({"model": "tiny", "prompt": SYSTEM[0] + " question 9 9"}, chat=False)
        assert blocks is not None and type(blocks).__name__ == "TokenBlocks"
        assert max(view.match_many(rids, blocks)) >= len(blocks) - 1

        # kill replica 0 and start it again on the same ports: its view is cleared
        await emus[0].close()

        async def lost() -> bool:
            return not cluster.kv_view.fresh(rids[0], router.clock()) and not view.stats(rids[0]).blocks

        await wait_for(lost)
        emus[0] = await start_emulator(ports[0], ports[1])
        async def back() -> bool:
            return view.fresh(rids[0], router.clock())
        await wait_for(back)
        assert len(view.stats(rids[0]).blocks) == 0
        assert view.match_many([rids[0]], blocks) == [0]
        m = await metrics(client)
        assert m[("llm_router_kv_view_blocks", ("replica", rids[0]))] == 0
        assert m[("llm_router_kv_view_blocks", ("replica", rids[1]))] > 0
    finally:
        await client.close()
        for e in emus:
            await e.close()
