"""Profile a running vLLM server from outside and fit a simulator profile to it (`fleet calibrate --server`).

One long module because the sweep's rounds share one server handle, one progress line and one table of measured
rows, each round reading what the one before found; the fit (calibrate_fit.py) and the validation replay
(calibrate_check.py) are apart, since they need no server.

The sweep covers the range a workload runs in, in rounds announced before they start:
- the batch limit first (given, or the plateau of running requests while others wait, `max_concurrency` at once);
- prefill at batch 1 up to a `max_num_batched_tokens` chunk, timed by the server's own prefill (or first-token less
  queue) histogram;
- decode over a grid of batch sizes up to the limit and per-sequence contexts up to half of max_model_len, each timed
  client-side over the window where every stream decodes (the server's inter-token histogram mixes in the
  staggered prefill's iterations);
- mixed iterations: a prompt joining a decoding batch, timed by the decoders' gap that ends with its first token.
Rounds repeat with fresh prompts until the chosen fit moves by under `converged` or the budget ends.

Rows (prefill tokens, decode sequences, context tokens, attention pairs, prefill sequences, seconds) are fitted by
`fleet.calibrate_fit` (both forms, chosen on held-out rows); `fleet.calibrate_check` replays a validation workload
and sets its measured percentiles against the profile's prediction. The profile file appears only when complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from routewise_vllm.fleet import calibrate_check, calibrate_fit
from routewise_vllm.simulator import costmodel

_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu north south east west river stone cloud light"
).split()


class CalibrationError(Exception):
    """One line naming the URL, the probe and the value that was wrong."""


@dataclass
class ServerInfo:
    url: str
    model: str
    max_model_len: int
    block_size: int
    kv_cache_tokens: int
    enable_prefix_caching: bool
    config_labels: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- /metrics


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples by name (labels, value); TYPE lines are ignored (counters' names differ between versions)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _total(samples: dict, name: str) -> float:
    return sum(v for _, v in samples.get(name, ()))


class Client:
    """HTTP to one server; every failure becomes a CalibrationError naming URL and probe."""

    def __init__(self, url: str, timeout_s: float) -> None:
        import aiohttp

        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._aiohttp = aiohttp
        # A connection per request: the mixed probe cancels its decoders mid-stream, and a kept-alive connection the
        # server has since closed would fail the next probe with ServerDisconnectedError (seen on real vLLM).
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                             timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0))

    async def close(self) -> None:
        await self.session.close()

    async def get(self, path: str, probe: str) -> str:
        try:
            async with self.session.get(self.url + path) as resp:
                body = await resp.text()
                if resp.status != 200:
                    raise CalibrationError(f"{self.url}{path}: probe {probe!r}: HTTP {resp.status}: {body[:200]!r}")
                return body
        except asyncio.TimeoutError:
            raise CalibrationError(f"{self.url}{path}: probe {probe!r} timed out after {self.timeout_s:g} s") from None
        except self._aiohttp.ClientError as e:
            raise CalibrationError(f"{self.url}{path}: probe {probe!r}: cannot connect ({e})") from None

    async def metrics(self, probe: str) -> dict:
        text = await self.get("/metrics", probe)
        try:
            return parse_metrics(text)
        except ValueError:
            raise CalibrationError(
                f"{self.url}/metrics: probe {probe!r}: not a vLLM server (not a Prometheus page: {text[:60]!r})"
            ) from None

    async def complete(self, model: str, prompt: str, max_tokens: int, probe: str,
                       times: list[float] | None = None) -> tuple[float, float, int, int]:
        """Stream one completion: (client TTFT, client E2E, prompt tokens, completion tokens). `times` gets the
        arrival time (perf_counter) of every chunk that carries a token, as it arrives."""
        body = {
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        first = math.nan
        usage: dict = {}
        try:
            async with self.session.post(self.url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    raise CalibrationError(
                        f"{self.url}/v1/completions: probe {probe!r}: HTTP {resp.status}: {text[:200]!r}"
                    )
                buf = b""
                async for piece in resp.content.iter_any():
                    now = time.perf_counter()
                    buf += piece
                    *events, buf = buf.split(b"\n\n")
                    for event in events:
                        payload = event.removeprefix(b"data:").strip()
                        if not payload or payload == b"[DONE]":
                            continue
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            raise CalibrationError(
                                f"{self.url}/v1/completions: probe {probe!r}: error mid-stream: {chunk['error']!r}"[:300]
                            )
                        if chunk.get("choices"):  # a token's text may be empty
                            if math.isnan(first):
                                first = now
                            if times is not None:
                                times.append(now)
                        usage = chunk.get("usage") or usage
        except asyncio.TimeoutError:
            raise CalibrationError(
                f"{self.url}/v1/completions: probe {probe!r} timed out after {self.timeout_s:g} s"
            ) from None
        except self._aiohttp.ClientError as e:
            raise CalibrationError(f"{self.url}/v1/completions: probe {probe!r}: {type(e).__name__}: {e}") from None
        end = time.perf_counter()
        return first - start, end - start, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


async def discover(client: Client, model: str | None) -> ServerInfo:
    """The server's model, context limit and KV cache; a non-vLLM server is refused here, before any load."""
    samples = await client.metrics("metrics")
    if not any(name.startswith("vllm:") for name in samples):
        raise CalibrationError(
            f"{client.url}/metrics: probe 'metrics': not a vLLM server (no vllm: metric among {len(samples)} names)"
        )
    info = samples.get("vllm:cache_config_info")
    if not info:
        raise CalibrationError(f"{client.url}/metrics: probe 'metrics': no vllm:cache_config_info (vLLM too old?)")
    labels = info[0][0]
    block_size = _int_label(client.url, labels, "block_size")
    kv_tokens = labels.get("kv_cache_size_tokens")
    kv_cache_tokens = (
        int(kv_tokens) if kv_tokens and kv_tokens.isdigit() else block_size * _int_label(client.url, labels, "num_gpu_blocks")
    )
    try:
        models = json.loads(await client.get("/v1/models", "models"))["data"]
    except (ValueError, KeyError, TypeError):
        raise CalibrationError(f"{client.url}/v1/models: probe 'models': not an OpenAI model list") from None
    ids = [m.get("id") for m in models]
    chosen = next((m for m in models if m.get("id") == model), None) if model else (models[0] if models else None)
    if chosen is None:
        raise CalibrationError(f"{client.url}/v1/models: probe 'models': model {model!r} not served (served: {ids})")
    max_len = chosen.get("max_model_len")
    if not isinstance(max_len, int) or max_len < 64:
        raise CalibrationError(f"{client.url}/v1/models: probe 'models': max_model_len {max_len!r} is not usable")
    return ServerInfo(
        url=client.url, model=str(chosen["id"]), max_model_len=max_len, block_size=block_size,
        kv_cache_tokens=kv_cache_tokens, enable_prefix_caching=labels.get("enable_prefix_caching") == "True",
        config_labels=labels,
    )


