"""Profile a running vLLM server from outside and fit a simulator profile to it (`fleet calibrate --server`).

The sweep is bounded and announced before it starts: prefill at batch 1 over prompt lengths, decode at
several concurrencies, one long-context point. Every probe is timed client-side and, from the server's own
/metrics histograms (deltas around the probe), server-side: prefill time, inter-token latency, queue time.
`vllm:cache_config_info` gives the block size and KV capacity; `max_num_seqs` is the most requests seen
running while others waited (or `--max-num-seqs`).

Rows (prefill tokens, decode sequences, context tokens, seconds) are fitted two ways: the measured linear
form of `costmodel.LinearCost` always, and the roofline (`costmodel.fit`) when a base profile describing the
hardware is given; the smaller relative RMS residual wins. The profile file appears only when complete.

Over 400 lines on purpose: the sweep, its /metrics deltas, the two fits and the profile document share one
measurement record; the thin `fleet calibrate` CLI sits at the end.
"""

from __future__ import annotations

import asyncio
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

from simulator import costmodel

_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu north south east west river stone cloud light"
).split()


class CalibrationError(Exception):
    """One line naming the URL, the probe and the value that was wrong."""


@dataclass(frozen=True)
class SweepSpec:
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 384, 512, 768)
    repeats: int = 2
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_prompt_tokens: int = 32
    decode_tokens: int = 64
    long_context_fraction: float = 0.75  # of max_model_len, for the long-context decode point
    probe_timeout_s: float = 30.0
    budget_s: float = 150.0


@dataclass
class Probe:
    name: str
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    seconds: float  # one iteration, server-side when the server exposes it
    source: str  # which measurement gave `seconds`
    client_ttft_s: float = math.nan
    server_ttft_s: float = math.nan
    prefix_hit_tokens: int = 0  # prompt tokens the server's prefix cache served (not computed: not in prefill_tokens)


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
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0))

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

    async def complete(self, model: str, prompt: str, max_tokens: int, probe: str) -> tuple[float, float, int, int]:
        """Stream one completion: (client TTFT, client E2E, prompt tokens, completion tokens)."""
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
                        if math.isnan(first) and chunk.get("choices"):  # a token's text may be empty
                            first = time.perf_counter()
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


@dataclass
class Plan:
    probes: list[tuple[str, int, int, int]]  # (kind, prompt tokens, concurrency, max_tokens)

    @property
    def requests(self) -> int:
        return sum(c for _, _, c, _ in self.probes)

    @property
    def max_concurrency(self) -> int:
        return max(c for _, _, c, _ in self.probes)

    @property
    def tokens(self) -> int:
        return sum(c * (p + o) for _, p, c, o in self.probes)


def plan_sweep(spec: SweepSpec, info: ServerInfo) -> Plan:
    """Every probe of the sweep, sized to the server's context and KV limits (the announced load)."""
    limit = min(info.max_model_len, info.kv_cache_tokens)
    probes: list[tuple[str, int, int, int]] = []
    # a prompt a little under the limit: real tokenisation may differ from the estimate by a few tokens
    lengths = sorted({min(n, int(limit * 0.8)) for n in spec.prefill_tokens})
    probes += [("prefill", n, 1, 1) for n in lengths for _ in range(spec.repeats)]
    per_seq = spec.decode_prompt_tokens + spec.decode_tokens
    for c in spec.concurrencies:
        probes.append(("decode", spec.decode_prompt_tokens, c, spec.decode_tokens))
    long_prompt = int(limit * spec.long_context_fraction) - spec.decode_tokens
    if long_prompt > 4 * per_seq:
        probes.append(("long", long_prompt, 1, spec.decode_tokens))
    return Plan(probes)


