"""Routing by model on emulated vLLM replicas: one serving alpha, one beta, one serving both (vLLM's
`--served-model-name alpha beta`), behind the router with the recommended policy (the learned any-fleet model with
late binding at each replica's inferred batch limit). 1,000 mixed requests from the official openai client
(completions and chat, streamed and not) all succeed, and each lands on a replica that serves its model."""

from __future__ import annotations

import asyncio
import random

import pytest
from aiohttp.test_utils import TestServer
from openai import AsyncOpenAI

from routewise_vllm.fleet.emulator import EmulatorSettings, make_app
from routewise_vllm.fleet.emulator.api import add_arguments, settings_from_args
from routewise_vllm.router.app import METRICS, ROUTER
from routewise_vllm.router.policy.registry import LEARNED

pytestmark = pytest.mark.timeout(240)

N_REQUESTS = 1_000
CONCURRENCY = 32


def test_served_model_name_takes_several_names_as_vllm_does():
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    s = settings_from_args(p.parse_args(["--port", "1", "--served-model-name", "alpha", "beta", "--max-num-seqs", "8"]))
    assert (s.model_name, s.aliases, s.max_num_seqs) == ("alpha", ("beta",), 8)
    assert settings_from_args(p.parse_args(["--port", "1"])).aliases == ()


async def _emulators() -> list[TestServer]:
    names = [("alpha",), ("beta",), ("alpha", "beta")]
    servers = []
    for first, *more in names:
        settings = EmulatorSettings(profile="llama3-8b-h100", model_name=first, aliases=tuple(more), speed=4.0,
                                    max_num_seqs=16)
        server = TestServer(make_app(settings), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
    return servers


@pytest.mark.slow  # over 5 s on 2 cores: outside the fast loop
async def test_a_thousand_mixed_requests_land_on_replicas_of_their_model(router_client):
    servers = await _emulators()
    urls = [str(s.make_url("")).rstrip("/") for s in servers]
    serves = {u.removeprefix("http://"): m for u, m in zip(urls, ({"alpha"}, {"beta"}, {"alpha", "beta"}))}
    rng = random.Random(11)
    kinds = [(rng.choice(["alpha", "beta"]), rng.random() < 0.5, rng.random() < 0.5) for _ in range(N_REQUESTS)]
    try:
        client = await router_client(urls, policy=LEARNED, late_binding=True, replica_header=True,
                                     first_byte_timeout_s=30, models_refresh_interval_s=3600.0)
        openai = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0, timeout=60)
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(model: str, stream: bool, chat: bool) -> tuple[str, str, int]:
            kw = dict(model=model, max_tokens=rng.randint(2, 12), stream=stream)
            async with sem:
                if chat:
                    raw = await openai.chat.completions.with_raw_response.create(
                        messages=[{"role": "user", "content": "hello " * rng.randint(1, 40)}], **kw)
                else:
                    raw = await openai.completions.with_raw_response.create(prompt="hi " * rng.randint(1, 40), **kw)
                answer = raw.parse()
                if stream:
                    pieces = [c async for c in answer]
                    tokens = sum(1 for c in pieces if c.choices and
                                 ((c.choices[0].delta.content if chat else c.choices[0].text) or ""))
                else:
                    tokens = answer.usage.completion_tokens
                return model, raw.headers["x-routewise-replica"], tokens

        try:
            results = await asyncio.gather(*(one(*k) for k in kinds))
        finally:
            await openai.close()
    finally:
        for s in servers:
            await s.close()
    assert len(results) == N_REQUESTS and all(tokens > 0 for _, _, tokens in results)
    wrong = [(m, r) for m, r, _ in results if m not in serves[r]]
    assert not wrong, wrong[:5]
    landed = {r for _, r, _ in results}
    assert landed == set(serves)  # the shared replica took some of each
    assert {m for m, r, _ in results if serves[r] == {"alpha", "beta"}} == {"alpha", "beta"}
    registry = client.app[METRICS].registry
    assert not registry.get_sample_value("llm_router_retries_total", {"reason": "stale_model"})
    served_by_policy = sum(registry.get_sample_value("llm_router_model_decisions_total", {"model": m}) or 0
                           for m in ("alpha", "beta"))
    assert served_by_policy == N_REQUESTS
    assert client.app[ROUTER].settings.policy == LEARNED
    fallbacks = {m.labels["reason"]: m.value for metric in registry.collect() if metric.name == "llm_router_fallbacks"
                 for m in metric.samples if m.name.endswith("_total")}
    assert sum(fallbacks.values()) < N_REQUESTS / 2, fallbacks  # the model decided most requests itself