def _int_label(url: str, labels: dict[str, str], name: str) -> int:
    v = labels.get(name, "")
    if not v.isdigit() or int(v) <= 0:
        raise CalibrationError(f"{url}/metrics: probe 'metrics': vllm:cache_config_info {name}={v!r} is not a positive integer")
    return int(v)


# ---------------------------------------------------------------- the sweep


class _Text:
    """Unique prompts (no prefix-cache hits between probes, nor with an earlier sweep of the same server) of about n
    tokens, with a measured chars/token."""

    def __init__(self, seed: int = 0, nonce: str | None = None) -> None:
        self.rng = random.Random(seed)
        # A seeded sweep repeats its prompts exactly; a server with room kept a previous sweep's in its prefix cache
        # and prefilled them in ~no time (the 16-slot CPU server fitted 0-1 us per prefill token after its first
        # sweep, 13-27 us in it, while its 2 MiB twin kept 9.6 us). The nonce makes every sweep's prompts its own.
        self.nonce = nonce if nonce is not None else secrets.token_hex(4)
        # A token covers at least one character of this ASCII text, so until the first probe measures the real
        # ratio, n characters never make more than n tokens: the load stays within what was announced.
        self.chars_per_token = 1.0
        self.measured = math.nan
        self.n = 0

    def prompt(self, tokens: int) -> str:
        self.n += 1
        n_chars = max(8, int(tokens * self.chars_per_token))
        words = [f"probe{self.nonce}n{self.n}x{self.rng.randrange(10**6)}"]
        while sum(len(w) + 1 for w in words) < n_chars:
            words.append(self.rng.choice(_WORDS))
        return " ".join(words)[:n_chars]

    def learn(self, prompt: str, tokens: int) -> None:
        if tokens > 8:
            self.measured = len(prompt) / tokens
            self.chars_per_token = 0.95 * self.measured  # a margin keeps later prompts within the announced tokens


