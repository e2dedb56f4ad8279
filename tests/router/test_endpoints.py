"""vLLM's other client endpoints through the router: embeddings, responses, tokenize, detokenize, score, rerank,
pooling, classify, audio transcriptions and translations, routed by model and load like generation. The real router
app in front of fake vLLM replicas (tests/fakes/fake_vllm.py answers each in vLLM's shape), loopback only; the real
openai client where it has a method, raw HTTP for the rest."""

from __future__ import annotations

import asyncio
import io
import json

import aiohttp
import openai
import pytest

from routewise_vllm.router.app import METRICS, ROUTER
from routewise_vllm.router.endpoints import ENDPOINTS, Endpoint, gather, parse, parse_form
from routewise_vllm.router.errors import BadRequest
from routewise_vllm.router.serving.decision_log import log_files
from tests.fakes.fake_vllm import ENDPOINT_PATHS
from tests.router.conftest import wait_for
from tests.fakes.harness import two_model_fleet

pytestmark = pytest.mark.timeout(90)

RAW = {  # the endpoints the openai client has no method for: a body for each
    "/tokenize": {"prompt": "hello there"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/v1/score": {"text_1": "what is a router", "text_2": ["it routes", "a tool"]},
    "/score": {"queries": "q", "documents": ["d1"]},
    "/v1/rerank": {"query": "what is a router", "documents": ["it routes", "a tool"]},
    "/rerank": {"query": "q", "documents": ["d1", "d2"]},
    "/v2/rerank": {"query": "q", "documents": ["d1"]},
    "/pooling": {"input": "pool this"},
    "/classify": {"input": ["classify this"]},
}


def sample(client, name: str, **labels) -> float | None:
    return client.app[METRICS].registry.get_sample_value(name, labels)


def oai(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0, timeout=20)


async def post(client, path: str, body) -> tuple[int, dict | str]:
    resp = await client.post(path, data=body if isinstance(body, (bytes, str)) else json.dumps(body),
                             headers={"Content-Type": "application/json"})
    text = await resp.text()
    return resp.status, (json.loads(text) if resp.content_type == "application/json" else text)


def test_the_fake_answers_every_routed_endpoint():
    assert set(ENDPOINTS) == set(ENDPOINT_PATHS)


def test_parse_reads_model_stream_text_and_bounds():
    ep = ENDPOINTS["/v1/responses"]
    p = parse(ep, {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi there"}]}],
                   "instructions": "be brief", "max_output_tokens": 7, "stream": True, "user": "u1"}, 100)
    assert (p.model, p.stream, p.max_tokens, p.user) == ("m", True, 7, "u1")
    assert "hi there" in p.text and "be brief" in p.text and "input_text" not in p.text
    det = parse(ENDPOINTS["/detokenize"], {"tokens": [5, 6, 7, 8]}, 100)
    assert (det.model, det.token_ids, det.max_tokens, det.text) == (None, 4, 0, "")
    for bad, param in (({"model": 3}, "model"), ({"model": ""}, "model"), ({"stream": "yes"}, "stream"),
                       ({"max_output_tokens": 101}, "max_output_tokens"), ({"max_output_tokens": True}, "max_output_tokens")):
        with pytest.raises(BadRequest) as err:
            parse(ep, bad, 100)
        assert err.value.param == param
    with pytest.raises(BadRequest):
        parse(ep, ["not", "an", "object"], 100)
    assert gather([[1, 2], [3]], []) == 3
    deep: list = []
    for _ in range(50):
        deep = [deep, "x"]
    assert gather(deep, []) == 0  # bounded depth: no recursion error


def test_parse_form_reads_text_fields_and_skips_files():
    form = aiohttp.FormData()
    form.add_field("file", io.BytesIO(b"RIFF....WAVE"), filename="a.wav", content_type="audio/wav")
    form.add_field("model", "whisper")
    form.add_field("stream", "true")
    payload = form()
    raw = b"".join(_chunks(payload))
    fields = parse_form(raw, payload.content_type)
    assert fields == {"model": "whisper", "stream": "true"}
    p = parse(ENDPOINTS["/v1/audio/transcriptions"], fields, 100)
    assert (p.model, p.stream) == ("whisper", True)
    for ct in ("application/json", ""):
        with pytest.raises(BadRequest):
            parse_form(raw, ct)
    with pytest.raises(BadRequest):
        parse_form(b"no parts here", "multipart/form-data; boundary=zzz")


def _chunks(payload) -> list[bytes]:
    out: list[bytes] = []

    class W:
        async def write(self, b):
            out.append(bytes(b))

    asyncio.run(payload.write(W()))
    return out


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the openai client's audio.translations
async def test_every_endpoint_lands_on_a_replica_of_its_model(fakes, router_client, tmp_path):
    a, b, c = await two_model_fleet(fakes)
    client = await router_client([a.url, b.url, c.url], decision_log_dir=tmp_path)
    api = oai(client)
    sent = 0
    try:
        for model in ("alpha", "beta"):
            for _ in range(3):
                emb = await api.embeddings.create(model=model, input=["one", "two"])
                assert [len(d.embedding) for d in emb.data] == [3, 3]
                resp = await api.responses.create(model=model, input="say hello")
                assert resp.output_text == f"hello from {model}"
                events = [e.type async for e in await api.responses.create(model=model, input="hi", stream=True)]
                assert events == ["response.created", "response.output_text.delta", "response.completed"]
                tr = await api.audio.transcriptions.create(model=model, file=("a.wav", b"RIFF0000WAVE", "audio/wav"))
                assert tr.text == f"transcribed by {model}"
                chunks = [ch async for ch in await api.audio.transcriptions.create(
                    model=model, file=("a.wav", b"RIFF0000WAVE", "audio/wav"), stream=True)]
                assert chunks
                tl = await api.audio.translations.create(model=model, file=("a.wav", b"RIFF", "audio/wav"))
                assert tl.text == f"transcribed by {model}"
                sent += 6
                for path, body in RAW.items():
                    status, answer = await post(client, path, {**body, "model": model})
                    assert status == 200, (path, answer)
                    sent += 1
    finally:
        await api.close()
    calls = a.endpoint_calls + b.endpoint_calls + c.endpoint_calls
    assert len(calls) == sent
    assert {m for _, m in a.endpoint_calls} == {"alpha"} and {m for _, m in b.endpoint_calls} == {"beta"}
    assert {p for p, _ in calls} == set(ENDPOINTS)
    assert a.requests + b.requests + c.requests == sent  # none was ever sent to a replica without its model
    assert sample(client, "llm_router_model_decisions_total", model="alpha") == sent / 2
    # no TTFT from any of them, streams included
    assert not sample(client, "llm_router_model_ttft_seconds_count", model="alpha")
    assert not any(s.value for m in client.app[METRICS].registry.collect() if m.name == "llm_router_ttft_seconds"
                   for s in m.samples if s.name.endswith("_count"))
    client.app[ROUTER].serving.decision_log.close()
    records = [json.loads(line) for f in log_files(tmp_path) for line in f.read_text().splitlines()]
    assert len(records) == sent
    for r in records:  # the policy saw only the model's replicas as candidates
        allowed = {0, 2} if r["model"] == "alpha" else {1, 2}
        assert {i for i, m in enumerate(r["mask"]) if m} == allowed and r["index"] in allowed


async def test_endpoints_are_routed_by_the_policy(fakes, router_client):
    a, b = await fakes(2, models=["alpha"])
    client = await router_client([a.url, b.url], policy="round-robin")
    for path in ("/v1/embeddings", "/tokenize", "/v1/rerank", "/pooling"):
        for _ in range(4):
            assert (await post(client, path, {**RAW.get(path, {"input": "x"}), "model": "alpha"}))[0] == 200
    assert [p for p, _ in a.endpoint_calls] == [p for p, _ in b.endpoint_calls]  # alternated, each path on both
    assert len(a.endpoint_calls) == 8


async def test_internal_endpoints_stay_unreachable(fakes, router_client):
    (a,) = await fakes(1)
    client = await router_client([a.url])
    for path in ("/reset_prefix_cache", "/v1/%2e%2e/reset_prefix_cache", "/v1/../reset_prefix_cache", "/sleep",
                 "/collective_rpc"):
        resp = await client.post(path, data=b"{}")
        assert resp.status == 404, path
    assert (await client.get("/tokenize")).status == 405
    assert a.internal_calls == 0 and a.requests == 0


async def test_bad_input_gets_an_openai_shaped_4xx(fakes, router_client):
    a, b, c = await two_model_fleet(fakes)
    client = await router_client([a.url, b.url, c.url])
    cases = [
        ("/v1/embeddings", {"model": 7, "input": "x"}, 400, "model"),
        ("/v1/embeddings", {"model": "gamma", "input": "x"}, 404, "model"),
        ("/v1/embeddings", {"input": "x"}, 400, "model"),  # no model, and the replicas serve different ones
        ("/v1/responses", {"model": "alpha", "input": "x", "stream": "yes"}, 400, "stream"),
        ("/tokenize", b"{not json", 400, None),
        ("/v1/audio/transcriptions", {"model": "alpha"}, 400, None),  # JSON where a form is due
    ]
    for path, body, status, param in cases:
        got, answer = await post(client, path, body)
        assert got == status, (path, answer)
        assert answer["error"]["param"] == param and answer["error"]["message"]
    status, answer = await post(client, "/v1/embeddings", {"model": "gamma", "input": "x"})
    assert "Available models: alpha, beta" in answer["error"]["message"]
    assert a.requests + b.requests + c.requests == 0


async def test_no_model_goes_to_any_replica_of_a_single_model_fleet(fakes, router_client):
    a, b = await fakes(2, models=["alpha"], adapters={"lora": "alpha"})
    client = await router_client([a.url, b.url], policy="round-robin")
    for _ in range(4):
        assert (await post(client, "/tokenize", {"prompt": "x"}))[0] == 200
    assert len(a.endpoint_calls) == len(b.endpoint_calls) == 2


async def test_a_failing_replica_is_retried_before_the_first_byte(fakes, router_client):
    a, b = await fakes(2, models=["alpha"])
    a.mode = "error_500"
    client = await router_client([a.url, b.url], policy="round-robin", breaker_failure_threshold=100)
    for path in ("/v1/embeddings", "/v1/rerank", "/pooling"):
        for _ in range(2):
            assert (await post(client, path, {**RAW.get(path, {"input": "x"}), "model": "alpha"}))[0] == 200
    assert len(b.endpoint_calls) == 6 and not a.endpoint_calls
    assert sample(client, "llm_router_retries_total", reason="http_5xx") >= 1


async def test_late_binding_holds_engine_work_but_never_the_tokenizer(fakes, router_client):
    (a,) = await fakes(1, models=["alpha"])
    client = await router_client([a.url], late_binding=True, late_binding_max_num_seqs=1, late_binding_timeout_s=60.0,
                                 health_interval_s=30.0, scrape_interval_s=30.0)
    gate = a.hold("occupy")
    busy = asyncio.create_task(client.post("/v1/completions", json={"model": "alpha", "prompt": "occupy",
                                                                     "max_tokens": 2}))
    await wait_for(lambda: a.active == 1)
    held = asyncio.create_task(post(client, "/v1/embeddings", {"model": "alpha", "input": "wait"}))
    await wait_for(lambda: sample(client, "llm_router_held_requests") == 1)
    assert (await post(client, "/tokenize", {"model": "alpha", "prompt": "now"}))[0] == 200  # not held
    assert [p for p, _ in a.endpoint_calls] == ["/tokenize"] and not held.done()
    gate.set()
    assert (await busy).status == 200
    assert (await held)[0] == 200
    assert [p for p, _ in a.endpoint_calls] == ["/tokenize", "/v1/embeddings"]
