"""The vLLM emulator against the official `openai` client and `prometheus_client`'s parser (loopback, in-process)."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from openai import AsyncOpenAI, NotFoundError, BadRequestError
from prometheus_client.parser import text_string_to_metric_families

from routewise_vllm.fleet.emulator import EmulatorSettings, make_app

pytestmark = pytest.mark.timeout(60)


@asynccontextmanager
async def emulator(**kw):
    server = TestServer(make_app(EmulatorSettings(**kw)), host="127.0.0.1")
    await server.start_server()
    client = AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0, timeout=30)
    try:
        yield server, client
    finally:
        await client.close()
        await server.close()


async def scrape(server: TestServer) -> dict[str, float]:
    """Samples by name (labels dropped except finished_reason); parse samples, not TYPE lines."""
    async with aiohttp.ClientSession() as s, s.get(server.make_url("/metrics")) as r:
        assert r.status == 200
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            assert sample.labels.get("engine") == "0"
            if sample.name.startswith("vllm:cache_config_info"):
                out["block_size"] = float(sample.labels["block_size"])
                out["num_gpu_blocks"] = float(sample.labels["num_gpu_blocks"])
                continue
            assert sample.labels.get("model_name") == "tiny"
            if "le" in sample.labels:
                continue
            out[sample.name] = sample.value
    return out


async def test_openai_client_streaming_and_non_streaming():
    async with emulator(profile="llama3-8b-h100") as (_server, client):
        full = await client.completions.create(model="tiny", prompt="hello " * 40, max_tokens=7)
        assert full.choices[0].finish_reason == "length"
        assert full.usage.completion_tokens == 7
        assert full.usage.prompt_tokens == 60  # 240 characters / 4
        chunks = []
        stream = await client.completions.create(
            model="tiny", prompt="hello", max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in stream:
            chunks.append(chunk)
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert len(texts) == 5 and all(texts)
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 5
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
        deltas = []
        async for chunk in await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        ):
            deltas.append(chunk.choices[0].delta.content)
        assert [d for d in deltas if d] == [" tok"] * 3


async def test_bad_requests_fail_like_vllm():
    async with emulator(max_model_len=128) as (_server, client):
        with pytest.raises(NotFoundError):
            await client.completions.create(model="other", prompt="x", max_tokens=2)
        with pytest.raises(BadRequestError, match="maximum context length"):
            await client.completions.create(model="tiny", prompt="x" * 800, max_tokens=2)


async def test_metrics_move_under_concurrent_load():
    # 4 sequences at once and 64 blocks of 16 tokens: 12 concurrent 200-token prompts must queue.
    async with emulator(max_num_seqs=4, kv_blocks=64, speed=0.5) as (server, client):
        before = await scrape(server)
        assert before["block_size"] == 16 and before["num_gpu_blocks"] == 64
        assert before["vllm:num_requests_running"] == 0 and before["vllm:kv_cache_usage_perc"] == 0

        async def one(i: int):
            return await client.completions.create(model="tiny", prompt=f"{i} " + "load " * 160, max_tokens=40)

        tasks = [asyncio.create_task(one(i)) for i in range(12)]
        seen_running, seen_waiting, seen_kv = 0.0, 0.0, 0.0
        while not all(t.done() for t in tasks):
            m = await scrape(server)
            seen_running = max(seen_running, m["vllm:num_requests_running"])
            seen_waiting = max(seen_waiting, m["vllm:num_requests_waiting"])
            seen_kv = max(seen_kv, m["vllm:kv_cache_usage_perc"])
            assert m["vllm:num_requests_running"] <= 4
            await asyncio.sleep(0.05)
        results = await asyncio.gather(*tasks)
        assert all(r.usage.completion_tokens == 40 for r in results)
        assert seen_running == 4 and seen_waiting >= 4 and seen_kv > 0.5
        after = await scrape(server)
        assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
        assert after["vllm:request_success_total"] == 12
        assert after["vllm:generation_tokens_total"] == 12 * 40
        assert after["vllm:prompt_tokens_total"] == sum(r.usage.prompt_tokens for r in results)
        assert after["vllm:time_to_first_token_seconds_count"] == 12
        assert after["vllm:e2e_request_latency_seconds_count"] == 12
        assert after["vllm:inter_token_latency_seconds_count"] == 12 * 39


async def test_kv_pressure_preempts():
    # 6 requests of 80 prompt tokens fit 40 blocks of 16 at admission (30 blocks) but cannot all grow to
    # 130 tokens (54 blocks), so some are preempted and recomputed.
    async with emulator(max_num_seqs=8, kv_blocks=40, speed=2.0) as (server, client):
        rs = await asyncio.gather(*[
            client.completions.create(model="tiny", prompt=f"{i}" + "p" * 319, max_tokens=50) for i in range(6)
        ])  # fmt: skip
        assert all(r.usage.completion_tokens == 50 for r in rs)
        m = await scrape(server)
        assert m["vllm:num_preemptions_total"] >= 1
        assert m["vllm:kv_cache_usage_perc"] == 0


async def test_repeated_long_prompt_hits_the_prefix_cache():
    prompt = "shared system prompt " * 150  # 3150 characters = 788 tokens = 49 full blocks of 16
    async with emulator(profile="llama3-8b-a100") as (server, client):
        first = await client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        m1 = await scrape(server)
        second = await client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        other = await client.completions.create(model="tiny", prompt="different " + prompt, max_tokens=2)
        m2 = await scrape(server)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 49 * 16
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # chained blocks: a different start shares nothing
    assert m1["vllm:prefix_cache_hits_total"] == 0
    assert m2["vllm:prefix_cache_hits_total"] == 49 * 16
    assert m2["vllm:prefix_cache_queries_total"] == first.usage.prompt_tokens * 2 + other.usage.prompt_tokens


async def test_faster_profile_gives_lower_latency():
    async def e2e(profile: str) -> float:
        async with emulator(profile=profile) as (_server, client):
            t0 = time.perf_counter()
            r = await client.completions.create(model="tiny", prompt="x " * 400, max_tokens=24)
            assert r.usage.completion_tokens == 24
            return time.perf_counter() - t0

    slow = await e2e("llama3-8b-l4")  # ~300 GB/s: ~70 ms per decode step
    fast = await e2e("llama3-8b-h100")  # ~3.3 TB/s: ~8 ms per decode step
    assert fast < slow / 2, (fast, slow)


async def test_client_disconnect_aborts_the_request():
    async with emulator(max_num_seqs=4, speed=0.25) as (server, client):
        async with aiohttp.ClientSession() as s:
            body = {"model": "tiny", "prompt": "x" * 400, "max_tokens": 2000, "stream": True}
            async with s.post(server.make_url("/v1/completions"), json=body) as r:
                assert r.status == 200
                await r.content.readline()  # the first token arrived: it is running now
                m = await scrape(server)
                assert m["vllm:num_requests_running"] == 1 and m["vllm:kv_cache_usage_perc"] > 0
        for _ in range(100):  # the abort lands at the end of the current iteration
            m = await scrape(server)
            if m["vllm:num_requests_running"] == 0:
                break
            await asyncio.sleep(0.02)
        assert m["vllm:num_requests_running"] == 0
        assert m["vllm:kv_cache_usage_perc"] == 0
        assert m.get("vllm:request_success_total", 0) == 0
        # the engine is still healthy afterwards
        r2 = await client.completions.create(model="tiny", prompt="again", max_tokens=3)
        assert r2.usage.completion_tokens == 3


async def test_a_failing_model_fails_requests_and_health_instead_of_hanging():
    from routewise_vllm.fleet.emulator import ENGINE_KEY

    async with emulator() as (server, client):
        engine = server.app[ENGINE_KEY]

        def broken(now):
            raise RuntimeError("model bug")

        engine.replica._finish_iteration = broken
        with pytest.raises(Exception) as info:
            await client.completions.create(model="tiny", prompt="x", max_tokens=3)
        assert "model bug" in str(info.value)
        async with aiohttp.ClientSession() as s, s.get(server.make_url("/health")) as r:
            assert r.status == 503