@dataclass(frozen=True)
class SweepSpec:
    """What one round of the sweep covers; rounds repeat (fresh prompts) until the fit converges or the budget ends.

    Every size is capped by the server: prefill chunks by max_num_batched_tokens and the context limit, decode
    batches by the batch limit (given, or the most requests seen running while others waited) and by
    `max_concurrency`, a decode probe's KV by `kv_share` of the server's cache."""

    prefill_tokens: tuple[int, ...] = (16, 128, 512, 2048, 8192)
    batches: tuple[int, ...] = (1, 4, 16, 64)
    contexts: tuple[int, ...] = (64, 512, 2048)  # per-sequence prompt tokens of the decode probes
    long_context_fraction: float = 0.5  # of max_model_len: one more per-sequence context where it fits
    mixed_prefill_tokens: tuple[int, ...] = (512, 2048)  # a prefill chunk inside a decoding batch
    decode_tokens: int = 48  # steady decode tokens per probe, beyond what a staggered prefill needs
    max_concurrency: int = 64
    max_num_seqs: int | None = None  # the server's batch limit when known
    max_num_batched_tokens: int = 8192
    kv_share: float = 0.5
    max_rounds: int = 3
    converged: float = 0.03  # relative change of the chosen fit's predictions between rounds that stops the sweep
    probe_timeout_s: float = 60.0
    budget_s: float = 120.0


@dataclass
class Probe:
    """One timed engine iteration shape: the row a fit sees, and how it was measured."""

    name: str
    kind: str  # prefill | decode | cached (decode over one cached prefix) | mixed
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    attn_pairs: float
    prefill_seqs: int
    seconds: float  # one iteration
    source: str  # which measurement gave `seconds`
    client_ttft_s: float = math.nan
    server_ttft_s: float = math.nan
    prefix_hit_tokens: int = 0  # prompt tokens the server's prefix cache served (not computed: not in prefill_tokens)

    def row(self) -> tuple[float, ...]:
        return (self.prefill_tokens, self.decode_seqs, self.context_tokens, self.attn_pairs, self.prefill_seqs, self.seconds)


@dataclass(frozen=True)
class Step:
    kind: str
    prompt_tokens: int
    concurrency: int
    max_tokens: int


def plan_round(spec: SweepSpec, info: ServerInfo, cap: int) -> list[Step]:
    """One round's probes, sized to the server's limits and the batch cap."""
    limit = min(info.max_model_len, info.kv_cache_tokens)
    chunk = min(spec.max_num_batched_tokens, int(limit * 0.8))
    steps = [Step("prefill", n, 1, 1) for n in sorted({min(n, chunk) for n in spec.prefill_tokens})]
    long_ctx = int(info.max_model_len * spec.long_context_fraction)
    batches = sorted({b for b in spec.batches if b < cap} | {cap})
    for b in batches:
        for ctx in sorted(set(spec.contexts) | {long_ctx}):
            # a batch whose prompts take several chunks staggers: the early ones decode while the late ones prefill,
            # so they need more tokens to still be decoding when the last one starts
            waves = math.ceil(b * ctx / spec.max_num_batched_tokens)
            out = spec.decode_tokens + 2 * waves
            if ctx + out > 0.8 * limit or b * (ctx + out) > spec.kv_share * info.kv_cache_tokens or waves > 4:
                continue
            steps.append(Step("decode", ctx, b, out))
    if info.enable_prefix_caching:
        # Long contexts at large batches without paying their prefill: the batch shares one cached prefix (each
        # sequence still reads all of its context), which separates the per-iteration overhead from the weights'
        # bandwidth in the roofline (both are constant across short-context decodes).
        for b in sorted({min(16, cap), cap}):
            for ctx in sorted({2048, long_ctx}):
                out = spec.decode_tokens
                if ctx + 16 + out <= 0.8 * limit and ctx + b * (16 + out) <= spec.kv_share * info.kv_cache_tokens:
                    steps.append(Step("cached", ctx, b, out))
    decoders = min(16, cap)
    for n in spec.mixed_prefill_tokens:
        if n + decoders <= spec.max_num_batched_tokens and n <= 0.8 * limit and decoders > 0:
            steps.append(Step("mixed", n, decoders, 1))
    return steps


