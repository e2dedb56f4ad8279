"""The feature contract: the only code that turns (ClusterView, RequestInfo) into model input.

Output is a float32 matrix with one row per replica: the replica's own block followed by the
request block (repeated on every row), so one permutation-equivariant network serves any
replica count. Padding rows are all zero, with `present` = 0, and are masked out.

Change anything here and bump FEATURE_VERSION: the spec hash changes and the router refuses
models trained against the old contract.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np

from router.policy.types import ClusterView, RequestInfo

FEATURE_VERSION = 1

# (name, transform, scale): value = transform(x) / scale; transform is "lin" or "log1p".
REPLICA_FEATURES: tuple[tuple[str, str, float], ...] = (
    ("present", "lin", 1.0),
    ("healthy", "lin", 1.0),
    ("outstanding", "log1p", 3.0),
    ("outstanding_minus_min", "log1p", 3.0),
    ("outstanding_prompt_tokens", "log1p", 10.0),
    ("outstanding_decode_tokens", "log1p", 10.0),
    ("waiting", "log1p", 3.0),
    ("running", "log1p", 3.0),
    ("kv_cache_usage", "lin", 1.0),
    ("stats_missing", "lin", 1.0),
    ("stats_age_s", "log1p", 3.0),
    ("dispatched_since_scrape", "log1p", 3.0),
    ("kv_capacity_tokens", "log1p", 14.0),
    ("prefix_match_frac", "lin", 1.0),
    ("prefix_match_tokens_est", "log1p", 10.0),
    ("ttft_ema_ms", "log1p", 8.0),
    ("tpot_ema_ms", "log1p", 5.0),
    ("latency_missing", "lin", 1.0),
)
REQUEST_FEATURES: tuple[tuple[str, str, float], ...] = (
    ("req_prompt_tokens_est", "log1p", 10.0),
    ("req_max_tokens", "log1p", 8.0),
    ("req_max_tokens_missing", "lin", 1.0),
    ("req_prefix_blocks", "log1p", 5.0),
    ("n_healthy", "log1p", 4.0),
)
FEATURE_NAMES: tuple[str, ...] = tuple(n for n, _, _ in REPLICA_FEATURES + REQUEST_FEATURES)
N_FEATURES = len(FEATURE_NAMES)
STATS_AGE_CAP_S = 3600.0  # an "infinite" age (never scraped) is written as this


def _spec_document() -> dict:
    return {
        "version": FEATURE_VERSION,
        "replica": [list(f) for f in REPLICA_FEATURES],
        "request": [list(f) for f in REQUEST_FEATURES],
        "stats_age_cap_s": STATS_AGE_CAP_S,
    }


FEATURE_SPEC_HASH: str = hashlib.sha256(json.dumps(_spec_document(), sort_keys=True).encode()).hexdigest()[:16]

_SPECS = REPLICA_FEATURES + REQUEST_FEATURES
_LOG_COLS = np.array([t == "log1p" for _, t, _ in _SPECS])
_SCALES = np.array([s for _, _, s in _SPECS], dtype=np.float64)


def spec_info() -> dict:
    """The spec as stored in model metadata."""
    return {"feature_version": FEATURE_VERSION, "feature_spec_hash": FEATURE_SPEC_HASH, "feature_names": list(FEATURE_NAMES)}


def raw_features(view: ClusterView, request: RequestInfo) -> np.ndarray:
    """Untransformed values, float64, shape (n_replicas, N_FEATURES)."""
    reps = view.replicas
    healthy_out = [r.outstanding for r in reps if r.healthy]
    min_out = min(healthy_out) if healthy_out else 0
    n_healthy = len(healthy_out)
    n_blocks = len(request.prefix_blocks)
    max_tok = request.max_tokens
    req = (
        request.prompt_tokens_est,
        max_tok if max_tok is not None else 0,
        1.0 if max_tok is None else 0.0,
        n_blocks,
        n_healthy,
    )
    rows = []
    for r in reps:
        missing = not r.has_stats
        frac = r.prefix_match_blocks / n_blocks if n_blocks else 0.0
        lat_missing = r.ttft_ema_s is None or r.tpot_ema_s is None
        rows.append(
            (
                1.0,
                1.0 if r.healthy else 0.0,
                r.outstanding,
                r.outstanding - min_out if r.healthy else 0,
                r.outstanding_prompt_tokens,
                r.outstanding_decode_tokens,
                0 if r.waiting is None else r.waiting,
                0 if r.running is None else r.running,
                0.0 if r.kv_cache_usage is None else r.kv_cache_usage,
                1.0 if missing else 0.0,
                min(r.stats_age_s, STATS_AGE_CAP_S) if math.isfinite(r.stats_age_s) else STATS_AGE_CAP_S,
                r.dispatched_since_scrape,
                0 if r.kv_capacity_tokens is None else r.kv_capacity_tokens,
                frac,
                frac * request.prompt_tokens_est,
                0.0 if r.ttft_ema_s is None else r.ttft_ema_s * 1000.0,
                0.0 if r.tpot_ema_s is None else r.tpot_ema_s * 1000.0,
                1.0 if lat_missing else 0.0,
            )
            + req
        )
    return np.array(rows, dtype=np.float64).reshape(len(reps), N_FEATURES)


def build_features(view: ClusterView, request: RequestInfo, pad_to: int | None = None) -> np.ndarray:
    """Model input, float32, shape (n, N_FEATURES) or (pad_to, N_FEATURES) with zero padding."""
    raw = raw_features(view, request)
    raw = np.maximum(raw, 0.0)
    raw[:, _LOG_COLS] = np.log1p(raw[:, _LOG_COLS])
    out = (raw / _SCALES).astype(np.float32)
    if pad_to is not None:
        if pad_to < out.shape[0]:
            raise ValueError(f"pad_to={pad_to} is smaller than the replica count {out.shape[0]}")
        padded = np.zeros((pad_to, N_FEATURES), dtype=np.float32)
        padded[: out.shape[0]] = out
        return padded
    return out


def action_mask(view: ClusterView, pad_to: int | None = None) -> np.ndarray:
    """int8 mask: 1 where routing is allowed (present and healthy)."""
    n = len(view.replicas) if pad_to is None else pad_to
    mask = np.zeros(n, dtype=np.int8)
    for i, r in enumerate(view.replicas):
        mask[i] = 1 if r.healthy else 0
    return mask
