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
from itertools import chain
from operator import attrgetter

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


# The snapshot fields the replica block is made of, read by one C-level call per replica.
_FIELDS = (
    "healthy",
    "outstanding",
    "outstanding_prompt_tokens",
    "outstanding_decode_tokens",
    "waiting",
    "running",
    "kv_cache_usage",
    "stats_age_s",
    "dispatched_since_scrape",
    "kv_capacity_tokens",
    "prefix_match_blocks",
    "ttft_ema_s",
    "tpot_ema_s",
)
_ROW = attrgetter(*_FIELDS)
_N_FIELDS = len(_FIELDS)
_N_REPLICA = len(REPLICA_FEATURES)
_FLAG_COLS = np.array([9, 17])  # stats_missing, latency_missing
# Feature columns whose snapshot field may be None (read as NaN), with the field names.
_NULLABLE_COLS = np.array([6, 7, 8, 12, 15, 16])
_NULLABLE_FIELDS = ("waiting", "running", "kv_cache_usage", "kv_capacity_tokens", "ttft_ema_s", "tpot_ema_s")


def _gather(reps: tuple) -> np.ndarray:
    """(n, len(_FIELDS)) float64 of the snapshots' fields, None read as NaN."""
    n = len(reps)
    try:
        return np.fromiter(chain.from_iterable(map(_ROW, reps)), np.float64, n * _N_FIELDS).reshape(n, _N_FIELDS)
    except TypeError:  # a None field: np.array reads it as NaN
        return np.array(list(map(_ROW, reps)), dtype=np.float64).reshape(n, _N_FIELDS)


def raw_features(view: ClusterView, request: RequestInfo) -> np.ndarray:
    """Untransformed values, float64, shape (n_replicas, N_FEATURES).

    Vectorised (this runs at every decision): one C-level attrgetter call per replica and one
    conversion; the column arithmetic gives the same bits as the per-replica Python it replaced
    (integer fields are exact in float64 below 2**53), which tests/policy/test_features_fast.py
    checks on random views. A view with a None, NaN or infinite value takes a slower exact path.
    """
    reps = view.replicas
    n = len(reps)
    raw = np.empty((n, N_FEATURES), dtype=np.float64)
    if not n:
        return raw
    g = _gather(reps)
    raw[:, 0] = 1.0
    raw[:, 1:3] = g[:, 0:2]  # healthy, outstanding
    raw[:, 4:9] = g[:, 2:7]  # prompt / decode tokens, waiting, running, kv usage
    raw[:, 10:14] = g[:, 7:11]  # age, dispatched, kv capacity, prefix match blocks
    raw[:, 15:17] = g[:, 11:13]  # ttft, tpot
    healthy = g[:, 0] != 0.0
    out = g[:, 1]
    healthy_out = out[healthy]
    n_healthy = len(healthy_out)
    raw[:, 3] = np.where(healthy, out - healthy_out.min(), 0.0) if n_healthy else 0.0
    age = raw[:, 10]
    if np.isfinite(g).all():
        raw[:, _FLAG_COLS] = 0.0
        np.minimum(age, STATS_AGE_CAP_S, out=age)
    else:
        # None -> 0 plus a flag; a value that really is NaN stays NaN; a non-finite age is the cap.
        nullable = raw[:, _NULLABLE_COLS]
        nan = np.isnan(nullable)
        none = np.zeros_like(nan)
        for k in np.flatnonzero(nan.any(axis=0)):
            field = _NULLABLE_FIELDS[k]
            none[:, k] = [getattr(r, field) is None for r in reps]
        raw[:, 9] = none[:, 0] | none[:, 1] | none[:, 2]
        raw[:, 17] = none[:, 4] | none[:, 5]
        raw[:, _NULLABLE_COLS] = np.where(none, 0.0, nullable)
        raw[:, 10] = np.where(np.isfinite(age), np.minimum(age, STATS_AGE_CAP_S), STATS_AGE_CAP_S)
    n_blocks = len(request.prefix_blocks)
    if n_blocks:
        raw[:, 13] /= n_blocks
    else:
        raw[:, 13] = 0.0
    np.multiply(raw[:, 13], request.prompt_tokens_est, out=raw[:, 14])
    raw[:, 15:17] *= 1000.0
    max_tok = request.max_tokens
    raw[:, _N_REPLICA:] = (
        request.prompt_tokens_est,
        max_tok if max_tok is not None else 0,
        1.0 if max_tok is None else 0.0,
        n_blocks,
        n_healthy,
    )
    return raw


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
    reps = view.replicas
    healthy = np.array([r.healthy for r in reps], dtype=bool).astype(np.int8)
    if pad_to is None:
        return healthy
    mask = np.zeros(pad_to, dtype=np.int8)
    mask[: len(reps)] = healthy
    return mask
