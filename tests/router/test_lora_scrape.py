"""vllm:lora_requests_info: parsed as vLLM writes it (the newest series wins), read from the emulator's /metrics into
the tracker and the views the policies see."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from routewise_vllm.fleet.emulator import EmulatorSettings, make_app
from routewise_vllm.router.app import REPLICAS, SCRAPER
from routewise_vllm.router.policy.types import LoraState, RequestInfo
from routewise_vllm.router.observe.vllm_metrics import parse_vllm_metrics

# vLLM 0.32 (vllm/v1/metrics/loggers.py): a new label set per stats update, set to the time; older ones stay
PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="base"} 2.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7640001e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-1,sql-0",waiting_lora_adapters="sql-2"} 1.7640003e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-0",waiting_lora_adapters=""} 1.7640002e+09
"""


def test_the_newest_lora_series_is_the_replicas_adapter_state():
    stats = parse_vllm_metrics(PAGE)
    assert stats.lora == LoraState(("sql-0", "sql-1"), ("sql-2",), 2)
    assert not stats.lora.room and stats.lora.has("sql-2") and not stats.lora.has("sql-3")
    assert parse_vllm_metrics(PAGE.split("# HELP vllm:lora")[0]).lora is None  # LoRA off: nothing on the page
    bad = PAGE.replace('max_lora="2"', 'max_lora="many"')
    assert parse_vllm_metrics(bad).lora is None and parse_vllm_metrics(bad).running == 2  # the rest still read


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_the_router_sees_the_adapters_an_emulated_replica_runs_and_queues(router_client):
    settings = EmulatorSettings(profile="llama3-8b-h100", model_name="base", lora=("sql-0", "sql-1"), max_loras=1)
    server = TestServer(make_app(settings), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        client = await router_client([url], scrape_interval_s=60)
        rep = next(iter(client.app[REPLICAS].by_id.values()))
        assert rep.tracker.lora == LoraState((), (), 1)  # the startup scrape

        async def ask(model: str, max_tokens: int) -> int:
            body = {"model": model, "prompt": "hello " * 20, "max_tokens": max_tokens}
            async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
                await r.read()
                return r.status

        long = asyncio.create_task(ask("sql-0", 4000))  # ~30 s of decoding: holds the only adapter slot
        blocked = asyncio.create_task(ask("sql-1", 4))

        async def scraped() -> LoraState | None:
            await client.app[SCRAPER].scrape_all()
            return rep.tracker.lora

        want = LoraState(("sql-0",), ("sql-1",), 1)
        deadline = asyncio.get_running_loop().time() + 30
        while (state := await scraped()) != want:
            assert asyncio.get_running_loop().time() < deadline, state
            await asyncio.sleep(0.05)
        view = client.app[REPLICAS].cluster.view(0.0, RequestInfo("q", 10, model="sql-1"))
        assert view.replicas[0].lora == want
        long.cancel()  # the client goes: sql-0's slot frees and sql-1 runs
        assert await blocked == 200
        await asyncio.gather(long, return_exceptions=True)
    finally:
        await server.close()
