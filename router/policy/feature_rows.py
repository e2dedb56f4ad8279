"""The build_features rows: one float32 row per replica, the replica's block followed by the request block (repeated
on every row), so one permutation-equivariant network serves any replica count. Padding rows are all zero, with
`present` = 0, and are masked out.

Two builders follow router/policy/feature_table.py's columns and nothing else: the Python one below (`raw_features`,
generated from the table at import) and the compiled one (`_fastnet.rows`, bound in feature_binding.py; reading the
snapshots from C is most of a decision's cost in Python). tests/policy/test_features_fast.py holds both to a frozen
reference.
"""

from __future__ import annotations

import math

import numpy as np

from routewise_vllm.router.policy.feature_binding import compiled as _compiled
from routewise_vllm.router.policy.feature_binding import compiled_row_args
from routewise_vllm.router.policy.feature_table import (
    COLUMNS,
    N_FEATURES,
    PER_REQUEST_OPS,
    REPLICA_FEATURES,
    REQUEST_FEATURES,
    Column,
    check_table,
)
from routewise_vllm.router.policy.types import ClusterView, RequestInfo

_SPECS = REPLICA_FEATURES + REQUEST_FEATURES
_LOG_COLS = np.array([t == "log1p" for _, t, _ in _SPECS])
_SCALES = np.array([s for _, _, s in _SPECS], dtype=np.float64)


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


_raw_rows = _compile_rows(COLUMNS)


def raw_features(view: ClusterView, request: RequestInfo) -> np.ndarray:
    """Untransformed values, float64, shape (n_replicas, N_FEATURES), in Python (the C rows give the same bits)."""
    n = len(view.replicas)
    return np.array(_raw_rows(view.replicas, request), dtype=np.float64).reshape(n, N_FEATURES)


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
