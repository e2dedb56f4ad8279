"""OpenAI API passthrough through the router, with the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import aiohttp.test_utils
import aiohttp.web
import openai
import pytest

from routewise_vllm.router.app import METRICS, REPLICAS
from tests.router.conftest import wait_for

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


def oai(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="test-key", max_retries=0, timeout=5)


def outstanding(client) -> int:
    return sum(r.tracker.outstanding for r in client.app[REPLICAS].ordered)


def sample(client, name: str, **labels) -> float | None:
    return client.app[METRICS].registry.get_sample_value(name, labels)


async def test_non_streaming_completion_and_chat(fakes, router_paths):
    a, b = await fakes(2)
    client = await router_paths([a.url, b.url])
    api = oai(client)
    r = await api.completions.create(model="tiny", prompt="hello there", max_tokens=3)
    assert r.choices[0].text == " tok0 tok1 tok2"
    c = await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert c.choices[0].message.content == " tok0 tok1"
    assert a.requests + b.requests == 2
    # the client's Authorization reaches the replica; hop-by-hop headers do not
    sent = (a.headers + b.headers)[0]
    assert sent.get("Authorization") == "Bearer test-key"
    assert outstanding(client) == 0
    total = sum(sample(client, "llm_router_requests_total", replica=f.url.removeprefix("http://"),
                       policy="least-outstanding", arm="main", code_class="2xx") or 0 for f in (a, b))
    assert total == 2


async def test_streaming_passthrough_measures_ttft(fakes, router_paths):
    (a,) = await fakes(1, token_delay_s=0.01)
    client = await router_paths([a.url])
    api = oai(client)
    stream = await api.completions.create(model="tiny", prompt="x", max_tokens=5, stream=True)
    texts = [ch.choices[0].text async for ch in stream]
    assert texts == [f" tok{i}" for i in range(5)]
    chat = await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                             max_tokens=3, stream=True)
    deltas = [ch.choices[0].delta.content async for ch in chat]
    assert "".join(d or "" for d in deltas) == " tok0 tok1 tok2"
    rid = a.url.removeprefix("http://")
    labels = dict(replica=rid, policy="least-outstanding", arm="main")
    assert sample(client, "llm_router_ttft_seconds_count", **labels) == 2
    assert sample(client, "llm_router_inter_token_latency_seconds_count", **labels) >= 5
    assert sample(client, "llm_router_e2e_latency_seconds_count", **labels) == 2
    tracker = client.app[REPLICAS].by_id[rid].tracker
    assert tracker.ttft_ema_s is not None and tracker.ttft_ema_s > 0
    assert tracker.tpot_ema_s is not None and tracker.tpot_ema_s >= 0.005
    assert outstanding(client) == 0


async def test_stream_chunks_are_forwarded_as_they_arrive(fakes, router_client):
    """Each chunk reaches the client while the replica has not produced the next one yet: the replica makes one
    token per release of its gate, so a router that buffered would never deliver it (order, not timing)."""
    (a,) = await fakes(1)
    a.token_gate = asyncio.Semaphore(1)  # the first token at once (the router waits for it before answering)
    client = await router_client([a.url])
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True})
    got = b""
    for i in range(4):
        async def until_chunk(i=i) -> bytes:
            data = b""
            while f"tok{i}".encode() not in data:
                more = await resp.content.readany()
                assert more, f"the stream ended before tok{i}: {got + data!r}"
                data += more
            return data
        got += await asyncio.wait_for(until_chunk(), 20)
        assert a.generation_tokens == i + 1  # tok{i} arrived and the replica has not made tok{i+1}
        assert got.startswith(b"data: ") and f"tok{i + 1}".encode() not in got
        a.token_gate.release()
    got += await resp.read()
    assert got.rstrip().endswith(b"data: [DONE]")


@pytest.mark.parametrize("payload,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": "x"}).encode(), 400, "model"),
    (json.dumps({"model": 3, "prompt": "x"}).encode(), 400, "model"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"model": "tiny"}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "model"),
])
async def test_bad_input_gets_openai_error(fakes, router_client, payload, status, param):
    (a,) = await fakes(1)
    client = await router_client([a.url])
    await wait_for(lambda: bool(client.app[REPLICAS].known_models))
    resp = await client.post("/v1/completions", data=payload, headers={"Content-Type": "application/json"})
    assert resp.status == status
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert a.requests == 0


async def test_bad_chat_messages_and_oversized_body(fakes, router_paths):
    (a,) = await fakes(1)
    client = await router_paths([a.url], max_body_bytes=2048)
    resp = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": "hi"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "messages"
    resp = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"content": "x"}]})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "messages[0]"
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 5000})
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "request_too_large"
    assert a.requests == 0


async def test_unknown_model_via_openai_client_is_404(fakes, router_client):
    (a,) = await fakes(1)
    client = await router_client([a.url])
    await wait_for(lambda: bool(client.app[REPLICAS].known_models))
    with pytest.raises(openai.NotFoundError):
        await oai(client).completions.create(model="gpt-17", prompt="x")


async def test_models_and_allow_listed_paths_are_proxied(fakes, router_client):
    (a,) = await fakes(1)
    client = await router_client([a.url], passthrough_paths=["/v1/models", "/v1/echo/*"])
    models = await oai(client).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    resp = await client.post("/v1/echo/x?y=1", data=b"payload")
    assert resp.status == 200
    assert await resp.json() == {"path": "/v1/echo/x", "query": {"y": "1"}, "body": "payload"}
    resp = await client.post("/v1/echo/%78", data=b"")  # normalised: decoded, re-encoded
    assert (await resp.json())["path"] == "/v1/echo/x"


@pytest.mark.parametrize("method,path", [
    ("POST", "/v1/%2e%2e/reset_prefix_cache"),
    ("POST", "/v1/%2E%2E/sleep?level=1"),
    ("POST", "/v1/../collective_rpc"),
    ("POST", "/v1/%2e%2e%2fcollective_rpc"),
    ("POST", "/v1/%252e%252e/reset_prefix_cache"),
    ("POST", "/v1/models/%2e%2e/%2e%2e/reset_prefix_cache"),
    ("POST", "/v1//models"),
    ("DELETE", "/v1/anything"),
    ("GET", "/v1/echo/x"),  # not allow-listed by default
    ("POST", "/v1/completions/../../sleep"),
])
async def test_paths_outside_the_allow_list_never_reach_a_replica(fakes, router_client, method, path):
    """`/v1/%2e%2e/reset_prefix_cache` used to reach the replica as `/reset_prefix_cache`."""
    (a,) = await fakes(1)
    seen: list[str] = []

    async def spy(request):
        seen.append(request.path)
        return aiohttp.web.json_response({"reset": True})

    runner_app = aiohttp.web.Application()
    runner_app.router.add_route("*", "/{tail:.*}", spy)
    server = aiohttp.test_utils.TestServer(runner_app, host="127.0.0.1")
    await server.start_server()
    try:
        client = await router_client([str(server.make_url("")).rstrip("/")])
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}".encode())
        raw = await reader.read()
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.split()[1] in (b"404", b"405"), raw[:200]
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
        assert not [p for p in seen if p not in ("/health", "/metrics", "/v1/models", "/kv_event_sources")]
    finally:
        await server.close()


async def test_no_healthy_replica_is_503(fakes, router_client):
    (a,) = await fakes(1)
    a.health_ok = False
    client = await router_client([a.url])
    resp = await client.get("/ready")
    assert resp.status == 503
    with pytest.raises(openai.InternalServerError) as exc:
        await oai(client).completions.create(model="tiny", prompt="x")
    assert exc.value.status_code == 503
    assert "no healthy replica" in exc.value.body["message"]
    assert a.requests == 0
    assert (await client.get("/health")).status == 200


async def test_retry_before_first_byte_goes_to_another_replica(fakes, router_paths):
    a, b = await fakes(2)
    a.mode = "error_500"
    client = await router_paths([a.url, b.url], policy="round-robin", breaker_failure_threshold=100)
    api = oai(client)
    for i in range(4):
        r = await api.completions.create(model="tiny", prompt="x", max_tokens=1, stream=bool(i % 2))
        if i % 2:
            assert [c.choices[0].text async for c in r] == [" tok0"]
        else:
            assert r.choices[0].text == " tok0"
    assert a.requests >= 1 and b.completed == 4
    assert sample(client, "llm_router_retries_total", reason="http_5xx") == a.requests
    assert sample(client, "llm_router_upstream_errors_total", replica=a.url.removeprefix("http://"),
                  kind="http_5xx") == a.requests
    assert outstanding(client) == 0


async def test_connect_error_and_first_byte_timeout_are_retried(fakes, router_paths):
    a, b = await fakes(2)
    b.mode = "hang_stream"
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    client = await router_paths([dead, a.url, b.url], policy="round-robin", health_failure_threshold=100,
                                 breaker_failure_threshold=100, max_retries=2)
    for r in client.app[REPLICAS].ordered:  # treat the dead one as healthy, serving the model, until requests fail on it
        r.probe_ok, r.models, r.models_known = True, frozenset({"tiny"}), True
        r.sync()
    client.app[REPLICAS].update_models()
    for _ in range(3):
        resp = await client.post("/v1/completions",
                                 json={"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True})
        assert resp.status == 200
        assert (await resp.read()).rstrip().endswith(b"[DONE]")
    assert a.completed == 3
    assert sample(client, "llm_router_upstream_errors_total", replica="127.0.0.1:9", kind="connect") >= 1
    assert sample(client, "llm_router_upstream_errors_total", replica=b.url.removeprefix("http://"),
                  kind="timeout") >= 1
    await wait_for(lambda: b.active == 0)  # the timed-out upstream request was aborted
    assert outstanding(client) == 0


async def test_all_attempts_fail_gives_5xx_openai_error(fakes, router_paths):
    (a,) = await fakes(1)
    a.mode = "error_500"
    client = await router_paths([a.url], breaker_failure_threshold=100)
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert resp.status == 500  # the replica's own answer on the last attempt
    assert outstanding(client) == 0


async def test_reset_mid_stream_is_an_error_not_a_hang(fakes, router_paths):
    (a,) = await fakes(1)
    a.mode = "reset_mid_stream"
    client = await router_paths([a.url], breaker_failure_threshold=100)
    stream = await oai(client).completions.create(model="tiny", prompt="x", max_tokens=6, stream=True)
    got = []
    with pytest.raises(openai.APIError):
        async for ch in stream:
            got.append(ch.choices[0].text)
    assert got == [" tok0", " tok1"]
    assert outstanding(client) == 0
    assert sample(client, "llm_router_requests_total", replica=a.url.removeprefix("http://"),
                  policy="least-outstanding", arm="main", code_class="error") == 1
    assert sample(client, "llm_router_upstream_errors_total", replica=a.url.removeprefix("http://"),
                  kind="reset") == 1


async def test_client_disconnect_mid_stream_releases_slot_once(fakes, router_paths):
    (a,) = await fakes(1, token_delay_s=0.05)
    client = await router_paths([a.url])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(client.make_url("/v1/completions"),
                            json={"model": "tiny", "prompt": "x", "max_tokens": 200, "stream": True})
        assert b"tok0" in await resp.content.readany()
        assert outstanding(client) == 1
        resp.close()  # the client goes away mid-stream
    await wait_for(lambda: a.cancelled == 1 and a.active == 0)
    await wait_for(lambda: outstanding(client) == 0)
    tracker = client.app[REPLICAS].ordered[0].tracker
    assert tracker.outstanding == 0 and tracker.outstanding_prompt_tokens == 0
    # a later request still counts from zero (no double decrement)
    await oai(client).completions.create(model="tiny", prompt="x", max_tokens=1)
    assert tracker.outstanding == 0


async def test_client_disconnect_before_first_byte_releases_slot(fakes, router_paths):
    (a,) = await fakes(1)
    a.mode = "hang"
    client = await router_paths([a.url])
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(client.make_url("/v1/completions"),
                                          json={"model": "tiny", "prompt": "x"}))
        await wait_for(lambda: a.active == 1)
        assert outstanding(client) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await wait_for(lambda: a.cancelled == 1 and outstanding(client) == 0)
    assert client.app[REPLICAS].ordered[0].tracker.outstanding == 0


async def test_hop_by_hop_headers_are_stripped_both_ways(fakes, router_paths):
    (a,) = await fakes(1)
    client = await router_paths([a.url])
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, headers={
        "Connection": "keep-alive, X-Drop-Me", "X-Drop-Me": "1", "TE": "trailers", "Proxy-Authorization": "p",
        "Keep-Alive": "timeout=5", "X-Keep-Me": "2",
    })
    assert resp.status == 200
    sent = {k.lower(): v for k, v in a.headers[0].items()}
    assert sent["x-keep-me"] == "2"
    for h in ("x-drop-me", "te", "proxy-authorization", "keep-alive"):
        assert h not in sent, h
    assert "transfer-encoding" not in {k.lower() for k in resp.headers}


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "prompt": "\\u00e9\\ud800"}', b'{"a": 1}  \n', b'  {"a": 1}', b'{"a": 1} x', b'{"a": 1}{}',
    b'{"a": }', b'{', b'{"a": NaN, "b": 1e999}', "{\"a\": \"\u00e9\"}".encode(), '{"a": 1}'.encode("utf-16-le"),
    b'{"a": "\xff"}', b"[1, 2]", b"", b"{" * 100_000,
])
async def test_body_decoding_is_json_loads(raw: bytes) -> None:
    """openai.loads, json.loads without its regex on the usual body: the same value or the same error."""
    from routewise_vllm.router.openai import loads

    try:
        want = ("value", json.loads(raw))
    except (ValueError, RecursionError) as exc:
        want = ("error", type(exc), str(exc))
    try:
        got = ("value", loads(raw))
    except (ValueError, RecursionError) as exc:
        got = ("error", type(exc), str(exc))
    assert repr(got) == repr(want)
