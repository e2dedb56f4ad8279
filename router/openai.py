"""What an OpenAI completion or chat completion body means to the router: decoding, validation of the fields it
reads, the prompt's text, and the decode budget (`max_completion_tokens` or `max_tokens`, times `n`).

The router reads `model`, `stream`, `max_tokens` / `max_completion_tokens`, `n`, `user` and the prompt (`prompt`,
or the `messages`' text); the replica validates the rest. vLLM's other endpoints are read by router.endpoints.
"""

from __future__ import annotations

import json
from typing import Any

from routewise_vllm.router.errors import BadRequest

_DECODER = json.JSONDecoder()


def loads(raw: bytes) -> Any:
    """json.loads(raw): the same value, the same errors. A UTF-8 body that starts with `{` is decoded without
    json.loads' encoding detection and whitespace regex (2.1 -> 0.9 us here, and the regex engine is cold on a
    router idle between requests)."""
    if raw[:1] == b"{" and raw[1:2] != b"\x00":  # what json.detect_encoding takes for UTF-8
        s = raw.decode("utf-8", "surrogatepass")
        value, end = _DECODER.raw_decode(s)  # raises what json.loads would: it calls this at index 0
        if end == len(s):
            return value
    return json.loads(raw)  # anything else, trailing whitespace or data included


def decode(raw: bytes) -> Any:
    """The JSON value of a request body, or BadRequest naming what is wrong with it."""
    try:
        return loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None


# The typed fields the router reads: (key, its type, how an error names it, the least an integer may be).
_FIELDS: tuple[tuple[str, type, str, int | None], ...] = (
    ("stream", bool, "a boolean", None), ("max_tokens", int, "an integer", 0),
    ("max_completion_tokens", int, "an integer", 0), ("n", int, "an integer", 1), ("user", str, "a string", None))


def validate(body: Any, chat: bool, max_tokens_limit: int = 1 << 20) -> dict[str, Any]:
    """Checks the fields the router reads; the replica validates the rest."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    get = body.get
    for key, typ, what, least in _FIELDS:  # one pass: most of these are absent, and this runs for every request
        v = get(key)
        if v is None:
            continue
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise BadRequest(f"'{key}' must be {what}, got {type(v).__name__}", param=key)
        if least is not None and v < least:
            raise BadRequest(f"'{key}' must be >= {least}, got {v}", param=key)
        if least is not None and v > max_tokens_limit:
            raise BadRequest(f"'{key}' must be <= {max_tokens_limit}, got {v}", param=key)
    n = get("n")
    if n is not None and n > 1:  # the limit bounds the tokens a request may make: max_tokens for each of n choices
        for key in ("max_tokens", "max_completion_tokens"):
            v = get(key)
            if v is not None and v * n > max_tokens_limit:
                raise BadRequest(f"'{key}' x 'n' must be <= {max_tokens_limit}, got {v} x {n}", param=key)
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' is required and must be a non-empty array", param="messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'", param=f"messages[{i}]")
            c = m.get("content")
            if c is not None and not isinstance(c, (str, list)):
                raise BadRequest(f"'messages[{i}].content' must be a string or an array", param=f"messages[{i}].content")
            if isinstance(c, list):
                _check_parts(c, i)
    else:
        p = body.get("prompt")
        ok = isinstance(p, str) or (
            isinstance(p, list) and p and (
                all(isinstance(x, str) for x in p)
                or all(isinstance(x, int) and not isinstance(x, bool) for x in p)
                or all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in p)
            )
        )
        if not ok:
            raise BadRequest(
                "'prompt' is required: a string, an array of strings, or an array of token ids", param="prompt"
            )
    return body


def _check_parts(parts: list[Any], i: int) -> None:
    """A content array as vLLM reads it: each part a string (text) or an object whose `type`, when present, is a
    string (an object without one names its media by key, e.g. {"image_url": ...}; vLLM judges those). vLLM
    answers 500 to any other part (an assertion), which the router would retry on every replica."""
    for j, part in enumerate(parts):
        if isinstance(part, str):
            continue
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict):
            raise BadRequest(f"'{where}' must be an object with a string 'type' (or a string), got "
                             f"{_json_type(part)}", param=where)
        t = part.get("type")
        if t is not None and not isinstance(t, str):
            raise BadRequest(f"'{where}.type' must be a string, got {_json_type(t)}", param=f"{where}.type")


def _json_type(v: Any) -> str:
    return {bool: "boolean", int: "number", float: "number", list: "array", dict: "object", str: "string"}.get(
        type(v), "null" if v is None else type(v).__name__)


def prompt_text(body: dict[str, Any], chat: bool) -> tuple[str, int | None]:
    """(prompt text, exact token count when the prompt is given as token ids). Assumes a validated body."""
    if chat:
        parts: list[str] = []
        for m in body["messages"]:
            c = m.get("content")
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):  # vLLM reads a string part as text
                parts.extend(p if isinstance(p, str) else p["text"] for p in c
                             if isinstance(p, str) or (isinstance(p, dict) and isinstance(p.get("text"), str)))
        return "\n".join(parts), None
    p = body["prompt"]
    if isinstance(p, str):
        return p, None
    if p and all(isinstance(x, str) for x in p):
        return "\n".join(p), None
    if p and isinstance(p[0], int):
        return "", len(p)
    return "", sum(len(x) for x in p)  # a batch of token-id lists


def decode_budget(body: dict[str, Any], chat: bool) -> int | None:
    """The tokens the request may decode in all: `max_completion_tokens` (chat) or `max_tokens`, times `n`
    choices; None when the body bounds nothing."""
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    n = body.get("n")
    if isinstance(max_tokens, int) and isinstance(n, int) and n > 1:
        max_tokens *= n
    return max_tokens if isinstance(max_tokens, int) else None


def user_of(body: dict[str, Any]) -> str | None:
    """The `user` field, the routing key's source when no header gives one."""
    user = body.get("user")
    return user if isinstance(user, str) else None