def _delta(after: dict, before: dict, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram's change between two scrapes."""
    return (
        _total(after, f"{name}_sum") - _total(before, f"{name}_sum"),
        _total(after, f"{name}_count") - _total(before, f"{name}_count"),
    )


async def _watch(client: Client, name: str, stop: asyncio.Event, seen: list[tuple[float, float]]) -> None:
    """(running, waiting) every 50 ms: how many the server runs while others wait is its batch limit."""
    while not stop.is_set():
        s = await client.metrics(name)
        seen.append((_total(s, "vllm:num_requests_running"), _total(s, "vllm:num_requests_waiting")))
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except asyncio.TimeoutError:
            pass


async def _probe_prefill(client: Client, info: ServerInfo, text: _Text, tokens: int) -> Probe:
    name = f"prefill {tokens} tokens"
    before = await client.metrics(name)
    prompt = text.prompt(tokens)
    ttft, _, real_prompt, _ = await client.complete(info.model, prompt, 1, name)
    after = await client.metrics(name)
    text.learn(prompt, real_prompt)
    pre_sum, pre_n = _delta(after, before, "vllm:request_prefill_time_seconds")
    st_sum, st_n = _delta(after, before, "vllm:time_to_first_token_seconds")
    q_sum, q_n = _delta(after, before, "vllm:request_queue_time_seconds")
    server_ttft = st_sum / st_n if st_n else math.nan
    if pre_n:
        seconds, source = pre_sum / pre_n, "vllm:request_prefill_time_seconds"
    elif st_n:  # the engine's first token less its queue: without the HTTP and tokenisation in front of it
        seconds, source = server_ttft - (q_sum / q_n if q_n else 0.0), "vllm:time_to_first_token_seconds - queue"
    else:
        seconds, source = ttft, "client TTFT"
    hits = _total(after, "vllm:prefix_cache_hits_total") - _total(before, "vllm:prefix_cache_hits_total")
    hits = min(max(0, round(hits)), real_prompt - 1)
    n = real_prompt - hits
    return Probe(name, "prefill", n, 0, real_prompt, n * (hits + n / 2), 1, seconds, source, ttft, server_ttft, hits)


def _steady_window(times: list[list[float]]) -> tuple[float, float, float] | None:
    """(seconds per iteration, window start, window end) while every stream decodes: after the last first token
    (no prefill left) and up to the first last token (no one finished). None when under 4 iterations."""
    w0 = max(t[0] for t in times)
    w1 = min(t[-1] for t in times)
    per: list[float] = []
    for t in times:
        inside = [x for x in t if w0 < x <= w1]
        if len(inside) >= 4:
            per.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return (statistics.median(per), w0, w1) if len(per) == len(times) else None


async def _probe_decode(client: Client, info: ServerInfo, text: _Text, step: Step, seen: list[tuple[float, float]]) -> Probe | None:
    """`concurrency` streams at once; one iteration's time from their steady window, client-side (the server's
    inter-token histogram mixes in the staggered prefill's iterations). None when the server ran them in waves
    (over its batch limit) or the window was too short."""
    name = f"{step.kind} {step.prompt_tokens} tokens x{step.concurrency} +{step.max_tokens} out"
    if step.kind == "cached":  # one prefix for the batch, cached by a first request, and a short tail each
        prefix = text.prompt(step.prompt_tokens)
        prompts = [f"{prefix} {text.prompt(16)}" for _ in range(step.concurrency)]
        await client.complete(info.model, f"{prefix} {text.prompt(16)}", 1, name)
    else:
        prompts = [text.prompt(step.prompt_tokens) for _ in range(step.concurrency)]
    before = await client.metrics(name)
    times: list[list[float]] = [[] for _ in prompts]
    stop, here = asyncio.Event(), []
    watcher = asyncio.create_task(_watch(client, name, stop, here))
    try:
        results = await asyncio.gather(*(client.complete(info.model, p, step.max_tokens, name, t) for p, t in zip(prompts, times)))
    finally:
        stop.set()
        await watcher
        seen.extend(here)
    after = await client.metrics(name)
    for r in results:
        if r[3] != step.max_tokens:
            raise CalibrationError(
                f"{client.url}/v1/completions: probe {name!r}: asked for {step.max_tokens} tokens (ignore_eos), got {r[3]}"
            )
    ran = max((int(r) for r, _ in here), default=step.concurrency) or step.concurrency
    if ran < step.concurrency or any(len(t) < 2 for t in times):
        return None
    window = _steady_window(times)
    if window is None:
        itl_sum, itl_n = _delta(after, before, "vllm:inter_token_latency_seconds")
        if not itl_n:
            return None
        seconds, source, mid = itl_sum / itl_n, "vllm:inter_token_latency_seconds", None
    else:
        seconds, w0, w1 = window
        source, mid = "client steady decode window", (w0 + w1) / 2
    gen = [sum(1 for x in t if x <= mid) if mid is not None else step.max_tokens / 2 for t in times]
    context = sum(r[2] + g for r, g in zip(results, gen))
    return Probe(name, step.kind, 0, step.concurrency, round(context), 0.0, 0, seconds, source,
                 statistics.mean(r[0] for r in results))


async def _probe_mixed(client: Client, info: ServerInfo, text: _Text, step: Step, budget_s: float) -> Probe | None:
    """`concurrency` decoding streams, then one prompt of `prompt_tokens` joins them: the decoders' token gap that
    ends with the newcomer's first token is one iteration holding both (chunked prefill beside decodes)."""
    name = f"mixed {step.prompt_tokens} prefill + {step.concurrency} decoding"
    out = max(32, min(512, int(0.8 * min(info.max_model_len, info.kv_cache_tokens)) - 64))
    prompts = [text.prompt(64) for _ in range(step.concurrency)]
    times: list[list[float]] = [[] for _ in prompts]
    usage: list[int] = [0] * len(prompts)

    async def decoder(i: int) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            r = await client.complete(info.model, prompts[i], out, name, times[i])
            usage[i] = r[2]

    tasks = [asyncio.create_task(decoder(i)) for i in range(len(prompts))]
    try:
        deadline = time.monotonic() + budget_s
        while min(len(t) for t in times) < 8:  # every decoder in its steady phase
            if all(t.done() for t in tasks) or time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.002)
        prompt = text.prompt(step.prompt_tokens)
        own: list[float] = []
        ttft, _, real_prompt, _ = await client.complete(info.model, prompt, 1, name, own)
        if not own:
            return None
        first_at = own[0]
        # the decoders' token of the same iteration lands within a few ms of it, either side: wait for two after it
        while min(sum(x > first_at for x in t) for t in times) < 2 and not all(t.done() for t in tasks):
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.002)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    gaps, context = [], 0
    for t in times:
        k = min(range(1, len(t)), key=lambda j: abs(t[j] - first_at), default=None)
        if k is None:
            return None
        gaps.append(t[k] - t[k - 1])
        context += 64 + k  # prompt (about 64) and the tokens it has generated by then
    n = real_prompt
    return Probe(name, "mixed", n, step.concurrency, context + n, n * n / 2, 1, statistics.median(gaps),
                 "client gap around a joining prefill", ttft)


