"""Health probes, circuit breaker, DNS discovery, admin API, metric names."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from routewise_vllm.router.app import REPLICAS
from routewise_vllm.router.replicas import BreakerState
from tests.router.conftest import wait_for

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def completion(client, **kw):
    return await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1, **kw})


async def test_health_probe_ejects_and_readmits(fakes, router_client):
    a, b = await fakes(2)
    client = await router_client([a.url, b.url])
    ra = client.app[REPLICAS].by_id[a.url.removeprefix("http://")]
    assert ra.routable
    a.health_ok = False
    await wait_for(lambda: not ra.routable)
    for _ in range(4):
        assert (await completion(client)).status == 200
    assert a.requests == 0 and b.requests == 4
    a.health_ok = True
    await wait_for(lambda: ra.routable)


async def test_a_stream_in_flight_outlives_its_replica_leaving_the_rotation(fakes, router_client):
    """Failing probes only stop new traffic: the stream already on the replica keeps flowing and keeps its
    outstanding slot until it ends, then releases it exactly once."""
    a, b = await fakes(2, token_delay_s=0.01)
    client = await router_client([a.url, b.url], policy="round-robin", replica_header=True)
    ra, rb = (client.app[REPLICAS].by_id[f.url.removeprefix("http://")] for f in (a, b))
    n = 60
    resp = await completion(client, max_tokens=n, stream=True)
    assert resp.headers["x-routewise-replica"] == ra.id
    body = await resp.content.readany()
    a.health_ok = False
    await wait_for(lambda: not ra.routable)
    assert ra.tracker.outstanding == 1 and a.active == 1  # still open on both sides
    for _ in range(3):  # new requests avoid the unhealthy replica
        assert (await completion(client)).headers["x-routewise-replica"] == rb.id
    body += await resp.read()
    assert body.count(b" tok") == n and body.rstrip().endswith(b"data: [DONE]")
    assert a.completed == 1 and a.cancelled == 0
    assert ra.tracker.outstanding == 0 and rb.tracker.outstanding == 0


async def test_circuit_breaker_ejects_then_recovers_half_open(fakes, router_client):
    a, b = await fakes(2)
    a.mode = "error_500"
    client = await router_client([a.url, b.url], policy="round-robin", breaker_failure_threshold=2,
                                 breaker_cooldown_s=0.3, max_retries=1)
    ra = client.app[REPLICAS].by_id[a.url.removeprefix("http://")]
    for _ in range(6):
        assert (await completion(client)).status == 200  # failures on a are retried on b
    assert ra.breaker.state is BreakerState.OPEN and not ra.routable
    assert a.requests == 2  # ejected after two consecutive failures, then no more traffic
    a.mode = "ok"
    await wait_for(lambda: ra.breaker.state is BreakerState.HALF_OPEN)  # a passing probe after the cool-down
    assert ra.routable
    for _ in range(4):
        assert (await completion(client)).status == 200
    assert ra.breaker.state is BreakerState.CLOSED and a.completed >= 1


async def test_half_open_failure_reopens(fakes, router_client):
    a, b = await fakes(2)
    a.mode = "error_500"
    client = await router_client([a.url, b.url], policy="round-robin", breaker_failure_threshold=1,
                                 breaker_cooldown_s=0.2, max_retries=1)
    ra = client.app[REPLICAS].by_id[a.url.removeprefix("http://")]
    for _ in range(2):
        await completion(client)
    assert ra.breaker.state is BreakerState.OPEN
    await wait_for(lambda: ra.breaker.state is BreakerState.HALF_OPEN)
    n = a.requests
    for _ in range(3):
        assert (await completion(client)).status == 200
    assert a.requests == n + 1 and ra.breaker.state is BreakerState.OPEN and ra.breaker.trips == 2


async def test_dns_discovery_of_localhost(fakes, router_client):
    (a,) = await fakes(1)
    port = a.url.rsplit(":", 1)[1]
    client = await router_client([], discover=f"localhost:{port}", discover_interval_s=0.1)
    assert f"127.0.0.1:{port}" in client.app[REPLICAS].by_id
    assert (await completion(client)).status == 200 and a.completed == 1


async def test_admin_requires_token_and_drains(fakes, router_client):
    a, b = await fakes(2)
    client = await router_client([a.url, b.url], admin_token=TOKEN)
    assert (await client.get("/admin/status")).status == 401
    assert (await client.get("/admin/status", headers={"Authorization": "Bearer wrong"})).status == 401
    resp = await client.get("/admin/status", headers=AUTH)
    assert resp.status == 200 and (await resp.json())["replicas"] == {"total": 2, "routable": 2}
    reps = (await (await client.get("/admin/replicas", headers=AUTH)).json())["replicas"]
    assert {r["id"] for r in reps} == {a.url[7:], b.url[7:]}
    assert reps[0]["scrape"]["waiting"] == 3 and reps[0]["breaker"]["state"] == "closed"
    policy = await (await client.get("/admin/policy", headers=AUTH)).json()
    assert policy["arms"]["main"]["policy"] == "least-outstanding"

    assert (await client.post(f"/admin/replicas/{a.url[7:]}/drain")).status == 401
    resp = await client.post(f"/admin/replicas/{a.url[7:]}/drain", headers=AUTH)
    assert resp.status == 200 and (await resp.json())["state"] == "draining"
    for _ in range(4):
        assert (await completion(client)).status == 200
    assert a.requests == 0 and b.requests == 4
    resp = await client.post(f"/admin/replicas/{a.url[7:]}/restore", headers=AUTH)
    assert (await resp.json())["state"] == "healthy"
    # sequential requests leave both replicas idle, so LOR breaks the tie at random: a restored replica gets
    # one of 40 with probability 1 - 2**-40
    sent = 4
    while a.requests == 0 and sent < 44:
        assert (await completion(client)).status == 200
        sent += 1
    assert a.requests >= 1
    assert (await client.post("/admin/replicas/nope:1/drain", headers=AUTH)).status == 404
    policy = await (await client.get("/admin/policy", headers=AUTH)).json()
    assert policy["arms"]["main"]["decisions"] == sent


async def test_admin_disabled_without_token(fakes, router_client):
    (a,) = await fakes(1)
    client = await router_client([a.url])
    assert (await client.get("/admin/status")).status == 404
    assert (await client.get("/admin/status", headers=AUTH)).status == 404


EXPECTED_METRICS = {
    "llm_router_requests": "counter",
    "llm_router_ttft_seconds": "histogram",
    "llm_router_inter_token_latency_seconds": "histogram",
    "llm_router_e2e_latency_seconds": "histogram",
    "llm_router_outstanding_requests": "gauge",
    "llm_router_decision_latency_seconds": "histogram",
    "llm_router_fallbacks": "counter",
    "llm_router_upstream_errors": "counter",
    "llm_router_retries": "counter",
    "llm_router_scrape_errors": "counter",
    "llm_router_scrape_age_seconds": "gauge",
    "llm_router_replica_healthy": "gauge",
    "llm_router_replica_waiting_requests": "gauge",
    "llm_router_replica_running_requests": "gauge",
    "llm_router_replica_kv_cache_usage_ratio": "gauge",
    "llm_router_policy_info": "gauge",
}


async def test_metrics_endpoint_exposes_every_metric(fakes, router_client):
    a, b = await fakes(2)
    a.mode = "reset_mid_stream"
    client = await router_client([a.url, b.url], policy="round-robin", breaker_failure_threshold=100)
    b.metrics_mode = "garbage"
    await wait_for(lambda: client.app[REPLICAS].by_id[b.url[7:]].scrape_error is not None)
    for stream in (True, True, False, False):
        resp = await completion(client, stream=stream, max_tokens=4)
        await resp.read()
    a.mode = "error_500"
    for _ in range(2):
        await (await completion(client)).read()
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    for name, kind in EXPECTED_METRICS.items():
        assert name in families, name
        assert families[name].type == kind, name
        assert families[name].samples, f"{name} has no samples"
    samples = {s.name for f in families.values() for s in f.samples}
    assert "llm_router_requests_total" in samples and "llm_router_ttft_seconds_bucket" in samples
    info = [s for s in families["llm_router_policy_info"].samples]
    assert info[0].labels["arm"] == "main" and info[0].labels["name"] == "round-robin" and info[0].value == 1
    healthy = {s.labels["replica"]: s.value for s in families["llm_router_replica_healthy"].samples}
    assert healthy == {a.url[7:]: 1.0, b.url[7:]: 1.0}
    assert not any(k.startswith("python_") for k in families)  # a per-app registry, not the global one


async def test_broken_model_falls_back_and_counts(fakes, router_client, tmp_path):
    (a,) = await fakes(1)
    model = tmp_path / "broken.onnx"
    model.write_bytes(b"not an onnx model")
    client = await router_client([a.url], policy=str(model))
    for _ in range(3):
        assert (await completion(client)).status == 200
    resp = await client.get("/metrics")
    text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    fallbacks = {s.labels["reason"]: s.value for s in families["llm_router_fallbacks"].samples
                 if s.name.endswith("_total")}
    assert fallbacks["unavailable"] == 3 and sum(fallbacks.values()) == 3  # a bad model never fails a request
    (info,) = [s.labels for s in families["llm_router_policy_info"].samples]  # what really serves: the fallback
    assert info == {"arm": "main", "name": "least-outstanding", "version": "fallback", "feature_hash": ""}
    ready = await client.get("/ready")  # not ready: a rollout with a model that does not load must stop
    body = await ready.json()
    assert ready.status == 503 and body["healthy_replicas"] == 1
    assert body["policies"]["main"]["serving"] == "least-outstanding (fallback)"
    assert "not a loadable ONNX model" in body["policies"]["main"]["error"]


async def test_the_start_up_heap_is_frozen_out_of_the_cyclic_gc_while_the_app_runs(fakes):
    """A full collection of the router's start-up heap took ~30 ms inside random requests (and decisions timed
    over the budget): the app freezes that heap when it starts and unfreezes it when it stops."""
    import gc

    from tests.fakes.harness import router_apps
    from tests.router.conftest import FAST

    (a,) = await fakes(1)
    async with router_apps(FAST) as start:
        client = await start([a.url])
        assert gc.get_freeze_count() > 10_000  # aiohttp, numpy, the app: all of it
        assert (await completion(client)).status == 200
    assert gc.get_freeze_count() == 0