def _delta(after: dict, before: dict, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram's change between two scrapes."""
    return (
        _total(after, f"{name}_sum") - _total(before, f"{name}_sum"),
        _total(after, f"{name}_count") - _total(before, f"{name}_count"),
    )


async def _probe(client: Client, info: ServerInfo, text: _Text, kind: str, prompt_tokens: int, conc: int, out_tokens: int,
                 running_seen: list[tuple[float, float]]) -> Probe:
    name = f"{kind} {prompt_tokens} tokens x{conc}" + (f" +{out_tokens} out" if out_tokens > 1 else "")
    before = await client.metrics(name)
    prompts = [text.prompt(prompt_tokens) for _ in range(conc)]
    stop = asyncio.Event()
    seen_here: list[tuple[float, float]] = []

    async def watch() -> None:  # how many run while others wait: the server's max_num_seqs
        while not stop.is_set():
            s = await client.metrics(name)
            seen_here.append((_total(s, "vllm:num_requests_running"), _total(s, "vllm:num_requests_waiting")))
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except asyncio.TimeoutError:
                pass

    watcher = asyncio.create_task(watch()) if conc > 1 else None
    try:
        results = await asyncio.gather(*(client.complete(info.model, p, out_tokens, name) for p in prompts))
    finally:
        stop.set()
        if watcher is not None:
            await watcher
        running_seen.extend(seen_here)
    after = await client.metrics(name)
    real_prompt = statistics.mean(r[2] for r in results)
    if kind == "prefill":
        text.learn(prompts[0], results[0][2])
    for r in results:
        if r[3] != out_tokens:
            raise CalibrationError(
                f"{client.url}/v1/completions: probe {name!r}: asked for {out_tokens} tokens (ignore_eos), got {r[3]}"
            )
    client_ttft = statistics.mean(r[0] for r in results)
    pre_sum, pre_n = _delta(after, before, "vllm:request_prefill_time_seconds")
    st_sum, st_n = _delta(after, before, "vllm:time_to_first_token_seconds")
    itl_sum, itl_n = _delta(after, before, "vllm:inter_token_latency_seconds")
    server_ttft = st_sum / st_n if st_n else math.nan
    if kind == "prefill":
        seconds, source = (pre_sum / pre_n, "vllm:request_prefill_time_seconds") if pre_n else (client_ttft, "client TTFT")
        hits = round((_total(after, "vllm:prefix_cache_hits_total") - _total(before, "vllm:prefix_cache_hits_total")) / conc)
        hits = min(max(0, hits), round(real_prompt) - 1)
        return Probe(name, round(real_prompt) - hits, 0, round(real_prompt), seconds, source, client_ttft, server_ttft, hits)
    if itl_n:
        seconds, source = itl_sum / itl_n, "vllm:inter_token_latency_seconds"
    else:
        seconds = statistics.mean((r[1] - r[0]) / max(1, out_tokens - 1) for r in results)
        source = "client TPOT"
    # The batch the engine ran: a server capped below `conc` (max_num_seqs) runs the probe in waves of its cap, and
    # fitting the time per token at `conc` would price each sequence at a fraction of its cost.
    batch = min(conc, max((int(r) for r, _ in seen_here), default=conc) or conc)
    context = batch * (real_prompt + out_tokens / 2)
    return Probe(name, 0, batch, round(context), seconds, source, client_ttft, server_ttft)


# ---------------------------------------------------------------- fitting


def fit_linear(rows: np.ndarray) -> tuple[costmodel.LinearCost, float]:
    """Non-negative least squares of LinearCost on relative errors (each row with a prefill is one prefill
    sequence: the sweep prefills at batch 1); (fit, RMS relative residual)."""
    t = rows[:, 3]
    design = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1], rows[:, 2], (rows[:, 0] > 0).astype(float)])
    scale = np.maximum(design.max(axis=0), 1e-12)
    w = 1.0 / np.maximum(t, 1e-9)
    a, y = design / scale * w[:, None], t * w
    keep = [j for j in range(5) if np.any(design[:, j] > 0)]
    coef = np.zeros(5)
    while keep:  # drop a term that fits negative and refit (a cost is never negative)
        sol, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if np.all(sol >= 0):
            coef[keep] = sol / scale[keep]
            break
        keep.pop(int(np.argmin(sol)))
    lin = costmodel.LinearCost(*(float(c) for c in coef))
    pred = np.array([lin.iteration_time(*r[:3], int(r[0] > 0)) for r in rows])
    return lin, _rms_rel(pred, t)


