"""The learned policy's fast path: the routing network's forward pass for one decision in compiled C.

At one decision the network is tiny, so onnxruntime spends its time on per-operator overhead (about 45
operators, ~100 us at 16 replicas) and the numpy cross-replica inputs on per-call overhead; one compiled
pass (`_fastnet`: `model_inputs`, then the network) does the same arithmetic in microseconds
(tests/bench/decision_latency_learned.py). ONNX stays the format and onnxruntime the reference:

- Weights: the exporter writes them into the model's metadata (key `fastnet`: the network's dimensions and
  its float32 weights in `pack_layout` order, base64). A model without them, a network this module does not
  describe, or a router built without a C compiler (the extension is optional) is served by onnxruntime.
- Checked before it serves: at load, on a fixed set of synthetic decisions (1 to 64 replicas, some
  unhealthy) against the same file's onnxruntime session: the same argmax (or a tie within 1e-4) and
  |logit difference| <= 1e-3 on every healthy replica, or onnxruntime serves and `reason` says why.
  The exporter runs the same check on every export.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping

import numpy as np

from routewise_vllm.router.policy.feature_binding import compiled as _fastnet  # bound to the feature table
from routewise_vllm.router.policy.feature_table import (
    FEATURE_NAMES,
    MODEL_INPUT_NAMES,
    N_FEATURES,
    N_MODEL_INPUTS,
    REPLICA_FEATURES,
)

METADATA_KEY = "fastnet"
LAYOUT_VERSION = 1
PARITY_MAX_DIFF = 1e-3
PARITY_TIE = 1e-4
PARITY_WIDTHS = (1, 2, 3, 5, 8, 16, 33, 64)

_COL = {name: i for i, name in enumerate(FEATURE_NAMES)}
_WAIT_COL = MODEL_INPUT_NAMES.index("expected_wait")  # the wait prior's input


def available() -> bool:
    """Whether the C extension was built."""
    return _fastnet is not None


def pack_layout(hidden: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every array in the weight blob, in order; linear weights are [in, out] (torch's transposed)."""
    h, ff = hidden, 2 * hidden
    out: list[tuple[str, tuple[int, ...]]] = [
        ("normaliser.mean", (N_FEATURES,)), ("normaliser.std", (N_FEATURES,)),
        ("encoder.0.weight", (N_MODEL_INPUTS, h)), ("encoder.0.bias", (h,)),
        ("encoder.2.weight", (h, h)), ("encoder.2.bias", (h,)),
    ]
    for i in range(layers):
        b = f"blocks.{i}."
        out += [
            (b + "norm1.weight", (h,)), (b + "norm1.bias", (h,)), (b + "qkv.weight", (h, 3 * h)), (b + "qkv.bias", (3 * h,)),
            (b + "out.weight", (h, h)), (b + "out.bias", (h,)), (b + "norm2.weight", (h,)), (b + "norm2.bias", (h,)),
            (b + "ff.0.weight", (h, ff)), (b + "ff.0.bias", (ff,)), (b + "ff.2.weight", (ff, h)), (b + "ff.2.bias", (h,)),
        ]
    out += [
        ("final_norm.weight", (h,)), ("final_norm.bias", (h,)), ("policy_head.0.weight", (h, h)), ("policy_head.0.bias", (h,)),
        ("policy_head.2.weight", (h,)), ("policy_head.2.bias", (1,)), ("wait_weight", (1,)),
    ]
    return out


def pack(state: Mapping[str, np.ndarray], hidden: int, heads: int, layers: int) -> str:
    """The metadata value for a RoutingNet's state dict (numpy arrays, torch's names and layouts)."""
    arrays = dict(state)
    arrays["normaliser.std"] = np.sqrt(np.asarray(arrays["normaliser.var"], np.float64) + 1e-8)
    has_prior = arrays.get("wait_weight") is not None
    if not has_prior:
        arrays["wait_weight"] = np.zeros(1)
    parts = []
    for name, shape in pack_layout(hidden, layers):
        a = np.asarray(arrays[name], dtype=np.float64)
        if name.endswith("weight") and a.ndim == 2:
            a = a.T  # torch Linear stores [out, in]
        parts.append(np.ascontiguousarray(a.reshape(shape), dtype=np.float32).ravel())
    blob = np.concatenate(parts).tobytes()
    return json.dumps({"layout": LAYOUT_VERSION, "hidden": hidden, "heads": heads, "layers": layers,
                       "wait_prior": has_prior, "weights": base64.b64encode(blob).decode()}, sort_keys=True)


