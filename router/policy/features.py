"""The feature contract: the only code that turns (ClusterView, RequestInfo) into model input.

Output is a float32 matrix with one row per replica: the replica's own block followed by the
request block (repeated on every row), so one permutation-equivariant network serves any
replica count. Padding rows are all zero, with `present` = 0, and are masked out.

Every column is one row of `REPLICA_COLUMNS` / `REQUEST_COLUMNS`: its name, its source (which
snapshot field or request attribute it reads, and how: `Source`), its transform and its scale.
Both builders of the rows follow that table and nothing else: the Python one (`raw_features`,
generated from the table at import) and the compiled one (`_fastnet.rows`, when the optional C
extension is built: reading the snapshots from C is most of a decision's cost in Python), which
receives the table when it binds, below. Adding a feature is a row here (with an existing op),
the value's source (a snapshot field and what fills it: tracker, scrapers, simulator) and
retraining; tests/policy/test_features_fast.py holds both builders to a frozen reference, and
tests/policy/test_feature_table.py shows a new row built alike by both without touching C.

The model's input is `model_inputs(features, mask)`: those rows followed by the cross-replica
inputs (each replica against the fleet's minimum, mean and maximum, token loads, the expected
wait), computed here once in numpy so the exported graph is a plain small network. The decision
log and training data keep the `build_features` rows; the cross-replica columns are a pure
function of them and the mask.

Change anything here and bump FEATURE_VERSION: the spec hash changes and the router refuses
models trained against the old contract.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import NamedTuple

import numpy as np

from routewise_vllm.router.policy.types import ClusterView, ReplicaSnapshot, RequestInfo

# The expected-wait score, one definition for the feature, the expected-wait heuristic (baselines.ExpectedWait)
# and the network's in-graph copy (trainer/network.py CrossReplicaInputs, which the shipped model was trained
# with; tests/trainer/test_latency.py checks they rank alike): work ahead x the replica's TPOT EMA relative to
# the MEAN TPOT EMA of the measured (tpot > 0) healthy replicas; unmeasured replicas count at relative speed 1.
# Part of the feature spec (its hash): changing it changes what every model was trained on.
EXPECTED_WAIT_DECODE_WEIGHT = 0.1

try:
    from routewise_vllm.router.policy import _fastnet as _compiled
except ImportError:  # built without a C compiler: the Python rows below
    _compiled = None

FEATURE_VERSION = 3  # 3: cross-replica inputs moved from the network into `model_inputs`
STATS_AGE_CAP_S = 3600.0  # an "infinite" age (never scraped) is written as this


class Source(NamedTuple):
    """Where a column's raw value comes from: `op` applied to `names` (snapshot fields, or the request's
    attributes for the per-request ops), `refs` (earlier or per-request columns, by name) and `x`."""

    op: str
    names: tuple[str, ...] = ()
    refs: tuple[str, ...] = ()
    x: float = 1.0


# Replica ops: one value per replica, from its snapshot `r`.
def const(x: float) -> Source:
    """x"""
    return Source("const", x=x)


def value(field: str, times: float = 1.0) -> Source:
    """r.field x times; None (not scraped / measured yet) reads as 0"""
    return Source("value", (field,), x=times)


def flag(field: str) -> Source:
    """1.0 if r.field is true, else 0.0"""
    return Source("flag", (field,))


def missing(*fields: str) -> Source:
    """1.0 if any of r.fields is None, else 0.0"""
    return Source("missing", fields)


def capped(field: str, cap: float) -> Source:
    """min(r.field, cap), and cap where it is not finite"""
    return Source("capped", (field,), x=cap)


def above_min(field: str, among: str) -> Source:
    """r.field minus its minimum over the replicas whose `among` is true; 0 where r.among is false"""
    return Source("above_min", (field, among))


def share(field: str, of: str) -> Source:
    """r.field / column `of`, 0.0 where that column is 0"""
    return Source("share", (field,), (of,))


def product(a: str, b: str) -> Source:
    """column a x column b"""
    return Source("product", (), (a, b))


# Per-request ops: one value for every row of the view.
def request(attr: str) -> Source:
    """request.attr; None reads as 0"""
    return Source("request", (attr,))


def request_missing(attr: str) -> Source:
    """1.0 if request.attr is None, else 0.0"""
    return Source("request_missing", (attr,))


def request_len(attr: str) -> Source:
    """len(request.attr)"""
    return Source("request_len", (attr,))


def count(among: str) -> Source:
    """the number of replicas whose `among` is true"""
    return Source("count", (among,))


PER_REQUEST_OPS = frozenset({"request", "request_missing", "request_len", "count"})


class Column(NamedTuple):
    """One model input column: value = transform(max(raw, 0)) / scale, raw from `source`; transform "lin" or "log1p"."""

    name: str
    source: Source
    transform: str
    scale: float


REPLICA_COLUMNS: tuple[Column, ...] = (
    Column("present", const(1.0), "lin", 1.0),
    Column("healthy", flag("healthy"), "lin", 1.0),
    Column("outstanding", value("outstanding"), "log1p", 3.0),
    Column("outstanding_minus_min", above_min("outstanding", among="healthy"), "log1p", 3.0),
    Column("outstanding_prompt_tokens", value("outstanding_prompt_tokens"), "log1p", 10.0),
    Column("outstanding_decode_tokens", value("outstanding_decode_tokens"), "log1p", 10.0),
    Column("waiting", value("waiting"), "log1p", 3.0),
    Column("running", value("running"), "log1p", 3.0),
    Column("kv_cache_usage", value("kv_cache_usage"), "lin", 1.0),
    Column("stats_missing", missing("waiting", "running", "kv_cache_usage"), "lin", 1.0),
    Column("stats_age_s", capped("stats_age_s", STATS_AGE_CAP_S), "log1p", 3.0),
    Column("dispatched_since_scrape", value("dispatched_since_scrape"), "log1p", 3.0),
    Column("kv_capacity_tokens", value("kv_capacity_tokens"), "log1p", 14.0),
    Column("prefix_match_frac", share("prefix_match_blocks", of="req_prefix_blocks"), "lin", 1.0),
    Column("prefix_match_tokens_est", product("prefix_match_frac", "req_prompt_tokens_est"), "log1p", 10.0),
    Column("ttft_ema_ms", value("ttft_ema_s", times=1000.0), "log1p", 8.0),
    Column("tpot_ema_ms", value("tpot_ema_s", times=1000.0), "log1p", 5.0),
    Column("latency_missing", missing("ttft_ema_s", "tpot_ema_s"), "lin", 1.0),
    Column("awaiting_first_token", value("awaiting_first_token"), "log1p", 3.0),
    Column("awaiting_prompt_tokens", value("awaiting_prompt_tokens"), "log1p", 10.0),
)
REQUEST_COLUMNS: tuple[Column, ...] = (
    Column("req_prompt_tokens_est", request("prompt_tokens_est"), "log1p", 10.0),
    Column("req_max_tokens", request("max_tokens"), "log1p", 8.0),
    Column("req_max_tokens_missing", request_missing("max_tokens"), "lin", 1.0),
    Column("req_prefix_blocks", request_len("prefix_blocks"), "log1p", 5.0),
    Column("n_healthy", count(among="healthy"), "log1p", 4.0),
)
COLUMNS = REPLICA_COLUMNS + REQUEST_COLUMNS

# (name, transform, scale) of each block: what the spec hash and the trainer read
REPLICA_FEATURES: tuple[tuple[str, str, float], ...] = tuple((c.name, c.transform, c.scale) for c in REPLICA_COLUMNS)
REQUEST_FEATURES: tuple[tuple[str, str, float], ...] = tuple((c.name, c.transform, c.scale) for c in REQUEST_COLUMNS)
FEATURE_NAMES: tuple[str, ...] = tuple(c.name for c in COLUMNS)
N_FEATURES = len(FEATURE_NAMES)

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


def spec_info() -> dict:
    """The spec as stored in model metadata."""
    return {"feature_version": FEATURE_VERSION, "feature_spec_hash": FEATURE_SPEC_HASH, "feature_names": list(FEATURE_NAMES),
            "model_input_names": list(MODEL_INPUT_NAMES)}


# Columns addressed by name from the contract's own table, never by position.
_COL = {name: i for i, name in enumerate(FEATURE_NAMES)}
_MATCH_FRAC = _COL["prefix_match_frac"]


# ---- the rows, from the table ------------------------------------------------------------------
_ARITY = {"const": (0, 0), "value": (1, 0), "flag": (1, 0), "missing": (-1, 0), "capped": (1, 0), "above_min": (2, 0),
          "share": (1, 1), "product": (0, 2), "request": (1, 0), "request_missing": (1, 0), "request_len": (1, 0),
          "count": (1, 0)}


def check_table(columns: tuple[Column, ...] = COLUMNS) -> None:
    """ValueError naming the first column the builders cannot follow: an unknown op or transform, a field the
    snapshot (or attribute the request) does not have, a reference to a later replica column."""
    snap, req = {f.name for f in dataclasses.fields(ReplicaSnapshot)}, {f.name for f in dataclasses.fields(RequestInfo)}
    seen: dict[str, bool] = {}  # name -> per request
    per_request = {c.name for c in columns if c.source.op in PER_REQUEST_OPS}
    for c in columns:
        op, names, refs = c.source.op, c.source.names, c.source.refs
        if op not in _ARITY:
            raise ValueError(f"feature column {c.name}: unknown op {op!r}")
        n_names, n_refs = _ARITY[op]
        if (len(names) < 1 if n_names < 0 else len(names) != n_names) or len(refs) != n_refs:
            raise ValueError(f"feature column {c.name}: op {op} takes {n_names} names and {n_refs} column references")
        known = req if op in PER_REQUEST_OPS and op != "count" else snap
        for n in names:
            if n not in known:
                owner = "RequestInfo" if known is req else "ReplicaSnapshot"
                raise ValueError(f"feature column {c.name}: {owner} has no {n!r}")
        for r in refs:
            if r not in per_request and r not in seen:
                raise ValueError(f"feature column {c.name}: column {r!r} is neither per request nor before it")
        if c.transform not in ("lin", "log1p") or not c.scale > 0:
            raise ValueError(f"feature column {c.name}: transform {c.transform!r}, scale {c.scale!r}")
        if c.name in seen:
            raise ValueError(f"feature column {c.name}: listed twice")
        seen[c.name] = op in PER_REQUEST_OPS


def _row_source(columns: tuple[Column, ...]) -> str:
    """The Python source of `_raw_rows(reps, request) -> list of row tuples`, one expression per column: the same
    arithmetic as the C builder's ops (rows.c), written as the plain code it replaces, and as fast. As there, a field
    or attribute that is None (not scraped / measured yet) reads as 0."""
    var = {c.name: f"c{j}" for j, c in enumerate(columns)}
    head, among, body = [], {}, []

    def among_list(field: str) -> str:
        if field not in among:
            among[field] = f"_among_{field}"
            head.append(f"{among[field]} = [r for r in reps if r.{field}]")
        return among[field]

    def get(field: str) -> str:
        return f"(0 if (_w := r.{field}) is None else _w)"

    for j, c in enumerate(columns):
        (op, names, refs, x), v = c.source, f"c{j}"
        a = names[0] if names else None
        if op == "const":
            expr = repr(float(x))
        elif op == "value":
            expr = f"(0 if (_v := r.{a}) is None else {'_v' if x == 1.0 else f'_v * {float(x)!r}'})"
        elif op == "flag":
            expr = f"(1.0 if r.{a} else 0.0)"
        elif op == "missing":
            expr = "(1.0 if " + " or ".join(f"r.{n} is None" for n in names) + " else 0.0)"
        elif op == "capped":
            expr = f"(min(_v, {float(x)!r}) if _isfinite(_v := {get(a)}) else {float(x)!r})"
        elif op == "above_min":
            lst = among_list(names[1])
            head.append(f"_m{j} = [{get(a)} for r in {lst}]")
            head.append(f"_m{j} = min(_m{j}) if _m{j} else 0")
            expr = f"({get(a)} - _m{j} if r.{names[1]} else 0)"
        elif op == "share":
            expr = f"({get(a)} / {var[refs[0]]} if {var[refs[0]]} else 0.0)"
        elif op == "product":
            expr = f"{var[refs[0]]} * {var[refs[1]]}"
        elif op == "request":
            expr = f"(0 if (_v := request.{a}) is None else _v)"
        elif op == "request_missing":
            expr = f"(1.0 if request.{a} is None else 0.0)"
        elif op == "request_len":
            expr = f"len(request.{a})"
        else:  # count
            expr = f"len({among_list(a)})"
        (head if op in PER_REQUEST_OPS else body).append(f"{v} = {expr}")
    lines = ["def _raw_rows(reps, request):", *(f"    {s}" for s in head), "    rows = []", "    append = rows.append",
             "    for r in reps:", *(f"        {s}" for s in body),
             f"        append(({', '.join(var[c.name] for c in columns)},))", "    return rows"]
    return "\n".join(lines) + "\n"


def _compile_rows(columns: tuple[Column, ...]):
    check_table(columns)
    namespace: dict = {"_isfinite": math.isfinite}
    exec(compile(_row_source(columns), f"<{__name__} rows>", "exec"), namespace)  # noqa: S102 - our own table
    return namespace["_raw_rows"]


def compiled_columns(columns: tuple[Column, ...] = COLUMNS) -> tuple[tuple, ...]:
    """The table as `_fastnet.bind_rows` takes it: (op, names, refs as column indices, x, log, scale) per column."""
    index = {c.name: j for j, c in enumerate(columns)}
    return tuple((c.source.op, c.source.names, tuple(index[r] for r in c.source.refs), float(c.source.x),
                  c.transform == "log1p", float(c.scale)) for c in columns)


_raw_rows = _compile_rows(COLUMNS)

if _compiled is not None:  # the same table, passed to C; an extension that cannot follow it stops the import here
    try:
        _compiled.bind_rows(ReplicaSnapshot, compiled_columns())
    except (AttributeError, TypeError, ValueError) as exc:
        raise ImportError(f"router.policy._fastnet cannot build the feature rows ({exc}): it was built from other "
                          "sources than router/policy/fastnet_c; rebuild it (pip install -e .)") from exc


def raw_features(view: ClusterView, request: RequestInfo) -> np.ndarray:
    """Untransformed values, float64, shape (n_replicas, N_FEATURES), in Python (the C rows give the same bits)."""
    n = len(view.replicas)
    return np.array(_raw_rows(view.replicas, request), dtype=np.float64).reshape(n, N_FEATURES)


def compiled_row_args(view: ClusterView, request: RequestInfo) -> tuple | None:
    """The compiled rows' arguments for one decision (`_fastnet.rows(*args, out)` writes build_features' bytes), or
    None where build_features runs in numpy. The learned policy's fast path passes them on with the network's."""
    if _compiled is None:
        return None
    reps = view.replicas
    return (reps if type(reps) is tuple else tuple(reps), request)


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
