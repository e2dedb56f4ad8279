"""A minimal fake vLLM server for the observability test: OpenAI completions and chat
(streaming and not), /v1/models, /health, and a /metrics page with vLLM's metric names.

Failure switches, so the router's error metrics get samples:
- a prompt containing `fail-on-<name>` gets 503 from the server called <name> (the router retries elsewhere);
- a prompt containing `fail-everywhere` gets 500 from every server;
- an unknown model gets 404, as vLLM answers;
- `--flaky-metrics` answers every second /metrics scrape with 500;
- `--fail-all` answers every generation with 503 (a broken replica: the router retries and ejects it).

KV-cache events as vLLM publishes them with `--kv-events-config`: `GET /kv_event_sources` names a ZMQ PUB socket
this server binds (nothing is stored, so it sends no batch), so the router subscribes and exports its view's gauges.

Run: python tests/deploy/fake_vllm.py --port 8101 --name a [--flaky-metrics] [--fail-all]   (--port 0: a free
one, printed in its serving line)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
import uuid

from aiohttp import web

MODEL = "tiny"
TOKEN_DELAY_S = 0.004


class FakeVllm:
    def __init__(self, name: str, flaky_metrics: bool, fail_all: bool = False) -> None:
        self.name = name
        self.flaky_metrics = flaky_metrics
        self.fail_all = fail_all
        self.running = 0
        self.scrapes = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/kv_event_sources", self.kv_event_sources)
        app.on_startup.append(self._bind_kv_events)
        app.on_cleanup.append(self._close_kv_events)
        return app

    async def _bind_kv_events(self, app: web.Application) -> None:
        import zmq

        self.zmq = zmq.Context()
        self.pub = self.zmq.socket(zmq.PUB)
        self.kv_port = self.pub.bind_to_random_port("tcp://127.0.0.1")

    async def _close_kv_events(self, app: web.Application) -> None:
        self.pub.close(linger=0)
        self.zmq.term()

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        return web.json_response({"0": {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                                        "endpoint": f"tcp://*:{self.kv_port}", "replay_endpoint": None}})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "vllm", "max_model_len": 2048}]})

    async def metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        if self.flaky_metrics and self.scrapes % 2 == 0:
            return web.Response(status=500, text="flaky metrics endpoint\n")
        labels = f'engine="0",model_name="{MODEL}"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(self.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} 0.0",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {min(1.0, 0.05 * self.running)}",
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="1024"}} 1.0',
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(self.prompt_tokens)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(self.generation_tokens)}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body.get("prompt", "")
        return await self._generate(request, body, prompt if isinstance(prompt, str) else json.dumps(prompt), chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text = "\n".join(m.get("content", "") for m in body.get("messages", []) if isinstance(m.get("content"), str))
        return await self._generate(request, body, text, chat=True)

    def _refusal(self, body: dict, prompt: str) -> web.Response | None:
        if body.get("model") != MODEL:
            return web.json_response({"object": "error", "message": f"The model `{body.get('model')}` does not exist.",
                                      "type": "NotFoundError", "code": 404}, status=404)
        if "fail-everywhere" in prompt:
            return web.json_response({"object": "error", "message": "injected failure", "code": 500}, status=500)
        if self.fail_all or f"fail-on-{self.name}" in prompt:
            return web.json_response({"object": "error", "message": "injected overload", "code": 503}, status=503)
        return None

    async def _generate(self, request: web.Request, body: dict, prompt: str, chat: bool) -> web.StreamResponse:
        refusal = self._refusal(body, prompt)
        if refusal is not None:
            return refusal
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 8)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        self.prompt_tokens += max(1, len(prompt) // 4)
        self.running += 1
        try:
            if not body.get("stream"):
                await asyncio.sleep(TOKEN_DELAY_S * n)
                self.generation_tokens += n
                text = " tok" * n
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                          if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
                usage = {"prompt_tokens": max(1, len(prompt) // 4), "completion_tokens": n,
                         "total_tokens": max(1, len(prompt) // 4) + n}
                return web.json_response({"id": rid, "object": kind, "created": created, "model": MODEL,
                                          "choices": [choice], "usage": usage})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            for i in range(n):
                await asyncio.sleep(TOKEN_DELAY_S)
                finish = "length" if i == n - 1 else None
                if chat:
                    delta = {"role": "assistant", "content": " tok"} if i == 0 else {"content": " tok"}
                    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": " tok", "logprobs": None, "finish_reason": finish}
                chunk = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created,
                         "model": MODEL, "choices": [choice]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.generation_tokens += 1
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.running -= 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", required=True, help="server name used by the fail-on-<name> switch")
    ap.add_argument("--flaky-metrics", action="store_true", help="fail every second /metrics scrape with 500")
    ap.add_argument("--fail-all", action="store_true", help="answer every generation with 503")
    args = ap.parse_args()
    sock = socket.create_server(("127.0.0.1", args.port))  # --port 0: a free one, said below
    print(f"fake vLLM {args.name}: serving on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    web.run_app(FakeVllm(args.name, args.flaky_metrics, args.fail_all).app(), sock=sock, print=None, access_log=None)


if __name__ == "__main__":
    main()
