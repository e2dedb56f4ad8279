"""Routing by model: the real router app in front of fake vLLM replicas serving different models and LoRA adapters,
loopback only. A fake answers vLLM's 404 for a model it does not serve, so a request sent to a wrong replica fails."""

from __future__ import annotations

import asyncio
import json
import random

import openai
import pytest

from routewise_vllm.router.app import METRICS, REPLICAS, ROUTER
from routewise_vllm.router.models import parse_model_list
from routewise_vllm.router.policy.model_routing import OTHER_MODEL, members, model_label
from routewise_vllm.router.serving.decision_log import log_files
from tests.router.conftest import wait_for
from tests.fakes.harness import two_model_fleet

pytestmark = pytest.mark.timeout(60)

LATE = dict(late_binding=True, late_binding_max_num_seqs=1, late_binding_timeout_s=30.0)
QUIET = dict(health_interval_s=30.0, scrape_interval_s=30.0, models_refresh_interval_s=3600.0)


def sample(client, name: str, **labels) -> float | None:
    return client.app[METRICS].registry.get_sample_value(name, labels)


async def post(client, model: str, prompt: str = "hi", stream: bool = False, max_tokens: int = 2,
               chat: bool = False) -> tuple[int, dict | str]:
    body = {"model": model, "max_tokens": max_tokens, "stream": stream}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    resp = await client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    text = await resp.text()
    return resp.status, (json.loads(text) if resp.content_type == "application/json" else text)


def test_members_and_labels():
    assert members(None, [frozenset({"a"}), frozenset({"b"})]) is None
    assert members("a", [frozenset({"a"}), frozenset({"b"}), frozenset({"a", "b"})]) == (0, 2)
    assert members("a", [frozenset({"a"}), None]) is None  # None: serves any model (every replica may take it)
    assert members("z", [frozenset({"a"})]) == ()
    assert model_label("a", frozenset({"a"})) == "a" and model_label("zz", frozenset({"a"})) == OTHER_MODEL
    assert model_label(None, frozenset()) == OTHER_MODEL
    for bad in ({"models": []}, [], {"data": [{"name": "x"}]}, {"data": [{"id": ""}]}, {"data": "x"}):
        with pytest.raises(ValueError):
            parse_model_list(bad)


async def test_two_model_fleet_every_request_lands_on_a_replica_of_its_model(fakes, router_client, tmp_path):
    a, b, c = await two_model_fleet(fakes)
    client = await router_client([a.url, b.url, c.url], decision_log_dir=tmp_path)
    rng = random.Random(7)
    kinds = [(rng.choice(["alpha", "beta"]), rng.random() < 0.5, rng.random() < 0.5) for _ in range(300)]
    sem = asyncio.Semaphore(24)

    async def one(model: str, stream: bool, chat: bool):
        async with sem:
            return await post(client, model, stream=stream, chat=chat)

    results = await asyncio.gather(*(one(*k) for k in kinds))
    assert [s for s, _ in results] == [200] * len(kinds)
    assert set(a.served_models) == {"alpha"} and set(b.served_models) == {"beta"}
    assert set(c.served_models) == {"alpha", "beta"}  # the shared replica takes both
    assert len(a.served_models) + len(b.served_models) + len(c.served_models) == len(kinds)
    assert a.requests + b.requests + c.requests == len(kinds)  # no request was ever sent to a wrong replica
    n_alpha = sum(1 for m, _, _ in kinds if m == "alpha")
    assert sample(client, "llm_router_model_decisions_total", model="alpha") == n_alpha
    assert sample(client, "llm_router_model_decisions_total", model="beta") == len(kinds) - n_alpha
    client.app[ROUTER].serving.decision_log.close()
    records = [json.loads(line) for f in log_files(tmp_path) for line in f.read_text().splitlines()]
    assert len(records) == len(kinds)
    ids = [a.url, b.url, c.url]
    for r in records:  # the policy saw only the model's replicas as candidates
        allowed = {0, 2} if r["model"] == "alpha" else {1, 2}
        assert {i for i, m in enumerate(r["mask"]) if m} == allowed and r["index"] in allowed
        assert r["replica"] == ids[r["index"]].removeprefix("http://")


async def test_lora_adapter_routed_to_the_replicas_that_load_it_and_listed_with_its_parent(fakes, router_client):
    (a,) = await fakes(1, models=["base"], adapters={"sql-lora": "base"})
    (b,) = await fakes(1, models=["base"])
    client = await router_client([a.url, b.url], policy="round-robin")
    for i in range(12):
        status, _ = await post(client, "sql-lora" if i % 2 else "base", stream=bool(i % 3))
        assert status == 200
    assert a.served_models.count("sql-lora") == 6 and "sql-lora" not in b.served_models
    assert b.served_models.count("base") >= 3  # the base model still goes to both
    listed = (await (await client.get("/v1/models")).json())["data"]
    assert {m["id"]: m["parent"] for m in listed} == {"base": None, "sql-lora": "base"}


