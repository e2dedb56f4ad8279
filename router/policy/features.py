"""The feature contract: the only code that turns (ClusterView, RequestInfo) into model input.

Output is a float32 matrix with one row per replica: the replica's own block followed by the
request block (repeated on every row), so one permutation-equivariant network serves any
replica count. Padding rows are all zero, with `present` = 0, and are masked out.

The model's input is `model_inputs(features, mask)`: those rows followed by the cross-replica
inputs (each replica against the fleet's minimum, mean and maximum, token loads, the expected
wait), computed here once in numpy so the exported graph is a plain small network. The decision
log and training data keep the `build_features` rows; the cross-replica columns are a pure
function of them and the mask.

Change anything here and bump FEATURE_VERSION: the spec hash changes and the router refuses
models trained against the old contract. `raw_features` has a row-wise and a column-wise path
(small vs large views), and `build_features` a compiled one (`_fastnet.rows`, when the optional C
extension is built: reading the snapshots from C is most of a decision's cost in Python): change
all three, and the reference in tests/policy/test_features_fast.py, which holds them to the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np

from router.policy.baselines import EXPECTED_WAIT_DECODE_WEIGHT
from router.policy.types import ClusterView, ReplicaSnapshot, RequestInfo

try:
    from router.policy import _fastnet as _compiled
except ImportError:  # built without a C compiler: the numpy path below
    _compiled = None
else:
    _compiled.bind_snapshot(ReplicaSnapshot)  # read snapshots by slot offset, not getattr

FEATURE_VERSION = 3  # 3: cross-replica inputs moved from the network into `model_inputs`

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
    ("awaiting_first_token", "log1p", 3.0),
    ("awaiting_prompt_tokens", "log1p", 10.0),
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

# Cross-replica inputs (`model_inputs`), in column order after the FEATURE_NAMES block.
_REP_NAMES = tuple(n for n, _, _ in REPLICA_FEATURES)
DERIVED_NAMES = ("token_load", "speed_load", "expected_wait")
CROSS_NAMES: tuple[str, ...] = (
    tuple(f"{n}_above_min" for n in _REP_NAMES)
    + tuple(f"{n}_above_mean" for n in _REP_NAMES)
    + tuple(f"{n}_below_max" for n in _REP_NAMES)
    + DERIVED_NAMES
    + tuple(f"{n}_above_min" for n in DERIVED_NAMES)
    + tuple(f"is_min_{n}" for n in _REP_NAMES + DERIVED_NAMES)
    + tuple(f"is_max_{n}" for n in _REP_NAMES + DERIVED_NAMES)
    + ("token_load_excess",)
)
MODEL_INPUT_NAMES: tuple[str, ...] = FEATURE_NAMES + CROSS_NAMES
N_MODEL_INPUTS = len(MODEL_INPUT_NAMES)


def _spec_document() -> dict:
    return {
        "version": FEATURE_VERSION,
        "replica": [list(f) for f in REPLICA_FEATURES],
        "request": [list(f) for f in REQUEST_FEATURES],
        "stats_age_cap_s": STATS_AGE_CAP_S,
        "cross": list(CROSS_NAMES),
        "expected_wait_decode_weight": EXPECTED_WAIT_DECODE_WEIGHT,
    }


FEATURE_SPEC_HASH: str = hashlib.sha256(json.dumps(_spec_document(), sort_keys=True).encode()).hexdigest()[:16]

_SPECS = REPLICA_FEATURES + REQUEST_FEATURES
_LOG_COLS = np.array([t == "log1p" for _, t, _ in _SPECS])
_SCALES = np.array([s for _, _, s in _SPECS], dtype=np.float64)
_LOG_FLAGS = bytes(_LOG_COLS.astype(np.uint8))


def spec_info() -> dict:
    """The spec as stored in model metadata."""
    return {"feature_version": FEATURE_VERSION, "feature_spec_hash": FEATURE_SPEC_HASH, "feature_names": list(FEATURE_NAMES),
            "model_input_names": list(MODEL_INPUT_NAMES)}


# Views up to this many replicas are built row by row in Python; larger ones column-wise in numpy.
# Both give the same bits (tests/policy/test_features_fast.py); only their speed differs.
_ROWWISE_MAX_REPLICAS = 32

# Columns addressed by name from the contract's own table, never by position.
_COL = {name: i for i, name in enumerate(FEATURE_NAMES)}
_PRESENT, _STATS_MISSING, _LATENCY_MISSING = _COL["present"], _COL["stats_missing"], _COL["latency_missing"]
_OUT_MINUS_MIN, _AGE = _COL["outstanding_minus_min"], _COL["stats_age_s"]
_MATCH_FRAC, _MATCH_TOKENS = _COL["prefix_match_frac"], _COL["prefix_match_tokens_est"]
_LATENCY_MS = [_COL["ttft_ema_ms"], _COL["tpot_ema_ms"]]
# Feature column of each snapshot field as `_field_columns` lists them (prefix_match_blocks lands in
# prefix_match_frac and is divided there); the last six may be None (not scraped / measured yet):
# flagged, then read as 0.
_FIELD_COLS = np.array([_COL[n] for n in (
    "healthy", "outstanding", "outstanding_prompt_tokens", "outstanding_decode_tokens", "stats_age_s",
    "dispatched_since_scrape", "prefix_match_frac", "awaiting_first_token", "awaiting_prompt_tokens",
    "waiting", "running", "kv_cache_usage", "kv_capacity_tokens", "ttft_ema_ms", "tpot_ema_ms",
)])
_NULLABLE_FROM = 9
_STATS_FIELDS = slice(0, 3)  # of the nullable fields: waiting, running, kv_cache_usage -> stats_missing
_LATENCY_FIELDS = slice(4, 6)  # ttft, tpot -> latency_missing
_N_REPLICA = len(REPLICA_FEATURES)


def _field_columns(reps: tuple) -> list[list]:
    # one list comprehension per field: the cheapest way CPython reads a slot of many objects
    return [
        [r.healthy for r in reps],
        [r.outstanding for r in reps],
        [r.outstanding_prompt_tokens for r in reps],
        [r.outstanding_decode_tokens for r in reps],
        [r.stats_age_s for r in reps],
        [r.dispatched_since_scrape for r in reps],
        [r.prefix_match_blocks for r in reps],
        [r.awaiting_first_token for r in reps],
        [r.awaiting_prompt_tokens for r in reps],
        [r.waiting for r in reps],
        [r.running for r in reps],
        [r.kv_cache_usage for r in reps],
        [r.kv_capacity_tokens for r in reps],
        [r.ttft_ema_s for r in reps],
        [r.tpot_ema_s for r in reps],
    ]


def _raw_features_rows(view: ClusterView, request: RequestInfo) -> np.ndarray:
    """raw_features, one Python row per replica: cheaper than numpy's per-call overhead for small views."""
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
                r.awaiting_first_token,
                r.awaiting_prompt_tokens,
            )
            + req
        )
    return np.array(rows, dtype=np.float64).reshape(len(reps), N_FEATURES)


