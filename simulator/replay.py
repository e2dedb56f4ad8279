"""Decision-log replay: the live router's own traffic as a simulator workload ("train on your own traffic").

The router writes one JSON line per routing decision (format: router/serving/DECISION_LOG.md). This
module reads those files without importing router code beyond `router.policy`, keeps the first attempt
of each request, and turns arrivals, prompt and output tokens and prefix blocks into `SimRequest`s.

    workload: {kind: decision_log, path: /var/log/routewise}     # in any scenario YAML
    simulator replay /var/log/routewise --cluster steady-chat --out mine.yaml
    simulator run --scenario mine.yaml --policy learned   # or trainer evaluate --scenarios mine.yaml

Splits: the log's first `train_fraction` of its time span is `train`, the rest `eval`.
Output tokens: the streamed token count the router observed; for non-streamed requests (not counted
by the router) the request's max_tokens, else `default_output_tokens`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from routewise_vllm.simulator.types import SimRequest

FORMAT_VERSION = 1
_FILE_RE = re.compile(r"^decisions-(\d{6,})\.jsonl$")


class DecisionLogError(ValueError):
    """A decision log that cannot be replayed; the message names file, line and field."""


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    time_s: float
    request_id: str
    prompt_tokens: int
    max_tokens: int | None
    output_tokens: int | None  # observed (streamed) output tokens
    prefix_blocks: tuple[int, ...]
    prefix_block_tokens: int | None
    arm: str
    fallback: str | None
    ok: bool | None


def log_paths(path: str | Path) -> list[Path]:
    """A log directory's `decisions-NNNNNN.jsonl` files, oldest first, or the one file given."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise DecisionLogError(f"decision log {p}: no such file or directory")
    files = sorted((int(m.group(1)), q) for q in p.iterdir() if (m := _FILE_RE.match(q.name)))
    if not files:
        raise DecisionLogError(f"decision log {p}: no decisions-NNNNNN.jsonl files in it")
    return [q for _, q in files]


def _field(rec: dict, name: str, types: tuple[type, ...], where: str, optional: bool = False):
    if name not in rec:
        raise DecisionLogError(f"{where}: field {name!r} is missing")
    v = rec[name]
    if v is None and optional:
        return None
    if not isinstance(v, types) or isinstance(v, bool) and bool not in types:
        raise DecisionLogError(f"{where}: field {name!r} = {v!r} is not {' or '.join(t.__name__ for t in types)}")
    return v


def parse_record(rec: object, where: str) -> tuple[LoggedRequest, int]:
    """(request, attempt) from one decoded JSON line; DecisionLogError naming `where` and the field."""
    if not isinstance(rec, dict):
        raise DecisionLogError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if rec.get("v") != FORMAT_VERSION:
        raise DecisionLogError(f"{where}: field 'v' = {rec.get('v')!r}; this simulator reads version {FORMAT_VERSION}")
    t = float(_field(rec, "t", (int, float), where))
    prompt = _field(rec, "prompt_tokens_est", (int,), where)
    if prompt < 0 or not math.isfinite(t):
        raise DecisionLogError(f"{where}: 't' = {t!r} / 'prompt_tokens_est' = {prompt!r} out of range")
    blocks = _field(rec, "prefix_blocks", (list,), where)
    if not all(isinstance(b, int) for b in blocks):
        raise DecisionLogError(f"{where}: field 'prefix_blocks' must be a list of integers")
    out = _field(rec, "output_tokens", (int,), where, optional=True)
    req = LoggedRequest(
        time_s=t,
        request_id=_field(rec, "id", (str,), where),
        prompt_tokens=prompt,
        max_tokens=_field(rec, "max_tokens", (int,), where, optional=True),
        output_tokens=out if out else None,
        prefix_blocks=tuple(blocks),
        prefix_block_tokens=_field(rec, "prefix_block_tokens", (int,), where, optional=True),
        arm=str(rec.get("arm", "")),
        fallback=rec.get("fallback"),
        ok=rec.get("ok"),
    )
    return req, int(_field(rec, "attempt", (int,), where))


