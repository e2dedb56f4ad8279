"""vLLM emulator: the simulator's replica model run in wall-clock time behind an OpenAI-compatible server.

    fleet emulate --port 8101 --profile llama3-8b-a100 [--speed 1.0] [--max-num-seqs 256] [--kv-blocks N]

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
- Prefix caching: the prompt text's chained prefix-block hashes (`router.policy.text_prefix_blocks` with
  blocks of `block_size` tokens), so a repeated prompt hits the replica's prefix cache.
- A client disconnect aborts the request in the model and frees its KV blocks.

aiohttp and prometheus_client are imported here: this is a live-fleet tool (`fleet`), not part of the simulator library.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.policy.estimate import TokenEstimator, text_prefix_blocks
from simulator.config import ReplicaGroup
from simulator.costmodel import load_profile
from simulator.replica import COMPLETE, DECODE, DONE, FIRST, IDLE, ITER, PREFILL, WAITING, Replica, ReqState
from simulator.types import SimRequest

ESTIMATOR = TokenEstimator()
DEFAULT_MAX_TOKENS = 16
FILLER = " tok"  # the text of every generated token

# vLLM's own histogram buckets (vllm/v1/metrics/loggers.py), so dashboards read the emulator like vLLM.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


# ---------------------------------------------------------------- one request's stream


@dataclass(slots=True)
class Stream:
    """What the engine loop tells a request handler: tokens so far, when it finished, and a wake-up."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival: float  # wall clock (time.monotonic)
    generated: int = 0
    notified: int = 0  # tokens the handler has been woken for
    last_token_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    cached_tokens: int = 0
    error: str | None = None  # set when the engine loop died
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.finished_at is not None


# ---------------------------------------------------------------- metrics (vLLM 0.32 names)


