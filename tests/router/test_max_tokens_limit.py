"""`max_tokens_limit` bounds the tokens one request may make: max_tokens (or max_completion_tokens) x n."""

from __future__ import annotations

import pytest

from routewise_vllm.router.errors import BadRequest
from routewise_vllm.router.openai import validate


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_the_limit_counts_every_choice(key):
    body = {"model": "m", "prompt": "x", key: 100}
    assert validate(dict(body, n=10), chat=False, max_tokens_limit=1000)[key] == 100  # 1000 tokens: at the limit
    with pytest.raises(BadRequest, match=rf"'{key}' x 'n' must be <= 1000, got 100 x 11") as exc:
        validate(dict(body, n=11), chat=False, max_tokens_limit=1000)
    assert exc.value.response().status == 400
    with pytest.raises(BadRequest, match=rf"'{key}' must be <= 1000, got 1001"):
        validate({"model": "m", "prompt": "x", key: 1001}, chat=False, max_tokens_limit=1000)
    assert validate({"model": "m", "prompt": "x", "n": 999}, chat=False, max_tokens_limit=1000)["n"] == 999