def read_decision_log(path: str | Path) -> list[LoggedRequest]:
    """The first attempt of every request in the log, in arrival order. A final line without its newline
    (a writer that died mid-line) is skipped; any other bad line raises, naming file and line."""
    first: dict[str, tuple[int, LoggedRequest]] = {}
    for file in log_paths(path):
        text = file.read_text(encoding="utf-8")
        lines = text.split("\n")
        for no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{file}:{no}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                if no == len(lines):  # the unterminated last line
                    continue
                raise DecisionLogError(f"{where}: not valid JSON ({exc.msg})") from None
            req, attempt = parse_record(rec, where)
            seen = first.get(req.request_id)
            if seen is None or attempt < seen[0]:
                first[req.request_id] = (attempt, req)
    if not first:
        raise DecisionLogError(f"decision log {path}: no records")
    return sorted((r for _, r in first.values()), key=lambda r: r.time_s)


def to_sim_requests(
    logged: list[LoggedRequest], time_scale: float = 1.0, default_output_tokens: int = 256,
    default_block_tokens: int = 64,
) -> list[SimRequest]:
    """Arrivals relative to the first request, divided by `time_scale` (2 = twice the load)."""
    if not logged:
        return []
    t0 = logged[0].time_s
    out = []
    for k, r in enumerate(logged):
        output = r.output_tokens or r.max_tokens or default_output_tokens
        out.append(SimRequest(
            request_id=k,
            arrival_s=(r.time_s - t0) / time_scale,
            prompt_tokens=max(1, r.prompt_tokens),
            output_tokens=max(1, output),
            block_ids=r.prefix_blocks,
            block_tokens=r.prefix_block_tokens or default_block_tokens,
            max_tokens=r.max_tokens,
        ))
    return out


def split_logged(logged: list[LoggedRequest], split: str, train_fraction: float) -> list[LoggedRequest]:
    t0, t1 = logged[0].time_s, logged[-1].time_s
    cut = t0 + train_fraction * (t1 - t0)
    if split == "train":
        return [r for r in logged if r.time_s < cut] or logged[:1]
    if split == "eval":
        return [r for r in logged if r.time_s >= cut]
    raise ValueError(f"unknown split {split!r}; known: train, eval")


class DecisionLogWorkload(BaseModel):
    """A scenario workload replaying a decision log (directory or one .jsonl file)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["decision_log"]
    path: str = Field(description="decision log directory (router --decision-log DIR) or one decisions-*.jsonl file")
    train_fraction: float = Field(0.7, gt=0, lt=1, description="the log's first fraction of time is the train split")
    max_requests: int | None = Field(None, ge=1, description="replay at most this many (the first of the split)")
    default_output_tokens: int = Field(256, ge=1, description="for requests without observed tokens or max_tokens")

    def build(self, rng: np.random.Generator, split: str, library, time_scale: float) -> list[SimRequest]:
        logged = split_logged(read_decision_log(self.path), split, self.train_fraction)
        if not logged:
            raise ValueError(f"decision log {self.path}: no requests in the {split} split")
        if self.max_requests is not None:
            logged = logged[: self.max_requests]
        return to_sim_requests(logged, time_scale, self.default_output_tokens)


def summarize_log(logged: list[LoggedRequest]) -> dict:
    span = logged[-1].time_s - logged[0].time_s if logged else 0.0
    prompt = np.array([r.prompt_tokens for r in logged], dtype=np.float64)
    arms: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    for r in logged:
        arms[r.arm] = arms.get(r.arm, 0) + 1
        if r.fallback:
            fallbacks[r.fallback] = fallbacks.get(r.fallback, 0) + 1
    return {
        "requests": len(logged),
        "duration_s": round(span, 3),
        "rate_rps": round((len(logged) - 1) / span, 3) if span > 0 else None,
        "prompt_tokens_p50": float(np.percentile(prompt, 50)) if len(prompt) else None,
        "prompt_tokens_p99": float(np.percentile(prompt, 99)) if len(prompt) else None,
        "with_observed_output_tokens": sum(1 for r in logged if r.output_tokens),
        "with_prefix_blocks": sum(1 for r in logged if r.prefix_blocks),
        "arms": arms,
        "fallbacks": fallbacks,
    }