# ---------------------------------------------------------------- the command's library half


@dataclass
class Result:
    info: ServerInfo
    probes: list[Probe]
    fits: calibrate_fit.Fits
    request_overhead_s: float
    max_num_seqs: int | None
    batch_cap: int
    chars_per_token: float
    rounds: int
    stopped: str  # why the sweep ended: converged | budget | rounds
    requests: int
    duration_s: float

    @property
    def chosen(self) -> str:
        return self.fits.chosen

    @property
    def linear(self) -> costmodel.LinearCost:
        return self.fits.linear

    @property
    def roofline(self) -> costmodel.Profile | None:
        return self.fits.roofline

    @property
    def residuals(self) -> dict[str, float | None]:
        """Each form's RMS relative error on rows it was not fitted on."""
        return self.fits.held_out

    def rows(self) -> np.ndarray:
        return np.array([p.row() for p in self.probes], dtype=float)


async def _batch_cap(client: Client, info: ServerInfo, text: _Text, spec: SweepSpec, seen: list) -> tuple[int, int | None, list[Probe]]:
    """The largest batch to probe, and the server's batch limit where it showed one (`max_concurrency` streams
    at once: how many run while others wait)."""
    if spec.max_num_seqs is not None:
        return min(spec.max_num_seqs, spec.max_concurrency), spec.max_num_seqs, []
    step = Step("decode", 32, spec.max_concurrency, 32)
    here: list[tuple[float, float]] = []
    probe = await _probe_decode(client, info, text, step, here)
    seen.extend(here)
    limit = batch_limit(here, spec.max_concurrency)
    return (min(limit, spec.max_concurrency) if limit else spec.max_concurrency), limit, [probe] if probe else []


def batch_limit(seen: list[tuple[float, float]], sent: int) -> int | None:
    """The server's batch limit from (running, waiting) scrapes while `sent` requests were in flight: the most
    running, if requests waited while that many ran and it is below what was sent. Requests also wait for a moment
    as they arrive, before the next iteration admits them: a count seen with waiting requests is not a limit
    unless it is the plateau."""
    if not seen:
        return None
    top = max(int(r) for r, _ in seen)
    if top >= sent or not any(w > 0 and int(r) == top for r, w in seen):
        return None
    return top


