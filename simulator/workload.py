"""Workloads: validated specs that build a deterministic `list[SimRequest]` from one seeded generator.

Three kinds (the `kind` field of a scenario's `workload:`):
- `synthetic`: an arrival process (Poisson, Gamma renewal with a burst CV, diurnal sinusoid, on/off MMPP),
  a length distribution (fixed, log-normal, or sampled from a trace's empirical pairs) and optional shared
  prefixes (system-prompt groups or multi-turn sessions).
- `adversarial`: several tenants under a sinusoidal load, plus one tenant that sends unannounced bursts of
  mega-prompts.
- `trace`: replay of a known trace (see `simulator/traces.py`) inside the split's window, sped up by `time_scale`.

The load level is `time_scale`: synthetic rates are multiplied by it, trace arrival times divided by it.
Every random draw comes from the `np.random.Generator` passed to `build`, so a seed fixes the workload.

Over 400 lines on purpose: the three workload kinds' pydantic schemas and their builders share the validators
and the seeded generator's draw order (which the golden digests pin), so they stay in one module.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from routewise_vllm.simulator.traces import (
    KNOWN_TRACES,
    WARMUP_S,
    WARMUP_TENANT,
    Split,
    TraceLibrary,
    needs_warmup,
    split_window,
    spread_in_buckets,
)
from routewise_vllm.simulator.replay import DecisionLogWorkload
from routewise_vllm.simulator.types import SimRequest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- arrival processes (times from 0)


def poisson_arrivals(rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def gamma_arrivals(rng: np.random.Generator, rate: float, cv: float, n: int) -> np.ndarray:
    """Renewal process with Gamma inter-arrivals of mean 1/rate and coefficient of variation `cv`."""
    shape = 1.0 / (cv * cv)
    return np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=n))


def diurnal_arrivals(
    rng: np.random.Generator, rate: float, amplitude: float, period_s: float, n: int, phase: float = 0.0
) -> np.ndarray:
    """Inhomogeneous Poisson with rate(t) = rate * (1 + amplitude * sin(2 pi t / period + phase)), by thinning."""
    peak = rate * (1.0 + amplitude)
    out = np.empty(0)
    t0 = 0.0
    while len(out) < n:
        batch = max(64, 2 * (n - len(out)))
        cand = t0 + np.cumsum(rng.exponential(1.0 / peak, size=batch))
        t0 = float(cand[-1])
        accept = rng.uniform(size=batch) * peak < rate * (1.0 + amplitude * np.sin(2 * np.pi * cand / period_s + phase))
        out = np.concatenate([out, cand[accept]])
    return out[:n]


def onoff_arrivals(
    rng: np.random.Generator, rate: float, mean_on_s: float, mean_off_s: float, off_rate_fraction: float, n: int
) -> np.ndarray:
    """Two-state MMPP: exponential on/off sojourns; the off rate is `off_rate_fraction` of the on rate,
    and the on rate is set so the long-run mean rate is `rate`. Starts in the on state."""
    on_rate = rate * (mean_on_s + mean_off_s) / (mean_on_s + off_rate_fraction * mean_off_s)
    out: list[np.ndarray] = []
    count, t, on = 0, 0.0, True
    while count < n:
        length = rng.exponential(mean_on_s if on else mean_off_s)
        r = on_rate if on else on_rate * off_rate_fraction
        if r > 0:
            k = rng.poisson(r * length)
            times = np.sort(t + rng.uniform(0.0, length, size=k))
            out.append(times)
            count += k
        t += length
        on = not on
    return np.concatenate(out)[:n]


class PoissonSpec(_Strict):
    process: Literal["poisson"] = "poisson"

    def sample(self, rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
        return poisson_arrivals(rng, rate, n)


class GammaSpec(_Strict):
    process: Literal["gamma"]
    cv: float = Field(gt=0, description="coefficient of variation of inter-arrival times (1 = Poisson)")

    def sample(self, rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
        return gamma_arrivals(rng, rate, self.cv, n)


class DiurnalSpec(_Strict):
    process: Literal["diurnal"]
    amplitude: float = Field(0.5, ge=0, le=1)
    period_s: float = Field(gt=0, description="period of the sinusoid in simulated seconds")
    phase: float = 0.0

    def sample(self, rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
        return diurnal_arrivals(rng, rate, self.amplitude, self.period_s, n, self.phase)


class OnOffSpec(_Strict):
    process: Literal["onoff"]
    mean_on_s: float = Field(gt=0)
    mean_off_s: float = Field(gt=0)
    off_rate_fraction: float = Field(0.0, ge=0, lt=1)

    def sample(self, rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
        return onoff_arrivals(rng, rate, self.mean_on_s, self.mean_off_s, self.off_rate_fraction, n)


ArrivalSpec = Annotated[Union[PoissonSpec, GammaSpec, DiurnalSpec, OnOffSpec], Field(discriminator="process")]


# ---------------------------------------------------------------- lengths


class FixedLengths(_Strict):
    dist: Literal["fixed"]
    prompt: int = Field(ge=1)
    output: int = Field(ge=1)

    def sample(self, rng: np.random.Generator, n: int, split: Split, library: TraceLibrary) -> tuple[np.ndarray, np.ndarray]:
        return np.full(n, self.prompt, dtype=np.int64), np.full(n, self.output, dtype=np.int64)


class LognormalLengths(_Strict):
    """Log-normal prompt and output lengths given by median and sigma of log; clipped to [1, max]."""

    dist: Literal["lognormal"]
    prompt_median: float = Field(gt=0)
    prompt_sigma: float = Field(ge=0)
    output_median: float = Field(gt=0)
    output_sigma: float = Field(ge=0)
    max_prompt: int = Field(32768, ge=1)
    max_output: int = Field(4096, ge=1)

    def sample(self, rng: np.random.Generator, n: int, split: Split, library: TraceLibrary) -> tuple[np.ndarray, np.ndarray]:
        p = rng.lognormal(math.log(self.prompt_median), self.prompt_sigma, size=n)
        o = rng.lognormal(math.log(self.output_median), self.output_sigma, size=n)
        return (
            np.clip(np.rint(p), 1, self.max_prompt).astype(np.int64),
            np.clip(np.rint(o), 1, self.max_output).astype(np.int64),
        )


class TraceLengths(_Strict):
    """(prompt, output) pairs drawn with replacement from a trace's rows in the split (joint, not marginal)."""

    dist: Literal["trace"]
    trace: str
    max_prompt: int | None = Field(None, ge=1, description="clip prompts (None = as in the trace)")

    def sample(self, rng: np.random.Generator, n: int, split: Split, library: TraceLibrary) -> tuple[np.ndarray, np.ndarray]:
        rows = library.split(self.trace, split)
        idx = rng.integers(len(rows), size=n)
        p = rows.prompt_tokens[idx]
        if self.max_prompt is not None:
            p = np.minimum(p, self.max_prompt)
        return p.copy(), rows.output_tokens[idx].copy()


