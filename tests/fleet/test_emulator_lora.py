"""The emulator with LoRA adapters (`fleet emulate --lora`): listed with their parent, served by name, scheduled with
vLLM's adapter limit, reported in vllm:lora_requests_info; against the official openai client."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from openai import AsyncOpenAI, NotFoundError

from routewise_vllm.fleet.emulator import EmulatorSettings, make_app
from routewise_vllm.fleet.emulator.api import add_arguments, settings_from_args
from routewise_vllm.router.observe.vllm_metrics import parse_vllm_metrics

pytestmark = pytest.mark.timeout(60)


def test_the_cli_takes_adapter_names_lists_and_ranges():
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    s = settings_from_args(p.parse_args(["--port", "1", "--lora", "sql-{0..2}", "a,b", "--max-loras", "2"]))
    assert s.lora == ("sql-0", "sql-1", "sql-2", "a", "b") and s.max_loras == 2


async def test_adapters_are_listed_served_by_name_and_queued_behind_the_slot_limit():
    settings = EmulatorSettings(profile="llama3-8b-h100", model_name="base", lora=("sql-0", "sql-1"), max_loras=1)
    server = TestServer(make_app(settings), host="127.0.0.1")
    await server.start_server()
    client = AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0, timeout=30)
    try:
        models = {m.id: m for m in (await client.models.list()).data}
        assert set(models) == {"base", "sql-0", "sql-1"}
        assert models["sql-0"].model_extra["parent"] == "base" and models["base"].model_extra["parent"] is None
        done = await client.completions.create(model="sql-1", prompt="hi " * 10, max_tokens=3)
        assert done.model == "sql-1" and done.usage.completion_tokens == 3
        with pytest.raises(NotFoundError):
            await client.completions.create(model="sql-9", prompt="hi", max_tokens=3)

        async with aiohttp.ClientSession() as s, s.get(server.make_url("/metrics")) as r:
            idle = parse_vllm_metrics(await r.text()).lora
        assert idle is not None and (idle.running, idle.waiting, idle.max_loras) == ((), (), 1)
        # sql-0 holds the only slot; sql-1 waits although the batch has room; a base request goes through
        stream = await client.completions.create(model="sql-0", prompt="hi", max_tokens=4000, stream=True)
        first = await stream.__anext__()
        assert first.model == "sql-0"
        blocked = asyncio.create_task(client.completions.create(model="sql-1", prompt="hi", max_tokens=3))
        base = await client.completions.create(model="base", prompt="hi", max_tokens=3)
        assert base.usage.completion_tokens == 3 and not blocked.done()
        async with aiohttp.ClientSession() as s:
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                async with s.get(server.make_url("/metrics")) as r:
                    text = await r.text()
                lora = parse_vllm_metrics(text).lora
                if lora is not None and lora.waiting:
                    break
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.02)
        assert (lora.running, lora.waiting, lora.max_loras) == (("sql-0",), ("sql-1",), 1)
        assert text.count("vllm:lora_requests_info{") >= 2  # earlier states stay on the page, as vLLM's do
        await stream.close()  # the client goes: sql-0 leaves, sql-1 runs
        assert (await blocked).usage.completion_tokens == 3
    finally:
        await client.close()
        await server.close()
