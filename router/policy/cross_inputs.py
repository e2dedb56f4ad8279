"""The network's input, `model_inputs(features, mask)`: the build_features rows followed by the cross-replica inputs
of router/policy/feature_table.py, computed here once in numpy so the exported graph is a plain small network. The
decision log and training data keep the rows; the cross-replica columns are a pure function of them and the mask.

The compiled fast path computes the same inputs in C from the same table (router/policy/fastnet_c/cross.c, bound in
feature_binding.py); tests/policy/test_fastnet.py and tests/policy/test_feature_table.py hold the two together.
"""

from __future__ import annotations

import numpy as np

from routewise_vllm.router.policy.feature_table import (
    COLUMNS,
    DERIVED_INPUTS,
    EXCESS_INPUTS,
    FEATURE_NAMES,
    N_FEATURES,
    N_MODEL_INPUTS,
    REPLICA_COLUMNS,
    postfix,
)

_F32 = np.float32
_COL = {name: i for i, name in enumerate(FEATURE_NAMES)}
_N_REP = len(REPLICA_COLUMNS)
_N_DERIVED = len(DERIVED_INPUTS)
_N_EXCESS = len(EXCESS_INPUTS)
_PROGRAMS = tuple(tuple((op, _COL[column] if column else -1, _F32(x)) for op, column, x in postfix(d.term))
                  for d in DERIVED_INPUTS)
# the columns the programs read unlogged (value = exp(feature x scale) - 1), in column order: one block for all
_UNLOG_COLS = np.array(sorted({col for p in _PROGRAMS for op, col, _ in p if op == "unlogged"}), dtype=np.intp)
_UNLOG_ROW = {int(col): k for k, col in enumerate(_UNLOG_COLS)}
_UNLOG_SCALES_COL = np.array([COLUMNS[c].scale for c in _UNLOG_COLS], dtype=_F32)[:, None]
_DERIVED_AT = {d.name: i for i, d in enumerate(DERIVED_INPUTS)}
_EXCESS_OF = tuple(_DERIVED_AT[e.of] for e in EXCESS_INPUTS)
_EXCESS_OFFSETS = np.array([e.offset for e in EXCESS_INPUTS], dtype=_F32)[:, None]
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}


def _run(program: tuple, ft: np.ndarray, unlog: np.ndarray, every: bool, is_valid: np.ndarray | None) -> np.ndarray:
    """One derived input's program on the transposed rows ft [..., F, R]: its raw value [..., 1, R]."""
    stack: list = []
    for op, col, x in program:
        if op == "feature":
            stack.append(ft[..., col : col + 1, :])
        elif op == "unlogged":
            k = _UNLOG_ROW[col]
            stack.append(unlog[..., k : k + 1, :])
        elif op == "const":
            stack.append(x)
        elif op == "relative":
            a = np.broadcast_to(stack.pop(), ft[..., :1, :].shape)
            measured = a > 0 if every else (a > 0) & is_valid
            mean = np.where(measured, a, 0.0).sum(-1, keepdims=True)
            mean /= np.maximum(measured.sum(-1, keepdims=True, dtype=_F32), 1.0)
            stack.append(np.where(measured, a / np.maximum(mean, 1e-6), 1.0))
        else:
            b = stack.pop()
            stack.append(_BINARY[op](stack.pop(), b))
    return stack[0]


def model_inputs(features: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The network's input, float32 [..., R, N_MODEL_INPUTS]: `features` [..., R, N_FEATURES] (build_features
    rows, any leading batch axes) followed by the cross-replica inputs over the replicas where `mask` [..., R]
    is 1 (present and healthy; padded or masked rows get zeros there and never enter the statistics).

    For every replica feature: its difference to the minimum, the mean and (maximum minus it) over valid
    replicas; each derived input of the table (token loads, the expected wait), log(1 + its term) / 10, and its
    difference to the minimum; exact is-minimum / is-maximum indicators of all of those; and each excess input
    (the token load's excess over the minimum in units of the mean load). Float32 throughout, as the network was
    trained with."""
    # Written for few numpy calls on contiguous memory (each costs about a microsecond at one decision's
    # size, several on strided columns): the work is done transposed, one row per column, with one statistics
    # pass over [replica features | derived | excess bases] and the outputs written in place. Same float32
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
    n, d, e = _N_REP, _N_DERIVED, _N_EXCESS
    lead = f.shape[:-2]
    r = f.shape[-2]
    unlog = ft[..., _UNLOG_COLS, :]
    unlog *= _UNLOG_SCALES_COL
    np.exp(unlog, out=unlog)
    unlog -= 1.0
    x = np.empty(lead + (n + d + e, r), dtype=_F32)
    x[..., :n, :] = ft[..., :n, :]
    for i, program in enumerate(_PROGRAMS):
        x[..., n + i : n + i + 1, :] = _run(program, ft, unlog, every, is_valid)
    for k, i in enumerate(_EXCESS_OF):  # the excess inputs' raw values, before the log below
        x[..., n + d + k, :] = x[..., n + i, :]
    derived = x[..., n : n + d, :]
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
    if e:
        excess = c[..., k + 2 * (n + d) :, :]
        np.subtract(x[..., n + d :, :], lo[..., n + d :, :], out=excess)
        excess /= mean[..., n + d :, :] + _EXCESS_OFFSETS
    if not every:
        c *= valid
    out = np.empty(lead + (r, N_MODEL_INPUTS), dtype=_F32)
    out[..., :N_FEATURES] = f
    out[..., N_FEATURES:] = np.swapaxes(c, -1, -2)
    return out
