"""A fake vLLM server: OpenAI-shaped completions (streaming or not), /health, /v1/models and a
/metrics page with vLLM's metric names, with switchable faults.

    fake = FakeVllm(); url = await fake.start(); ...; fake.mode = "error_500"; ...; await fake.stop()

`mode` (requests):  ok | error_500 | hang (never answers) | hang_stream (headers, then nothing)
                    | reset_mid_stream (2 chunks, then the connection is aborted) | slow (token_delay_s per token)
                    | stall_mid_stream (2 chunks, then nothing) | first_byte_delay (first_byte_delay_s before anything)
`metrics_mode`:     ok | legacy (gpu_cache_usage_perc) | garbage | missing (no kv usage) | http_500 | hang
`health_ok`:        False makes GET /health answer 500.
Gates, for tests that order events instead of timing them: `token_gate` (an asyncio.Semaphore) makes every token
wait for one release; `hold(prompt)` makes a request with that prompt wait before its last token until the
returned asyncio.Event is set (it holds its slot meanwhile, whatever the host's load).
`models`:           the ids it serves (default: [model]); `adapters` maps a LoRA adapter id to its base model (listed
                    in /v1/models with that `parent`, as vLLM does). A generation request for any other model gets
                    vLLM's 404 naming it. `models_mode`: ok | garbage (/v1/models answers a non-list).
vLLM's other client endpoints (ENDPOINT_PATHS: embeddings, responses, tokenize, detokenize, score, rerank, pooling,
classify, audio transcriptions and translations) answer in vLLM's shapes, a stream where vLLM streams; each records
(path, model) in `endpoint_calls`, a model not given standing for its first. `internal_calls` counts requests to
vLLM's internal /reset_prefix_cache (which a router must never forward).
Whatever the mode, like real vLLM on input it chokes on: a request still carrying `Content-Encoding` or whose
prompt contains POISON gets a 500 (a failure the request causes, not the replica).
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web


class FakeVllm:
    def __init__(self, model: str = "tiny", tokens: int = 4, token_delay_s: float = 0.0,
                 models: list[str] | None = None, adapters: dict[str, str] | None = None) -> None:
        self.model = model
        self.models = list(models) if models is not None else [model]
        self.adapters = dict(adapters or {})
        self.models_mode = "ok"
        self.model_requests = 0  # GET /v1/models received
        self.served_models: list[str] = []  # the model of each generation request it answered
        self.endpoint_calls: list[tuple[str, str]] = []  # (path, model) of each other endpoint's request answered
        self.internal_calls = 0
        self.tokens = tokens
        self.token_delay_s = token_delay_s
        self.mode = "ok"
        self.first_byte_delay_s = 0.5
        self.metrics_mode = "ok"
        self.health_ok = True
        self.waiting, self.running, self.kv_usage = 3, 5, 0.42
        self.num_gpu_blocks, self.block_size = 1000, 16
        self.requests = 0  # generation requests received
        self.active = 0  # generation requests being handled now
        self.cancelled = 0  # generation requests whose client went away
        self.completed = 0
        self.generation_tokens = 0  # exported as vllm:generation_tokens_total
        self.bodies: list[dict] = []
        self.token_gate: asyncio.Semaphore | None = None
        self.gates: dict[str, asyncio.Event] = {}
        self.headers: list[dict[str, str]] = []
        self.metrics_scrapes = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    # --- lifecycle ---
    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
            web.get("/metrics", self._metrics),
            web.post("/v1/echo/{tail:.*}", self._echo),
            *(web.post(path, self._endpoint) for path in ENDPOINT_PATHS),
            web.post("/reset_prefix_cache", self._internal),
        ])
        return app

    async def start(self, port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- endpoints ---
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="", status=200 if self.health_ok else 500)

    async def _models(self, request: web.Request) -> web.Response:
        self.model_requests += 1
        if self.models_mode == "garbage":
            return web.json_response({"models": "all of them"})
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "vllm", "root": m, "parent": None,
                 "max_model_len": 1024} for m in self.models]
        data += [{"id": a, "object": "model", "created": 0, "owned_by": "vllm", "root": f"/adapters/{a}", "parent": base,
                  "max_model_len": 1024} for a, base in self.adapters.items()]
        return web.json_response({"object": "list", "data": data})

    def serves(self, model: object) -> bool:
        return model in self.models or model in self.adapters

    async def _echo(self, request: web.Request) -> web.Response:
        return web.json_response({"path": request.path, "query": dict(request.query), "body": await request.text()})

    async def _internal(self, request: web.Request) -> web.Response:
        self.internal_calls += 1
        return web.Response(text="")

    async def _endpoint(self, request: web.Request) -> web.StreamResponse:
        """vLLM's other client endpoints: the model checked as for generation, then an answer in vLLM's shape."""
        path = request.path
        self.requests += 1
        self.headers.append(dict(request.headers))
        if path.startswith("/v1/audio/"):
            form = await request.post()
            body = {k: v for k, v in form.items() if isinstance(v, str)}
            body["file_bytes"] = sum(len(v.file.read()) for v in form.values() if not isinstance(v, str))
            stream = body.get("stream") == "true"
        else:
            body = await request.json()
            stream = body.get("stream") is True
        self.bodies.append(body)
        model = body.get("model") or self.models[0]
        if not self.serves(model):
            return web.json_response({"error": {"message": f"The model `{model}` does not exist.",
                                                "type": "NotFoundError", "param": "model", "code": 404}}, status=404)
        if self.mode == "error_500":
            return web.json_response({"error": {"message": "engine dead", "type": "InternalServerError",
                                                "param": None, "code": 500}}, status=500)
        if self.mode == "first_byte_delay":
            await asyncio.sleep(self.first_byte_delay_s)
        self.endpoint_calls.append((path, model))
        if stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in endpoint_events(path, model):
                await resp.write(event)
            await resp.write_eof()
            return resp
        return web.json_response(endpoint_answer(path, model, body))

    def metrics_text(self) -> str:
        kv_name = "vllm:gpu_cache_usage_perc" if self.metrics_mode == "legacy" else "vllm:kv_cache_usage_perc"
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{engine="0",model_name="{self.model}"}} {float(self.running)}',
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{engine="0",model_name="{self.model}"}} {float(self.waiting)}',
        ]
        if self.metrics_mode != "missing":
            lines += [
                f"# HELP {kv_name} KV-cache usage. 1 means 100 percent usage.",
                f"# TYPE {kv_name} gauge",
                f'{kv_name}{{engine="0",model_name="{self.model}"}} {self.kv_usage}',
            ]
        lines += [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",enable_prefix_caching="True",'
            f'engine="0",num_gpu_blocks="{self.num_gpu_blocks}"}} 1.0',
            "# TYPE vllm:generation_tokens_total counter",
            f'vllm:generation_tokens_total{{engine="0",model_name="{self.model}"}} {float(self.generation_tokens)}',
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
            "# TYPE vllm:num_preemptions_total counter",
            f'vllm:num_preemptions_total{{engine="0",model_name="{self.model}"}} 7.0',
            f'vllm:num_preemptions_created{{engine="0",model_name="{self.model}"}} 1.7e9',
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="{self.model}"}} 1200.0',
            "# TYPE vllm:prefix_cache_hits_total counter",
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="{self.model}"}} 640.0',
            "# TYPE vllm:time_to_first_token_seconds histogram",
            f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.01",model_name="{self.model}"}} 3.0',
            f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{self.model}"}} 5.0',
            f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="{self.model}"}} 5.0',
            f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="{self.model}"}} 0.2',
        ]
        return "\n".join(lines) + "\n"

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        if self.metrics_mode == "garbage":
            return web.Response(text="<html><body>502 Bad Gateway</body></html>", content_type="text/html")
        if self.metrics_mode == "http_500":
            return web.Response(status=500, text="boom")
        if self.metrics_mode == "hang":
            await asyncio.sleep(3600)
        return web.Response(text=self.metrics_text(), content_type="text/plain")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _chunk(self, i: int, chat: bool, finish: str | None) -> bytes:
        text = f" tok{i}"
        if chat:
            choice = {"index": 0, "delta": {"content": text} if i >= 0 else {"role": "assistant", "content": ""},
                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        data = {"id": "cmpl-fake", "object": obj, "created": int(time.time()), "model": self.model, "choices": [choice]}
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    def hold(self, prompt: str) -> asyncio.Event:
        """Requests with this prompt wait before their last token until the event is set."""
        return self.gates.setdefault(prompt, asyncio.Event())

    async def _gate(self, body: dict, last: bool) -> None:
        if self.token_gate is not None:
            await self.token_gate.acquire()
        gate = self.gates.get(body.get("prompt")) if last and isinstance(body.get("prompt"), str) else None
        if gate is not None:
            await gate.wait()

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self.requests += 1
        self.active += 1
        try:
            self.headers.append(dict(request.headers))
            if "Content-Encoding" in request.headers:  # vLLM (uvicorn) fails such a body with a 500
                return web.json_response({"object": "error", "message": "Expecting value", "type": "InternalServerError",
                                          "param": None, "code": 500}, status=500)
            body = await request.json()
            self.bodies.append(body)
            if not self.serves(body.get("model")):  # vLLM's answer (serving_engine._check_model)
                return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                    "type": "NotFoundError", "param": "model", "code": 404}}, status=404)
            self.served_models.append(body["model"])
            if "POISON" in json.dumps(body):
                return web.json_response({"object": "error", "message": "poisoned input", "type": "InternalServerError",
                                          "param": None, "code": 500}, status=500)
            mode = self.mode
            if mode == "error_500":
                return web.json_response({"object": "error", "message": "engine dead", "type": "InternalServerError",
                                          "param": None, "code": 500}, status=500)
            if mode == "hang":
                await asyncio.sleep(3600)
            if mode == "first_byte_delay":
                await asyncio.sleep(self.first_byte_delay_s)
            n = int(body.get("max_tokens") or self.tokens)
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await resp.prepare(request)
                if mode == "hang_stream":
                    await asyncio.sleep(3600)
                if chat:
                    await resp.write(self._chunk(-1, True, None))
                for i in range(n):
                    if mode == "stall_mid_stream" and i == 2:
                        await asyncio.sleep(3600)
                    if mode == "reset_mid_stream" and i == 2:
                        request.transport.abort()  # type: ignore[union-attr]
                        return resp
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                    await self._gate(body, last=i == n - 1)
                    self.generation_tokens += 1
                    await resp.write(self._chunk(i, chat, "length" if i == n - 1 else None))
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                self.completed += 1
                return resp
            for i in range(n):  # generating: the counter moves, the client sees nothing until the end
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                await self._gate(body, last=i == n - 1)
                self.generation_tokens += 1
            text = "".join(f" tok{i}" for i in range(n))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
            self.completed += 1
            return web.json_response({
                "id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": [choice],
                "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
            })
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled += 1
            raise
        finally:
            self.active -= 1


ENDPOINT_PATHS = ("/v1/embeddings", "/pooling", "/classify", "/v1/responses", "/tokenize", "/detokenize", "/v1/score",
                  "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/audio/transcriptions", "/v1/audio/translations")


def endpoint_answer(path: str, model: str, body: dict) -> dict:
    """A non-streamed answer in the shape vLLM gives on `path` (vllm/entrypoints/*/protocol.py)."""
    now = int(time.time())
    usage = {"prompt_tokens": 3, "total_tokens": 3, "completion_tokens": 0}
    if path == "/v1/embeddings":
        n = len(body["input"]) if isinstance(body.get("input"), list) and body["input"] and isinstance(body["input"][0], str) else 1
        return {"id": "embd-fake", "object": "list", "created": now, "model": model, "usage": usage,
                "data": [{"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]} for i in range(n)]}
    if path in ("/pooling", "/classify"):
        return {"id": "pool-fake", "object": "list", "created": now, "model": model, "usage": usage,
                "data": [{"index": 0, "object": "pooling", "data": [0.5, 0.5]}]}
    if path == "/v1/responses":
        return {"id": "resp_fake", "object": "response", "created_at": now, "model": model, "status": "completed",
                "output": [{"type": "message", "id": "msg_fake", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": f"hello from {model}", "annotations": []}]}],
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "usage": {"input_tokens": 3, "output_tokens": 3, "total_tokens": 6,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}}
    if path == "/tokenize":
        return {"count": 3, "max_model_len": 1024, "tokens": [1, 2, 3], "token_strs": None}
    if path == "/detokenize":
        return {"prompt": " ".join(f"t{t}" for t in body.get("tokens", []))}
    if path in ("/v1/score", "/score"):
        return {"id": "score-fake", "object": "list", "created": now, "model": model, "usage": usage,
                "data": [{"index": 0, "object": "score", "score": 0.75}]}
    if path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        docs = body.get("documents") or []
        return {"id": "rerank-fake", "model": model, "usage": {"total_tokens": 3},
                "results": [{"index": i, "document": {"text": d}, "relevance_score": 1.0 / (i + 1)}
                            for i, d in enumerate(docs)]}
    return {"text": f"transcribed by {model}"}  # /v1/audio/transcriptions, /v1/audio/translations


def endpoint_events(path: str, model: str) -> list[bytes]:
    """A streamed answer as vLLM sends it on `path`: a response's lifecycle events, or a transcription's deltas."""
    if path == "/v1/responses":
        base = {"id": "resp_fake", "object": "response", "created_at": 0, "model": model, "output": [],
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
        events = [("response.created", {"response": {**base, "status": "in_progress"}}),
                  ("response.output_text.delta", {"item_id": "msg_fake", "output_index": 0, "content_index": 0,
                                                  "delta": "hello", "logprobs": []}),
                  ("response.completed", {"response": {**base, "status": "completed"}})]
        return [f"event: {t}\ndata: {json.dumps({'type': t, 'sequence_number': i, **d})}\n\n".encode()
                for i, (t, d) in enumerate(events)]
    chunks = [{"id": "trsc-fake", "object": "transcription.chunk", "created": 0, "model": model,
               "choices": [{"delta": {"content": w}, "finish_reason": None}]} for w in ("hello", " world")]
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
