"""The feature table: every model input the router computes, declared once, as data.

Two kinds of rows:

- Per-replica columns (`REPLICA_COLUMNS`, `REQUEST_COLUMNS`): a name, a `Source` (which snapshot field or request
  attribute it reads, and how), a transform and a scale. They make the `build_features` rows (router/policy/
  feature_rows.py in Python, `_fastnet.rows` in C), which the decision log and training data keep.
- Cross-replica inputs (`DERIVED_INPUTS`, `EXCESS_INPUTS`): a replica's load and expected wait against the fleet,
  written as `Term` expressions over one replica's row and a fleet statistic. They, and every replica column
  against the fleet's minimum, mean and maximum, follow the rows in the network's input (`model_inputs`:
  router/policy/cross_inputs.py in numpy, the same programs bound into `_fastnet.inputs` in C).

Adding a per-replica feature is a column here (with an existing op), the value's source (a snapshot field and what
fills it: tracker, scrapers, simulator) and retraining; adding a cross-replica input is a `Derived` row here and
retraining. Neither touches C: router/policy/feature_binding.py hands both tables to the extension when it loads
(tests/policy/test_feature_table.py builds both in a copy and compares C with Python).

Change anything here and bump FEATURE_VERSION: the spec hash changes and the router refuses models trained against
the old contract (router/policy/feature_spec.py).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from routewise_vllm.router.policy.types import ReplicaSnapshot, RequestInfo

FEATURE_VERSION = 3  # 3: cross-replica inputs moved from the network into `model_inputs`
STATS_AGE_CAP_S = 3600.0  # an "infinite" age (never scraped) is written as this

# The expected-wait score, one definition for the cross-replica input `expected_wait` (DERIVED_INPUTS below) and
# the expected-wait heuristic (baselines.ExpectedWait; tests/trainer/test_latency.py checks they rank alike): work
# ahead x the replica's TPOT EMA relative to the MEAN TPOT EMA of the measured (tpot > 0) healthy replicas;
# unmeasured replicas count at relative speed 1. Part of the feature spec (its hash): changing it changes what
# every model was trained on.
EXPECTED_WAIT_DECODE_WEIGHT = 0.1


# ---- per-replica columns ---------------------------------------------------------------------------------
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
MASK_COLUMN = "healthy"  # the rows' own copy of action_mask: the compiled model_inputs reads its mask there


# ---- cross-replica inputs --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Term:
    """A float32 expression over one replica's build_features row, for every replica of a decision at once.
    Leaves: `feature`, `unlogged`, constants (any Python number); operators + - * /; `relative`, the one fleet
    statistic. Both evaluators (cross_inputs.py in numpy, fastnet_c/cross.c in C) apply the operations in the tree's order."""

    op: str
    args: tuple[Term, ...] = ()
    column: str = ""
    x: float = 0.0

    def __add__(self, other: Term | float) -> Term:
        return Term("add", (self, _term(other)))

    def __radd__(self, other: float) -> Term:
        return Term("add", (_term(other), self))

    def __sub__(self, other: Term | float) -> Term:
        return Term("sub", (self, _term(other)))

    def __rsub__(self, other: float) -> Term:
        return Term("sub", (_term(other), self))

    def __mul__(self, other: Term | float) -> Term:
        return Term("mul", (self, _term(other)))

    def __rmul__(self, other: float) -> Term:
        return Term("mul", (_term(other), self))

    def __truediv__(self, other: Term | float) -> Term:
        return Term("div", (self, _term(other)))

    def __rtruediv__(self, other: float) -> Term:
        return Term("div", (_term(other), self))


def _term(x: Term | float) -> Term:
    return x if isinstance(x, Term) else Term("const", x=float(x))


def feature(column: str) -> Term:
    """the replica's value in `column` of its build_features row"""
    return Term("feature", column=column)


def unlogged(column: str) -> Term:
    """a log1p column's value before its transform: exp(value x scale) - 1"""
    return Term("unlogged", column=column)


def relative(term: Term) -> Term:
    """term / its mean over the valid replicas where it is > 0 (at least 1e-6); 1 where it is not > 0 or the
    replica is not valid (masked)"""
    return Term("relative", (term,))


class Derived(NamedTuple):
    """A cross-replica input: value = log(1 + term) / 10 per replica; the model also gets it against its minimum
    over the valid replicas, and is-minimum / is-maximum indicators."""

    name: str
    term: Term


class Excess(NamedTuple):
    """A cross-replica input: (raw - its minimum) / (its mean + offset), raw the term of derived input `of`."""

    name: str
    of: str
    offset: float


