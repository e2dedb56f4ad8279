"""The load plan: a trace (or a Poisson process) as timed requests with synthetic prompts. No network here.

`build_plan(PlanSpec)` gives the requests `fleet.loadgen` sends: send time (the trace's scaled arrival),
prompt text whose length and shared prefix blocks follow the trace, and max_tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from routewise_vllm.router.policy.estimate import DEFAULT_CHARS_PER_TOKEN
from routewise_vllm.simulator.traces import KNOWN_TRACES, TraceLibrary, split_window, spread_in_buckets

# Short trace names of the CLI -> names in simulator/traces.py (both are accepted).
TRACE_ALIASES = {
    "azure-conv": "azure-conv",
    "azure-code": "azure-code",
    "mooncake-conv": "mooncake-conversation",
    "mooncake-synth": "mooncake-synthetic",
}
TRACE_CHOICES = sorted(set(TRACE_ALIASES) | set(TRACE_ALIASES.values()) | {"poisson"})
CHARS_PER_TOKEN = int(DEFAULT_CHARS_PER_TOKEN)

_WORDS = (
    "able acid aged also area army away baby back ball band bank base bath bear beat been beer bell belt best "
    "bill bird blow blue boat body bomb bond bone book boom born boss both bowl bulk burn bush busy call calm "
    "came camp card care case cash cast cell chat chip city club coal coat code cold come cook cool cope copy "
    "core cost crew crop dark data date dawn days dead deal dean dear debt deep deny desk dial diet disk does "
    "done door dose down draw drew drop drug dual duke dust duty each earn ease east easy edge else even ever "
    "face fact fail fair fall farm fast fate fear feed feel feet fell felt file fill film find fine fire firm"
).split()


# ---------------------------------------------------------------- prompt synthesis


def _text(rng: random.Random, n_chars: int) -> str:
    """Words separated by spaces, exactly `n_chars` characters."""
    parts: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(_WORDS)
        parts.append(w)
        size += len(w) + 1
    return " ".join(parts)[:n_chars].ljust(n_chars, ".")


class PromptSynth:
    """Prompts of an exact estimated token count; trace block ids map to fixed text blocks.

    Block id `b` always gives the same `block_tokens * 4` characters (memoised), whatever request uses it,
    so identical leading ids give identical leading text. Requests without block ids get a unique first
    block from a seeded counter.
    """

    def __init__(self, seed: int = 0, block_tokens: int = 512) -> None:
        self.seed = seed
        self.block_tokens = max(1, block_tokens)
        self._blocks: dict[int, str] = {}
        self._unique = 0

    def block_text(self, block_id: int) -> str:
        text = self._blocks.get(block_id)
        if text is None:
            text = _text(random.Random(f"{self.seed}:block:{block_id}"), self.block_tokens * CHARS_PER_TOKEN)
            self._blocks[block_id] = text
        return text

    def prompt(self, tokens: int, block_ids: tuple[int, ...] = ()) -> str:
        n_chars = max(1, tokens) * CHARS_PER_TOKEN
        if block_ids:
            parts = [self.block_text(b) for b in block_ids]
        else:
            self._unique += 1
            head = f"request {self.seed}-{self._unique}: "
            parts = [head + _text(random.Random(f"{self.seed}:unique:{self._unique}"), n_chars)]
        text = "".join(parts)[:n_chars]
        if len(text) < n_chars:  # trace has fewer block ids than tokens need: pad with request-unique text
            self._unique += 1
            text += _text(random.Random(f"{self.seed}:pad:{self._unique}"), n_chars - len(text))
        return text


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    send_s: float  # seconds after the start of the run
    prompt: str
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class PlanSpec:
    trace: str = "azure-conv"
    window: str = "train"
    start_s: float = 0.0  # offset into the window, in trace seconds
    time_scale: float = 1.0
    rate: float | None = None  # poisson: requests/s; traces: overrides time_scale to hit this mean rate
    duration_s: float = 60.0
    max_requests: int | None = None
    token_scale: float = 1.0
    max_tokens_cap: int | None = None
    max_prompt_tokens: int | None = None  # clip longer prompts (after token_scale)
    prompt_tokens: int = 256  # poisson only
    output_tokens: int = 32  # poisson only
    seed: int = 0


def canonical_trace(name: str) -> str:
    if name == "poisson" or name in KNOWN_TRACES:
        return name
    if name in TRACE_ALIASES:
        return TRACE_ALIASES[name]
    raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACE_CHOICES)}")


def build_plan(spec: PlanSpec, library: TraceLibrary | None = None) -> tuple[list[PlannedRequest], dict]:
    """The requests to send and a description of how they were derived (for the report)."""
    if spec.duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {spec.duration_s}")
    if spec.token_scale <= 0:
        raise ValueError(f"token_scale must be > 0, got {spec.token_scale}")
    trace = canonical_trace(spec.trace)
    rng = np.random.default_rng(spec.seed)
    info: dict = {"trace": trace, "token_scale": spec.token_scale, "max_tokens_cap": spec.max_tokens_cap}
    if trace == "poisson":
        rate = spec.rate if spec.rate is not None else 1.0
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        n = max(1, int(rate * spec.duration_s * 2) + 16)
        send = np.cumsum(rng.exponential(1.0 / rate, size=n))
        send = send[send < spec.duration_s]
        prompt = np.full(len(send), spec.prompt_tokens)
        output = np.full(len(send), spec.output_tokens)
        blocks: list[tuple[int, ...]] = [()] * len(send)
        block_tokens = 512
        info.update(rate_per_s=rate)
    else:
        library = library or TraceLibrary()
        full = library.load(trace)
        window = split_window(trace, spec.window)  # type: ignore[arg-type]
        if window is None:
            raise ValueError(f"trace {trace!r} has no timestamps")
        lo = window[0] + spec.start_s
        rows = full.window(lo, window[1])
        if len(rows) == 0:
            raise ValueError(f"trace {trace!r}: no requests after {lo} s in the {spec.window} window")
        raw = spread_in_buckets(rows.arrival_s, full.bucket_s, rng)  # Mooncake conversation: ~3 s buckets, seeded
        rel = raw - raw[0]
        time_scale = spec.time_scale
        if spec.rate is not None:  # choose the speed-up that gives this mean rate over the duration
            span = rel[min(len(rel) - 1, 200)] or 1.0
            native = min(len(rel) - 1, 200) / span
            time_scale = float(spec.rate / max(native, 1e-9))
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        send = rel / time_scale
        keep = send < spec.duration_s
        send = send[keep]
        prompt = rows.prompt_tokens[keep]
        output = rows.output_tokens[keep]
        blocks = list(rows.block_ids[i] for i in np.flatnonzero(keep)) if rows.block_ids else [()] * len(send)
        block_tokens = rows.block_tokens
        info.update(window=spec.window, trace_start_s=float(raw[0]), time_scale=time_scale)
    if spec.max_requests is not None:
        send, prompt, output, blocks = send[: spec.max_requests], prompt[: spec.max_requests], output[
            : spec.max_requests
        ], blocks[: spec.max_requests]
    scaled_block = max(1, round(block_tokens * spec.token_scale))
    synth = PromptSynth(seed=spec.seed, block_tokens=scaled_block)
    plan: list[PlannedRequest] = []
    for t, p, o, b in zip(send, prompt, output, blocks):
        p_tok = max(1, round(int(p) * spec.token_scale))
        if spec.max_prompt_tokens is not None:
            p_tok = min(p_tok, spec.max_prompt_tokens)
        o_tok = max(1, round(int(o) * spec.token_scale))
        if spec.max_tokens_cap is not None:
            o_tok = min(o_tok, spec.max_tokens_cap)
        plan.append(PlannedRequest(float(t), synth.prompt(p_tok, tuple(b)), p_tok, o_tok))
    info.update(requests=len(plan), block_tokens_scaled=scaled_block if any(blocks) else None)
    if plan:
        info.update(
            mean_prompt_tokens=float(np.mean([r.prompt_tokens for r in plan])),
            mean_max_tokens=float(np.mean([r.max_tokens for r in plan])),
            offered_rate_per_s=len(plan) / spec.duration_s,
        )
    return plan, info
