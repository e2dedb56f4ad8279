"""The model list at any size: a fleet of LoRA adapters may list 100,000 names. What the router answers about them
(a 404's few names, its own /v1/models body) is built once per list change, never per request; the `model` label
of its metrics is bounded by a setting; a list's change is logged as a count and a digest, never as the names."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import re

import pytest
from aiohttp.test_utils import make_mocked_request

from routewise_vllm.router import model_index, models
from routewise_vllm.router.app import METRICS, REPLICAS
from routewise_vllm.router.model_index import ModelIndex, SendBudget, accepts_gzip, etag_matches
from routewise_vllm.router.models import models_handler, unknown_model
from routewise_vllm.router.policy.model_routing import OTHER_MODEL, ModelLabels
from tests.router.test_models import QUIET, post, sample

pytestmark = pytest.mark.timeout(60)

PARSE = models.parse_model_list
LISTED = re.compile(r"Available models: (.*) and (\d+) more\.$")


class CountingSet(frozenset):
    """A frozenset that counts how often it is walked through (sorting, joining or scanning it all)."""

    def __init__(self, *args) -> None:
        self.walks = 0

    def __iter__(self):
        self.walks += 1
        return super().__iter__()


class Fleet:
    """What unknown_model reads of a ReplicaSet."""

    def __init__(self, known: frozenset[str]) -> None:
        self.known_models, self.models_known, self.metrics = known, True, None


@pytest.mark.parametrize("size", [100, 100_000])
def test_an_unknown_models_404_costs_one_walk_of_the_list_per_change_not_per_request(size):
    names = [f"lora-{i:06d}" for i in range(size)]
    fleet = Fleet(CountingSet(names))
    messages = {unknown_model(fleet, f"nope-{i}").message.split("`", 2)[2] for i in range(50)}
    assert fleet.known_models.walks == 1  # the old 404 sorted the whole list for each request
    (message,) = messages
    first, more = LISTED.search(message).groups()
    assert first.split(", ") == names[:20] and int(more) == size - 20
    assert unknown_model(fleet, names[-1]) is None  # a listed model is no 404

    fleet.known_models = CountingSet(["only"])  # a list change: built again, once
    assert unknown_model(fleet, "nope").message.endswith("Available models: only.")
    assert unknown_model(fleet, "nope2") is not None and fleet.known_models.walks == 1


async def test_the_routers_refusals_name_twenty_models_and_the_count(fakes, router_client):
    adapters = {f"lora-{i:05d}": "base" for i in range(5_000)}
    (a,) = await fakes(1, models=["base"], adapters=adapters)
    (b,) = await fakes(1, models=["solo"])
    client = await router_client([a.url, b.url], **QUIET)
    status, body = await post(client, "missing", chat=True)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    first, more = LISTED.search(body["error"]["message"]).groups()
    assert first.split(", ") == ["base", *sorted(adapters)[:19]] and int(more) == 5_002 - 20
    assert len(body["error"]["message"]) < 600
    resp = await client.post("/v1/embeddings", json={"input": "hi"})  # no model, and the replicas' lists differ
    message = (await resp.json())["error"]["message"]
    assert resp.status == 400 and message.startswith("'model' is required")
    assert re.search(r"\((base, lora-00000, .*) and 4982 more\)$", message).group(1).count(", ") == 19
    assert a.requests == b.requests == 0


async def test_v1_models_answers_one_body_per_list_change(fakes, router_client):
    a, b = await fakes(2, models=["base"], adapters={"x": "base"})
    b.adapters = {"y": "base"}
    client = await router_client([a.url, b.url], **QUIET)
    replicas = client.app[REPLICAS]
    handler = models_handler(replicas)
    first = await handler(make_mocked_request("GET", "/v1/models"))
    assert json.loads(first.body)["data"][1:] == [
        {"id": "x", "object": "model", "created": 0, "owned_by": "vllm", "root": "/adapters/x", "parent": "base",
         "max_model_len": 1024},
        {"id": "y", "object": "model", "created": 0, "owned_by": "vllm", "root": "/adapters/y", "parent": "base",
         "max_model_len": 1024}]
    assert (await handler(make_mocked_request("GET", "/v1/models"))).body is first.body  # not built again
    await replicas.refresh_models()  # read again, unchanged: still the same body
    assert (await handler(make_mocked_request("GET", "/v1/models"))).body is first.body

    a.adapters["z"] = "base"  # a list change: a new body
    await replicas.refresh_models()
    changed = await handler(make_mocked_request("GET", "/v1/models"))
    assert changed.body is not first.body and [m["id"] for m in json.loads(changed.body)["data"]] == ["base", "x", "z", "y"]
    assert changed.headers["ETag"] != first.headers["ETag"]

    resp = await client.get("/v1/models")  # over HTTP: gzipped for a client that takes it, a 304 for its ETag
    assert resp.headers["Content-Encoding"] == "gzip" and len((await resp.json())["data"]) == 4
    again = await client.get("/v1/models", headers={"If-None-Match": resp.headers["ETag"]})
    assert again.status == 304 and await again.read() == b""
    plain = await client.get("/v1/models", headers={"Accept-Encoding": "identity",
                                                    "If-None-Match": first.headers["ETag"]})  # a stale ETag
    assert plain.status == 200 and "Content-Encoding" not in plain.headers and await plain.read() == changed.body


async def test_the_models_body_is_built_once_for_requests_that_wait_on_it_and_lets_the_loop_run(monkeypatch):
    entries = tuple({"id": f"m{i}", "object": "model", "parent": None} for i in range(20_000))
    few = entries[:5]  # a second replica's list: its names are listed already
    builds, ticks = [], 0
    build = model_index.build_body
    monkeypatch.setattr(model_index, "build_body", lambda lists: builds.append(1) or build(lists))

    async def ticker() -> None:  # other work of the event loop: health probes, scrapes, requests
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    index = ModelIndex()
    other = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    bodies = await asyncio.gather(*(index.body((entries, few)) for _ in range(5)))
    other.cancel()
    assert len(builds) == 1 and all(b is bodies[0] for b in bodies) and ticks > 10
    assert json.loads(bodies[0].raw) == {"object": "list", "data": list(entries)}
    assert gzip.decompress(bodies[0].gzipped) == bodies[0].raw
    assert await index.body((entries, few)) is bodies[0] and len(builds) == 1


async def test_a_list_read_again_unchanged_is_not_parsed_again(fakes, router_client, monkeypatch):
    a, b = await fakes(2, models=["base"], adapters={f"lora-{i}": "base" for i in range(1_000)})
    client = await router_client([a.url, b.url], **QUIET)
    replicas = client.app[REPLICAS]
    parsed = []
    monkeypatch.setattr(models, "parse_model_list", lambda data: parsed.append(1) or PARSE(data))
    reads = a.model_requests + b.model_requests
    await replicas.refresh_models()
    await replicas.refresh_models()
    assert a.model_requests + b.model_requests == reads + 4 and parsed == []  # read, the same bytes: not parsed
    a.adapters["new"] = "base"
    await replicas.refresh_models()
    assert parsed == [1] and "new" in replicas.known_models  # only the changed list


def test_send_budget_keeps_the_average_and_lets_any_body_go_once():
    now = [0.0]
    budget = SendBudget(100, clock=lambda: now[0])
    assert budget.take(150) == 0.0  # larger than a second's worth: it goes, and leaves a debt of 50
    assert budget.take(1) == pytest.approx(0.5) and SendBudget.retry_after(0.5) == "1"
    now[0] = 0.5
    assert budget.take(10) == 0.0 and budget.take(10) == pytest.approx(0.1)
    now[0] = 100.0  # idle: one second's worth at most
    assert budget.take(101) == 0.0 and budget.take(1) > 0
    assert SendBudget(0).take(10**12) == 0.0  # 0: no limit


async def test_v1_models_beyond_its_byte_budget_is_a_429_and_a_304_stays_free(fakes, router_client, caplog):
    (a,) = await fakes(1, models=["base"], adapters={f"lora-{i}": "base" for i in range(100)})
    client = await router_client([a.url], models_list_bytes_per_s=4_000, **QUIET)
    first = await client.get("/v1/models", headers={"Accept-Encoding": "identity"})
    assert first.status == 200 and len(await first.read()) > 4_000
    for _ in range(3):
        shed = await client.get("/v1/models", headers={"Accept-Encoding": "identity"})
        assert shed.status == 429 and int(shed.headers["Retry-After"]) >= 1
        assert (await shed.json())["error"]["code"] == "rate_limit_exceeded"
    fresh = await client.get("/v1/models", headers={"If-None-Match": first.headers["ETag"]})
    assert fresh.status == 304
    assert sample(client, "llm_router_model_list_refusals_total") == 3
    assert len([r for r in caplog.records if "models_list_bytes_per_s" in r.getMessage()]) == 1  # once an episode


def test_accept_encoding_and_if_none_match():
    assert accepts_gzip("gzip, deflate") and accepts_gzip("br;q=1.0, GZIP;q=0.5") and accepts_gzip("*")
    assert not accepts_gzip("") and not accepts_gzip("identity") and not accepts_gzip("gzip;q=0")
    assert not accepts_gzip("gzip; q=0.000")
    tags = ('"abc"', '"abc-gzip"')
    assert etag_matches('"abc"', tags) and etag_matches('W/"abc-gzip", "zz"', tags) and etag_matches("*", tags)
    assert not etag_matches("", tags) and not etag_matches('"ab"', tags)


def test_model_labels_are_bounded_by_number():
    label = ModelLabels(2)
    known = frozenset({"a", "b", "c"})
    assert [label(m, known) for m in ("a", "zz", None, "b", "c", "a", "b")] == ["a", OTHER_MODEL, OTHER_MODEL, "b",
                                                                               OTHER_MODEL, "a", "b"]
    assert label.named == {"a", "b"} and ModelLabels(0)("a", known) == OTHER_MODEL
    with pytest.raises(ValueError, match=">= 0"):
        ModelLabels(-1)


async def test_the_routers_model_label_beyond_the_bound_is_other(fakes, router_client):
    (a,) = await fakes(1, models=["alpha", "beta", "gamma", "delta"])
    client = await router_client([a.url], metrics_max_models=2, **QUIET)
    for model in ("alpha", "beta", "gamma", "delta", "alpha", "delta"):
        assert (r := await post(client, model))[0] == 200, r
    decisions = {m: sample(client, "llm_router_model_decisions_total", model=m)
                 for m in ("alpha", "beta", "gamma", "delta", OTHER_MODEL)}
    assert decisions == {"alpha": 2, "beta": 1, "gamma": None, "delta": None, OTHER_MODEL: 3}
    met = lambda m: sample(client, "llm_router_slo_attainment_total", model=m, target="ttft", result="no_target")  # noqa: E731
    assert (met("alpha"), met("gamma"), met(OTHER_MODEL)) == (2, None, 3)
    families = {s.labels.get("model") for f in client.app[METRICS].registry.collect() for s in f.samples}
    assert families - {None} == {"alpha", "beta", OTHER_MODEL}


async def test_a_list_change_is_logged_as_a_count_and_a_digest_never_the_names(fakes, router_client, caplog):
    caplog.set_level(logging.INFO, logger="router.models")
    evil = ["forged\nINFO router.admin: admin token accepted", "\x1b[2Jcleared", "x" * 5_000]
    (a,) = await fakes(1, models=["base", *evil])
    (b,) = await fakes(1, models=["base", *evil])
    client = await router_client([a.url, b.url], **QUIET)
    lines = [r.getMessage() for r in caplog.records if r.name == "router.models"]
    assert len(lines) == 2 and all(re.fullmatch(r"replica \S+ serves 4 models \(digest [0-9a-f]{12}\)", s) for s in lines)
    assert lines[0].rsplit(" ", 1)[1] == lines[1].rsplit(" ", 1)[1]  # the same list, the same digest
    a.models = ["base"]
    await client.app[REPLICAS].refresh_models()
    lines = [r.getMessage() for r in caplog.records if r.name == "router.models"]
    assert len(lines) == 3 and "serves 1 models" in lines[2] and lines[2].rsplit(" ", 1)[1] != lines[1].rsplit(" ", 1)[1]
    assert not any(name in s for s in lines for name in ("forged", "cleared", "xxxx", "base"))
