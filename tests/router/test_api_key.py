"""Client API keys as vLLM's --api-key checks them (every /v1/* path, on every transport path of the router),
and 405 for another method on a routed endpoint, as vLLM answers."""

from __future__ import annotations

import openai
import pytest
from pydantic import ValidationError

from routewise_vllm.router.settings import RouterSettings

pytestmark = pytest.mark.timeout(120)

KEY, OTHER = "sk-route-first", "sk-second"  # ASCII: the openai client sends no other header bytes


def oai(client, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0, timeout=20)


async def test_the_key_is_asked_on_every_client_path_and_nowhere_else(fakes, router_paths):
    (a,) = await fakes(1)
    client = await router_paths([a.url], api_key=KEY)
    for wrong in ("sk-wrong", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as exc:
            await oai(client, wrong).completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert exc.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            await oai(client, wrong).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.AuthenticationError):
            await oai(client, wrong).models.list()
        with pytest.raises(openai.AuthenticationError):
            await oai(client, wrong).embeddings.create(model="tiny", input="x")
    assert a.requests == 0  # nothing of a refused request reached the replica
    good = oai(client, KEY)
    assert (await good.completions.create(model="tiny", prompt="hi", max_tokens=2)).choices
    assert (await good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])).choices
    assert [m.id for m in (await good.models.list()).data] == ["tiny"]
    for path in ("/health", "/ready", "/metrics"):  # the probes and the scrape need no key, as on vLLM
        resp = await client.get(path)
        assert resp.status == 200, path


async def test_no_request_reaches_a_replica_without_the_key(fakes, router_paths):
    (a,) = await fakes(1)
    client = await router_paths([a.url], api_key=KEY)
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY},
                    [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer nope")]):
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=headers)
        assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
        assert (await resp.json())["error"]["code"] == "invalid_api_key"
    assert a.requests == 0


async def test_several_keys_from_a_file(fakes, router_client, tmp_path):
    (a,) = await fakes(1)
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n\n{OTHER}\n")
    client = await router_client([a.url], api_key_file=str(keys))
    for key in (KEY, OTHER):
        assert (await oai(client, key).completions.create(model="tiny", prompt="hi", max_tokens=2)).choices
    with pytest.raises(openai.AuthenticationError):
        await oai(client, "sk-third").completions.create(model="tiny", prompt="hi", max_tokens=2)


def test_key_settings_are_checked(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n  \n")
    for kwargs, says in ((dict(api_key=" "), "api_key is empty"),
                         (dict(api_key_file=str(empty)), "the file has no key"),
                         (dict(api_key_file=str(tmp_path / "missing")), "No such file"),
                         (dict(api_key="a", api_key_file=str(empty)), "not both")):
        with pytest.raises(ValidationError, match=says):
            RouterSettings(replicas=["http://a:1"], **kwargs)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize"])
async def test_another_method_on_a_routed_endpoint_is_405(fakes, router_paths, path):
    (a,) = await fakes(1)
    client = await router_paths([a.url])
    resp = await client.get(path)
    assert resp.status == 405 and "POST" in resp.headers["Allow"], await resp.text()
