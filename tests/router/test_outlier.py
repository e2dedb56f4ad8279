"""Outlier detection on real outcomes: replicas that break streams, stall, or answer far slower than their
peers are ejected with a reason and counted, re-admitted once they recover; the panic threshold keeps the
fleet in rotation; a replica hanging on generation does not hold a non-streamed request."""

from __future__ import annotations

import asyncio

import openai
import pytest

from routewise_vllm.router.app import METRICS, REPLICAS
from routewise_vllm.router.replicas import BreakerState
from tests.router.conftest import wait_for

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def oai(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0, timeout=10)


def ejections(client, rid: str, reason: str) -> float:
    return client.app[METRICS].registry.get_sample_value(
        "llm_router_replica_ejections_total", {"replica": rid, "reason": reason}) or 0.0


async def stream_text(api, **kw) -> str:
    s = await api.completions.create(model="tiny", prompt="x", max_tokens=4, stream=True, **kw)
    return "".join([c.choices[0].text async for c in s])


async def test_replica_breaking_every_stream_is_ejected_then_readmitted(fakes, router_client):
    """It used to keep its share of traffic: non-streamed successes reset the breaker between broken streams."""
    a, b = await fakes(2)
    a.mode = "reset_mid_stream"
    # a cool-down no busy host outlasts while the ejection is checked; shortened afterwards for the readmission
    client = await router_client([a.url, b.url], policy="round-robin", breaker_failure_threshold=100,
                                 breaker_cooldown_s=600.0)
    rep = client.app[REPLICAS].by_id[a.url[7:]]
    api = oai(client)
    broken = 0
    for i in range(30):
        if rep.breaker.state is BreakerState.OPEN:
            break
        await api.completions.create(model="tiny", prompt="x", max_tokens=2)  # non-streamed: fine everywhere
        for _ in range(2):  # round-robin: a gets streamed and non-streamed requests alike
            try:
                await stream_text(api)
            except openai.APIError:
                broken += 1
    assert rep.breaker.state is BreakerState.OPEN and rep.breaker.reason == "stream_failures"
    # some breaks came before the first byte and were retried on b: the client never saw them
    assert ejections(client, rep.id, "stream_failures") == 1 and broken >= 2
    sent = a.requests
    for _ in range(3):  # all of it now goes to b (until the cool-down ends)
        assert await stream_text(api) == " tok0 tok1 tok2 tok3"
    assert a.requests == sent and rep.breaker.state is BreakerState.OPEN
    a.mode = "ok"  # recovered: half-open after the cool-down, closed by a successful trial
    rep.breaker.cooldown_s = 0.2
    await wait_for(lambda: rep.breaker.state is BreakerState.HALF_OPEN, timeout=5)
    for _ in range(4):
        assert await stream_text(api) == " tok0 tok1 tok2 tok3"
    assert rep.breaker.state is BreakerState.CLOSED and rep.routable
    admin = await client.get("/metrics")
    assert 'llm_router_replica_ejections_total{reason="stream_failures"' in await admin.text()


async def test_hanging_replica_does_not_hold_a_non_streamed_request(fakes, router_paths):
    a, b = await fakes(2, token_delay_s=0.01)
    a.mode = "hang"
    client = await router_paths([a.url, b.url], policy="round-robin", stall_timeout_s=0.5,
                                 breaker_failure_threshold=100, health_interval_s=0.05)
    api = oai(client)
    loop = asyncio.get_running_loop()

    async def one(i: int) -> float:
        t0 = loop.time()
        r = await api.completions.create(model="tiny", prompt=f"x{i}", max_tokens=2)
        assert r.choices[0].text == " tok0 tok1"
        return loop.time() - t0

    took = await asyncio.gather(*(one(i) for i in range(6)))
    assert max(took) < 3.0, took  # not the 300 s idle timeout
    rep = client.app[REPLICAS].by_id[a.url[7:]]
    assert rep.breaker.reason == "stalled" and ejections(client, rep.id, "stalled") >= 1
    assert client.app[METRICS].registry.get_sample_value(
        "llm_router_upstream_errors_total", {"replica": rep.id, "kind": "stalled"}) >= 1
    await wait_for(lambda: a.active == 0)  # the aborted requests were cancelled on the replica too


async def test_long_non_streamed_generation_is_not_a_stall(fakes, router_client):
    """The replica's own generation counter (scraped /metrics) shows progress the client cannot see yet."""
    a, b = await fakes(2)
    a.token_delay_s = 0.05  # 40 tokens: 2 s of silence on the connection, 4x stall_timeout_s
    client = await router_client([a.url, b.url], policy="round-robin", stall_timeout_s=0.5,
                                 health_interval_s=0.05, scrape_interval_s=0.05)
    r = await oai(client).completions.create(model="tiny", prompt="x", max_tokens=40)
    assert r.choices[0].text.endswith(" tok39")
    rep = client.app[REPLICAS].by_id[a.url[7:]]
    assert a.completed == 1 and rep.breaker.trips == 0 and rep.routable, "aborted as a stall"


