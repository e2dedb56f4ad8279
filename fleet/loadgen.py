"""Open-loop load generator: replays a trace (or a Poisson process) against an OpenAI-compatible endpoint.

    fleet loadgen --url http://127.0.0.1:8000 --trace azure-conv --time-scale 4 --duration 60

- Arrivals are open loop: request i is sent at its (scaled) trace time whatever happened to earlier ones.
  Traces come from `simulator/traces.py` (train window by default; `--window eval` for held-out replay).
- Prompts are synthesised with exactly the trace's token counts under the router's estimator rule
  (`TokenEstimator`: 4 characters per token), so the router and the emulator count the tokens the trace
  says. Mooncake `hash_ids` become shared text: the same block id always yields the same text block, so
  the router's text prefix hashing and a replica's prefix cache see the trace's sharing. Prompts without
  block ids start with a per-request unique block, so unrelated prompts never share a prefix by accident.
- `max_tokens` is the trace's output length (optionally capped), sent with `ignore_eos` so vLLM (and the
  emulator) generate exactly that many tokens.
- `--token-scale` shrinks prompt and output lengths (real traces are long for CPU backends); report it.
- Streaming measures TTFT (first content chunk), TPOT ((E2E - TTFT) / (tokens - 1)) and E2E per request;
  non-streaming measures E2E only. Results are grouped by the router's `x-routewise-arm` response header
  (`all` when absent).

Bounded: sending stops at `--duration` or `--max-requests`, every request has `--timeout`, and requests still
in flight `--drain-timeout` seconds after the last send are cancelled and counted as errors.

Over 400 lines on purpose: one open-loop client with two transports (aiohttp, the openai SDK), its live
progress line, the per-arm summaries and the CLI, which all share RequestResult; the plan is fleet/loadplan.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import numpy as np

from routewise_vllm.fleet.loadplan import TRACE_CHOICES, PlannedRequest, PlanSpec, build_plan

ARM_HEADER = "x-routewise-arm"
REPLICA_HEADER = "x-routewise-replica"
DEFAULT_GROUP = "all"
PERCENTILES = (50, 90, 99)


# ---------------------------------------------------------------- sending and measuring


@dataclass(slots=True)
class RequestResult:
    group: str
    ok: bool
    error: str = ""  # "" or a short kind: http_503, timeout, connection, cancelled, ...
    replica: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    sent_s: float = 0.0
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    e2e_s: float = math.nan


@dataclass(frozen=True)
class ClientSpec:
    url: str
    model: str = "tiny"
    stream: bool = True
    chat: bool = False
    timeout_s: float = 60.0
    client: str = "aiohttp"  # or "openai"
    also: tuple[str, ...] = ()  # further base URLs: requests go round-robin over url + also (router pods behind a Service)


def _body(spec: ClientSpec, req: PlannedRequest) -> dict:
    body: dict = {"model": spec.model, "max_tokens": req.max_tokens, "ignore_eos": True, "temperature": 0.0}
    if spec.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if spec.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _chunk_tokens(chunk: dict) -> int:
    """1 when a streamed chunk carries generated text (OpenAI completion or chat format), else 0."""
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return 1
    return 0


def _finish(res: RequestResult, start: float, first: float | None, end: float, tokens: int) -> None:
    res.ok = True
    res.output_tokens = tokens
    res.e2e_s = end - start
    if first is not None:
        res.ttft_s = first - start
        res.tpot_s = (end - first) / (tokens - 1) if tokens > 1 else 0.0


async def _send_aiohttp(session: aiohttp.ClientSession, spec: ClientSpec, req: PlannedRequest, res: RequestResult) -> None:
    path = "/v1/chat/completions" if spec.chat else "/v1/completions"
    start = time.perf_counter()
    async with session.post(spec.url.rstrip("/") + path, json=_body(spec, req)) as resp:
        res.group = resp.headers.get(ARM_HEADER, DEFAULT_GROUP)
        res.replica = resp.headers.get(REPLICA_HEADER, "")
        if resp.status != 200:
            await resp.read()
            res.error = f"http_{resp.status}"
            return
        if not spec.stream:
            data = await resp.json()
            tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
            _finish(res, start, None, time.perf_counter(), tokens)
            return
        first: float | None = None
        chunks = 0
        usage_tokens: int | None = None
        buf = b""
        async for piece in resp.content.iter_any():
            buf += piece
            *events, buf = buf.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    chunk = json.loads(payload)
                    if "error" in chunk and not chunk.get("choices"):
                        res.error = "stream_error"
                        return
                    n = _chunk_tokens(chunk)
                    if n and first is None:
                        first = time.perf_counter()
                    chunks += n
                    if chunk.get("usage"):
                        usage_tokens = int(chunk["usage"].get("completion_tokens") or 0)
        _finish(res, start, first, time.perf_counter(), usage_tokens if usage_tokens is not None else chunks)


async def _send_openai(client, spec: ClientSpec, req: PlannedRequest, res: RequestResult) -> None:
    """The official client: `with_streaming_response` / `with_raw_response` give the router's headers."""
    body = _body(spec, req)
    extra = {"ignore_eos": body.pop("ignore_eos")}
    api = client.chat.completions if spec.chat else client.completions
    start = time.perf_counter()
    if not spec.stream:
        raw = await api.with_raw_response.create(**body, extra_body=extra)
        res.group = raw.headers.get(ARM_HEADER, DEFAULT_GROUP)
        res.replica = raw.headers.get(REPLICA_HEADER, "")
        parsed = raw.parse()
        _finish(res, start, None, time.perf_counter(), parsed.usage.completion_tokens if parsed.usage else 0)
        return
    first: float | None = None
    chunks = 0
    usage_tokens: int | None = None
    async with api.with_streaming_response.create(**body, extra_body=extra) as resp:
        res.group = resp.headers.get(ARM_HEADER, DEFAULT_GROUP)
        res.replica = resp.headers.get(REPLICA_HEADER, "")
        stream = await resp.parse()
        async for chunk in stream:
            n = _chunk_tokens(chunk.model_dump())
            if n and first is None:
                first = time.perf_counter()
            chunks += n
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
    _finish(res, start, first, time.perf_counter(), usage_tokens if usage_tokens is not None else chunks)


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    if isinstance(exc, aiohttp.ClientConnectionError):
        return "connection"
    name = type(exc).__name__
    if name == "APIStatusError" or hasattr(exc, "status_code"):
        return f"http_{getattr(exc, 'status_code', 'error')}"
    if "Timeout" in name:
        return "timeout"
    if "Connection" in name:
        return "connection"
    return name


