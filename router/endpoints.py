"""vLLM's client endpoints besides completions and chat completions, routed like them: by the request's `model`,
through the same view and policy, with retries before the first byte (router.proxy.Proxy.endpoint).

What the router reads of each body (the replica validates the rest, as for generation): `model` (a non-empty
string when given; vLLM makes it optional and then serves its own default model, so a request without one may go
to any replica only while every replica lists the same models), `stream`, and the text it carries, for the
prompt-size estimate the policy sees. A pooling or tokenizer endpoint decodes nothing (max_tokens 0). None of
these streams carries a token per SSE event, so none records a TTFT (`Endpoint.tokens` is False for all).
`/tokenize` and `/detokenize` run in vLLM's API server, not its engine: routed by the policy but never held by
late binding (`engine` False). The audio endpoints take multipart/form-data, read with the standard library's
email parser (a form's fields are MIME parts).

vLLM's internal endpoints (/reset_prefix_cache, /sleep, /collective_rpc, /start_profile, ...) have no route here
and stay unreachable (router.paths).
"""

from __future__ import annotations

import email.parser
import email.policy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from routewise_vllm.router.errors import BadRequest
from routewise_vllm.router.model_index import model_index
from routewise_vllm.router.models import unknown_model
from routewise_vllm.router.openai import decode

if TYPE_CHECKING:
    from routewise_vllm.router.replicas import ReplicaSet


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    fields: tuple[str, ...]  # body fields whose strings (and token-id lists) make the prompt estimate
    max_tokens: str | None = None  # the body field bounding the decode, None: nothing is decoded (0)
    form: bool = False  # multipart/form-data (audio), else a JSON object
    engine: bool = True  # served by vLLM's engine (late binding may hold it); False: its API server alone
    tokens: bool = False  # an SSE event per generated token (a TTFT to record): only completions and chat


_POOL = ("input", "messages")
_SCORE = ("query", "queries", "documents", "text_1", "text_2", "data_1", "data_2")
ENDPOINTS: dict[str, Endpoint] = {e.path: e for e in (
    Endpoint("/v1/embeddings", _POOL),
    Endpoint("/pooling", _POOL),
    Endpoint("/classify", _POOL),
    Endpoint("/v1/responses", ("input", "instructions"), max_tokens="max_output_tokens"),
    Endpoint("/tokenize", ("prompt", "messages"), engine=False),
    Endpoint("/detokenize", ("tokens",), engine=False),
    Endpoint("/v1/score", _SCORE),
    Endpoint("/score", _SCORE),
    Endpoint("/v1/rerank", _SCORE),
    Endpoint("/rerank", _SCORE),
    Endpoint("/v2/rerank", _SCORE),
    Endpoint("/v1/audio/transcriptions", ("prompt",), max_tokens="max_completion_tokens", form=True),
    Endpoint("/v1/audio/translations", ("prompt",), max_tokens="max_completion_tokens", form=True),
)}

_MAX_TEXT = 1 << 20  # characters gathered for the estimate: the size of a huge input is plain anyway


def gather(value: Any, parts: list[str], depth: int = 0) -> int:
    """The strings in `value` (nested lists and objects, as vLLM's inputs and chat messages nest them) appended to
    `parts`; returns the count of token ids found (integers in lists)."""
    if depth > 8:
        return 0
    if isinstance(value, str):
        parts.append(value)
        return 0
    if isinstance(value, list):
        ids = 0
        for v in value:
            if isinstance(v, int) and not isinstance(v, bool):
                ids += 1
            else:
                ids += gather(v, parts, depth + 1)
        return ids
    if isinstance(value, dict):
        return sum(gather(v, parts, depth + 1) for k, v in value.items() if k not in ("role", "type", "name"))
    return 0


def parse_form(raw: bytes, content_type: str) -> dict[str, str]:
    """The text fields of a multipart/form-data body (a file part is skipped), or BadRequest."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise BadRequest(f"request body must be multipart/form-data, got {content_type or 'no Content-Type'!r}")
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + raw)
    if not msg.is_multipart():
        raise BadRequest("request body is not a valid multipart/form-data body (no parts for its boundary)")
    out: dict[str, str] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str) or part.get_filename() is not None:
            continue
        payload = part.get_payload(decode=True)
        if isinstance(payload, bytes) and len(payload) <= _MAX_TEXT:
            out[name] = payload.decode("utf-8", "replace")
    return out


@dataclass(frozen=True, slots=True)
class Parsed:
    """What routing reads of an endpoint request."""

    model: str | None
    stream: bool
    text: str
    token_ids: int  # token ids given directly (detokenize, pre-tokenized inputs)
    max_tokens: int | None
    user: str | None


def parse(endpoint: Endpoint, body: Any, max_tokens_limit: int) -> Parsed:
    """The fields the router reads of a decoded body (a dict: JSON, or a form's text fields), or BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise BadRequest("'model' must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if endpoint.form and isinstance(stream, str):
        stream = stream.strip().lower() == "true"
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, got {type(stream).__name__}", param="stream")
    max_tokens: int | None = 0
    if endpoint.max_tokens is not None:
        v = body.get(endpoint.max_tokens)
        if endpoint.form and isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= max_tokens_limit):
            raise BadRequest(f"'{endpoint.max_tokens}' must be an integer from 0 to {max_tokens_limit}",
                             param=endpoint.max_tokens)
        max_tokens = v
    parts: list[str] = []
    ids = sum(gather(body.get(f), parts) for f in endpoint.fields)
    user = body.get("user")
    return Parsed(model, stream, "\n".join(parts)[:_MAX_TEXT], ids, max_tokens, user if isinstance(user, str) else None)


def read(endpoint: Endpoint, raw: bytes, content_type: str, replicas: ReplicaSet, max_tokens_limit: int) -> Parsed:
    """What routing reads of a request's body, or BadRequest: not JSON (or not a form), invalid, a model no replica
    serves, or no model while the replicas serve different ones."""
    parsed = parse(endpoint, parse_form(raw, content_type) if endpoint.form else decode(raw), max_tokens_limit)
    if parsed.model is not None:
        if (refused := unknown_model(replicas, parsed.model)) is not None:
            raise refused
    elif not (index := model_index(replicas)).same_lists(replicas):  # built once per list change, as a 404's
        raise BadRequest("'model' is required: the replicas serve different models ("
                         + index.listed(replicas.known_models) + ")", param="model")
    return parsed
