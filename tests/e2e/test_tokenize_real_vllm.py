"""The router's own tokenization (`--tokenizer`) against vLLM's /tokenize on the tiny model: completions and chat."""

from __future__ import annotations

import json
import urllib.request

import pytest

from routewise_vllm.router.policy.kv_view import token_prefix_blocks
from routewise_vllm.router.kv.prompt_tokens import LocalTokenizer, PromptBlocks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [
    "Hello world",
    "the router sends each request to a replica " * 40,
    "Ünïcode — and emoji 🙂 mixed with tokens, 42 and 2024-06-01.",
]
CHATS = [
    [{"role": "user", "content": "Which replica holds my prefix?"}],
    [{"role": "system", "content": "You answer questions about routing. " * 20},
     {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
     {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
]


def tokenize(base: str, body: dict) -> list[int]:
    req = urllib.request.Request(base + "/tokenize", data=json.dumps({"model": "tiny", **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())["tokens"]


def test_local_tokenization_matches_vllms(vllm_servers, tiny_model_dir):
    local = LocalTokenizer(tiny_model_dir)
    base = vllm_servers[0]
    for prompt in PROMPTS:
        assert local.completion_ids(prompt) == tokenize(base, {"prompt": prompt}), prompt
    for messages in CHATS:
        assert local.chat_ids(messages) == tokenize(base, {"messages": messages}), messages
        assert local.chat_ids(messages, add_generation_prompt=False) == \
            tokenize(base, {"messages": messages, "add_generation_prompt": False})


def test_prefix_blocks_are_the_full_prompts_leading_blocks(vllm_servers, tiny_model_dir):
    """What the router matches (a cached prefix's blocks) is a prefix of what vLLM stores for the whole prompt."""
    pb = PromptBlocks(lambda: 32, LocalTokenizer(tiny_model_dir))
    prompt = PROMPTS[1] + " and then a question that differs"
    pb.of({"prompt": prompt}, chat=False)  # a new prefix: its head now, the rest in the background
    pb.drain()
    blocks = pb.of({"prompt": prompt}, chat=False)
    full = token_prefix_blocks(tokenize(vllm_servers[0], {"prompt": prompt}), 32)
    assert blocks and tuple(blocks) == tuple(full[: len(blocks)])
    pb.of({"messages": CHATS[1]}, chat=True)
    pb.drain()
    chat = pb.of({"messages": CHATS[1]}, chat=True)
    full = token_prefix_blocks(tokenize(vllm_servers[0], {"messages": CHATS[1]}), 32)
    assert chat and tuple(chat) == tuple(full[: len(chat)])