class Progress:
    """Live counts and the running p99 TTFT, on a tqdm bar (stderr) when enabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.sent = self.done = self.errors = 0
        self.ttfts: list[float] = []
        self._bar = None
        self._last = 0.0
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="req", desc="loadgen", file=sys.stderr, dynamic_ncols=True,
                              mininterval=0.1 if sys.stderr.isatty() else 5.0)  # a log file gets a line every 5 s

    def on_sent(self) -> None:
        self.sent += 1
        self._refresh()

    def on_done(self, res: RequestResult) -> None:
        self.done += 1
        if not res.ok:
            self.errors += 1
        elif not math.isnan(res.ttft_s):
            self.ttfts.append(res.ttft_s)
        if self._bar is not None:
            self._bar.update(1)
        self._refresh()

    def _refresh(self, force: bool = False) -> None:
        if self._bar is None:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.5:
            return
        self._last = now
        p99 = f"{np.percentile(self.ttfts, 99) * 1000:.0f}ms" if self.ttfts else "-"
        self._bar.set_postfix_str(f"sent={self.sent} done={self.done} err={self.errors} p99_ttft={p99}")

    def close(self) -> None:
        if self._bar is not None:
            self._refresh(force=True)
            self._bar.close()


async def run_load(
    plan: list[PlannedRequest], spec: ClientSpec, progress: bool = True, drain_timeout_s: float | None = None
) -> tuple[list[RequestResult], float]:
    """Send the plan open loop; returns one result per planned request and the wall time of the run."""
    drain = spec.timeout_s if drain_timeout_s is None else drain_timeout_s
    bar = Progress(len(plan), progress)
    results: list[RequestResult] = []
    tasks: list[asyncio.Task] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s, sock_connect=5.0)
    session = aiohttp.ClientSession(connector=connector, timeout=timeout)
    oai = None
    if spec.client == "openai":
        from openai import AsyncOpenAI

        oai = AsyncOpenAI(base_url=spec.url.rstrip("/") + "/v1", api_key="unused", timeout=spec.timeout_s, max_retries=0)
    elif spec.client != "aiohttp":
        raise ValueError(f"client must be 'aiohttp' or 'openai', got {spec.client!r}")
    if spec.also and oai is not None:
        raise ValueError("several URLs need the aiohttp client")
    specs = [spec] + [dataclasses.replace(spec, url=u) for u in spec.also]

    async def one(req: PlannedRequest, res: RequestResult, target: ClientSpec) -> None:
        try:
            if oai is not None:
                await asyncio.wait_for(_send_openai(oai, spec, req, res), spec.timeout_s)
            else:
                await _send_aiohttp(session, target, req, res)
        except BaseException as exc:  # noqa: BLE001 - every failure is a counted result
            res.ok, res.error = False, _error_kind(exc)
            if isinstance(exc, asyncio.CancelledError):
                bar.on_done(res)
                raise
        bar.on_done(res)

    t0 = time.perf_counter()
    try:
        for req in plan:
            delay = t0 + req.send_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            res = RequestResult(group=DEFAULT_GROUP, ok=False, prompt_tokens=req.prompt_tokens, sent_s=req.send_s)
            results.append(res)
            tasks.append(asyncio.create_task(one(req, res, specs[len(tasks) % len(specs)])))
            bar.on_sent()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
        await session.close()
        if oai is not None:
            await oai.close()
    return results, time.perf_counter() - t0


# ---------------------------------------------------------------- summaries


def _pcts(values: list[float]) -> dict[str, float | None]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return {f"p{p}": None for p in PERCENTILES}
    arr = np.percentile(vals, PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, arr)}


def summarize(results: list[RequestResult]) -> dict[str, dict]:
    """Per group: counts, error kinds, and p50/p90/p99 of TTFT, TPOT and E2E (seconds; None = no sample)."""
    groups: dict[str, list[RequestResult]] = {}
    for r in results:
        groups.setdefault(r.group, []).append(r)
    out: dict[str, dict] = {}
    for name in sorted(groups):
        rs = groups[name]
        ok = [r for r in rs if r.ok]
        out[name] = {
            "requests": len(rs),
            "ok": len(ok),
            "errors": len(rs) - len(ok),
            "error_kinds": dict(Counter(r.error for r in rs if not r.ok)),
            "replicas": dict(Counter(r.replica for r in ok if r.replica)),
            "ttft_s": _pcts([r.ttft_s for r in ok]),
            "tpot_s": _pcts([r.tpot_s for r in ok]),
            "e2e_s": _pcts([r.e2e_s for r in ok]),
        }
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}" if v >= 0.1 else f"{v * 1000:.1f}"


def format_table(summary: dict[str, dict]) -> str:
    """One row per group: counts, then p50/p90/p99 of TTFT, TPOT and E2E in milliseconds."""
    head = ["group", "ok", "err"] + [f"{m} p{p}" for m in ("TTFT", "TPOT", "E2E") for p in PERCENTILES]
    rows = [head]
    for name, s in summary.items():
        row = [name, str(s["ok"]), str(s["errors"])]
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            row += [_ms(s[key][f"p{p}"]) for p in PERCENTILES]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    errs = {n: s["error_kinds"] for n, s in summary.items() if s["error_kinds"]}
    if errs:
        lines.append("errors: " + "; ".join(f"{n}: {k}" for n, k in errs.items()))
    return "\n".join(lines) + "\n(latencies in ms)"


def format_side_by_side(summary: dict[str, dict], groups: list[str] | None = None) -> str:
    """Metrics as rows, groups (A/B arms) as columns: TTFT and E2E percentiles in milliseconds."""
    groups = groups or list(summary)
    rows = [["metric"] + groups]
    rows.append(["requests ok/err"] + [f"{summary[g]['ok']}/{summary[g]['errors']}" if g in summary else "-" for g in groups])
    for key, label in (("ttft_s", "TTFT"), ("e2e_s", "E2E"), ("tpot_s", "TPOT")):
        for p in PERCENTILES:
            rows.append(
                [f"{label} p{p} (ms)"] + [_ms(summary[g][key][f"p{p}"]) if g in summary else "-" for g in groups]
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", action="append", default=None,
                   help="base URL of the router or vLLM server (default http://127.0.0.1:8000); repeat it to spread "
                        "requests round-robin over several routers")
    p.add_argument("--trace", default="azure-conv", choices=TRACE_CHOICES, help="trace to replay, or 'poisson'")
    p.add_argument("--window", default="train", choices=["train", "eval"], help="trace window (simulator/data/traces/README.md: train/eval)")
    p.add_argument("--start", type=float, default=0.0, help="offset into the window, trace seconds")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace speed-up: arrival times are divided by it")
    p.add_argument("--rate", type=float, default=None, help="poisson: req/s; trace: pick the time scale for this mean rate")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of sending (wall clock)")
    p.add_argument("--max-requests", type=int, default=None, help="stop after this many requests")
    p.add_argument("--token-scale", type=float, default=1.0, help="multiply prompt and output lengths (e.g. 0.05 for CPU)")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="cap max_tokens (output length)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="clip prompts to this many tokens (after scaling)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="poisson: prompt length in tokens")
    p.add_argument("--output-tokens", type=int, default=32, help="poisson: output length in tokens")
    p.add_argument("--model", default="tiny", help="model name sent in requests")
    stream = p.add_mutually_exclusive_group()
    stream.add_argument("--stream", dest="stream", action="store_true", default=True, help="stream (default; gives TTFT)")
    stream.add_argument("--no-stream", dest="stream", action="store_false", help="non-streaming (E2E only)")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions instead of /v1/completions")
    p.add_argument("--client", default="aiohttp", choices=["aiohttp", "openai"], help="HTTP client (openai = official SDK)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, seconds")
    p.add_argument("--drain-timeout", type=float, default=None, help="wait for in-flight requests after the last send")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the summary and per-request results here")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")


def spec_from_args(args: argparse.Namespace) -> tuple[PlanSpec, ClientSpec]:
    plan = PlanSpec(
        trace=args.trace,
        window=args.window,
        start_s=args.start,
        time_scale=args.time_scale,
        rate=args.rate,
        duration_s=args.duration,
        max_requests=args.max_requests,
        token_scale=args.token_scale,
        max_tokens_cap=args.max_tokens_cap,
        max_prompt_tokens=args.max_prompt_tokens,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        seed=args.seed,
    )
    urls = args.url or ["http://127.0.0.1:8000"]
    client = ClientSpec(url=urls[0], also=tuple(urls[1:]), model=args.model, stream=args.stream, chat=args.chat,
                        timeout_s=args.timeout, client=args.client)
    return plan, client


def main(args: argparse.Namespace) -> int:
    plan_spec, client = spec_from_args(args)
    plan, info = build_plan(plan_spec)
    print(
        f"loadgen: {info['requests']} requests over {plan_spec.duration_s:.0f} s from {info['trace']}"
        + (f" ({info.get('window')} window, time scale {info['time_scale']:.2f})" if "time_scale" in info else "")
        + f", token scale {plan_spec.token_scale}"
        + (f", max_tokens cap {plan_spec.max_tokens_cap}" if plan_spec.max_tokens_cap else "")
        + f" -> {', '.join((client.url, *client.also))}",
        file=sys.stderr,
    )
    if not plan:
        print("loadgen: nothing to send", file=sys.stderr)
        return 1
    results, wall = asyncio.run(run_load(plan, client, progress=not args.no_progress, drain_timeout_s=args.drain_timeout))
    summary = summarize(results)
    print(format_table(summary))
    if args.json:
        for r in results:  # NaN is not JSON
            for k in ("ttft_s", "tpot_s", "e2e_s"):
                if math.isnan(getattr(r, k)):
                    setattr(r, k, None)  # type: ignore[arg-type]
        args.json.write_text(
            json.dumps({"plan": info, "wall_s": wall, "summary": summary, "requests": [asdict(r) for r in results]}, indent=1)
        )
    return 0 if all(r.ok for r in results) else 2


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fleet loadgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return main(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(cli())