def raw_features(view: ClusterView, request: RequestInfo) -> np.ndarray:
    """Untransformed values, float64, shape (n_replicas, N_FEATURES).

    Large views are built column-wise (this runs at every decision): one list comprehension per
    field, one conversion, and column arithmetic that gives the same bits as the row-wise code
    (integer fields are exact in float64 below 2**53); tests/policy/test_features_fast.py checks
    both paths against the original per-replica code on random views.
    """
    reps = view.replicas
    n = len(reps)
    if n <= _ROWWISE_MAX_REPLICAS:
        return _raw_features_rows(view, request)
    cols = _field_columns(reps)
    g = np.array(cols, dtype=np.float64)  # (fields, n); None -> NaN
    none = None
    nan_rows = np.isnan(g[_NULLABLE_FROM:]).any(axis=1)
    if nan_rows.any():  # None -> 0 plus a flag; a value that really is NaN stays NaN
        none = np.zeros((len(nan_rows), n), dtype=bool)
        for k in np.flatnonzero(nan_rows):
            none[k] = [x is None for x in cols[_NULLABLE_FROM + k]]
        g[_NULLABLE_FROM:][none] = 0.0
    raw = np.empty((n, N_FEATURES), dtype=np.float64)
    raw[:, _FIELD_COLS] = g.T
    raw[:, _PRESENT] = 1.0
    if none is None:
        raw[:, _STATS_MISSING] = 0.0
        raw[:, _LATENCY_MISSING] = 0.0
    else:
        raw[:, _STATS_MISSING] = none[_STATS_FIELDS].any(axis=0)
        raw[:, _LATENCY_MISSING] = none[_LATENCY_FIELDS].any(axis=0)
    healthy = g[0] != 0.0
    out = g[1]
    healthy_out = out[healthy]
    n_healthy = len(healthy_out)
    raw[:, _OUT_MINUS_MIN] = np.where(healthy, out - healthy_out.min(), 0.0) if n_healthy else 0.0
    age = raw[:, _AGE]
    raw[:, _AGE] = np.where(np.isfinite(age), np.minimum(age, STATS_AGE_CAP_S), STATS_AGE_CAP_S)
    raw[:, _LATENCY_MS] *= 1000.0
    n_blocks = len(request.prefix_blocks)
    if n_blocks:
        raw[:, _MATCH_FRAC] /= n_blocks
    else:
        raw[:, _MATCH_FRAC] = 0.0
    np.multiply(raw[:, _MATCH_FRAC], request.prompt_tokens_est, out=raw[:, _MATCH_TOKENS])
    max_tok = request.max_tokens
    raw[:, _N_REPLICA:] = (
        request.prompt_tokens_est,
        max_tok if max_tok is not None else 0,
        1.0 if max_tok is None else 0.0,
        n_blocks,
        n_healthy,
    )
    return raw


