"""Run metrics from `RequestRecord`s, and their aggregation over seeds.

Conventions:
- Percentiles use `numpy.percentile(..., method="linear")` (Hyndman-Fan type 7, numpy's default) over the
  finished, scored requests.
- Requests of tenant `warmup` (cache warm-up replay before a trace window) are not scored.
- A request that never finished (lost to a crash) counts as an SLO miss in goodput and is reported in
  `unfinished`; latency percentiles are over finished requests only, so read them with `completed_fraction`.
- Goodput: the fraction of scored requests with TTFT <= ttft_s and TPOT <= tpot_s, and that count per second
  of the run's span (first scored arrival to last scored finish). Throughput uses the same span.
- Load imbalance: coefficient of variation (population std / mean) and max/mean of requests per replica,
  over all replicas when `replica_ids` is given (a replica that got nothing counts as 0), else over those seen.
- Seeds aggregate as the mean and the half-width of a two-sided 95 % Student-t interval (n - 1 d.o.f.).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from routewise_vllm.simulator.traces import WARMUP_TENANT
from routewise_vllm.simulator.types import RequestRecord

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9)
PERCENTILE_METHOD = "linear"


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


def _pname(p: float) -> str:
    return f"p{p:g}".replace(".", "")  # p50, p90, p99, p999


def percentiles(values: np.ndarray, prefix: str) -> dict[str, float]:
    if len(values) == 0:
        return {f"{prefix}_{_pname(p)}_s": math.nan for p in PERCENTILES}
    q = np.percentile(values, PERCENTILES, method=PERCENTILE_METHOD)
    return {f"{prefix}_{_pname(p)}_s": float(v) for p, v in zip(PERCENTILES, q)}


def request_table(records: Iterable[RequestRecord]) -> dict[str, np.ndarray]:
    """Per-request columns: ttft_s, tpot_s, e2e_s, queue_delay_s, preemptions, prefix_hit_tokens, ..."""
    recs = list(records)
    return {
        "request_id": np.array([r.request_id for r in recs], dtype=np.int64),
        "replica_id": np.array([r.replica_id for r in recs], dtype=object),
        "arrival_s": np.array([r.arrival_s for r in recs], dtype=float),
        "finish_s": np.array([r.finish_s for r in recs], dtype=float),
        "ttft_s": np.array([r.ttft_s for r in recs], dtype=float),
        "tpot_s": np.array([r.tpot_s if not math.isnan(r.finish_s) else math.nan for r in recs], dtype=float),
        "e2e_s": np.array([r.e2e_s for r in recs], dtype=float),
        "queue_delay_s": np.array([r.queue_delay_s for r in recs], dtype=float),
        "preemptions": np.array([r.preemptions for r in recs], dtype=np.int64),
        "prefix_hit_tokens": np.array([r.prefix_hit_tokens for r in recs], dtype=np.int64),
        "prompt_tokens": np.array([r.prompt_tokens for r in recs], dtype=np.int64),
        "output_tokens": np.array([r.output_tokens for r in recs], dtype=np.int64),
    }


def summarize(
    records: Sequence[RequestRecord], slo: Slo, replica_ids: Sequence[str] | None = None
) -> dict[str, float]:
    """One run's figures (see the module docstring for definitions)."""
    scored = [r for r in records if r.tenant != WARMUP_TENANT]
    if not scored:
        raise ValueError("no scored requests (every record is warm-up or the run is empty)")
    t = request_table(scored)
    done = ~np.isnan(t["finish_s"])
    n, n_done = len(scored), int(done.sum())
    ok = done & (t["ttft_s"] <= slo.ttft_s) & (t["tpot_s"] <= slo.tpot_s)
    span = (float(np.max(t["finish_s"][done])) - float(np.min(t["arrival_s"]))) if n_done else math.nan
    out: dict[str, float] = {"requests": float(n), "unfinished": float(n - n_done), "completed_fraction": n_done / n}
    for name in ("ttft", "tpot", "e2e", "queue_delay"):
        out |= percentiles(t[f"{name}_s"][done], name)
    out["ttft_mean_s"] = float(np.mean(t["ttft_s"][done])) if n_done else math.nan
    out["goodput"] = float(ok.sum()) / n
    out["goodput_rps"] = float(ok.sum()) / span if span and span > 0 else math.nan
    out["throughput_rps"] = n_done / span if span and span > 0 else math.nan
    out["output_tokens_per_s"] = float(t["output_tokens"][done].sum()) / span if span and span > 0 else math.nan
    out["prompt_tokens_per_s"] = float(t["prompt_tokens"][done].sum()) / span if span and span > 0 else math.nan
    out["preemptions_total"] = float(t["preemptions"].sum())
    prompt_total = float(t["prompt_tokens"].sum())
    out["prefix_hit_fraction"] = float(t["prefix_hit_tokens"].sum()) / prompt_total if prompt_total else 0.0
    out |= load_imbalance(t["replica_id"], replica_ids)
    return out


def load_imbalance(replica_of_request: Iterable[str], replica_ids: Sequence[str] | None = None) -> dict[str, float]:
    counts = Counter(replica_of_request)
    ids = list(replica_ids) if replica_ids is not None else sorted(counts)
    unknown = set(counts) - set(ids)
    if unknown:
        raise ValueError(f"records name replicas {sorted(unknown)} not in replica_ids {ids}")
    per = np.array([counts.get(i, 0) for i in ids], dtype=float)
    mean = per.mean() if len(per) else 0.0
    if mean == 0:
        return {"load_cov": math.nan, "load_max_over_mean": math.nan}
    return {"load_cov": float(per.std() / mean), "load_max_over_mean": float(per.max() / mean)}


# Two-sided 95 % Student-t quantiles t_{0.975, df} for df = 1..30; beyond, the Cornish-Fisher expansion.
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip


def t_quantile_975(df: int) -> float:
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95 % t-interval); half-width NaN for a single value."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        raise ValueError("no values to aggregate")
    m = float(x.mean())
    if len(x) < 2:
        return m, math.nan
    return m, t_quantile_975(len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))


def aggregate(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean over runs of each figure, plus `<name>_ci95` (t-interval half-width) for each."""
    if not runs:
        raise ValueError("no runs to aggregate")
    out: dict[str, float] = {}
    for key in runs[0]:
        m, h = mean_ci95([r[key] for r in runs])
        out[key] = m
        out[f"{key}_ci95"] = h
    return out


def render_table(rows: Sequence[Sequence[str]], text_columns: int = 2) -> str:
    """Plain-text table: the first row is the header; the first `text_columns` are left-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i < text_columns else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