async def _calibrate(url: str, model: str | None, spec: SweepSpec, base: costmodel.Profile | None,
                     announce: Callable[[str], None], progress: bool) -> Result:
    client = Client(url, spec.probe_timeout_s)
    t0 = time.monotonic()
    requests = 0
    try:
        info = await discover(client, model)
        text = _Text()
        seen: list[tuple[float, float]] = []
        cap, limit, probes = await _batch_cap(client, info, text, spec, seen)
        requests += 0 if spec.max_num_seqs is not None else spec.max_concurrency
        plan = plan_round(spec, info, cap)
        per_round = sum(s.concurrency + (s.kind in ("mixed", "cached")) for s in plan)
        announce(
            f"calibrate: {info.url} ({info.model}, max_model_len {info.max_model_len}, KV {info.kv_cache_tokens} tokens, "
            f"block {info.block_size}, batch limit {limit if limit else f'>= {cap}'}): rounds of {len(plan)} probes, "
            f"{per_round} requests, at most {max(s.concurrency for s in plan) + 1} at once; up to {spec.max_rounds} "
            f"rounds within {spec.budget_s:g} s, stopping when the fit changes by under {spec.converged:.0%}"
        )
        from tqdm import tqdm

        stopped, rounds = "rounds", 0
        previous: calibrate_fit.Fits | None = None
        bar = tqdm(total=len(plan) * spec.max_rounds, desc="calibrate", unit="probe", disable=not progress)
        try:
            for rounds in range(1, spec.max_rounds + 1):
                for step in plan:
                    if time.monotonic() - t0 > spec.budget_s:
                        stopped = "budget"
                        break
                    if step.kind == "prefill":
                        probe = await _probe_prefill(client, info, text, step.prompt_tokens)
                    elif step.kind in ("decode", "cached"):
                        probe = await _probe_decode(client, info, text, step, seen)
                    else:
                        probe = await _probe_mixed(client, info, text, step, spec.probe_timeout_s)
                    requests += step.concurrency + (step.kind in ("mixed", "cached"))
                    if probe is not None:
                        probes.append(probe)
                    bar.update(1)
                if stopped == "budget":
                    break
                rows = np.array([p.row() for p in probes], dtype=float)
                if len(rows) >= 4:
                    fits = calibrate_fit.fit_rows(rows, base)
                    if previous is not None and calibrate_fit.relative_change(fits.predict(rows), previous.predict(rows)) < spec.converged:
                        stopped = "converged"
                        break
                    previous = fits
        finally:
            bar.close()
    finally:
        await client.close()
    if len(probes) < 4:
        raise CalibrationError(f"{info.url}: only {len(probes)} probes timed within the budget of {spec.budget_s:g} s "
                               "(raise --budget)")
    rows = np.array([p.row() for p in probes], dtype=float)
    if not np.all(rows[:, -1] > 0):
        bad = next(p for p in probes if not p.seconds > 0)
        raise CalibrationError(f"{info.url}: probe {bad.name!r}: measured {bad.seconds!r} s, not a positive time")
    fits = calibrate_fit.fit_rows(rows, base)
    # what the API server adds around the engine at batch 1 (HTTP, tokenisation, detokenisation, streaming)
    pre = [p for p in probes if p.kind == "prefill" and math.isfinite(p.client_ttft_s)]
    overhead = max(0.0, statistics.median(p.client_ttft_s - p.seconds for p in pre)) if pre else 0.0
    return Result(
        info=info, probes=probes, fits=fits, request_overhead_s=overhead, max_num_seqs=limit, batch_cap=cap,
        chars_per_token=text.measured, rounds=rounds, stopped=stopped, requests=requests,
        duration_s=time.monotonic() - t0,
    )


def calibrate(url: str, model: str | None = None, spec: SweepSpec = SweepSpec(), base: costmodel.Profile | None = None,
              announce: Callable[[str], None] = print, progress: bool = True) -> Result:
    return asyncio.run(_calibrate(url, model, spec, base, announce, progress))