async def test_openai_client_unknown_model_404_lists_models_and_models_union(fakes, router_client):
    a, b, c = await two_model_fleet(fakes)
    client = await router_client([a.url, b.url, c.url])
    oai = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0, timeout=20)
    try:
        listed = await oai.models.list()
        assert sorted(m.id for m in listed.data) == ["alpha", "beta"]
        for model in ("alpha", "beta"):
            done = await oai.completions.create(model=model, prompt="x", max_tokens=2)
            assert done.choices[0].text
            chat = await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=2, stream=True)
            assert [ch async for ch in chat]
        with pytest.raises(openai.NotFoundError) as err:
            await oai.completions.create(model="gamma", prompt="x", max_tokens=2)
    finally:
        await oai.close()
    body = err.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "`gamma`" in body["message"] and "Available models: alpha, beta" in body["message"]
    assert "gamma" not in a.served_models + b.served_models + c.served_models and a.requests + b.requests + c.requests == 4
    assert sample(client, "llm_router_model_refusals_total", reason="unknown_model") == 1


async def test_503_names_the_model_whose_replicas_are_all_out_of_rotation(fakes, router_client):
    a, b, c = await two_model_fleet(fakes)
    client = await router_client([a.url, b.url, c.url], health_interval_s=30.0)
    replicas = client.app[REPLICAS]
    for fake in (b, c):  # beta's replicas drained: beta refused, alpha still served by a
        replicas.drain(fake.url.removeprefix("http://"))
    status, body = await post(client, "beta")
    assert status == 503 and body["error"]["code"] == "no_healthy_replica"
    assert "`beta`" in body["error"]["message"] and body["error"]["type"] == "server_error"
    assert (await post(client, "alpha", stream=True))[0] == 200 and a.served_models == ["alpha"]
    assert (await post(client, "gamma"))[0] == 404  # not served anywhere: 404, not 503
    assert sample(client, "llm_router_model_refusals_total", reason="no_replica") == 1


async def test_a_replica_answering_404_for_its_model_has_its_list_read_again(fakes, router_client):
    a, b = await fakes(2, models=["alpha"])
    client = await router_client([a.url, b.url], policy="round-robin", **QUIET)
    reads = a.model_requests
    a.models = ["other"]  # a stops serving alpha; the router's list is stale
    statuses = [(await post(client, "alpha", stream=i == 1))[0] for i in range(2)]  # round-robin: one goes to a
    assert statuses == [200, 200]  # a's 404 is retried on b before the first byte
    assert a.requests == 1 and not a.served_models and len(b.served_models) == 2
    assert sample(client, "llm_router_retries_total", reason="stale_model") == 1
    await wait_for(lambda: a.model_requests > reads and client.app[REPLICAS].members("alpha") is not None)
    assert [(await post(client, "alpha"))[0] for _ in range(6)] == [200] * 6
    assert a.requests == 1 and len(b.served_models) == 8
    assert client.app[REPLICAS].known_models == {"alpha", "other"}
    assert client.app[REPLICAS].by_id[a.url.removeprefix("http://")].routable  # a 404 is no failure of a


async def test_a_404_with_no_other_replica_of_the_model_reaches_the_client(fakes, router_client):
    (a,) = await fakes(1, models=["alpha"])
    (b,) = await fakes(1, models=["beta"])
    client = await router_client([a.url, b.url], **QUIET)
    a.models = ["other"]  # stale: the router still takes a for alpha's only replica
    status, body = await post(client, "alpha")
    assert status == 404 and "`alpha`" in body["error"]["message"]  # vLLM's own answer
    a.models, a.mode = ["alpha"], "error_500"
    assert (await post(client, "alpha"))[0] == 500  # nor is a 5xx retried on a replica of another model
    assert b.requests == 0 and not sample(client, "llm_router_retries_total", reason="stale_model")


async def test_garbage_model_list_serves_nothing_and_is_counted(fakes, router_client):
    a, b = await fakes(2, models=["alpha"])
    a.models_mode = "garbage"
    client = await router_client([a.url, b.url], policy="round-robin")
    assert sample(client, "llm_router_model_list_errors_total", replica=a.url.removeprefix("http://")) >= 1
    assert [(await post(client, "alpha"))[0] for _ in range(6)] == [200] * 6
    assert a.requests == 0 and len(b.served_models) == 6
    a.models_mode = "ok"  # answers sensibly again: routed to again after the next read
    await client.app[REPLICAS].refresh_models()
    assert [(await post(client, "alpha"))[0] for _ in range(4)] == [200] * 4
    assert a.served_models == ["alpha", "alpha"]


async def test_late_binding_holds_per_model(fakes, router_client):
    """alpha's only replica is full: a second alpha request is held; beta requests, arriving after it, go at
    once to beta's replica and complete while alpha's waits; alpha's completion releases its held request."""
    (a,) = await fakes(1, models=["alpha"])
    (b,) = await fakes(1, models=["beta"])
    end = a.hold("first")
    client = await router_client([a.url, b.url], **LATE, **QUIET)
    router = client.app[ROUTER]
    first = asyncio.create_task(post(client, "alpha", "first", stream=True))
    await wait_for(lambda: a.active == 1)
    second = asyncio.create_task(post(client, "alpha", "second", stream=True))
    await wait_for(lambda: len(router.holds) == 1)
    for i in range(3):  # beta's replica has room: nothing of beta waits behind the held alpha request
        assert (await post(client, "beta", f"b{i}", stream=bool(i % 2)))[0] == 200
    assert len(router.holds) == 1 and a.requests == 1 and len(b.served_models) == 3
    end.set()
    assert [s for s, _ in await asyncio.gather(first, second)] == [200, 200]
    assert [x["prompt"] for x in a.bodies] == ["first", "second"] and len(router.holds) == 0