class VllmMetrics:
    """vLLM's Prometheus families in a registry of their own (no process-global state)."""

    def __init__(self, model_name: str, block_size: int, num_gpu_blocks: int, enable_prefix_caching: bool) -> None:
        self.registry = CollectorRegistry()
        labels = ("engine", "model_name")
        values = ("0", model_name)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + extra, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ("engine", "block_size", "num_gpu_blocks", "enable_prefix_caching"),
            registry=r,
        )
        info.labels("0", str(block_size), str(num_gpu_blocks), str(enable_prefix_caching)).set(1)
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.").labels(*values)
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.").labels(*values)
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.").labels(*values)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*values)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(*values)
        self._success = counter("vllm:request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.success_length = self._success.labels(*values, "length")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", E2E_BUCKETS)
        self._values = values

    def bind_state(self, driver: "WallClockEngine") -> None:
        """Gauges read the model's state when scraped (no per-iteration bookkeeping)."""
        self.running.labels(*self._values).set_function(lambda: driver.num_running)
        self.waiting.labels(*self._values).set_function(lambda: driver.num_waiting)
        self.kv_usage.labels(*self._values).set_function(lambda: driver.kv_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ---------------------------------------------------------------- the replica model in wall-clock time


@dataclass(frozen=True)
class EmulatorSettings:
    profile: str = "llama3-8b-a100"
    model_name: str = "tiny"
    speed: float = 1.0  # emulated seconds per wall second
    slowdown: float = 1.0  # the replica's iteration-time multiplier (a slower GPU)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_blocks: int | None = None  # None: what the profile's memory leaves (vLLM's profiling)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the profile's
    stream_interval: int = 1  # tokens per streamed chunk, like vLLM's --stream-interval


class WallClockEngine:
    """Steps one `simulator.replica.Replica` in real time and hands tokens to the waiting streams.

    Simulated time is `(monotonic() - t0) * speed`. Iterations are planned one at a time
    (`closed_form=False`: no multi-step decode jumps) so every iteration's tokens can be emitted. An
    iteration that the host finishes late ends at the late time: the emulated GPU never outruns the
    machine. Aborts of scheduled requests wait for the end of the current iteration, when no KV block
    is half-allocated; waiting requests leave at once.
    """

    def __init__(self, settings: EmulatorSettings, clock=time.monotonic) -> None:
        if settings.speed <= 0:
            raise ValueError(f"speed must be > 0, got {settings.speed}")
        if settings.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {settings.stream_interval}")
        self.settings = settings
        self.profile = load_profile(settings.profile)
        group = ReplicaGroup(
            profile=settings.profile,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            block_size=settings.block_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enable_prefix_caching=settings.enable_prefix_caching,
            speed_factor=settings.slowdown,
        )
        self.replica = Replica("0", group, self.profile, closed_form=False)
        if settings.kv_blocks is not None:
            if settings.kv_blocks < 1:
                raise ValueError(f"kv_blocks must be >= 1, got {settings.kv_blocks}")
            self.replica.num_blocks = settings.kv_blocks
            self.replica._reset_state()  # the model sizes its free list from num_blocks
        self.max_model_len = settings.max_model_len or self.profile.max_model_len
        self.clock = clock
        self.t0 = clock()
        self.streams: dict[ReqState, Stream] = {}
        self._pending_aborts: list[ReqState] = []
        self._kick = asyncio.Event()
        self._ids = itertools.count()
        self.metrics = VllmMetrics(
            settings.model_name, settings.block_size, self.replica.num_blocks, settings.enable_prefix_caching
        )
        self.metrics.bind_state(self)
        self._preemptions_seen = 0
        self.error: str | None = None

    # ---- state read by the gauges
    @property
    def num_running(self) -> int:
        return len(self.replica.running)

    @property
    def num_waiting(self) -> int:
        return len(self.replica.waiting)

    @property
    def kv_usage(self) -> float:
        return self.replica.kv_usage()

    def sim_now(self) -> float:
        return (self.clock() - self.t0) * self.settings.speed

    def wall_of(self, sim_s: float) -> float:
        return self.t0 + sim_s / self.settings.speed

    # ---- requests
    def validate(self, prompt_tokens: int, max_tokens: int) -> None:
        """vLLM's admission checks (400 on failure), plus the model's own: the request must fit the KV cache."""
        if prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        if prompt_tokens + max_tokens - 1 > self.replica.kv_capacity_tokens:
            raise ValueError(
                f"request of {prompt_tokens} prompt + {max_tokens} output tokens does not fit the KV cache "
                f"({self.replica.kv_capacity_tokens} tokens)"
            )

    def submit(self, prompt_tokens: int, max_tokens: int, prefix_keys: tuple[int, ...]) -> tuple[ReqState, Stream]:
        if self.error:
            raise RuntimeError(self.error)
        self.validate(prompt_tokens, max_tokens)
        rid = next(self._ids)
        bs = self.settings.block_size
        req = SimRequest(
            request_id=rid,
            arrival_s=0.0,
            prompt_tokens=prompt_tokens,
            output_tokens=max_tokens,
            block_ids=prefix_keys,
            block_tokens=bs,
            max_tokens=max_tokens,
        )
        now = self.sim_now()
        st = ReqState(req, rid, now, keys=prefix_keys)
        stream = Stream(f"{rid}", prompt_tokens, max_tokens, arrival=self.clock())
        self.streams[st] = stream
        self.replica.add(st, now)
        self._kick.set()
        return st, stream

    def abort(self, st: ReqState) -> None:
        """The client went away: free the request's slot and KV blocks."""
        stream = self.streams.pop(st, None)
        if stream is None or st.phase == DONE:
            return
        if st.phase == WAITING:
            self.replica.waiting.remove(st)
            st.phase = DONE
            if self.replica.mode == IDLE and not self.replica.running and not self.replica.waiting:
                self.replica.event_s = None
        else:
            self._pending_aborts.append(st)
            self._kick.set()

    def _apply_aborts(self) -> None:
        rep = self.replica
        for st in self._pending_aborts:
            if st.phase in (PREFILL, DECODE):
                rep._release(st)  # the model has no abort(): see the emulator's report to the lead
                rep.running.remove(st)
                if st in rep.prefilling:
                    rep.prefilling.remove(st)
            elif st.phase == WAITING:  # preempted since the abort was asked
                rep.waiting.remove(st)
            st.phase = DONE
        self._pending_aborts.clear()

    # ---- the loop
    async def run(self) -> None:
        """The engine loop; if the model raises, every stream fails and the server reports unhealthy."""
        try:
            await self._run()
        except Exception as e:  # noqa: BLE001 - surfaced through /health and every request
            import traceback

            traceback.print_exc()
            self.error = f"engine loop failed: {e!r}"
            for stream in self.streams.values():
                stream.error = self.error
                stream.wake.set()
            raise

    async def _run(self) -> None:
        rep = self.replica
        while True:
            if rep.mode != ITER:
                if self._pending_aborts:
                    self._apply_aborts()
                    rep._plan_next(self.sim_now())
                    continue
                self._kick.clear()
                await self._kick.wait()
                continue
            delay = self.wall_of(rep.event_s) - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            now = max(rep.event_s, self.sim_now())
            rep._finish_iteration(now)
            if self._pending_aborts:
                self._apply_aborts()
            rep._plan_next(now)
            self._emit(rep)

    def _emit(self, rep: Replica) -> None:
        """Hand this iteration's tokens to the streams; one wake-up per stream per iteration at most."""
        wall = self.clock()
        m = self.metrics
        step = rep.step
        interval = self.settings.stream_interval
        new_tokens = 0
        if rep.outputs:
            for kind, st, _t in rep.outputs:
                stream = self.streams.get(st)
                if stream is None:
                    continue
                if kind == FIRST:
                    stream.first_token_at = wall
                    stream.cached_tokens = st.prefix_hit_tokens
                    m.ttft.observe(wall - stream.arrival)
                    m.queue_time.observe(max(0.0, (st.first_scheduled_s - st.dispatch_s) / self.settings.speed))
                    m.prompt_tokens.inc(st.prompt)
                    m.prefix_queries.inc(st.prompt)
                    if st.prefix_hit_tokens:
                        m.prefix_hits.inc(st.prefix_hit_tokens)
                elif kind == COMPLETE:
                    new_tokens += self._advance(stream, st.output, wall)
                    stream.finished_at = wall
                    del self.streams[st]
                    m.e2e.observe(wall - stream.arrival)
                    m.success_length.inc()
                    stream.wake.set()
            rep.outputs.clear()
        for st in rep.running:
            if st.phase == DECODE:
                stream = self.streams.get(st)
                if stream is None:
                    continue
                g = st.base + step - st.prompt + 1
                if g > stream.generated:
                    new_tokens += self._advance(stream, g, wall)
                    if g - stream.notified >= interval or stream.notified == 0:
                        stream.notified = g
                        stream.wake.set()
        if new_tokens:
            m.generation_tokens.inc(new_tokens)
        if rep.n_preemptions != self._preemptions_seen:
            m.preemptions.inc(rep.n_preemptions - self._preemptions_seen)
            self._preemptions_seen = rep.n_preemptions

    def _advance(self, stream: Stream, g: int, wall: float) -> int:
        new = g - stream.generated
        if new <= 0:
            return 0
        if stream.last_token_at is not None:
            gap = (wall - stream.last_token_at) / new
            for _ in range(new):
                self.metrics.itl.observe(gap)
        elif new > 1:
            for _ in range(new - 1):
                self.metrics.itl.observe(0.0)
        stream.generated = g
        stream.last_token_at = wall
        return new


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


def prompt_tokens_of(prompt: object) -> tuple[int, str]:
    """(token count, text for prefix hashing) of a completions `prompt` (string, token ids, or a list of one)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return ESTIMATOR.from_text(prompt), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        # token ids: 4 characters per id keeps the prefix blocks aligned with the token count
        return len(prompt), "".join(f"{t:>4}"[-4:] for t in prompt)
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
    text: str
    max_tokens: int
    stream: bool
    include_usage: bool


def _parse(body: object, chat: bool, served: str) -> _Parsed:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served:
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
    return _Parsed(tokens, text, max_tokens, stream, bool(opts.get("include_usage", False)))


class Api:
    """Request handlers over one WallClockEngine."""

    def __init__(self, engine: WallClockEngine) -> None:
        self.engine = engine
        self.model = engine.settings.model_name
        self.created = int(time.time())
        bs = engine.settings.block_size
        self._prefix_chars = bs * ESTIMATOR.chars_per_token
        self._caching = engine.settings.enable_prefix_caching

    def _keys(self, text: str, tokens: int) -> tuple[int, ...]:
        if not self._caching:
            return ()
        return text_prefix_blocks(
            text, block_tokens=self.engine.settings.block_size, max_blocks=tokens // self.engine.settings.block_size + 1
        )

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
        return web.json_response({"object": "list", "data": [card]})

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
            p = _parse(body, chat, self.model)
            try:
                st, stream = self.engine.submit(p.prompt_tokens, p.max_tokens, self._keys(p.text, p.prompt_tokens))
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
            return web.json_response(self._full_body(stream, chat, rid))
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

    def _full_body(self, stream: Stream, chat: bool, rid: str) -> dict:
        text = FILLER * stream.generated
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": "length", "stop_reason": None}  # fmt: skip
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model, "choices": [choice],
                "usage": self._usage(stream)}  # fmt: skip

    async def _stream(self, request: web.Request, stream: Stream, p: _Parsed, chat: bool, rid: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        if chat:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model}
            token = _sse({**head, "choices": [{"index": 0, "delta": {"content": FILLER}, "logprobs": None, "finish_reason": None}]})
            last = _sse({**head, "choices": [{"index": 0, "delta": {"content": FILLER}, "logprobs": None,
                                              "finish_reason": "length", "stop_reason": None}]})  # fmt: skip
            first = _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        else:
            head = {"id": rid, "object": "text_completion", "created": created, "model": self.model}
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
        api = Api(engine)
        app[ENGINE_KEY] = engine
        app[API_KEY] = api
        task = asyncio.create_task(engine.run(), name="emulator-engine")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # a failed loop was already reported

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
    return app


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--profile", default="llama3-8b-a100", help="hardware/model profile (simulator/profiles/) or a YAML path")
    p.add_argument("--model-name", "--served-model-name", dest="model_name", default="tiny", help="served model name")
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


def settings_from_args(args: argparse.Namespace) -> EmulatorSettings:
    return EmulatorSettings(
        profile=args.profile,
        model_name=args.model_name,
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
    )


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    try:
        WallClockEngine(settings)  # fail fast on a bad profile or sizes, before binding the port
    except (ValueError, KeyError) as e:
        print(f"fleet emulate: error: {e}", file=sys.stderr)
        return 2
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    print(f"emulator: {settings.profile} (x{settings.slowdown} slower, speed {settings.speed}) serving "
          f"{settings.model_name!r} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)  # fmt: skip
    web.run_app(make_app(settings), host=args.host, port=args.port, print=None, handler_cancellation=True,
                access_log=None, handle_signals=True, backlog=1024)  # fmt: skip
    return 0


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fleet emulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return main(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(cli())