async def test_stalled_stream_ends_with_an_error_event(fakes, router_client):
    """A stream that stops mid-way used to hang for the 300 s idle timeout."""
    (a,) = await fakes(1, token_delay_s=0.02)
    a.mode = "stall_mid_stream"
    client = await router_client([a.url], stall_timeout_s=0.5, breaker_failure_threshold=100,
                                 health_interval_s=0.05)
    # the stall timeout (0.5 s) ends it, far inside the outer bound and the 300 s idle timeout
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 6, "stream": True})
    body = await asyncio.wait_for(resp.read(), 60)
    events = [e for e in body.split(b"\n\n") if e]
    assert b"tok1" in events[1] and b'"error"' in events[-1] and b"[DONE]" not in body
    rid = a.url[7:]
    assert client.app[METRICS].registry.get_sample_value("llm_router_requests_total", {
        "replica": rid, "policy": "least-outstanding", "arm": "main", "code_class": "error"}) == 1
    await wait_for(lambda: a.active == 0)


async def test_slow_first_byte_outlier_is_ejected(fakes, router_client):
    a, b, c = await fakes(3)
    a.mode = "first_byte_delay"
    a.first_byte_delay_s = 0.3
    client = await router_client([a.url, b.url, c.url], policy="round-robin", outlier_min_requests=3,
                                 outlier_ttfb_min_s=0.1, outlier_ttfb_ratio=5, health_interval_s=0.05,
                                 breaker_cooldown_s=30, first_byte_timeout_s=5, breaker_failure_threshold=100)
    api = oai(client)
    for _ in range(12):  # one at a time: only a replica found idle is judged on its first byte
        await stream_text(api)
    rep = client.app[REPLICAS].by_id[a.url[7:]]
    await wait_for(lambda: rep.breaker.state is BreakerState.OPEN)
    assert rep.breaker.reason == "slow_first_byte" and ejections(client, rep.id, "slow_first_byte") == 1
    others = [r for r in client.app[REPLICAS].ordered if r is not rep]
    assert all(r.routable for r in others)


async def test_panic_threshold_keeps_half_the_fleet(fakes, router_client):
    """Even failures blamed on replicas never eject more than max_ejected_ratio of them."""
    reps = await fakes(4)
    for f in reps:
        f.mode = "reset_mid_stream"
    client = await router_client([f.url for f in reps], policy="round-robin", breaker_failure_threshold=2,
                                 max_ejected_ratio=0.5, breaker_cooldown_s=30)
    api = oai(client)
    for _ in range(24):
        with pytest.raises(openai.APIError):
            await stream_text(api)
    ordered = client.app[REPLICAS].ordered
    assert sum(r.breaker.state is BreakerState.OPEN for r in ordered) == 2
    assert sum(r.routable for r in ordered) == 2
    refused = [s.value for m in client.app[METRICS].ejections_refused.collect() for s in m.samples
               if s.name.endswith("_total")]
    assert sum(refused) >= 1


async def test_panic_threshold_counts_replicas_out_for_any_reason(fakes, router_client):
    """One of three drained: ejecting a broken second one would leave a third of the fleet, so it stays in."""
    a, b, c = await fakes(3)
    a.mode = "reset_mid_stream"
    client = await router_client([a.url, b.url, c.url], policy="round-robin", breaker_failure_threshold=2,
                                 max_ejected_ratio=0.5, breaker_cooldown_s=30)
    replicas = client.app[REPLICAS]
    replicas.drain(c.url[7:])
    api = oai(client)
    for _ in range(8):
        try:
            await stream_text(api)
        except openai.APIError:
            pass
    rep = replicas.by_id[a.url[7:]]
    assert rep.breaker.state is not BreakerState.OPEN and rep.routable
    refused = [s.value for m in client.app[METRICS].ejections_refused.collect() for s in m.samples
               if s.name.endswith("_total")]
    assert sum(refused) >= 1


async def test_a_request_sent_before_the_ejection_does_not_readmit(fakes, router_client):
    """Its success used to close the breaker again, clearing the ejection at once."""
    a, b = await fakes(2)
    client = await router_client([a.url, b.url], breaker_cooldown_s=30)
    replicas = client.app[REPLICAS]
    rep = replicas.by_id[a.url[7:]]
    assert replicas.eject(rep, "slow_first_byte")
    replicas.record_success(rep, stream=True, ttfb_s=0.01)
    assert rep.breaker.state is BreakerState.OPEN and not rep.routable
