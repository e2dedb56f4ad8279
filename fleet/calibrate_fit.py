"""Fitting a calibration sweep: both cost forms, chosen on probes they were not fitted on.

Rows are single engine iterations, (prefill tokens, decode sequences, context tokens, attention pairs, prefill
sequences, seconds), as `simulator.replica` plans them. Two forms are fitted:

- the linear form of `costmodel.LinearCost` (a + b * prefill + c * decode + d * context + e * prefill seqs), always;
- the roofline (`costmodel.fit`: overhead, prefill MFU, decode bandwidth utilisation) when the model's shape is
  known: a profile, a Hugging Face `config.json` with a named GPU, or a profile's GPU with a config's model.

Each form's error is measured by k-fold cross-validation (every row predicted by a fit that did not see it); the
form with the smaller held-out error is refitted on every row and kept. In-sample residuals favour the form with
more parameters; a linear form cannot bend where a roofline's max(compute, bandwidth) switches bound, so it
extrapolates badly from a sweep that misses the workload's operating range.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from routewise_vllm.simulator import costmodel

FOLDS = 5
# Columns of a sweep row.
PREFILL, DECODE, CONTEXT, ATTN, PREFILL_SEQS, SECONDS = range(6)


@dataclass(frozen=True)
class Fits:
    linear: costmodel.LinearCost
    roofline: costmodel.Profile | None
    held_out: dict[str, float | None]  # RMS relative error on rows each fit did not see
    in_sample: dict[str, float | None]
    chosen: str
    unidentified: tuple[str, ...]  # parameters of the chosen form the rows could not pin down

    def predict(self, rows: np.ndarray) -> np.ndarray:
        return predict(self, self.chosen, rows)


def rms_rel(pred: np.ndarray, t: np.ndarray) -> float:
    return float(np.sqrt(np.mean(((pred - t) / t) ** 2)))


def _linear_design(rows: np.ndarray) -> np.ndarray:
    return np.column_stack([np.ones(len(rows)), rows[:, PREFILL], rows[:, DECODE], rows[:, CONTEXT], rows[:, PREFILL_SEQS]])


def fit_linear(rows: np.ndarray) -> costmodel.LinearCost:
    """Non-negative least squares on relative errors (a cost is never negative: a term fitted negative is dropped
    and the rest refitted)."""
    t = rows[:, SECONDS]
    design = _linear_design(rows)
    scale = np.maximum(design.max(axis=0), 1e-12)
    w = 1.0 / np.maximum(t, 1e-9)
    a, y = design / scale * w[:, None], t * w
    keep = [j for j in range(5) if np.any(design[:, j] > 0)]
    coef = np.zeros(5)
    while keep:
        sol, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if np.all(sol >= 0):
            coef[keep] = sol / scale[keep]
            break
        keep.pop(int(np.argmin(sol)))
    return costmodel.LinearCost(*(float(c) for c in coef))


def fit_roofline(base: costmodel.Profile, rows: np.ndarray) -> costmodel.Profile:
    return costmodel.fit(base, rows[:, [PREFILL, DECODE, CONTEXT, ATTN, SECONDS]])


def predict(fits: Fits, form: str, rows: np.ndarray) -> np.ndarray:
    if form == "roofline":
        co = fits.roofline.coefficients()  # type: ignore[union-attr]
        return np.array([co.iteration_time(int(r[PREFILL]), int(r[DECODE]), int(r[CONTEXT]), r[ATTN]) for r in rows])
    lin = fits.linear
    return np.array([lin.iteration_time(r[PREFILL], r[DECODE], r[CONTEXT], r[PREFILL_SEQS]) for r in rows])


def _held_out(rows: np.ndarray, fit_one, seed: int = 0) -> float:
    """RMS relative error of each row predicted by a fit on the other folds."""
    n = len(rows)
    order = np.random.default_rng(seed).permutation(n)
    errs = np.empty(n)
    folds = min(FOLDS, n)
    for k in range(folds):
        test = order[k::folds]
        train = np.setdiff1d(order, test)
        pred = fit_one(rows[train])(rows[test])
        errs[test] = (pred - rows[test, SECONDS]) / rows[test, SECONDS]
    return float(np.sqrt(np.mean(errs**2)))


def _linear_predictor(rows: np.ndarray):
    lin = fit_linear(rows)
    return lambda r: np.array([lin.iteration_time(x[PREFILL], x[DECODE], x[CONTEXT], x[PREFILL_SEQS]) for x in r])


def _roofline_predictor(base: costmodel.Profile):
    def fit_one(rows: np.ndarray):
        co = fit_roofline(base, rows).coefficients()
        return lambda r: np.array([co.iteration_time(int(x[PREFILL]), int(x[DECODE]), int(x[CONTEXT]), x[ATTN]) for x in r])

    return fit_one


def unidentified(rows: np.ndarray, form: str, fits: Fits) -> tuple[str, ...]:
    """Parameters no row constrains: a linear term whose column is zero or a copy of another's, or that the rows
    exercise but fitted below zero (dropped, so written as 0: smaller than the timing noise resolves); a roofline
    side (compute or bandwidth) that no row is bound by."""
    if form == "linear":
        design = _linear_design(rows)
        names = costmodel.LINEAR_FIELDS
        out = [names[j] for j in range(5) if not np.any(design[:, j] > 0)]
        used = [j for j in range(5) if names[j] not in out]
        if np.linalg.matrix_rank(design[:, used] / np.maximum(design[:, used].max(axis=0), 1e-12)) < len(used):
            out.append("collinear terms among " + ", ".join(names[j] for j in used))
        out += [f"{names[j]} (fitted below zero, written as 0)" for j in used if getattr(fits.linear, names[j]) == 0.0]
        return tuple(out)
    co = fits.roofline.coefficients()  # type: ignore[union-attr]
    flops = co.flops_per_token * (rows[:, PREFILL] + rows[:, DECODE]) + co.attn_flops_per_token_pair * rows[:, ATTN]
    nbytes = co.weight_bytes + co.kv_bytes_per_token * rows[:, CONTEXT]
    compute = flops * co.s_per_flop > nbytes * co.s_per_byte
    out = []
    if not compute.any():
        out.append("prefill_mfu (no row is compute-bound)")
    if compute.all():
        out.append("decode_bw_util (no row is bandwidth-bound)")
    return tuple(out)


def fit_rows(rows: np.ndarray, base: costmodel.Profile | None) -> Fits:
    """Both forms, each scored on held-out rows; the better one is kept (fitted on every row)."""
    if len(rows) < 4:
        raise ValueError(f"need at least 4 timed iterations to fit, got {len(rows)}")
    t = rows[:, SECONDS]
    linear = fit_linear(rows)
    held: dict[str, float | None] = {"linear": _held_out(rows, _linear_predictor), "roofline": None}
    roof = fit_roofline(base, rows) if base is not None else None
    if base is not None:
        held["roofline"] = _held_out(rows, _roofline_predictor(base))
    chosen = "roofline" if held["roofline"] is not None and held["roofline"] <= held["linear"] else "linear"
    fits = Fits(linear, roof, held, {"linear": None, "roofline": None}, chosen, ())
    in_sample = {f: (rms_rel(predict(fits, f, rows), t) if f == "linear" or roof is not None else None)
                 for f in ("linear", "roofline")}
    return dataclasses.replace(fits, in_sample=in_sample, unidentified=unidentified(rows, chosen, fits))


# ---------------------------------------------------------------- the model's shape


def shape_from_config(config_path: str | Path, gpu: costmodel.Profile) -> costmodel.Profile:
    """A roofline profile with the hardware of `gpu` (a profile) and the model of a Hugging Face `config.json`
    (decoder-only transformer: parameters estimated from its dimensions when the file does not state them)."""
    path = Path(config_path)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable config.json ({e})") from None
    try:
        layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        inter = int(cfg.get("intermediate_size", 4 * hidden))
        vocab = int(cfg.get("vocab_size", 32000))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: field {e} missing or not an integer (need num_hidden_layers, hidden_size, "
                         "num_attention_heads)") from None
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o, k, v projections
    mlp = 3 * hidden * inter  # gate, up, down
    params = float(layers * (attn + mlp) + vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2))
    dtype = str(cfg.get("torch_dtype", "bfloat16"))
    bytes_per_param = 4.0 if dtype == "float32" else 2.0
    max_len = int(cfg.get("max_position_embeddings", gpu.max_model_len))
    return dataclasses.replace(
        gpu, name=f"{path.parent.name or 'model'}-{gpu.gpu_name}", model_name=str(cfg.get("_name_or_path", path.parent.name)),
        params=params, layers=layers, hidden=hidden, kv_heads=kv_heads, head_dim=head_dim,
        bytes_per_param=bytes_per_param, max_model_len=max_len, sources=(str(path),),
    )


def resolve_shape(profile: str | None, model_config: str | None) -> costmodel.Profile | None:
    """The roofline base: `--profile` alone, or `--model-config` with `--profile` naming the GPU (its hardware
    is kept, its model replaced); None when neither is given (the linear form only)."""
    if model_config and not profile:
        raise ValueError("--model-config needs --profile naming the GPU (a profile on the same hardware, e.g. llama3-8b-a100)")
    if not profile:
        return None
    base = costmodel.load_profile(profile)
    if base.linear is not None:
        raise ValueError(f"--profile {profile}: a measured linear profile has no hardware to fit a roofline on")
    return shape_from_config(model_config, base) if model_config else base


def relative_change(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12))) if len(a) else math.inf