def profile_document(res: Result, name: str, max_num_seqs: int | None = None,
                     max_num_batched_tokens: int | None = None) -> dict:
    """The profile YAML document: loadable by `costmodel.load_profile(path)`, with the measurements inside."""
    info = res.info
    doc: dict = {"name": name}
    if res.chosen == "roofline" and res.roofline is not None:
        r = res.roofline
        doc.update(
            gpu={"name": r.gpu_name, "count": r.gpu_count, "peak_bf16_tflops": r.peak_flops / 1e12 / r.gpu_count,
                 "hbm_bandwidth_gbs": r.hbm_bandwidth / 1e9 / r.gpu_count, "memory_gib": r.memory_bytes / costmodel.GIB / r.gpu_count},
            model={"name": r.model_name, "params": r.params, "layers": r.layers, "hidden": r.hidden, "kv_heads": r.kv_heads,
                   "head_dim": r.head_dim, "bytes_per_param": r.bytes_per_param, "max_model_len": info.max_model_len},
            efficiency={"prefill_mfu": round(r.prefill_mfu, 5), "decode_bw_util": round(r.decode_bw_util, 5)},
            overhead_s=round(r.overhead_s, 7),
            activation_reserve_gib=r.activation_reserve_bytes / costmodel.GIB / r.gpu_count,
        )
    else:
        lin = res.linear
        doc.update(
            hardware=f"measured: vLLM at {info.url}",
            model={"name": info.model, "max_model_len": info.max_model_len},
            cost_model={"form": "linear", **{f: float(f"{getattr(lin, f):.6g}") for f in costmodel.LINEAR_FIELDS}},
        )
    doc["server"] = {
        "url": info.url,
        "block_size": info.block_size,
        "kv_cache_tokens": info.kv_cache_tokens,
        "enable_prefix_caching": info.enable_prefix_caching,
        "max_num_seqs": max_num_seqs if max_num_seqs is not None else res.max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "chars_per_token": round(res.chars_per_token, 4),
    }
    doc["request_overhead_s"] = round(res.request_overhead_s, 6)
    rnd = lambda d: {k: (None if v is None else round(v, 4)) for k, v in d.items()}  # noqa: E731
    doc["fit"] = {
        "chosen": res.chosen,
        "held_out_rms_relative_error": rnd(res.fits.held_out),
        "in_sample_rms_relative_error": rnd(res.fits.in_sample),
        "unidentified": list(res.fits.unidentified),
        "rows": len(res.probes),
    }
    doc["calibration"] = {
        "duration_s": round(res.duration_s, 1),
        "rounds": res.rounds,
        "stopped": res.stopped,
        "requests": res.requests,
        "measurements": [
            {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else (None if isinstance(v, float) else v))
             for k, v in asdict(p).items()}
            for p in res.probes
        ],
    }
    return doc


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """The file appears only complete: written to a temporary file beside it, then renamed over it."""
    out = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent if str(out.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


async def replay(url: str, model: str, requests, chars_per_token: float, timeout_s: float) -> list[tuple[float, float, int]]:
    """Each request (`SimRequest`) sent at its arrival offset; (client TTFT, client E2E, prompt tokens the server
    counted) per request."""
    client = Client(url, timeout_s)
    text = _Text()
    if math.isfinite(chars_per_token):
        text.chars_per_token = 0.95 * chars_per_token
    t0 = time.perf_counter()

    async def one(r) -> tuple[float, float, int]:
        prompt = text.prompt(r.prompt_tokens)
        await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
        ttft, e2e, prompt_tokens, _ = await client.complete(model, prompt, r.output_tokens, "validation")
        return ttft, e2e, prompt_tokens

    try:
        return list(await asyncio.gather(*(one(r) for r in requests)))
    finally:
        await client.close()


# ---------------------------------------------------------------- `fleet calibrate` (thin CLI)


def add_arguments(p) -> None:
    p.add_argument("--server", required=True, help="base URL of a running vLLM server to profile (e.g. http://127.0.0.1:8000)")
    p.add_argument("--model", help="the served model to profile (default: the first the server lists)")
    p.add_argument("--profile", help="the hardware and model shape to fit a roofline on (a name in simulator/profiles/ or a "
                                     "YAML path); with --model-config, only its GPU is used. Without either, only the "
                                     "linear form is fitted")  # fmt: skip
    p.add_argument("--model-config", help="the served model's Hugging Face config.json (its shape for the roofline)")
    p.add_argument("-o", "--output", required=True, help="where to write the measured profile YAML (written when complete)")
    p.add_argument("--name", help="name of the profile (default: one from the model and the server)")
    p.add_argument("--budget", type=float, default=120.0,
                   help="seconds the sweep may take (default 120); it stops earlier once the fit converges")
    p.add_argument("--probe-timeout", type=float, default=60.0, help="seconds one probe may take (default 60)")
    p.add_argument("--max-concurrency", type=int, default=64,
                   help="most requests sent at once; decode batches go up to it or the server's batch limit (default 64)")
    p.add_argument("--max-num-seqs", type=int, help="the server's --max-num-seqs when known (else inferred)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="the server's --max-num-batched-tokens: the largest prefill chunk probed (default 8192)")
    p.add_argument("--validate-seconds", type=float, default=20.0,
                   help="seconds of the validation replay after the fit (default 20; 0 skips it)")
    p.add_argument("--validate-load", type=float, default=0.5,
                   help="the validation's Poisson rate as a share of the fitted capacity (default 0.5)")
    p.add_argument("--max-validation-error", type=float, default=0.25,
                   help="validation error of a p50 (p99: twice this) above which the profile is written with a warning")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args) -> int:
    import sys

    import yaml

    def fail(message: str) -> int:
        print(f"fleet calibrate: error: {message}", file=sys.stderr)
        return 2

    if min(args.max_concurrency, args.max_num_batched_tokens) < 1 or args.budget <= 0 or args.probe_timeout <= 0:
        return fail("--max-concurrency, --max-num-batched-tokens, --budget and --probe-timeout must be positive")
    if args.validate_seconds < 0 or not 0 < args.validate_load <= 1:
        return fail("--validate-seconds must be >= 0 and --validate-load in (0, 1]")
    try:
        base = calibrate_fit.resolve_shape(args.profile, args.model_config)
    except ValueError as e:
        return fail(str(e))
    spec = SweepSpec(max_concurrency=args.max_concurrency, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, probe_timeout_s=args.probe_timeout,
                     budget_s=args.budget)
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    try:
        res = calibrate(args.server, args.model, spec, base, announce=say, progress=not args.quiet)
    except CalibrationError as e:
        print(f"fleet calibrate: error: {e}", file=sys.stderr)
        return 1
    name = args.name or f"measured-{res.info.model}-{args.server.split('//')[-1].replace(':', '-').strip('/')}"
    doc = profile_document(res, name, args.max_num_seqs, args.max_num_batched_tokens)
    held, roof = res.fits.held_out, res.fits.held_out["roofline"]
    lin = res.linear
    say(f"fit: {res.chosen} form ({len(res.probes)} iterations, {res.rounds} rounds, stopped: {res.stopped}); held-out "
        f"RMS relative error linear {held['linear']:.3f}, roofline {'-' if roof is None else format(roof, '.3f')}; "
        f"linear = {lin.a_s * 1e3:.2f} ms + {lin.b_s_per_prefill_token * 1e6:.1f} us/prefill token + "
        f"{lin.c_s_per_decode_seq * 1e6:.1f} us/decode seq + {lin.d_s_per_context_token * 1e9:.1f} ns/context token + "
        f"{lin.e_s_per_prefill_seq * 1e3:.2f} ms/prefill seq"
        + (f"; roofline: overhead {res.roofline.overhead_s * 1e3:.2f} ms, prefill MFU {res.roofline.prefill_mfu:.3f}, "
           f"decode bandwidth {res.roofline.decode_bw_util:.3f}" if res.roofline is not None else ""))
    if res.fits.unidentified:
        say(f"fit: not identified by this sweep: {'; '.join(res.fits.unidentified)}")
    write_atomically(args.output, yaml.safe_dump(doc, sort_keys=False))
    warning = ""
    if args.validate_seconds > 0:
        srv = doc["server"]
        server = calibrate_check.Server(max_num_seqs=srv["max_num_seqs"] or res.batch_cap,
                                        max_num_batched_tokens=args.max_num_batched_tokens, block_size=srv["block_size"],
                                        max_model_len=res.info.max_model_len)
        limit = min(res.info.max_model_len, res.info.kv_cache_tokens)
        rate, requests = calibrate_check.validation_requests(args.output, server, args.validate_load, args.validate_seconds,
                                                             prompt_median=min(600, limit / 8), output_median=min(120, limit / 16))
        try:
            measured = asyncio.run(replay(args.server, res.info.model, requests, res.chars_per_token, args.probe_timeout * 4))
            v = calibrate_check.judge(args.output, server, rate, requests, measured)
        except CalibrationError as e:
            print(f"fleet calibrate: error: validation: {e}", file=sys.stderr)
            return 1
        print(v.table())
        p50, p99 = v.worst()
        doc["validation"] = {"rate_rps": round(v.rate_rps, 3), "requests": v.requests,
                             "measured": {k: round(x, 5) for k, x in v.measured.items()},
                             "predicted": {k: round(x, 5) for k, x in v.predicted.items()}}
        if p50 > args.max_validation_error or p99 > 2 * args.max_validation_error:
            warning = (f"WARNING: validation error over the threshold (p50 {p50:.0%}, p99 {p99:.0%}; limits "
                       f"{args.max_validation_error:.0%} / {2 * args.max_validation_error:.0%}): the profile does not "
                       "predict this server well")
            doc["validation"]["warning"] = warning
        write_atomically(args.output, yaml.safe_dump(doc, sort_keys=False))
    print(f"wrote {args.output} in {res.duration_s:.0f} s: {res.chosen} cost model; request overhead "
          f"{res.request_overhead_s * 1e3:.1f} ms; KV {res.info.kv_cache_tokens} tokens; max_num_seqs "
          f"{doc['server']['max_num_seqs']}")
    if warning:
        print(f"fleet calibrate: {warning}", file=sys.stderr)
    return 0
