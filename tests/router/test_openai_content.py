"""Chat content parts validated as vLLM reads them (vLLM 0.32, renderers/chat_utils.py): a part is a string
(text) or an object whose `type`, when present, is a string. Any other part makes vLLM fail an assertion and
answer 500, which the router would retry on every replica: the router answers 400 naming the part instead, and
no replica is asked."""

from __future__ import annotations

import pytest

from routewise_vllm.router.errors import BadRequest
from routewise_vllm.router.openai import prompt_text, validate


def chat(*content) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": list(content)}]}


@pytest.mark.parametrize("part, param, what", [
    (5, "messages[1].content[1]", "got number"),
    (None, "messages[1].content[1]", "got null"),
    (["x"], "messages[1].content[1]", "got array"),
    (True, "messages[1].content[1]", "got boolean"),
    (1.5, "messages[1].content[1]", "got number"),
    ({"type": 5, "text": "x"}, "messages[1].content[1].type", "'messages[1].content[1].type' must be a string"),
    ({"type": ["text"]}, "messages[1].content[1].type", "got array"),
])
def test_a_part_that_vllm_cannot_read_is_a_400_naming_it(part, param, what):
    with pytest.raises(BadRequest) as err:
        validate(chat({"type": "text", "text": "hi"}, part), chat=True)
    assert err.value.status == 400 and err.value.param == param and what in err.value.message, err.value.message


@pytest.mark.parametrize("content", [
    [{"type": "text", "text": "hi"}],
    ["a plain string part"],  # vLLM reads it as text
    [{"image_url": "http://x/y.png"}],  # no type: vLLM names the media by its key
    [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}, {"type": "text", "text": "what is it?"}],
    [{"type": "some_future_type"}],  # vLLM judges the types it knows
    [{"text": "no type"}],  # vLLM answers 400 itself: the router does not guess its list of keys
    [],
])
def test_what_vllm_accepts_or_judges_itself_passes(content):
    validate(chat(*content), chat=True)


def test_string_parts_count_in_the_prompt_text():
    body = validate(chat("first", {"type": "text", "text": "second"}, {"type": "image_url", "image_url": "u"}), True)
    assert prompt_text(body, True) == ("be brief\nfirst\nsecond", None)


async def test_the_router_answers_400_and_asks_no_replica(fakes, router_client):
    (a,) = await fakes(1)
    client = await router_client([a.url])
    resp = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, 7]}]})
    body = await resp.json()
    assert resp.status == 400 and body["error"]["param"] == "messages[0].content[1]", body
    assert a.requests == 0
