"""`router serve --policy prefix-aware`, with nothing else about KV events, on the session's two real vLLM servers:
it finds each server's publisher (`/kv_event_sources`), follows both, and vLLM's own prefix-cache hit fraction over
96 completions reaches 0.84.

The workload is sized for the shared pair (server 0: 2 MiB of KV = 64 blocks of 32 tokens, 4 sequences; server 1:
16 MiB): six system prompts of 9 full blocks (54 blocks) fit on either server even if every prompt is placed on
server 0, so where the router places a new prompt (by load: a coin toss on idle servers) cannot make it evict.
Each prompt's first request goes alone, before the others (a system prompt is in use before it is shared), so every
repeat can find its blocks reported; then the other 90 requests run 4 at a time in a shuffled order. The ideal
(each prompt's first request misses, each repeat hits its 288 prompt tokens): about 0.90. The full-size bench
(16 MiB each, 12 prompts of ~950 tokens, every arm, one and two routers) is tests/bench/kv_hit_fraction.py.
"""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from routewise_vllm.fleet.router_process import start_router
from routewise_vllm.fleet.vllm import SERVED_MODEL_NAME
from routewise_vllm.router.kv.prompt_tokens import LocalTokenizer
from routewise_vllm.router.settings import replica_id

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(240)]

REQUESTS = 96
CONCURRENCY = 4
PROMPTS = 6
BLOCK_TOKENS = 32  # the session servers' --block-size
TARGET_TOKENS = 9 * BLOCK_TOKENS
MIN_HIT_FRACTION = 0.84
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "qu", "ex", "th", "sh", "ing", "ed", "er"]


def system_prompts(tok: LocalTokenizer, seed: int) -> list[str]:
    """PROMPTS fresh system prompts (nothing the servers cached before) of TARGET_TOKENS tokens or a few more."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choices(SYLLABLES, k=rng.randint(2, 4))) for _ in range(300)]
    out = []
    for i in range(PROMPTS):
        text = f"System {seed}-{i}-{time.time_ns()}:"
        while len(tok.completion_ids(text)) < TARGET_TOKENS:
            text += " " + rng.choice(vocab)
        out.append(text)
    return out


def prefix_cache(url: str) -> tuple[float, float]:
    """vLLM's own (hits, queries) in tokens."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    got = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in got:
            got[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return got["vllm:prefix_cache_hits"], got["vllm:prefix_cache_queries"]


def router_samples(base_url: str, name: str) -> list[tuple[dict, float]]:
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


async def drive(base_url: str, prompts: list[str]) -> None:
    rng = random.Random(7)
    order = [i % len(prompts) for i in range(len(prompts), REQUESTS)]
    rng.shuffle(order)
    sem = asyncio.Semaphore(CONCURRENCY)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one(k: int, p: int) -> None:
            body = {"model": SERVED_MODEL_NAME, "prompt": prompts[p] + f"\nQuestion {k}: which replica?",
                    "max_tokens": 8, "ignore_eos": True}
            async with sem, s.post(f"{base_url}/v1/completions", json=body) as r:
                assert r.status == 200, (await r.text())[:300]
                await r.read()

        for p in range(len(prompts)):  # each prompt's first request alone
            await one(p, p)
        await asyncio.gather(*(one(len(prompts) + k, p) for k, p in enumerate(order)))


def test_prefix_aware_on_kv_events_reaches_the_hit_fraction(vllm_servers, tiny_model_dir, vllm_work_dir: Path):
    prompts = system_prompts(LocalTokenizer(tiny_model_dir), seed=54)
    router = start_router(list(vllm_servers), "prefix-aware", vllm_work_dir / "router-kv-events")
    try:
        ids = {replica_id(u) for u in vllm_servers}
        deadline = time.monotonic() + 30  # the router looks for publishers every 5 s
        while {s[0]["replica"] for s in router_samples(router.base_url, "llm_router_kv_view_fresh") if s[1] == 1} != ids:
            assert time.monotonic() < deadline, f"KV views not fresh; router log:\n{router.log_tail()}"
            time.sleep(0.2)
        before = [prefix_cache(u) for u in vllm_servers]
        asyncio.run(drive(router.base_url, prompts))
        after = [prefix_cache(u) for u in vllm_servers]
        hits = sum(a[0] - b[0] for a, b in zip(after, before))
        queries = sum(a[1] - b[1] for a, b in zip(after, before))
        stored = {s[0]["replica"]: s[1] for s in router_samples(router.base_url, "llm_router_kv_events_total")
                  if s[0]["kind"] == "BlockStored"}
        sources = {s[0]["source"]: s[1] for s in router_samples(router.base_url, "llm_router_prefix_match_source_total")}
        print(f"hit fraction {hits / queries:.3f} ({hits:.0f}/{queries:.0f} tokens); BlockStored {stored}; "
              f"match sources {sources}")
        assert all(stored.get(rid, 0) > 0 for rid in ids), f"events from both replicas: {stored}"
        assert sources.get("precise", 0) > 0, sources
        assert hits / queries >= MIN_HIT_FRACTION, f"hit fraction {hits / queries:.3f} ({hits:.0f}/{queries:.0f})"
    finally:
        router.stop()