def compiled_row_args(view: ClusterView, request: RequestInfo) -> tuple | None:
    """The compiled rows' arguments for one decision (`_fastnet.rows(*args, out)` writes build_features' bytes), or
    None where build_features runs in numpy. The learned policy's fast path passes them on with the network's."""
    if _compiled is None:
        return None
    reps = view.replicas
    return (reps if type(reps) is tuple else tuple(reps), request.prompt_tokens_est, request.max_tokens,
            len(request.prefix_blocks), _LOG_FLAGS, _SCALES, STATS_AGE_CAP_S)


def build_features(view: ClusterView, request: RequestInfo, pad_to: int | None = None) -> np.ndarray:
    """Model input, float32, shape (n, N_FEATURES) or (pad_to, N_FEATURES) with zero padding."""
    if _compiled is not None:
        n = len(view.replicas)
        if pad_to is not None and pad_to < n:
            raise ValueError(f"pad_to={pad_to} is smaller than the replica count {n}")
        out = np.zeros((pad_to, N_FEATURES), np.float32) if pad_to is not None else np.empty((n, N_FEATURES), np.float32)
        _compiled.rows(*compiled_row_args(view, request), out[:n])  # type: ignore[misc]
        return out
    raw = raw_features(view, request)  # a fresh array: transformed in place
    np.maximum(raw, 0.0, out=raw)
    raw = np.where(_LOG_COLS, np.log1p(raw), raw)  # fewer calls than indexing the log columns
    raw /= _SCALES
    out = raw.astype(np.float32)
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


# ---- cross-replica inputs ----------------------------------------------------------------------
_N_REP = len(REPLICA_FEATURES)
_N_DERIVED = len(DERIVED_NAMES)
_ALL_SCALES = {n: s for n, _, s in _SPECS}
# the columns that are un-logged (value = expm1(feature x scale)) for the token loads and the expected wait
_UNLOG = ("outstanding_prompt_tokens", "outstanding_decode_tokens", "tpot_ema_ms", "awaiting_prompt_tokens",
          "req_prompt_tokens_est")
_UNLOG_COLS = np.array([_COL[n] for n in _UNLOG])
_UNLOG_SCALES_COL = np.array([_ALL_SCALES[n] for n in _UNLOG], dtype=np.float32)[:, None]
# The same tables as the compiled cross-replica inputs read them (router/policy/fastnet.py): the feature columns
# un-logged for the token loads and the expected wait, in _UNLOG's order, and their scales.
UNLOG_COLUMNS: tuple[int, ...] = tuple(int(c) for c in _UNLOG_COLS)
UNLOG_SCALES: tuple[float, ...] = tuple(float(x) for x in _UNLOG_SCALES_COL[:, 0])
_F32 = np.float32


