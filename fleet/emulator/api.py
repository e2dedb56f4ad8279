"""vLLM emulator: the simulator's replica model run in wall-clock time behind an OpenAI-compatible server.

    fleet emulate --port 8101 --profile llama3-8b-a100 [--speed 1.0] [--max-num-seqs 256] [--kv-blocks N]
                  [--lora sql-{0..7} --max-loras 4]

A stand-in for a vLLM server at scale on a CPU machine (demo, fast integration tests), not a substitute for
the real-vLLM tests. What it does:
- `/v1/completions`, `/v1/chat/completions` (SSE streaming in OpenAI's chunk format, and non-streaming),
  `/v1/models`, `/health`, `/metrics` (vLLM 0.32's metric names, `engine="0"`, `model_name=<served name>`).
- Requests go into one `simulator.replica` model (continuous batching, chunked prefill, paged KV with
  preemption, prefix caching). An asyncio task steps it: each engine iteration's simulated duration is
  slept in real time (divided by `--speed`), then that iteration's tokens go to the waiting streams, all of
  a request's new tokens in one write. The first token follows the request's last prefill chunk.
- Prompt tokens: the router's estimator rule, `ceil(len(text) / 4)` (`TokenEstimator.from_text`); a chat
  request's text is its messages rendered as `role: content\\n` lines; a prompt given as token ids counts
  its ids. Output tokens: exactly `max_tokens` (default 16), as with `ignore_eos` - the text is filler.
- Tokens: 4 characters each (fleet/emulator/kv_publish.py), what `POST /tokenize` answers. Prefix caching keys a
  prompt's full blocks of `block_size` tokens by the chain hash of their token ids, so a repeated prompt hits.
- KV-cache events (`--kv-events PORT_OR_ENDPOINT`): the prefix cache's stored and evicted blocks published as vLLM
  does (ZMQ PUB, msgpack KVEventBatch, topic `kv`, optional `--kv-events-replay`), and `GET /kv_event_sources`.
- A client disconnect aborts the request in the model and frees its KV blocks.
- LoRA adapters (`--lora NAME ...`, ranges `NAME-{A..B}` allowed): listed in `/v1/models` with the served model as
  their parent; a request naming one is scheduled with vLLM's adapter rules (at most `--max-loras` distinct adapters
  per batch, the load and swap cost of an adapter not in a GPU slot: `simulator.replica`), and
  `vllm:lora_requests_info` reports the adapters running and waiting as vLLM does.

aiohttp and prometheus_client are imported here: this is a live-fleet tool (`fleet`), not part of the simulator library.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
import uuid
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from routewise_vllm.fleet.emulator.engine import EmulatorSettings, Stream, WallClockEngine
from routewise_vllm.fleet.emulator.kv_publish import KVPublisher, endpoint_of, prefix_keys, token_ids
from routewise_vllm.router.policy.estimate import TokenEstimator
from routewise_vllm.simulator.config import expand_names

ESTIMATOR = TokenEstimator()
DEFAULT_MAX_TOKENS = 16
FILLER = " tok"  # the text of every generated token


# ---------------------------------------------------------------- the OpenAI-compatible API


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def _error(message: str, status: int, kind: str) -> web.Response:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status)


def _int_param(body: dict, name: str, default: int, minimum: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def prompt_tokens_of(prompt: object) -> tuple[int, str | list[int]]:
    """(token count, the prompt's text or token ids) of a completions `prompt` (string, token ids, or a list of one)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return ESTIMATOR.from_text(prompt), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt), list(prompt)
    raise BadRequest("prompt must be a string, a list of token ids, or a list of one of those (batches are not supported)")


def chat_text(messages: object) -> str:
    """The chat template of the tiny test model: one `role: content` line per message."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    lines = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise BadRequest(f"messages[{i}] must be an object with a role")
        content = msg.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        lines.append(f"{msg['role']}: {content}\n")
    return "".join(lines)


@dataclass(frozen=True, slots=True)
class _Parsed:
    prompt_tokens: int
    text: str | list[int]  # token ids for a prompt given as ids
    max_tokens: int
    stream: bool
    include_usage: bool
    adapter: str | None = None  # the LoRA adapter the request names (None: the served model)


def _parse(body: object, chat: bool, served: str | frozenset[str], adapters: frozenset[str] = frozenset()) -> _Parsed:
    """`served`: the served model's name, or all of its names."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    names = frozenset((served,)) if isinstance(served, str) else served
    if model is not None and model not in names and model not in adapters:
        raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")
    if _int_param(body, "n", 1, 1) != 1:
        raise BadRequest("n > 1 is not supported by the emulator")
    if chat:
        text = chat_text(body.get("messages"))
        tokens = ESTIMATOR.from_text(text)
        max_tokens = _int_param(body, "max_completion_tokens", _int_param(body, "max_tokens", DEFAULT_MAX_TOKENS, 1), 1)
    else:
        if "prompt" not in body:
            raise BadRequest("prompt is required")
        tokens, text = prompt_tokens_of(body["prompt"])
        max_tokens = _int_param(body, "max_tokens", DEFAULT_MAX_TOKENS, 1)
    stream = bool(body.get("stream", False))
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object")
    return _Parsed(tokens, text, max_tokens, stream, bool(opts.get("include_usage", False)),
                   model if isinstance(model, str) and model in adapters else None)


class Api:
    """Request handlers over one WallClockEngine."""

    def __init__(self, engine: WallClockEngine) -> None:
        self.engine = engine
        self.model = engine.settings.model_name
        self.names = frozenset((self.model, *engine.settings.aliases))
        self.adapters = frozenset(engine.replica.lora_names[1:])
        self.created = int(time.time())
        bs = engine.settings.block_size
        self._prefix_chars = bs * ESTIMATOR.chars_per_token
        self._caching = engine.settings.enable_prefix_caching

    def _keys(self, text: str | list[int]) -> tuple[int, ...]:
        if not self._caching:
            return ()
        ids = token_ids(text) if isinstance(text, str) else text
        keys = prefix_keys(ids, self.engine.settings.block_size)
        if self.engine.kv is not None:
            self.engine.kv.register(keys, ids)
        return keys

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        kv = self.engine.kv
        return web.json_response({} if kv is None else {"0": kv.config()})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a completions `prompt` or chat `messages` (rendered as the chat requests are)."""
        try:
            if request.content_type != "application/json":  # vLLM (FastAPI) reads only a JSON body
                raise BadRequest(f"expected a JSON body (Content-Type application/json), got {request.content_type!r}")
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"invalid JSON body: {e}") from None
            if not isinstance(body, dict):
                raise BadRequest("request body must be a JSON object")
            model = body.get("model")
            if model is not None and model not in self.names and model not in self.adapters:
                raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")
            if "messages" in body:
                ids = token_ids(chat_text(body["messages"]))
            elif "prompt" in body:
                _, text = prompt_tokens_of(body["prompt"])
                ids = token_ids(text) if isinstance(text, str) else text
            else:
                raise BadRequest("prompt or messages is required")
        except BadRequest as e:
            return _error(str(e), e.status, e.kind)
        return web.json_response({"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                                  "token_strs": None})

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }
        names = [{**card, "id": n} for n in self.engine.settings.aliases]  # vLLM: a card per served name
        loras = [{**card, "id": a, "root": f"/adapters/{a}", "parent": self.model, "max_model_len": None}
                 for a in self.engine.replica.lora_names[1:]]  # vLLM lists an adapter with its path and parent
        return web.json_response({"object": "list", "data": [card, *names, *loras]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503, text=self.engine.error) if self.engine.error else web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.engine.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"invalid JSON body: {e}") from None
            p = _parse(body, chat, self.names, self.adapters)
            try:
                st, stream = self.engine.submit(p.prompt_tokens, p.max_tokens, self._keys(p.text),
                                                p.adapter)
            except ValueError as e:
                raise BadRequest(str(e)) from None
            except RuntimeError as e:
                raise BadRequest(str(e), 503, "ServiceUnavailableError") from None
        except BadRequest as e:
            return _error(str(e), e.status, e.kind)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            if p.stream:
                return await self._stream(request, stream, p, chat, rid)
            while not stream.finished and stream.error is None:
                stream.wake.clear()
                await stream.wake.wait()
            if stream.error is not None:
                return _error(stream.error, 500, "InternalServerError")
            return web.json_response(self._full_body(stream, chat, rid, p.adapter or self.model))
        finally:
            if not stream.finished:
                self.engine.abort(st)

    def _usage(self, stream: Stream) -> dict:
        n = stream.generated
        return {
            "prompt_tokens": stream.prompt_tokens,
            "total_tokens": stream.prompt_tokens + n,
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": stream.cached_tokens},
        }

    def _full_body(self, stream: Stream, chat: bool, rid: str, model: str) -> dict:
        text = FILLER * stream.generated
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": "length", "stop_reason": None}  # fmt: skip
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
                "usage": self._usage(stream)}  # fmt: skip

    async def _stream(self, request: web.Request, stream: Stream, p: _Parsed, chat: bool, rid: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        if chat:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": p.adapter or self.model}
            token = _sse({**head, "choices": [{"index": 0, "delta": {"content": FILLER}, "logprobs": None, "finish_reason": None}]})
            last = _sse({**head, "choices": [{"index": 0, "delta": {"content": FILLER}, "logprobs": None,
                                              "finish_reason": "length", "stop_reason": None}]})  # fmt: skip
            first = _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        else:
            head = {"id": rid, "object": "text_completion", "created": created, "model": p.adapter or self.model}
            token = _sse({**head, "choices": [{"index": 0, "text": FILLER, "logprobs": None, "finish_reason": None, "stop_reason": None}]})
            last = _sse({**head, "choices": [{"index": 0, "text": FILLER, "logprobs": None, "finish_reason": "length", "stop_reason": None}]})
            first = b""
        sent = 0
        while True:
            if stream.error is not None:  # mid-stream failure: vLLM sends an error event and stops
                await resp.write(_sse({"error": {"message": stream.error, "type": "InternalServerError", "code": 500}}))
                break
            if stream.generated == sent and not stream.finished:
                stream.wake.clear()
                await stream.wake.wait()
                continue
            n = stream.generated - sent
            done = stream.finished and stream.generated == stream.max_tokens
            if sent == 0 and first:
                out = first + token * (n - 1 if done else n) + (last if done else b"")
            else:
                out = token * (n - 1 if done else n) + (last if done else b"")
            sent += n
            if done:
                if p.include_usage:
                    out += _sse({**head, "choices": [], "usage": self._usage(stream)})
                out += b"data: [DONE]\n\n"
                await resp.write(out)
                break
            await resp.write(out)
        await resp.write_eof()
        return resp


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


ENGINE_KEY = web.AppKey("engine", WallClockEngine)
API_KEY = web.AppKey("api", Api)


def make_app(settings: EmulatorSettings) -> web.Application:
    """App factory: the engine loop runs for the app's lifetime (a cleanup context)."""
    app = web.Application()

    async def engine_ctx(app: web.Application):
        engine = WallClockEngine(settings)
        if settings.kv_events:
            engine.kv = KVPublisher(settings.kv_events, settings.block_size, settings.kv_events_topic,
                                    settings.kv_events_replay)
            engine.kv.observe(engine.replica)
            engine.kv.start()
        api = Api(engine)
        app[ENGINE_KEY] = engine
        app[API_KEY] = api
        task = asyncio.create_task(engine.run(), name="emulator-engine")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # a failed loop was already reported
        if engine.kv is not None:
            await engine.kv.close()

    app.cleanup_ctx.append(engine_ctx)

    def handler(name: str):
        async def h(request: web.Request) -> web.StreamResponse:
            return await getattr(request.app[API_KEY], name)(request)

        return h

    app.router.add_post("/v1/completions", handler("completions"))
    app.router.add_post("/v1/chat/completions", handler("chat_completions"))
    app.router.add_get("/v1/models", handler("models"))
    app.router.add_get("/health", handler("health"))
    app.router.add_get("/metrics", handler("metrics"))
    app.router.add_get("/kv_event_sources", handler("kv_event_sources"))
    app.router.add_post("/tokenize", handler("tokenize"))
    return app


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, required=True, help="listen port; 0 takes a free one, printed in the serving line")
    p.add_argument("--profile", default="llama3-8b-a100", help="hardware/model profile (simulator/profiles/) or a YAML path")
    p.add_argument("--model-name", "--served-model-name", dest="model_name", nargs="+", default=["tiny"],
                   metavar="NAME", help="served model name; several are names of the same model, as in vLLM (the "
                   "first labels the metrics and the answers)")
    p.add_argument("--speed", type=float, default=1.0, help="emulated seconds per wall second (0.5 = half speed)")
    p.add_argument("--slowdown", type=float, default=1.0, help="iteration-time multiplier of this replica (a slower GPU)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks (default: what the profile's memory leaves)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the profile's")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed chunk (vLLM's --stream-interval)")
    p.add_argument("--lora", nargs="+", default=[], metavar="NAME",
                   help="LoRA adapters served besides the model (comma-separated or several; NAME-{0..7} for 8)")
    p.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one batch (vLLM's --max-loras)")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory (default: max-loras)")
    p.add_argument("--lora-load-s", type=float, default=0.1, help="seconds to read an adapter not in host memory")
    p.add_argument("--lora-swap-s", type=float, default=0.01, help="seconds to copy an adapter into a GPU slot")
    p.add_argument("--kv-events", metavar="PORT_OR_ENDPOINT", default=None,
                   help="publish KV-cache events as vLLM does: a port binds tcp://*:PORT; an endpoint with a wildcard "
                   "is bound, a concrete one (a router's --kv-events-bind) connected to")
    p.add_argument("--kv-events-topic", default="kv", help="the events' ZMQ topic (default kv)")
    p.add_argument("--kv-events-replay", metavar="ENDPOINT", default=None,
                   help="a ZMQ ROUTER endpoint answering replay requests (vLLM's replay_endpoint)")


def settings_from_args(args: argparse.Namespace) -> EmulatorSettings:
    return EmulatorSettings(
        profile=args.profile,
        model_name=args.model_name[0],
        aliases=tuple(args.model_name[1:]),
        speed=args.speed,
        slowdown=args.slowdown,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        max_model_len=args.max_model_len,
        stream_interval=args.stream_interval,
        lora=tuple(expand_names([n for arg in args.lora for n in arg.split(",") if n])),
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        lora_load_s=args.lora_load_s,
        lora_swap_s=args.lora_swap_s,
        kv_events=None if args.kv_events is None else endpoint_of(args.kv_events),
        kv_events_topic=args.kv_events_topic,
        kv_events_replay=None if args.kv_events_replay is None else endpoint_of(args.kv_events_replay),
    )


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        WallClockEngine(settings)  # fail fast on a bad profile or sizes, before binding the port
    except (ValueError, KeyError) as e:
        print(f"fleet emulate: error: {e}", file=sys.stderr)
        return 2
    try:  # bound before it says it serves: a busy port is one line
        sock = socket.create_server((args.host, args.port), backlog=1024)
    except OSError as e:
        print(f"fleet emulate: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    port = sock.getsockname()[1]
    print(f"emulator: {settings.profile} (x{settings.slowdown} slower, speed {settings.speed}) serving "
          f"{', '.join(repr(n) for n in (settings.model_name, *settings.aliases))} on http://{args.host}:{port}", file=sys.stderr, flush=True)  # fmt: skip
    web.run_app(make_app(settings), sock=sock, print=None, handler_cancellation=True, access_log=None,
                handle_signals=True)  # fmt: skip
    return 0


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fleet emulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return main(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(cli())
