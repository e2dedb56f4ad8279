"""Real ONNX files for the serving tests and the latency benchmark, built with `onnx.helper`
(no torch): a linear scorer, faulty variants (NaN, slow, runtime error, wrong spec hash,
corrupt bytes) and a model of the shipped architecture family (per-replica MLP encoder +
cross-replica self-attention + per-replica logit head).

Every model follows router/policy/onnx_policy.py's contract: inputs `features` float32
[batch, replicas, N_MODEL_INPUTS] (`model_inputs`) and `mask` float32 [batch, replicas]; output `logits` float32
[batch, replicas]; masked entries -1e9; metadata `feature_spec_hash` etc.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from routewise_vllm.router.policy.features import MODEL_INPUT_NAMES, FEATURE_SPEC_HASH, FEATURE_VERSION, N_MODEL_INPUTS

OPSET = 17
MASKED_LOGIT = -1e9


def _io() -> tuple[list, list]:
    inputs = [
        helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", "replicas", N_MODEL_INPUTS]),
        helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", "replicas"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "replicas"])]
    return inputs, outputs


def _const(name: str, value) -> onnx.TensorProto:
    arr = np.asarray(value)
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    return numpy_helper.from_array(arr, name)


def _mask_nodes(raw: str) -> tuple[list, list]:
    """logits = where(mask > 0.5, raw, -1e9)."""
    nodes = [
        helper.make_node("Greater", ["mask", "half"], ["valid"]),
        helper.make_node("Where", ["valid", raw, "masked_logit"], ["logits"]),
    ]
    return nodes, [_const("half", np.float32(0.5)), _const("masked_logit", np.float32(MASKED_LOGIT))]


def _save(nodes, inits, path: str | Path, spec_hash: str, version: str) -> Path:
    inputs, outputs = _io()
    graph = helper.make_graph(nodes, "routewise_test_policy", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="routewise-tests")
    model.ir_version = 8
    meta = {
        "feature_spec_hash": spec_hash,
        "feature_version": str(FEATURE_VERSION),
        "policy_version": version,
        "training_config": json.dumps({"builder": "tests/serving/onnx_models.py"}),
    }
    for k, v in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = k, v
    onnx.checker.check_model(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def feature_weights(**by_name: float) -> np.ndarray:
    """A weight vector over the model inputs (MODEL_INPUT_NAMES) (unnamed features weigh 0)."""
    w = np.zeros(N_MODEL_INPUTS, dtype=np.float32)
    for name, value in by_name.items():
        w[MODEL_INPUT_NAMES.index(name)] = value
    return w


def linear_model(path, weights: np.ndarray | None = None, spec_hash: str = FEATURE_SPEC_HASH, version: str = "linear-1") -> Path:
    """logits = features @ weights; the default (-outstanding) behaves like least-outstanding."""
    w = feature_weights(outstanding=-1.0) if weights is None else np.asarray(weights, dtype=np.float32)
    nodes = [
        helper.make_node("MatMul", ["features", "w"], ["score3"]),
        helper.make_node("Squeeze", ["score3", "last_axis"], ["raw"]),
    ]
    inits = [_const("w", w.reshape(N_MODEL_INPUTS, 1)), _const("last_axis", np.array([-1], dtype=np.int64))]
    mn, mi = _mask_nodes("raw")
    return _save(nodes + mn, inits + mi, path, spec_hash, version)


def prefer_replica_model(path, index: int, version: str = "prefer-1") -> Path:
    """Always scores replica `index` highest, whatever the load (a policy that ignores load)."""
    nodes = [
        helper.make_node("Shape", ["mask"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["r"], axis=0),
        helper.make_node("Cast", ["r"], ["r_f"], to=TensorProto.FLOAT),
        helper.make_node("Range", ["zero", "r_f", "step"], ["idx"]),  # 0..R-1
        helper.make_node("Sub", ["idx", "target"], ["d"]),
        helper.make_node("Abs", ["d"], ["ad"]),
        helper.make_node("Neg", ["ad"], ["row"]),  # [R], peak 0 at `index`
        helper.make_node("Mul", ["mask", "zero"], ["zeros"]),  # [B, R]
        helper.make_node("Add", ["zeros", "row"], ["raw"]),
    ]
    inits = [
        _const("one", np.array(1, dtype=np.int64)),
        _const("zero", np.float32(0.0)),
        _const("step", np.float32(1.0)),
        _const("target", np.float32(index)),
    ]
    mn, mi = _mask_nodes("raw")
    return _save(nodes + mn, inits + mi, path, FEATURE_SPEC_HASH, version)


def nan_model(path) -> Path:
    """Valid replicas get NaN logits (what a diverged training run exports)."""
    nodes = [
        helper.make_node("ReduceSum", ["features", "last_axis"], ["s"], keepdims=0),
        helper.make_node("Mul", ["s", "nan"], ["raw"]),
    ]
    inits = [_const("last_axis", np.array([-1], dtype=np.int64)), _const("nan", np.float32(np.nan))]
    mn, mi = _mask_nodes("raw")
    return _save(nodes + mn, inits + mi, path, FEATURE_SPEC_HASH, "nan-1")


def slow_model(path, size: int = 384, depth: int = 6) -> Path:
    """A least-outstanding scorer plus `depth` input-dependent size x size MatMuls whose result
    is multiplied by zero: right answers, far over a sub-millisecond budget."""
    rng = np.random.default_rng(0)
    c = (rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceSum", ["features"], ["total"], keepdims=0),  # scalar from the input
        helper.make_node("Mul", ["c", "total"], ["m0"]),
    ]
    for i in range(depth):
        nodes += [
            helper.make_node("MatMul", [f"m{i}", "c"], [f"p{i}"]),
            helper.make_node("Tanh", [f"p{i}"], [f"m{i + 1}"]),
        ]
    nodes += [
        helper.make_node("ReduceSum", [f"m{depth}"], ["junk"], keepdims=0),
        helper.make_node("Mul", ["junk", "zero"], ["nothing"]),
        helper.make_node("MatMul", ["features", "w"], ["score3"]),
        helper.make_node("Squeeze", ["score3", "last_axis"], ["score"]),
        helper.make_node("Add", ["score", "nothing"], ["raw"]),
    ]
    inits = [
        _const("c", c),
        _const("zero", np.float32(0.0)),
        _const("w", feature_weights(outstanding=-1.0).reshape(N_MODEL_INPUTS, 1)),
        _const("last_axis", np.array([-1], dtype=np.int64)),
    ]
    mn, mi = _mask_nodes("raw")
    return _save(nodes + mn, inits + mi, path, FEATURE_SPEC_HASH, "slow-1")


def fixed_width_model(path, replicas: int = 4) -> Path:
    """Reshapes its input to a fixed replica count: onnxruntime raises at run time for any other width."""
    nodes = [
        helper.make_node("Reshape", ["features", "fixed_shape"], ["f"]),
        helper.make_node("MatMul", ["f", "w"], ["score3"]),
        helper.make_node("Squeeze", ["score3", "last_axis"], ["raw"]),
    ]
    inits = [
        _const("fixed_shape", np.array([1, replicas, N_MODEL_INPUTS], dtype=np.int64)),
        _const("w", feature_weights(outstanding=-1.0).reshape(N_MODEL_INPUTS, 1)),
        _const("last_axis", np.array([-1], dtype=np.int64)),
    ]
    mn, mi = _mask_nodes("raw")
    return _save(nodes + mn, inits + mi, path, FEATURE_SPEC_HASH, "fixed-width-1")


def corrupt_file(path, source: Path | None = None) -> Path:
    """Bytes that are not an ONNX model: a truncated real model when `source` is given."""
    path = Path(path)
    data = source.read_bytes()[: len(source.read_bytes()) // 3] if source is not None else b"\x08\x07not an onnx model\xff\xfe"
    path.write_bytes(data)
    return path


# ---- the shipped architecture family, for the latency benchmark -------------------------------------------


class _G:
    def __init__(self, rng: np.random.Generator) -> None:
        self.nodes: list = []
        self.inits: list = []
        self.rng = rng
        self.n = 0

    def name(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}_{self.n}"

    def const(self, value, prefix: str = "c") -> str:
        name = self.name(prefix)
        self.inits.append(_const(name, value))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def linear(self, x: str, n_in: int, n_out: int) -> str:
        w = (self.rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
        b = (0.01 * self.rng.standard_normal(n_out)).astype(np.float32)
        return self.op("Add", [self.op("MatMul", [x, self.const(w, "w")]), self.const(b, "b")])

    def gelu(self, x: str) -> str:  # exact GELU as torch exports it at opset 17: x * 0.5 * (1 + erf(x / sqrt 2))
        e = self.op("Erf", [self.op("Div", [x, self.const(np.float32(np.sqrt(2.0)))])])
        return self.op("Mul", [self.op("Mul", [x, self.op("Add", [e, self.const(np.float32(1.0))])]), self.const(np.float32(0.5))])

    def layer_norm(self, x: str, width: int) -> str:
        return self.op("LayerNormalization", [x, self.const(np.ones(width, np.float32)), self.const(np.zeros(width, np.float32))], axis=-1, epsilon=1e-5)


def attention_model(path, hidden: int = 64, heads: int = 4, layers: int = 2, seed: int = 0, version: str = "attn-bench-1") -> Path:
    """Random weights, the trainer's architecture: normalise -> MLP encoder -> `layers` pre-norm
    self-attention blocks with key masking -> final norm -> MLP head -> masked logits."""
    g = _G(np.random.default_rng(seed))
    d = hidden // heads
    mean = g.const(np.zeros(N_MODEL_INPUTS, np.float32))
    std = g.const(np.ones(N_MODEL_INPUTS, np.float32))
    x = g.op("Clip", [g.op("Div", [g.op("Sub", ["features", mean]), std]), g.const(np.float32(-10)), g.const(np.float32(10))])
    h = g.linear(g.gelu(g.linear(x, N_MODEL_INPUTS, hidden)), hidden, hidden)
    # key bias [B, 1, 1, R]: 0 for valid keys, -1e9 for masked ones
    bias = g.op("Mul", [g.op("Sub", [g.const(np.float32(1.0)), "mask"]), g.const(np.float32(MASKED_LOGIT))])
    bias = g.op("Unsqueeze", [bias, g.const(np.array([1, 2], np.int64))])
    split_shape = g.const(np.array([0, 0, heads, d], np.int64))
    merge_shape = g.const(np.array([0, 0, hidden], np.int64))
    for _ in range(layers):
        n1 = g.layer_norm(h, hidden)
        q, k, v = (g.op("Transpose", [g.op("Reshape", [g.linear(n1, hidden, hidden), split_shape])], perm=[0, 2, 1, 3]) for _ in range(3))
        kt = g.op("Transpose", [k], perm=[0, 1, 3, 2])
        scores = g.op("Add", [g.op("Div", [g.op("MatMul", [q, kt]), g.const(np.float32(np.sqrt(d)))]), bias])
        ctx = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
        ctx = g.op("Reshape", [g.op("Transpose", [ctx], perm=[0, 2, 1, 3]), merge_shape])
        h = g.op("Add", [h, g.linear(ctx, hidden, hidden)])
        ff = g.linear(g.gelu(g.linear(g.layer_norm(h, hidden), hidden, 2 * hidden)), 2 * hidden, hidden)
        h = g.op("Add", [h, ff])
    h = g.layer_norm(h, hidden)
    raw = g.op("Squeeze", [g.linear(g.gelu(g.linear(h, hidden, hidden)), hidden, 1), g.const(np.array([-1], np.int64))])
    mn, mi = _mask_nodes(raw)
    return _save(g.nodes + mn, g.inits + mi, path, FEATURE_SPEC_HASH, version)


def pooled_model(path, hidden: int = 64, layers: int = 2, seed: int = 0, version: str = "pooled-bench-1") -> Path:
    """An O(replicas) alternative to self-attention, for latency comparisons: each block mixes every
    replica's embedding with the masked mean and max of all of them (DeepSets-style), still
    permutation-equivariant and width-agnostic."""
    g = _G(np.random.default_rng(seed))
    x = g.op("Clip", [g.op("Div", [g.op("Sub", ["features", g.const(np.zeros(N_MODEL_INPUTS, np.float32))]),
                                   g.const(np.ones(N_MODEL_INPUTS, np.float32))]), g.const(np.float32(-10)), g.const(np.float32(10))])
    h = g.linear(g.gelu(g.linear(x, N_MODEL_INPUTS, hidden)), hidden, hidden)
    m3 = g.op("Unsqueeze", ["mask", g.const(np.array([-1], np.int64))])  # [B, R, 1]
    count = g.op("Max", [g.op("ReduceSum", [m3, g.const(np.array([1], np.int64))], keepdims=1), g.const(np.float32(1.0))])
    neg = g.op("Mul", [g.op("Sub", [g.const(np.float32(1.0)), m3]), g.const(np.float32(-1e4))])
    for _ in range(layers):
        n1 = g.layer_norm(h, hidden)
        mean = g.op("Div", [g.op("ReduceSum", [g.op("Mul", [n1, m3]), g.const(np.array([1], np.int64))], keepdims=1), count])
        mx = g.op("ReduceMax", [g.op("Add", [n1, neg])], axes=[1], keepdims=1)
        ctx = g.op("Add", [g.linear(mean, hidden, hidden), g.linear(mx, hidden, hidden)])  # [B, 1, H], broadcast
        h = g.op("Add", [h, g.linear(g.gelu(g.op("Add", [g.linear(n1, hidden, 2 * hidden), g.linear(ctx, hidden, 2 * hidden)])),
                                     2 * hidden, hidden)])
    h = g.layer_norm(h, hidden)
    raw = g.op("Squeeze", [g.linear(g.gelu(g.linear(h, hidden, hidden)), hidden, 1), g.const(np.array([-1], np.int64))])
    mn, mi = _mask_nodes(raw)
    return _save(g.nodes + mn, g.inits + mi, path, FEATURE_SPEC_HASH, version)