LengthSpec = Annotated[Union[FixedLengths, LognormalLengths, TraceLengths], Field(discriminator="dist")]


# ---------------------------------------------------------------- shared prefixes


class _IdAllocator:
    """Fresh block ids (content that nothing else shares)."""

    def __init__(self, start: int = 0) -> None:
        self.next = start

    def take(self, k: int) -> tuple[int, ...]:
        ids = tuple(range(self.next, self.next + k))
        self.next += k
        return ids


def _unique_blocks(ids: _IdAllocator, prompt_tokens: int, block_tokens: int) -> tuple[int, ...]:
    return ids.take(math.ceil(prompt_tokens / block_tokens))


class NoPrefix(_Strict):
    kind: Literal["none"] = "none"


class PrefixGroups(_Strict):
    """`groups` system prompts of `prefix_tokens` each, picked with Zipf(`zipf_s`) popularity (0 = uniform).
    A request's prompt is its group's prefix followed by its sampled length of own tokens."""

    kind: Literal["groups"]
    groups: int = Field(ge=1)
    prefix_tokens: int = Field(ge=1)
    zipf_s: float = Field(1.0, ge=0)


class PrefixSessions(_Strict):
    """Multi-turn chat: `sessions` conversations are open at a time; each request continues a random open
    one, its prompt being the whole history (earlier prompts and answers) plus the sampled new tokens.
    A session closes after a geometric number of turns (mean `mean_turns`) and a fresh one opens."""

    kind: Literal["sessions"]
    sessions: int = Field(ge=1)
    mean_turns: float = Field(4.0, ge=1)
    max_prompt: int = Field(32768, ge=1, description="a session whose history exceeds this closes")