def model_inputs(features: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The network's input, float32 [..., R, N_MODEL_INPUTS]: `features` [..., R, N_FEATURES] (build_features
    rows, any leading batch axes) followed by the cross-replica inputs over the replicas where `mask` [..., R]
    is 1 (present and healthy; padded or masked rows get zeros there and never enter the statistics).

    For every replica feature: its difference to the minimum, the mean and (maximum minus it) over valid
    replicas; the token load log(1 + prompt + expected decode tokens)/10, the speed-aware load (token load x
    TPOT EMA) and the expected wait for a first token (prompt tokens awaiting their first token + this
    request's uncached prompt + EXPECTED_WAIT_DECODE_WEIGHT x decode tokens in flight, times the TPOT EMA
    relative to the fleet's measured mean: the expected-wait heuristic's score), each with its difference
    to the minimum; exact is-minimum / is-maximum indicators of all of those; and the token load's excess
    over the minimum in units of the mean load. Float32 throughout, as the network was trained with."""
    # Written for few numpy calls on contiguous memory (each costs about a microsecond at one decision's
    # size, several on strided columns): the work is done transposed, one row per column, with one statistics
    # pass over [replica features | 3 derived | raw token load] and the outputs written in place. Same float32
    # arithmetic, in the same order, as the torch module the shipped model was trained with
    # (tests/trainer/test_cross_inputs_rewrite.py keeps that formulation as the reference).
    f = np.asarray(features, dtype=_F32)
    ft = np.ascontiguousarray(np.swapaxes(f, -1, -2))  # [..., F, R]
    m = np.asarray(mask, dtype=_F32)
    # every replica valid (the usual live decision; mask entries are 0 or 1): the masked statistics reduce
    # to plain ones, same bits
    every = m.size > 0 and bool(m.min() > 0.5)
    valid = m[..., None, :]  # [..., 1, R]
    is_valid = None if every else valid > 0.5
    n, d = _N_REP, _N_DERIVED
    lead = f.shape[:-2]
    r = f.shape[-2]
    raw = ft[..., _UNLOG_COLS, :]
    raw *= _UNLOG_SCALES_COL
    np.exp(raw, out=raw)
    raw -= 1.0
    prompt, decode, tpot_ms = raw[..., 0:1, :], raw[..., 1:2, :], raw[..., 2:3, :]
    awaiting, req_prompt = raw[..., 3:4, :], raw[..., 4:5, :]
    x = np.empty(lead + (n + d + 1, r), dtype=_F32)
    x[..., :n, :] = ft[..., :n, :]
    raw_load = x[..., n + d :, :]
    np.add(prompt, decode, out=raw_load)
    derived = x[..., n : n + d, :]
    derived[..., :1, :] = raw_load
    speed = derived[..., 1:2, :]
    np.multiply(raw_load, tpot_ms, out=speed)
    speed /= 10.0
    measured = tpot_ms > 0 if every else (tpot_ms > 0) & is_valid
    mean_tpot = np.where(measured, tpot_ms, 0.0).sum(-1, keepdims=True)
    mean_tpot /= np.maximum(measured.sum(-1, keepdims=True, dtype=_F32), 1.0)
    wait = derived[..., 2:3, :]
    np.subtract(1.0, ft[..., _MATCH_FRAC : _MATCH_FRAC + 1, :], out=wait)
    wait *= req_prompt  # uncached prompt tokens
    wait += awaiting
    wait += EXPECTED_WAIT_DECODE_WEIGHT * decode
    wait *= np.where(measured, tpot_ms / np.maximum(mean_tpot, 1e-6), 1.0)  # relative speed
    derived += 1.0
    np.log(derived, out=derived)
    derived /= 10.0
    if every:
        lo = x.min(-1, keepdims=True)
        hi = x.max(-1, keepdims=True)
        mean = x.sum(-1, keepdims=True)
        mean /= _F32(r)
    else:
        count = valid.sum(-1, keepdims=True)
        any_valid = (count > 0.5).astype(_F32)
        lo = np.where(is_valid, x, 1e4).min(-1, keepdims=True)
        lo *= any_valid
        hi = np.where(is_valid, x, -1e4).max(-1, keepdims=True)
        hi *= any_valid
        mean = (x * valid).sum(-1, keepdims=True)
        mean /= np.maximum(count, 1.0)
    c = np.empty(lead + (N_MODEL_INPUTS - N_FEATURES, r), dtype=_F32)
    rep = x[..., :n, :]
    np.subtract(rep, lo[..., :n, :], out=c[..., :n, :])
    np.subtract(rep, mean[..., :n, :], out=c[..., n : 2 * n, :])
    np.subtract(hi[..., :n, :], rep, out=c[..., 2 * n : 3 * n, :])
    c[..., 3 * n : 3 * n + d, :] = derived
    np.subtract(derived, lo[..., n : n + d, :], out=c[..., 3 * n + d : 3 * n + 2 * d, :])
    k = 3 * n + 2 * d
    np.less_equal(x[..., : n + d, :], lo[..., : n + d, :] + 1e-6, out=c[..., k : k + n + d, :])
    np.greater_equal(x[..., : n + d, :], hi[..., : n + d, :] - 1e-6, out=c[..., k + n + d : k + 2 * (n + d), :])
    excess = c[..., -1:, :]
    np.subtract(raw_load, lo[..., n + d :, :], out=excess)
    excess /= mean[..., n + d :, :] + 256.0
    if not every:
        c *= valid
    out = np.empty(lead + (r, N_MODEL_INPUTS), dtype=_F32)
    out[..., :N_FEATURES] = f
    out[..., N_FEATURES:] = np.swapaxes(c, -1, -2)
    return out