_PROMPT, _DECODE = unlogged("outstanding_prompt_tokens"), unlogged("outstanding_decode_tokens")
_TPOT_MS = unlogged("tpot_ema_ms")
DERIVED_INPUTS: tuple[Derived, ...] = (
    Derived("token_load", _PROMPT + _DECODE),  # tokens in flight: prompt + expected decode
    Derived("speed_load", (_PROMPT + _DECODE) * _TPOT_MS / 10.0),  # the token load x TPOT EMA
    # the expected wait for a first token: the expected-wait heuristic's score (baselines.ExpectedWait)
    Derived("expected_wait", ((1.0 - feature("prefix_match_frac")) * unlogged("req_prompt_tokens_est")
                              + unlogged("awaiting_prompt_tokens") + EXPECTED_WAIT_DECODE_WEIGHT * _DECODE)
            * relative(_TPOT_MS)),
)
EXCESS_INPUTS: tuple[Excess, ...] = (
    Excess("token_load_excess", of="token_load", offset=256.0),  # in units of the mean load
)

# ---- the names, in the model's input order ----------------------------------------------------------------
# (name, transform, scale) of each block: what the spec hash and the trainer read
REPLICA_FEATURES: tuple[tuple[str, str, float], ...] = tuple((c.name, c.transform, c.scale) for c in REPLICA_COLUMNS)
REQUEST_FEATURES: tuple[tuple[str, str, float], ...] = tuple((c.name, c.transform, c.scale) for c in REQUEST_COLUMNS)
FEATURE_NAMES: tuple[str, ...] = tuple(c.name for c in COLUMNS)
N_FEATURES = len(FEATURE_NAMES)

_REP_NAMES = tuple(n for n, _, _ in REPLICA_FEATURES)
DERIVED_NAMES: tuple[str, ...] = tuple(d.name for d in DERIVED_INPUTS)
# Cross-replica inputs (`model_inputs`), in column order after the FEATURE_NAMES block.
CROSS_NAMES: tuple[str, ...] = (
    tuple(f"{n}_above_min" for n in _REP_NAMES)
    + tuple(f"{n}_above_mean" for n in _REP_NAMES)
    + tuple(f"{n}_below_max" for n in _REP_NAMES)
    + DERIVED_NAMES
    + tuple(f"{n}_above_min" for n in DERIVED_NAMES)
    + tuple(f"is_min_{n}" for n in _REP_NAMES + DERIVED_NAMES)
    + tuple(f"is_max_{n}" for n in _REP_NAMES + DERIVED_NAMES)
    + tuple(e.name for e in EXCESS_INPUTS)
)
MODEL_INPUT_NAMES: tuple[str, ...] = FEATURE_NAMES + CROSS_NAMES
N_MODEL_INPUTS = len(MODEL_INPUT_NAMES)


# ---- what the builders can follow ---------------------------------------------------------------------------
_ARITY = {"const": (0, 0), "value": (1, 0), "flag": (1, 0), "missing": (-1, 0), "capped": (1, 0), "above_min": (2, 0),
          "share": (1, 1), "product": (0, 2), "request": (1, 0), "request_missing": (1, 0), "request_len": (1, 0),
          "count": (1, 0)}
TERM_ARITY = {"feature": 0, "unlogged": 0, "const": 0, "add": 2, "sub": 2, "mul": 2, "div": 2, "relative": 1}


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


def check_cross(derived: tuple[Derived, ...] = DERIVED_INPUTS, excess: tuple[Excess, ...] = EXCESS_INPUTS,
                columns: tuple[Column, ...] = COLUMNS) -> None:
    """ValueError naming the first cross-replica input the evaluators cannot follow: an unknown operation, a
    column the rows do not have (or, for `unlogged`, one without the log1p transform), an excess of an input
    that is not derived, a name used twice."""
    transform = {c.name: c.transform for c in columns}

    def walk(name: str, t: Term) -> None:
        if t.op not in TERM_ARITY or len(t.args) != TERM_ARITY[t.op]:
            raise ValueError(f"cross-replica input {name}: operation {t.op!r} with {len(t.args)} arguments")
        if t.op in ("feature", "unlogged") and t.column not in transform:
            raise ValueError(f"cross-replica input {name}: no feature column {t.column!r}")
        if t.op == "unlogged" and transform[t.column] != "log1p":
            raise ValueError(f"cross-replica input {name}: column {t.column!r} is not log1p, nothing to unlog")
        for a in t.args:
            walk(name, a)

    names = set(transform)
    for d in derived:
        walk(d.name, d.term)
    derived_names = {d.name for d in derived}
    for e in excess:
        if e.of not in derived_names:
            raise ValueError(f"cross-replica input {e.name}: {e.of!r} is not a derived input")
    for name in [d.name for d in derived] + [e.name for e in excess]:
        if name in names:
            raise ValueError(f"cross-replica input {name}: listed twice")
        names.add(name)



def postfix(term: Term) -> tuple[tuple[str, str, float], ...]:
    """The term as both evaluators walk it: (op, column, x) with every operation after its arguments."""
    out: list[tuple[str, str, float]] = []

    def walk(t: Term) -> None:
        for a in t.args:
            walk(a)
        out.append((t.op, t.column, t.x))

    walk(term)
    return tuple(out)


check_table()
check_cross()