PrefixSpec = Annotated[Union[NoPrefix, PrefixGroups, PrefixSessions], Field(discriminator="kind")]


def _apply_prefix(
    rng: np.random.Generator,
    prefix: NoPrefix | PrefixGroups | PrefixSessions,
    prompt: np.ndarray,
    output: np.ndarray,
    block_tokens: int,
    ids: _IdAllocator,
) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """Final prompt lengths and block ids (Mooncake convention: ceil(prompt / block_tokens) ids, the
    leading full blocks shared where the content is shared, the partial tail block always fresh)."""
    n = len(prompt)
    if isinstance(prefix, NoPrefix):
        return prompt, [_unique_blocks(ids, int(p), block_tokens) for p in prompt]
    if isinstance(prefix, PrefixGroups):
        full = prefix.prefix_tokens // block_tokens
        group_ids = [ids.take(full) for _ in range(prefix.groups)]
        weights = 1.0 / np.arange(1, prefix.groups + 1) ** prefix.zipf_s
        group = rng.choice(prefix.groups, size=n, p=weights / weights.sum())
        total = prompt + prefix.prefix_tokens
        blocks = [group_ids[g] + ids.take(math.ceil(int(t) / block_tokens) - full) for g, t in zip(group, total)]
        return total, blocks
    # sessions: history tokens and the ids of its full blocks
    history: list[tuple[int, tuple[int, ...], int]] = []  # (tokens, full-block ids, turns left)

    def new_session() -> tuple[int, tuple[int, ...], int]:
        return (0, (), int(rng.geometric(1.0 / prefix.mean_turns)))

    history = [new_session() for _ in range(prefix.sessions)]
    total = np.empty(n, dtype=np.int64)
    blocks: list[tuple[int, ...]] = []
    for i in range(n):
        s = int(rng.integers(prefix.sessions))
        tokens, full_ids, left = history[s]
        if tokens + prompt[i] > prefix.max_prompt:
            tokens, full_ids, left = new_session()
        p = tokens + int(prompt[i])
        n_full = p // block_tokens
        keep = full_ids[: tokens // block_tokens]
        full_now = keep + ids.take(n_full - len(keep))
        tail = ids.take(1) if p % block_tokens else ()
        total[i] = p
        blocks.append(full_now + tail)
        # the answer joins the history; its partial block content is new next turn
        h = p + int(output[i])
        history[s] = new_session() if left <= 1 else (h, full_now, left - 1)
    return total, blocks


# ---------------------------------------------------------------- workload specs


def _requests(
    arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray, blocks: list[tuple[int, ...]], block_tokens: int,
    tenants: list[str] | None = None,
) -> list[SimRequest]:
    order = np.argsort(arrival, kind="stable")
    start = float(arrival[order[0]]) if len(order) else 0.0
    return [
        SimRequest(
            request_id=k,
            arrival_s=float(arrival[i]) - start,
            prompt_tokens=int(prompt[i]),
            output_tokens=int(output[i]),
            block_ids=blocks[i],
            block_tokens=block_tokens,
            tenant=tenants[i] if tenants is not None else "",
        )
        for k, i in enumerate(order)
    ]


class SyntheticWorkload(_Strict):
    kind: Literal["synthetic"]
    n_requests: int = Field(ge=1, le=1_000_000)
    rate_rps: float = Field(gt=0, description="mean arrival rate before time_scale")
    arrivals: ArrivalSpec = PoissonSpec()
    lengths: LengthSpec
    prefix: PrefixSpec = NoPrefix()
    block_tokens: int = Field(512, ge=1)

    def build(self, rng: np.random.Generator, split: Split, library: TraceLibrary, time_scale: float) -> list[SimRequest]:
        arrival = self.arrivals.sample(rng, self.rate_rps * time_scale, self.n_requests)
        prompt, output = self.lengths.sample(rng, self.n_requests, split, library)
        prompt, blocks = _apply_prefix(rng, self.prefix, prompt, output, self.block_tokens, _IdAllocator())
        return _requests(arrival, prompt, output, blocks, self.block_tokens)


class AdversarialWorkload(_Strict):
    """`tenants` ordinary tenants under a diurnal (sinusoidal) load, plus tenant `mega` that sends bursts
    of `burst_size` mega-prompts within `burst_spread_s`, bursts arriving as a Poisson process. Nothing
    marks a mega-prompt to the router except its (estimated) size."""

    kind: Literal["adversarial"]
    n_requests: int = Field(ge=1, le=1_000_000, description="ordinary requests")
    rate_rps: float = Field(gt=0)
    amplitude: float = Field(0.6, ge=0, le=1)
    period_s: float = Field(60.0, gt=0)
    tenants: int = Field(4, ge=1)
    lengths: LengthSpec
    mega_bursts_per_min: float = Field(2.0, gt=0)
    burst_size: int = Field(4, ge=1)
    burst_spread_s: float = Field(1.0, ge=0)
    mega_prompt_tokens: int = Field(24000, ge=1)
    mega_output_tokens: int = Field(32, ge=1)
    block_tokens: int = Field(512, ge=1)

    def build(self, rng: np.random.Generator, split: Split, library: TraceLibrary, time_scale: float) -> list[SimRequest]:
        arrival = diurnal_arrivals(rng, self.rate_rps * time_scale, self.amplitude, self.period_s, self.n_requests)
        prompt, output = self.lengths.sample(rng, self.n_requests, split, library)
        tenant = [f"tenant-{int(t)}" for t in rng.integers(self.tenants, size=self.n_requests)]
        horizon = float(arrival[-1])
        burst_rate = self.mega_bursts_per_min / 60.0 * time_scale
        n_bursts = int(rng.poisson(burst_rate * horizon))
        starts = rng.uniform(0.0, horizon, size=n_bursts)
        mega_t = (starts[:, None] + rng.uniform(0.0, self.burst_spread_s, size=(n_bursts, self.burst_size))).ravel()
        k = len(mega_t)
        arrival = np.concatenate([arrival, mega_t])
        prompt = np.concatenate([prompt, np.full(k, self.mega_prompt_tokens, dtype=np.int64)])
        output = np.concatenate([output, np.full(k, self.mega_output_tokens, dtype=np.int64)])
        tenant += ["mega"] * k
        ids = _IdAllocator()
        blocks = [_unique_blocks(ids, int(p), self.block_tokens) for p in prompt]
        return _requests(arrival, prompt, output, blocks, self.block_tokens, tenant)


class TraceWorkload(_Strict):
    """Replay of a known trace inside the split's window (or a narrower `windows` entry).

    At most `max_requests` consecutive requests are replayed, starting at a random request of the window
    (`segment: random`, different per seed) or at its first (`segment: first`); `eval_max_requests` shortens
    the segment on the eval split only, where the window is too small for long segments to differ. Traces whose requests
    continue earlier prefix chains (Mooncake) first replay the `WARMUP_S` seconds before the segment as
    tenant `warmup` (metrics skip them), unless `warmup: false`. With `target_rps`, the segment is sped up
    to that mean rate (so every segment and both splits run at the same average load), times `time_scale`.
    """

    kind: Literal["trace"]
    trace: str
    max_requests: int = Field(5000, ge=1)
    eval_max_requests: int | None = Field(
        None, ge=1, description="shorter segment on the eval split, so random starts differ between seeds (None = max_requests)"
    )
    segment: Literal["random", "first"] = "random"
    warmup: bool | None = Field(None, description="None = automatic (Mooncake traces)")
    windows: dict[Literal["train", "eval"], tuple[float, float]] = Field(
        default_factory=dict, description="narrower [start_s, end_s) per split, inside the split's window"
    )
    max_prompt_tokens: int | None = Field(None, ge=1, description="clip longer prompts (and their block ids)")
    target_rps: float | None = Field(
        None, gt=0, description="speed the scored segment up to this mean rate (then x time_scale); None = native"
    )

    @model_validator(mode="after")
    def _check(self) -> TraceWorkload:
        if self.trace not in KNOWN_TRACES:
            raise ValueError(f"unknown trace {self.trace!r}; known: {', '.join(KNOWN_TRACES)}")
        for split, (a, b) in self.windows.items():
            allowed = split_window(self.trace, split)
            if allowed is None:
                raise ValueError(f"trace {self.trace!r} has no timestamps: windows do not apply")
            if not (allowed[0] <= a < b <= allowed[1]):
                raise ValueError(
                    f"windows.{split} = [{a}, {b}) must lie inside the {split} window [{allowed[0]}, {allowed[1]})"
                )
        return self

    def build(self, rng: np.random.Generator, split: Split, library: TraceLibrary, time_scale: float) -> list[SimRequest]:
        full = library.load(self.trace)
        if not full.timed:
            raise ValueError(f"trace {self.trace!r} has no timestamps; use it as `lengths: {{dist: trace}}`")
        start, end = self.windows.get(split) or split_window(self.trace, split)
        idx = np.flatnonzero((full.arrival_s >= start) & (full.arrival_s < end))
        if len(idx) == 0:
            raise ValueError(f"trace {self.trace!r} has no requests in [{start}, {end})")
        cap = self.eval_max_requests if split == "eval" and self.eval_max_requests is not None else self.max_requests
        n = min(cap, len(idx))
        first = int(rng.integers(len(idx) - n + 1)) if self.segment == "random" else 0
        segment = idx[first : first + n]
        seg_start = float(full.arrival_s[segment[0]])
        warm = needs_warmup(self.trace) if self.warmup is None else self.warmup
        n_warm = 0
        if warm:
            warm_idx = np.flatnonzero((full.arrival_s >= seg_start - WARMUP_S) & (full.arrival_s < seg_start))
            n_warm = len(warm_idx)
            segment = np.concatenate([warm_idx, segment])
        rows = full.select(segment)
        scale = time_scale
        if self.target_rps is not None:
            span = float(full.arrival_s[segment[-1]] - full.arrival_s[segment[n_warm]])
            native = (len(segment) - n_warm - 1) / span if span > 0 else math.inf
            scale *= self.target_rps / native if math.isfinite(native) else 1.0
        arrival = spread_in_buckets(rows.arrival_s, full.bucket_s, rng) / scale
        prompt, blocks = rows.prompt_tokens.copy(), list(rows.block_ids)
        if self.max_prompt_tokens is not None:
            prompt = np.minimum(prompt, self.max_prompt_tokens)
            nb = math.ceil(self.max_prompt_tokens / rows.block_tokens)
            blocks = [b[:nb] for b in blocks]
        tenants = [WARMUP_TENANT] * n_warm + [""] * (len(rows) - n_warm)
        return _requests(arrival, prompt, rows.output_tokens, blocks, rows.block_tokens, tenants)


WorkloadSpec = Annotated[
    Union[SyntheticWorkload, AdversarialWorkload, TraceWorkload, DecisionLogWorkload], Field(discriminator="kind")
]