def _rms_rel(pred: np.ndarray, t: np.ndarray) -> float:
    return float(np.sqrt(np.mean(((pred - t) / t) ** 2)))


def fit_roofline(base: costmodel.Profile, rows: np.ndarray) -> tuple[costmodel.Profile, float]:
    fitted = costmodel.fit(base, rows)
    pred = np.array([fitted.iteration_time(*r[:3]) for r in rows])
    return fitted, _rms_rel(pred, rows[:, 3])


# ---------------------------------------------------------------- the command's library half


@dataclass
class Result:
    info: ServerInfo
    probes: list[Probe]
    linear: costmodel.LinearCost
    residuals: dict[str, float | None]
    chosen: str
    roofline: costmodel.Profile | None
    request_overhead_s: float
    max_num_seqs: int | None
    chars_per_token: float
    plan: Plan
    duration_s: float


async def _calibrate(url: str, model: str | None, spec: SweepSpec, base: costmodel.Profile | None,
                     announce: Callable[[str], None], progress: bool) -> Result:
    client = Client(url, spec.probe_timeout_s)
    t0 = time.monotonic()
    try:
        info = await discover(client, model)
        plan = plan_sweep(spec, info)
        announce(
            f"calibrate: {info.url} ({info.model}, max_model_len {info.max_model_len}, KV {info.kv_cache_tokens} tokens, "
            f"block {info.block_size}): {len(plan.probes)} probes, {plan.requests} requests, at most "
            f"{plan.max_concurrency} at once, at most {plan.tokens} tokens in all (+ /metrics scrapes, every 50 ms "
            f"during concurrent probes), budget {spec.budget_s:g} s"
        )
        from tqdm import tqdm

        text = _Text()
        seen: list[tuple[float, float]] = []
        probes: list[Probe] = []
        bar = tqdm(total=len(plan.probes), desc="calibrate", unit="probe", disable=not progress)
        try:
            for kind, p, c, o in plan.probes:
                if time.monotonic() - t0 > spec.budget_s:
                    raise CalibrationError(
                        f"{info.url}: sweep over its budget of {spec.budget_s:g} s after {len(probes)} of "
                        f"{len(plan.probes)} probes (raise --budget or shrink the sweep)"
                    )
                probes.append(await _probe(client, info, text, kind, p, c, o, seen))
                bar.update(1)
        finally:
            bar.close()
    finally:
        await client.close()
    rows = np.array([(p.prefill_tokens, p.decode_seqs, p.context_tokens, p.seconds) for p in probes], dtype=float)
    if not np.all(rows[:, 3] > 0):
        bad = next(p for p in probes if not p.seconds > 0)
        raise CalibrationError(f"{info.url}: probe {bad.name!r}: measured {bad.seconds!r} s, not a positive time")
    linear, lin_res = fit_linear(rows)
    residuals: dict[str, float | None] = {"linear": lin_res, "roofline": None}
    roof = None
    if base is not None:
        roof, residuals["roofline"] = fit_roofline(base, rows)
    chosen = "roofline" if roof is not None and residuals["roofline"] < lin_res else "linear"  # type: ignore[operator]
    # what the API server adds around the engine at batch 1 (HTTP, tokenisation, detokenisation, streaming)
    pre = [p for p in probes if p.decode_seqs == 0]
    overhead = max(0.0, statistics.median(p.client_ttft_s - p.seconds for p in pre))
    waited = [r for r, w in seen if w > 0]
    return Result(
        info=info, probes=probes, linear=linear, residuals=residuals, chosen=chosen, roofline=roof,
        request_overhead_s=overhead, max_num_seqs=int(max(waited)) if waited else None,
        chars_per_token=text.measured, plan=plan, duration_s=time.monotonic() - t0,
    )


def calibrate(url: str, model: str | None = None, spec: SweepSpec = SweepSpec(), base: costmodel.Profile | None = None,
              announce: Callable[[str], None] = print, progress: bool = True) -> Result:
    return asyncio.run(_calibrate(url, model, spec, base, announce, progress))