def _aligned(flat: np.ndarray, sizes: list[int]) -> np.ndarray:
    """The packed arrays as the C code walks them: each padded to a multiple of ALIGN_FLOATS and starting on a
    64-byte boundary (a vector load across two cache lines costs two)."""
    align = _fastnet.ALIGN_FLOATS
    padded = [-(-n // align) * align for n in sizes]
    raw = np.zeros(sum(padded) + 64 // 4, dtype=np.float32)
    skip = (-raw.ctypes.data % 64) // 4
    out = raw[skip: skip + sum(padded)]
    src = dst = 0
    for n, room in zip(sizes, padded):
        out[dst: dst + n] = flat[src: src + n]
        src, dst = src + n, dst + room
    return out


class FastNet:
    """The network of one model file, for one decision at a time: `logits(rows)` for build_features rows."""

    def __init__(self, value: str) -> None:
        doc = json.loads(value)
        if doc.get("layout") != LAYOUT_VERSION:
            raise ValueError(f"weight layout {doc.get('layout')!r}, this router reads {LAYOUT_VERSION}")
        hidden, heads, layers = int(doc["hidden"]), int(doc["heads"]), int(doc["layers"])
        blob = base64.b64decode(doc["weights"])
        layout = pack_layout(hidden, layers)
        expected = sum(int(np.prod(s)) for _, s in layout) * 4
        if len(blob) != expected:
            raise ValueError(f"{len(blob)} bytes of weights, the network's dimensions need {expected}")
        self._weights = _aligned(np.frombuffer(blob, dtype=np.float32), [int(np.prod(s)) for _, s in layout])
        self._dims = (N_FEATURES, N_MODEL_INPUTS, hidden, heads, layers, 2 * hidden, int(bool(doc["wait_prior"])), _WAIT_COL)

    def logits(self, rows: np.ndarray) -> np.ndarray:
        """float32 [R] logits (unhealthy replicas -1e9) for build_features rows float32 [R, N_FEATURES]."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        out = np.empty(rows.shape[0], dtype=np.float32)
        _fastnet.logits(rows, rows.shape[0], self._weights, self._dims, out)
        return out

    def best(self, rows: np.ndarray) -> tuple[int, bool]:
        """(index of the largest logit among healthy rows, -1 if none; whether all healthy logits are finite):
        policy.base.best_of(logits(rows), healthy) in one call, for C-contiguous float32 rows."""
        return _fastnet.best(rows, rows.shape[0], self._weights, self._dims)

    def best_view(self, row_args: tuple) -> tuple[int, bool]:
        """best(build_features(view, request)) with the rows built inside the same C call, no numpy array on the
        way: `row_args` is feature_binding.compiled_row_args(view, request)."""
        return _fastnet.best_view(*row_args, self._weights, self._dims)


def inputs(rows: np.ndarray) -> np.ndarray:
    """model_inputs(rows, healthy column) for one decision, computed by the C code (for tests)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    out = np.empty((rows.shape[0], N_MODEL_INPUTS), dtype=np.float32)
    _fastnet.inputs(rows, rows.shape[0], out)
    return out


def parity_rows(seed: int = 0) -> list[np.ndarray]:
    """Synthetic decisions: build_features-shaped rows of every width in PARITY_WIDTHS, some replicas unhealthy."""
    rng = np.random.default_rng(seed)
    sets = []
    for width in PARITY_WIDTHS:
        for _ in range(4):
            rows = rng.uniform(0.0, 1.2, (width, N_FEATURES)).astype(np.float32)
            rows[:, _COL["present"]] = 1.0
            rows[:, _COL["healthy"]] = (rng.random(width) > 0.2).astype(np.float32)
            rows[:, _COL["prefix_match_frac"]] = rng.uniform(0.0, 1.0, width)  # a share: 0..1
            rows[:, len(REPLICA_FEATURES):] = rows[0, len(REPLICA_FEATURES):]  # the request block is the same on every row
            sets.append(rows)
    return sets


def check(net: FastNet, reference) -> str | None:
    """None if `net` agrees with `reference(rows) -> logits` (onnxruntime) on parity_rows(), else what differs."""
    for rows in parity_rows():
        want = np.asarray(reference(rows), dtype=np.float32)
        got = net.logits(rows)
        valid = rows[:, _COL["healthy"]] > 0.5
        if not valid.any():
            continue
        diff = float(np.abs(got - want)[valid].max())
        if not diff <= PARITY_MAX_DIFF:
            return f"|logit difference| {diff:.3g} > {PARITY_MAX_DIFF} at {len(rows)} replicas"
        a, b = int(np.argmax(np.where(valid, got, -np.inf))), int(np.argmax(np.where(valid, want, -np.inf)))
        if a != b and want[b] - want[a] > PARITY_TIE:
            return f"argmax {a} vs onnxruntime's {b} at {len(rows)} replicas"
    return None


def load(metadata: Mapping[str, str], reference) -> tuple[FastNet | None, str]:
    """(the fast path or None, why) for a model's metadata, checked against `reference(rows) -> logits`."""
    if _fastnet is None:
        return None, "the C extension router.policy._fastnet is not built (no C compiler at install)"
    value = metadata.get(METADATA_KEY)
    if not value:
        return None, f"the model has no '{METADATA_KEY}' weights in its metadata (exported before they were written)"
    try:
        net = FastNet(value)
        problem = check(net, reference)
    except Exception as exc:  # noqa: BLE001 - any problem with the fast path means onnxruntime serves
        return None, f"fast path unusable ({type(exc).__name__}: {exc})"
    if problem is not None:
        return None, f"fast path disagrees with onnxruntime: {problem}"
    return net, "checked against onnxruntime at load"
