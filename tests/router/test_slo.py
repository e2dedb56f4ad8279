"""Per-request latency targets (router/slo.py): x-slo-ttft-ms / x-slo-tpot-ms and per-model defaults, deadline-first
dispatch of held requests behind late binding, attainment telemetry. The real router app in front of fake vLLM
replicas, loopback only; holds are provoked with `late_binding_max_num_seqs=1` and ordered by the fakes' gates."""

from __future__ import annotations

import asyncio
import math

import pytest

from routewise_vllm.router.app import METRICS, ROUTER
from routewise_vllm.router.settings import RouterSettings
from routewise_vllm.router.slo import Targets, header_ms, judge
from routewise_vllm.router.telemetry import RouterMetrics
from tests.router.conftest import wait_for

pytestmark = pytest.mark.timeout(60)

LATE = dict(late_binding=True, late_binding_max_num_seqs=1, late_binding_timeout_s=30.0,
            health_interval_s=30.0, scrape_interval_s=30.0)


def sample(client, name: str, **labels) -> float:
    return client.app[METRICS].registry.get_sample_value(name, labels) or 0.0


def held(client) -> int:
    return len(client.app[ROUTER].holds)


async def post(client, prompt: str, headers: dict | None = None, stream: bool = True, path: str = "/v1/completions",
               **body) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": stream, **body}
    resp = await client.post(path, json=body, headers=headers or {})
    await resp.read()
    return resp.status


def ttft(ms) -> dict:
    return {"x-slo-ttft-ms": str(ms)}


def test_header_values_and_judgement():
    assert header_ms("250") == 0.25 and header_ms(" 1e3 ") == 1.0 and header_ms(None) is None
    for bad in ("abc", "", "0", "-5", "nan", "inf", "-inf"):
        with pytest.raises(ValueError):
            header_ms(bad)
    assert judge(None, 1.0, True) == "no_target" and judge(0.5, 0.4, True) == "met"
    assert judge(0.5, 0.6, True) == "missed" and judge(0.5, 0.1, False) == "missed"
    assert judge(0.5, None, True) == "unmeasured"


def test_a_header_overrides_the_models_default_and_bad_ones_are_counted():
    settings = RouterSettings(replicas=["http://a:1"], slo_default_ttft_s="alpha=0.5,*=2", slo_default_tpot_s="beta=0.05")
    metrics = RouterMetrics()
    t = Targets(settings, metrics)
    assert t.of({}, "alpha") == (0.5, None) and t.of({}, "beta") == (2.0, 0.05) and t.of(None, None) == (2.0, None)
    assert t.of({"x-slo-ttft-ms": "100", "x-slo-tpot-ms": "20"}, "alpha") == (0.1, 0.02)
    assert t.of({"x-slo-ttft-ms": "soon", "x-slo-tpot-ms": "-1"}, "alpha") == (0.5, None)  # ignored: the default
    errors = {h: metrics.registry.get_sample_value("llm_router_slo_header_errors_total", {"header": h})
              for h in ("x-slo-ttft-ms", "x-slo-tpot-ms")}
    assert errors == {"x-slo-ttft-ms": 1.0, "x-slo-tpot-ms": 1.0}
    with pytest.raises(ValueError, match="slo_default_ttft_s"):
        RouterSettings(replicas=["http://a:1"], slo_default_ttft_s="alpha=0")


async def test_held_requests_go_earliest_deadline_first(fakes, router_client):
    (a,) = await fakes(1)
    end_a = a.hold("A")  # A keeps the only slot until the test lets it finish
    client = await router_client([a.url], **LATE)
    first = asyncio.create_task(post(client, "A"))
    await wait_for(lambda: a.active == 1)
    later = []
    for prompt, headers in (("none", {}), ("loose", ttft(60_000)), ("tight", ttft(1_000)), ("tighter", ttft(500))):
        later.append(asyncio.create_task(post(client, prompt, headers)))  # one at a time: the arrival order is known
        await wait_for(lambda n=len(later): held(client) == n)
    end_a.set()  # each slot frees as the request before completes
    assert await asyncio.gather(first, *later) == [200] * 5
    assert [b["prompt"] for b in a.bodies] == ["A", "tighter", "tight", "loose", "none"]  # not arrival order


async def test_the_queue_timeout_still_goes_by_arrival(fakes, router_client):
    (a,) = await fakes(1)
    end_a = a.hold("A")
    now = [1000.0]
    client = await router_client([a.url], clock=lambda: now[0], **LATE)
    first = asyncio.create_task(post(client, "A"))
    await wait_for(lambda: a.active == 1)
    old = asyncio.create_task(post(client, "old"))  # no target, held
    await wait_for(lambda: held(client) == 1)
    now[0] += 31.0  # the oldest has now waited past late_binding_timeout_s
    tight = asyncio.create_task(post(client, "tight", ttft(100)))  # an earlier deadline arrives
    await wait_for(lambda: a.requests == 2)
    assert [b["prompt"] for b in a.bodies] == ["A", "old"] and held(client) == 1  # the timed-out one went, busy or not
    assert sample(client, "llm_router_late_dispatches_total", reason="timeout") == 1
    end_a.set()
    assert await asyncio.gather(first, old, tight) == [200] * 3


async def test_attainment_is_counted_per_target_and_result(fakes, router_client):
    (a,) = await fakes(1, tokens=4)
    client = await router_client([a.url])
    big = {"x-slo-ttft-ms": "600000", "x-slo-tpot-ms": "600000"}
    assert await post(client, "met", big, max_tokens=4) == 200  # streamed: TTFT and TPOT measured
    assert await post(client, "missed", {"x-slo-ttft-ms": "1e-6"}) == 200  # a nanosecond: missed
    assert await post(client, "whole", big, stream=False) == 200  # TTFT is the whole answer's time; TPOT unseen
    assert await post(client, "none", stream=False) == 200
    for bad in ("abc", "0", "-3", "nan", "inf"):
        assert await post(client, "bad", {"x-slo-ttft-ms": bad}) == 200  # ignored, never an error
    assert await post(client, "", ttft(600000), path="/v1/embeddings", input="x", stream=False) == 200
    assert await post(client, "", ttft(600000), path="/v1/responses", input="x") == 200  # events are not tokens
    a.mode = "error_500"
    assert await post(client, "failed", ttft(600000)) == 500
    got = {(t, r): sample(client, "llm_router_slo_attainment_total", model="tiny", target=t, result=r)
           for t in ("ttft", "tpot") for r in ("met", "missed", "no_target", "unmeasured")}
    assert got == {("ttft", "met"): 3, ("ttft", "missed"): 2, ("ttft", "no_target"): 6, ("ttft", "unmeasured"): 1,
                   ("tpot", "met"): 1, ("tpot", "missed"): 0, ("tpot", "no_target"): 10, ("tpot", "unmeasured"): 1}
    assert sample(client, "llm_router_slo_header_errors_total", header="x-slo-ttft-ms") == 5


async def test_a_models_default_target_applies_without_a_header(fakes, router_client):
    (a,) = await fakes(1)
    client = await router_client([a.url], slo_default_ttft_s={"tiny": 600.0})
    assert await post(client, "x") == 200 and await post(client, "y", ttft("1e-6")) == 200
    assert sample(client, "llm_router_slo_attainment_total", model="tiny", target="ttft", result="met") == 1
    assert sample(client, "llm_router_slo_attainment_total", model="tiny", target="ttft", result="missed") == 1
    assert math.isclose(client.app[ROUTER].targets.of({}, "tiny")[0], 600.0)