def profile_document(res: Result, name: str, max_num_seqs: int | None = None) -> dict:
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
        "chars_per_token": round(res.chars_per_token, 4),
    }
    doc["request_overhead_s"] = round(res.request_overhead_s, 6)
    doc["fit"] = {
        "chosen": res.chosen,
        "rms_relative_residual": {k: (None if v is None else round(v, 4)) for k, v in res.residuals.items()},
        "rows": len(res.probes),
    }
    doc["calibration"] = {
        "duration_s": round(res.duration_s, 1),
        "load": {"requests": res.plan.requests, "max_concurrency": res.plan.max_concurrency, "tokens": res.plan.tokens},
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


# ---------------------------------------------------------------- `fleet calibrate` (thin CLI)


def add_arguments(p) -> None:
    p.add_argument("--server", required=True, help="base URL of a running vLLM server to profile (e.g. http://127.0.0.1:8000)")
    p.add_argument("--model", help="the served model to profile (default: the first the server lists)")
    p.add_argument("--profile", help="also fit this roofline profile (a name in simulator/profiles/ or a YAML path); "
                                     "it wins if its residual is smaller")  # fmt: skip
    p.add_argument("-o", "--output", required=True, help="where to write the measured profile YAML (written when complete)")
    p.add_argument("--name", help="name of the profile (default: one from the model and the server)")
    p.add_argument("--budget", type=float, default=150.0, help="seconds the sweep may take (default 150)")
    p.add_argument("--probe-timeout", type=float, default=30.0, help="seconds one probe may take (default 30)")
    p.add_argument("--max-concurrency", type=int, default=16, help="most requests sent at once (default 16)")
    p.add_argument("--max-num-seqs", type=int, help="the server's --max-num-seqs when known (else inferred)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args) -> int:
    import sys

    import yaml

    def fail(message: str) -> int:
        print(f"fleet calibrate: error: {message}", file=sys.stderr)
        return 2

    if args.max_concurrency < 1 or args.budget <= 0 or args.probe_timeout <= 0:
        return fail("--max-concurrency, --budget and --probe-timeout must be positive")
    base = None
    if args.profile:
        try:
            base = costmodel.load_profile(args.profile)
        except ValueError as e:
            return fail(str(e))
    default = SweepSpec()
    spec = SweepSpec(
        concurrencies=tuple(c for c in default.concurrencies if c < args.max_concurrency) + (args.max_concurrency,),
        probe_timeout_s=args.probe_timeout,
        budget_s=args.budget,
    )
    try:
        res = calibrate(args.server, args.model, spec, base, announce=lambda m: print(m, file=sys.stderr),
                        progress=not args.quiet)  # fmt: skip
    except CalibrationError as e:
        print(f"fleet calibrate: error: {e}", file=sys.stderr)
        return 1
    name = args.name or f"measured-{res.info.model}-{args.server.split('//')[-1].replace(':', '-').strip('/')}"
    doc = profile_document(res, name, args.max_num_seqs)
    write_atomically(args.output, yaml.safe_dump(doc, sort_keys=False))
    lin = res.linear
    roofline = res.residuals["roofline"]
    print(
        f"wrote {args.output} in {res.duration_s:.0f} s: {res.chosen} cost model (RMS relative residual "
        f"linear {res.residuals['linear']:.3f}, roofline {'-' if roofline is None else format(roofline, '.3f')}); "
        f"iteration = {lin.a_s * 1e3:.2f} ms + {lin.b_s_per_prefill_token * 1e6:.1f} us/prefill token + "
        f"{lin.c_s_per_decode_seq * 1e6:.1f} us/decode seq + {lin.d_s_per_context_token * 1e9:.1f} ns/context token + "
        f"{lin.e_s_per_prefill_seq * 1e3:.2f} ms/prefill seq; "
        f"request overhead {res.request_overhead_s * 1e3:.1f} ms; KV {res.info.kv_cache_tokens} tokens; "
        f"max_num_seqs {doc['server']['max_num_seqs']}"
    )
    return 0
