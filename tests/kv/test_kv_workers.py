"""`router serve --workers 2` with KV events (loopback, emulated replicas): either worker's /metrics shows the KV
view (each worker follows the same publishers) and the decisions' match and token-block sources of both workers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.kv.test_kv_live import SYSTEM, free_port, start_emulator
from tests.router.test_workers import workers

pytestmark = pytest.mark.timeout(120)


async def samples(session, url: str) -> dict[tuple, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, *sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def total(m: dict[tuple, float], name: str) -> float:
    return sum(v for k, v in m.items() if k[0] == name)


async def until(cond, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_either_workers_metrics_show_the_kv_view_and_both_workers_decisions(monkeypatch):
    monkeypatch.setenv("ROUTEWISE_KV_EVENTS_REFRESH_S", "0.2")
    ports = [free_port() for _ in range(4)]
    emus = [await start_emulator(ports[0], ports[1]), await start_emulator(ports[2], ports[3])]
    reps = [SimpleNamespace(url=f"http://127.0.0.1:{p}") for p in (ports[0], ports[2])]
    rids = [f"127.0.0.1:{p}" for p in (ports[0], ports[2])]
    try:
        async with workers(reps, "--policy", "prefix-aware") as w:
            sa, sb = w.by_pid.values()

            async def fresh_everywhere() -> bool:
                for s in (sa, sb):
                    m = await samples(s, w.url)
                    if any(m.get(("llm_router_kv_view_fresh", ("replica", rid))) != 1 for rid in rids):
                        return False
                return True

            await until(fresh_everywhere)

            async def post(s, i: int, q: int) -> None:
                body = {"model": "tiny", "prompt": SYSTEM[i] + f" question {q}", "max_tokens": 2}
                async with s.post(w.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()

            await post(sa, 0, 0)  # the first blocks stored: every worker learns the block size from them

            async def stored_everywhere() -> bool:
                ms = [await samples(s, w.url) for s in (sa, sb)]
                return all(total({k: v for k, v in m.items() if ("kind", "BlockStored") in k}, "llm_router_kv_events_total")
                           > 0 for m in ms)

            await until(stored_everywhere)
            for q in range(1, 4):
                await post(sa, q % 2, q)
            for q in range(4, 8):
                await post(sb, q % 2, q)

            async def both_workers_counted() -> bool:
                ms = [await samples(s, w.url) for s in (sa, sb)]
                return all(total(m, "llm_router_prefix_match_source_total") >= 8
                           and total(m, "llm_router_prompt_blocks_total") >= 7 for m in ms)

            await until(both_workers_counted, 15.0)  # each worker adds its counts every second
            m = await samples(sb, w.url)
            for rid in rids:
                assert ("llm_router_kv_view_blocks", ("replica", rid)) in m
            assert total(m, "llm_router_kv_view_blocks") > 0
    finally:
        for e in emus:
            await e.close()
